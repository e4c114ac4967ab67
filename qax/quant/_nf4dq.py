"""NF4 with double quantization (QLoRA's, as bitsandbytes stores it): `NF4DQWeight`.

The block absmax of `NF4Weight` (one float per 64 numbers: 0.5 bits per number in
float32) is itself quantized: 8-bit codes, one float scale per group of 256 of them,
``absmax ≈ code * absmax_scale``, codes in ``1..255`` (a block with a nonzero absmax
never decodes to zero). The numbers are then coded against the decoded absmax, which
absorbs part of its rounding. Stored: ``4 + 8/64 + 32/(64*256) = 4.127`` bits per
number for a float32 weight whose absmax array splits into groups of 256.

The groups are boxes of the absmax array (which has the weight's rank, its blocks'
axis divided by 64), so every indexing that keeps the other formats quantized keeps
this one: a group runs along the last absmax axis and, when that axis holds fewer
than 256, over whole rows of it along the axis before (``(4096, 4096)`` blocked along
its last axis: absmax ``(4096, 64)``, groups of 4 rows, ``absmax_scale`` of shape
``(1024, 1)``). The largest such box of at most 256 is chosen; where the shape allows
no box of 256, groups are smaller (a few more bits of scale per number).

This module uses qax's public API only.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

import qax

from . import _codes
from ._types import NF4_LEVELS, _block_axis, _check_block_axis, _PackedFourBits

GROUP: int = 256
"""Block absmax per 8-bit scale group (bitsandbytes' and the QLoRA paper's)."""


def groups(shape: tuple[int, ...], batch_ndim: int) -> tuple[int, ...]:
    """The box of absmax entries that share a scale, per axis of the absmax array of
    ``shape`` (1 along the batch axes): the largest box of at most `GROUP` entries made
    of the last axes whole and a divisor of the axis before."""
    own = shape[batch_ndim:]
    best, box = (0, -1), (1,) * len(shape)
    trailing = 1
    for i in range(len(own) - 1, -1, -1):
        if trailing > GROUP:
            break
        g = max(
            d for d in range(1, own[i] + 1) if own[i] % d == 0 and d * trailing <= GROUP
        )
        size = g * trailing
        if size > best[0]:
            best = (size, i)
            box = (1,) * (batch_ndim + i) + (g,) + tuple(own[i + 1 :])
        trailing *= own[i]
    return box


def _expand(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``scale`` (one entry per box) repeated to ``shape`` (one per absmax)."""
    for d, (s, n) in enumerate(zip(scale.shape, shape, strict=True)):
        if s != n:
            scale = jnp.repeat(scale, n // s, axis=d)
    return scale


def _box_max(x: jax.Array, box: tuple[int, ...]) -> jax.Array:
    split = []
    for n, b in zip(x.shape, box, strict=True):
        split += [n // b, b]
    return jnp.max(x.reshape(split), axis=tuple(range(1, len(split), 2)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def encode_nf4dq(
    w: jax.Array, size: int, axis: int, batch_ndim: int
) -> tuple[jax.Array, ...]:
    """The packed NF4 codes, the 8-bit absmax codes and the group scales."""
    moved = _codes.to_last(w, axis)
    absmax = jnp.max(jnp.abs(_codes.split_blocks(moved, size)), axis=-1)
    absmax = _codes.from_last(absmax, axis)  # the weight's axes, blocks' one divided
    box = groups(absmax.shape, batch_ndim)
    top = _box_max(absmax, box)
    scale = jnp.where(top > 0, top / 255, 1).astype(w.dtype)
    wide = _expand(scale, absmax.shape)
    code = jnp.clip(jnp.round(absmax / wide), jnp.where(absmax > 0, 1, 0), 255)
    code = code.astype(jnp.uint8)
    decoded = _codes.to_last(code.astype(w.dtype) * wide, axis)
    codes, _ = _codes.nf4_codes(_codes.split_blocks(moved, size), decoded)
    packed = _codes.from_last(_codes.pack4(codes.reshape(moved.shape)), axis)
    return packed, code, scale


class NF4DQWeight(_PackedFourBits):
    """NF4 with double quantization: `NF4Weight`'s codes, its block absmax coded in 8
    bits with one scale per group of 256: ``w ≈ NF4_LEVELS[code] * absmax[block] *
    absmax_scale[group]`` (see `qax.quant` on the groups).

    Examples:
        >>> q = qax.quant.NF4DQWeight.from_array(jax.random.normal(key, (256, 256)))
        >>> q.packed.shape, q.absmax.dtype, q.absmax.shape, q.absmax_scale.shape
        ((256, 128), dtype('uint8'), (256, 4), (4, 1))
        >>> round(8 * q.nbytes / q.size, 3)
        4.127

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: indices into `NF4_LEVELS`, as
        in `NF4Weight`.
      absmax: ``uint8`` codes of the block absmax, of shape ``(*lead, n //
        block_size)``, in ``1..255`` (0 for an all-zero block).
      absmax_scale: floating-point, one per group of absmax codes (the weight's rank:
        each axis of ``absmax`` divided by the group's extent along it).
      block_size: numbers per block (64, as in QLoRA).
      block_axis: the axis the blocks (and pairs of codes) run along, counted from
        the end of one weight's axes: -1, the last axis (the default).
    """

    __module__ = "qax.quant"

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    absmax: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    absmax_scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int = qax.aux_field(default=64)
    block_axis: int = qax.aux_field(default=-1)

    _ARRAYS = ("packed", "absmax", "absmax_scale")

    @classmethod
    def from_array(
        cls,
        w: jax.Array,
        block_size: int = 64,
        batch_ndim: int = 0,
        block_axis: int = -1,
    ) -> NF4DQWeight:
        """Quantize ``w`` to NF4 block-wise along its last axis (or ``block_axis``),
        the block absmax to 8 bits in groups of 256.

        ``batch_ndim`` leading axes stack independent weights (scanned layers), each
        with its own groups. ``block_axis``: the axis of one weight the blocks run
        along (``-2``, the input axis of a Flax ``(in, out)`` kernel).

        Raises:
          ValueError: the blocks' axis is not a multiple of ``block_size``, or odd.
        """
        w = jnp.asarray(w)
        k = _block_axis(cls, w, block_axis, batch_ndim)
        why = "two 4-bit numbers share a byte"
        _check_block_axis(cls, w.shape, "block_size", block_size, k, unit=2, why=why)
        packed, code, scale = encode_nf4dq(w, block_size, k, batch_ndim)
        return cls(packed, code, scale, block_size, k, weight_ndim=w.ndim - batch_ndim)

    def _scale_field(self) -> str:
        return "absmax_scale"  # the floating-point field (casts, scalar products)

    def _decode(self, packed: Any, absmax: Any, absmax_scale: Any) -> jax.Array:
        k = self.block_axis
        levels = jnp.asarray(NF4_LEVELS, self.dtype)
        values = levels[_codes.unpack4(_codes.to_last(packed, k))]
        scale = absmax.astype(self.dtype) * _expand(absmax_scale, absmax.shape)
        return _codes.scale_blocks(values, scale, self.block_size, k)

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Codes and absmax along every dimension of the weight; the group scales
        along those they have more than one entry on (a group that spans a whole axis
        broadcasts along it)."""
        dims = super().field_dims()
        rank = len(dims["packed"])
        nb = len(self.shape) - rank
        pairs = zip(jnp.shape(self.absmax_scale)[nb:], self.shape[nb:], strict=True)
        dims["absmax_scale"] = tuple(
            None if n == 1 and m != 1 else i for i, (n, m) in enumerate(pairs)
        )
        return dims

    def frozen_fields(self) -> tuple[str, ...]:
        """The NF4 codes and the absmax codes."""
        return self._ARRAYS[:2]
