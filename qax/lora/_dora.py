"""`DoraWeight`: weight-decomposed low-rank adaptation (DoRA), never formed.

DoRA (Liu et al. 2024) splits a weight into a magnitude and a direction: the adapted
weight is ``m * V / ‖V‖`` with ``V = w + s·a⊗b`` (a LoRA weight), the norm taken per
output unit over the input axes and ``m`` a trainable magnitude per output unit. As in
PEFT and the paper, the norm is a constant in the backward pass.

Here the input axes are the axes of ``a`` (``A``: a Flax kernel's ``in``, an einsum
kernel's ``a_axes``) and the output units the axes of ``b`` (``B``), so ``m`` has the
shape of ``B``. Products never form ``V``: a product that contracts ``A`` is the LoRA
product times ``m / ‖V‖`` on its ``B`` axes, and the squared norm is

    ‖V‖² = ‖w‖² + 2s·Σ_r b_r ⊙ (aᵀw)_r + s²·Σ_r b_r ⊙ (aᵀa · b)_r

with ``‖w‖²`` computed once (``w`` is frozen: the field ``w_norm2``) and ``aᵀw`` a
product of the thin factor with the base, through the base's own product handler (an
NF4 or int8 base costs what a QLoRA product costs). The magnitude's gradient needs the
unscaled product ``x·V``, which a LoRA step never keeps: products are under
`jax.checkpoint` and recompute it in the backward pass (see `_recomputed`).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import qax

from ._weight import LoraWeight, _batch_ndim, _layout, _lora_product


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in jnp.shape(x))


class DoraWeight(qax.ImplicitArray):
    """The DoRA weight ``m * V / ‖V‖``, ``V = w + (alpha / rank) * tensordot(a, b, 1)``.

    ``w``, ``a``, ``b``, ``alpha``, ``a_axes`` as in `LoraWeight` (one unbatched weight:
    layers stacked for `lax.scan` are sliced by the declared field ranks). ``m`` has the
    shape of the output axes ``B`` (those of ``b`` after the rank); the norm ``‖V‖`` is
    taken over the input axes ``A`` for each output unit and is a constant for
    gradients. ``w_norm2`` is ``‖w‖²`` per output unit, computed at construction when
    not given (the base is frozen).

    Examples:
        >>> w = jnp.arange(12.0).reshape(4, 3); a = jnp.ones((4, 2)); b = jnp.ones((2, 3))
        >>> d = qax.lora.DoraWeight(w, a, b, m=jnp.ones(3))
        >>> jnp.linalg.norm(d.materialize(), axis=0)  # each column has norm m
        Array([1., 1., 1.], dtype=float32)

    Attributes:
      w: the base weight (frozen; dense or a `qax.quant` weight).
      a: ``(*A, rank)``.
      b: ``(rank, *B)``.
      m: the magnitude, shape ``B``.
      w_norm2: ``‖w‖²`` over ``A``, shape ``B`` (frozen).
      alpha: the LoRA scale numerator (``None``: ``alpha = rank``).
      a_axes: as for `LoraWeight`.
    """

    w: qax.ArrayValue = qax.array_field(ndim="w_ndim")
    a: qax.ArrayValue = qax.array_field(ndim="a_ndim")
    b: qax.ArrayValue = qax.array_field(ndim="b_ndim")
    m: qax.ArrayValue = qax.array_field(ndim="m_ndim", default=None)
    w_norm2: qax.ArrayValue = qax.array_field(ndim="m_ndim", default=None)
    alpha: float | None = qax.aux_field(default=None)
    w_ndim: int | None = qax.aux_field(default=None, init=False)
    a_ndim: int | None = qax.aux_field(default=None, init=False)
    b_ndim: int | None = qax.aux_field(default=None, init=False)
    m_ndim: int | None = qax.aux_field(default=None, init=False)
    a_axes: tuple[int, ...] | None = qax.aux_field(default=None)

    def frozen_fields(self) -> tuple[str, ...]:
        """``("w", "w_norm2")``: optimizers move ``a``, ``b`` and ``m`` only."""
        return ("w", "w_norm2")

    def __post_init__(self) -> None:
        lora = self.lora()  # checks the layout (LoraWeight's messages)
        nb = _batch_ndim(jnp.ndim(self.w), jnp.ndim(self.a), jnp.ndim(self.b))
        out_shape = _shape(self.b)[nb + 1 :]
        if self.w_norm2 is None:
            self.w_norm2 = _squared_norm(lora, self.w, nb)
        if self.m is None:
            self.m = jnp.sqrt(self.w_norm2)  # PEFT's start: the direction alone is w
        want = (*_shape(self.a)[:nb], *out_shape)
        for name in ("m", "w_norm2"):
            if _shape(getattr(self, name)) != want:
                raise ValueError(
                    f"DoraWeight: `{name}` must have the shape of the output axes "
                    f"(those of `b` after the rank), {want}; got "
                    f"{_shape(getattr(self, name))}."
                )
        if self.alpha is not None:
            object.__setattr__(self, "alpha", float(self.alpha))
        self.w_ndim, self.a_ndim = jnp.ndim(self.w) - nb, jnp.ndim(self.a) - nb
        self.b_ndim, self.m_ndim = jnp.ndim(self.b) - nb, len(out_shape)
        super().__post_init__()

    def compute_shape(self) -> tuple[int, ...]:
        return _shape(self.w)

    def compute_dtype(self) -> Any:
        return jnp.result_type(self.w.dtype, self.a.dtype, self.b.dtype, self.m.dtype)

    def lora(self) -> LoraWeight:
        """The direction's unnormalised weight ``V`` as a `LoraWeight` (frozen base)."""
        return LoraWeight(self.w, self.a, self.b, alpha=self.alpha, a_axes=self.a_axes)

    def scale(self) -> jax.Array:
        """``m / ‖V‖`` per output unit (the norm a constant for gradients)."""
        return _scale(self.lora(), self.m, self.w_norm2).astype(self.dtype)

    def materialize(self) -> jax.Array:
        v = self.lora().materialize().astype(self.dtype)
        return v * _on_output_axes(self, self.scale(), v.ndim)

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """As for `LoraWeight`, and ``m``, ``w_norm2`` along the output axes."""
        n_w = self.w_ndim
        a_axes, b_axes = _layout(n_w, self.a_ndim - 1, self.a_axes)
        return {
            "w": tuple(range(n_w)),
            "a": (*a_axes, None),
            "b": (None, *b_axes),
            "m": b_axes,
            "w_norm2": b_axes,
        }


def _axes(lora: LoraWeight, nb: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n_w = jnp.ndim(lora.w) - nb
    return _layout(n_w, jnp.ndim(lora.a) - nb - 1, lora.a_axes)


def _squared_norm(lora: LoraWeight, w: Any, nb: int) -> jax.Array:
    """``‖w‖²`` over the input axes (``w`` decoded once if quantized)."""
    dense = (
        qax.materialize_nested(w, full=True) if isinstance(w, qax.ImplicitArray) else w
    )
    a_axes, _ = _axes(lora, nb)
    dense = jnp.asarray(dense, jnp.promote_types(dense.dtype, jnp.float32))
    return jnp.sum(dense * dense, axis=tuple(nb + i for i in a_axes))


def _direction_norm2(
    w: Any, a: Any, b: Any, s: float, in_axes: tuple[int, ...], nb: int, w_norm2: Any
) -> jax.Array:
    """``‖w + s·a⊗b‖²`` over the input axes ``in_axes`` of one weight (``nb`` stack
    axes lead every array), without forming ``a⊗b`` or ``w + a⊗b``: ``aᵀw`` is a
    product with the base (its own handler when it is quantized)."""
    stack = tuple(range(nb))
    contract_a = tuple(range(nb, nb + len(in_axes)))
    contract_w = tuple(nb + i for i in in_axes)
    dtype = jnp.result_type(w.dtype, a.dtype, b.dtype)
    cross = lax.dot_general(
        a.astype(dtype), w, ((contract_a, contract_w), (stack, stack))
    )  # (*stack, rank, *B)
    return _norm2_from_cross(w_norm2, a, b, s, cross, nb)


def _norm2_from_cross(
    w_norm2: Any, a: Any, b: Any, s: float, cross: Any, nb: int
) -> jax.Array:
    """``‖w‖² + 2s·Σ_r b⊙(aᵀw) + s²·Σ_r b⊙(aᵀa·b)`` given ``cross = aᵀw`` (``(*stack,
    rank, *B)``), in at least float32."""
    dtype = jnp.promote_types(jnp.result_type(a.dtype, b.dtype), jnp.float32)
    a, b, cross = a.astype(dtype), b.astype(dtype), cross.astype(dtype)
    stack = tuple(range(nb))
    contract_a = tuple(range(nb, a.ndim - 1))
    gram = lax.dot_general(a, a, ((contract_a, contract_a), (stack, stack)))
    gb = lax.dot_general(gram, b, (((nb + 1,), (nb,)), (stack, stack)))
    cross_term = jnp.sum(b * cross, axis=nb)
    quad = jnp.sum(b * gb, axis=nb)
    total = w_norm2 + (2 * s) * cross_term + (s * s) * quad
    return total.astype(w_norm2.dtype)


def _norm2_of(lora: LoraWeight, w_norm2: Any, nb: int) -> jax.Array:
    """`_direction_norm2` of a LoRA weight, in a nested `qax.use_implicit_args` (its
    base may be quantized, and this may run outside any wrapper: `materialize()`)."""
    in_axes, s = _axes(lora, nb)[0], lora.scale

    def norm2(w, a, b, n):
        return _direction_norm2(w, a, b, s, in_axes, nb, n)

    return qax.use_implicit_args(norm2)(lora.w, lora.a, lora.b, w_norm2)


def _scale(lora: LoraWeight, m: Any, w_norm2: Any) -> jax.Array:
    """``m / ‖V‖`` for the LoRA weight ``V`` (the norm a constant for gradients)."""
    nb = _batch_ndim(jnp.ndim(lora.w), jnp.ndim(lora.a), jnp.ndim(lora.b))
    norm2 = _norm2_of(lora, w_norm2, nb)
    return m / jnp.sqrt(lax.stop_gradient(norm2))


def _on_output_axes(d: DoraWeight, scale: jax.Array, ndim: int) -> jax.Array:
    """`scale` (shape ``B``) broadcast against one weight's axes."""
    nb = ndim - d.w_ndim
    _, b_axes = _layout(d.w_ndim, d.a_ndim - 1, d.a_axes)
    shape = [1] * ndim
    for k in range(nb):
        shape[k] = jnp.shape(scale)[k]
    for i, axis in enumerate(b_axes):
        shape[nb + axis] = jnp.shape(scale)[nb + i]
    # `scale` runs along B in b's order, which is w's order of those axes.
    return jnp.reshape(scale, shape)


@qax.checkpoint.register_dataclass
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DoraAdapter:
    """The trainable part of one `DoraWeight`: ``a``, ``b`` and the magnitude ``m``
    (see `qax.lora.split`); ``w_norm2`` stays with the base."""

    a: Any
    b: Any
    m: Any
    alpha: float | None = dataclasses.field(default=None, metadata={"static": True})
    a_axes: tuple[int, ...] | None = dataclasses.field(
        default=None, metadata={"static": True}
    )


@qax.checkpoint.register_dataclass
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DoraBase:
    """The frozen part of one `DoraWeight` in the base of `qax.lora.split`: the base
    weight and its ``‖w‖²`` per output unit (computed once, kept beside it)."""

    w: Any
    w_norm2: Any


# ----------------------------------------------------------------------------------------
# Handlers


def _bind(primitive: Any, *operands: Any, **params: Any) -> Any:
    """`primitive` on operands that include a `LoraWeight` built here: its own
    handlers run (a nested `qax.use_implicit_args`)."""
    return qax.use_implicit_args(lambda *ops: primitive.bind(*ops, **params))(*operands)


def _unbatched(d: DoraWeight) -> bool:
    return jnp.ndim(d.w) == d.w_ndim


def _recomputed(f: Any, x: Any, d: DoraWeight) -> Any:
    """``f(x, lora, m, w_norm2)``, a product with ``lora`` (``d``'s `LoraWeight`)
    scaled by ``m / ‖V‖`` on its output units, under `jax.checkpoint`: the backward
    pass keeps these inputs and a decoded base (`_keeps_base`) and recomputes the rest.
    The magnitude's gradient needs the unscaled product (``dm = Σ g ⊙ x·V / ‖V‖``), one
    output-sized value per product that a LoRA step never keeps; recomputing it costs
    one more product with the base in the backward pass, and a DoRA step holds what a
    LoRA step holds (with JAX 0.12's XLA; JAX 0.10's merges the recomputation with the
    forward product, so the value is kept there). The base is stopped here, once, not
    again inside (``freeze_w=False``)."""
    w = jax.tree_util.tree_map(lax.stop_gradient, d.w)
    lora = LoraWeight(w, d.a, d.b, alpha=d.alpha, freeze_w=False, a_axes=d.a_axes)
    policy = _keeps_base(_shape(d.w), {jnp.dtype(d.w.dtype), jnp.dtype(d.dtype)})
    return jax.checkpoint(f, policy=policy)(x, lora, d.m, d.w_norm2)


def _kept(dtype: Any, dtypes: set) -> bool:
    # Integer codes pass as they are; a float8 value is never kept (JAX marks a kept
    # float with a `reduce_precision` to its own format, which takes float8 e4m3fn's
    # largest numbers to infinity).
    return jnp.issubdtype(dtype, jnp.integer) or jnp.dtype(dtype) in dtypes


def _keeps_base(shape: tuple[int, ...], dtypes: set) -> Any:
    """A `jax.checkpoint` policy that keeps the values of the base's shape (a quantized
    base decoded, a base cast to the product's dtype, integer codes: what a LoRA step
    keeps for its backward product, made once, not again in the backward pass) and
    recomputes everything else."""

    def policy(primitive, *avals, **params):
        try:
            out = jax.eval_shape(lambda *v: primitive.bind(*v, **params), *avals)
        except Exception:  # noqa: BLE001 (a primitive not bound this way: recomputed)
            return False
        outs = out if isinstance(out, (list, tuple)) else (out,)
        return any(_shape(o) == shape and _kept(o.dtype, dtypes) for o in outs)

    return policy


def _dot(primitive, x, d: DoraWeight, dimension_numbers, weight_is_rhs, params):
    if weight_is_rhs:
        (x_c, w_c), (x_b, w_b) = dimension_numbers
    else:
        (w_c, x_c), (w_b, x_b) = dimension_numbers
    if not _unbatched(d):
        return _dot_stack(primitive, x, d, (x_c, w_c, x_b, w_b), weight_is_rhs, params)
    if w_b:
        return NotImplemented
    a_axes, b_axes = _layout(d.w_ndim, d.a_ndim - 1, d.a_axes)
    if weight_is_rhs and not x_b and sorted(w_c) == sorted(a_axes):
        fused = lambda *args: _dot_fused(primitive, d, (x_c, w_c), params, *args)  # noqa: E731
        return _recomputed(fused, x, d)
    if sorted(w_c) == sorted(a_axes):
        # The inputs contract the input axes: the output units are free; scale them.
        def scaled(x, lora, m, w_norm2):
            scale = _scale(lora, m, w_norm2)
            operands = (x, lora) if weight_is_rhs else (lora, x)
            out = _bind(
                primitive, *operands, dimension_numbers=dimension_numbers, **params
            )
            n_x_free = x.ndim - len(x_c) - len(x_b)
            w_free_start = len(x_b) + (n_x_free if weight_is_rhs else 0)
            shape = [1] * out.ndim
            free = [i for i in range(d.w_ndim) if i not in w_c]
            for pos, axis in enumerate(free):
                shape[w_free_start + pos] = jnp.shape(scale)[b_axes.index(axis)]
            return out * jnp.reshape(scale, shape).astype(out.dtype)

        return _recomputed(scaled, x, d)
    scale = d.scale()
    lora = d.lora()
    if sorted(w_c) == sorted(b_axes):
        # The inputs contract the output units (``x @ W.T``): scale the inputs (the
        # backward pass keeps ``x``, as LoRA's does: nothing to recompute).
        shape = [1] * x.ndim
        for xi, wi in zip(x_c, w_c, strict=True):
            shape[xi] = jnp.shape(scale)[b_axes.index(wi)]
        x = x * jnp.reshape(scale, shape).astype(x.dtype)
        operands = (x, lora) if weight_is_rhs else (lora, x)
        return _bind(
            primitive, *operands, dimension_numbers=dimension_numbers, **params
        )
    return NotImplemented


def _dot_fused(primitive, d: DoraWeight, contract, params, x, lora, m, w_norm2):
    """``x @ W`` contracting the input axes, with the base taken once: the inputs and
    ``aᵀ`` (``rank`` more rows) go through one product with ``w`` (one decode of a
    quantized base), giving ``x·w`` and the norm's cross term ``aᵀw`` together. ``d``
    gives the layout only; the values are ``lora`` (its base stopped), ``m`` and
    ``w_norm2`` (see `_recomputed`)."""
    x_c, w_c = contract
    a_axes, b_axes = _layout(d.w_ndim, d.a_ndim - 1, d.a_axes)
    dtype = jnp.result_type(x.dtype, lora.dtype, m.dtype)
    free_x = [i for i in range(x.ndim) if i not in x_c]
    lead = tuple(x.shape[i] for i in free_x)
    tokens = math.prod(lead)
    x2 = jnp.reshape(
        lax.transpose(x, (*free_x, *x_c)), (tokens, *(x.shape[c] for c in x_c))
    )
    at = lax.transpose(lora.a, (lora.a.ndim - 1, *(a_axes.index(c) for c in w_c)))
    z = jnp.concatenate([x2.astype(dtype), at.astype(dtype)], axis=0)
    contract_z = tuple(range(1, 1 + len(w_c)))
    zw = _bind(
        primitive, z, lora.base(), dimension_numbers=((contract_z, tuple(w_c)), ((), ())),
        **params,
    )  # fmt: skip
    free_w = [i for i in range(d.w_ndim) if i not in w_c]  # = b_axes, in order
    main = jnp.reshape(zw[:tokens], (*lead, *(lora.w.shape[i] for i in free_w)))
    cross = lax.stop_gradient(zw[tokens:])  # aᵀw: (rank, *B)
    norm2 = _norm2_from_cross(w_norm2, lora.a, lora.b, lora.scale, cross, 0)
    scale = (m / jnp.sqrt(lax.stop_gradient(norm2))).astype(main.dtype)
    delta = _lora_product(x, lora, ((x_c, w_c), ((), ())), True, params)
    out = main + delta.astype(main.dtype)
    return out * scale  # B is last, in w's order: `scale`'s own order


def _dot_stack(primitive, x, d: DoraWeight, dims, weight_is_rhs, params):
    """A product with a stack of layers (``vmap`` over the layers gives one whose
    stack axis is a batch axis of the product, or a free one): the one-layer product,
    mapped over the stack."""
    x_c, w_c, x_b, w_b = dims
    nb = jnp.ndim(d.w) - d.w_ndim
    if nb != 1 or 0 in w_c:
        return NotImplemented
    if tuple(w_b[:1]) == (0,):  # the stack axis is a batch axis: x has it too
        xb = x_b[0]
        x_c1 = tuple(c - (c > xb) for c in x_c)
        x_b1 = tuple(c - (c > xb) for c in x_b[1:])
        w_b1 = tuple(c - 1 for c in w_b[1:])
        x_axis, out_axis = xb, 0
    elif 0 not in w_b:  # a free axis: it stays where the product puts w's free axes
        x_c1, x_b1, w_b1 = tuple(x_c), tuple(x_b), tuple(c - 1 for c in w_b)
        n_x_free = jnp.ndim(x) - len(x_c) - len(x_b)
        x_axis, out_axis = None, len(x_b) + (n_x_free if weight_is_rhs else 0)
    else:
        return NotImplemented
    w_c1 = tuple(c - 1 for c in w_c)
    dn = ((x_c1, w_c1), (x_b1, w_b1)) if weight_is_rhs else ((w_c1, x_c1), (w_b1, x_b1))

    def one(x1, w, a, b, m, n):
        d1 = DoraWeight(w, a, b, m=m, w_norm2=n, alpha=d.alpha, a_axes=d.a_axes)
        out = _dot(primitive, x1, d1, dn, weight_is_rhs, params)
        if out is NotImplemented:
            raise _Declined
        return out

    mapped = jax.vmap(one, in_axes=(x_axis, 0, 0, 0, 0, 0), out_axes=out_axis)
    try:
        return qax.use_implicit_args(mapped)(x, d.w, d.a, d.b, d.m, d.w_norm2)
    except _Declined:
        return NotImplemented


class _Declined(Exception):
    """One layer's product has no handler here (raised out of the mapped call)."""


@qax.primitive_handler("dot_general")
def _dot_x_dora(
    primitive, x: jax.Array, w: DoraWeight, *, dimension_numbers, **params
) -> Any:
    return _dot(primitive, x, w, dimension_numbers, True, params)


@qax.primitive_handler("dot_general")
def _dot_dora_x(
    primitive, w: DoraWeight, x: jax.Array, *, dimension_numbers, **params
) -> Any:
    return _dot(primitive, x, w, dimension_numbers, False, params)


@qax.primitive_handler("conv_general_dilated")
def _conv_x_dora(primitive, x: jax.Array, w: DoraWeight, **params) -> Any:
    """The LoRA convolution, its output features scaled (Flax kernels: the output
    feature is the last axis, the one ``b`` runs along)."""
    _, b_axes = _layout(w.w_ndim, w.a_ndim - 1, w.a_axes)
    rhs_spec, out_spec = params["dimension_numbers"][1], params["dimension_numbers"][2]
    if not _unbatched(w) or b_axes != (rhs_spec[0],):
        return NotImplemented

    def scaled(x, lora, m, w_norm2):
        out = _bind(primitive, x, lora, **params)
        shape = [1] * out.ndim
        shape[out_spec[1]] = -1
        return out * jnp.reshape(_scale(lora, m, w_norm2), shape).astype(out.dtype)

    return _recomputed(scaled, x, w)


@qax.primitive_handler("gather")
def _gather_dora(primitive, w: DoraWeight, indices: jax.Array, **params) -> Any:
    """Rows of the LoRA weight (``table[ids]``, indexing the input axes), scaled along
    the output axes at the end of the result."""
    _, b_axes = _layout(w.w_ndim, w.a_ndim - 1, w.a_axes)
    n_b = len(b_axes)
    if not _unbatched(w) or tuple(params["slice_sizes"][-n_b:]) != w.shape[-n_b:]:
        return NotImplemented
    if b_axes != tuple(range(w.w_ndim - n_b, w.w_ndim)):
        return NotImplemented
    offset_dims = tuple(params["dimension_numbers"].offset_dims)
    out_ndim = len(offset_dims) + jnp.ndim(indices) - 1  # the index vector is last
    if offset_dims[-n_b:] != tuple(range(out_ndim - n_b, out_ndim)):
        return NotImplemented

    def scaled(indices, lora, m, w_norm2):
        rows = _bind(primitive, lora, indices, **params)
        return rows * _scale(lora, m, w_norm2).astype(rows.dtype)

    return _recomputed(scaled, indices, w)


# ----------------------------------------------------------------------------------------
# Building


def to_dora(params: Any) -> Any:
    """Every `LoraWeight` of ``params`` as a `DoraWeight` with the same factors.

    The magnitude starts at the norm of the LoRA weight's direction, so the model
    computes what it computed with LoRA (with ``b = 0``, as `loraify` starts it: the
    base model). A quantized base's ``‖w‖²`` is decoded once here.

    Examples:
        >>> dora = qax.lora.to_dora(qax.lora.loraify(params, 8, key=key, alpha=16.0))

    Args:
      params: parameters holding `LoraWeight`s (from `loraify`, over any base).

    Returns:
      The same tree with `DoraWeight`s in their place.
    """

    def one(x: Any) -> Any:
        if not isinstance(x, LoraWeight):
            return x
        nb = _batch_ndim(jnp.ndim(x.w), jnp.ndim(x.a), jnp.ndim(x.b))
        w_norm2 = _squared_norm(x, x.w, nb)
        m = jnp.sqrt(_norm2_of(x, w_norm2, nb))
        return DoraWeight(
            x.w, x.a, x.b, m=m, w_norm2=w_norm2, alpha=x.alpha, a_axes=x.a_axes
        )

    return jax.tree_util.tree_map(
        one, params, is_leaf=lambda x: isinstance(x, LoraWeight)
    )


@qax.primitive_handler("transpose")
def _transpose_dora(primitive, w: DoraWeight, *, permutation) -> Any:
    """``W.T`` (any permutation of one weight's axes): the base transposed, ``a``
    unchanged (its axes at their new positions: ``a_axes``), ``b``, ``m`` and
    ``w_norm2`` with the output axes in their new order. The input axes stay the
    input axes, so the norm is the same."""
    if not _unbatched(w):
        return NotImplemented
    perm = tuple(permutation)
    a_axes, b_axes = _layout(w.w_ndim, w.a_ndim - 1, w.a_axes)
    where = {old: new for new, old in enumerate(perm)}
    new_a_axes = tuple(where[i] for i in a_axes)
    new_b = sorted(where[i] for i in b_axes)  # the new weight's order of B
    order = [b_axes.index(perm[i]) for i in new_b]  # old B positions, in new order
    return DoraWeight(
        lax.transpose(w.w, perm),
        w.a,
        lax.transpose(w.b, (0, *(1 + k for k in order))),
        m=lax.transpose(w.m, order),
        w_norm2=lax.transpose(w.w_norm2, order),
        alpha=w.alpha,
        a_axes=new_a_axes,
    )


@qax.primitive_handler("slice")
def _slice_dora(primitive, w: DoraWeight, *, start_indices, limit_indices, strides):
    """A slice along output axes only (``w[:, :k]`` of a Flax kernel; a fused
    projection's piece): the base, ``b``, ``m`` and ``w_norm2`` sliced on those axes,
    ``a`` unchanged, so each output unit keeps its norm. A slice that cuts input axes
    changes every norm: it is declined (the weight is formed, with a warning)."""
    if not _unbatched(w):
        return NotImplemented
    a_axes, b_axes = _layout(w.w_ndim, w.a_ndim - 1, w.a_axes)
    strides = tuple(strides or (1,) * w.ndim)
    starts, limits = tuple(start_indices), tuple(limit_indices)
    whole = all(
        starts[i] == 0 and limits[i] == w.shape[i] and strides[i] == 1 for i in a_axes
    )
    if not whole:
        return NotImplemented
    on_b = lambda x: tuple(x[i] for i in b_axes)  # noqa: E731
    return DoraWeight(
        lax.slice(w.w, starts, limits, strides),
        w.a,
        lax.slice(
            w.b, (0, *on_b(starts)), (w.b.shape[0], *on_b(limits)), (1, *on_b(strides))
        ),
        m=lax.slice(w.m, on_b(starts), on_b(limits), on_b(strides)),
        w_norm2=lax.slice(w.w_norm2, on_b(starts), on_b(limits), on_b(strides)),
        alpha=w.alpha,
        a_axes=w.a_axes,
    )
