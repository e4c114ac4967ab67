"""Quantized weights through grouped products: `jax.lax.ragged_dot` over stacked experts.

A mixture-of-experts layer multiplies tokens sorted by expert by a stacked weight
``(experts, d_in, d_out)`` with `jax.lax.ragged_dot` (the primitive
``ragged_dot_general``). A `qax.quant` weight stacked along the expert axis
(``quantize(..., batch_ndim=1)``: codes and scales per expert) is handled there: a
per-channel one (int8, per-channel fp8) multiplies its codes directly, each token's
row then scaled by its own expert's scales (no float copy of the experts); the block
formats (nf4, int4, int2...int7, block-wise fp8) decode inside the product, as their
`dot_general` does. Either way the weight stays stored as codes; nothing is left to
qax's fallback (so ``qax.materialization_policy(..., "error")`` passes).

This module uses qax's public API only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import qax

from ._handlers import _per_channel
from ._types import QuantizedWeight


def _grouped_codes(primitive, x, w, group_sizes, rdn, params) -> jax.Array | None:
    """The product on the codes of a per-channel stack of experts, each row scaled by
    its group's scales; ``None`` where that does not apply (scales along a contracted
    axis, batch axes, an offset into the groups, a non-floating product)."""
    (xc, wc), (xb, _) = rdn.dot_dimension_numbers
    batch = len(w.shape) - (w.weight_ndim or 0)
    if (
        not _per_channel(w)
        or batch != 1
        or xb
        or params.get("group_offset") is not None
        or len(rdn.lhs_ragged_dimensions) != 1
        or tuple(rdn.rhs_group_dimensions) != (0,)
        or not jnp.issubdtype(x.dtype, jnp.floating)
        or any(w.scale.shape[a] != 1 for a in wc)
    ):
        return None
    dtype = params.get("preferred_element_type") or jnp.result_type(x.dtype, w.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    codes = lax.stop_gradient(w.q)  # fixed, as in `dequantize`
    out = primitive.bind(
        x,
        codes,
        group_sizes,
        ragged_dot_dimension_numbers=rdn,
        **{**params, "preferred_element_type": dtype},
    )
    # The output's axes: x's free axes (the grouped one among them), then w's.
    free = [a for a in range(1, w.ndim) if a not in wc]
    scale = lax.transpose(w.scale, (0, *free, *wc))
    scale = scale.reshape(scale.shape[: 1 + len(free)])  # (experts, *free)
    ragged = rdn.lhs_ragged_dimensions[0]
    rows = x.shape[ragged]
    group = jnp.repeat(
        jnp.arange(w.shape[0]), group_sizes, total_repeat_length=rows
    )  # each row's expert (rows past the groups are zero in `out`)
    per_row = jnp.take(scale, group, axis=0).astype(out.dtype)
    x_free = [a for a in range(x.ndim) if a not in xc]
    at = x_free.index(ragged)
    dims = (at, *range(len(x_free), len(x_free) + len(free)))
    return out * lax.broadcast_in_dim(per_row, out.shape, dims)


@qax.primitive_handler("ragged_dot_general")
def _ragged_x_w(
    primitive,
    x: jax.Array,
    w: QuantizedWeight,
    group_sizes: jax.Array,
    *,
    ragged_dot_dimension_numbers,
    **params,
) -> jax.Array:
    rdn = ragged_dot_dimension_numbers
    out = _grouped_codes(primitive, x, w, group_sizes, rdn, params)
    if out is not None:
        return out
    return primitive.bind(
        x, w.dequantize(), group_sizes, ragged_dot_dimension_numbers=rdn, **params
    )
