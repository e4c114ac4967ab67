"""The quantized weight types (see `qax.quant`); their encodings are in `_codes`.

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax

from . import _codes
from ._codes import NF4_LEVELS

_BLOCK_AXIS = (
    "{cls}: {where} of a weight of shape {shape} must be a multiple of "
    "{what}={size}{unit}. Pass a {what} that divides {last}{hint}, another block_axis, "
    "or leave this weight out with `filter=`."
)
_BAD_BLOCK_AXIS = (
    "{cls}: block_axis={axis!r} for a weight of shape {shape} ({rank} weight axes): "
    "the axis the blocks run along must be an integer in [-{rank}, {rank}) (-1: the "
    "last axis; -2 for the input axis of a Flax (in, out) kernel, as bitsandbytes and "
    "qwix group)."
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


def _reduced_axes(cls: type, w: jax.Array, axis: Any, batch_ndim: int) -> tuple:
    """The axes a per-channel scale reduces over: all but the batch and channel axes."""
    kept = _channel_axes(cls, w, axis)
    return tuple(i for i in range(batch_ndim, w.ndim) if i not in kept)


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


@jax.jit
def _decode_compiled(weight: QuantizedWeight) -> jax.Array:
    """`dequantize` as one program per type, shape and settings: run eagerly (or under
    an eager `grad`/`vmap`), JAX would dispatch and compile each step of the decoding;
    traced, the program is inlined into the caller's."""
    return weight._decode(**{n: getattr(weight, n) for n in weight._ARRAYS})


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

    # Public as `qax.quant.X`: the name checkpoints and `jax.export` record.
    __module__ = "qax.quant"

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
        if hasattr(self, "block_axis"):
            axis = self.block_axis
            if not (_is_int(axis) and axis < 0 and (n is None or axis >= -max(n, 1))):
                raise ValueError(
                    f"{type(self).__name__}: block_axis must count from the end of "
                    f"one weight's axes (-1: the last axis), got {axis!r}; "
                    "`from_array` also takes it counted from the start."
                )
            self.block_axis = int(axis)
        super().__post_init__()

    def dequantize(self) -> jax.Array:
        """The dense weight the codes stand for (differentiable in the scales)."""
        return _decode_compiled(self)

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
        # from shapes and dtypes: a leaf split over processes has no local value
        leaves = jax.tree_util.tree_leaves(self)
        return sum(
            math.prod(np.shape(x))
            * np.dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x)).itemsize
            for x in leaves
        )


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

    __module__ = "qax.quant"

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
        q, scale = _codes.encode_int8(w, _reduced_axes(cls, w, axis, batch_ndim))
        return cls(q, scale, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, q: Any, scale: Any) -> jax.Array:
        return q.astype(self.dtype) * scale

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """The codes run along every dimension of the weight; the scales only along
        the channel axes (their other dimensions have size 1)."""
        return _channel_field_dims(self)


class _PackedFourBits(QuantizedWeight):
    """4-bit codes packed two per byte along the blocks' axis (`Int4Weight`,
    `NF4Weight`)."""

    __module__ = "qax.quant"

    def compute_shape(self) -> tuple[int, ...]:
        return _unpacked_shape(self.packed.shape, self.block_axis, 2, 1)


class Int4Weight(_PackedFourBits):
    """4-bit symmetric integers, two per byte, with one scale per group along the last
    axis: ``w[..., g*s:(g+1)*s] ≈ (code - 8) * scale[..., g]`` (or along another axis:
    ``block_axis``).

    Examples:
        >>> q = qax.quant.Int4Weight.from_array(jnp.ones((4, 64)), group_size=32)
        >>> q.packed.shape, q.scale.shape
        ((4, 32), (4, 2))
        >>> q = qax.quant.Int4Weight.from_array(jnp.ones((64, 4)), 32, block_axis=0)
        >>> q.packed.shape, q.scale.shape
        ((32, 4), (2, 4))

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: codes ``0..15`` (value + 8), the
        even element in the low nibble (the blocks' axis halved).
      scale: ``(*lead, n // group_size)`` floating-point scales.
      group_size: numbers per scale.
      block_axis: the axis the groups (and pairs of codes) run along, counted from
        the end of one weight's axes: -1, the last axis (the default).
    """

    __module__ = "qax.quant"

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    group_size: int = qax.aux_field(default=64)
    block_axis: int = qax.aux_field(default=-1)

    _ARRAYS = ("packed", "scale")

    @classmethod
    def from_array(
        cls,
        w: jax.Array,
        group_size: int = 64,
        batch_ndim: int = 0,
        block_axis: int = -1,
    ) -> Int4Weight:
        """Quantize ``w`` group-wise along its last axis (or ``block_axis``): codes in
        ``[-8, 7]``, one scale per group, set so that the group's largest number is 7
        steps or its most negative -8 steps.

        ``batch_ndim`` leading axes stack independent weights (scanned layers).
        ``block_axis``: the axis of one weight the groups run along (``-2``, the input
        axis of a Flax ``(in, out)`` kernel, groups numbers that one output sums over,
        as bitsandbytes and qwix do).

        Raises:
          ValueError: the blocks' axis is not a multiple of ``group_size``, or odd.
        """
        return _quantize_blocks(
            cls, w, "group_size", group_size, batch_ndim, block_axis, _codes.int4_codes
        )

    def _decode(self, packed: Any, scale: Any) -> jax.Array:
        k = self.block_axis
        values = _codes.unpack4(_codes.to_last(packed, k)).astype(jnp.int32) - 8
        return _codes.scale_blocks(values.astype(self.dtype), scale, self.group_size, k)


class NF4Weight(_PackedFourBits):
    """QLoRA's 4-bit NormalFloat: codes into `NF4_LEVELS`, two per byte, with one
    absmax per block along the last axis (or ``block_axis``): ``w ≈ NF4_LEVELS[code] *
    absmax[block]``.

    Examples:
        >>> q = qax.quant.NF4Weight.from_array(jax.random.normal(key, (8, 128)))
        >>> q.packed.dtype, q.packed.shape, q.absmax.shape
        (dtype('uint8'), (8, 64), (8, 2))
        >>> q = qax.quant.NF4Weight.from_array(jnp.ones((128, 8)), block_axis=-2)
        >>> q.packed.shape, q.absmax.shape
        ((64, 8), (2, 8))

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n // 2)``: indices into `NF4_LEVELS`, the
        even element in the low nibble (the blocks' axis halved).
      absmax: ``(*lead, n // block_size)`` floating-point block scales.
      block_size: numbers per block (64, as in QLoRA).
      block_axis: the axis the blocks (and pairs of codes) run along, counted from
        the end of one weight's axes: -1, the last axis (the default).
    """

    __module__ = "qax.quant"

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    absmax: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int = qax.aux_field(default=64)
    block_axis: int = qax.aux_field(default=-1)

    _ARRAYS = ("packed", "absmax")

    @classmethod
    def from_array(
        cls,
        w: jax.Array,
        block_size: int = 64,
        batch_ndim: int = 0,
        block_axis: int = -1,
    ) -> NF4Weight:
        """Quantize ``w`` block-wise along its last axis (or ``block_axis``) to the
        nearest NF4 level.

        ``batch_ndim`` leading axes stack independent weights (scanned layers).
        ``block_axis``: the axis of one weight the blocks run along (``-2``, the input
        axis of a Flax ``(in, out)`` kernel, as bitsandbytes and qwix group).

        Raises:
          ValueError: the blocks' axis is not a multiple of ``block_size``, or odd.
        """
        return _quantize_blocks(
            cls, w, "block_size", block_size, batch_ndim, block_axis, _codes.nf4_codes
        )

    def _decode(self, packed: Any, absmax: Any) -> jax.Array:
        k = self.block_axis
        levels = jnp.asarray(NF4_LEVELS, self.dtype)
        values = levels[_codes.unpack4(_codes.to_last(packed, k))]
        return _codes.scale_blocks(values, absmax, self.block_size, k)


class FP8Weight(QuantizedWeight):
    """FP8 codes (``float8_e4m3fn`` or ``float8_e5m2``) with absmax scales: ``w ≈ q *
    scale``, each scale mapping its absmax to the format's largest finite value.

    Two layouts, chosen by ``block_size``:

    - per channel (``block_size=None``, the default): ``scale`` as for `Int8Weight`,
      with the weight's rank and size 1 on every axis but the channel axes (``axis``);
      products whose contraction leaves the channel axes alone run on the fp8 codes
      (see the module's notes on narrow products);
    - block-wise (``block_size=b``): one scale per ``b`` consecutive numbers along the
      last axis (or ``block_axis``), ``scale`` of shape ``(*lead, n // b)``.

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
      block_axis: block-wise, the axis the blocks run along, counted from the end of
        one weight's axes (-1, the default: the last axis).
    """

    __module__ = "qax.quant"

    q: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    block_size: int | None = qax.aux_field(default=None)
    block_axis: int = qax.aux_field(default=-1)

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
        block_axis: int = -1,
    ) -> FP8Weight:
        """Quantize ``w`` to fp8 codes, per channel or per block.

        Args:
          w: a floating-point weight.
          fp8_dtype: ``jnp.float8_e4m3fn`` (the default) or ``jnp.float8_e5m2`` (or
            their names).
          axis: per-channel scales (the default layout): the channel axis (default:
            the last one) or a tuple of axes, as for `Int8Weight`.
          block_size: block-wise scales instead: numbers per scale along the last
            axis (or ``block_axis``), which it must divide.
          batch_ndim: leading axes that stack independent weights (scanned layers);
            each gets its own scales.
          block_axis: block-wise, the axis of one weight the blocks run along (``-2``:
            the input axis of a Flax ``(in, out)`` kernel).

        Returns:
          The quantized weight.

        Raises:
          ValueError: ``fp8_dtype`` is not one of the two formats, an axis is out of
            range, both ``axis`` and ``block_size`` are given, ``block_axis`` without
            ``block_size``, or ``block_size`` does not divide the blocks' axis.
        """
        try:
            dtype = jnp.dtype(fp8_dtype)
        except TypeError:
            dtype = None
        if dtype not in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
            raise ValueError(_BAD_FP8.format(dtype=fp8_dtype))
        w = jnp.asarray(w)
        reduced = None
        if block_size is None:
            if block_axis != -1:
                raise ValueError(
                    f"FP8Weight.from_array: block_axis={block_axis!r} without "
                    "block_size: block_axis places block-wise scales; pass block_size= "
                    "with it, or axis= for per-channel scales."
                )
            reduced = _reduced_axes(cls, w, -1 if axis is None else axis, batch_ndim)
            k = -1
        elif axis is not None:
            raise ValueError(
                f"FP8Weight.from_array: axis={axis!r} and block_size={block_size!r}: "
                "pass axis= for per-channel scales or block_size= for block-wise "
                "scales (along block_axis), not both."
            )
        else:
            k = _block_axis(cls, w, block_axis, batch_ndim)
            _check_block_axis(cls, w.shape, "block_size", block_size, k)
        q, scale = _codes.encode_fp8(w, dtype, reduced, block_size, k)
        return cls(q, scale, block_size, k, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, q: Any, scale: Any) -> jax.Array:
        # The codes are floats, but fixed: no gradient reaches them (as for integers).
        values = lax.stop_gradient(q).astype(self.dtype)
        if self.block_size is None:
            return values * scale
        k = self.block_axis
        return _codes.scale_blocks(_codes.to_last(values, k), scale, self.block_size, k)

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
    With ``block_axis`` (another axis than the last), groups and bit streams run
    along that axis instead.

    Examples:
        >>> q = qax.quant.IntKWeight.from_array(jnp.ones((4, 64)), bits=3, group_size=32)
        >>> q.packed.dtype, q.packed.shape, q.scale.shape, q.shape
        (dtype('uint8'), (4, 24), (4, 2), (4, 64))

    Attributes:
      packed: ``uint8`` of shape ``(*lead, n * bits // 8)``: the bit stream.
      scale: ``(*lead, n // group_size)`` floating-point scales.
      bits: bits per number, 2 to 8.
      group_size: numbers per scale.
      block_axis: the axis the groups and bit streams run along, counted from the end
        of one weight's axes: -1, the last axis (the default).
    """

    __module__ = "qax.quant"

    packed: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim="weight_ndim", stored=True)
    bits: int = qax.aux_field()
    group_size: int = qax.aux_field(default=64)
    block_axis: int = qax.aux_field(default=-1)

    _ARRAYS = ("packed", "scale")

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        super().__post_init__()

    def compute_shape(self) -> tuple[int, ...]:
        return _unpacked_shape(
            self.packed.shape, self.block_axis, *_codes.chunk(self.bits)
        )

    @classmethod
    def from_array(
        cls,
        w: jax.Array,
        bits: int,
        group_size: int = 64,
        batch_ndim: int = 0,
        block_axis: int = -1,
    ) -> IntKWeight:
        """Quantize ``w`` group-wise along its last axis to ``bits``-bit integers in
        ``[-2**(bits-1), 2**(bits-1) - 1]``, one scale per group (from 4 bits, the
        group's largest number or its most negative lands exactly on the end of the
        range; at 2 and 3 bits the scale is ``absmax / (2**(bits-1) - 0.5)``).

        Args:
          w: a floating-point weight.
          bits: bits per number, 2 to 8.
          group_size: numbers per scale; it must divide the last axis (or
            ``block_axis``), and ``group_size * bits`` must be a multiple of 8.
          batch_ndim: leading axes that stack independent weights (scanned layers).
          block_axis: the axis of one weight the groups run along (``-2``: the input
            axis of a Flax ``(in, out)`` kernel).

        Returns:
          The quantized weight.

        Raises:
          ValueError: ``bits`` is not an integer from 2 to 8, or ``group_size`` does
            not fit the blocks' axis.
        """
        _check_bits(bits)
        w = jnp.asarray(w)
        k = _block_axis(cls, w, block_axis, batch_ndim)
        unit = _codes.chunk(bits)[0]
        _check_block_axis(
            cls,
            w.shape,
            "group_size",
            group_size,
            k,
            unit=unit,
            why=f"each group of {bits}-bit numbers fills whole bytes",
        )
        packed, scale = _codes.encode_intk(w, bits, group_size, k)
        return cls(packed, scale, bits, group_size, k, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, packed: Any, scale: Any) -> jax.Array:
        k = self.block_axis
        codes = _codes.unpack_bits(_codes.to_last(packed, k), self.bits)
        values = (codes - 2 ** (self.bits - 1)).astype(self.dtype)
        return _codes.scale_blocks(values, scale, self.group_size, k)


def _check_bits(bits: Any) -> None:
    ok = isinstance(bits, (int, np.integer)) and not isinstance(bits, bool)
    if not (ok and 2 <= bits <= 8):
        raise ValueError(
            _BAD_BITS.format(bits=bits, names=", ".join(qax.quant.FORMATS))
        )


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _unpacked_shape(shape: tuple, axis: int, codes: int, bytes_: int) -> tuple:
    """The weight's shape from its packed codes' ``shape``: ``codes`` numbers in every
    ``bytes_`` bytes along ``axis``."""
    out = list(shape)
    out[axis] = out[axis] // bytes_ * codes
    return tuple(out)


def _axis_words(axis: int) -> str:
    """The blocks' axis in messages."""
    return "the last axis" if axis == -1 else f"axis {axis} (block_axis)"


def _block_axis(cls: type, w: jax.Array, axis: Any, batch_ndim: int) -> int:
    """``axis`` of one weight (the last ``w.ndim - batch_ndim`` axes of ``w``), counted
    from the end, checked."""
    rank = w.ndim - batch_ndim if _is_int(batch_ndim) else w.ndim
    if not (_is_int(axis) and rank > 0 and -rank <= axis < rank):
        raise ValueError(
            _BAD_BLOCK_AXIS.format(
                cls=cls.__name__, axis=axis, shape=tuple(w.shape), rank=rank
            )
        )
    return int(axis) - rank if axis >= 0 else int(axis)


def _check_block_axis(
    cls: type,
    shape: tuple,
    what: str,
    size: Any,
    axis: int = -1,
    unit: int = 1,
    why: str = "",
) -> None:
    n = shape[axis] if shape else 0
    if not shape or not _is_int(size) or size <= 0 or size % unit or n % size:
        raise ValueError(
            _BLOCK_AXIS.format(
                cls=cls.__name__,
                where=_axis_words(axis),
                shape=tuple(shape),
                what=what,
                size=size,
                last=n,
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
    block_axis: int,
    encode: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]],
) -> QuantizedWeight:
    """The 4-bit formats' `from_array`: blocks of `size` along ``block_axis``, each
    coded by ``encode(blocks, absmax) -> (codes 0..15, scales)``, codes packed."""
    w = jnp.asarray(w)
    k = _block_axis(cls, w, block_axis, batch_ndim)
    _check_block_axis(
        cls, w.shape, what, size, k, unit=2, why="two 4-bit numbers share a byte"
    )
    packed, scale = _codes.encode_packed(w, size, encode, k)
    return cls(packed, scale, size, k, weight_ndim=w.ndim - batch_ndim)
