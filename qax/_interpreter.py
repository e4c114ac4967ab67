"""The interpreter: a stackless JAX `Trace` whose tracers carry implicit arrays.

`use_implicit_args(f)` runs `f` with an `ImplicitTrace` current. Implicit arguments enter
as `ImplicitTracer`s; every primitive bound while the trace is current reaches
`ImplicitTrace.process_primitive`. Primitives without implicit operands go straight to the
parent trace (plain JAX, untouched); the others are resolved by `apply_primitive`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jaxlib
import numpy as np
import plum

from . import _dispatch, _errors, _mutable
from ._base import (
    ImplicitBase,
    check_declared_avals,
    is_implicit,
    quiet_materialization,
)
from ._compat import (
    Primitive,
    Trace,
    Tracer,
    TraceTag,
    bind_canonical,
    current_trace,
    ensure_no_leaks,
    in_backward_pass,
    is_eval_trace,
    set_current_trace,
    traced_source_line,
    typeof,
)
from .constants import COMMUTATIVE_OPS

_COMMUTATIVE = frozenset(
    p for p in (getattr(jax.lax, f"{n}_p", None) for n in COMMUTATIVE_OPS) if p
)

# Rules for primitives whose operands are functions of other operands (jit, scan, cond,
# ...). Declared here, filled by `qax._higher_order`: rule(trace, primitive, vals, params).
structural_rules: dict[Primitive, Callable[..., Any]] = {}


# ----------------------------------------------------------------------------------------
# Materialization reports


@dataclasses.dataclass(frozen=True)
class MaterializationEvent:
    """One implicit operand that was turned into a dense array."""

    primitive: str
    cls: type
    shape: tuple[int, ...]
    dtype: Any
    source: str | None
    # A specific explanation (e.g. "the carry of a scan changed structure"), warned
    # instead of the standard "was not handled" text.
    reason: str | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


# Listeners see every event (audits); recorders collect events of a traced body so that a
# cached body can report them again when it is reused.
_listeners: contextvars.ContextVar[
    tuple[Callable[[MaterializationEvent], None], ...]
] = contextvars.ContextVar("qax_listeners", default=())
_recorders: contextvars.ContextVar[tuple[list, ...]] = contextvars.ContextVar(
    "qax_recorders", default=()
)
# Set while a body is traced that may be thrown away (a loop traced again with another
# carry structure): its events are collected here and reported later with `replay`.
_held: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "qax_held", default=None
)


def _package_dir(module: Any) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_SKIP_DIRS = tuple(
    _package_dir(m) for m in (sys.modules[__package__], jax, jaxlib, plum, contextlib)
)


def _stacklevel() -> int:
    """The `stacklevel` that points a warning at the first frame outside JAX and qax."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame, level = frame.f_back, level + 1
    return level


@contextlib.contextmanager
def listen(callback: Callable[[MaterializationEvent], None]) -> Iterator[None]:
    token = _listeners.set((*_listeners.get(), callback))
    try:
        yield
    finally:
        _listeners.reset(token)


@contextlib.contextmanager
def _recording(into: list) -> Iterator[None]:
    token = _recorders.set((*_recorders.get(), into))
    try:
        yield
    finally:
        _recorders.reset(token)


@contextlib.contextmanager
def holding_reports(into: list) -> Iterator[None]:
    """Collect the events reported inside into `into` instead of reporting them.

    Recorders opened inside still see them; the caller `replay`s the ones that count.
    """
    held, recorders = _held.set(into), _recorders.set(())
    try:
        yield
    finally:
        _recorders.reset(recorders)
        _held.reset(held)


def _source_line() -> str | None:
    """`file:line (function)` of the user code behind a materialization.

    The first frame outside JAX and qax (where the warning points); in a backward pass,
    the user line of the forward operation being transposed, when JAX knows it.
    """
    if in_backward_pass():
        line = traced_source_line(_SKIP_DIRS)
        if line is not None:
            return line
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame = frame.f_back
    if frame is None:
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def keyword_policy(event: MaterializationEvent) -> tuple[str, str]:
    """The class keyword's policy: "warn", or "allow" for `warn_on_materialize=False`."""
    if event.cls.warn_on_materialize:
        return "warn", "class default"
    return "allow", f"{event.cls.__name__} was created with warn_on_materialize=False"


# Decides what a materialization does: ("allow" | "warn" | "error", why). Declared here,
# replaced by `qax._audit` with the rules of `qax.materialization_policy`.
PolicyRule = Callable[[MaterializationEvent], tuple[str, str]]
decide_policy: list[PolicyRule] = [keyword_policy]


def report(event: MaterializationEvent) -> None:
    """Record `event`, then apply its policy: nothing, a warning, or an error."""
    for recorder in _recorders.get():
        recorder.append(event)
    held = _held.get()
    if held is not None:
        held.append(event)
        return
    for listener in _listeners.get():
        listener(event)
    policy, why = decide_policy[0](event)
    if policy == "error":
        phase = "backward" if in_backward_pass() else "forward"
        raise _errors.MaterializationError(event, why, phase)
    if policy == "warn":
        message = event.reason or _errors.MATERIALIZE_WARNING.format(
            primitive=event.primitive, cls=event.cls.__name__
        )
        warnings.warn(message, _errors.MaterializationWarning, stacklevel=_stacklevel())


def replay(events: list[MaterializationEvent]) -> None:
    for event in events:
        report(event)


# ----------------------------------------------------------------------------------------
# Trace and tracer


class ImplicitTracer(Tracer):
    """A tracer whose value is an implicit array (never a plain array)."""

    __slots__ = ("value",)

    def __init__(self, trace: ImplicitTrace, value: ImplicitBase):
        super().__init__(trace, value.aval)
        self.value = value

    def full_lower(self):
        return self

    def _contents(self):
        return [("value", self.value)]


class ImplicitTrace(Trace):
    """Interprets primitives on implicit arrays; see the module docstring."""

    def __init__(self, parent_trace: Trace, tag: TraceTag):
        super().__init__()
        self.parent_trace = parent_trace
        self.tag = tag
        self.requires_low = False

    # -- lifting and lowering ------------------------------------------------------------

    def to_value(self, x: Any) -> Any:
        if isinstance(x, ImplicitTracer) and x._trace.tag is self.tag:
            return x.value
        return x

    def wrap(self, x: Any) -> Any:
        return ImplicitTracer(self, x) if isinstance(x, ImplicitBase) else x

    def unwrap_tree(self, tree: Any) -> Any:
        """Replace this trace's tracers by their values, at any depth of `tree`."""
        if isinstance(tree, (list, tuple)) and not any(
            isinstance(x, (ImplicitTracer, ImplicitBase, list, tuple, dict))
            for x in tree
        ):
            return tree
        return jax.tree_util.tree_map(self.to_value, tree)

    # -- JAX's Trace interface -----------------------------------------------------------

    def process_primitive(self, primitive, tracers, params):
        # Hot path (every primitive bound while this trace is current): unwrap and look
        # for implicit operands in one pass, without a method call per operand.
        tag = self.tag
        vals = []
        implicit = False
        for t in tracers:
            if isinstance(t, ImplicitTracer) and t._trace.tag is tag:
                t = t.value
            if not implicit and isinstance(t, ImplicitBase):
                implicit = True
            vals.append(t)
        if not implicit:  # operands straight from `bind`: already canonical
            return bind_canonical(self.parent_trace, primitive, vals, params)
        out = apply_primitive(self, primitive, vals, params)
        if primitive.multiple_results:
            return [self.wrap(o) for o in out]
        return self.wrap(out)

    def stage_value(self, val):
        if isinstance(val, ImplicitTracer) and val._trace.tag is self.tag:
            return val
        return self.parent_trace.stage_value(val)

    def process_call(self, call_primitive, f, tracers, params):
        rule = structural_rules[call_primitive]
        return rule(
            self, call_primitive, f, [self.to_value(t) for t in tracers], params
        )

    def process_custom_jvp_call(self, primitive, fun, jvp, tracers, *, symbolic_zeros):
        rule = structural_rules[primitive]
        vals = [self.to_value(t) for t in tracers]
        return rule(self, primitive, fun, jvp, vals, symbolic_zeros=symbolic_zeros)

    def process_custom_vjp_call(
        self, primitive, fun, fwd, bwd, tracers, *, out_trees, symbolic_zeros
    ):
        rule = structural_rules[primitive]
        vals = [self.to_value(t) for t in tracers]
        return rule(
            self,
            primitive,
            fun,
            fwd,
            bwd,
            vals,
            out_trees=out_trees,
            symbolic_zeros=symbolic_zeros,
        )

    def process_shard_map(self, primitive, fun, tracers, **params):
        rule = structural_rules[primitive]
        return rule(self, primitive, fun, [self.to_value(t) for t in tracers], params)


# ----------------------------------------------------------------------------------------
# Resolving one primitive on implicit operands


def apply_primitive(
    trace: ImplicitTrace, primitive: Primitive, vals: list, params: dict
):
    """Run `primitive` on `vals`, at least one of which is implicit.

    The fallback order:

    1. commutative binary primitives get the implicit operand first (unless its class
       was created with ``commute_ops=False``);
    2. a handler registered with `qax.primitive_handler` for the operand types; it may
       return `NotImplemented` to pass;
    3. a structural rule (jit, scan, cond, while, remat, custom_jvp, ...), which runs the
       primitive's body on the implicit values without materializing them;
    4. the per-type rule `cls.default_handler` of the first implicit operand's class;
    5. materialize the implicit operands (one layer), warn, and bind the primitive.
    """
    if (
        len(vals) == 2
        and primitive in _COMMUTATIVE
        and not isinstance(vals[0], ImplicitBase)
        and vals[1].commute_ops
    ):
        vals = [vals[1], vals[0]]

    types = tuple(map(_dispatch.dispatch_type, vals))
    handler = _dispatch.lookup(primitive, types)
    if handler is not None:
        kwargs = _dispatch.params_for(handler, primitive, params)
        out = call_with_children(trace, handler, primitive, *vals, **kwargs)
        if out is not NotImplemented:
            _check_result(handler, primitive, vals, params, out)
            return out

    rule = structural_rules.get(primitive)
    if rule is not None:
        return rule(trace, primitive, vals, params)

    cls = type(next(v for v in vals if isinstance(v, ImplicitBase)))
    if cls.default_handler.__func__ is not _BASE_DEFAULT_HANDLER:
        out = call_with_children(
            trace, cls.default_handler, primitive, *vals, params=params
        )
        if out is not NotImplemented:
            return out
    return materialize_and_bind(trace, primitive, vals, params)


# The base rule only says "materialize": classes that keep it skip the call.
_BASE_DEFAULT_HANDLER = ImplicitBase.default_handler.__func__


def materialize_and_bind(trace: ImplicitTrace, primitive: Primitive, vals, params):
    """Step 5 of `apply_primitive`: densify the implicit operands and run `primitive`."""
    dense = []
    for v in vals:
        if isinstance(v, ImplicitBase):
            if not quiet_materialization.get():
                report(
                    MaterializationEvent(
                        primitive.name, type(v), v.shape, v.dtype, _source_line()
                    )
                )
            v = materialize_one_layer(trace, v)
        dense.append(v)
    bind_params = primitive.get_bind_params(params)
    with set_current_trace(trace):
        out = primitive.bind(*map(trace.wrap, dense), **bind_params)
    if primitive.multiple_results:
        return [trace.to_value(o) for o in out]
    return trace.to_value(out)


def materialize_one_layer(trace: ImplicitTrace, value: ImplicitBase) -> Any:
    """`value.materialize()`, with implicit children visible to `trace` as tracers."""
    out = call_with_children(trace, type(value).materialize, value)
    got = typeof(out) if not isinstance(out, ImplicitBase) else out.aval
    if got.shape != tuple(value.shape) or got.dtype != value.dtype:
        raise _errors.HandlerError(
            f"{type(value).__name__}.materialize() returned {got.str_short()}, but the "
            f"array declares shape {tuple(value.shape)} and dtype {value.dtype}. Fix "
            "`materialize()` or the declared shape/dtype."
        )
    return out


def _implicit_children(value: ImplicitBase) -> list[tuple[str, Any]]:
    """The (field name, child) pairs of `value` that contain implicit arrays."""
    found = []
    for name in type(value)._qax_child_names():
        child = getattr(value, name)
        if isinstance(child, ImplicitBase) or (
            isinstance(child, (list, tuple, dict))
            and any(
                map(is_implicit, jax.tree_util.tree_leaves(child, is_leaf=is_implicit))
            )
        ):
            found.append((name, child))
    return found


def call_with_children(trace: ImplicitTrace, fn: Callable, *args: Any, **kwargs: Any):
    """Call user code (a handler, `materialize`) on implicit values.

    Implicit arrays nested *inside* the implicit arguments are handed over as tracers of
    `trace`, so that `jnp` code on them is dispatched again; the call then runs with
    `trace` current. Without nesting it runs directly on the parent trace.
    """
    nested = False
    new_args = list(args)
    for i, arg in enumerate(args):
        if isinstance(arg, ImplicitBase):
            children = _implicit_children(arg)
            if children:
                nested = True
                arg = copy.copy(arg)
                for name, child in children:
                    wrapped = jax.tree_util.tree_map(
                        trace.wrap, child, is_leaf=is_implicit
                    )
                    object.__setattr__(arg, name, wrapped)
                new_args[i] = arg
    if not nested:
        with set_current_trace(trace.parent_trace):
            return fn(*args, **kwargs)
    with set_current_trace(trace):
        out = fn(*new_args, **kwargs)
    if out is NotImplemented:
        return out
    return trace.unwrap_tree(out)


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    if isinstance(x, ImplicitBase):
        return tuple(x.shape), np.dtype(x.dtype)
    aval = typeof(x)
    return tuple(aval.shape), aval.dtype


def _expected_avals(primitive: Primitive, in_avals: tuple, params: dict) -> list:
    expected, _ = primitive.abstract_eval(*in_avals, **params)
    return list(expected) if primitive.multiple_results else [expected]


@functools.lru_cache(maxsize=4096)
def _expected_avals_cached(
    primitive: Primitive, in_avals: tuple, param_items: tuple, x64: bool
) -> list:
    return _expected_avals(primitive, in_avals, dict(param_items))


def _check_result(handler, primitive, vals, params, out) -> None:
    """Report a handler result whose shape or dtype differs from the primitive's."""
    try:
        in_avals = tuple(
            v.aval if isinstance(v, ImplicitBase) else typeof(v) for v in vals
        )
        try:
            # Shape rules are pure: cache them per (primitive, avals, params), which
            # saves most of the cost of this check while tracing (see benchmarks/).
            expected = _expected_avals_cached(
                primitive, in_avals, tuple(params.items()), jax.config.jax_enable_x64
            )
        except TypeError:  # unhashable params
            expected = _expected_avals(primitive, in_avals, params)
    except Exception:  # noqa: BLE001 (no abstract rule: nothing to check against)
        return
    outs = list(out) if primitive.multiple_results else [out]
    problem = len(outs) != len(expected)
    found = []
    for o, e in zip(outs, expected):
        try:
            shape, dtype = _shape_dtype(o)
        except TypeError:
            problem, shape, dtype = True, None, type(o).__name__
        found.append((shape, dtype))
        if shape != tuple(e.shape) or dtype != e.dtype:
            problem = True
    if problem:
        got = [f"{d}{list(s) if s is not None else ''}" for s, d in found]
        raise _errors.HandlerError(
            _errors.BAD_HANDLER_RESULT.format(
                handler=_dispatch.describe_handler(handler),
                primitive=primitive.name,
                got=", ".join(got),
                expected=", ".join(e.str_short() for e in expected),
            )
        )


# ----------------------------------------------------------------------------------------
# Entry points


_SLICED_THROUGH = (
    "{cls} of shape {shape} has fields that do not fit its declared ranks ({fields}): "
    "its leaves were sliced through an unbatched dimension, for example by "
    "`lax.scan`/`lax.map` or `tree_map(lambda x: x[i], ...)` over it outside "
    "`qax.use_implicit_args`. Do the scan (or indexing) inside the function wrapped "
    "with `qax.use_implicit_args`, where implicit arrays are sliced row by row."
)


def _check_entry(x: ImplicitBase) -> None:
    """Refuse an implicit argument whose leaves no longer fit its type's declaration."""
    if x.__dict__.get("_qax_nb", 0) is None:
        fields = dataclasses.fields(x)
        described = ", ".join(
            f"{f.name}: {getattr(getattr(x, f.name), 'shape', '?')}"
            for f in fields
            if f.name not in ("shape", "dtype") and "qax_ndim" in f.metadata
        )
        raise ValueError(
            _SLICED_THROUGH.format(
                cls=type(x).__name__, shape=x.shape, fields=described
            )
        )
    for name in type(x)._qax_child_names():
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
    sees them as JAX arrays of their `shape`/`dtype`; primitives on them are routed to
    handlers (see `apply_primitive` for the order). Implicit arrays may be returned. It
    composes with `jax.jit`, `jax.grad`, `jax.vmap` and friends on either side.

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
        reused = _eager_trace(parent)
        trace = reused or ImplicitTrace(parent, TraceTag())
        token = check_declared_avals.set(False)
        try:
            out = _run(trace, f, leaves, treedef, variables)
        finally:
            check_declared_avals.reset(token)
            if reused is not None:
                _eager.in_use = False
        if reused is None:
            with ensure_no_leaks(trace):
                del trace
        return out

    return implicit_f


_eager = threading.local()


def _eager_trace(parent: Trace) -> ImplicitTrace | None:
    """The thread's reusable trace for eager calls, if it applies and is free.

    JAX keys its caches of `jit` traces (every `jnp` function is a jit) on the current
    trace: a new trace per eager call would miss them every time and grow them without
    bound. Eager calls therefore share one trace per thread, unless a call is already
    using it (nesting) or tracer-leak checking is on (which needs a trace per call).
    """
    if not is_eval_trace(parent) or jax.config.jax_check_tracer_leaks:
        return None
    if getattr(_eager, "in_use", False):
        return None
    trace = getattr(_eager, "trace", None)
    if trace is None or trace.parent_trace is not parent:
        trace = _eager.trace = ImplicitTrace(parent, TraceTag())
    _eager.in_use = True
    return trace


def enter_current_trace(values: tuple) -> tuple | None:
    """Wrap implicit `values` into the current `ImplicitTrace`, if one is current."""
    trace = current_trace()
    if isinstance(trace, ImplicitTrace):
        return tuple(trace.wrap(v) for v in values)
    return None


def materialize_nested(implicit_arr: Any, full: bool = False) -> Any:
    """Materialize one layer of an implicit array, or with `full=True` all of them.

    Implicit arrays nested inside `implicit_arr` stay implicit while its `materialize()`
    runs (so their handlers apply); `full=True` repeats until a dense array remains.
    """
    while isinstance(implicit_arr, ImplicitBase):
        implicit_arr = use_implicit_args(_materialize_value)(implicit_arr)
        if not full:
            break
    return implicit_arr


def _materialize_value(tracer: Any) -> Any:
    trace = current_trace()
    return materialize_one_layer(trace, trace.to_value(tracer))
