"""The `FakeQuant` type: quantize-dequantize with straight-through gradients (see
`qax.qat`).

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax

_BAD_FORMAT = (
    "FakeQuant: qax.quant.quantize cannot quantize a weight of shape {shape} and dtype "
    "{dtype} to {fmt!r} with options {options}: {error}. Pass a format and options that "
    "`qax.quant.quantize` accepts for this weight (e.g. a block size that divides the "
    "last axis), or leave the weight out with `filter=`."
)

_NO_GROUPS = (
    "FakeQuant: clip_ratio < 1 needs the channels or blocks of the {cls} scales, "
    "but its floating-point fields of rank {ndim} ({shapes}) do not divide the weight's "
    "shape {shape} into channels or blocks. Use clip_ratio=1.0 (no clipping) for this "
    "format."
)

# Settings a rule may give (`fake_quantize(rules=...)`), besides the call's options.
_RULE_KEYS = (
    "format",
    "clip_ratio",
    "activation_bits",
    "axis",
    "group_size",
    "block_size",
    "block_axis",
    "batch_ndim",
)


def _everything(path: str, leaf: Any) -> bool:
    return True


def _quantize_one(w: Any, fmt: Any, options: tuple, batch_ndim: int) -> Any:
    """`qax.quant.quantize` of the single weight ``w`` (the definition of the codes)."""
    kwargs = dict(options)
    if batch_ndim:
        kwargs["batch_ndim"] = batch_ndim
    return qax.quant.quantize({"w": w}, fmt, filter=_everything, **kwargs)["w"]


def _probe(fmt: Any, options: tuple, shape: tuple, dtype: Any, batch_ndim: int):
    """The class and leaves (shapes and dtypes) of the quantized weight, abstractly.

    Raises:
      ValueError: the format cannot hold such a weight (with `_BAD_FORMAT`'s advice).
    """
    found = []

    def run(w: Any) -> list:
        q = _quantize_one(w, fmt, options, batch_ndim)
        found.append(type(q))
        return jax.tree_util.tree_leaves(q)

    try:
        leaves = jax.eval_shape(run, jax.ShapeDtypeStruct(shape, dtype))
    except (ValueError, TypeError) as e:
        raise ValueError(
            _BAD_FORMAT.format(
                shape=tuple(shape),
                dtype=np.dtype(dtype).name,
                fmt=fmt,
                options=dict(options),
                error=e,
            )
        ) from e
    if not found or not issubclass(found[0], qax.ImplicitArray):
        raise ValueError(
            f"FakeQuant: qax.quant.quantize(..., {fmt!r}) did not quantize a weight of "
            f"shape {tuple(shape)}; pass a format name or a qax.quant.QuantizedWeight "
            "subclass."
        )
    return found[0], tuple(leaves)


@functools.lru_cache(maxsize=512)
def _groups(
    fmt: Any, options: tuple, shape: tuple, dtype: Any, batch_ndim: int
) -> tuple[int, ...]:
    """The size of one channel or block of the format's scales along each axis.

    Read from the quantized weight's fields after its codes (the first) that have the
    weight's rank but not its shape (its scales, floating-point or coded: NF4 with
    double quantization's 8-bit absmax, MXFP4's e8m0 exponents): each axis of length
    ``n`` with ``s`` scales along it has blocks of ``n // s``. A rank-0 scale is one
    block. Where there are several (NVFP4's block scales and its scale per weight,
    double quantization's absmax and their group scales), the finest are the blocks.
    """
    cls, leaves = _probe(fmt, options, shape, dtype, batch_ndim)
    scales = {
        tuple(leaf.shape)
        for leaf in leaves[1:]
        if leaf.ndim == 0 or (leaf.ndim == len(shape) and leaf.shape != shape)
    }
    if len(scales) > 1:  # the finest, if it refines every other
        finest = max(scales, key=lambda s: int(np.prod(s)))
        if all(a % b == 0 for s in scales for a, b in zip(finest, s or finest)):
            scales = {finest}
    if len(scales) == 1:
        (s,) = scales
        if not s:
            return tuple(shape)
        if all(d > 0 and n % d == 0 for n, d in zip(shape, s, strict=True)):
            return tuple(n // d for n, d in zip(shape, s, strict=True))
    raise ValueError(
        _NO_GROUPS.format(
            cls=cls.__name__,
            ndim=len(shape),
            shapes=sorted(scales),
            shape=tuple(shape),
        )
    )


def _group_absmax(w: jax.Array, block: tuple[int, ...]) -> jax.Array:
    """Each element's channel or block absolute maximum (blocks of ``block``)."""
    split = []
    for n, b in zip(w.shape, block, strict=True):
        split += [n // b, b]
    a = jnp.abs(w).reshape(split)
    m = jnp.max(a, axis=tuple(range(1, len(split), 2)), keepdims=True)
    return jnp.broadcast_to(m, split).reshape(w.shape)


def _working_dtype(dtype: Any) -> np.dtype:
    """The dtype quantization runs in for a weight of ``dtype`` (see `_working`)."""
    dtype = np.dtype(dtype)
    return dtype if jnp.finfo(dtype).bits >= 32 else np.dtype(np.float32)


def _working(w: jax.Array) -> jax.Array:
    """``w`` in the precision the quantization runs in: at least float32.

    Quantizing a bfloat16 weight in bfloat16 arithmetic is not reproducible: XLA may
    keep the intermediate results of a fused computation in float32, so a jitted
    program and an eager call could round a value near a code boundary differently.
    Upcasting first is exact, and every code is then the same wherever it is computed.
    """
    return w.astype(_working_dtype(w.dtype))


def _clipped(w: jax.Array, spec: _Spec) -> tuple[jax.Array, jax.Array | None]:
    """``w`` clipped to ``clip_ratio`` times its block absmax, and the in-range mask
    (``None``: nothing is clipped)."""
    if spec.clip_ratio >= 1:
        return w, None
    block = _groups(spec.fmt, spec.options, tuple(w.shape), w.dtype, spec.batch_ndim)
    limit = _group_absmax(w, block) * jnp.asarray(spec.clip_ratio, w.dtype)
    return jnp.clip(w, -limit, limit), jnp.abs(w) <= limit


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What the image depends on besides ``w`` (hashable: a static argument)."""

    fmt: Any
    options: tuple
    clip_ratio: float
    batch_ndim: int
    out_dtype: Any


def _cast(q: Any, dtype: Any) -> Any:
    """The quantized weight ``q`` decoding to ``dtype``, as a program that casts it
    gets it (the format's own ``convert_element_type`` handler)."""
    if np.dtype(dtype) == np.dtype(q.dtype):
        return q
    return qax.use_implicit_args(lambda q: q.astype(dtype))(q)


def _quantized(w: jax.Array, spec: _Spec) -> tuple[Any, jax.Array | None]:
    """The quantized weight of ``w`` (decoding to ``w``'s dtype), and the in-range
    mask."""
    w_c, mask = _clipped(_working(w), spec)
    q = _quantize_one(w_c, spec.fmt, spec.options, spec.batch_ndim)
    return _cast(q, w.dtype), mask


def _image(w: jax.Array, spec: _Spec) -> tuple[jax.Array, jax.Array | None]:
    """The fake-quantized weight and the in-range mask."""
    q, mask = _quantized(w, spec)
    return qax.materialize_nested(_cast(q, spec.out_dtype), full=True), mask


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _fake(w: jax.Array, spec: _Spec) -> jax.Array:
    return _image(w, spec)[0]


@_fake.defjvp
def _fake_jvp(spec: _Spec, primals: tuple, tangents: tuple) -> tuple:
    (w,), (t,) = primals, tangents
    value, mask = _image(w, spec)
    if mask is not None:
        t = jnp.where(mask, t, jnp.zeros_like(t))
    return value, t.astype(value.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _fake_activation(x: jax.Array, bits: int) -> jax.Array:
    top = 2 ** (bits - 1) - 1
    absmax = jnp.max(jnp.abs(x))
    scale = jnp.where(absmax > 0, absmax / top, 1).astype(x.dtype)
    return (jnp.clip(jnp.round(x / scale), -top, top) * scale).astype(x.dtype)


@_fake_activation.defjvp
def _fake_activation_jvp(bits: int, primals: tuple, tangents: tuple) -> tuple:
    return _fake_activation(primals[0], bits), tangents[0]


def _normalized_options(options: Any) -> tuple:
    if options is None:
        return ()
    items = options.items() if isinstance(options, dict) else options
    try:
        pairs = [(str(k), v) for k, v in items]
    except (TypeError, ValueError) as e:
        raise ValueError(
            "FakeQuant: options must be a dict of `qax.quant.quantize` options (e.g. "
            f"{{'group_size': 32}}) or a tuple of (name, value) pairs, got {options!r}."
        ) from e
    out = []
    for k, v in sorted(pairs):
        if isinstance(v, list):
            v = tuple(v)
        if k == "batch_ndim":
            raise ValueError(
                "FakeQuant: batch_ndim is not an option of the format: leading axes of "
                "a stack of weights are given by `weight_ndim=` (the rank of one "
                "weight), as `FakeQuant.from_array(w, fmt, batch_ndim=1)` sets it."
            )
        out.append((k, v))
    return tuple(out)


class FakeQuant(qax.ImplicitArray):
    """A full-precision weight that computes as its quantize-dequantize image.

    The value is ``qax.quant.quantize(w, fmt, **options)`` decoded (after clipping
    each channel or block to ``clip_ratio`` times its absolute maximum), exactly; the
    derivative with respect to ``w`` is straight-through: 1 where ``w`` is in range,
    0 where it was clipped. Products with it compute as products with the quantized
    weight compute (bitwise). Build one with `from_array` (or `fake_quantize` for a
    whole parameter tree); `quantized` gives the quantized weight it stands for.

    The codes are computed from ``w`` in at least float32 (a bfloat16 ``w`` is upcast
    first, exactly), so that jitted and eager programs agree on every code; the image
    decodes to ``dtype`` (``w``'s, or the one ``w.astype(...)`` asked for) as the
    quantized weight cast to it decodes.

    Examples:
        >>> w = jax.random.normal(jax.random.key(0), (64, 32))
        >>> fq = qax.qat.FakeQuant.from_array(w, "int4", group_size=32)
        >>> y = qax.use_implicit_args(lambda x, w: x @ w)(jnp.ones((2, 64)), fq)
        >>> bool(jnp.all(y == jnp.ones((2, 64)) @ fq.quantized().dequantize()))
        True

    Attributes:
      w: the full-precision weight (the trained parameter).
      fmt: the format: a name `qax.quant.quantize` accepts (``"int8"``, ``"int4"``,
        ``"nf4"``, ...) or a `qax.quant.QuantizedWeight` subclass.
      options: the format's options, as ``(name, value)`` pairs (a dict is accepted).
      clip_ratio: in ``(0, 1]``: clip each channel or block to this fraction of its
        absolute maximum before quantizing (1: no clipping).
      activation_bits: fake-quantize the other operand of each product to symmetric
        integers of this many bits (one dynamic absmax scale per operand, per example
        under `jax.vmap`), straight-through, or ``None`` (default).
      weight_ndim: the rank of one weight; leading axes of ``w`` beyond it stack
        independent weights (scanned layers), each quantized on its own.

    Raises:
      ValueError: bad ``options``, ``clip_ratio`` or ``activation_bits``.
    """

    __module__ = "qax.qat"

    w: qax.ArrayValue = qax.array_field(ndim="weight_ndim")
    fmt: Any = qax.aux_field(default="int8")
    options: Any = qax.aux_field(default=())
    clip_ratio: float = qax.aux_field(default=1.0)
    activation_bits: int | None = qax.aux_field(default=None)
    weight_ndim: int | None = qax.aux_field(default=None, kw_only=True)

    # What `vmap`/`lax.scan` warnings tell a user whose stacked weight lacks a batch axis.
    batch_axes_advice = (
        "for layers stacked along a leading axis, fake-quantize with that axis as a "
        "batch axis, `qax.qat.fake_quantize(params, ..., batch_ndim=1)`, so that each "
        "layer keeps its own scales."
    )

    def __post_init__(self) -> None:
        self.options = _normalized_options(self.options)
        clip = self.clip_ratio
        if isinstance(clip, bool) or not isinstance(clip, (int, float, np.floating)):
            raise ValueError(
                f"FakeQuant: clip_ratio must be a number in (0, 1], got {clip!r}."
            )
        if not 0 < float(clip) <= 1:
            raise ValueError(
                f"FakeQuant: clip_ratio={clip} is outside (0, 1]: it is the fraction "
                "of each channel's or block's absolute maximum kept (1: no clipping)."
            )
        self.clip_ratio = float(clip)
        bits = self.activation_bits
        if bits is not None and (
            isinstance(bits, bool)
            or not isinstance(bits, (int, np.integer))
            or not 2 <= bits <= 16
        ):
            raise ValueError(
                "FakeQuant: activation_bits must be None (no activation quantization) "
                f"or an integer from 2 to 16, got {bits!r}."
            )
        if bits is not None:
            self.activation_bits = int(bits)
        super().__post_init__()

    def compute_shape(self) -> tuple[int, ...]:
        return tuple(jnp.shape(self.w))

    def compute_dtype(self) -> Any:
        return self.w.dtype

    def field_dims(self) -> dict[str, tuple[int | None, ...]]:
        """``w`` is the weight itself: it runs along every dimension (for
        `qax.sharding`, which then splits ``w`` as the dense weight's spec says)."""
        rank = jnp.ndim(self.w) if self.weight_ndim is None else self.weight_ndim
        return {"w": tuple(range(rank))}

    @classmethod
    def from_array(
        cls,
        w: jax.Array,
        fmt: Any = "int8",
        *,
        clip_ratio: float = 1.0,
        activation_bits: int | None = None,
        batch_ndim: int = 0,
        **options: Any,
    ) -> FakeQuant:
        """Wrap ``w`` for quantization-aware training in format ``fmt``.

        Examples:
            >>> fq = qax.qat.FakeQuant.from_array(jnp.ones((4, 64)), "nf4", block_size=32)
            >>> type(fq.quantized()).__name__
            'NF4Weight'

        Args:
          w: a floating-point weight.
          fmt: a format name or class that `qax.quant.quantize` accepts.
          clip_ratio: clip each channel or block to this fraction of its absolute
            maximum (1: none); clipped values get no gradient.
          activation_bits: fake-quantize the other operand of products with the
            weight to this many bits (``None``: not).
          batch_ndim: leading axes of ``w`` that stack independent weights.
          **options: the format's options (``axis``, ``group_size``, ``block_size``).

        Returns:
          The `FakeQuant`.

        Raises:
          ValueError: the format cannot hold ``w`` with these options, ``w`` is not
            floating-point, or a bad ``clip_ratio``, ``activation_bits`` or
            ``batch_ndim``.
        """
        w = jnp.asarray(w)
        if not jnp.issubdtype(w.dtype, jnp.floating):
            raise ValueError(
                f"FakeQuant.from_array: w must be a floating-point weight, got dtype "
                f"{w.dtype}; quantization-aware training trains a float weight."
            )
        if (
            isinstance(batch_ndim, bool)
            or not isinstance(batch_ndim, (int, np.integer))
            or not 0 <= batch_ndim <= w.ndim
        ):
            raise ValueError(
                f"FakeQuant.from_array: batch_ndim={batch_ndim!r} must be an integer "
                f"from 0 to w.ndim={w.ndim} (the leading axes that stack weights)."
            )
        out = cls(
            w,
            fmt,
            options,
            clip_ratio,
            activation_bits,
            weight_ndim=w.ndim - int(batch_ndim),
        )
        out._spec()  # checks the format now, with its error message
        return out

    @property
    def batch_ndim(self) -> int:
        """The leading axes of ``w`` that stack independent weights."""
        return jnp.ndim(self.w) - (
            jnp.ndim(self.w) if self.weight_ndim is None else self.weight_ndim
        )

    def _spec(self) -> _Spec:
        spec = _Spec(
            self.fmt, self.options, self.clip_ratio, self.batch_ndim, self.dtype
        )
        # Validated once per (format, options, shape, dtype): the error names the fix.
        shape, dtype = tuple(jnp.shape(self.w)), _working_dtype(self.w.dtype)
        clips = self.clip_ratio < 1
        _check_format(self.fmt, self.options, shape, dtype, self.batch_ndim, clips)
        return spec

    def materialize(self) -> jax.Array:
        """The fake-quantized weight, with straight-through derivatives."""
        return _fake(self.w, self._spec())

    def in_range(self) -> jax.Array:
        """Where ``w`` is not clipped (there its gradient is 1; elsewhere 0)."""
        mask = _clipped(_working(self.w), self._spec())[1]
        return jnp.ones(jnp.shape(self.w), bool) if mask is None else mask

    def quantized(self) -> Any:
        """The `qax.quant` weight of ``w`` in this format: the codes the model is
        trained against (its ``dequantize()`` is this value in ``w``'s dtype).

        Returns:
          A `qax.quant.QuantizedWeight` (stacked like ``w`` if ``weight_ndim`` says
          so).
        """
        return _quantized(jax.lax.stop_gradient(self.w), self._spec())[0]

    def fake_activation(self, x: jax.Array) -> jax.Array:
        """``x`` fake-quantized as the other operand of a product with this weight
        (unchanged if ``activation_bits`` is ``None``)."""
        if self.activation_bits is None or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return _fake_activation(x, self.activation_bits)

    @classmethod
    def default_handler(cls, primitive: Any, *args: Any, params: dict) -> Any:
        """Any primitive no handler covers runs on the fake-quantized image (without
        a `qax.MaterializationWarning`: forming it is what a `FakeQuant` is for)."""
        args = [a.materialize() if isinstance(a, FakeQuant) else a for a in args]
        if any(isinstance(a, qax.ImplicitArray) for a in args):
            return NotImplemented  # other implicit types: the standard rule
        return primitive.bind(*args, **params)


@functools.lru_cache(maxsize=512)
def _check_format(
    fmt: Any, options: tuple, shape: tuple, dtype: Any, batch_ndim: int, clips: bool
) -> None:
    if clips:
        _groups(fmt, options, shape, dtype, batch_ndim)
    else:
        _probe(fmt, options, shape, dtype, batch_ndim)


def clear_caches() -> None:
    _groups.cache_clear()
    _check_format.cache_clear()
