"""Quantized weights through grouped products: `jax.lax.ragged_dot` over stacked experts.

A mixture-of-experts layer multiplies tokens sorted by expert by a stacked weight
``(experts, d_in, d_out)`` with `jax.lax.ragged_dot` (the primitive
``ragged_dot_general``). A `qax.quant` weight stacked along the expert axis
(``quantize(..., batch_ndim=1)``: codes and scales per expert) is handled there: a
per-channel one (int8, per-channel fp8) multiplies its codes directly, each token's
row scaled by its own expert's scales (after the product, or before it for scales
along the contracted axis: no float copy of the experts); the block
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


def _row_groups(w, group_sizes, rows):
    """Each row's expert (rows past the groups are zero in the product)."""
    return jnp.repeat(jnp.arange(w.shape[0]), group_sizes, total_repeat_length=rows)


def _grouped_codes(primitive, x, w, group_sizes, rdn, params) -> jax.Array | None:
    """The product on the codes of a per-channel stack of experts, each row scaled by
    its expert's scales: after the product for scales along free axes of the weight,
    before it (on the row of ``x``) for scales along contracted axes. ``None`` where
    that does not apply (scales along both, batch axes, an offset into the groups, a
    non-floating product)."""
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
    ):
        return None
    dtype = params.get("preferred_element_type") or jnp.result_type(x.dtype, w.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    free = [a for a in range(1, w.ndim) if a not in wc]
    on_contracted = any(w.scale.shape[a] != 1 for a in wc)
    if on_contracted and any(w.scale.shape[a] != 1 for a in free):
        return None
    ragged = rdn.lhs_ragged_dimensions[0]
    group = _row_groups(w, group_sizes, x.shape[ragged])
    if on_contracted:
        # x's row times its expert's scales along the contracted axes (in x's order).
        scale = lax.transpose(w.scale, (0, *wc, *free))
        scale = scale.reshape(scale.shape[: 1 + len(wc)])  # (experts, *contracted)
        per_row = jnp.take(scale, group, axis=0).astype(x.dtype)
        x = x * lax.broadcast_in_dim(per_row, x.shape, (ragged, *xc))
    codes = lax.stop_gradient(w.q)  # fixed, as in `dequantize`
    out = primitive.bind(
        x,
        codes,
        group_sizes,
        ragged_dot_dimension_numbers=rdn,
        **{**params, "preferred_element_type": dtype},
    )
    if on_contracted:
        return out
    # The output's axes: x's free axes (the grouped one among them), then w's.
    scale = lax.transpose(w.scale, (0, *free, *wc))
    scale = scale.reshape(scale.shape[: 1 + len(free)])  # (experts, *free)
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
