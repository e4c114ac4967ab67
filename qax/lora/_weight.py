"""The `LoraWeight` type and its handlers (see `qax.lora`).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import qax

_BAD_FACTORS = (
    "LoraWeight: the factors do not fit the weight. For `w` of shape (*A, *B), `a` must "
    "have shape (*A, rank) and `b` shape (rank, *B); got w {w}, a {a}, b {b}. "
    "(For a Flax kernel of shape (in, out): a (in, rank), b (rank, out).)"
)


_BAD_AXES = (
    "LoraWeight: a_axes={axes} for a weight of shape {w}: it must name {n} distinct "
    "axes of one (unbatched) weight, in -{k}..{top}, one for each axis of `a` before "
    "the rank (a {a})."
)

_AXES_MISFIT = (
    "LoraWeight: the factors do not fit the weight with a_axes={axes}: `a` must have "
    "shape (*(w.shape[i] for i in a_axes), rank) and `b` shape (rank, *(the other axes "
    "of w, in order)); got w {w}, a {a}, b {b}."
)


_BATCHED_BASE = (
    "LoraWeight: `w` is a {cls} of shape {w} with {k} batch dimension(s), but the "
    "factors stack {nb} weight(s) along {nb} leading dimension(s) (a {a}, b {b}). A "
    "stacked LoraWeight needs a `w` stacked the same way, so that slicing a layer "
    "slices both. {fix}"
)

# The fix, by which side stacks fewer layers than the other.
_STACK_THE_FACTORS = (
    "The base was quantized per layer (batch_ndim={k}): give the factors the same "
    "stack, `qax.lora.loraify(..., batch_ndim={k})` (the `batch_ndim` of `quantize`)."
)
_STACK_THE_BASE = (
    "For a quantized stack, quantize each layer on its own: "
    "`qax.quant.quantize(params, ..., batch_ndim={nb})`, then "
    "`qax.lora.loraify(..., batch_ndim={nb})`."
)


_STACK_ADVICE = (
    "for layers stacked along a leading axis (`nnx.vmap`/`nnx.scan` layers, linen "
    "`nn.scan`, weights stacked for `lax.scan`), build the LoRA weights with that axis "
    "as a batch axis, `qax.lora.loraify(params, ..., batch_ndim=1)` (over a quantized "
    "base, quantize with `qax.quant.quantize(params, ..., batch_ndim=1)` first), so "
    "that each layer gets its own factors. Without it, one LoraWeight spans the whole "
    "stack, its `b` shared by every layer."
)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in jnp.shape(x))


def _batch_ndim(w_ndim: int, a_ndim: int, b_ndim: int) -> int:
    """Leading axes shared by all three fields (a stack of LoRA weights)."""
    return a_ndim + b_ndim - 2 - w_ndim


class LoraWeight(qax.ImplicitArray):
    """The weight ``w + (alpha / rank) * tensordot(a, b, 1)``, stored as its factors.

    ``w`` has shape ``(*A, *B)``, ``a`` shape ``(*A, rank)``, ``b`` shape ``(rank, *B)``
    (see the module docstring for the layouts of Flax and Equinox weights). With
    ``a_axes``, ``A`` may be any axes of ``w``: ``a`` runs along ``w``'s axes ``a_axes``
    (in that order), ``b`` along the others (in ``w``'s order), as PEFT and qwix lay out
    adapters on einsum kernels: for a query kernel ``(heads, d_model, head_dim)``,
    ``a_axes=(1,)`` gives ``a (d_model, rank)`` and ``b (rank, heads, head_dim)``. ``w`` may
    itself be an implicit array, e.g. a `qax.quant.NF4Weight` (QLoRA). The dtype is what
    JAX's type promotion gives for ``w``, ``a`` and ``b``.

    Examples:
        >>> w = jnp.ones((4, 3)); a = jnp.ones((4, 2)); b = jnp.zeros((2, 3))
        >>> lora = qax.lora.LoraWeight(w, a, b, alpha=4.0)
        >>> qax.use_implicit_args(lambda x, w: x @ w)(jnp.ones((5, 4)), lora).shape
        (5, 3)

    Attributes:
      w: the base weight (frozen).
      a: the first factor, ``(*A, rank)``.
      b: the second factor, ``(rank, *B)``; zero at initialisation in `loraify`.
      alpha: the LoRA scale numerator: the update is scaled by ``alpha / rank``
        (``None``: ``alpha = rank``, a scale of 1).
      freeze_w: stop gradients into ``w`` (default ``True``).
      a_axes: the axes of (one unbatched) ``w`` that ``a`` runs along, in ``a``'s order;
        ``b`` runs along the rest. ``None`` (the default): ``w``'s leading axes, as many
        as ``a`` has before the rank. Stored as ``None`` when it names exactly those.

    Leading axes shared by ``w``, ``a`` and ``b`` beyond what the layout needs stack
    independent weights (layers stacked for `lax.scan`): ``w (L, *A, *B)``, ``a (L,
    *A, rank)``, ``b (L, rank, *B)`` is a stack of ``L`` weights, which `lax.scan` and
    `vmap` slice without forming them. The attributes ``w_ndim``, ``a_ndim`` and
    ``b_ndim`` (set from the shapes, not arguments) hold the ranks of one unbatched
    ``w``, ``a`` and ``b``; they are the fields' declared ranks
    (``qax.array_field(ndim="w_ndim")``).

    Raises:
      ValueError: the shapes of ``w``, ``a`` and ``b`` do not fit together, or
        ``a_axes`` does not name distinct axes of ``w``.
    """

    w: qax.ArrayValue = qax.array_field(ndim="w_ndim")
    a: qax.ArrayValue = qax.array_field(ndim="a_ndim")
    b: qax.ArrayValue = qax.array_field(ndim="b_ndim")
    alpha: float | None = qax.aux_field(default=None)
    freeze_w: bool = qax.aux_field(default=True)
    # The ranks of one (unbatched) w, a and b, set from the shapes of the fields:
    # leading axes shared by all three beyond them are batch axes (a stack of LoRA
    # weights, sliced by `lax.scan` and `vmap`).
    w_ndim: int | None = qax.aux_field(default=None, init=False)
    a_ndim: int | None = qax.aux_field(default=None, init=False)
    b_ndim: int | None = qax.aux_field(default=None, init=False)
    # Last, so that checkpoint descriptions saved before it existed still rebuild.
    a_axes: tuple[int, ...] | None = qax.aux_field(default=None)

    # What `vmap`/`lax.scan` warnings tell a user whose LoraWeight lacks a batch axis.
    batch_axes_advice = _STACK_ADVICE

    def frozen_fields(self) -> tuple[str, ...]:
        """``("w",)`` when ``freeze_w``: `qax.utils.apply_updates` and
        `qax.nnx.Optimizer` then never move the base weight (weight decay included)."""
        return ("w",) if self.freeze_w else ()

    def __post_init__(self) -> None:
        w, a, b = _shape(self.w), _shape(self.a), _shape(self.b)
        nb = _batch_ndim(len(w), len(a), len(b))
        ok = nb >= 0 and len(a) - nb >= 2 and len(b) - nb >= 2
        given = self.a_axes
        if ok and given is not None:
            self.a_axes = _checked_axes(given, w, a, nb)
        if ok:
            core_a, core_b = a[nb:], b[nb:]
            a_axes, b_axes = _layout(len(w) - nb, len(core_a) - 1, self.a_axes)
            ok = (
                w[:nb] == a[:nb] == b[:nb]
                and core_a[-1] == core_b[0]
                and core_a[:-1] == tuple(w[nb + i] for i in a_axes)
                and core_b[1:] == tuple(w[nb + i] for i in b_axes)
            )
        if not ok:
            template = _BAD_FACTORS if given is None else _AXES_MISFIT
            raise ValueError(template.format(w=w, a=a, b=b, axes=given))
        k = qax.utils.batch_ndim(self.w)
        if isinstance(self.w, qax.ImplicitArray) and k is not None and k != nb:
            fix = (_STACK_THE_FACTORS if nb < k else _STACK_THE_BASE).format(k=k, nb=nb)
            raise ValueError(
                _BATCHED_BASE.format(
                    cls=type(self.w).__name__, w=w, k=k, nb=nb, a=a, b=b, fix=fix
                )
            )
        if self.alpha is not None:
            object.__setattr__(self, "alpha", float(self.alpha))
        self.w_ndim, self.a_ndim, self.b_ndim = len(w) - nb, len(a) - nb, len(b) - nb
        super().__post_init__()

    def compute_shape(self) -> tuple[int, ...]:
        return _shape(self.w)

    def compute_dtype(self) -> Any:
        return jnp.result_type(self.w.dtype, self.a.dtype, self.b.dtype)

    @property
    def rank(self) -> int:
        """The inner dimension of the factors."""
        return int(
            jnp.shape(self.b)[_batch_ndim(self.w.ndim, self.a.ndim, self.b.ndim)]
        )

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor applied to ``a @ b``."""
        return 1.0 if self.alpha is None else self.alpha / self.rank

    def base(self) -> Any:
        """``w``, behind `jax.lax.stop_gradient` if ``freeze_w``, cast to ``dtype``."""
        w = lax.stop_gradient(self.w) if self.freeze_w else self.w
        return w if w.dtype == self.dtype else w.astype(self.dtype)

    def axes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The axes of one (unbatched) weight that ``a`` and ``b`` run along (each in
        its factor's order)."""
        nb = _batch_ndim(self.w.ndim, self.a.ndim, self.b.ndim)
        return _layout(self.w.ndim - nb, self.a.ndim - nb - 1, self.a_axes)

    def delta(self) -> jax.Array:
        """The dense update ``(alpha / rank) * tensordot(a, b, 1)`` (for `merge`), laid
        out like ``w``."""
        nb = _batch_ndim(self.w.ndim, self.a.ndim, self.b.ndim)
        lead, rank = _shape(self.a)[:nb], self.rank
        a_core, b_core = _shape(self.a)[nb:-1], _shape(self.b)[nb + 1 :]
        a = jnp.reshape(self.a, (*lead, math.prod(a_core), rank))
        b = jnp.reshape(self.b, (*lead, rank, math.prod(b_core)))
        ab = jnp.reshape(jnp.matmul(a * self.scale, b), (*lead, *a_core, *b_core))
        if self.a_axes is not None:
            order = [*self.a_axes, *self.axes()[1]]
            ab = lax.transpose(
                ab, (*range(nb), *(nb + order.index(i) for i in range(len(order))))
            )
        return ab.astype(self.dtype)

    def materialize(self) -> jax.Array:
        return self.base() + self.delta()

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Which dimension of the weight each field dimension runs along (for
        `qax.sharding`): ``w`` all of them, ``a`` those of ``A`` then the rank,
        ``b`` the rank then those of ``B``."""
        nb = _batch_ndim(jnp.ndim(self.w), jnp.ndim(self.a), jnp.ndim(self.b))
        n_w = jnp.ndim(self.w) - nb
        a_axes, b_axes = _layout(n_w, jnp.ndim(self.a) - nb - 1, self.a_axes)
        return {"w": tuple(range(n_w)), "a": (*a_axes, None), "b": (None, *b_axes)}


def _layout(
    n_w: int, n_a: int, a_axes: tuple[int, ...] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The axes of an `n_w`-axis weight that `a` (`n_a` axes before the rank) and `b`
    run along."""
    if a_axes is None:
        return tuple(range(n_a)), tuple(range(n_a, n_w))
    return tuple(a_axes), tuple(i for i in range(n_w) if i not in a_axes)


def _checked_axes(axes: Any, w: tuple, a: tuple, nb: int) -> tuple[int, ...] | None:
    """``a_axes`` normalized (non-negative, ``None`` for the leading axes), or a
    ValueError."""
    k, n = len(w) - nb, len(a) - nb - 1
    try:
        given = tuple(int(i) for i in axes)
    except TypeError:
        given = None
    ok = (
        given is not None
        and len(given) == n
        and all(-k <= i < k for i in given)
        and len({i % k for i in given}) == n
    )
    if not ok:
        raise ValueError(_BAD_AXES.format(axes=axes, w=w, n=n, k=k, top=k - 1, a=a))
    given = tuple(i % k for i in given)
    return None if given == tuple(range(n)) else given


@qax.checkpoint.register_dataclass
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraAdapter:
    """The trainable part of one `LoraWeight`: its factors ``a`` and ``b`` (see `split`).

    A plain pytree (two array leaves); ``alpha``, ``freeze_w`` and ``a_axes`` are static
    metadata, so that `combine` rebuilds the same `LoraWeight`. Registered with
    `qax.checkpoint.register_dataclass`: it serializes with `jax.export` and
    `flax.serialization`, and `qax.checkpoint.describe` / `rebuild` know it.
    """

    a: Any
    b: Any
    alpha: float | None = dataclasses.field(default=None, metadata={"static": True})
    freeze_w: bool = dataclasses.field(default=True, metadata={"static": True})
    a_axes: tuple[int, ...] | None = dataclasses.field(
        default=None, metadata={"static": True}
    )


# ----------------------------------------------------------------------------------------
# Handlers


def _factors(w: LoraWeight) -> tuple[Any, Any]:
    """``a`` (already scaled) and ``b``, in the weight's dtype."""
    a, b = w.a, w.b
    if a.dtype != w.dtype:
        a = a.astype(w.dtype)
    if b.dtype != w.dtype:
        b = b.astype(w.dtype)
    return a, b


def _labelled_dot(x, x_labels, y, y_labels, contract, batch, **params):
    """`lax.dot_general` of two arrays whose axes are named by labels.

    Contracts the labels in `contract` and batches over those in `batch` (each present
    in both); returns the result and its labels (batch, then `x`'s free, then `y`'s).
    """
    dims = (
        (
            tuple(x_labels.index(k) for k in contract),
            tuple(y_labels.index(k) for k in contract),
        ),
        (
            tuple(x_labels.index(k) for k in batch),
            tuple(y_labels.index(k) for k in batch),
        ),
    )
    if y.dtype != x.dtype:
        y = y.astype(x.dtype)
    out = lax.dot_general(x, y, dims, **params)
    used = set(contract) | set(batch)
    labels = [*batch]
    labels += [k for k in x_labels if k not in used]
    labels += [k for k in y_labels if k not in used]
    return out, labels


_RANK = "rank"


def _lora_product(x, lora, dimension_numbers, lora_is_rhs, params):
    """``dot_general(x, a⊗b)`` (scaled) in the primitive's output layout, as two
    products with the thin factors."""
    if lora_is_rhs:
        (xc, lc), (xb, lb) = dimension_numbers
    else:
        (lc, xc), (lb, xb) = dimension_numbers
    x_labels = list(range(x.ndim))
    lora_labels = [("w", i) for i in range(lora.ndim)]
    for xi, li in zip(xc, lc, strict=True):
        lora_labels[li] = xi
    for xi, li in zip(xb, lb, strict=True):
        lora_labels[li] = xi
    contract, batch = set(xc), [x_labels[i] for i in xb]
    nb = _batch_ndim(lora.w.ndim, lora.a.ndim, lora.b.ndim)
    stack, core = lora_labels[:nb], lora_labels[nb:]
    a_axes, b_axes = lora.axes()
    a, b = _factors(lora)
    a_labels = [*stack, *(core[i] for i in a_axes), _RANK]
    b_labels = [*stack, _RANK, *(core[i] for i in b_axes)]
    # Contract x first with the factor that shares more contracted axes with it, so that
    # the intermediate result has the small rank axis.
    in_a = sum(k in contract for k in a_labels)
    in_b = sum(k in contract for k in b_labels)
    (f1, l1), (f2, l2) = ((a, a_labels), (b, b_labels))
    if in_b > in_a:
        (f1, l1), (f2, l2) = (f2, l2), (f1, l1)
    inner = {k: v for k, v in params.items() if k != "out_sharding"}
    # The stack axes of a stacked weight are in both factors: a stack axis that `x`
    # contracts stays a batch axis of the first product and is contracted (with the
    # rank) in the second; a free one is free in the first and a batch axis of the
    # second.
    t, t_labels = _labelled_dot(
        x,
        x_labels,
        f1,
        l1,
        [k for k in x_labels if k in contract and k in l1 and k not in stack],
        [*(k for k in batch if k in l1), *(k for k in stack if k in contract)],
        **inner,
    )
    if lora.scale != 1:
        t = t * jnp.asarray(lora.scale, t.dtype)
    out, out_labels = _labelled_dot(
        t,
        t_labels,
        f2,
        l2,
        [_RANK, *(k for k in t_labels if k in contract and k in l2)],
        [
            *(k for k in batch if k in l2 and k in t_labels),
            *(k for k in stack if k not in contract and k not in batch),
        ],
        **inner,
    )
    x_free = [k for k in x_labels if k not in contract and k not in batch]
    lora_free = [k for k in lora_labels if k not in contract and k not in batch]
    want = (
        [*batch, *x_free, *lora_free] if lora_is_rhs else [*batch, *lora_free, *x_free]
    )
    perm = tuple(out_labels.index(k) for k in want)
    return out if perm == tuple(range(len(perm))) else lax.transpose(out, perm)


def _dot(primitive, x, lora, dimension_numbers, lora_is_rhs, params):
    operands = (x, lora.base()) if lora_is_rhs else (lora.base(), x)
    main = primitive.bind(*operands, dimension_numbers=dimension_numbers, **params)
    delta = _lora_product(x, lora, dimension_numbers, lora_is_rhs, params)
    return main + delta.astype(main.dtype)


@qax.primitive_handler("dot_general")
def _dot_x_lora(
    primitive, x: jax.Array, w: LoraWeight, *, dimension_numbers, **params
) -> jax.Array:
    return _dot(primitive, x, w, dimension_numbers, True, params)


@qax.primitive_handler("dot_general")
def _dot_lora_x(
    primitive, w: LoraWeight, x: jax.Array, *, dimension_numbers, **params
) -> jax.Array:
    return _dot(primitive, x, w, dimension_numbers, False, params)


@qax.primitive_handler("conv_general_dilated")
def _conv_x_lora(
    primitive,
    x: jax.Array,
    w: LoraWeight,
    *,
    dimension_numbers,
    feature_group_count,
    batch_group_count,
    **params,
) -> Any:
    """``conv(x, w) + s · conv(x, f_in) ·₁ f_out``: one factor holds the kernel's input
    and spatial axes (a convolution with ``rank`` output channels), the other its
    output-feature axis (a 1x1 product)."""
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    if feature_group_count != 1 or batch_group_count != 1 or nb or w.a_axes is not None:
        return NotImplemented
    _, rhs_spec, out_spec = dimension_numbers
    out_axis, p = rhs_spec[0], w.a.ndim - 1
    a, b = _factors(w)
    if out_axis == w.ndim - 1 and p == w.ndim - 1:
        f_in, f_out = a, b  # Flax: a (*spatial, in, rank), b (rank, out)
    elif out_axis == 0 and p == 1:
        f_in, f_out = b, a.T  # Equinox: a (out, rank), b (rank, in, *spatial)
    else:
        return NotImplemented
    conv = dict(
        params,
        dimension_numbers=dimension_numbers,
        feature_group_count=1,
        batch_group_count=1,
    )
    main = primitive.bind(x, w.base(), **conv)
    if f_in.dtype != x.dtype:
        f_in = f_in.astype(x.dtype)
    t = primitive.bind(x, f_in, **conv)
    if w.scale != 1:
        t = t * jnp.asarray(w.scale, t.dtype)
    feature = out_spec[1]
    delta = lax.dot_general(
        t, f_out.astype(t.dtype), (((feature,), (0,)), ((), ())),
        precision=params.get("precision"),
        preferred_element_type=params.get("preferred_element_type"),
    )  # fmt: skip
    delta = jnp.moveaxis(delta, -1, feature)
    return main + delta.astype(main.dtype)


@qax.primitive_handler("gather")
def _gather_rows(
    primitive,
    w: LoraWeight,
    indices: jax.Array,
    *,
    dimension_numbers,
    slice_sizes,
    **params,
) -> Any:
    """Rows of ``w`` plus rows of ``a`` times ``b``, when the lookup indexes only the
    axes of ``a`` and keeps the axes of ``b`` whole, at the end of the result
    (``table[ids]``, ``jnp.take(table, ids, axis=0)``)."""
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    p, k = w.a.ndim - 1, w.ndim
    dn = dimension_numbers
    indexed = (*dn.collapsed_slice_dims, *dn.start_index_map, *dn.operand_batching_dims)
    out_ndim = indices.ndim - 1 + len(dn.offset_dims)
    n_b = k - p
    if (
        nb
        or w.a_axes is not None
        or any(d >= p for d in indexed)
        or tuple(slice_sizes[p:]) != tuple(w.shape[p:])
        or tuple(dn.offset_dims[-n_b:]) != tuple(range(out_ndim - n_b, out_ndim))
    ):
        return NotImplemented
    main = primitive.bind(
        w.base(), indices, dimension_numbers=dn, slice_sizes=slice_sizes, **params
    )
    a, b = _factors(w)
    a_dn = lax.GatherDimensionNumbers(
        offset_dims=(*dn.offset_dims[:-n_b], out_ndim - n_b),
        collapsed_slice_dims=dn.collapsed_slice_dims,
        start_index_map=dn.start_index_map,
        operand_batching_dims=dn.operand_batching_dims,
        start_indices_batching_dims=dn.start_indices_batching_dims,
    )
    rows = primitive.bind(
        a,
        indices,
        dimension_numbers=a_dn,
        slice_sizes=(*slice_sizes[:p], w.rank),
        **params,
    )
    if w.scale != 1:
        rows = rows * jnp.asarray(w.scale, rows.dtype)
    delta = lax.dot_general(rows, b, (((rows.ndim - 1,), (0,)), ((), ())))
    return main + delta.astype(main.dtype)


def _replace(old: LoraWeight, **fields: Any) -> LoraWeight:
    """A `LoraWeight` with new fields; shape and dtype are recomputed."""
    fields = {
        "w": old.w,
        "a": old.a,
        "b": old.b,
        "alpha": old.alpha,
        "freeze_w": old.freeze_w,
        "a_axes": old.a_axes,
        **fields,
    }
    return LoraWeight(**fields)


def _unbatched(w: LoraWeight) -> bool:
    return _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim) == 0


def _split_point(old: Sequence[int], new: Sequence[int], p: int) -> int | None:
    """The number of leading axes of `new` whose sizes multiply to ``prod(old[:p])``."""
    target, size = math.prod(old[:p]), 1
    for q in range(1, len(new)):
        size *= new[q - 1]
        if size == target:
            return q
        if size > target:
            return None
    return None


@qax.primitive_handler(["reshape", "squeeze"])
def _reshape(primitive, w: LoraWeight, **params) -> Any:
    """A reshape that keeps the boundary between the axes of ``a`` and ``b``
    (splitting or merging axes on either side) is again a `LoraWeight`; a weight that
    is a single row or column becomes that dense row. Squeezing stack axes (one layer
    of a stack, ``stack[i]``) squeezes all three fields."""
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    squeezed = params.get("dimensions") or (nb,)
    if nb and primitive is lax.squeeze_p and max(squeezed) < nb:
        dims = tuple(params["dimensions"])
        return _replace(
            w,
            w=lax.squeeze(w.w, dims),
            a=lax.squeeze(w.a, dims),
            b=lax.squeeze(w.b, dims),
        )
    if nb or w.a_axes is not None:
        return NotImplemented
    if primitive is lax.reshape_p and params.get("dimensions") is not None:
        return NotImplemented  # a reshape that also transposes
    new_shape = jax.eval_shape(
        lambda x: primitive.bind(x, **params), jax.ShapeDtypeStruct(w.shape, w.dtype)
    ).shape
    p = w.a.ndim - 1
    if math.prod(w.shape[:p]) == 1 or math.prod(w.shape[p:]) == 1:
        # One side is a single row (``table[i]`` then squeeze): the result is no bigger
        # than that row, so it is formed directly.
        return jnp.reshape(w.base() + w.delta(), new_shape)
    q = _split_point(w.shape, new_shape, p)
    if q is None:
        return NotImplemented
    return _replace(
        w,
        w=jnp.reshape(w.w, new_shape),
        a=jnp.reshape(w.a, (*new_shape[:q], w.rank)),
        b=jnp.reshape(w.b, (w.rank, *new_shape[q:])),
    )


@qax.primitive_handler("slice")
def _slice(primitive, w: LoraWeight, *, start_indices, limit_indices, strides) -> Any:
    """Slicing ``w`` slices ``a`` on its axes and ``b`` on its axes (and all three on
    the stack axes of a stack: ``stack[1:]``, ``stack[i]`` before its squeeze)."""
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    (ia, ib), r = w.axes(), w.rank
    strides = strides or (1,) * w.ndim
    starts, limits = tuple(start_indices), tuple(limit_indices)

    def on(axes, first, x, fill):
        out = [x[nb + i] for i in axes]
        return (*x[:nb], *((*out, fill) if first else (fill, *out)))

    return _replace(
        w,
        w=lax.slice(w.w, starts, limits, strides),
        a=lax.slice(
            w.a, on(ia, 1, starts, 0), on(ia, 1, limits, r), on(ia, 1, strides, 1)
        ),
        b=lax.slice(
            w.b, on(ib, 0, starts, 0), on(ib, 0, limits, r), on(ib, 0, strides, 1)
        ),
    )


@qax.primitive_handler("dynamic_slice")
def _dynamic_slice(primitive, w: LoraWeight, *starts: jax.Array, slice_sizes) -> Any:
    """``lax.dynamic_slice`` (e.g. one row, ``table[i]``; one layer of a stack,
    ``stack[i]``): slice each factor on its axes (and on the stack axes)."""
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    (ia, ib), zero = w.axes(), jnp.zeros((), jnp.int32)
    sizes = tuple(slice_sizes)
    starts = [s.astype(jnp.int32) for s in starts]
    lead, lead_sizes = starts[:nb], sizes[:nb]
    at, size = starts[nb:], sizes[nb:]
    return _replace(
        w,
        w=lax.dynamic_slice(w.w, starts, sizes),
        a=lax.dynamic_slice(
            w.a,
            [*lead, *(at[i] for i in ia), zero],
            (*lead_sizes, *(size[i] for i in ia), w.rank),
        ),
        b=lax.dynamic_slice(
            w.b,
            [*lead, zero, *(at[i] for i in ib)],
            (*lead_sizes, w.rank, *(size[i] for i in ib)),
        ),
    )


@qax.primitive_handler("split")
def _split_weight(primitive, w: LoraWeight, *, sizes, axis) -> Any:
    """``jnp.split`` of a fused weight (QKV): one `LoraWeight` per piece."""
    if not _unbatched(w):
        return NotImplemented
    ia, ib = w.axes()
    pieces = lax.split(w.w, sizes, axis)
    if axis in ia:
        parts = [(a, w.b) for a in lax.split(w.a, sizes, ia.index(axis))]
    else:
        parts = [(w.a, b) for b in lax.split(w.b, sizes, 1 + ib.index(axis))]
    return [_replace(w, w=piece, a=a, b=b) for piece, (a, b) in zip(pieces, parts)]


@qax.primitive_handler("convert_element_type")
def _convert(primitive, w: LoraWeight, *, new_dtype, **params) -> Any:
    """``w.astype(dtype)`` for a floating dtype casts every field: bf16 compute over
    f32 factors (the casts are differentiable, so gradients reach the f32 factors)."""
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented
    return _replace(
        w, w=w.w.astype(new_dtype), a=w.a.astype(new_dtype), b=w.b.astype(new_dtype)
    )


@qax.primitive_handler("mul")
def _mul_scalar(primitive, w: LoraWeight, c: jax.Array) -> Any:
    """``c * W`` for a scalar ``c``: ``c w + s (c a) b``."""
    if jnp.ndim(c) != 0:
        return NotImplemented
    c = c.astype(w.dtype)
    return _replace(w, w=w.w * c.astype(w.w.dtype), a=w.a * c.astype(w.a.dtype))


@qax.primitive_handler("stop_gradient")
def _stop_gradient(primitive, w: LoraWeight) -> Any:
    return _replace(
        w,
        w=lax.stop_gradient(w.w),
        a=lax.stop_gradient(w.a),
        b=lax.stop_gradient(w.b),
    )
