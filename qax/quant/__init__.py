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
- indexing keeps the codes: ``slice``, ``squeeze``, ``dynamic_slice`` (``w[a:b]``,
  ``w[:, 3]``, one layer ``stack[i]`` of a stacked weight with a static or traced
  ``i``, in ``fori_loop`` too) and ``gather`` of layers (``stack[ids]``) slice the
  codes and scales and return a quantized weight. Along the blocks' axis of a block
  format, a slice keeps whole blocks (and so whole bytes of packed codes) when it
  starts and ends on multiples of the block size; one that cuts a block decodes the
  weight, with a `qax.MaterializationWarning` that says so (`qax.decline`);
- ``gather`` of rows (embedding lookups, ``jnp.take`` along any axis the blocks do not
  run along): only the gathered rows are decoded;
- ``convert_element_type`` to a floating dtype: the same codes, decoding to that dtype
  (``w.astype(jnp.bfloat16)`` keeps 4-bit storage); ``mul`` by a scalar rescales the
  scales; ``transpose`` transposes the codes and scales as stored (a block format's
  blocks move with their axis: ``emb.T`` of a 4-bit table stays 4-bit; one that keeps
  the stacked axes in front keeps the stack); ``stop_gradient``;
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
  the last axis, packed so that a weight of ``n`` numbers takes exactly ``n * bits /
  8`` bytes. Any ``bits`` from 2 to 8 through the
  class: ``quantize(params, qax.quant.IntKWeight, bits=8, group_size=64)`` is group-wise
  int8 (``"int4"`` and ``"int8"`` keep their own types above; ``IntKWeight`` with
  ``bits=4`` stores the very bytes `Int4Weight` does).
- ``"nf4_dq"``, `NF4DQWeight`: NF4 with QLoRA's double quantization: the block absmax
  coded in 8 bits with one scale per group of 256 of them, 4.127 bits per number
  (``"nf4"`` stays plain `NF4Weight`: the type every tree and checkpoint made before
  holds, and bitsandbytes' default); the error is NF4's within 1 %.
- ``"mxfp4"``, `MXFP4Weight`: OCP MXFP4, FP4 (e2m1, `FP4_LEVELS`) codes two per byte
  with an e8m0 scale (a power of two) per 32 numbers: 4.25 bits per number.
- ``"nvfp4"``, `NVFP4Weight`: NVIDIA's NVFP4, FP4 codes with an e4m3 scale per 16
  numbers and one float32 scale per weight: 4.5 bits per number. On normal weights the
  relative RMS errors are 0.092 (nf4), 0.095 (nvfp4) and 0.115 (mxfp4); their block
  sizes are the specifications' (``block_axis=`` still chooses the axis).

The block formats (int4, nf4, nf4_dq, int2...int7, block-wise fp8, mxfp4, nvfp4) group along the last axis
unless told ``block_axis=``: ``-2`` puts the blocks (and the packing) on the input axis
of a Flax ``(in, out)`` kernel, or the contracted ``d_model`` axis of an ``nnx.Einsum``
kernel ``(heads, d_model, head_dim)``, as bitsandbytes and qwix group: each block
then holds numbers that one output sums over, which lowers the post-training error on
trained weights (``benchmarks/README.md``, ``bench_qat.py``); the bytes are the same.
The default stays the last axis, so weights and checkpoints made before decode as
they did. ``quantize(params, "nf4", block_axis=-2)`` or per path in ``rules=``.

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

# The types' classes say `__module__ = "qax.quant"` (their public name, which checkpoints
# and `jax.export` record), so dataclasses reads their `ClassVar` annotations here.
from typing import ClassVar  # noqa: F401

from . import _handlers, _indexing, _ragged  # noqa: F401  (register the handlers)
from ._calibrate import InputStats, calibrate
from ._fp4 import FP4_LEVELS, MXFP4Weight, NVFP4Weight
from ._gptq_awq import awq, gptq
from ._like import format_options, requantize
from ._nf4dq import NF4DQWeight
from ._params import FORMATS, dequantize, plan, quantize, quantize_dequantize
from ._types import (
    NF4_LEVELS,
    FP8Weight,
    Int4Weight,
    Int8Weight,
    IntKWeight,
    NF4Weight,
    QuantizedWeight,
)

__all__ = [
    "FORMATS",
    "FP4_LEVELS",
    "MXFP4Weight",
    "NF4_LEVELS",
    "NVFP4Weight",
    "FP8Weight",
    "InputStats",
    "Int4Weight",
    "Int8Weight",
    "IntKWeight",
    "NF4DQWeight",
    "NF4Weight",
    "QuantizedWeight",
    "awq",
    "calibrate",
    "dequantize",
    "format_options",
    "gptq",
    "plan",
    "quantize_dequantize",
    "requantize",
    "quantize",
]
