"""Many adapters over one base: `LoraBank`, `bank`, `unbank`, `per_example`.

A bank holds ``N`` LoRA adapters of one weight over a single shared base weight: the
factors of every adapter stacked along a leading *adapter axis* (zero-padded to a common
rank), one ``alpha`` and one rank per adapter. It stands for the stack of the ``N``
merged weights (``bank.materialize()[i]`` is adapter ``i`` merged into the base), but the
base is stored once, and may be dense or any `qax.quant` format.

`per_example` runs unchanged model code on a batch whose examples each use their own
adapter: every example sees the model's parameters with its adapter's `LoraWeight`
(`jax.vmap` over the examples; the base is not mapped, so ``x @ w`` stays one product for
the whole batch and only the thin factors are gathered per example, the BGMV pattern of
multi-LoRA servers).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax

from ._dora import DoraAdapter, DoraBase, DoraWeight
from ._weight import LoraAdapter, LoraWeight, _batch_ndim, _layout

_NO_ADAPTERS = (
    "qax.lora.bank: no adapters given. Pass a list of adapter trees, one per fine-tune, "
    "as `qax.lora.split` returns them: `adapters, base = qax.lora.split(params)`."
)

_NOT_SPLIT = (
    "qax.lora.bank: adapter {i} holds a LoraWeight at {path}: pass the adapters of "
    "`qax.lora.split` (`adapters, base = qax.lora.split(params)`), not the combined "
    "parameters."
)

_MISMATCH = (
    "qax.lora.bank: adapter {i} does not fit the base at {path}: {why}. Every adapter "
    "must be trained on the same base (the `base` of `qax.lora.split`), with the same "
    "layout (`a_axes`, `split_at`, `batch_ndim`) at each weight; only ranks and alphas "
    "may differ."
)

_STRUCTURE = (
    "qax.lora.bank: adapter {i} does not have the structure of `base` ({error}). Pass "
    "the adapters and the base that `qax.lora.split` returns."
)


def _is_bank(x: Any) -> bool:
    return isinstance(x, LoraBank)


class LoraBank(qax.ImplicitArray):
    """``N`` LoRA adapters over one shared base weight.

    Stands for the stack of the ``N`` merged weights, shape ``(N, *w.shape)``: entry
    ``i`` is ``w + (alphas[i] / ranks[i]) * tensordot(a[i], b[i], 1)`` in the layout of a
    `LoraWeight` (``a_axes``, layer stacks). The base ``w`` is stored once. Built by
    `bank`; used through `per_example`, which hands every example its own adapter as a
    `LoraWeight`.

    Examples:
        >>> w = jnp.ones((4, 3))
        >>> lb = qax.lora.LoraBank(w, jnp.ones((2, 4, 1)), jnp.ones((2, 1, 3)),
        ...                        alphas=(1.0, 2.0), ranks=(1, 1))
        >>> lb.shape, float(lb.materialize()[1, 0, 0])
        ((2, 4, 3), 3.0)

    Attributes:
      w: the shared base weight (dense or a `qax.quant` weight; frozen).
      a: the first factors, ``(N, *stack, *A, rank)``; columns past an adapter's own rank
        are zero.
      b: the second factors, ``(N, *stack, rank, *B)``; rows past an adapter's own rank
        are zero.
      alphas: each adapter's ``alpha`` (``None``: ``alpha = rank``, a scale of 1).
      ranks: each adapter's own rank (0: no adapter on this weight for that slot).
      freeze_w: stop gradients into ``w`` (default ``True``).
      a_axes: as for `LoraWeight`.

    ``alphas`` and ``ranks`` are static (part of the tree structure): a jitted function
    retraces when they change, not when factors of the same ranks and alphas are swapped
    in.
    """

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue
    alphas: tuple = qax.aux_field(default=())
    ranks: tuple = qax.aux_field(default=())
    freeze_w: bool = qax.aux_field(default=True)
    a_axes: tuple[int, ...] | None = qax.aux_field(default=None)

    def frozen_fields(self) -> tuple[str, ...]:
        """``("w",)`` when ``freeze_w``: optimizers move only the factors."""
        return ("w",) if self.freeze_w else ()

    def __post_init__(self) -> None:
        n = int(jnp.shape(self.a)[0]) if jnp.ndim(self.a) else 0
        if (
            jnp.ndim(self.a) < 2
            or jnp.ndim(self.b) < 2
            or jnp.shape(self.b)[0] != n
            or len(self.alphas) != n
            or len(self.ranks) != n
        ):
            raise ValueError(
                "LoraBank: `a` and `b` stack N adapters along their first axis, with "
                f"one alpha and one rank each; got a {jnp.shape(self.a)}, b "
                f"{jnp.shape(self.b)}, {len(self.alphas)} alphas, {len(self.ranks)} "
                "ranks."
            )
        self.alphas = tuple(None if x is None else float(x) for x in self.alphas)
        self.ranks = tuple(int(r) for r in self.ranks)
        # The layout check of one adapter (raises LoraWeight's messages), on shapes
        # only (the function closes over nothing of this value's, which may hold
        # tracers).
        a_axes = self.a_axes
        jax.eval_shape(
            lambda w, a, b: LoraWeight(w, a, b, a_axes=a_axes).shape,
            _abstract(self.w),
            jax.ShapeDtypeStruct(jnp.shape(self.a)[1:], self.a.dtype),
            jax.ShapeDtypeStruct(jnp.shape(self.b)[1:], self.b.dtype),
        )
        super().__post_init__()

    def compute_shape(self) -> tuple[int, ...]:
        return (int(jnp.shape(self.a)[0]), *(int(d) for d in jnp.shape(self.w)))

    def compute_dtype(self) -> Any:
        return jnp.result_type(self.w.dtype, self.a.dtype, self.b.dtype)

    @property
    def size_n(self) -> int:
        """The number of adapters, ``N``."""
        return int(jnp.shape(self.a)[0])

    @property
    def rank(self) -> int:
        """The common (padded) rank of the stored factors."""
        return int(jnp.shape(self.a)[-1])

    def scales(self) -> np.ndarray:
        """Each adapter's ``alpha / rank`` (1 where ``alpha`` is None, 0 for an empty
        slot), as float32."""
        return np.asarray(
            [_scale(al, r) for al, r in zip(self.alphas, self.ranks, strict=True)],
            np.float32,
        )

    def adapter(self, i: int) -> LoraWeight:
        """Adapter ``i`` as a `LoraWeight` over the base (its own rank, unpadded)."""
        a, b = _trim(self, self.a[i], self.b[i], self.ranks[i])
        return LoraWeight(
            self.w,
            a,
            b,
            alpha=self.alphas[i],
            freeze_w=self.freeze_w,
            a_axes=self.a_axes,
        )

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Which dimension of the bank (``(N, *w.shape)``) each field dimension runs
        along (for `qax.sharding`): the adapter axis is dimension 0 of ``a`` and
        ``b``; ``w`` runs along the others; the factors' layer-stack axes and weight
        axes as in a `LoraWeight`, their rank axis along none."""
        nb = _nb(self.w, self.a[0], self.b[0])
        n_w = jnp.ndim(self.w) - nb
        a_axes, b_axes = _layout(n_w, jnp.ndim(self.a) - 2 - nb, self.a_axes)
        stack = tuple(range(1, 1 + nb))
        return {
            "w": tuple(range(1, 1 + jnp.ndim(self.w))),
            "a": (0, *stack, *(1 + nb + i for i in a_axes), None),
            "b": (0, *stack, None, *(1 + nb + i for i in b_axes)),
        }

    def materialize(self) -> jax.Array:
        scales = jnp.asarray(self.scales())

        def one(a, b, s):
            return LoraWeight(
                self.w,
                a * s.astype(a.dtype),
                b,
                freeze_w=self.freeze_w,
                a_axes=self.a_axes,
            ).materialize()

        return jax.vmap(one)(self.a, self.b, scales).astype(self.dtype)


class DoraBank(LoraBank):
    """``N`` DoRA adapters over one shared base weight (a `LoraBank` with magnitudes).

    Entry ``i`` of the stack it stands for is adapter ``i``'s `DoraWeight` merged:
    ``m[i] * V_i / ‖V_i‖`` with ``V_i = w + s_i * tensordot(a[i], b[i], 1)``. ``w`` and
    its ``‖w‖²`` (``w_norm2``, frozen) are stored once. Built by `bank` from adapters of
    `DoraWeight`s (`split` gives them as `DoraAdapter`s); `per_example` hands every
    example its adapter as a `DoraWeight` (the base model alone for id ``-1``).

    Examples:
        >>> d = qax.lora.DoraWeight(jnp.ones((4, 3)), jnp.ones((4, 1)), jnp.ones((1, 3)),
        ...                         m=jnp.ones(3))
        >>> adapters, base = qax.lora.split({"w": d})
        >>> db = qax.lora.bank(base, [adapters, adapters])["w"]
        >>> type(db).__name__, db.shape
        ('DoraBank', (2, 4, 3))

    Attributes:
      m: each adapter's magnitude, ``(N, *stack, *B)``.
      w_norm2: ``‖w‖²`` per output unit, ``(*stack, *B)`` (frozen).
    """

    m: qax.ArrayValue = None
    w_norm2: qax.ArrayValue = None

    def frozen_fields(self) -> tuple[str, ...]:
        """``w`` (when ``freeze_w``) and ``w_norm2``."""
        return (*super().frozen_fields(), "w_norm2")

    def __post_init__(self) -> None:
        n = int(jnp.shape(self.a)[0]) if jnp.ndim(self.a) else 0
        if self.m is None or self.w_norm2 is None or jnp.shape(self.m)[:1] != (n,):
            raise ValueError(
                "DoraBank: `m` stacks one magnitude per adapter along its first axis "
                f"(N={n}) and `w_norm2` is the base's ‖w‖²; got m "
                f"{None if self.m is None else jnp.shape(self.m)}, w_norm2 "
                f"{None if self.w_norm2 is None else jnp.shape(self.w_norm2)}."
            )
        super().__post_init__()

    def adapter(self, i: int) -> DoraWeight:
        """Adapter ``i`` as a `DoraWeight` over the base (its own rank, unpadded)."""
        lw = super().adapter(i)
        return DoraWeight(
            lw.w,
            lw.a,
            lw.b,
            m=self.m[i],
            w_norm2=self.w_norm2,
            alpha=lw.alpha,
            a_axes=self.a_axes,
        )

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """As `LoraBank`; ``m`` along the adapter axis and the output axes, ``w_norm2``
        along the output axes."""
        dims = super().field_dims()
        nb = _nb(self.w, self.a[0], self.b[0])
        b_dims = dims["b"][2 + nb :]
        stack = tuple(range(1, 1 + nb))
        return {**dims, "m": (0, *stack, *b_dims), "w_norm2": (*stack, *b_dims)}

    def materialize(self) -> jax.Array:
        scales = jnp.asarray(self.scales())

        def one(a, b, m, s):
            return DoraWeight(
                self.w,
                a * s.astype(a.dtype),
                b,
                m=m,
                w_norm2=self.w_norm2,
                a_axes=self.a_axes,
            ).materialize()

        return jax.vmap(one)(self.a, self.b, self.m, scales).astype(self.dtype)


def _abstract(x: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda v: jax.ShapeDtypeStruct(jnp.shape(v), v.dtype), x
    )


def _scale(alpha: float | None, rank: int) -> float:
    if rank == 0:
        return 0.0
    return 1.0 if alpha is None else alpha / rank


def _nb(w: Any, a: Any, b: Any) -> int:
    """Layer-stack axes of one adapter's factors (``batch_ndim`` of `loraify`)."""
    return _batch_ndim(jnp.ndim(w), jnp.ndim(a), jnp.ndim(b))


def _trim(bank: LoraBank, a: Any, b: Any, rank: int) -> tuple[Any, Any]:
    """One adapter's factors without the zero padding past its rank."""
    nb = _nb(bank.w, a, b)
    return a[..., :rank], jax.lax.slice_in_dim(b, 0, rank, axis=nb)


def _pad(x: Any, axis: int, to: int) -> Any:
    width = [(0, 0)] * jnp.ndim(x)
    width[axis] = (0, to - jnp.shape(x)[axis])
    return jnp.pad(x, width)


# ----------------------------------------------------------------------------------------
# Building and splitting banks


def bank(base: Any, adapters: Sequence[Any] | Mapping[Any, Any]) -> Any:
    """Put many adapters on one base: a `LoraBank` at every adapted weight.

    The adapters are trees from `qax.lora.split` (one per fine-tune, each trained on
    ``base``): a `LoraAdapter` or ``None`` at each weight. Adapter ``i`` (its position in
    the list, or in the mapping's order) is id ``i`` for `per_example`. Adapters of
    different ranks share one bank: the factors are zero-padded to the largest rank and
    each keeps its own scale ``alpha / rank``, so no number changes (`bank_padding`
    reports what the padding costs). A weight that some adapters leave alone gets an
    empty slot for them (rank 0: the base weight alone).

    Differentiable in the factors: building the bank inside a loss, from adapters that
    an optimizer trains, trains them all in one step (see `per_example`).

    Examples:
        >>> adapters, base = qax.lora.split(params)
        >>> served = qax.lora.bank(base, [adapters, other_adapters])
        >>> logits = qax.lora.per_example(model.apply)(jnp.array([1, 0, -1]), served, x)

    Args:
      base: the base parameters (the second result of `qax.lora.split`); weights may be
        quantized (`qax.quant`).
      adapters: a non-empty list (or mapping) of adapter trees from `qax.lora.split`.

    Returns:
      ``base`` with a `LoraBank` in place of each weight that any adapter adapts.

    Raises:
      ValueError: no adapters; an adapter tree does not have the base's structure, or
        holds combined `LoraWeight`s; an adapter's layout does not fit its weight.
    """
    if isinstance(adapters, Mapping):
        adapters = list(adapters.values())
    adapters = list(adapters)
    if not adapters:
        raise ValueError(_NO_ADAPTERS)

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, (*_ADAPTERS, qax.ImplicitArray))

    def is_weight(x: Any) -> bool:
        return isinstance(x, (qax.ImplicitArray, DoraBase))

    base_paths, treedef = jax.tree_util.tree_flatten_with_path(base, is_leaf=is_weight)
    columns = []
    for i, tree in enumerate(adapters):
        try:
            column = treedef.flatten_up_to(tree)
        except (ValueError, TypeError) as e:
            raise ValueError(_STRUCTURE.format(i=i, error=e)) from None
        for j, ((path, _), x) in enumerate(zip(base_paths, column, strict=True)):
            if isinstance(x, qax.ImplicitArray):
                raise ValueError(
                    _NOT_SPLIT.format(i=i, path=qax.utils.path_string(path))
                )
            if x is not None and not isinstance(x, _ADAPTERS):
                # A subtree where base has a leaf: not an adapter tree.
                found = jax.tree_util.tree_leaves(x, is_leaf=is_leaf)
                if any(f is not None for f in found):
                    raise ValueError(
                        _STRUCTURE.format(
                            i=i,
                            error=f"{type(x).__name__} at "
                            f"{qax.utils.path_string(path)}, not an adapter or None",
                        )
                    )
                column[j] = None
        columns.append(column)

    leaves = []
    for j, (path, w) in enumerate(base_paths):
        found = [column[j] for column in columns]
        if all(x is None for x in found):
            leaves.append(w)
            continue
        leaves.append(_bank_one(qax.utils.path_string(path), w, found))
    return jax.tree_util.tree_unflatten(treedef, leaves)


_ADAPTERS = (LoraAdapter, DoraAdapter)


def _bank_one(path: str, w: Any, found: list) -> LoraBank:
    given = [(i, x) for i, x in enumerate(found) if isinstance(x, _ADAPTERS)]
    i0, first = given[0]
    dora = isinstance(first, DoraAdapter)
    if any(isinstance(x, DoraAdapter) != dora for _, x in given) or (
        isinstance(w, DoraBase) != dora
    ):
        raise ValueError(
            _MISMATCH.format(
                i=i0,
                path=path,
                why="LoRA and DoRA adapters (or a DoRA adapter and a LoRA base) at "
                "one weight; a bank holds one kind",
            )
        )
    if dora:
        return _dora_bank_one(path, w, found)
    for i, x in given:
        why = None
        freeze = (getattr(x, "freeze_w", True), getattr(first, "freeze_w", True))
        if x.a_axes != first.a_axes or freeze[0] != freeze[1]:
            why = (
                f"a_axes={x.a_axes}, freeze_w={freeze[0]} where adapter {i0} has "
                f"a_axes={first.a_axes}, freeze_w={freeze[1]}"
            )
        else:
            try:
                LoraWeight(_abstract_array(w), x.a, x.b, a_axes=x.a_axes)
            except ValueError as e:
                why = str(e)
        if why is None and (
            jnp.shape(x.a)[:-1] != jnp.shape(first.a)[:-1]
            or _drop_rank(x, w) != _drop_rank(first, w)
        ):
            why = f"factors a {jnp.shape(x.a)}, b {jnp.shape(x.b)}"
        if why is not None:
            raise ValueError(_MISMATCH.format(i=i, path=path, why=why))
    nb = _nb(w, first.a, first.b)
    ranks = [0 if x is None else int(jnp.shape(x.a)[-1]) for x in found]
    top = max(ranks)
    dtype_a = jnp.result_type(*(x.a.dtype for _, x in given))
    dtype_b = jnp.result_type(*(x.b.dtype for _, x in given))
    zero_a = jnp.zeros((*jnp.shape(first.a)[:-1], top), dtype_a)
    zero_b = jnp.zeros(
        (*jnp.shape(first.b)[:nb], top, *jnp.shape(first.b)[nb + 1 :]), dtype_b
    )
    a = jnp.stack(
        [zero_a if x is None else _pad(x.a.astype(dtype_a), -1, top) for x in found]
    )
    b = jnp.stack(
        [zero_b if x is None else _pad(x.b.astype(dtype_b), nb, top) for x in found]
    )
    alphas = [None if x is None else x.alpha for x in found]
    return LoraBank(
        w,
        a,
        b,
        alphas=tuple(alphas),
        ranks=tuple(ranks),
        freeze_w=getattr(first, "freeze_w", True),
        a_axes=first.a_axes,
    )


def _dora_bank_one(path: str, base: DoraBase, found: list) -> DoraBank:
    """A `DoraBank`: the factors banked as for LoRA, the magnitudes stacked (an
    empty slot gets the base's own norm: its weight is the base)."""
    plain = [
        None if x is None else LoraAdapter(x.a, x.b, alpha=x.alpha, a_axes=x.a_axes)
        for x in found
    ]
    lb = _bank_one(path, base.w, plain)
    norm = jnp.sqrt(base.w_norm2)
    m = jnp.stack([norm if x is None else jnp.asarray(x.m, norm.dtype) for x in found])
    return DoraBank(
        lb.w,
        lb.a,
        lb.b,
        alphas=lb.alphas,
        ranks=lb.ranks,
        a_axes=lb.a_axes,
        m=m,
        w_norm2=base.w_norm2,
    )


def _abstract_array(w: Any) -> Any:
    """A stand-in for `w` with its shape, for the layout check (no data is touched)."""
    return jax.ShapeDtypeStruct(jnp.shape(w), jnp.dtype(w.dtype))


def _drop_rank(x: LoraAdapter, w: Any) -> tuple:
    nb = _nb(w, x.a, x.b)
    shape = tuple(jnp.shape(x.b))
    return shape[:nb] + shape[nb + 1 :]


def unbank(params: Any) -> tuple[Any, list]:
    """Inverse of `bank`: ``(base, [adapters, ...])``, one adapter tree per slot.

    Each adapter tree is what `qax.lora.split` gave for that fine-tune (its own rank,
    its ``alpha``; ``None`` at weights it left alone), so ``qax.lora.combine(adapters[i],
    base)`` is that fine-tune's model.

    Examples:
        >>> base, adapters = qax.lora.unbank(served)
        >>> tuned = qax.lora.combine(adapters[1], base)

    Args:
      params: parameters holding `LoraBank`s (all of the same size ``N``).

    Returns:
      ``(base, adapters)``: the base parameters and a list of ``N`` adapter trees.

    Raises:
      ValueError: no bank in ``params``, or banks of different sizes.
    """
    n = _bank_size(params, "qax.lora.unbank")

    def base_of(x: Any) -> Any:
        if isinstance(x, DoraBank):
            return DoraBase(x.w, x.w_norm2)
        return x.w if _is_bank(x) else x

    def adapter_of(i: int) -> Callable[[Any], Any]:
        def one(x: Any) -> Any:
            if not _is_bank(x) or x.ranks[i] == 0:
                return None
            a, b = _trim(x, x.a[i], x.b[i], x.ranks[i])
            if isinstance(x, DoraBank):
                return DoraAdapter(a, b, x.m[i], alpha=x.alphas[i], a_axes=x.a_axes)
            return LoraAdapter(
                a, b, alpha=x.alphas[i], freeze_w=x.freeze_w, a_axes=x.a_axes
            )

        return one

    def is_weight(x: Any) -> bool:
        return isinstance(x, qax.ImplicitArray)

    base = jax.tree_util.tree_map(base_of, params, is_leaf=is_weight)
    adapters = [
        jax.tree_util.tree_map(adapter_of(i), params, is_leaf=is_weight)
        for i in range(n)
    ]
    return base, adapters


def _banks(tree: Any) -> list[tuple[str, LoraBank]]:
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_bank)[0]
    return [(qax.utils.path_string(p), x) for p, x in found if _is_bank(x)]


def _bank_size(params: Any, who: str) -> int:
    banks = _banks(params)
    if not banks:
        raise ValueError(
            f"{who}: no LoraBank in the parameters. Build them with "
            "`qax.lora.bank(base, [adapters, ...])`."
        )
    sizes = {x.size_n for _, x in banks}
    if len(sizes) != 1:
        listed = ", ".join(f"{p}: {x.size_n}" for p, x in banks)
        raise ValueError(
            f"{who}: the banks hold different numbers of adapters ({listed})."
        )
    return sizes.pop()


@dataclasses.dataclass(frozen=True)
class BankPaddingRow:
    """One bank's padding: its path, the adapters' ranks, and the factor numbers stored
    and used."""

    path: str
    ranks: tuple[int, ...]
    stored: int
    used: int
    itemsize: int

    @property
    def wasted_bytes(self) -> int:
        return (self.stored - self.used) * self.itemsize


@dataclasses.dataclass(frozen=True)
class BankPadding:
    """What padding the adapters of a bank to a common rank costs (see `bank_padding`).

    ``stored`` and ``used`` count factor numbers (``a`` and ``b``) over all banks;
    ``wasted_bytes`` is the memory the zero padding takes, ``fraction`` its share of the
    stored factors. ``str()`` gives a table, one row per bank.
    """

    rows: tuple[BankPaddingRow, ...]

    @property
    def stored(self) -> int:
        return sum(r.stored for r in self.rows)

    @property
    def used(self) -> int:
        return sum(r.used for r in self.rows)

    @property
    def wasted_bytes(self) -> int:
        return sum(r.wasted_bytes for r in self.rows)

    @property
    def fraction(self) -> float:
        return 0.0 if not self.stored else 1.0 - self.used / self.stored

    def __str__(self) -> str:
        lines = [f"{'weight':<40} {'ranks':<24} {'stored':>10} {'padding':>10}"]
        for r in self.rows:
            ranks = ",".join(map(str, r.ranks))
            if len(ranks) > 24:
                ranks = ranks[:21] + "..."
            lines.append(
                f"{r.path:<40} {ranks:<24} {r.stored:>10} {r.stored - r.used:>10}"
            )
        lines.append(
            f"padding: {self.stored - self.used} of {self.stored} factor numbers "
            f"({100 * self.fraction:.1f}%), {self.wasted_bytes} bytes"
        )
        return "\n".join(lines)


def bank_padding(params: Any) -> BankPadding:
    """The cost of storing adapters of different ranks at one common rank.

    Examples:
        >>> report = qax.lora.bank_padding(served)
        >>> report.fraction, report.wasted_bytes
        (0.25, 3072)

    Args:
      params: parameters holding `LoraBank`s.

    Returns:
      A `BankPadding` (per-bank rows and totals; ``print`` it for a table).
    """
    rows = []
    for path, x in _banks(params):
        per_rank = (math.prod(jnp.shape(x.a)) + math.prod(jnp.shape(x.b))) // (
            x.size_n * max(x.rank, 1)
        )
        stored = per_rank * x.size_n * x.rank
        used = per_rank * sum(x.ranks)
        rows.append(
            BankPaddingRow(path, x.ranks, stored, used, jnp.dtype(x.a.dtype).itemsize)
        )
    return BankPadding(tuple(rows))
