"""Entry points: `use_implicit_args`, `materialize_nested`, and implicit values that
enter a transformation running inside `use_implicit_args`.

`use_implicit_args(f)` flattens the arguments, checks the implicit ones, opens an
`ImplicitTrace` (the thread's shared `EagerTrace` outside any transformation), runs `f`
with the implicit leaves as its tracers, writes back mutable state (`qax._mutable`), and
returns the implicit values of the outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from . import _errors, _mutable
from ._base import (
    NB,
    ImplicitBase,
    check_declared_avals,
    is_implicit,
    quiet_materialization,
)
from ._compat import (
    Trace,
    Zero,
    api_boundary,
    current_trace,
    ensure_no_leaks,
    hide_frames_of,
    is_eval_trace,
    is_stack_before_transformation,
    primitive_batchers,
    primitive_jvps,
    register_lowering_fun,
    set_current_trace,
)
from ._eager import eager_trace, new_trace, release
from ._fields import fields_of, stackable
from ._interpreter import (
    ImplicitTag,
    ImplicitTrace,
    ImplicitTracer,
    box,
    implicit_p,
    materialize_one_layer,
)
from ._report import QAX_DIR, quietly, report_materialization
from ._report import arguments as report_arguments


def _check_entry(x: ImplicitBase) -> None:
    """Refuse an implicit argument whose leaves no longer fit its type's declaration."""
    if x.__dict__.get(NB, 0) is None:
        fields = dataclasses.fields(x)
        described = ", ".join(
            f"{f.name}: {getattr(getattr(x, f.name), 'shape', '?')}"
            for f in fields
            if f.name not in ("shape", "dtype") and "qax_ndim" in f.metadata
        )
        raise ValueError(
            _errors.SLICED_THROUGH.format(
                cls=type(x).__name__, shape=x.shape, fields=described
            )
        )
    for name in fields_of(type(x)).children:
        child = x.__dict__.get(name)
        if isinstance(child, ImplicitBase):
            _check_entry(child)


def _run(trace: ImplicitTrace, f: Callable, leaves: list, treedef, variables: list):
    for x in leaves:
        if isinstance(x, ImplicitBase):
            _check_entry(x)
    in_tracers = [trace.wrap(x) for x in leaves]
    with set_current_trace(trace):
        # Rebuilt under the trace: objects that record the trace they were made in
        # (Flax NNX `Variable`s) may then be updated inside `f`, e.g. by `nnx.jit`.
        args, kwargs = jax.tree_util.tree_unflatten(treedef, in_tracers)
        del in_tracers
        pairs = _mutable.capture(variables, (args, kwargs)) if variables else None
        out = f(*args, **kwargs)
    del args, kwargs
    if pairs:
        _mutable.write_back(pairs, trace.to_value)
    return jax.tree_util.tree_map(trace.to_value, out)


def use_implicit_args(f: Callable) -> Callable:
    """Make `f` accept implicit arrays anywhere in its arguments.

    The returned function takes the same arguments as `f`; any pytree leaf may be an
    implicit array (at any depth, also nested inside other implicit arrays). Inside, `f`
    sees them as JAX arrays of their `shape`/`dtype` (their fields are not readable
    there). Each primitive applied to one is resolved in this order: a handler
    registered with `qax.primitive_handler` for the operand types; for `jit`, `scan`,
    `cond`, `while_loop`, `checkpoint` and custom derivatives, the function body runs on
    the implicit values; the class's `default_handler`; otherwise the implicit operands
    are materialized, with a `qax.MaterializationWarning`. Implicit arrays may be
    returned. It composes with `jax.jit`, `jax.grad`, `jax.vmap` and friends on either
    side.

    Examples:
        >>> @qax.use_implicit_args
        ... def f(w, x):
        ...     return x @ w
        >>> f(LoraMatrix(w, a, b), x)  # never forms w + a @ b.T

    Args:
      f: any function of JAX arrays.

    Returns:
      The wrapped function.
    """

    @functools.wraps(f)
    def implicit_f(*args, **kwargs):
        leaves, treedef, variables = _mutable.flatten(
            (args, kwargs), is_leaf=is_implicit
        )
        parent = current_trace()
        reused = eager_trace(parent)
        trace = reused or new_trace(parent, ImplicitTag())
        token = check_declared_avals.set(False)
        try:
            with report_arguments(args, kwargs):  # names what is materialized
                out = _run(trace, f, leaves, treedef, variables)
        except Exception as e:
            _raise_if_half_built(leaves, e)
            _show_once(e)
            _note_structure_error(e)
            raise
        finally:
            check_declared_avals.reset(token)
            if reused is not None:
                release()
        if reused is None and not trace.tag.rules_outlive_call:
            with ensure_no_leaks(trace):
                del trace
        return out

    return api_boundary(implicit_f)


# qax's frames are left out of the tracebacks JAX filters, like JAX's own.
hide_frames_of(QAX_DIR)

_QAX_ERRORS = (
    _errors.HandlerError,
    _errors.MaterializationError,
    _errors.UninitializedAval,
)


def _show_once(error: Exception) -> None:
    """Drop the copy of the stack that JAX chains to qax's own errors raised while it
    re-evaluated a traced operation: the error would be printed twice, and the filtered
    traceback already ends at the user's line."""
    if isinstance(error, _QAX_ERRORS) and is_stack_before_transformation(
        error.__cause__
    ):
        error.__cause__ = None
        error.__suppress_context__ = True


def _note_structure_error(error: Exception) -> None:
    """Add the cause and the fix to JAX's error for a loop carry (or `cond` branches)
    whose pytree structure changes, when an implicit type is part of it."""
    message = str(error)
    if not isinstance(error, TypeError) or "pytree structure" not in message:
        return
    names, todo = set(), [ImplicitBase]
    while todo:
        for cls in todo.pop().__subclasses__():
            names.add(cls.__name__)
            todo.append(cls)
    if any(f".{name}'" in message or f" {name} " in message for name in names):
        error.add_note(_errors.CONSTRUCTED_CARRY)


def enter_current_trace(values: tuple) -> tuple | None:
    """Implicit `values` as values of the current trace, if `use_implicit_args` is on.

    In an `ImplicitTrace`, they are wrapped as its tracers. In a transformation that
    runs inside `use_implicit_args` (a `jit`, `grad`, `vmap` or `checkpoint` of a
    function called there), they enter that transformation's trace through
    `implicit_p`, which gives the `ImplicitTrace` below the implicit value back.
    Otherwise (no `use_implicit_args` active) None.
    """
    trace = current_trace()
    if isinstance(trace, ImplicitTrace):
        return tuple(
            trace.adopt(v) if isinstance(v, ImplicitBase) else v for v in values
        )
    if _implicit_trace_below(trace):
        return tuple(box(v) if isinstance(v, ImplicitBase) else v for v in values)
    return None


def implicit_args_active() -> bool:
    """Whether code runs inside `use_implicit_args` (maybe under a transformation)."""
    return _implicit_trace_below(current_trace())


def _implicit_trace_below(trace: Trace) -> bool:
    while trace is not None and not is_eval_trace(trace):
        if isinstance(trace, ImplicitTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def _half_built_fields(value: ImplicitBase) -> list[str]:
    """``Type.field`` for each child field of `value` (or of an implicit array nested in
    it) that is None, as `eqx.partition` leaves them."""
    found = []
    for name in fields_of(type(value)).children:
        child = getattr(value, name, None)
        if child is None:
            found.append(f"{type(value).__name__}.{name}")
        elif isinstance(child, ImplicitBase):
            found += _half_built_fields(child)
    return found


def _raise_if_half_built(leaves: list, error: Exception) -> None:
    """Re-raise `error` as a `TypeError` naming the None fields, if an implicit array
    among `leaves` has some: the likely cause of a failure deep inside dispatch."""
    fields = [
        f for leaf in leaves if is_implicit(leaf) for f in _half_built_fields(leaf)
    ]
    if not fields:
        return
    lines = str(error).strip().splitlines()
    raise TypeError(
        _errors.HALF_BUILT.format(
            fields=", ".join(f"`{f}`" for f in fields),
            verb="is" if len(fields) == 1 else "are",
            error=f"{type(error).__name__}: {lines[0].rstrip('.') if lines else ''}",
        )
    ) from None


# ----------------------------------------------------------------------------------------
# The rules of `implicit_p` (declared in `qax._interpreter`)
# A function transformed inside `use_implicit_args` (`use_implicit_args(jax.jit(f))`)
# runs on the transformation's trace, which cannot hold an implicit array that `f`
# creates. Such a value enters that trace as `implicit_p` of its leaves: a primitive
# whose result looks like the dense array. Transformations that pass it on (`vmap` and
# `grad` do when its leaves are not batched or differentiated) hand it to the
# `ImplicitTrace` below, which takes the implicit value back; a staged one (`jit`,
# `checkpoint`) meets the `ImplicitTrace` when the staged body is interpreted again by
# its rule. Where no `ImplicitTrace` takes it, the value is materialized.


def _report_unboxed(tree: Any, leaves: Sequence, reason: str) -> None:
    """Report the materialization of the value of `leaves` that `reason` explains."""
    if quiet_materialization.get():
        return
    value = jax.tree_util.tree_unflatten(tree, list(leaves))
    report_materialization(
        implicit_p.name, value, reason.format(cls=type(value).__name__)
    )


def _unboxed_dense(tree: Any, *leaves: Any) -> Any:
    """The dense array that the implicit value with `leaves` represents (reported)."""
    with quietly():
        value = jax.tree_util.tree_unflatten(tree, list(leaves))
        return materialize_nested(value, full=True)


def _implicit_impl(*leaves, tree, aval):
    _report_unboxed(tree, leaves, _errors.CREATED_INSIDE_USED_OUTSIDE)
    return _unboxed_dense(tree, *leaves)


def _implicit_jvp(primals, tangents, *, tree, aval):
    out = implicit_p.bind(*primals, tree=tree, aval=aval)
    _report_unboxed(tree, primals, _errors.CREATED_UNDER_GRAD)
    # Leaves without a tangent (symbolic zeros) are constants of the derivative: a zero
    # tangent instantiated for them would leave a `leaf * 0` term in the tangent, which
    # depends on the primal where the dense program's does not (reverse mode through a
    # `while_loop` carrying that tangent then fails).
    moving = [type(t) is not Zero for t in tangents]

    def dense(*moved):
        it = iter(moved)
        leaves = [next(it) if m else p for p, m in zip(primals, moving, strict=True)]
        return _unboxed_dense(tree, *leaves)

    return out, jax.jvp(
        dense,
        tuple(p for p, m in zip(primals, moving, strict=True) if m),
        tuple(t for t, m in zip(tangents, moving, strict=True) if m),
    )[1]


def _implicit_batch(args, dims, *, tree, aval):
    # `dims` holds None for the leaves that are not batched, as `in_axes` does.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    stacked = _stacked(tree, args, dims, size, aval)
    if stacked is not None:
        return box(stacked), 0
    _report_unboxed(tree, args, _errors.CREATED_UNDER_VMAP)
    dense = functools.partial(_unboxed_dense, tree)
    return jax.vmap(dense, in_axes=list(dims), axis_size=size)(*args), 0


class _NotStackable(Exception):
    pass


def _stacked(tree: Any, args: Sequence, dims: Sequence, size: int, aval: Any):
    """The stack, along a new leading axis, of the examples of an implicit value built
    inside `vmap` (leaves `args`, batched along `dims`), if its type and those of the
    implicit arrays nested in it declare their batch axes: stacked leaf by leaf, as
    `vmap` outside `use_implicit_args` stacks it (a part shared by the examples, such
    as a base weight closed over, is broadcast along the new axis). Else None."""

    trace = current_trace()
    if isinstance(trace, ImplicitTrace):
        # An implicit part shared by the examples (a symbolic constant closed over):
        # its value, which `vmap` batches by its own rules below. (A batched one stays
        # this trace's tracer: `vmap` slices it as the array it is.)
        args = [
            trace.to_value(a) if d is None else a
            for a, d in zip(args, dims, strict=True)
        ]

    def example(*leaves):
        value = jax.tree_util.tree_unflatten(tree, list(leaves))
        if not stackable(value):
            raise _NotStackable
        return value

    try:
        out = jax.vmap(example, in_axes=list(dims), axis_size=size)(*args)
    except _NotStackable:
        return None
    if not isinstance(out, ImplicitBase) or tuple(out.shape) != (size, *aval.shape):
        return None
    return out


implicit_p.def_impl(_implicit_impl)
implicit_p.def_abstract_eval(lambda *avals, tree, aval: aval)
register_lowering_fun(implicit_p, _implicit_impl)
primitive_jvps[implicit_p] = _implicit_jvp
primitive_batchers[implicit_p] = _implicit_batch


def materialize_nested(implicit_arr: Any, full: bool = False) -> Any:
    """Materialize one layer of an implicit array, or with `full=True` all of them.

    Implicit arrays nested inside `implicit_arr` stay implicit while its `materialize()`
    runs (so their handlers apply); `full=True` repeats until a dense array remains.
    Inside `materialize()` of a type holding another implicit array, the child arrives
    as a tracer of `use_implicit_args`; ``qax.materialize_nested(self.inner)`` then
    materializes its value (explicitly asked for: no warning). A pytree (a dict of
    parameters) has each of its implicit leaves materialized so; other leaves stay.
    """
    kinds = (ImplicitBase, ImplicitTracer)
    if not isinstance(implicit_arr, kinds):
        leaves, treedef = jax.tree_util.tree_flatten(
            implicit_arr, is_leaf=lambda x: isinstance(x, kinds)
        )
        if not any(isinstance(x, kinds) for x in leaves):
            return implicit_arr
        leaves = [
            materialize_nested(x, full) if isinstance(x, kinds) else x for x in leaves
        ]
        return jax.tree_util.tree_unflatten(treedef, leaves)
    while True:
        if isinstance(implicit_arr, ImplicitBase):
            implicit_arr = use_implicit_args(_materialize_value)(implicit_arr)
        elif isinstance(implicit_arr, ImplicitTracer):
            trace = implicit_arr.owner
            value = materialize_one_layer(trace, implicit_arr.value)
            implicit_arr = trace.wrap(value)
        else:
            return implicit_arr
        if not full:
            return implicit_arr


def _materialize_value(tracer: Any) -> Any:
    trace = current_trace()
    return materialize_one_layer(trace, trace.to_value(tracer))


def densify(x: ImplicitBase, primitive: str, reason: str | None) -> Any:
    """Report the materialization of `x` by `primitive` (why: `reason`), then
    materialize it all the way down at the current trace."""
    report_materialization(primitive, x, reason)
    return materialize_nested(x, full=True)
