"""Parameter trees: `fake_quantize` and `convert` (see `qax.qat`).

This module uses qax's public API only.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import qax
from qax.lora import default_filter

from ._fake import (
    _RULE_KEYS,
    FakeQuant,
    _check_format,
    _normalized_options,
    _probe,
    _working_dtype,
)

# ----------------------------------------------------------------------------------------
# Parameter trees

_PROBE_SHAPE = (8, 2**10 * 3 * 5 * 7)  # any block size a format may ask for divides it


@functools.lru_cache(maxsize=64)
def _format_class(fmt: Any) -> type:
    """The class `qax.quant.quantize` uses for ``fmt`` (found abstractly)."""
    if isinstance(fmt, type):
        return fmt
    return _probe(fmt, (), _PROBE_SHAPE, np.dtype(np.float32), 0)[0]


def clear_caches() -> None:
    _format_class.cache_clear()


def _takes(cls: type, name: str) -> bool:
    params = inspect.signature(cls.from_array).parameters
    return name in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def _options_for(fmt: Any, options: dict) -> dict:
    """The call's options that the format of a rule takes (as `qax.quant.quantize`
    does for a rule that picks another format): the block size under the name that
    format uses (``block_size`` first, then ``group_size``), the others if its
    ``from_array`` has a parameter of that name (``block_axis`` only where it then
    makes block scales)."""
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
        if name == "block_axis" and not _has_blocks(cls, out):
            continue
        if _takes(cls, name):
            out[name] = value
    return out


def _has_blocks(cls: type, out: dict) -> bool:
    """Whether ``cls.from_array`` with ``out`` makes block scales (`block_axis` then
    applies): a block size passed, or one by default (fp8 is per channel without)."""
    if "block_size" in out or "group_size" in out:
        return True
    params = inspect.signature(cls.from_array).parameters
    return any(
        name in params and params[name].default not in (None, inspect.Parameter.empty)
        for name in ("block_size", "group_size")
    )


def fake_quantize(
    params: Any,
    fmt: str | type = "int8",
    *,
    filter: Callable[[str, Any], bool] | None = None,
    rules: Any = None,
    clip_ratio: float = 1.0,
    activation_bits: int | None = None,
    strict_rules: bool = False,
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
      filter: ``filter(path, leaf) -> bool``; default: `qax.lora.default_filter`
        (and no bias that `qax.lora.biases` finds in ``params``), skipping (with a
        warning) weights that the format cannot hold.
      rules: ``[(pattern, settings), ...]`` as in `qax.quant.quantize`; settings may
        also give ``clip_ratio`` and ``activation_bits``. A rule that decides no
        weight gives a warning naming it and the closest paths.
      clip_ratio: see `FakeQuant` (1: no clipping).
      activation_bits: see `FakeQuant` (``None``: weights only).
      strict_rules: raise instead of warning about a rule that decides no weight.
      **options: the format's options, and ``batch_ndim`` (an int or a function of
        ``(path, leaf)``) for stacked layers.

    Returns:
      ``params`` with `FakeQuant` weights.

    Raises:
      ValueError: an unknown format, a bad rule, a weight chosen by ``filter`` or a
        rule that the format cannot hold, or, under ``strict_rules``, a rule that
        decides no weight.
    """
    _format_class(fmt)  # an unknown format fails here, naming it
    lookup = qax.utils.path_rules(
        rules, tuple(dict.fromkeys((*_RULE_KEYS, *options))), "fake_quantize"
    )
    skipped = []
    seen = []
    default = filter is None or filter is default_filter
    found = qax.lora.biases(params) if default else frozenset()

    def choose(name: str, leaf: Any) -> bool:
        if not default:
            return filter(name, leaf)
        if not default_filter(name, leaf) or name in found:
            return False
        if not _fits(leaf, fmt, options, name):
            skipped.append(f"{name} {tuple(leaf.shape)}")
            return False
        return True

    def wrap(path: Any, leaf: Any) -> Any:
        if hasattr(leaf, "shape"):
            seen.append(qax.utils.path_string(path))
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
            "divides the blocks' axis: the last, or block_axis=), per-path rules=, or "
            "a `filter` that leaves them out.",
            stacklevel=2,
        )
    qax.lora.check_rules(
        rules, seen, "fake_quantize", strict=strict_rules, stacklevel=2
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
