"""Calibration for quantization: `calibrate` and `InputStats` (see `qax.quant`).

`calibrate` runs the user's model, unchanged, on calibration batches with each chosen
weight replaced by a recording implicit array (`_Recorder`): its ``dot_general``
handler computes the product with the weight as it is, and sends what the product's
input contributes to the weight's statistics (the sum of ``x xᵀ`` over the input
vectors, with ``x`` running along the axes of the weight that the product contracts,
and the sum of ``|x|``) to the host with `jax.debug.callback`. Only these sums cross,
never the activations, and the host adds them up batch after batch (the batches
stream: one is held at a time).

Which weight (and which layer of a stacked one) a product used travels as data: each
recorder carries an integer ``tag`` per layer, an array field that `lax.scan`, `vmap`
and indexing slice along with the weight, so the product inside the body of a scan over
stacked layers reports the layer it ran on. The callback is a module-level function
that hands the sums to the calibration running now (`_SINKS`), so a program compiled
for one call (a user's ``jax.jit``) reports to the next one correctly.

`gptq` and `awq` (in `_gptq_awq`) turn the statistics into the existing formats.

This module uses qax's public API only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax

from ._params import _decider
from ._types import Int8Weight

_NEVER_SEEN = (
    "calibrate: {n} chosen weight(s) were never seen by a product during calibration: "
    "{paths}. Each must reach a matrix product (dot_general: x @ w, an einsum, "
    "nn.Dense, nnx.Linear/Einsum) inside the function, after at most a transpose or a "
    "dtype cast. Check that `f` uses `params` (not weights it closes over), that the "
    "batches run the layers that hold them, and the MaterializationWarning that names "
    "an operation the recorder does not follow; or leave them out with `filter=`."
)

# ----------------------------------------------------------------------------------------
# Recording


class _Recorder(qax.ImplicitArray):
    """A weight that computes its products as the weight itself and reports, for each,
    the sums of ``x xᵀ`` and ``|x|`` over the product's input vectors (see the module's
    notes). ``axes``: the axes of the stored weight that the axes of this value are
    (a transposed view keeps the stored weight and permutes ``axes``)."""

    w: qax.ArrayValue = qax.array_field(ndim="weight_ndim")
    tag: qax.ArrayValue = qax.array_field(ndim=0)
    axes: tuple = qax.aux_field(default=None)
    weight_ndim: int | None = qax.aux_field(default=None, kw_only=True)

    def compute_shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    def compute_dtype(self) -> Any:
        return self.w.dtype

    def materialize(self) -> jax.Array:
        return self.w


def _deliver(tag: Any, h: Any, s: Any, *, count: int, axes: tuple) -> None:
    """The host side of a recorded product: add the sums to the running calibration."""
    if _SINKS:
        _SINKS[-1].add(np.asarray(tag), np.asarray(h), np.asarray(s), count, axes)


_SINKS: list = []  # the calibrations running now (innermost last)


def _record(x: jax.Array, w: _Recorder, x_dims: tuple, w_dims: tuple) -> None:
    """Report the input ``x`` of a product with ``w`` (``x_dims``/``w_dims``: each
    side's contracting and batch dimensions)."""
    (xc, wc), (xb, wb) = zip(x_dims, w_dims, strict=True)
    nb = w.ndim - w.weight_ndim  # stacked layers, as this value holds them
    if tuple(wb) != tuple(range(nb)):
        raise NotImplementedError(
            "calibrate: a product that batches over axes of a recorded weight other "
            f"than its stacked layers (weight batch dims {tuple(wb)}, {nb} stacked); "
            "calibrate such a weight with batch_ndim= covering those axes, or leave "
            "it out with `filter=`."
        )
    # The vectors run along the weight's contracted axes in its own order, whatever
    # order the product names them in.
    pairs = sorted(zip(xc, wc, strict=True), key=lambda p: w.axes[p[1] - nb])
    xc, wc = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    free = [d for d in range(x.ndim) if d not in xc and d not in xb]
    xt = lax.transpose(x, (*xb, *free, *xc))
    k = math.prod(x.shape[d] for d in xc)
    m = math.prod(x.shape[d] for d in free)
    xt = xt.reshape(*xt.shape[: len(xb)], m, k).astype(jnp.float32)
    h = jnp.einsum("...mk,...ml->...kl", xt, xt, precision=lax.Precision.HIGHEST)
    s = jnp.sum(jnp.abs(xt), axis=-2)
    axes = tuple(w.axes[d - nb] for d in wc)
    tag = lax.stop_gradient(w.tag)
    jax.debug.callback(functools.partial(_deliver, count=m, axes=axes), tag, h, s)


@qax.primitive_handler("dot_general")
def _product_x_rec(primitive, x: jax.Array, w: _Recorder, **params) -> jax.Array:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    _record(x, w, (lc, lb), (rc, rb))
    return primitive.bind(x, w.w, **params)


@qax.primitive_handler("dot_general")
def _product_rec_x(primitive, w: _Recorder, x: jax.Array, **params) -> jax.Array:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    _record(x, w, (rc, rb), (lc, lb))
    return primitive.bind(w.w, x, **params)


@qax.primitive_handler("transpose")
def _transpose_rec(primitive, w: _Recorder, *, permutation) -> Any:
    nb = w.ndim - w.weight_ndim
    if tuple(permutation[:nb]) != tuple(range(nb)):
        return NotImplemented  # moves the stacked layers: not followed
    axes = tuple(w.axes[p - nb] for p in permutation[nb:])
    w_t = primitive.bind(w.w, permutation=permutation)
    return _Recorder(w_t, w.tag, axes, weight_ndim=w.weight_ndim)


@qax.primitive_handler("convert_element_type")
def _convert_rec(primitive, w: _Recorder, **params) -> Any:
    if not jnp.issubdtype(params["new_dtype"], jnp.floating):
        return NotImplemented
    cast = primitive.bind(w.w, **params)
    return _Recorder(cast, w.tag, w.axes, weight_ndim=w.weight_ndim)


@dataclasses.dataclass(frozen=True)
class InputStats:
    """What the products of one weight saw during calibration (`calibrate`).

    The input vectors are the slices of a product's input along the axes it contracts
    with the weight (for ``x @ w`` with a Flax ``(in, out)`` kernel: the rows of
    ``x``, of length ``in``), flattened in the order of ``axes``.

    Attributes:
      axes: the axes of one weight (counted from its first axis after the stacked
        layers) that the products contract, in the order the vectors run along.
      hessian: ``(*stack, k, k)`` float64, the mean of ``x xᵀ`` over the input
        vectors (``k`` = the product of the ``axes``' sizes; ``stack``: the weight's
        stacked-layer axes, each layer its own).
      mean_abs: ``(*stack, k)`` float64, the mean of ``|x|`` per input channel.
      count: ``(*stack,)`` int64, the number of input vectors seen.
    """

    axes: tuple[int, ...]
    hessian: np.ndarray
    mean_abs: np.ndarray
    count: np.ndarray


class _Sink:
    """The running sums of one calibration: per slot (a weight, or one layer of a
    stacked weight), keyed by the slot's tag."""

    def __init__(self, slots: dict[str, tuple[int, tuple]]):
        self.slots = slots  # path -> (first tag, stack shape)
        self.sums: dict[int, list] = {}
        self.axes: dict[int, tuple] = {}
        self.errors: list[str] = []

    def add(self, tag, h, s, count, axes) -> None:
        tags = tag.reshape(-1)
        h = h.reshape(-1, *h.shape[-2:])
        s = s.reshape(-1, s.shape[-1])
        if len(tags) != len(h):  # the weight stacked, the product per layer
            h = np.broadcast_to(h, (len(tags), *h.shape[1:]))
            s = np.broadcast_to(s, (len(tags), *s.shape[1:]))
        for t, hi, si in zip(tags.tolist(), h, s, strict=True):
            seen = self.axes.setdefault(t, axes)
            if seen != axes:
                self.errors.append(
                    f"{self._path(t)}: products contract its axes {seen} and {axes}"
                )
                continue
            acc = self.sums.get(t)
            if acc is None:
                self.sums[t] = [hi.astype(np.float64), si.astype(np.float64), count]
            else:
                acc[0] += hi
                acc[1] += si
                acc[2] += count

    def _path(self, tag: int) -> str:
        for path, (first, stack) in self.slots.items():
            if first <= tag < first + math.prod(stack):
                return path
        return f"tag {tag}"

    def result(self) -> dict[str, InputStats]:
        if self.errors:
            raise ValueError(
                "calibrate: a weight is used by products that contract different "
                f"axes of it, so one input covariance cannot describe it: {self.errors[0]}"
                ". Leave it out with `filter=`."
            )
        missing, out = [], {}
        for path, (first, stack) in self.slots.items():
            tags = range(first, first + math.prod(stack))
            if any(t not in self.sums for t in tags):
                missing.append(path)
                continue
            sums = [self.sums[t] for t in tags]
            count = np.array([c for _, _, c in sums], np.int64).reshape(stack)
            h = np.stack([a for a, _, _ in sums]).reshape(*stack, *sums[0][0].shape)
            s = np.stack([b for _, b, _ in sums]).reshape(*stack, -1)
            out[path] = InputStats(
                self.axes[first],
                h / count[..., None, None],
                s / count[..., None],
                count,
            )
        if missing:
            raise ValueError(
                _NEVER_SEEN.format(n=len(missing), paths=", ".join(missing))
            )
        return out


def calibrate(
    f: Callable,
    params: Any,
    batches: Iterable[Any],
    *,
    filter: Any = None,
    batch_ndim: Any = 0,
    jit: bool = True,
) -> dict[str, InputStats]:
    """The input statistics of chosen weights, from running ``f`` on calibration data.

    ``f(params, batch)`` is the model, unchanged: it runs once per batch (traced once
    per batch shape when ``jit``) under `qax.use_implicit_args`, with each chosen
    weight of ``params`` replaced by an implicit array that computes its products as
    the weight and records what they see (see the module's notes). Nothing else of
    the model is called. The batches stream: each is used and dropped.

    Examples:
        >>> params = {"dense": {"kernel": jax.random.normal(jax.random.key(0), (64, 8))}}
        >>> def f(p, x):
        ...     return x @ p["dense"]["kernel"]
        >>> batches = [jax.random.normal(jax.random.key(i), (16, 64)) for i in range(3)]
        >>> stats = qax.quant.calibrate(f, params, batches)
        >>> stats["dense/kernel"].hessian.shape, stats["dense/kernel"].count
        ((64, 64), array(48))
        >>> q = qax.quant.gptq(params, stats, "int4", group_size=32, block_axis=-2)

    Args:
      f: ``f(params, batch)``; its result is computed and discarded.
      params: as for `quantize` (linen dicts, NNX state, any pytree).
      batches: an iterable of batches, each passed as ``f``'s second argument.
      filter: the weights to record, as `quantize`'s ``filter`` (default:
        `qax.lora.default_filter`). Implicit arrays already in ``params`` stay.
      batch_ndim: leading stacked-layer axes (an int or a function of ``(path,
        leaf)``, as for `quantize`): each layer gets its own statistics, also when
        ``f`` runs the stack with `lax.scan` (or `nnx.scan`, linen `nn.scan`).
      jit: run ``use_implicit_args(f)`` under `jax.jit`; ``False`` runs it as it is
        (eagerly, unless ``f`` compiles itself).

    Returns:
      ``{path: InputStats}`` for every chosen weight (paths as `quantize` and
      `plan` write them).

    Raises:
      ValueError: no batch, a chosen weight that no product used (for one layer of a
        stack: any), or a weight whose products contract different axes of it.
    """
    decide = _decider(
        params, "int8", Int8Weight, {"batch_ndim": batch_ndim}, filter, None
    )
    slots: dict[str, tuple[int, tuple]] = {}

    def wrap(path, leaf):
        if isinstance(leaf, qax.ImplicitArray) or not hasattr(leaf, "shape"):
            return leaf
        name = qax.utils.path_string(path)
        kind, kwargs, _ = decide(name, leaf, None)
        if kind is None or not jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf
        nb = kwargs.get("batch_ndim", 0)
        stack = tuple(leaf.shape[:nb])
        first = sum(math.prod(s) for _, s in slots.values())
        slots[name] = (first, stack)
        tag = first + np.arange(math.prod(stack), dtype=np.int32).reshape(stack)
        axes = tuple(range(leaf.ndim - nb))
        return _Recorder(leaf, jnp.asarray(tag), axes, weight_ndim=leaf.ndim - nb)

    recording = qax.utils.tree_map_with_path_with_implicit(wrap, params)
    run = qax.use_implicit_args(f)
    if jit:
        run = jax.jit(run)
    sink = _Sink(slots)
    _SINKS.append(sink)
    n = 0
    try:
        for batch in batches:
            jax.block_until_ready(run(recording, batch))
            n += 1
        jax.effects_barrier()
    finally:
        _SINKS.remove(sink)
    if n == 0:
        raise ValueError("calibrate: `batches` gave no batch; pass at least one.")
    return sink.result()
