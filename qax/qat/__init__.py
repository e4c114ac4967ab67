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

# `FakeQuant` says `__module__ = "qax.qat"` (its public name, which checkpoints and
# `jax.export` record), so dataclasses reads its `ClassVar` annotations here.
from typing import ClassVar  # noqa: F401

from . import _handlers  # noqa: F401  (registers the handlers)
from ._fake import FakeQuant
from ._params import convert, fake_quantize

__all__ = ["FakeQuant", "convert", "fake_quantize"]
