"""Quantized weights that stay quantized: integer, NormalFloat and FP8 codes.

Each type stores codes plus floating-point scales and behaves like the dense weight they
decode to. The handlers decode *inside* the operation that uses the weight, so the
full-precision weight never exists as a parameter or an input of the program:

- ``dot_general`` (any layout, either side) and ``conv_general_dilated``: decode, then
  the product (XLA fuses the decoding into it). For per-channel `Int8Weight` and
  `FP8Weight` whose scales run only along output (non-contracted) axes of the product,
  the product takes the int8 / fp8 codes themselves as its operand and the scales
  multiply its output (a *narrow product*: JAX's TPU lowering feeds the codes to the
  dot as they are; on CPU and GPU, JAX's lowering converts them to the product's
  dtype right before the dot, and nothing of the weight's size is multiplied);
- ``gather`` of rows (embedding lookups): only the gathered rows are decoded;
- ``convert_element_type`` to a floating dtype: the same codes, decoding to that dtype
  (``w.astype(jnp.bfloat16)`` keeps 4-bit storage); ``mul`` by a scalar rescales the
  scales; ``transpose`` of a per-channel weight transposes its codes; ``stop_gradient``;
- ``add`` / ``sub`` (merging a LoRA into a quantized base): decoded inside the handler.

The formats (the names `quantize` takes):

- ``"int8"``, `Int8Weight`: symmetric int8 with one scale per output channel (``axis``,
  by default the last axis: the output axis of a Flax ``(in, out)`` kernel; or a tuple
  of axes, e.g. heads and outputs of an einsum kernel). 1 byte per number.
- ``"int4"``, `Int4Weight`: symmetric 4-bit integers in ``[-8, 7]`` with one scale per
  group of ``group_size`` consecutive numbers along the last axis; two numbers per byte.
- ``"nf4"``, `NF4Weight`: QLoRA's 4-bit NormalFloat: 16 levels at quantiles of a
  standard normal (one of them exactly zero), one absmax scale per block of
  ``block_size`` numbers along the last axis; two numbers per byte. For normally
  distributed weights its error is lower than `Int4Weight`'s at the same size (see
  ``benchmarks/bench_quant.py``).
- ``"fp8_e4m3"`` / ``"fp8_e5m2"``, `FP8Weight`: ``float8_e4m3fn`` / ``float8_e5m2``
  codes, each scale mapping its absmax to the format's largest finite value (448 /
  57344); one scale per output channel (``axis``, as for int8) or, with
  ``block_size=``, one per block along the last axis. 1 byte per number.
- ``"int2"``, ``"int3"``, ``"int5"``, ``"int6"``, ``"int7"``, `IntKWeight`:
  ``bits``-bit two's-complement integers in ``[-2**(bits-1), 2**(bits-1) - 1]`` (all
  ``2**bits`` levels used: ``int2`` is ``{-2, -1, 0, 1}``), one scale per group along
  the last axis, packed so that a weight of ``n``
  numbers takes exactly ``n * bits / 8`` bytes. Any ``bits`` from 2 to 8 through the
  class: ``quantize(params, qax.quant.IntKWeight, bits=8, group_size=64)`` is group-wise
  int8 (``"int4"`` and ``"int8"`` keep their own types above; ``IntKWeight`` with
  ``bits=4`` stores the very bytes `Int4Weight` does).

Gradients flow into the scales as they would into the decoded weight; the codes get
none (integers; FP8 codes are decoded under `jax.lax.stop_gradient`), and every type
declares its codes frozen (`qax.ImplicitArray.frozen_fields`), so
`qax.utils.apply_updates` never moves them. A quantized base is meant to stay fixed:
differentiate with respect to the LoRA factors only (`qax.lora.split`), or wrap it in
`jax.lax.stop_gradient` (which `qax.lora.LoraWeight` does for its ``w``; the handler
keeps the weight quantized), and no weight-sized gradient is computed for it. Train on
top of them with `qax.lora` (QLoRA), whatever the format:

Examples:
    >>> base = qax.quant.quantize(params, "nf4")        # or "fp8_e4m3", "int3", ...
    >>> params = qax.lora.loraify(base, rank=8, key=jax.random.key(0))
    >>> adapters, base = qax.lora.split(params)   # train `adapters` as in qax.lora

`quantize_dequantize` gives the array a format decodes to (quantize, then decode), for
quantization-aware training and error studies.

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from statistics import NormalDist
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax
from qax.lora import default_filter

__all__ = [
    "FORMATS",
    "NF4_LEVELS",
    "FP8Weight",
    "Int4Weight",
    "Int8Weight",
    "IntKWeight",
    "NF4Weight",
    "QuantizedWeight",
    "dequantize",
    "quantize_dequantize",
    "quantize",
]


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

_LAST_AXIS = (
    "{cls}: the last axis of a weight of shape {shape} must be a multiple of "
    "{what}={size}{unit}. Pass a {what} that divides {last}{hint}, or leave this weight "
    "out with `filter=`."
)
_BAD_BITS = (
    "IntKWeight: bits={bits!r}; bits must be an integer from 2 to 8 (the number of bits "
    "per stored code). Named formats: {names}."
)
_BAD_FP8 = (
    "FP8Weight: fp8_dtype={dtype!r} is not an FP8 format; use jnp.float8_e4m3fn "
    '(format "fp8_e4m3": more precision, max 448) or jnp.float8_e5m2 ("fp8_e5m2": more '
    "range, max 57344)."
)


def _pack(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte along the last axis: element ``2j`` in the low nibble."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: jax.Array) -> jax.Array:
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def _blocks(x: jax.Array, size: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _chunk(bits: int) -> tuple[int, int]:
    """The shortest byte-aligned run of ``bits``-bit codes: (codes, bytes)."""
    common = math.gcd(8, bits)
    return 8 // common, bits // common


def _pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """Codes in ``[0, 2**bits)`` as a little-endian bit stream along the last axis.

    Code ``i`` of a row takes bits ``i*bits`` to ``i*bits + bits - 1`` of the row's
    bytes, bit 0 being the least significant bit of byte 0 (for 4 bits: the even code in
    the low nibble, as `Int4Weight` packs). The last axis must hold whole bytes.
    """
    n_codes, n_bytes = _chunk(bits)
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


def _unpack_bits(packed: jax.Array, bits: int) -> jax.Array:
    """The codes (``int32``) of a bit stream written by `_pack_bits`."""
    n_codes, n_bytes = _chunk(bits)
    data = packed.astype(jnp.int32).reshape(*packed.shape[:-1], -1, n_bytes)
    start = np.arange(n_codes) * bits  # code i's first bit in its run
    first, shift = start // 8, start % 8
    # Code i lies in byte `first[i]` and, if it runs on, the next one; where it does
    # not, the next byte's bits land above the mask.
    word = data[..., first] | (data[..., np.minimum(first + 1, n_bytes - 1)] << 8)
    codes = (word >> shift) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def _channel_axes(cls: type, w: jax.Array, axis: Any) -> set[int]:
    """The channel axes of ``w`` (``axis``: an int or a tuple of ints), checked."""
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    if not all(
        isinstance(a, (int, np.integer)) and -w.ndim <= a < w.ndim for a in axes
    ):
        raise ValueError(
            f"{cls.__name__}.from_array: axis={axis!r} for a weight of shape "
            f"{tuple(w.shape)}: each channel axis must be an integer in "
            f"[-{w.ndim}, {w.ndim})."
        )
    return {a % w.ndim for a in axes}


def _channel_absmax(cls: type, w: jax.Array, axis: Any, batch_ndim: int) -> jax.Array:
    """The absmax of ``w`` over all but its batch and channel axes (kept, size 1)."""
    kept = _channel_axes(cls, w, axis)
    others = tuple(i for i in range(batch_ndim, w.ndim) if i not in kept)
    return jnp.max(jnp.abs(w), axis=others, keepdims=True)


def _channel_field_dims(w: QuantizedWeight) -> dict[str, tuple[int | None, ...]]:
    """`field_dims` of a per-channel weight: codes along every dimension, scales only
    along the channel axes."""
    rank = w.weight_ndim
    nb = len(w.shape) - rank
    channel = tuple(d != 1 for d in jnp.shape(w.scale)[nb:])
    return {
        "q": tuple(range(rank)),
        "scale": tuple(i if keep else None for i, keep in enumerate(channel)),
    }


class QuantizedWeight(qax.ImplicitArray):
    """Base of the quantized types: `dequantize` decodes; the handlers are shared.

    Subclasses define `_decode(**fields)` (the dense weight from the array fields, in
    ``dtype``), `from_array()` and ``_ARRAYS`` (the names of the array fields);
    ``dtype`` is the dtype of the scales. Every array field has the weight's rank, held
    per instance by the keyword-only aux field ``weight_ndim``: declare the array
    fields with ``qax.array_field(ndim="weight_ndim", stored=True)``. Constructed
    without it, a weight is unbatched (``weight_ndim`` is the rank of its fields); with
    it, leading axes beyond it stack independent weights (scanned layers, as
    ``from_array(w, batch_ndim=1)`` builds them), which `lax.scan` and `vmap` slice
    without decoding. ``stored=True``: in a program split over devices, products move
    the codes and scales as stored and decode them after the move (`qax.sharding`).

    Examples:
        >>> q = qax.quant.Int8Weight.from_array(jnp.ones((3, 4, 2)), batch_ndim=1)
        >>> q.shape, q.weight_ndim
        ((3, 4, 2), 2)
    """

    _ARRAYS: ClassVar[tuple[str, ...]] = ()
    # What `vmap`/`lax.scan` warnings tell a user whose weight lacks a batch axis.
    batch_axes_advice = (
        "for layers stacked along a leading axis (`nnx.vmap`/`nnx.scan` layers, linen "
        "`nn.scan`, weights stacked for `lax.scan`), quantize with that axis as a batch "
        "axis, `qax.quant.quantize(params, ..., batch_ndim=1)` (and `qax.lora.loraify"
        "(..., batch_ndim=1)` over it for QLoRA), so that each layer keeps its own scales."
    )

    # The rank of one (unbatched) weight, the declared rank of every array field; set
    # from the fields when not given (an unbatched weight).
    weight_ndim: int | None = qax.aux_field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        n = self.weight_ndim
        if n is not None:
            ok = isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0
            if not ok:
                raise ValueError(
                    f"{type(self).__name__}: weight_ndim must be the rank of one "
                    f"unbatched weight (an integer >= 0), got {n!r}; `from_array`'s "
                    "batch_ndim must be at most the weight's ndim."
                )
            self.weight_ndim = int(n)
        super().__post_init__()

    def dequantize(self) -> jax.Array:
        """The dense weight the codes stand for (differentiable in the scales)."""
        return self._decode(**{n: getattr(self, n) for n in self._ARRAYS})

    def _decode(self, **arrays: Any) -> jax.Array:
        raise NotImplementedError

    def frozen_fields(self) -> tuple[str, ...]:
        """The codes (the first array field): optimizers leave them as they are."""
        return self._ARRAYS[:1]

    def materialize(self) -> jax.Array:
        return self.dequantize()

    def compute_dtype(self) -> Any:
        return getattr(self, self._scale_field()).dtype  # the codes decode to it

    def _scale_field(self) -> str:
        return self._ARRAYS[1]  # (codes, scales)

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Which dimension of the weight each field dimension runs along (for
        `qax.sharding`): codes and scales keep the weight's rank and run along its
        dimensions (packed codes and group scales along the last one, in order)."""
        rank = len(self.shape) if self.weight_ndim is None else self.weight_ndim
        return {name: tuple(range(rank)) for name in self._ARRAYS}

    def _rescaled(self, **changes: Any) -> QuantizedWeight:
        return dataclasses.replace(self, shape=None, dtype=None, **changes)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales."""
        return sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(self))


class Int8Weight(QuantizedWeight):
    """Symmetric int8 codes with one scale per output channel: ``w ≈ q * scale``.

    ``scale`` keeps the weight's rank, with size 1 on every axis but the channel axes
    (by default the last one; any set of axes with ``from_array(w, axis=(...))``, e.g.
    one scale per head and output unit of an ``nnx.Einsum`` kernel ``(heads, d, k)``).

    Examples:
        >>> q = qax.quant.Int8Weight.from_array(jnp.ones((4, 3)))
        >>> q.q.dtype, q.scale.shape
        (dtype('int8'), (1, 3))
        >>> qax.quant.Int8Weight.from_array(jnp.ones((2, 4, 3)), axis=(0, 2)).scale.shape
        (2, 1, 3)

    Attributes:
      q: the int8 codes, in ``[-127, 127]``.
      scale: the per-channel scales (the dtype the weight decodes to).
    """

    q: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)

    _ARRAYS = ("q", "scale")

    def compute_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @classmethod
    def from_array(
        cls, w: jax.Array, axis: int | tuple[int, ...] = -1, batch_ndim: int = 0
    ) -> Int8Weight:
        """Quantize ``w`` with one scale per index of the ``axis`` axes (absmax / 127).

        Args:
          w: a floating-point weight.
          axis: the output-channel axis (default: the last one), or a tuple of axes:
            one scale per position along all of them, the absmax taken over the
            others (negative axes count from the end).
          batch_ndim: leading axes that stack independent weights (scanned layers);
            each gets its own scales.

        Returns:
          The quantized weight.

        Raises:
          ValueError: an axis is out of range for ``w``.
        """
        w = jnp.asarray(w)
        absmax = _channel_absmax(cls, w, axis, batch_ndim)
        scale = jnp.where(absmax > 0, absmax / 127, 1).astype(w.dtype)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        return cls(q, scale, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, q: Any, scale: Any) -> jax.Array:
        return q.astype(self.dtype) * scale

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """The codes run along every dimension of the weight; the scales only along
        the channel axes (their other dimensions have size 1)."""
        return _channel_field_dims(self)


class _PackedFourBits(QuantizedWeight):
    """4-bit codes packed two per byte along the last axis (`Int4Weight`, `NF4Weight`)."""

    def compute_shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])


class Int4Weight(_PackedFourBits):
    """4-bit symmetric integers, two per byte, with one scale per group along the last
    axis: ``w[..., g*s:(g+1)*s] ≈ (code - 8) * scale[..., g]``.

    Examples:
        >>> q = qax.quant.Int4Weight.from_array(jnp.ones((4, 64)), group_size=32)
        >>> q.packed.shape, q.scale.shape
        ((4, 32), (4, 2))

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: codes ``0..15`` (value + 8), the
        even element in the low nibble.
      scale: ``(*lead, n // group_size)`` floating-point scales.
      group_size: numbers per scale.
    """

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    group_size: int = qax.aux_field(default=64)

    _ARRAYS = ("packed", "scale")

    @classmethod
    def from_array(
        cls, w: jax.Array, group_size: int = 64, batch_ndim: int = 0
    ) -> Int4Weight:
        """Quantize ``w`` group-wise along its last axis: codes in ``[-8, 7]``, one
        scale per group, set so that the group's largest number is 7 steps or its
        most negative -8 steps.

        ``batch_ndim`` leading axes stack independent weights (scanned layers).

        Raises:
          ValueError: the last axis is not a multiple of ``group_size``, or odd.
        """
        return _quantize_blocks(cls, w, "group_size", group_size, batch_ndim, _int4)

    def _decode(self, packed: Any, scale: Any) -> jax.Array:
        values = _unpack(packed).astype(jnp.int32) - 8
        groups = _blocks(values.astype(self.dtype), self.group_size)
        return (groups * scale[..., None]).reshape(values.shape)


class NF4Weight(_PackedFourBits):
    """QLoRA's 4-bit NormalFloat: codes into `NF4_LEVELS`, two per byte, with one
    absmax per block along the last axis: ``w ≈ NF4_LEVELS[code] * absmax[block]``.

    Examples:
        >>> q = qax.quant.NF4Weight.from_array(jax.random.normal(key, (8, 128)))
        >>> q.packed.dtype, q.packed.shape, q.absmax.shape
        (dtype('uint8'), (8, 64), (8, 2))

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: indices into `NF4_LEVELS`, the
        even element in the low nibble.
      absmax: ``(*lead, n // block_size)`` floating-point block scales.
      block_size: numbers per block (64, as in QLoRA).
    """

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    absmax: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int = qax.aux_field(default=64)

    _ARRAYS = ("packed", "absmax")

    @classmethod
    def from_array(
        cls, w: jax.Array, block_size: int = 64, batch_ndim: int = 0
    ) -> NF4Weight:
        """Quantize ``w`` block-wise along its last axis to the nearest NF4 level.

        ``batch_ndim`` leading axes stack independent weights (scanned layers).

        Raises:
          ValueError: the last axis is not a multiple of ``block_size``, or odd.
        """
        return _quantize_blocks(cls, w, "block_size", block_size, batch_ndim, _nf4)

    def _decode(self, packed: Any, absmax: Any) -> jax.Array:
        levels = jnp.asarray(NF4_LEVELS, self.dtype)[_unpack(packed)]
        blocks = _blocks(levels, self.block_size) * absmax[..., None]
        return blocks.reshape(levels.shape)


class FP8Weight(QuantizedWeight):
    """FP8 codes (``float8_e4m3fn`` or ``float8_e5m2``) with absmax scales: ``w ≈ q *
    scale``, each scale mapping its absmax to the format's largest finite value.

    Two layouts, chosen by ``block_size``:

    - per channel (``block_size=None``, the default): ``scale`` as for `Int8Weight`,
      with the weight's rank and size 1 on every axis but the channel axes (``axis``);
      products whose contraction leaves the channel axes alone run on the fp8 codes
      (see the module's notes on narrow products);
    - block-wise (``block_size=b``): one scale per ``b`` consecutive numbers along the
      last axis, ``scale`` of shape ``(*lead, n // b)``.

    ``float8_e4m3fn`` keeps 3 mantissa bits (a relative error of at most 1/16 per
    number) up to 448; ``float8_e5m2`` keeps 2 (at most 1/8) with a far wider range.

    Examples:
        >>> q = qax.quant.FP8Weight.from_array(jnp.ones((4, 3)))
        >>> q.q.dtype, q.scale.shape
        (dtype(float8_e4m3fn), (1, 3))
        >>> q = qax.quant.FP8Weight.from_array(
        ...     jnp.ones((4, 256)), fp8_dtype=jnp.float8_e5m2, block_size=128)
        >>> q.q.dtype, q.scale.shape
        (dtype(float8_e5m2), (4, 2))

    Attributes:
      q: the fp8 codes, of the weight's shape.
      scale: the scales (the dtype the weight decodes to).
      block_size: numbers per scale along the last axis, or ``None``: per channel.
    """

    q: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int | None = qax.aux_field(default=None)

    _ARRAYS = ("q", "scale")

    def compute_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @classmethod
    def from_array(
        cls,
        w: jax.Array,
        fp8_dtype: Any = jnp.float8_e4m3fn,
        axis: int | tuple[int, ...] | None = None,
        block_size: int | None = None,
        batch_ndim: int = 0,
    ) -> FP8Weight:
        """Quantize ``w`` to fp8 codes, per channel or per block.

        Args:
          w: a floating-point weight.
          fp8_dtype: ``jnp.float8_e4m3fn`` (the default) or ``jnp.float8_e5m2`` (or
            their names).
          axis: per-channel scales (the default layout): the channel axis (default:
            the last one) or a tuple of axes, as for `Int8Weight`.
          block_size: block-wise scales instead: numbers per scale along the last
            axis, which it must divide.
          batch_ndim: leading axes that stack independent weights (scanned layers);
            each gets its own scales.

        Returns:
          The quantized weight.

        Raises:
          ValueError: ``fp8_dtype`` is not one of the two formats, an axis is out of
            range, both ``axis`` and ``block_size`` are given, or ``block_size`` does
            not divide the last axis.
        """
        try:
            dtype = jnp.dtype(fp8_dtype)
        except TypeError:
            dtype = None
        if dtype not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
            raise ValueError(_BAD_FP8.format(dtype=fp8_dtype))
        w = jnp.asarray(w)
        if block_size is None:
            absmax = _channel_absmax(cls, w, -1 if axis is None else axis, batch_ndim)
        elif axis is not None:
            raise ValueError(
                f"FP8Weight.from_array: axis={axis!r} and block_size={block_size!r}: "
                "pass axis= for per-channel scales or block_size= for block-wise "
                "scales along the last axis, not both."
            )
        else:
            _check_last_axis(cls, w.shape, "block_size", block_size)
            absmax = jnp.max(jnp.abs(_blocks(w, block_size)), axis=-1)
        largest = float(jnp.finfo(dtype).max)
        scale = jnp.where(absmax > 0, absmax / largest, 1).astype(w.dtype)
        wide = scale if block_size is None else jnp.repeat(scale, block_size, axis=-1)
        ratio = w.astype(jnp.float32) / wide.astype(jnp.float32)
        q = jnp.clip(ratio, -largest, largest).astype(dtype)
        return cls(q, scale, block_size, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, q: Any, scale: Any) -> jax.Array:
        # The codes are floats, but fixed: no gradient reaches them (as for integers).
        values = lax.stop_gradient(q).astype(self.dtype)
        if self.block_size is None:
            return values * scale
        blocks = _blocks(values, self.block_size) * scale[..., None]
        return blocks.reshape(values.shape)

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """Per channel: as `Int8Weight` (scales along the channel axes only);
        block-wise: codes and scales along every dimension of the weight."""
        if self.block_size is None:
            return _channel_field_dims(self)
        return super().field_dims()


class IntKWeight(QuantizedWeight):
    """``bits``-bit integers (2 to 8), packed ``bits`` bits per number, with one scale
    per group along the last axis: ``w[..., g*s:(g+1)*s] ≈ (code - 2**(bits-1)) *
    scale[..., g]``.

    The values are in ``[-2**(bits-1), 2**(bits-1) - 1]``, every level used
    (``bits=2``: ``{-2, -1, 0, 1}``; see `from_array` for the scales). The codes (value +
    ``2**(bits-1)``) form a little-endian bit stream along the last axis: code ``i`` of
    a row takes bits ``i*bits`` to ``i*bits + bits - 1`` of the row's bytes, bit 0 being
    the least significant bit of byte 0. A row of ``n`` numbers takes ``n * bits / 8``
    bytes, and each group whole bytes (``group_size * bits`` a multiple of 8: any
    ``group_size`` divisible by 8 does). With ``bits=4`` the bytes are `Int4Weight`'s.

    Examples:
        >>> q = qax.quant.IntKWeight.from_array(jnp.ones((4, 64)), bits=3, group_size=32)
        >>> q.packed.dtype, q.packed.shape, q.scale.shape, q.shape
        (dtype('uint8'), (4, 24), (4, 2), (4, 64))

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n * bits // 8)``: the bit stream.
      scale: ``(*lead, n // group_size)`` floating-point scales.
      bits: bits per number, 2 to 8.
      group_size: numbers per scale.
    """

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    bits: int = qax.aux_field()
    group_size: int = qax.aux_field(default=64)

    _ARRAYS = ("packed", "scale")

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        super().__post_init__()

    def compute_shape(self) -> tuple[int, ...]:
        *lead, n_bytes = self.packed.shape
        return (*lead, n_bytes * 8 // self.bits)

    @classmethod
    def from_array(
        cls, w: jax.Array, bits: int, group_size: int = 64, batch_ndim: int = 0
    ) -> IntKWeight:
        """Quantize ``w`` group-wise along its last axis to ``bits``-bit integers in
        ``[-2**(bits-1), 2**(bits-1) - 1]``, one scale per group (from 4 bits, the
        group's largest number or its most negative lands exactly on the end of the
        range; at 2 and 3 bits the scale is ``absmax / (2**(bits-1) - 0.5)``).

        Args:
          w: a floating-point weight.
          bits: bits per number, 2 to 8.
          group_size: numbers per scale; it must divide the last axis, and
            ``group_size * bits`` must be a multiple of 8.
          batch_ndim: leading axes that stack independent weights (scanned layers).

        Returns:
          The quantized weight.

        Raises:
          ValueError: ``bits`` is not an integer from 2 to 8, or ``group_size`` does
            not fit the last axis.
        """
        _check_bits(bits)
        w = jnp.asarray(w)
        unit = _chunk(bits)[0]
        _check_last_axis(
            cls,
            w.shape,
            "group_size",
            group_size,
            unit=unit,
            why=f"each group of {bits}-bit numbers fills whole bytes",
        )
        packed, scale = _encode_intk(w, bits, group_size)
        return cls(packed, scale, bits, group_size, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, packed: Any, scale: Any) -> jax.Array:
        values = _unpack_bits(packed, self.bits) - 2 ** (self.bits - 1)
        groups = _blocks(values.astype(self.dtype), self.group_size)
        return (groups * scale[..., None]).reshape(values.shape)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _encode_intk(w: jax.Array, bits: int, group_size: int) -> tuple[jax.Array, ...]:
    """The packed codes and group scales of `IntKWeight.from_array` (one compiled
    program per shape, rather than a dispatch per bit-packing step)."""
    q, scale = _signed_codes(_blocks(w, group_size), bits)
    return _pack_bits((q + 2 ** (bits - 1)).reshape(w.shape), bits), scale


def _signed_codes(blocks: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
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


def _check_bits(bits: Any) -> None:
    ok = isinstance(bits, (int, np.integer)) and not isinstance(bits, bool)
    if not (ok and 2 <= bits <= 8):
        raise ValueError(_BAD_BITS.format(bits=bits, names=", ".join(FORMATS)))


def _check_last_axis(
    cls: type,
    shape: tuple,
    what: str,
    size: Any,
    unit: int = 1,
    why: str = "",
) -> None:
    last = shape[-1] if shape else 0
    ok = isinstance(size, (int, np.integer)) and not isinstance(size, bool)
    if not shape or not ok or size <= 0 or size % unit or last % size:
        raise ValueError(
            _LAST_AXIS.format(
                cls=cls.__name__,
                shape=tuple(shape),
                what=what,
                size=size,
                last=last,
                unit=f" (and {what} a multiple of {unit}: {why})" if unit > 1 else "",
                hint=f" and is a multiple of {unit}" if unit > 1 else "",
            )
        )


def _quantize_blocks(
    cls: type,
    w: jax.Array,
    what: str,
    size: int,
    batch_ndim: int,
    encode: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
) -> QuantizedWeight:
    """The 4-bit formats' `from_array`: blocks of `size` along the last axis, each
    coded by ``encode(blocks, absmax) -> (codes 0..15, scales)``, codes packed."""
    w = jnp.asarray(w)
    _check_last_axis(
        cls, w.shape, what, size, unit=2, why="two 4-bit numbers share a byte"
    )
    blocks = _blocks(w, size)
    codes, scale = encode(blocks, jnp.max(jnp.abs(blocks), axis=-1))
    packed = _pack(codes.reshape(w.shape))
    return cls(packed, scale, size, weight_ndim=w.ndim - batch_ndim)


def _int4(blocks: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """4-bit codes (value + 8) and the group scales, as `IntKWeight` with 4 bits."""
    q, scale = _signed_codes(blocks, 4)
    return q + 8, scale


def _nf4(blocks: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The nearest NF4 level of each number over its block's absmax, and the absmax."""
    safe = jnp.where(absmax > 0, absmax, 1).astype(blocks.dtype)
    normalized = (blocks / safe[..., None]).astype(jnp.float32)
    midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
    codes = jnp.searchsorted(jnp.asarray(midpoints), normalized, method="compare_all")
    return codes, safe


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
    dense = jax.eval_shape(
        lambda a, b: primitive.bind(a, b, **params),
        *(jax.ShapeDtypeStruct(jnp.shape(a), a.dtype) for a in (lhs, rhs)),
    )
    if not jnp.issubdtype(dense.dtype, jnp.floating):
        return None
    codes = lax.stop_gradient(w.q)  # fixed, as in `dequantize`
    operands = (codes, x) if weight_side == 0 else (x, codes)
    out = primitive.bind(*operands, **{**params, "preferred_element_type": dense.dtype})
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


@qax.primitive_handler("gather")
def _gather_rows(
    primitive, w: QuantizedWeight, indices: jax.Array, *, dimension_numbers, **params
) -> jax.Array:
    """Gather the codes and scales of the rows, then decode only those rows.

    Applies when the lookup indexes leading axes and keeps the last axis whole, at the
    end of the result (``table[ids]``); otherwise the whole weight is decoded first.
    """
    dn, sizes = dimension_numbers, tuple(params.pop("slice_sizes"))
    indexed = (*dn.collapsed_slice_dims, *dn.start_index_map, *dn.operand_batching_dims)
    out_ndim = indices.ndim - 1 + len(dn.offset_dims)
    last = w.ndim - 1
    if (
        w.ndim < 2
        or last in indexed
        or sizes[-1] != w.shape[-1]
        or dn.offset_dims[-1:] != (out_ndim - 1,)
    ):
        return primitive.bind(
            w.dequantize(), indices, dimension_numbers=dn, slice_sizes=sizes, **params
        )
    changes = {}
    for field in dataclasses.fields(w):
        leaf = getattr(w, field.name)
        if not isinstance(leaf, jax.Array) or leaf.ndim != w.ndim:
            continue
        if tuple(leaf.shape[:-1]) == tuple(w.shape[:-1]):
            changes[field.name] = primitive.bind(
                leaf,
                indices,
                dimension_numbers=dn,
                slice_sizes=(*sizes[:-1], leaf.shape[-1]),
                **params,
            )
        elif any(d != 1 for d in leaf.shape[:-1]):  # a scale per row of another axis
            return primitive.bind(
                w.dequantize(),
                indices,
                dimension_numbers=dn,
                slice_sizes=sizes,
                **params,
            )
    return w._decode(**{n: changes.get(n, getattr(w, n)) for n in w._ARRAYS})


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
    """Ops that move elements: decode, then run them (inside the handler)."""
    return primitive.bind(w.dequantize(), **params)


@qax.primitive_handler("transpose")
def _transpose_int8(primitive, w: Int8Weight, *, permutation) -> Any:
    """Per-channel int8 transposes exactly: codes and (broadcastable) scales."""
    return _transpose_per_channel(primitive, w, permutation)


@qax.primitive_handler("transpose")
def _transpose_fp8(primitive, w: FP8Weight, *, permutation) -> Any:
    """Per-channel fp8 likewise; block-wise fp8 decodes first."""
    return _transpose_per_channel(primitive, w, permutation)


def _transpose_per_channel(primitive, w: QuantizedWeight, permutation) -> Any:
    if not _per_channel(w):
        return primitive.bind(w.dequantize(), permutation=permutation)
    return dataclasses.replace(
        w,
        q=lax.transpose(w.q, permutation),
        scale=lax.transpose(w.scale, permutation),
        shape=None,
        dtype=None,
        weight_ndim=None,
    )


# ----------------------------------------------------------------------------------------
# Parameter trees

_FORMATS: dict[str, tuple[type, dict[str, Any]]] = {
    "int8": (Int8Weight, {}),
    "int4": (Int4Weight, {}),
    "nf4": (NF4Weight, {}),
    "fp8_e4m3": (FP8Weight, {"fp8_dtype": jnp.float8_e4m3fn}),
    "fp8_e5m2": (FP8Weight, {"fp8_dtype": jnp.float8_e5m2}),
    **{f"int{k}": (IntKWeight, {"bits": k}) for k in (2, 3, 5, 6, 7)},
}

FORMATS: tuple[str, ...] = tuple(_FORMATS)
"""The format names `quantize` and `quantize_dequantize` take: ``"int8"``, ``"int4"``,
``"nf4"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int2"``, ``"int3"``, ``"int5"``,
``"int6"``, ``"int7"`` (see the module's notes)."""

_OPTIONS = ("axis", "group_size", "block_size", "batch_ndim", "bits", "fp8_dtype")


def _block_size(options: dict) -> int:
    return options.get("block_size", options.get("group_size", 64))


def _skip_size(cls: type, options: dict) -> Any:
    """The block size that a weight's last axis must be a multiple of."""
    if issubclass(cls, FP8Weight):
        return options.get("block_size")
    if issubclass(cls, IntKWeight):
        return options.get("group_size", 64)
    return _block_size(options)


def _fits(cls: type, leaf: Any, options: dict) -> bool:
    if cls is Int8Weight:
        return True
    size = _skip_size(cls, options)
    if issubclass(cls, (FP8Weight, IntKWeight)):  # a bad size is from_array's error
        return size is None or not isinstance(size, int) or leaf.shape[-1] % size == 0
    return size % 2 == 0 and leaf.shape[-1] % size == 0


def quantize(
    params: Any,
    fmt: str | type = "nf4",
    *,
    filter: Any = None,
    rules: Any = None,
    **options: Any,
) -> Any:
    """Replace chosen weights of a params pytree by quantized weights.

    Examples:
        >>> small = qax.quant.quantize(params, "nf4", block_size=64)
        >>> qax.use_implicit_args(model.apply)({"params": small}, x)
        >>> fp8 = qax.quant.quantize(params, "fp8_e4m3")          # per channel
        >>> int3 = qax.quant.quantize(params, "int3", group_size=32)
        >>> int8g = qax.quant.quantize(params, qax.quant.IntKWeight, bits=8)

    Args:
      params: any pytree (Flax linen dict, NNX state, Equinox module, ...).
      fmt: a name in `FORMATS` (``"int8"``, ``"int4"``, ``"nf4"``, ``"fp8_e4m3"``,
        ``"fp8_e5m2"``, ``"int2"``, ``"int3"``, ``"int5"``, ``"int6"``, ``"int7"``), or
        one of the classes (`IntKWeight` with ``bits=``: any of 2 to 8 bits,
        group-wise).
      filter: ``filter(path, leaf) -> bool`` (``path`` as in `qax.lora.loraify`).
        Default: `qax.lora.default_filter` (every 2-D+ weight but embeddings, norms and
        biases), skipping weights whose last axis is not a multiple of the block size
        (the group size of the integer formats), with a warning that names them.
      rules: per-path settings, like qwix's rules: an ordered list of ``(pattern,
        settings)``. The first pattern (a regular expression) that matches all of a
        weight's path decides for it: ``settings`` is a dict with a ``"format"`` and
        options overriding this call's (``axis``, ``group_size``, ``block_size``,
        ``batch_ndim``, ``bits``, ``fp8_dtype``), the weight then chosen whatever
        ``filter`` says; or ``None``, to keep it dense. Weights no pattern matches
        follow ``filter``, ``fmt`` and ``options``. E.g. ``rules=[(".*/attn/.*",
        {"format": "int8"}), (".*/head/.*", None)]``. A rule that picks another
        format than the call's takes, of the call's options, ``batch_ndim``, ``axis``
        (int8, fp8) and the block size (``block_size`` or ``group_size``, under the
        name the format uses; not int8).
      **options: passed to ``from_array``: ``axis`` (int8 and per-channel fp8: an axis
        or a tuple of axes that keep their own scales), ``group_size`` (int4,
        int2...int7 and `IntKWeight`), ``block_size`` (nf4; fp8: block-wise scales
        instead of per-channel), ``bits`` (`IntKWeight`), ``fp8_dtype`` (`FP8Weight`),
        ``batch_ndim`` (stacked layers; an int or a function of ``(path, leaf)``).

    Returns:
      ``params`` with quantized weights. Weights trained with quantization-aware
      training (`qax.qat.FakeQuant`, also as the base of a `qax.lora.LoraWeight`)
      become exactly the quantized weights they were trained against, in their own
      format and options, whatever ``fmt`` says; other implicit arrays are kept.

    Raises:
      ValueError: an unknown format, an option that contradicts the format's name
        (``"int3"`` with ``bits=5``), `IntKWeight` without ``bits``, or a weight chosen
        by ``filter`` that the format cannot hold.
    """
    cls, preset = _format(fmt)
    options = _with_preset(fmt, preset, options)
    _check_options(cls, options)
    lookup = qax.utils.path_rules(rules, ("format", *_OPTIONS), "quantize")
    skipped = []  # chosen by the default filter, but the format cannot hold them

    def choose(path: str, leaf: Any) -> bool:
        if filter is not None:
            return filter(path, leaf)
        if not default_filter(path, leaf):
            return False
        if not _fits(cls, leaf, options):
            skipped.append(f"{path} {tuple(leaf.shape)}")
            return False
        return True

    def convert(path, leaf):
        if isinstance(leaf, qax.ImplicitArray):
            # A `qax.qat.FakeQuant` (also as a LoRA base) becomes the codes it was
            # trained against, in its own format; other implicit arrays stay.
            return qax.qat.convert(leaf)
        if not hasattr(leaf, "shape"):
            return leaf
        name = qax.utils.path_string(path)
        matched, settings = lookup(name)
        if matched and settings is None:
            return leaf
        if not matched and not choose(name, leaf):
            return leaf
        kind, kwargs = cls, dict(options)
        if settings:
            settings = dict(settings)
            rule_fmt = settings.pop("format", fmt)
            kind, rule_preset = _format(rule_fmt)
            if kind is not cls:  # the call's options that this format takes
                kwargs = _options_for(kind, options)
            kwargs.update(_with_preset(rule_fmt, rule_preset, settings))
            _check_options(kind, kwargs)
        if callable(kwargs.get("batch_ndim")):
            kwargs["batch_ndim"] = kwargs["batch_ndim"](name, leaf)
        return kind.from_array(leaf, **kwargs)

    out = qax.utils.tree_map_with_path_with_implicit(convert, params)
    if skipped:
        warnings.warn(
            f"quantize(..., {cls.__name__}) kept {len(skipped)} weight(s) unquantized: "
            "their last axis is not a multiple of the block size "
            f"{_skip_size(cls, options)}: {', '.join(skipped)}. Pass a block size that "
            "divides it (block_size= for nf4 and fp8, group_size= for int4 and "
            "int2...int7), or a `filter` that leaves them out.",
            stacklevel=2,
        )
    return out


def quantize_dequantize(
    x: jax.Array, fmt: str | type = "nf4", **options: Any
) -> jax.Array:
    """The array that ``x`` quantized in a format decodes to (quantize, then decode).

    A pure function of ``x``, differentiable as its operations are (rounding has a zero
    derivative almost everywhere). For quantization-aware training, with
    straight-through gradients, use `qax.qat.FakeQuant` / `qax.qat.fake_quantize`.

    Examples:
        >>> w = jax.random.normal(jax.random.key(0), (64, 128))
        >>> err = qax.quant.quantize_dequantize(w, "int3", group_size=32) - w

    Args:
      x: a floating-point array, quantized as one weight (``batch_ndim=`` for stacked
        ones).
      fmt: a format name in `FORMATS` or a `QuantizedWeight` class, as in `quantize`.
      **options: the format's ``from_array`` options (``axis``, ``group_size``,
        ``block_size``, ``bits``, ``fp8_dtype``, ``batch_ndim``).

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      ValueError: as `quantize`, or the format cannot hold ``x``'s shape.
    """
    cls, preset = _format(fmt)
    options = _with_preset(fmt, preset, options)
    _check_options(cls, options)
    return cls.from_array(x, **options).dequantize()


def _with_preset(fmt: Any, preset: dict, options: dict) -> dict:
    """``options`` with what the format's name fixes (``"int3"``: ``bits=3``)."""
    for key, value in preset.items():
        given = options.get(key, value)
        if not _same(key, given, value):
            raise ValueError(
                f"quantize: format {fmt!r} means {key}={_show(value)}, but {key}="
                f"{given!r} was given. Name the format that has it, or pass the class "
                f"with the option: qax.quant.{_FORMATS[fmt][0].__name__} with "
                f"{key}={given!r}."
            )
    return {**options, **preset}


def _same(key: str, a: Any, b: Any) -> bool:
    if key != "fp8_dtype":
        return a == b
    try:
        return jnp.dtype(a) == jnp.dtype(b)
    except TypeError:
        return False


def _show(value: Any) -> str:
    return jnp.dtype(value).name if isinstance(value, type) else repr(value)


def _check_options(cls: type, options: dict) -> None:
    if issubclass(cls, IntKWeight) and "bits" not in options:
        raise ValueError(
            "quantize: IntKWeight needs bits= (2 to 8), e.g. quantize(params, "
            "qax.quant.IntKWeight, bits=8) for group-wise int8; or a format name: "
            f"{', '.join(FORMATS)}."
        )


def _options_for(cls: type, options: dict) -> dict:
    """The options of `quantize`'s call that `cls.from_array` takes, for a rule that
    picks another format than the call's: ``batch_ndim``; ``axis`` for int8 and fp8;
    the block size (``block_size`` or ``group_size``) under the name the format uses
    (not for int8)."""
    if cls not in {kind for kind, _ in _FORMATS.values()}:
        return dict(options)
    out = {"batch_ndim": options["batch_ndim"]} if "batch_ndim" in options else {}
    if cls in (Int8Weight, FP8Weight) and "axis" in options:
        out["axis"] = options["axis"]
    if cls is not Int8Weight and ("block_size" in options or "group_size" in options):
        name = "group_size" if cls in (Int4Weight, IntKWeight) else "block_size"
        out[name] = _block_size(options)
    return out


def _format(fmt: Any) -> tuple[type, dict[str, Any]]:
    """The class of a format (a name or a class) and the options its name fixes."""
    if isinstance(fmt, str) and fmt in _FORMATS:
        return _FORMATS[fmt]
    if isinstance(fmt, type) and issubclass(fmt, QuantizedWeight):
        return fmt, {}
    raise ValueError(
        f"quantize: unknown format {fmt!r}; use one of {', '.join(FORMATS)}, or a "
        "QuantizedWeight subclass (qax.quant.IntKWeight with bits= for any of 2 to 8 "
        "bits)."
    )


def dequantize(params: Any) -> Any:
    """Replace every quantized weight by the dense weight it decodes to.

    Examples:
        >>> dense = qax.quant.dequantize(qax.quant.quantize(params, "int8"))

    Args:
      params: a pytree holding quantized weights (also inside `qax.lora.LoraWeight`).

    Returns:
      The tree with plain arrays in their place.
    """

    def is_q(x: Any) -> bool:
        return isinstance(x, QuantizedWeight)

    return jax.tree_util.tree_map(
        lambda x: x.dequantize() if is_q(x) else x, params, is_leaf=is_q
    )
