"""`requantize`: an array in the format and layout of a quantized weight it replaces.

Merging an adapter into a quantized base (`qax.lora.merge` with ``quantize="base"``)
needs ``w + s·a⊗b`` stored as ``w`` was: the same class, block size, block axis, bits,
per-channel axes and stack. Those are the weight's own fields, read here rather than
remembered by the caller. This module uses qax's public API only.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp

from ._types import QuantizedWeight


def format_options(like: QuantizedWeight) -> tuple[type, dict[str, Any]]:
    """``(class, from_array options)`` that quantize an array as ``like`` is stored.

    Examples:
        >>> q = qax.quant.quantize(jnp.ones((2, 8, 64)), "nf4", filter=lambda *_: True,
        ...                        block_size=32, batch_ndim=1)
        >>> cls, options = qax.quant.format_options(q)
        >>> cls.__name__, options
        ('NF4Weight', {'batch_ndim': 1, 'block_axis': -1, 'block_size': 32})
    """
    if not isinstance(like, QuantizedWeight):
        raise TypeError(
            f"format_options: expected a qax.quant weight, got {type(like).__name__}."
        )
    cls = type(like)
    accepted = inspect.signature(cls.from_array).parameters
    nb = like.ndim - (like.ndim if like.weight_ndim is None else like.weight_ndim)
    options: dict[str, Any] = {"batch_ndim": nb} if "batch_ndim" in accepted else {}
    for name in sorted(accepted):
        if name in ("w", "batch_ndim", "axis", "fp8_dtype"):
            continue
        if hasattr(like, name):
            options[name] = getattr(like, name)
    if "fp8_dtype" in accepted:
        options["fp8_dtype"] = jnp.dtype(like.q.dtype)
    if "axis" in accepted and getattr(like, "block_size", None) is None:
        # Per-channel scales keep the weight's rank: the channel axes are those
        # where the scales are as long as the weight (size 1 elsewhere).
        k = like.ndim - nb
        shape, scale = like.shape[nb:], jnp.shape(like.scale)[nb:]
        axes = tuple(i - k for i in range(k) if scale[i] == shape[i] and shape[i] > 1)
        options["axis"] = axes[0] if len(axes) == 1 else axes or -1
    return cls, options


def requantize(x: jax.Array, like: QuantizedWeight) -> QuantizedWeight:
    """``x`` quantized in the format and layout of ``like`` (a weight of its shape).

    Examples:
        >>> w = jax.random.normal(jax.random.key(0), (16, 64))
        >>> q = qax.quant.quantize(w, "int4", filter=lambda *_: True, group_size=32)
        >>> r = qax.quant.requantize(w + 0.01, q)
        >>> type(r).__name__, r.group_size
        ('Int4Weight', 32)

    Args:
      x: a floating-point array of ``like``'s shape.
      like: the quantized weight whose class and options to use.

    Returns:
      A quantized weight of ``like``'s class, options and stack, decoding to
      ``like``'s dtype.

    Raises:
      ValueError: ``x`` does not have ``like``'s shape.
    """
    if tuple(jnp.shape(x)) != tuple(like.shape):
        raise ValueError(
            f"requantize: the array has shape {tuple(jnp.shape(x))}, the weight it "
            f"replaces {tuple(like.shape)}; they must be equal."
        )
    cls, options = format_options(like)
    return cls.from_array(jnp.asarray(x, like.dtype), **options)
