"""Quantized weights that stay quantized: `Int8Weight`, `Int4Weight`, `NF4Weight`.

Each type stores integer codes plus floating-point scales and behaves like the dense
weight they decode to. The handlers decode *inside* the operation that uses the weight,
so the full-precision weight never exists as a parameter or an input of the program:

- ``dot_general`` (any layout, either side) and ``conv_general_dilated``: decode, then
  the product (XLA fuses the decoding into it);
- ``gather`` of rows (embedding lookups): only the gathered rows are decoded;
- ``convert_element_type`` to a floating dtype: the same codes, decoding to that dtype
  (``w.astype(jnp.bfloat16)`` keeps 4-bit storage); ``mul`` by a scalar rescales the
  scales; ``transpose`` of an `Int8Weight` transposes its codes; ``stop_gradient``;
- ``add`` / ``sub`` (merging a LoRA into a quantized base): decoded inside the handler.

The formats:

- `Int8Weight`: symmetric int8 with one scale per output channel (``axis``, by default the
  last axis: the output axis of a Flax ``(in, out)`` kernel; or a tuple of axes, e.g.
  heads and outputs of an einsum kernel). 1 byte per number.
- `Int4Weight`: symmetric 4-bit integers in ``[-8, 7]`` with one scale per group of
  ``group_size`` consecutive numbers along the last axis; two numbers per byte.
- `NF4Weight`: QLoRA's 4-bit NormalFloat: 16 levels at quantiles of a standard normal
  (one of them exactly zero), one absmax scale per block of ``block_size`` numbers along
  the last axis; two numbers per byte. For normally distributed weights its error is
  lower than `Int4Weight`'s at the same size (see ``benchmarks/bench_quant.py``).

Gradients flow into the scales as they would into the decoded weight (the codes are
integers and get none). A quantized base is meant to stay fixed: differentiate with
respect to the LoRA factors only (`qax.lora.split`), or wrap it in
`jax.lax.stop_gradient` (which `qax.lora.LoraWeight` does for its ``w``; the handler
keeps the weight quantized), and no weight-sized gradient is computed for it.
Train on top of them with `qax.lora` (QLoRA):

Examples:
    >>> base = qax.quant.quantize(params, "nf4")
    >>> params = qax.lora.loraify(base, rank=8, key=jax.random.key(0))
    >>> adapters, base = qax.lora.split(params)   # train `adapters` as in qax.lora

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
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
    "NF4_LEVELS",
    "Int4Weight",
    "Int8Weight",
    "NF4Weight",
    "QuantizedWeight",
    "dequantize",
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
    "{what}={size} (and even, two 4-bit numbers share a byte). Pass a {what} that "
    "divides {last}, or leave this weight out with `filter=`."
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
        axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
        if not all(
            isinstance(a, (int, np.integer)) and -w.ndim <= a < w.ndim for a in axes
        ):
            raise ValueError(
                f"Int8Weight.from_array: axis={axis!r} for a weight of shape "
                f"{tuple(w.shape)}: each channel axis must be an integer in "
                f"[-{w.ndim}, {w.ndim})."
            )
        kept = {a % w.ndim for a in axes}
        others = tuple(i for i in range(batch_ndim, w.ndim) if i not in kept)
        absmax = jnp.max(jnp.abs(w), axis=others, keepdims=True)
        scale = jnp.where(absmax > 0, absmax / 127, 1).astype(w.dtype)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        return cls(q, scale, weight_ndim=w.ndim - batch_ndim)

    def _decode(self, q: Any, scale: Any) -> jax.Array:
        return q.astype(self.dtype) * scale

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """The codes run along every dimension of the weight; the scales only along
        the channel axes (their other dimensions have size 1)."""
        rank = self.weight_ndim
        nb = len(self.shape) - rank
        channel = tuple(d != 1 for d in jnp.shape(self.scale)[nb:])
        return {
            "q": tuple(range(rank)),
            "scale": tuple(i if keep else None for i, keep in enumerate(channel)),
        }


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
        """Quantize ``w`` group-wise along its last axis (absmax / 7 per group).

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


def _check_last_axis(cls: type, shape: tuple, what: str, size: int) -> None:
    last = shape[-1] if shape else 0
    if not shape or size < 2 or size % 2 or last % size:
        raise ValueError(
            _LAST_AXIS.format(
                cls=cls.__name__, shape=tuple(shape), what=what, size=size, last=last
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
    _check_last_axis(cls, w.shape, what, size)
    blocks = _blocks(w, size)
    codes, scale = encode(blocks, jnp.max(jnp.abs(blocks), axis=-1))
    packed = _pack(codes.reshape(w.shape))
    return cls(packed, scale, size, weight_ndim=w.ndim - batch_ndim)


def _int4(blocks: jax.Array, absmax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric 4-bit codes (value + 8) and the group scales ``absmax / 7``."""
    scale = jnp.where(absmax > 0, absmax / 7, 1).astype(blocks.dtype)
    q = jnp.clip(jnp.round(blocks / scale[..., None]), -8, 7).astype(jnp.int32)
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
    return primitive.bind(x, w.dequantize(), **params)


@qax.primitive_handler("dot_general")
def _product_w_x(primitive, w: QuantizedWeight, x: jax.Array, **params) -> jax.Array:
    return primitive.bind(w.dequantize(), x, **params)


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
def _transpose_int8(primitive, w: Int8Weight, *, permutation) -> Int8Weight:
    """Per-channel int8 transposes exactly: codes and (broadcastable) scales."""
    if w.q.ndim != w.ndim:
        return primitive.bind(w.dequantize(), permutation=permutation)
    return Int8Weight(
        lax.transpose(w.q, permutation), lax.transpose(w.scale, permutation)
    )


# ----------------------------------------------------------------------------------------
# Parameter trees

_FORMATS = {"int8": Int8Weight, "int4": Int4Weight, "nf4": NF4Weight}


def _block_size(options: dict) -> int:
    return options.get("block_size", options.get("group_size", 64))


def _fits(cls: type, leaf: Any, options: dict) -> bool:
    if cls is Int8Weight:
        return True
    size = _block_size(options)
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

    Args:
      params: any pytree (Flax linen dict, NNX state, Equinox module, ...).
      fmt: ``"int8"``, ``"int4"``, ``"nf4"``, or one of the classes.
      filter: ``filter(path, leaf) -> bool`` (``path`` as in `qax.lora.loraify`).
        Default: `qax.lora.default_filter` (every 2-D+ weight but embeddings, norms and
        biases), skipping weights whose last axis is not a multiple of the block size,
        with a warning that names them.
      rules: per-path settings, like qwix's rules: an ordered list of ``(pattern,
        settings)``. The first pattern (a regular expression) that matches all of a
        weight's path decides for it: ``settings`` is a dict with a ``"format"`` and
        options overriding this call's (``axis``, ``group_size``, ``block_size``,
        ``batch_ndim``), the weight then chosen whatever ``filter`` says; or ``None``,
        to keep it dense. Weights no pattern matches follow ``filter``, ``fmt`` and
        ``options``. E.g. ``rules=[(".*/attn/.*", {"format": "int8"}),
        (".*/head/.*", None)]``.
      **options: passed to ``from_array``: ``axis`` (int8: an axis or a tuple of
        axes that keep their own scales), ``group_size`` (int4),
        ``block_size`` (nf4), ``batch_ndim`` (stacked layers; an int or a function of
        ``(path, leaf)``).

    Returns:
      ``params`` with quantized weights.

    Raises:
      ValueError: an unknown format, or a weight chosen by ``filter`` that the format
        cannot hold.
    """
    cls = _format(fmt)
    lookup = qax.utils.path_rules(
        rules, ("format", "axis", "group_size", "block_size", "batch_ndim"), "quantize"
    )
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
        if isinstance(leaf, qax.ImplicitArray) or not hasattr(leaf, "shape"):
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
            kind = _format(settings.pop("format", fmt))
            if kind is not cls:  # the call's options that this format takes
                kwargs = _options_for(kind, options)
            kwargs.update(settings)
        if callable(kwargs.get("batch_ndim")):
            kwargs["batch_ndim"] = kwargs["batch_ndim"](name, leaf)
        return kind.from_array(leaf, **kwargs)

    out = qax.utils.tree_map_with_path_with_implicit(convert, params)
    if skipped:
        size = _block_size(options)
        warnings.warn(
            f"quantize(..., {cls.__name__}) kept {len(skipped)} weight(s) unquantized: "
            f"their last axis is not a multiple of the block size {size}: "
            f"{', '.join(skipped)}. Pass a block size that divides it (block_size= for "
            "nf4, group_size= for int4), or a `filter` that leaves them out.",
            stacklevel=2,
        )
    return out


def _options_for(cls: type, options: dict) -> dict:
    """The options of `quantize`'s call that `cls.from_array` takes, for a rule that
    picks another format than the call's: the block size (``block_size`` or
    ``group_size``) under the name the 4-bit format uses, ``axis`` for int8 only."""
    if cls not in _FORMATS.values():
        return dict(options)
    out = {"batch_ndim": options["batch_ndim"]} if "batch_ndim" in options else {}
    if cls is Int8Weight:
        if "axis" in options:
            out["axis"] = options["axis"]
    elif "block_size" in options or "group_size" in options:
        out["group_size" if cls is Int4Weight else "block_size"] = _block_size(options)
    return out


def _format(fmt: Any) -> type:
    cls = _FORMATS.get(fmt) if isinstance(fmt, str) else fmt
    if not (isinstance(cls, type) and issubclass(cls, QuantizedWeight)):
        raise ValueError(
            f"quantize: unknown format {fmt!r}; use one of {sorted(_FORMATS)} or a "
            "QuantizedWeight subclass."
        )
    return cls


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
