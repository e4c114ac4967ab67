"""GPTQ and AWQ from `calibrate`'s statistics: `gptq`, `awq` (see `qax.quant`).

Each starts from the scales round to nearest gives (the format's ``from_array``) and
chooses the codes (GPTQ) or rescales and clips before rounding (AWQ), then stores the
result in the very type `quantize` makes (`_encode`: codes packed as the format packs
them, beside the scales), so everything that takes a quantized weight takes these.

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax
from qax.lora import LoraWeight

from . import _codes
from ._calibrate import InputStats
from ._params import _check_options, _decider, _format, _with_preset
from ._types import (
    NF4_LEVELS,
    FP8Weight,
    Int4Weight,
    Int8Weight,
    IntKWeight,
    NF4Weight,
    QuantizedWeight,
)

_NO_STATS = (
    "{method}: the weight at {path!r} is chosen for quantization but has no "
    "calibration statistics; calibrate it (qax.quant.calibrate with the same params "
    "and filter) or leave it out with `filter=` / `rules=[(pattern, None)]`."
)

_UNSUPPORTED = (
    "{method}: format {kind} is not one {method} rounds; it makes Int8Weight, "
    "Int4Weight, IntKWeight (int2...int8), NF4Weight and FP8Weight (any block size "
    "and block_axis). Quantize {kind} with qax.quant.quantize (round to nearest), or "
    "pick another format for this weight with `rules=`."
)
# The formats whose rounding with fixed scales `_Round` and `_encode` know.
_METHOD_FORMATS = (Int8Weight, Int4Weight, IntKWeight, NF4Weight, FP8Weight)

# ----------------------------------------------------------------------------------------
# Rounding with fixed scales, per format


def _scale_name(q: QuantizedWeight) -> str:
    return q._scale_field()


def _dense_scale(q: QuantizedWeight, scale: Any = None) -> jax.Array:
    """The scale of every number of ``q`` (``scale``: another scale field of the same
    layout), in the weight's shape."""
    scale = getattr(q, _scale_name(q)) if scale is None else scale
    size = getattr(q, "group_size", None) or getattr(q, "block_size", None)
    if isinstance(q, (Int8Weight, FP8Weight)) and size is None:
        return jnp.broadcast_to(scale, q.shape)
    k = q.block_axis
    wide = jnp.repeat(_codes.to_last(scale, k), size, axis=-1)
    return _codes.from_last(wide, k)


def _levels(q: QuantizedWeight) -> tuple[float, float]:
    if isinstance(q, Int8Weight):
        return -127.0, 127.0
    if isinstance(q, Int4Weight):
        return -8.0, 7.0
    top = 2 ** (q.bits - 1)
    return float(-top), float(top - 1)


@dataclasses.dataclass(frozen=True)
class _Round:
    """``round(v, s)``: the number of a format nearest ``v`` on the grid of the scale
    ``s`` (elementwise; the decoded value). Hashable by value: one compiled GPTQ
    program per format and shape, not per weight."""

    kind: str  # "int", "nf4" or "fp8"
    lo: float = 0.0
    hi: float = 0.0
    dtype: Any = None

    def __call__(self, v: jax.Array, s: jax.Array) -> jax.Array:
        if self.kind == "nf4":
            levels = jnp.asarray(NF4_LEVELS)
            mid = jnp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
            return levels[jnp.searchsorted(mid, v / s, method="compare_all")] * s
        if self.kind == "fp8":
            codes = jnp.clip(v / s, -self.hi, self.hi).astype(self.dtype)
            # Through the bits: XLA may drop a float32 -> fp8 -> float32 round trip
            # (excess precision, as it does on GPUs), and with it the rounding.
            bits = lax.bitcast_convert_type(codes, jnp.uint8)
            codes = lax.bitcast_convert_type(lax.optimization_barrier(bits), self.dtype)
            return codes.astype(v.dtype) * s
        return jnp.clip(jnp.round(v / s), self.lo, self.hi) * s


def _rounder(q: QuantizedWeight) -> _Round:
    """The rounding of ``q``'s format with fixed scales."""
    if isinstance(q, NF4Weight):
        return _Round("nf4")
    if isinstance(q, FP8Weight):
        dtype = jnp.dtype(q.q.dtype)
        return _Round("fp8", hi=float(jnp.finfo(dtype).max), dtype=dtype)
    return _Round("int", *_levels(q))


def _encode(q: QuantizedWeight, v: jax.Array, scale: jax.Array) -> QuantizedWeight:
    """``q``'s type and settings holding the codes of ``v`` (on the grid of ``scale``,
    a scale field of ``q``'s layout) and ``scale``."""
    s = _dense_scale(q, scale).astype(jnp.float32)
    v = v.astype(jnp.float32)
    name = _scale_name(q)
    if isinstance(q, FP8Weight):
        top = float(jnp.finfo(q.q.dtype).max)
        codes = jnp.clip(v / s, -top, top).astype(q.q.dtype)
        return q._rescaled(q=codes, **{name: scale})
    if isinstance(q, Int8Weight):
        codes = jnp.clip(jnp.round(v / s), -127, 127).astype(jnp.int8)
        return q._rescaled(q=codes, **{name: scale})
    k = q.block_axis
    if isinstance(q, NF4Weight):
        mid = jnp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
        codes = jnp.searchsorted(mid, v / s, method="compare_all")
    else:
        lo, hi = _levels(q)
        codes = (jnp.clip(jnp.round(v / s), lo, hi) - lo).astype(jnp.int32)
    codes = _codes.to_last(codes, k)
    if isinstance(q, IntKWeight):
        packed = _codes.pack_bits(codes, q.bits)
    else:
        packed = _codes.pack4(codes)
    return q._rescaled(packed=_codes.from_last(packed, k), **{name: scale})


# ----------------------------------------------------------------------------------------
# Layout: the weight as (inputs, outputs)


def _to_matrix(x: jax.Array, nb: int, axes: tuple) -> jax.Array:
    """``(*stack, k, n)``: the contracted ``axes`` (of one weight) first, flattened."""
    rest = [a for a in range(x.ndim - nb) if a not in axes]
    order = (*range(nb), *(nb + a for a in axes), *(nb + a for a in rest))
    xt = jnp.transpose(x, order)
    k = math.prod(x.shape[nb + a] for a in axes)
    return xt.reshape(*x.shape[:nb], k, -1)


def _from_matrix(m: jax.Array, shape: tuple, nb: int, axes: tuple) -> jax.Array:
    rest = [a for a in range(len(shape) - nb) if a not in axes]
    order = (*range(nb), *(nb + a for a in axes), *(nb + a for a in rest))
    xt = m.reshape(tuple(shape[o] for o in order))
    return jnp.transpose(xt, np.argsort(order))


def _input_shaped(v: Any, shape: tuple, nb: int, axes: tuple) -> jax.Array:
    """A per-input-channel ``(*stack, k)`` array laid out to broadcast against a
    weight of ``shape`` (size 1 on the axes the products do not contract)."""
    v = jnp.asarray(v)
    sizes = [shape[nb + a] for a in axes]
    v = v.reshape(*shape[:nb], *sizes)
    order = np.argsort(axes)  # the contracted axes in the weight's order
    v = jnp.transpose(v, (*range(nb), *(nb + int(o) for o in order)))
    full = list(shape[:nb]) + [1] * (len(shape) - nb)
    for a in axes:
        full[nb + a] = shape[nb + a]
    return v.reshape(full)


# ----------------------------------------------------------------------------------------
# GPTQ


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _gptq_matrix(w, s, h, rnd, block, damp):
    """GPTQ (Frantar et al. 2022) on one ``(k, n)`` weight whose inputs run along
    ``k``: the rows are rounded in order (``rnd`` with the fixed scales ``s``), each
    one's error spread over the rows not yet rounded through the Cholesky factor of
    the inverse Hessian, ``block`` rows at a time (the later rows updated once per
    block). Returns the rounded ``(k, n)`` values."""
    k, n = w.shape
    w = w.astype(jnp.float32)
    s = s.astype(jnp.float32)
    h = h.astype(jnp.float32)
    diag = jnp.diagonal(h)
    dead = diag <= 0  # inputs never non-zero: nothing to compensate with
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + jnp.eye(k) * (damp * jnp.mean(jnp.where(dead, 1.0, diag)))
    low = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((low, True), jnp.eye(k))
    u = jnp.linalg.cholesky(hinv).T  # upper: hinv = uᵀ u
    kp = -(-k // block) * block
    pad = kp - k
    w = jnp.pad(w, ((0, pad), (0, 0)))
    s = jnp.pad(s, ((0, pad), (0, 0)), constant_values=1.0)
    u = jnp.pad(u, ((0, pad), (0, pad))) + jnp.diag(
        jnp.concatenate([jnp.zeros(k), jnp.ones(pad)])
    )
    rows = jnp.arange(block)
    cols = jnp.arange(kp)

    def one_block(b, carry):
        w, out = carry
        i1 = b * block
        w1 = lax.dynamic_slice(w, (i1, 0), (block, n))
        s1 = lax.dynamic_slice(s, (i1, 0), (block, n))
        u_rows = lax.dynamic_slice(u, (i1, 0), (block, kp))
        u1 = lax.dynamic_slice(u, (i1, i1), (block, block))

        def one_row(i, inner):
            w1, q1, e1 = inner
            row = w1[i]
            q = rnd(row, s1[i])
            e = (row - q) / u1[i, i]
            later = jnp.where(rows > i, u1[i], 0.0)
            w1 = w1 - later[:, None] * e[None, :]
            return w1, q1.at[i].set(q), e1.at[i].set(e)

        zeros = jnp.zeros((block, n), jnp.float32)
        _, q1, e1 = lax.fori_loop(0, block, one_row, (w1, zeros, zeros))
        after = jnp.where(cols[None, :] >= i1 + block, u_rows, 0.0)
        w = w - after.T @ e1
        return w, lax.dynamic_update_slice(out, q1, (i1, 0))

    _, out = lax.fori_loop(0, kp // block, one_block, (w, jnp.zeros_like(w)))
    return out[:k]


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _gptq_weight(w, q0, hessian, axes, nb, damp, block):
    """`gptq` of one weight (stacked: each layer with its own Hessian), one program
    per format, settings and shape."""
    s = _dense_scale(q0)
    rnd = _rounder(q0)
    wm, sm = _to_matrix(w, nb, axes), _to_matrix(s, nb, axes)

    def core(w, s, h):
        return _gptq_matrix(w, s, h, rnd, block, damp)

    for _ in range(nb):
        core = jax.vmap(core)
    out = _from_matrix(core(wm, sm, hessian.astype(jnp.float32)), w.shape, nb, axes)
    return _encode(q0, out, getattr(q0, _scale_name(q0)))


def gptq(
    params: Any,
    stats: dict[str, InputStats],
    fmt: str | type = "int4",
    *,
    filter: Any = None,
    rules: Any = None,
    damp: float = 0.01,
    update_block: int = 128,
    **options: Any,
) -> Any:
    """Quantize chosen weights with GPTQ, from `calibrate`'s statistics.

    Each weight gets the scales round-to-nearest gives it (``fmt``'s ``from_array``
    with ``options``); then its input channels are rounded one after another, each
    rounding error compensated on the channels not yet rounded so as to minimise the
    error of the products on the calibration inputs (Frantar et al. 2022, with the
    Hessian ``2 E[x xᵀ]`` from ``stats``, damped by ``damp`` times its mean diagonal,
    updates applied ``update_block`` channels at a time). The result is ``fmt``'s
    own type with its options: ``gptq(params, stats, "nf4", block_size=64)`` is an
    `NF4Weight` like ``quantize(params, "nf4", block_size=64)``'s, with other codes.

    Examples:
        >>> params = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (64, 8))}}
        >>> batches = [jax.random.normal(jax.random.key(1), (32, 64))]
        >>> stats = qax.quant.calibrate(lambda p, x: x @ p["dense"]["kernel"], params, batches)
        >>> q = qax.quant.gptq(params, stats, "int3", group_size=32, block_axis=-2)
        >>> type(q["dense"]["kernel"]).__name__
        'IntKWeight'

    Args:
      params: the params `calibrate` ran with (or any tree with the same weights).
      stats: `calibrate`'s result.
      fmt: a format name or class, as for `quantize`.
      filter: as for `quantize`.
      rules: as for `quantize` (a rule's format and options apply to the weight).
      damp: the damping added to the Hessian's diagonal, relative to its mean (0.01
        as in the paper; more for a weight whose inputs are nearly collinear).
      update_block: input channels rounded between two updates of the rest.
      **options: as for `quantize` (``group_size``, ``block_size``, ``block_axis``,
        ``axis``, ``batch_ndim``, ...).

    Returns:
      ``params`` with the chosen weights quantized.

    Raises:
      ValueError: as `quantize`, or a chosen weight without statistics (or with
        statistics of another shape).
    """
    if not (isinstance(damp, (int, float)) and damp > 0):
        raise ValueError(f"gptq: damp must be a positive number, got {damp!r}.")
    if not (isinstance(update_block, int) and update_block > 0):
        raise ValueError(
            f"gptq: update_block must be a positive integer, got {update_block!r}."
        )

    def method(w, q0, hessian, mean_abs, axes, nb):
        del mean_abs
        return _gptq_weight(w, q0, hessian, axes, nb, float(damp), update_block)

    return _calibrated("gptq", method, params, stats, fmt, filter, rules, options)


# ----------------------------------------------------------------------------------------
# AWQ


def _group_sum(q: QuantizedWeight, x: jax.Array) -> jax.Array:
    """``x`` (the weight's shape) summed over the numbers that share each scale."""
    scale = getattr(q, _scale_name(q))
    size = getattr(q, "group_size", None) or getattr(q, "block_size", None)
    if isinstance(q, (Int8Weight, FP8Weight)) and size is None:
        axes = tuple(i for i in range(x.ndim) if scale.shape[i] == 1 and x.shape[i] > 1)
        return jnp.sum(x, axis=axes, keepdims=True)
    k = q.block_axis
    return _codes.from_last(_codes.split_blocks(_codes.to_last(x, k), size).sum(-1), k)


def _foldable(q: QuantizedWeight, nb: int, axes: tuple) -> bool:
    """Whether each scale of ``q`` covers numbers of one input channel only, so that a
    per-input-channel factor folds into the scales exactly."""
    scale = getattr(q, _scale_name(q))
    size = getattr(q, "group_size", None) or getattr(q, "block_size", None)
    if isinstance(q, (Int8Weight, FP8Weight)) and size is None:
        return all(scale.shape[nb + a] == q.shape[nb + a] for a in axes)
    rank = q.ndim - nb
    return (q.block_axis % rank) not in axes


_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _awq_weight(w, q0, hessian, mean_abs, axes, nb, grid, clip):
    """`awq` of one weight (stacked: each layer its own search), one program per
    format, settings and shape."""
    kind = type(q0)
    h = jnp.asarray(hessian, jnp.float32)
    wf = w.astype(jnp.float32)
    scale = getattr(q0, _scale_name(q0))
    if _foldable(q0, nb, axes):
        kwargs = _rebuild_options(q0, nb)
        a = jnp.maximum(jnp.asarray(mean_abs, jnp.float32), 1e-8)

        def error(alpha):
            f = a**alpha
            f = f / jnp.sqrt(f.max(-1, keepdims=True) * f.min(-1, keepdims=True))
            fs = _input_shaped(f, w.shape, nb, axes)
            qs = kind.from_array((wf * fs).astype(w.dtype), **kwargs)
            d = _to_matrix(qs.dequantize().astype(jnp.float32) / fs - wf, nb, axes)
            return f, jnp.einsum("...kn,...kl,...ln->...", d, h, d)

        # All exponents at once (one program, not one per exponent); alpha = 0, round
        # to nearest, comes first and wins ties.
        fs, errs = jax.vmap(error)(jnp.arange(grid, dtype=jnp.float32) / grid)
        pick = jnp.argmin(errs, axis=0)  # per layer of a stack
        best = jnp.take_along_axis(fs, pick[None, ..., None], axis=0)[0]
        fs = _input_shaped(best, w.shape, nb, axes)
        qs = kind.from_array((wf * fs).astype(w.dtype), **kwargs)
        scale_s = getattr(qs, _scale_name(qs))
        scale = (scale_s / fs.astype(scale_s.dtype)).astype(scale.dtype)
        scale = jnp.broadcast_to(scale, scale_s.shape)
    if clip:
        rnd = _rounder(q0)
        contracted = tuple(nb + a for a in axes)

        def clipped(c):
            # The error of the products, tr(Δᵀ H Δ), is a sum over output units;
            # summed here over the outputs each factor moves (the scales' non-
            # contracted index), so that each choice below is exact.
            d = rnd(wf, _dense_scale(q0, scale * c).astype(jnp.float32)) - wf
            dm = _to_matrix(d, nb, axes)
            e = _from_matrix(dm * (h @ dm), w.shape, nb, axes)
            return jnp.sum(_group_sum(q0, e), axis=contracted, keepdims=True)

        errs = jax.vmap(clipped)(jnp.asarray(_CLIPS, jnp.float32))
        c = jnp.asarray(_CLIPS, jnp.float32)[jnp.argmin(errs, axis=0)]
        scale = scale * c.astype(scale.dtype)
    rnd = _rounder(q0)
    out = rnd(wf, _dense_scale(q0, scale).astype(jnp.float32))
    return _encode(q0, out, scale.astype(getattr(q0, _scale_name(q0)).dtype))


def awq(
    params: Any,
    stats: dict[str, InputStats],
    fmt: str | type = "int4",
    *,
    filter: Any = None,
    rules: Any = None,
    grid: int = 20,
    clip: bool = True,
    **options: Any,
) -> Any:
    """Quantize chosen weights with AWQ, from `calibrate`'s statistics.

    Activation-aware weight quantization (Lin et al. 2023): the input channels that
    see large activations matter most, so each weight is scaled up along its input
    channels by ``s = mean|x| ** α`` before rounding and the scales of the format
    divided by ``s`` after, ``α`` searched on a grid of ``grid`` points in ``[0, 1)``
    for the lowest error of the products on the calibration inputs (measured exactly
    from the statistics: ``tr(Δᵀ E[x xᵀ] Δ)`` for the weight's error ``Δ``; ``α = 0``
    is round-to-nearest, so the search never does worse there). The factor folds into
    the stored scales where each scale covers one input channel (the block formats
    with blocks along an output axis, the default ``block_axis=-1`` for Flax ``(in,
    out)`` kernels); where a scale spans input channels (``block_axis=-2``,
    per-output-channel int8 / fp8) that search is skipped. Then, with ``clip``, the
    scales of each output unit (each index of the scales' non-contracted axes) are
    shrunk by the factor in ``{1, 0.95, ..., 0.5}`` that lowers that error most (AWQ's
    clipping search; the error is a sum over output units, so each choice is exact).
    The result is ``fmt``'s own type with its options.

    Examples:
        >>> params = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (64, 8))}}
        >>> batches = [jax.random.normal(jax.random.key(1), (32, 64))]
        >>> stats = qax.quant.calibrate(lambda p, x: x @ p["dense"]["kernel"], params, batches)
        >>> q = qax.quant.awq(params, stats, "nf4", block_size=8)
        >>> type(q["dense"]["kernel"]).__name__
        'NF4Weight'

    Args:
      params: the params `calibrate` ran with (or any tree with the same weights).
      stats: `calibrate`'s result.
      fmt: a format name or class, as for `quantize`.
      filter: as for `quantize`.
      rules: as for `quantize`.
      grid: the number of exponents ``α`` tried (``0, 1/grid, ...``).
      clip: also search a clipping factor per scale.
      **options: as for `quantize`.

    Returns:
      ``params`` with the chosen weights quantized.

    Raises:
      ValueError: as `quantize`, or a chosen weight without statistics (or with
        statistics of another shape).
    """
    if not (isinstance(grid, int) and grid > 0):
        raise ValueError(f"awq: grid must be a positive integer, got {grid!r}.")

    def method(w, q0, hessian, mean_abs, axes, nb):
        return _awq_weight(w, q0, hessian, mean_abs, axes, nb, grid, bool(clip))

    return _calibrated("awq", method, params, stats, fmt, filter, rules, options)


def _rebuild_options(q: QuantizedWeight, nb: int) -> dict:
    """``from_array`` options that make a weight laid out as ``q``."""
    out: dict[str, Any] = {"batch_ndim": nb}
    if isinstance(q, IntKWeight):
        out["bits"] = q.bits
    if isinstance(q, (Int4Weight, IntKWeight)):
        out |= {"group_size": q.group_size, "block_axis": q.block_axis}
    elif isinstance(q, NF4Weight):
        out |= {"block_size": q.block_size, "block_axis": q.block_axis}
    elif isinstance(q, FP8Weight):
        out["fp8_dtype"] = q.q.dtype
        if q.block_size is not None:
            out |= {"block_size": q.block_size, "block_axis": q.block_axis}
        else:
            out["axis"] = _channel_axes(q, nb)
    elif isinstance(q, Int8Weight):
        out["axis"] = _channel_axes(q, nb)
    return out


def _channel_axes(q: QuantizedWeight, nb: int) -> tuple:
    scale = q.scale
    return tuple(
        i for i in range(nb, q.ndim) if scale.shape[i] != 1 or q.shape[i] == 1
    ) or (q.ndim - 1,)


# ----------------------------------------------------------------------------------------
# Shared


def _calibrated(
    name: str,
    method: Callable,
    params: Any,
    stats: dict,
    fmt: Any,
    filter: Any,
    rules: Any,
    options: dict,
) -> Any:
    """`quantize`'s choice of weights and formats, each chosen weight made by
    ``method(w, rtn, stats, batch_ndim)`` from its round-to-nearest version."""
    cls, preset = _format(fmt)
    options = _with_preset(fmt, preset, options)
    _check_options(cls, options)
    if not isinstance(stats, dict):
        raise ValueError(
            f"{name}: stats must be the dict qax.quant.calibrate returns, got "
            f"{type(stats).__name__}."
        )
    decide = _decider(params, fmt, cls, options, filter, rules, set())
    skipped = []

    def convert(path, leaf):
        if isinstance(leaf, (qax.ImplicitArray, LoraWeight)) or not hasattr(
            leaf, "shape"
        ):
            return leaf
        path = qax.utils.path_string(path)
        kind, kwargs, why = decide(path, leaf, None)
        if kind is None:
            if why is not None and "multiple of the block size" in why:
                skipped.append(f"{path} {tuple(leaf.shape)}")
            return leaf
        st = stats.get(path)
        if kind not in _METHOD_FORMATS:
            raise ValueError(_UNSUPPORTED.format(method=name, kind=kind.__name__))
        if st is None:
            raise ValueError(_NO_STATS.format(method=name, path=path))
        try:
            q0 = kind.from_array(leaf, **kwargs)
        except ValueError as error:
            raise ValueError(f"{name}, the weight at {path!r}: {error}") from None
        nb = q0.ndim - q0.weight_ndim
        k = math.prod(leaf.shape[nb + a] for a in st.axes) if st.axes else 0
        want = (*leaf.shape[:nb], k, k)
        if tuple(np.shape(st.hessian)) != want:
            raise ValueError(
                f"{name}: the statistics of {path!r} have shape "
                f"{tuple(np.shape(st.hessian))}, the weight {tuple(leaf.shape)} "
                f"(batch_ndim={nb}) needs {want}: calibrate with the same params and "
                "batch_ndim."
            )
        return method(jnp.asarray(leaf), q0, st.hessian, st.mean_abs, st.axes, nb)

    out = qax.utils.tree_map_with_path_with_implicit(convert, params)
    if skipped:
        warnings.warn(
            f"{name}(..., {cls.__name__}) kept {len(skipped)} weight(s) unquantized "
            f"(the block size does not divide them): {', '.join(skipped)}.",
            stacklevel=3,
        )
    return out
