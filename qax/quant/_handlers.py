"""The handlers of the quantized weight types (see `qax.quant`).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import qax

from ._types import (
    FP8Weight,
    Int8Weight,
    IntKWeight,
    QuantizedWeight,
    _PackedFourBits,
)

# ----------------------------------------------------------------------------------------
# Handlers


@qax.primitive_handler(["dot_general", "conv_general_dilated"])
def _product_x_w(primitive, x: jax.Array, w: QuantizedWeight, **params) -> jax.Array:
    if primitive is lax.dot_general_p:
        out = _narrow_product(primitive, x, w, params, weight_side=1)
        if out is not None:
            return out
    return primitive.bind(x, w.dequantize(), **params)


@qax.primitive_handler("dot_general")
def _product_w_x(primitive, w: QuantizedWeight, x: jax.Array, **params) -> jax.Array:
    out = _narrow_product(primitive, w, x, params, weight_side=0)
    if out is not None:
        return out
    return primitive.bind(w.dequantize(), x, **params)


def _per_channel(w: QuantizedWeight) -> bool:
    """Codes of the weight's shape whose scales broadcast against them."""
    if isinstance(w, FP8Weight):
        if w.block_size is not None:
            return False
    elif not isinstance(w, Int8Weight):
        return False
    return jnp.ndim(w.q) == jnp.ndim(w.scale) == w.ndim


def _narrow_product(
    primitive, lhs: Any, rhs: Any, params: dict, weight_side: int
) -> jax.Array | None:
    """``dot_general`` on the codes of a per-channel weight, the scales applied to its
    output; ``None`` where that does not apply (scales along a contracted axis, codes
    of a block format, a non-floating product).

    The product keeps the dtype of the dense one (``preferred_element_type``: its
    result dtype), so a bf16 model multiplies bf16 by int8 / fp8.
    """
    w, x = (lhs, rhs) if weight_side == 0 else (rhs, lhs)
    if not (_per_channel(w) and jnp.issubdtype(x.dtype, jnp.floating)):
        return None
    contracting, batch = (tuple(d[weight_side]) for d in params["dimension_numbers"])
    if any(w.scale.shape[a] != 1 for a in contracting):
        return None
    # The dense product's dtype, by `dot_general`'s own rule (no second trace).
    dtype = params.get("preferred_element_type") or jnp.result_type(x.dtype, w.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    codes = lax.stop_gradient(w.q)  # fixed, as in `dequantize`
    operands = (codes, x) if weight_side == 0 else (x, codes)
    out = primitive.bind(*operands, **{**params, "preferred_element_type": dtype})
    # The output's axes: the batch axes, the lhs's free axes, then the rhs's.
    free = [a for a in range(w.ndim) if a not in contracting and a not in batch]
    scale = lax.transpose(w.scale, (*batch, *free, *contracting))
    scale = scale.reshape(scale.shape[: len(batch) + len(free)])
    x_free = x.ndim - len(batch) - len(contracting)
    start = len(batch) + (0 if weight_side == 0 else x_free)
    dims = (*range(len(batch)), *range(start, start + len(free)))
    return out * lax.broadcast_in_dim(scale.astype(out.dtype), out.shape, dims)


@qax.primitive_handler(["add", "sub"])
def _elementwise(primitive, w: QuantizedWeight, x: jax.Array) -> jax.Array:
    return primitive.bind(w.dequantize(), x)


@qax.primitive_handler("sub")
def _elementwise_right(primitive, x: jax.Array, w: QuantizedWeight) -> jax.Array:
    return primitive.bind(x, w.dequantize())


@qax.primitive_handler("convert_element_type")
def _convert(primitive, w: QuantizedWeight, *, new_dtype, **params) -> Any:
    """Decode to another floating dtype: the codes stay, the scales are cast."""
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented
    name = w._scale_field()
    return w._rescaled(**{name: getattr(w, name).astype(new_dtype)})


@qax.primitive_handler("mul")
def _mul_scalar(primitive, w: QuantizedWeight, c: jax.Array) -> Any:
    if jnp.ndim(c) != 0:
        return NotImplemented
    name = w._scale_field()
    scale = getattr(w, name)
    return w._rescaled(**{name: scale * c.astype(scale.dtype)})


@qax.primitive_handler("stop_gradient")
def _stop_gradient(primitive, w: QuantizedWeight) -> Any:
    name = w._scale_field()
    return w._rescaled(**{name: lax.stop_gradient(getattr(w, name))})


@qax.primitive_handler(["transpose", "broadcast_in_dim", "reshape"])
def _decode_then(primitive, w: QuantizedWeight, **params) -> jax.Array:
    """Ops that move elements: decode, then run them (inside the handler); one that
    leaves the shape as it is (``jnp``'s indexing ends with an identity
    ``broadcast_in_dim``) returns the weight itself."""
    shape = params.get("shape", params.get("new_sizes"))  # transpose: None
    if shape is not None and tuple(shape) == tuple(w.shape):
        if params.get("dimensions") is None and params.get("sharding") is None:
            return w
    return primitive.bind(w.dequantize(), **params)


@qax.primitive_handler("transpose")
def _transpose_int8(primitive, w: Int8Weight, *, permutation) -> Any:
    """Per-channel int8 transposes exactly: codes and (broadcastable) scales."""
    return _transpose_per_channel(primitive, w, permutation)


@qax.primitive_handler("transpose")
def _transpose_fp8(primitive, w: FP8Weight, *, permutation) -> Any:
    """Per-channel fp8 likewise; block-wise fp8 as the other block formats."""
    if w.block_size is not None:
        return _transpose_blocks(primitive, w, permutation)
    return _transpose_per_channel(primitive, w, permutation)


@qax.primitive_handler("transpose")
def _transpose_packed(primitive, w: _PackedFourBits, *, permutation) -> Any:
    """4-bit codes and block scales transpose as stored (``emb.T`` of a tied embedding
    stays 4-bit): the blocks follow their axis."""
    return _transpose_blocks(primitive, w, permutation)


@qax.primitive_handler("transpose")
def _transpose_intk(primitive, w: IntKWeight, *, permutation) -> Any:
    return _transpose_blocks(primitive, w, permutation)


def _transpose_blocks(primitive, w: QuantizedWeight, permutation) -> Any:
    """A block format's fields (each of the weight's rank, dimension ``i`` along the
    weight's dimension ``i``) transposed together, ``block_axis`` moved with its axis;
    a permutation that moves stacked (batch) axes decodes first."""
    permutation = tuple(int(p) for p in permutation)
    ndim = w.ndim
    batch = 0 if w.weight_ndim is None else ndim - w.weight_ndim
    if permutation[:batch] != tuple(range(batch)):
        return primitive.bind(w.dequantize(), permutation=permutation)
    fields = {n: lax.transpose(getattr(w, n), permutation) for n in w._ARRAYS}
    block_axis = permutation.index(ndim + w.block_axis) - ndim
    return w._rescaled(**fields, block_axis=block_axis)


def _transpose_per_channel(primitive, w: QuantizedWeight, permutation) -> Any:
    """Codes and scales transposed together; a permutation that keeps the stacked
    (batch) axes in front keeps them stacked (``jnp.swapaxes(stack, -1, -2)``), any
    other makes one weight of every axis."""
    if not _per_channel(w):
        return primitive.bind(w.dequantize(), permutation=permutation)
    permutation = tuple(int(p) for p in permutation)
    batch = 0 if w.weight_ndim is None else w.ndim - w.weight_ndim
    kept = permutation[:batch] == tuple(range(batch))
    return dataclasses.replace(
        w,
        q=lax.transpose(w.q, permutation),
        scale=lax.transpose(w.scale, permutation),
        shape=None,
        dtype=None,
        weight_ndim=w.weight_ndim if kept else None,
    )
