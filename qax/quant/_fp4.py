"""The 4-bit float formats of `qax.quant`: `MXFP4Weight` and `NVFP4Weight`.

Both store FP4 codes (``e2m1``: a sign bit, 2 exponent bits, 1 mantissa bit; the
values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, `FP4_LEVELS`) two per byte,
the even element in the low nibble, with one scale per block:

- MXFP4 (the OCP Microscaling Formats specification v1.0): an ``e8m0`` scale (a power
  of two, stored as its biased exponent byte ``e + 127``) per 32 numbers. The scale of
  a block is ``2**(floor(log2(absmax)) - 2)``, 2 being the largest exponent of FP4, so
  that the block's largest number lands in ``[4, 8)`` and saturates to 6 above 6.
  ``4 + 8/32 = 4.25`` bits per number.
- NVFP4 (NVIDIA's Blackwell format): an ``e4m3`` scale per 16 numbers times one
  float32 scale per weight (per layer of a stack): the weight's scale maps its absmax
  to ``6 * 448`` (FP4's largest value times e4m3's), each block scale is the block's
  absmax over 6 in those units, rounded to e4m3. ``4 + 8/16 = 4.5`` bits per number,
  plus 32 bits per weight.

The codes are computed here (round to the nearest value, ties to the even code, as a
conversion to ``float4_e2m1fn`` does) and packed as ``uint8`` nibbles, so the formats
work on JAX versions with and without the FP4 and e8m0 dtypes. Both decode in float32
and cast to the weight's ``dtype`` (an aux field: ``w.astype(jnp.bfloat16)`` keeps the
codes and scales as stored).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax

from . import _codes
from ._types import _block_axis, _check_block_axis, _PackedFourBits, _quantize_blocks

FP4_LEVELS: np.ndarray = np.array(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32
)
"""The 16 FP4 (e2m1) values by code: bit 3 the sign, bits 0-2 the magnitude."""

_MIDPOINTS = (FP4_LEVELS[1:8] + FP4_LEVELS[:7]) / 2  # between consecutive magnitudes
_FP4_MAX = 6.0
_E4M3_MAX = 448.0


def fp4_codes(x: jax.Array) -> jax.Array:
    """The FP4 code nearest each number of ``x`` (ties to the even code; beyond 6,
    saturated to 6), negative numbers with the sign bit."""
    a = jnp.abs(x).astype(jnp.float32)
    mid = jnp.asarray(_MIDPOINTS)
    lo = jnp.searchsorted(mid, a, side="left", method="compare_all")
    hi = jnp.searchsorted(mid, a, side="right", method="compare_all")
    mag = jnp.where((hi != lo) & (lo % 2 == 1), hi, lo)  # a tie: the even code
    return (mag + 8 * (x < 0)).astype(jnp.uint8)


def _fp4_values(packed: jax.Array) -> jax.Array:
    """The float32 values of packed codes (the blocks' axis last)."""
    return jnp.asarray(FP4_LEVELS)[_codes.unpack4(packed)]


def mx_codes(blocks: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4: the codes of each block of 32 (the last axis) and the e8m0 scale bytes."""
    # absmax = m * 2**e with m in [0.5, 1): floor(log2(absmax)) = e - 1, exactly.
    _, exponent = jnp.frexp(absmax.astype(jnp.float32))
    shared = jnp.where(absmax > 0, exponent - 1 - 2, -127)  # floor(log2) - emax(FP4)
    shared = jnp.clip(shared, -127, 127)
    scale = jnp.ldexp(jnp.float32(1), shared)
    codes = fp4_codes(blocks.astype(jnp.float32) / scale[..., None])
    return codes, (shared + 127).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnums=(1, 2))
def encode_nvfp4(w: jax.Array, batch_ndim: int, axis: int) -> tuple[jax.Array, ...]:
    """NVFP4: the packed codes, the e4m3 block scales and the float32 scale of each
    weight (of the weight's rank, size 1 along its own axes), blocks along ``axis``."""
    w = w.astype(jnp.float32)
    own = tuple(range(batch_ndim, w.ndim))
    amax = jnp.max(jnp.abs(w), axis=own, keepdims=True)
    tensor = jnp.where(amax > 0, amax / (_FP4_MAX * _E4M3_MAX), 1).astype(jnp.float32)

    moved = _codes.to_last(w, axis)
    blocks = _codes.split_blocks(moved, 16)
    t = _codes.to_last(tensor, axis)  # broadcasts against the block absmax
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scale = jnp.clip(absmax / _FP4_MAX / t, 0, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    dec = scale.astype(jnp.float32) * t
    codes = fp4_codes(blocks / jnp.where(dec > 0, dec, 1)[..., None])
    packed = _codes.from_last(_codes.pack4(codes.reshape(moved.shape)), axis)
    scale = _codes.from_last(scale, axis)
    return packed, scale, tensor


class _FP4Weight(_PackedFourBits):
    """FP4 codes with block scales, decoding to the aux field ``dtype``."""

    __module__ = "qax.quant"

    # `quantize`'s block size: fixed by the format's specification.
    default_block_size = 32

    def compute_dtype(self) -> Any:
        return jnp.float32  # the dtype of a weight built without one

    def _rescaled(self, **changes: Any) -> _FP4Weight:
        changes.setdefault("dtype", self.dtype)  # no field of ours carries it
        return dataclasses.replace(self, shape=None, **changes)

    def frozen_fields(self) -> tuple[str, ...]:
        """The codes and the block scales (formats' codes themselves)."""
        return self._ARRAYS[:2]


class MXFP4Weight(_FP4Weight):
    """OCP MXFP4: FP4 (e2m1) codes, two per byte, with one e8m0 scale (a power of
    two) per 32 numbers along the last axis (or ``block_axis``): ``w ≈
    FP4_LEVELS[code] * 2**(scale - 127)``. 4.25 bits per number as stored.

    Examples:
        >>> q = qax.quant.MXFP4Weight.from_array(jax.random.normal(key, (8, 64)))
        >>> q.packed.dtype, q.packed.shape, q.scale.dtype, q.scale.shape
        (dtype('uint8'), (8, 32), dtype('uint8'), (8, 2))
        >>> 8 * q.nbytes / q.size
        4.25

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: FP4 codes (`FP4_LEVELS`), the
        even element in the low nibble (the blocks' axis halved).
      scale: ``uint8`` of shape ``(*lead, n // 32)``: each block's e8m0 scale, its
        biased exponent (``2**(scale - 127)``).
      block_size: 32, the specification's.
      block_axis: the axis the blocks (and pairs of codes) run along, counted from
        the end of one weight's axes: -1, the last axis (the default).
    """

    __module__ = "qax.quant"

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int = qax.aux_field(default=32)
    block_axis: int = qax.aux_field(default=-1)

    _ARRAYS = ("packed", "scale")
    default_block_size = 32

    @classmethod
    def from_array(
        cls, w: jax.Array, batch_ndim: int = 0, block_axis: int = -1
    ) -> MXFP4Weight:
        """Quantize ``w`` to MXFP4, blocks of 32 along its last axis (or
        ``block_axis``), decoding to ``w``'s dtype.

        ``batch_ndim`` leading axes stack independent weights (scanned layers).
        ``block_axis``: the axis of one weight the blocks run along (``-2``, the input
        axis of a Flax ``(in, out)`` kernel).

        Raises:
          ValueError: the blocks' axis is not a multiple of 32.
        """
        w = jnp.asarray(w)
        q = _quantize_blocks(cls, w, "block_size", 32, batch_ndim, block_axis, mx_codes)
        return q._rescaled(dtype=w.dtype)

    def _decode(self, packed: Any, scale: Any) -> jax.Array:
        k = self.block_axis
        values = _fp4_values(_codes.to_last(packed, k))
        power = jnp.ldexp(jnp.float32(1), scale.astype(jnp.int32) - 127)
        out = _codes.scale_blocks(values, power, self.block_size, k)
        return out.astype(self.dtype)


class NVFP4Weight(_FP4Weight):
    """NVIDIA's NVFP4: FP4 (e2m1) codes, two per byte, one e4m3 scale per 16 numbers
    along the last axis (or ``block_axis``), and one float32 scale per weight: ``w ≈
    FP4_LEVELS[code] * scale[block] * tensor_scale``. 4.5 bits per number as stored,
    plus 4 bytes per weight (per layer of a stack).

    Examples:
        >>> q = qax.quant.NVFP4Weight.from_array(jax.random.normal(key, (8, 64)))
        >>> q.packed.shape, q.scale.dtype, q.scale.shape, q.tensor_scale.shape
        ((8, 32), dtype(float8_e4m3fn), (8, 4), (1, 1))
        >>> (8 * q.nbytes - 32) / q.size
        4.5

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: FP4 codes (`FP4_LEVELS`), the
        even element in the low nibble (the blocks' axis halved).
      scale: ``float8_e4m3fn`` of shape ``(*lead, n // 16)``: the block scales.
      tensor_scale: float32, one per weight (size 1 along each of its axes; one per
        layer of a stack): the weight's absmax over ``6 * 448``.
      block_size: 16, NVIDIA's.
      block_axis: the axis the blocks (and pairs of codes) run along, counted from
        the end of one weight's axes: -1, the last axis (the default).
    """

    __module__ = "qax.quant"

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    tensor_scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int = qax.aux_field(default=16)
    block_axis: int = qax.aux_field(default=-1)

    _ARRAYS = ("packed", "scale", "tensor_scale")
    default_block_size = 16

    @classmethod
    def from_array(
        cls, w: jax.Array, batch_ndim: int = 0, block_axis: int = -1
    ) -> NVFP4Weight:
        """Quantize ``w`` to NVFP4, blocks of 16 along its last axis (or
        ``block_axis``), one float32 scale per weight, decoding to ``w``'s dtype.

        ``batch_ndim`` leading axes stack independent weights (scanned layers), each
        with its own float32 scale.

        Raises:
          ValueError: the blocks' axis is not a multiple of 16.
        """
        w = jnp.asarray(w)
        k = _block_axis(cls, w, block_axis, batch_ndim)
        why = "two 4-bit numbers share a byte"
        _check_block_axis(cls, w.shape, "block_size", 16, k, unit=2, why=why)
        packed, scale, tensor = encode_nvfp4(w, batch_ndim, k)
        return cls(
            packed,
            scale,
            tensor,
            16,
            k,
            weight_ndim=w.ndim - batch_ndim,
            dtype=w.dtype,
        )

    def _scale_field(self) -> str:
        return "tensor_scale"

    def _decode(self, packed: Any, scale: Any, tensor_scale: Any) -> jax.Array:
        k = self.block_axis
        values = _fp4_values(_codes.to_last(packed, k))
        block = lax.stop_gradient(scale).astype(jnp.float32)  # codes: fixed
        out = _codes.scale_blocks(values, block, self.block_size, k)
        return (out * tensor_scale.astype(jnp.float32)).astype(self.dtype)

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Codes and block scales along every dimension; the weight's scale along
        none (size 1)."""
        dims = super().field_dims()
        return {**dims, "tensor_scale": (None,) * len(dims["packed"])}


# ----------------------------------------------------------------------------------------
# Handlers: the scales are codes (MXFP4) or codes and one float32 (NVFP4), so a cast
# changes only the dtype the weight decodes to.


@qax.primitive_handler("convert_element_type")
def _convert(primitive, w: _FP4Weight, *, new_dtype, **params) -> Any:
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return NotImplemented
    return w._rescaled(dtype=new_dtype)


@qax.primitive_handler("mul")
def _mul_scalar(primitive, w: _FP4Weight, c: jax.Array) -> Any:
    """NVFP4 rescales its float32 scale; MXFP4 (powers of two only) decodes."""
    if jnp.ndim(c) != 0:
        return NotImplemented
    if isinstance(w, NVFP4Weight):
        t = w.tensor_scale
        return w._rescaled(tensor_scale=t * jnp.asarray(c).astype(t.dtype))
    return primitive.bind(w.dequantize(), jnp.asarray(c).astype(w.dtype))


@qax.primitive_handler("stop_gradient")
def _stop_gradient(primitive, w: _FP4Weight) -> Any:
    if isinstance(w, NVFP4Weight):
        return w._rescaled(tensor_scale=lax.stop_gradient(w.tensor_scale))
    return w  # codes only: nothing to differentiate
