"""Quantizing parameter trees: `quantize`, `dequantize`, `quantize_dequantize` (see
`qax.quant`).

This module uses qax's public API only.
"""

from __future__ import annotations

import collections
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp

import qax
from qax.lora import LoraWeight, default_filter

from ._fp4 import MXFP4Weight, NVFP4Weight
from ._nf4dq import NF4DQWeight
from ._types import (
    FP8Weight,
    Int4Weight,
    Int8Weight,
    IntKWeight,
    NF4Weight,
    QuantizedWeight,
    _axis_words,
    _block_axis,
)

# ----------------------------------------------------------------------------------------
# Parameter trees

_FORMATS: dict[str, tuple[type, dict[str, Any]]] = {
    "int8": (Int8Weight, {}),
    "int4": (Int4Weight, {}),
    "nf4": (NF4Weight, {}),
    "nf4_dq": (NF4DQWeight, {}),
    "fp8_e4m3": (FP8Weight, {"fp8_dtype": jnp.float8_e4m3fn}),
    "fp8_e5m2": (FP8Weight, {"fp8_dtype": jnp.float8_e5m2}),
    **{f"int{k}": (IntKWeight, {"bits": k}) for k in (2, 3, 5, 6, 7)},
    "mxfp4": (MXFP4Weight, {}),
    "nvfp4": (NVFP4Weight, {}),
}

FORMATS: tuple[str, ...] = tuple(_FORMATS)
"""The format names `quantize` and `quantize_dequantize` take: ``"int8"``, ``"int4"``,
``"nf4"``, ``"nf4_dq"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int2"``, ``"int3"``,
``"int5"``, ``"int6"``, ``"int7"``, ``"mxfp4"``, ``"nvfp4"`` (see the module's notes)."""

_OPTIONS = (
    "axis",
    "group_size",
    "block_size",
    "block_axis",
    "batch_ndim",
    "bits",
    "fp8_dtype",
)


def _block_size(options: dict, cls: type | None = None) -> int:
    if hasattr(cls, "default_block_size"):  # fixed by the format (mxfp4, nvfp4)
        return cls.default_block_size
    return options.get("block_size", options.get("group_size", 64))


def _skip_size(cls: type, options: dict) -> Any:
    """The block size that a weight's blocks' axis must be a multiple of."""
    if issubclass(cls, FP8Weight):
        return options.get("block_size")
    if issubclass(cls, IntKWeight):
        return options.get("group_size", 64)
    return _block_size(options, cls)


def _stack_ndim(nb: Any, name: str, leaf: Any) -> Any:
    """The batch dimensions of one weight: ``batch_ndim`` (an int or a function of
    ``(path, leaf)``), or 0 where the weight has fewer than ``batch_ndim + 2`` axes
    (the head beside a stack of layers is one unstacked weight)."""
    nb = nb(name, leaf) if callable(nb) else nb
    if isinstance(nb, int) and nb > 0 and len(leaf.shape) - nb < 2:
        return 0
    return nb + qax.lora.expert_axes(name, leaf, nb)  # experts: codes per expert


def _misfit(cls: type, leaf: Any, options: dict, name: str) -> str | None:
    """Why the format `cls` with `options` cannot hold `leaf` (``None``: it can): its
    blocks' axis is not a multiple of the block size."""
    if cls is Int8Weight:
        return None
    size = _skip_size(cls, options)
    nb = _stack_ndim(options.get("batch_ndim", 0), name, leaf)
    try:  # the axis within one weight, from the end
        axis = _block_axis(cls, leaf, options.get("block_axis", -1), nb)
    except ValueError:
        return None  # from_array names the bad setting
    n = leaf.shape[axis]
    if issubclass(cls, (FP8Weight, IntKWeight)):  # a bad size is from_array's error
        if size is None or not isinstance(size, int) or n % size == 0:
            return None
    elif size % 2 == 0 and n % size == 0:
        return None
    words = _axis_words(options.get("block_axis", -1))
    return f"{words} ({n}) is not a multiple of the block size {size}"


def quantize(
    params: Any,
    fmt: str | type = "nf4",
    *,
    filter: Any = None,
    rules: Any = None,
    strict_rules: bool = False,
    donate: bool = False,
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
      fmt: a name in `FORMATS` (``"int8"``, ``"int4"``, ``"nf4"``, ``"nf4_dq"``,
        ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int2"``, ``"int3"``, ``"int5"``, ``"int6"``,
        ``"int7"``, ``"mxfp4"``, ``"nvfp4"``), or
        one of the classes (`IntKWeight` with ``bits=``: any of 2 to 8 bits,
        group-wise).
      filter: ``filter(path, leaf) -> bool`` (``path`` as in `qax.lora.loraify`).
        Default: `qax.lora.default_filter` (every 2-D+ weight but embeddings, norms and
        biases, also those `qax.lora.biases` finds from the tree's structure: ``b``
        beside ``w``), skipping weights whose blocks' axis (the last, or ``block_axis``) is
        not a multiple of the block size (the group size of the integer formats), with
        a warning that names them.
      rules: per-path settings, like qwix's rules: an ordered list of ``(pattern,
        settings)``. The first pattern (a regular expression) that matches all of a
        weight's path decides for it: ``settings`` is a dict with a ``"format"`` and
        options overriding this call's (``axis``, ``group_size``, ``block_size``,
        ``block_axis``, ``batch_ndim``, ``bits``, ``fp8_dtype``), the weight then chosen
        whatever ``filter`` says (but one with too few axes for the rule's
        ``batch_ndim``, a stacked bias, stays dense); or ``None``, to keep it dense.
        Weights no pattern matches follow ``filter``, ``fmt`` and ``options``. E.g.
        ``rules=[(".*/attn/.*", {"format": "int8"}), (".*/head/.*", None)]``. A rule
        that picks another format than the call's takes, of the call's options, ``batch_ndim``, ``axis``
        (int8, fp8) and the block size (``block_size`` or ``group_size``, under the
        name the format uses; not int8) with ``block_axis``. A rule that decides no
        weight gives a warning naming it and the closest paths
        (`qax.lora.check_rules`). `plan` shows what is chosen, and why.
      strict_rules: raise instead of warning about a rule that decides no weight.
      donate: free each dense weight's buffer once its quantized weight is computed
        (``params`` can then no longer be used; an array that appears at several
        paths is kept). Weights are quantized one at a time (each waits for the one
        before), so the memory ``quantize`` needs is the model plus one weight's
        working copy, with ``donate`` the quantized weights taking the place of the
        dense ones (``benchmarks/bench_big_qlora.py`` measures it). Inside a traced
        function it changes nothing.
      **options: passed to ``from_array``: ``axis`` (int8 and per-channel fp8: an axis
        or a tuple of axes that keep their own scales), ``group_size`` (int4,
        int2...int7 and `IntKWeight`), ``block_size`` (nf4; fp8: block-wise scales
        instead of per-channel), ``block_axis`` (the block formats: the axis of one
        weight the blocks run along, default -1, the last; ``-2`` groups the input
        axis of Flax ``(in, out)`` kernels, as bitsandbytes and qwix do: a lower error
        on trained weights), ``bits`` (`IntKWeight`), ``fp8_dtype`` (`FP8Weight`),
        ``batch_ndim`` (stacked layers; an int or a function of ``(path, leaf)``). A
        weight with fewer than ``batch_ndim + 2`` axes (the 2-D head beside a stack of
        layers, under ``batch_ndim=1`` for the whole model) is quantized as one
        unstacked weight. A stack of experts (as `qax.lora.loraify` finds them: a
        path component containing ``expert`` or a ``moe`` word, at least
        ``batch_ndim + 3`` axes) gets its expert axis as one more batch axis (codes
        and scales per expert); the router stays dense by default.

    Returns:
      ``params`` with quantized weights. The base weight of a `qax.lora.LoraWeight`
      (``quantize(loraify(params))``) is quantized as the weight at its path would
      be, stacked as its factors are; the factors stay. Weights trained with
      quantization-aware training (`qax.qat.FakeQuant`, also as the base of a
      `qax.lora.LoraWeight`) become exactly the quantized weights they were trained
      against, in their own format and options, whatever ``fmt`` says; other implicit
      arrays are kept.

    Raises:
      ValueError: an unknown format, an option that contradicts the format's name
        (``"int3"`` with ``bits=5``), `IntKWeight` without ``bits``, a weight chosen
        by ``filter`` or a rule that the format cannot hold (the message names its
        path), or, under ``strict_rules``, a rule that decides no weight.
    """
    cls, preset = _format(fmt)
    options = _with_preset(fmt, preset, options)
    _check_options(cls, options)
    misfits = set()  # the reasons `decide` gives for weights the format cannot hold
    decide = _decider(params, fmt, cls, options, filter, rules, misfits)
    skipped = []  # chosen by the default filter, but the format cannot hold them
    seen = []

    def one(name: str, leaf: Any, stack: int | None) -> Any:
        """`leaf` quantized (or not) as the weight at `name`; `stack`: the batch
        dimensions of the `LoraWeight` whose base it is."""
        kind, kwargs, why = decide(name, leaf, stack)
        if kind is None:
            if why in misfits:
                skipped.append(f"{name} {tuple(leaf.shape)}")
            return leaf
        try:
            q = kind.from_array(leaf, **kwargs)
        except ValueError as error:  # name the weight
            raise ValueError(f"quantize, the weight at {name!r}: {error}") from None
        if _concrete(leaf):  # one weight's working copy at a time
            jax.block_until_ready(q)
            if donate and shared[id(leaf)] == 1:
                leaf.delete()
        return q

    def convert(path, leaf):
        if hasattr(leaf, "shape"):
            seen.append(qax.utils.path_string(path))
        if isinstance(leaf, LoraWeight) and not isinstance(leaf.w, qax.ImplicitArray):
            # `quantize(loraify(params))`: the base inside the LoraWeight.
            stack = leaf.a.ndim - leaf.a_ndim
            w = one(qax.utils.path_string(path), leaf.w, stack)
            if w is leaf.w:
                return leaf
            return LoraWeight(
                w,
                leaf.a,
                leaf.b,
                alpha=leaf.alpha,
                freeze_w=leaf.freeze_w,
                a_axes=leaf.a_axes,
            )
        if isinstance(leaf, qax.ImplicitArray):
            # A `qax.qat.FakeQuant` (also as a LoRA base) becomes the codes it was
            # trained against, in its own format; other implicit arrays stay.
            return qax.qat.convert(leaf)
        if not hasattr(leaf, "shape"):
            return leaf
        return one(qax.utils.path_string(path), leaf, None)

    shared = collections.Counter(map(id, jax.tree_util.tree_leaves(params)))
    out = qax.utils.tree_map_with_path_with_implicit(convert, params)
    if skipped:
        warnings.warn(
            f"quantize(..., {cls.__name__}) kept {len(skipped)} weight(s) unquantized: "
            f"{_axis_words(options.get('block_axis', -1))} of each is not a multiple "
            "of the block size "
            f"{_skip_size(cls, options)}: {', '.join(skipped)}. Pass a block size that "
            "divides it (block_size= for nf4 and fp8, group_size= for int4 and "
            "int2...int7; or per-path rules=), or a `filter` that leaves them out.",
            stacklevel=2,
        )
    qax.lora.check_rules(rules, seen, "quantize", strict=strict_rules, stacklevel=2)
    return out


def _concrete(x: Any) -> bool:
    """Whether ``x`` is a JAX array with a buffer (not a tracer)."""
    if not isinstance(x, jax.Array):
        return False
    try:
        x.is_deleted()
    except jax.errors.ConcretizationTypeError:
        return False
    return True


def _decider(
    params: Any,
    fmt: Any,
    cls: type,
    options: dict,
    filter: Any,
    rules: Any,
    misfits: set | None = None,
) -> Any:
    """``decide(path, leaf, stack) -> (kind, kwargs, why)``: `quantize`'s choice for
    one weight: the class and ``from_array`` options (``kind`` ``None``: kept), and
    what decided; ``stack``: the batch dimensions of the `LoraWeight` whose base it
    is (``None``: none). The reasons given for weights that the default filter chose
    but the format cannot hold are added to ``misfits``."""
    lookup = qax.utils.path_rules(rules, ("format", *_OPTIONS), "quantize")
    default = filter is None or filter is default_filter
    by = "default filter" if default else "filter"
    left_out = {}  # why the default filter leaves a leaf out (biases by the tree too)
    if default:
        for row in qax.lora.plan(params, 1).skipped:
            left_out[row.path] = row.why

    def reason(path: str, leaf: Any, stack: int | None) -> str | None:
        if not default:
            return None if filter(path, leaf) else "filter"
        if stack is not None:  # the base of a LoraWeight
            return None if default_filter(path, leaf) else "left out by default_filter"
        return left_out.get(path)

    def decide(name: str, leaf: Any, stack: int | None) -> tuple:
        call = options if stack is None else {**options, "batch_ndim": stack}
        matched, settings = lookup(name)
        rule = None
        for pattern, _ in rules or ():
            if re.fullmatch(pattern, name):
                rule = f"rule {getattr(pattern, 'pattern', pattern)!r}"
                break
        if matched and settings is None:
            return None, None, f"{rule}: None"
        if not matched:
            why = reason(name, leaf, stack)
            if why is None and default:
                why = _misfit(cls, leaf, call, name)
                if why is not None and misfits is not None:
                    misfits.add(why)
            if why is not None:
                return None, None, why
        kind, kwargs = cls, dict(call)
        if settings:
            settings = dict(settings)
            rule_fmt = settings.pop("format", fmt)
            kind, rule_preset = _format(rule_fmt)
            if kind is not cls:  # the call's options that this format takes
                kwargs = _options_for(kind, call)
            kwargs.update(_with_preset(rule_fmt, rule_preset, settings))
            _check_options(kind, kwargs)
        if stack is not None:
            kwargs["batch_ndim"] = stack  # the base is stacked as its factors are
        if settings and "batch_ndim" in settings and stack is None:
            nb = kwargs["batch_ndim"]
            nb = nb(name, leaf) if callable(nb) else nb
            if len(leaf.shape) - nb < 2:  # a stack of vectors, by the rule (biases)
                return None, None, f"{rule}: fewer than batch_ndim + 2 axes"
        if "batch_ndim" in kwargs:
            kwargs["batch_ndim"] = _stack_ndim(kwargs["batch_ndim"], name, leaf)
        return kind, kwargs, rule or by

    return decide


def plan(
    params: Any,
    fmt: str | type = "nf4",
    *,
    filter: Any = None,
    rules: Any = None,
    **options: Any,
) -> qax.lora.Plan:
    """What `quantize` with these arguments would do to each weight, without doing it.

    Each leaf with a shape gets a `qax.lora.PlanRow`: quantized or not, what decided
    (the filter, a rule, or the reason it is kept: ``"bias"``, ``"embedding"``,
    ``"normalisation"``, a block size that does not divide it...), and the format with
    its options; rules that would decide no weight are listed. ``print(plan)`` shows a
    table.

    Examples:
        >>> params = {"gate": {"w": jnp.ones((2, 64, 64)), "b": jnp.ones((2, 64))}}
        >>> print(qax.quant.plan(params, "nf4", block_size=32))
        quantize converts 1 of 2 leaves:
          gate/b  (2, 64)      float32  skipped: bias
          gate/w  (2, 64, 64)  float32  NF4Weight, block_size=32 (default filter)

    Args:
      params: as for `quantize`.
      fmt: as for `quantize`.
      filter: as for `quantize`.
      rules: as for `quantize`.
      **options: as for `quantize`.

    Returns:
      A `qax.lora.Plan`.

    Raises:
      ValueError: as `quantize` for these arguments (before quantizing anything).
    """
    cls, preset = _format(fmt)
    options = _with_preset(fmt, preset, options)
    _check_options(cls, options)
    decide = _decider(params, fmt, cls, options, filter, rules)
    rows = []
    for path, leaf in qax.utils.tree_flatten_with_path_with_implicit(params)[0]:
        if not hasattr(leaf, "shape"):
            continue
        name = qax.utils.path_string(path)
        shape, dtype = tuple(leaf.shape), str(jnp.dtype(leaf.dtype))
        if isinstance(leaf, LoraWeight) and not isinstance(leaf.w, qax.ImplicitArray):
            kind, kwargs, why = decide(name, leaf.w, leaf.a.ndim - leaf.a_ndim)
            why = f"{why}, the base of a LoraWeight"
        elif isinstance(leaf, qax.qat.FakeQuant):
            kind, kwargs, why = None, {}, "a FakeQuant: becomes its own format"
        elif isinstance(leaf, qax.ImplicitArray):
            kind, kwargs, why = None, {}, f"already a {type(leaf).__name__}"
        else:
            kind, kwargs, why = decide(name, leaf, None)
        if kind is None:
            rows.append(qax.lora.PlanRow(name, shape, dtype, False, why))
            continue
        shown = ", ".join(
            f"{k}={_show(v) if k == 'fp8_dtype' else v!r}"
            for k, v in kwargs.items()
            if not (k == "batch_ndim" and v == 0)
        )
        detail = f"{kind.__name__}, {shown}" if shown else kind.__name__
        rows.append(qax.lora.PlanRow(name, shape, dtype, True, why, detail))
    seen = [row.path for row in rows]
    unmatched = qax.lora.unmatched_rules(rules, seen, "quantize")
    return qax.lora.Plan("quantize", tuple(rows), unmatched)


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
    if hasattr(cls, "default_block_size"):
        for name in ("block_size", "group_size"):
            if name in options:
                raise ValueError(
                    f"quantize: {cls.__name__} has blocks of {cls.default_block_size} "
                    f"by its specification; {name}={options[name]!r} cannot change "
                    "that. Leave it out (block_axis= still chooses the axis), or use "
                    'a format whose block size is free ("nf4", "int4", block fp8).'
                )
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
    (not for int8); ``block_axis`` where the format then has blocks."""
    if cls not in {kind for kind, _ in _FORMATS.values()}:
        return dict(options)
    out = {"batch_ndim": options["batch_ndim"]} if "batch_ndim" in options else {}
    if cls in (Int8Weight, FP8Weight) and "axis" in options:
        out["axis"] = options["axis"]
    fixed = hasattr(cls, "default_block_size")  # mxfp4, nvfp4: blocks by the spec
    sized = "block_size" in options or "group_size" in options
    if cls is not Int8Weight and sized and not fixed:
        name = "group_size" if cls in (Int4Weight, IntKWeight) else "block_size"
        out[name] = _block_size(options)
    blocks = cls in (Int4Weight, NF4Weight, NF4DQWeight, IntKWeight) or fixed
    blocks = blocks or "block_size" in out
    if blocks and "block_axis" in options:
        out["block_axis"] = options["block_axis"]
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
