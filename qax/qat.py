"""Quantization-aware training: `FakeQuant`, `fake_quantize`, `convert`.

A `FakeQuant` holds a full-precision weight ``w`` and a quantization format of
`qax.quant` (a name or class that `qax.quant.quantize` accepts, with its options). It
behaves like the *quantize-dequantize image* of ``w``: the dense weight that
``qax.quant.quantize`` of ``w`` decodes to. Gradients are straight-through: the
derivative with respect to ``w`` is 1 where ``w`` is inside the representable range
and 0 where it was clipped. So a model trained on `FakeQuant` weights learns weights
that survive quantization, and `convert` (or `FakeQuant.quantized`, or
`qax.quant.quantize` of the trained tree) gives exactly the codes and scales the model
was trained against:

Examples:
    >>> params = qax.qat.fake_quantize(params, "int4", group_size=32)
    >>> grads = jax.grad(qax.use_implicit_args(loss_fn))(params, batch)  # STE grads
    >>> deployed = qax.qat.convert(params)   # Int4Weight leaves, the same numbers

**Formats.** Every format `qax.quant.quantize` accepts works, with the options it
takes (``axis`` for int8, ``group_size`` for int4, ``block_size`` for nf4, ...): the
image is computed by `qax.quant.quantize` itself, so a format added there works here
unchanged.

**Clipping.** The formats of `qax.quant` scale each channel or block by its absolute
maximum, so no value is ever out of range and the straight-through gradient is the
identity everywhere. ``clip_ratio=c < 1`` clips each channel or block to ``c`` times
its absolute maximum before quantizing (trading the error of a few large values for a
finer step for all the others); the clipped values then get a zero gradient, as in
the usual straight-through estimator (PACT, LSQ). The channels or blocks are those of
the format's scales, read from their shapes.

**Mixed precision.** ``w.astype(jnp.bfloat16)`` (what Flax does with ``dtype=``) keeps a
`FakeQuant` whose image is the quantized weight decoded in bfloat16, as a quantized
weight cast the same way decodes: codes and scales come from the float32 ``w``.

**Activations.** ``activation_bits=b`` also fake-quantizes the other operand of every
product with the weight (``dot_general``, convolutions) to symmetric ``b``-bit
integers with one dynamic absmax scale per tensor, straight-through. `convert` does
not carry this over: a deployed model must quantize its activations itself.

**Handlers.** Products (``dot_general`` on either side, ``conv_general_dilated``) run
exactly as the deployed model runs them: on the quantized weight, through its own
handler (an int8 or fp8 product on the codes, the scales applied to the output), so
the trained forward pass and the converted model's agree bitwise; their derivatives
are those of the product with the image. ``gather`` (embedding lookups),
``transpose``, ``reshape`` and the other structural ops take the image. The image
needs the whole weight (its scales are per channel or per block), which costs
nothing extra since the weight is full precision anyway. Any other primitive gets
the image too (`FakeQuant` defines `default_handler`), never a
`qax.MaterializationWarning`.

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax
from qax.lora import default_filter

__all__ = ["FakeQuant", "convert", "fake_quantize"]

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

    Read from the quantized weight's floating-point fields that have the weight's
    rank but not its shape (its scales): each axis of length ``n`` with ``s`` scales
    along it has blocks of ``n // s``. A rank-0 scale is one block.
    """
    cls, leaves = _probe(fmt, options, shape, dtype, batch_ndim)
    scales = {
        tuple(leaf.shape)
        for leaf in leaves
        if jnp.issubdtype(leaf.dtype, jnp.floating)
        and (leaf.ndim == 0 or (leaf.ndim == len(shape) and leaf.shape != shape))
    }
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


# ----------------------------------------------------------------------------------------
# Handlers: the product runs on the fake-quantized image (and, if asked, on
# fake-quantized activations).


def _deployed_product(
    primitive: Any, params: dict, x: jax.Array, w: FakeQuant, side: int
) -> jax.Array:
    """The product of ``x`` with the weight, computed as the deployed model computes it
    (the quantized weight's own handler: int8 products run on the codes, the scales
    applied to the output), so that the trained forward pass is the deployed one
    bitwise; its derivatives are those of the product with the image, the weight's
    straight-through (``side``: the weight's operand position)."""
    x = w.fake_activation(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        operands = (w.materialize(), x) if side == 0 else (x, w.materialize())
        return primitive.bind(*operands, **params)
    spec = w._spec()

    def bind(a: Any, b: Any) -> Any:
        return primitive.bind(a, b, **params)

    def ordered(x: Any, w: Any) -> tuple:
        return (w, x) if side == 0 else (x, w)

    @jax.custom_jvp
    def product(x: jax.Array, w: jax.Array) -> jax.Array:
        q = _cast(_quantized(w, spec)[0], spec.out_dtype)
        out = qax.use_implicit_args(bind)(*ordered(x, q))
        return qax.materialize_nested(out, full=True)

    @product.defjvp
    def product_jvp(primals: tuple, tangents: tuple) -> tuple:
        (x, w), (tx, tw) = primals, tangents
        img, mask = _image(w, spec)
        if mask is not None:
            tw = jnp.where(mask, tw, jnp.zeros_like(tw))
        tangent = bind(*ordered(tx, img)) + bind(*ordered(x, tw.astype(img.dtype)))
        return product(x, w), tangent

    return product(x, w.w)


@qax.primitive_handler(["dot_general", "conv_general_dilated"])
def _product_x_w(primitive, x: jax.Array, w: FakeQuant, **params) -> jax.Array:
    return _deployed_product(primitive, params, x, w, side=1)


@qax.primitive_handler("dot_general")
def _product_w_x(primitive, w: FakeQuant, x: jax.Array, **params) -> jax.Array:
    return _deployed_product(primitive, params, x, w, side=0)


@qax.primitive_handler("gather")
def _gather(primitive, w: FakeQuant, indices: jax.Array, **params) -> jax.Array:
    """Rows of the image (the scales span the table's channels or blocks)."""
    return primitive.bind(w.materialize(), indices, **params)


@qax.primitive_handler("convert_element_type")
def _convert(primitive, w: FakeQuant, *, new_dtype, **params) -> Any:
    """To a floating dtype: the same codes (from the full-precision ``w``), decoded in
    ``new_dtype`` as a quantized weight cast the same way decodes."""
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return primitive.bind(w.materialize(), new_dtype=new_dtype, **params)
    return dataclasses.replace(w, dtype=np.dtype(new_dtype))


@qax.primitive_handler(
    [
        "transpose",
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "slice",
        "reduce_sum",
        "neg",
    ]
)
def _image_then(primitive, w: FakeQuant, **params) -> jax.Array:
    """Structural ops move elements of the image (its scales belong to ``w``'s
    layout, so the result is a plain array)."""
    return primitive.bind(w.materialize(), **params)


@qax.primitive_handler("stop_gradient")
def _stop_gradient(primitive, w: FakeQuant) -> FakeQuant:
    """Still a `FakeQuant` (a frozen one, e.g. the base of a `qax.lora.LoraWeight`),
    so that products with it still run as the deployed model runs them."""
    return dataclasses.replace(w, w=jax.lax.stop_gradient(w.w))


@qax.primitive_handler(["add", "sub", "mul"])
def _elementwise(primitive, w: FakeQuant, x: jax.Array, **params) -> jax.Array:
    return primitive.bind(w.materialize(), x, **params)


@qax.primitive_handler("sub")
def _elementwise_right(primitive, x: jax.Array, w: FakeQuant, **params) -> jax.Array:
    return primitive.bind(x, w.materialize(), **params)


# ----------------------------------------------------------------------------------------
# Parameter trees

_PROBE_SHAPE = (8, 2**10 * 3 * 5 * 7)  # any block size a format may ask for divides it


@functools.lru_cache(maxsize=64)
def _format_class(fmt: Any) -> type:
    """The class `qax.quant.quantize` uses for ``fmt`` (found abstractly)."""
    if isinstance(fmt, type):
        return fmt
    return _probe(fmt, (), _PROBE_SHAPE, np.dtype(np.float32), 0)[0]


def _takes(cls: type, name: str) -> bool:
    params = inspect.signature(cls.from_array).parameters
    return name in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def _options_for(fmt: Any, options: dict) -> dict:
    """The call's options that the format of a rule takes (as `qax.quant.quantize`
    does for a rule that picks another format): the block size under the name that
    format uses (``block_size`` first, then ``group_size``), the others if its
    ``from_array`` has a parameter of that name."""
    cls = _format_class(fmt)
    out = {}
    size = options.get("block_size", options.get("group_size"))
    params = inspect.signature(cls.from_array).parameters
    for name in ("block_size", "group_size"):
        if size is not None and name in params:
            out[name] = size
            break
    for name, value in options.items():
        if name in ("block_size", "group_size"):
            continue
        if _takes(cls, name):
            out[name] = value
    return out


def fake_quantize(
    params: Any,
    fmt: str | type = "int8",
    *,
    filter: Callable[[str, Any], bool] | None = None,
    rules: Any = None,
    clip_ratio: float = 1.0,
    activation_bits: int | None = None,
    **options: Any,
) -> Any:
    """Wrap chosen weights of a params pytree in `FakeQuant` for quantization-aware
    training.

    Chooses the weights as `qax.quant.quantize` does (same ``filter``, ``rules``,
    ``batch_ndim`` and options), so that ``convert(fake_quantize(params, ...))`` and
    ``qax.quant.quantize(params, ...)`` quantize the same weights the same way.

    Examples:
        >>> qat = qax.qat.fake_quantize(params, "int4", group_size=32)
        >>> loss, grads = jax.value_and_grad(qax.use_implicit_args(loss_fn))(qat, batch)
        >>> qat = optax.apply_updates(qat, updates)   # trains each FakeQuant's `w`

    Args:
      params: any pytree (Flax linen dict, NNX state, Equinox module, ...).
      fmt: a format name or class that `qax.quant.quantize` accepts.
      filter: ``filter(path, leaf) -> bool``; default: `qax.lora.default_filter`,
        skipping (with a warning) weights that the format cannot hold.
      rules: ``[(pattern, settings), ...]`` as in `qax.quant.quantize`; settings may
        also give ``clip_ratio`` and ``activation_bits``.
      clip_ratio: see `FakeQuant` (1: no clipping).
      activation_bits: see `FakeQuant` (``None``: weights only).
      **options: the format's options, and ``batch_ndim`` (an int or a function of
        ``(path, leaf)``) for stacked layers.

    Returns:
      ``params`` with `FakeQuant` weights.

    Raises:
      ValueError: an unknown format, a bad rule, or a weight chosen by ``filter`` or a
        rule that the format cannot hold.
    """
    _format_class(fmt)  # an unknown format fails here, naming it
    lookup = qax.utils.path_rules(
        rules, tuple(dict.fromkeys((*_RULE_KEYS, *options))), "fake_quantize"
    )
    skipped = []

    def choose(name: str, leaf: Any) -> bool:
        if filter is not None:
            return filter(name, leaf)
        if not default_filter(name, leaf):
            return False
        if not _fits(leaf, fmt, options, name):
            skipped.append(f"{name} {tuple(leaf.shape)}")
            return False
        return True

    def wrap(path: Any, leaf: Any) -> Any:
        if isinstance(leaf, qax.ImplicitArray) or not hasattr(leaf, "shape"):
            return leaf
        name = qax.utils.path_string(path)
        matched, settings = lookup(name)
        if matched and settings is None:
            return leaf
        if not matched and not choose(name, leaf):
            return leaf
        kind, kwargs = fmt, dict(options)
        kwargs.setdefault("clip_ratio", clip_ratio)
        kwargs.setdefault("activation_bits", activation_bits)
        if settings:
            settings = dict(settings)
            kind = settings.pop("format", fmt)
            if kind != fmt:
                kwargs = {
                    "clip_ratio": clip_ratio,
                    "activation_bits": activation_bits,
                    **_options_for(kind, options),
                }
            kwargs.update(settings)
        return _wrap(leaf, kind, kwargs, name)

    out = qax.utils.tree_map_with_path_with_implicit(wrap, params)
    if skipped:
        warnings.warn(
            f"fake_quantize(..., {fmt!r}) kept {len(skipped)} weight(s) in full "
            f"precision: the format cannot hold them with options {options}: "
            f"{', '.join(skipped)}. Pass options that fit them (a block size that "
            "divides the last axis), or a `filter` that leaves them out.",
            stacklevel=2,
        )
    return out


def _settings(leaf: Any, name: str, kwargs: dict) -> tuple[dict, int, float, Any]:
    """Split a weight's settings: the format's options, ``batch_ndim``, ``clip_ratio``
    and ``activation_bits``."""
    options = dict(kwargs)
    batch_ndim = options.pop("batch_ndim", 0)
    if callable(batch_ndim):
        batch_ndim = batch_ndim(name, leaf)
    clip = options.pop("clip_ratio", 1.0)
    bits = options.pop("activation_bits", None)
    return options, batch_ndim, clip, bits


def _fits(leaf: Any, fmt: Any, kwargs: dict, name: str) -> bool:
    """Whether the format can hold ``leaf`` with these settings."""
    options, batch_ndim, clip, _ = _settings(leaf, name, kwargs)
    if not isinstance(batch_ndim, int):
        return False
    try:
        _check_format(
            fmt,
            _normalized_options(options),
            tuple(leaf.shape),
            _working_dtype(leaf.dtype),
            batch_ndim,
            clip < 1,
        )
    except ValueError:
        return False
    return True


def _wrap(leaf: Any, fmt: Any, kwargs: dict, name: str) -> FakeQuant:
    options, batch_ndim, clip, bits = _settings(leaf, name, kwargs)
    return FakeQuant.from_array(
        leaf,
        fmt,
        clip_ratio=clip,
        activation_bits=bits,
        batch_ndim=batch_ndim,
        **options,
    )


def convert(params: Any) -> Any:
    """Replace every `FakeQuant` by its quantized weight (`FakeQuant.quantized`).

    The quantized model computes exactly what the trained model computed in its
    forward pass (its weights decode to the `FakeQuant` images), except for
    activation fake-quantization, which a deployed model must do itself.

    Examples:
        >>> deployed = qax.qat.convert(trained)
        >>> qax.use_implicit_args(model)(deployed, x)   # == the QAT forward pass

    Args:
      params: a pytree holding `FakeQuant` weights (also inside other implicit
        arrays' fields, e.g. the base of a `qax.lora.LoraWeight`).

    Returns:
      The tree with `qax.quant` weights in their place.
    """

    def is_fq(x: Any) -> bool:
        return isinstance(x, FakeQuant)

    return jax.tree_util.tree_map(
        lambda x: x.quantized() if is_fq(x) else x, params, is_leaf=is_fq
    )
