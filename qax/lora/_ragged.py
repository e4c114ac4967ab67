"""`LoraWeight` through grouped products: `jax.lax.ragged_dot` over stacked experts.

A mixture-of-experts layer holds its experts as one stacked weight ``(experts, d_in,
d_out)`` and multiplies tokens sorted by expert with `jax.lax.ragged_dot` (the
primitive ``ragged_dot_general``): the rows of ``x`` in group ``g`` go through expert
``g``. A `LoraWeight` stacked along the expert axis (``loraify(..., batch_ndim=1)``:
one pair of factors per expert) stays implicit there: the product is the grouped
product of the base plus the grouped product of the factors, ``ragged_dot(x, w) +
s · ragged_dot(ragged_dot(x, a), b)``, never ``w + s·a b`` for every expert. Its
gradient reaches each expert's factors from that expert's tokens only (JAX's own
derivative of the grouped products). The einsum form of a capacity-bucketed dispatch
(``'ecd,edf->ecf'``, the expert axis a batch axis of the product) and `jax.vmap` over
the experts are the `dot_general` handlers' (`_weight`) and the stacks' (`_stacks`).

This module uses qax's public API only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import qax

from ._weight import LoraWeight, _batch_ndim, _factors

_RANK = "rank"
_GROUP = "group"


def _ragged_labelled(primitive, x, xl, y, yl, group_sizes, contract, batch, params):
    """``ragged_dot_general`` of two labelled arrays: ``x``'s axis labelled ``ragged``
    split in groups, ``y``'s axis `_GROUP` the group axis. Returns the result and its
    labels (batch, then ``x``'s free, then ``y``'s free but the group axis)."""
    rdn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(
            (
                tuple(xl.index(k) for k in contract),
                tuple(yl.index(k) for k in contract),
            ),
            (tuple(xl.index(k) for k in batch), tuple(yl.index(k) for k in batch)),
        ),
        lhs_ragged_dimensions=(xl.index("ragged"),),
        rhs_group_dimensions=(yl.index(_GROUP),),
    )
    if y.dtype != x.dtype:
        y = y.astype(x.dtype)
    out = primitive.bind(x, y, group_sizes, ragged_dot_dimension_numbers=rdn, **params)
    used = {*contract, *batch, _GROUP}
    labels = [*batch, *(k for k in xl if k not in used)]
    return out, labels + [k for k in yl if k not in used]


def _base_product(primitive, x, w, group_sizes, rdn, params):
    """The grouped product with the (frozen) experts.

    A dense frozen base goes through a `jax.custom_jvp` product whose tangent is the
    tangent of ``x`` times ``w``: the same derivative as ``ragged_dot(x,
    stop_gradient(w))``, but the backward pass reads ``w`` itself. Under `lax.scan`
    over stacked layers, ``stop_gradient(w)`` would be a new value per layer that the
    forward pass keeps for the backward one (a copy of every layer's experts); ``w``
    is the scanned input, which JAX passes on without a copy.
    """
    base = w.base()
    if not w.freeze_w or isinstance(w.w, qax.ImplicitArray):
        return primitive.bind(
            x, base, group_sizes, ragged_dot_dimension_numbers=rdn, **params
        )

    def bind(x, w, group_sizes):
        return primitive.bind(
            x, w, group_sizes, ragged_dot_dimension_numbers=rdn, **params
        )

    product = jax.custom_jvp(bind)

    @product.defjvp
    def _product_jvp(primals, tangents):
        x, w, group_sizes = primals
        return bind(x, w, group_sizes), bind(tangents[0], w, group_sizes)

    weight = w.w if w.w.dtype == w.dtype else w.w.astype(w.dtype)
    return product(x, weight, group_sizes)


@qax.primitive_handler("ragged_dot_general")
def _ragged_x_lora(
    primitive,
    x: jax.Array,
    w: LoraWeight,
    group_sizes: jax.Array,
    *,
    ragged_dot_dimension_numbers,
    **params,
) -> Any:
    """``x`` split in groups along a free axis, ``w`` a stack of experts whose stack
    axis is the group axis: two thin grouped products beside the base's."""
    rdn = ragged_dot_dimension_numbers
    (xc, wc), (xb, wb) = rdn.dot_dimension_numbers
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    if (
        len(rdn.lhs_ragged_dimensions) != 1
        or tuple(rdn.rhs_group_dimensions) != (0,)
        or nb != 1
        or rdn.lhs_ragged_dimensions[0] in (*xc, *xb)
    ):
        return NotImplemented  # not a grouped product over the expert stack
    main = _base_product(primitive, x, w, group_sizes, rdn, params)
    # Label the axes: x's by position ("ragged" for the grouped one), w's contracted
    # and batch axes by x's labels, its free axes by ("w", i), the stack by _GROUP.
    ragged = rdn.lhs_ragged_dimensions[0]
    xl = ["ragged" if i == ragged else i for i in range(x.ndim)]
    wl: list[Any] = [("w", i) for i in range(w.ndim)]
    wl[0] = _GROUP
    for xi, wi in zip((*xc, *xb), (*wc, *wb), strict=True):
        wl[wi] = xl[xi]
    contract, batch = {xl[i] for i in xc}, [xl[i] for i in xb]
    a_axes, b_axes = w.axes()
    core = wl[1:]
    a, b = _factors(w)
    al = [_GROUP, *(core[i] for i in a_axes), _RANK]
    bl = [_GROUP, _RANK, *(core[i] for i in b_axes)]
    # Contract x first with the factor that shares more contracted axes with it.
    (f1, l1), (f2, l2) = (a, al), (b, bl)
    if sum(k in contract for k in bl) > sum(k in contract for k in al):
        (f1, l1), (f2, l2) = (f2, l2), (f1, l1)
    inner = {**params, "out_sharding": None}  # the thin products' layout: JAX's
    t, tl = _ragged_labelled(
        primitive,
        x,
        xl,
        f1,
        l1,
        group_sizes,
        [k for k in xl if k in contract and k in l1],
        [k for k in batch if k in l1],
        inner,
    )
    if w.scale != 1:
        t = t * jnp.asarray(w.scale, t.dtype)
    out, ol = _ragged_labelled(
        primitive,
        t,
        tl,
        f2,
        l2,
        group_sizes,
        [_RANK, *(k for k in tl if k in contract and k in l2)],
        [k for k in batch if k in l2 and k in tl],
        inner,
    )
    used = {*contract, *batch}
    want = [
        *batch,
        *(k for k in xl if k not in used),
        *(k for k in wl if k not in used and k != _GROUP),
    ]
    if sorted(map(str, ol)) != sorted(map(str, want)):
        return NotImplemented  # a batch axis split between the factors
    perm = tuple(ol.index(k) for k in want)
    if perm != tuple(range(len(perm))):
        out = lax.transpose(out, perm)
    return main + out.astype(main.dtype)
