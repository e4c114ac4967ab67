"""`per_example`: unchanged model code with one adapter of a bank per example.

Every example sees the parameters with each `LoraBank` replaced by its adapter's
`LoraWeight`: `jax.vmap` over the examples, with the shared base weight not mapped (so
``x @ w`` stays one product for the whole batch, over a quantized base too) and only the
thin factors gathered per example, the BGMV pattern of multi-LoRA servers.

This module uses qax's public API only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qax

from ._bank import DoraBank, LoraBank, _bank_size, _banks, _is_bank
from ._dora import DoraWeight
from ._weight import LoraWeight

_BAD_IDS = (
    "qax.lora.per_example: `adapter_ids` must be a 1-D integer array, one adapter per "
    "example (-1 for the base model alone); got {got}."
)

_IDS_RANGE = (
    "qax.lora.per_example: adapter id {id} is not in the bank (its {n} adapters have "
    "ids 0..{top}; -1 is the base model alone)."
)

_BATCH = (
    "qax.lora.per_example: argument {arg} has {size} example(s) along axis {axis}, but "
    "there are {n} adapter ids (one per example). Give each argument that is not a "
    "parameter tree its examples along `in_axes` (default 0), or `in_axes=None` for an "
    "argument every example shares."
)

_NO_BANK = (
    "qax.lora.per_example: no argument holds a LoraBank. Build the parameters with "
    "`qax.lora.bank(base, [adapters, ...])` and pass them to the function."
)

_OUT_AXIS = (
    "qax.lora.per_example: output {path} of one example has shape {shape}, without the "
    "batch axis of size 1 at out_axes={axis} that the example's input had. Return "
    "batched outputs (or pass the output's batch axis as `out_axes`)."
)


def _check_ids(adapter_ids: Any, n: int) -> jax.Array:
    ids = adapter_ids
    if not isinstance(ids, jax.Array | np.ndarray):
        try:
            ids = np.asarray(ids)
        except Exception:  # noqa: BLE001 (reported below)
            raise ValueError(_BAD_IDS.format(got=type(adapter_ids).__name__)) from None
    if jnp.ndim(ids) != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(_BAD_IDS.format(got=f"{ids.dtype}{list(jnp.shape(ids))}"))
    try:
        values = np.asarray(ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None  # traced ids: checked where they are used (NaN, see `_select`)
    if values is not None:
        bad = values[(values < -1) | (values >= n)]
        if bad.size:
            raise ValueError(_IDS_RANGE.format(id=int(bad[0]), n=n, top=n - 1))
    return jnp.asarray(ids, jnp.int32)


def _select(x: LoraBank, ids: jax.Array) -> tuple[Any, Any, Any]:
    """Each example's factors and scale (0 for id -1; NaN for an id outside the bank,
    which only a traced id can be: its example's outputs are NaN, never another
    adapter's numbers)."""
    n = x.size_n
    safe = jnp.clip(ids, 0, n - 1)
    scale = jnp.asarray(x.scales())[safe]
    scale = jnp.where(ids < 0, 0.0, scale)
    scale = jnp.where(ids >= n, jnp.nan, scale)
    picked = (
        jnp.take(x.a, safe, axis=0, mode="clip"),
        jnp.take(x.b, safe, axis=0, mode="clip"),
        scale,
    )
    if isinstance(x, DoraBank):  # id -1: the base's own norm (its weight is the base)
        m = jnp.take(x.m, safe, axis=0, mode="clip")
        norm = jnp.sqrt(x.w_norm2).astype(m.dtype)
        where = (ids < 0).reshape((-1,) + (1,) * (jnp.ndim(m) - 1))
        return (*picked, jnp.where(where, norm[None], m))
    return picked


def _view(x: LoraBank, a: Any, b: Any, s: Any, m: Any = None) -> Any:
    """One example's adapter: its factors with the scale folded into the smaller one
    (a `DoraWeight` with its magnitude ``m`` for a `DoraBank`)."""
    if math.prod(jnp.shape(a)) <= math.prod(jnp.shape(b)):
        a = a * s.astype(a.dtype)
    else:
        b = b * s.astype(b.dtype)
    if isinstance(x, DoraBank):
        return DoraWeight(x.w, a, b, m=m, w_norm2=x.w_norm2, a_axes=x.a_axes)
    return LoraWeight(x.w, a, b, freeze_w=x.freeze_w, a_axes=x.a_axes)


def per_example(
    f: Callable[..., Any], *, in_axes: Any = 0, out_axes: int = 0
) -> Callable[..., Any]:
    """Run ``f`` on a batch whose examples each use their own adapter from a bank.

    ``per_example(f)(adapter_ids, *args)`` returns, for each example ``i``, what ``f``
    returns when that example runs alone with adapter ``adapter_ids[i]`` (``-1``: the
    base model alone): arguments that hold `LoraBank`s are the parameters, and every
    example sees them with each bank replaced by its adapter's `LoraWeight`; every other
    argument is split into examples along ``in_axes`` (each example keeps a batch axis
    of size 1 there, so ``f`` is the unchanged batched model code), and the outputs are
    stacked back along ``out_axes``. ``f`` is called on implicit arrays
    (`qax.use_implicit_args` is applied for you).

    Under the hood this is `jax.vmap` over the examples: the shared base weight is not
    mapped (``x @ w`` is one product for the whole batch, over a quantized base too),
    and each example's factors are gathered from the bank. It composes with `jax.jit`,
    `jax.grad` (gradients reach each adapter from its own examples only), `lax.scan`
    over stacked layers and `jax.checkpoint`.

    Examples:
        >>> served = qax.lora.bank(base, [adapters_a, adapters_b])
        >>> ids = jnp.array([0, 1, 1, -1])                 # one adapter per example
        >>> logits = jax.jit(qax.lora.per_example(model.apply))(ids, served, tokens)
        >>> # a decode step: the cache is batched, the position shared
        >>> step = qax.lora.per_example(decode, in_axes=(None, 0, 0, None))
        >>> logits, cache = step(ids, served, token, cache, position)

    Args:
      f: the model function, written for dense arrays (a Flax ``apply``, an NNX call
        ``lambda model, x: model(x)``, any function).
      in_axes: for the arguments after ``adapter_ids``: the batch axis of each (an int
        for all, or a tuple with an int or ``None`` per argument; ``None``: shared by
        every example, not split). Arguments holding banks are always parameters:
        their other leaves are shared.
      out_axes: the batch axis of every output.

    Returns:
      ``g(adapter_ids, *args)``. ``adapter_ids``: a 1-D integer array, one id per
      example. An id outside ``-1..N-1`` raises `ValueError` when the ids are concrete;
      traced ones (under `jax.jit`) give NaN outputs for that example.
    """
    call = qax.use_implicit_args(f)

    @functools.wraps(f)
    def run(adapter_ids: Any, *args: Any) -> Any:
        axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        if len(axes) != len(args):
            raise ValueError(
                f"qax.lora.per_example: in_axes has {len(axes)} entries for "
                f"{len(args)} arguments after adapter_ids."
            )
        holds = [bool(_banks(arg)) for arg in args]
        if not any(holds):
            raise ValueError(_NO_BANK)
        n = _bank_size(
            [a for a, h in zip(args, holds, strict=True) if h], "per_example"
        )
        ids = _check_ids(adapter_ids, n)
        count = int(jnp.shape(ids)[0])

        # Parameters: banks become (shared base, per-example factors and scale).
        shapes, picked = [], []
        for arg, h in zip(args, holds, strict=True):
            if not h:
                shapes.append(None)
                continue
            leaves, treedef = jax.tree_util.tree_flatten(arg, is_leaf=_is_bank)
            shapes.append((treedef, leaves))
            picked.append([_select(x, ids) for x in leaves if _is_bank(x)])
        for k, (arg, h, axis) in enumerate(zip(args, holds, axes, strict=True)):
            if h or axis is None:
                continue
            for leaf in jax.tree_util.tree_leaves(arg):
                if jnp.ndim(leaf) <= axis or jnp.shape(leaf)[axis] != count:
                    raise ValueError(
                        _BATCH.format(
                            arg=k,
                            size=jnp.shape(leaf)[axis] if jnp.ndim(leaf) > axis else 0,
                            axis=axis,
                            n=count,
                        )
                    )

        data = [
            arg if not h and axis is not None else None
            for arg, h, axis in zip(args, holds, axes, strict=True)
        ]
        data_axes = [
            axis if not h and axis is not None else None
            for h, axis in zip(holds, axes, strict=True)
        ]

        def one(picked_i: list, data_i: list) -> Any:
            rebuilt, p = [], 0
            for k, (arg, shape) in enumerate(zip(args, shapes, strict=True)):
                if shape is not None:
                    treedef, leaves = shape
                    views, q = [], 0
                    for leaf in leaves:
                        if _is_bank(leaf):
                            views.append(_view(leaf, *picked_i[p][q]))
                            q += 1
                        else:
                            views.append(leaf)
                    rebuilt.append(jax.tree_util.tree_unflatten(treedef, views))
                    p += 1
                elif data_axes[k] is None:
                    rebuilt.append(arg)
                else:
                    ax = data_axes[k]
                    rebuilt.append(
                        jax.tree_util.tree_map(
                            lambda v, ax=ax: jnp.expand_dims(v, ax), data_i[k]
                        )
                    )
            out = call(*rebuilt)
            return _squeeze_outputs(out, out_axes)

        return jax.vmap(one, in_axes=(0, data_axes), out_axes=out_axes)(picked, data)

    return run


def _squeeze_outputs(out: Any, axis: int) -> Any:
    def squeeze(path: Any, v: Any) -> Any:
        shape = jnp.shape(v)
        if len(shape) <= axis or shape[axis] != 1:
            raise ValueError(
                _OUT_AXIS.format(
                    path=jax.tree_util.keystr(path) or "(the output)",
                    shape=tuple(shape),
                    axis=axis,
                )
            )
        return jnp.squeeze(v, axis)

    return jax.tree_util.tree_map_with_path(squeeze, out)
