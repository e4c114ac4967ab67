"""The encodings behind the `qax.quant` types: bit packing and the encoders.

Each encoder is one `jax.jit` program per shape and settings (eagerly, JAX would
dispatch and compile every step separately). This module uses qax's public API only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _nf4_levels() -> np.ndarray:
    """The 16 NormalFloat levels of QLoRA (Dettmers et al., 2023, appendix E).

    8 positive levels at the standard normal quantiles of ``linspace(offset, 1/2, 9)``
    (without the last point), 7 negative ones at those of ``linspace(offset, 1/2, 8)``,
    and an exact zero, all divided by the largest. ``offset`` is the mean of
    ``1 - 1/(2·15)`` and ``1 - 1/(2·16)``, so that the extreme levels are ±1.
    """
    ppf = NormalDist().inv_cdf
    offset = ((1 - 1 / 30) + (1 - 1 / 32)) / 2
    positive = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    levels = np.sort(np.array([*positive, 0.0, *negative]))
    return (levels / np.abs(levels).max()).astype(np.float32)


NF4_LEVELS: np.ndarray = _nf4_levels()
"""The 16 NF4 levels in ascending order, from -1 to 1 (index = the 4-bit code)."""


def pack4(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte along the last axis: element ``2j`` in the low nibble."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: jax.Array) -> jax.Array:
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def split_blocks(x: jax.Array, size: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def to_last(x: jax.Array, axis: int) -> jax.Array:
    """``x`` with the blocks' axis (negative, from the end) moved last."""
    return x if axis == -1 else jnp.moveaxis(x, axis, -1)


def from_last(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of `to_last`: the last axis moved back to ``axis``."""
    return x if axis == -1 else jnp.moveaxis(x, -1, axis)


def scale_blocks(values: jax.Array, scale: Any, size: int, axis: int) -> jax.Array:
    """The decoded weight: ``values`` (the blocks' axis last, as `to_last` leaves it)
    times one scale per ``size`` numbers (``scale`` as stored), moved back to ``axis``."""
    blocks = split_blocks(values, size) * to_last(scale, axis)[..., None]
    return from_last(blocks.reshape(values.shape), axis)


def chunk(bits: int) -> tuple[int, int]:
    """The shortest byte-aligned run of ``bits``-bit codes: (codes, bytes)."""
    common = math.gcd(8, bits)
    return 8 // common, bits // common


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Codes in ``[0, 2**bits)`` as a little-endian bit stream along the last axis.

    Code ``i`` of a row takes bits ``i*bits`` to ``i*bits + bits - 1`` of the row's
    bytes, bit 0 being the least significant bit of byte 0 (for 4 bits: the even code in
    the low nibble, as `Int4Weight` packs). The last axis must hold whole bytes.
    """
    n_codes, n_bytes = chunk(bits)
    values = codes.astype(jnp.int32).reshape(*codes.shape[:-1], -1, n_codes)
    out = []
    for b in range(n_bytes):
        byte = jnp.zeros(values.shape[:-1], jnp.int32)
        for i in range(n_codes):
            shift = i * bits - 8 * b  # where code i's bit 0 falls, from byte b's bit 0
            if -bits < shift < 8:
                part = values[..., i]
                byte = byte | (part << shift if shift >= 0 else part >> -shift)
        out.append(byte & 0xFF)
    packed = jnp.stack(out, axis=-1).astype(jnp.uint8)
    return packed.reshape(*codes.shape[:-1], -1)


def unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """The codes (``int32``) of a bit stream written by `pack_bits`."""
    n_codes, n_bytes = chunk(bits)
    data = packed.astype(jnp.int32).reshape(*packed.shape[:-1], -1, n_bytes)
    start = np.arange(n_codes) * bits  # code i's first bit in its run
    first, shift = start // 8, start % 8
    # Code i lies in byte `first[i]` and, if it runs on, the next one; where it does
    # not, the next byte's bits land above the mask.
    word = data[..., first] | (data[..., np.minimum(first + 1, n_bytes - 1)] << 8)
    codes = (word >> shift) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


@functools.partial(jax.jit, static_argnums=1)
def encode_int8(w: jax.Array, reduced: tuple) -> tuple[jax.Array, jax.Array]:
    """`Int8Weight.from_array`'s codes and scales (one compiled program per shape)."""
    absmax = jnp.max(jnp.abs(w), axis=reduced, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127, 1).astype(w.dtype)
    return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def encode_intk(
    w: jax.Array, bits: int, group_size: int, axis: int = -1
) -> tuple[jax.Array, ...]:
    """The packed codes and group scales of `IntKWeight.from_array`, groups and bit
    stream along ``axis`` (one compiled program per shape, rather than a dispatch per
    bit-packing step)."""
    w = to_last(w, axis)
    q, scale = signed_codes(split_blocks(w, group_size), bits)
    packed = pack_bits((q + 2 ** (bits - 1)).reshape(w.shape), bits)
    return from_last(packed, axis), from_last(scale, axis)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def encode_fp8(
    w: jax.Array,
    dtype: Any,
    reduced: tuple | None,
    block_size: int | None,
    axis: int = -1,
) -> tuple[jax.Array, jax.Array]:
    """`FP8Weight.from_array`'s codes and scales: per channel (the absmax over the
    ``reduced`` axes) or per block of ``block_size`` along ``axis`` (-1 per channel)."""
    w = to_last(w, axis)
    if block_size is None:
        absmax = jnp.max(jnp.abs(w), axis=reduced, keepdims=True)
    else:
        absmax = jnp.max(jnp.abs(split_blocks(w, block_size)), axis=-1)
    largest = float(jnp.finfo(dtype).max)
    scale = jnp.where(absmax > 0, absmax / largest, 1).astype(w.dtype)
    wide = scale if block_size is None else jnp.repeat(scale, block_size, axis=-1)
    ratio = w.astype(jnp.float32) / wide.astype(jnp.float32)
    q = jnp.clip(ratio, -largest, largest).astype(dtype)
    return from_last(q, axis), from_last(scale, axis)


def signed_codes(blocks: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """``bits``-bit two's-complement codes in ``[-2**(bits-1), 2**(bits-1) - 1]`` of
    each block (the last axis) and the block scales.

    All ``2**bits`` levels are used. From 4 bits on, the scale puts the block's largest
    or its most negative number exactly on the end of the range that fits it (the other
    end then has room to spare); at 2 and 3 bits, ``absmax / (2**(bits-1) - 0.5)``
    (the extreme rounds half a step inwards, a finer step for all the others). On
    normal weights, each gives a lower RMS error at its widths than the other, and than
    ``absmax / (2**(bits-1) - 1)`` with the most negative level unused
    (``benchmarks/bench_quant.py``).
    """
    top = 2 ** (bits - 1) - 1
    if bits >= 4:
        scale = jnp.maximum(
            jnp.max(blocks, axis=-1) / top, -jnp.min(blocks, axis=-1) / (top + 1)
        )
    else:
        scale = jnp.max(jnp.abs(blocks), axis=-1) / (top + 0.5)
    scale = jnp.where(scale > 0, scale, 1).astype(blocks.dtype)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -top - 1, top)
    return q.astype(jnp.int32), scale


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def encode_packed(
    w: jax.Array, size: int, encode: Callable, axis: int = -1
) -> tuple[jax.Array, ...]:
    """The 4-bit codes and block scales, blocks and pairs of codes along ``axis`` (one
    compiled program per shape)."""
    w = to_last(w, axis)
    blocks = split_blocks(w, size)
    codes, scale = encode(blocks, jnp.max(jnp.abs(blocks), axis=-1))
    return from_last(pack4(codes.reshape(w.shape)), axis), from_last(scale, axis)


def int4_codes(blocks: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """4-bit codes (value + 8) and the group scales, as `IntKWeight` with 4 bits."""
    q, scale = signed_codes(blocks, 4)
    return q + 8, scale


def nf4_codes(blocks: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The nearest NF4 level of each number over its block's absmax, and the absmax."""
    safe = jnp.where(absmax > 0, absmax, 1).astype(blocks.dtype)
    normalized = (blocks / safe[..., None]).astype(jnp.float32)
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    codes = jnp.searchsorted(jnp.asarray(midpoints), normalized, method="compare_all")
    return codes, safe
