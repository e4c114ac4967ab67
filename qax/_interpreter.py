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
import operator
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jaxlib
import numpy as np
import plum

from . import _dispatch, _errors, _mutable
from ._base import (
    NB,
    STACKED,
    ImplicitBase,
    check_declared_avals,
    is_implicit,
    quiet_materialization,
)
from ._compat import (
    ArrayImpl,
    ClosedJaxpr,
    Jaxpr,
    Primitive,
    Trace,
    Tracer,
    TraceTag,
    api_boundary,
    bind_canonical,
    canonicalize_value,
    current_trace,
    ensure_no_leaks,
    hide_frames_of,
    in_backward_pass,
    init_tracer,
    instantiate_zeros,
    is_eval_trace,
    is_stack_before_transformation,
    jaxpr_as_fun,
    jit_context,
    jit_params_are_default,
    primitive_batchers,
    primitive_jvps,
    primitives_module,
    register_lowering_fun,
    set_current_trace,
    traced_source_line,
    typeof,
)
from .constants import COMMUTATIVE_OPS

_COMMUTATIVE = frozenset(
    p for p in (getattr(jax.lax, f"{n}_p", None) for n in COMMUTATIVE_OPS) if p
)

_primitive_rules = _dispatch.primitive_rules


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


# Frames skipped when looking for the user's line (warnings' stacklevel, the audit's
# source column): qax, JAX, plum, the standard library, and every installed package
# (Flax, optax, ...: anything under a site-packages or dist-packages directory, wherever
# the environment keeps it; a virtualenv's is not under the standard library's).
_SKIP_DIRS = tuple(
    _package_dir(m) for m in (sys.modules[__package__], jax, jaxlib, plum, contextlib)
)
_INSTALLED = tuple(f"{os.sep}{d}{os.sep}" for d in ("site-packages", "dist-packages"))


# The example models (`qax.examples`) are model code, like the user's own: never skipped.
_EXAMPLES_DIR = f"{_SKIP_DIRS[0]}examples{os.sep}"


def _is_library_file(filename: str) -> bool:
    if filename.startswith(_EXAMPLES_DIR):
        return False
    return filename.startswith(_SKIP_DIRS) or any(d in filename for d in _INSTALLED)


def _stacklevel() -> int:
    """The `stacklevel` that points a warning at the first frame outside JAX and qax."""
    frame, level = sys._getframe(2), 2
    while frame is not None and _is_library_file(frame.f_code.co_filename):
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
        line = traced_source_line(_is_library_file)
        if line is not None:
            return line
    frame = sys._getframe(1)
    while frame is not None and _is_library_file(frame.f_code.co_filename):
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
    """Report again the events of a cached body that runs again (unless quiet)."""
    if quiet_materialization.get():
        return
    for event in events:
        report(event)


# ----------------------------------------------------------------------------------------
# Trace and tracer


class ImplicitTag(TraceTag):
    """The tag of one `use_implicit_args` call, shared by the sub-traces it opens."""

    def __init__(self):
        # Set when a custom derivative rule, which may close over this call's tracers,
        # is handed to a transformation that runs it after the call (a backward pass,
        # a staged program). The rule then sees them through a sub-trace with this tag,
        # so they are meant to outlive the call.
        self.rules_outlive_call = False


class ImplicitTracer(Tracer):
    """A tracer whose value is an implicit array (never a plain array)."""

    __slots__ = ("value", "owner")

    def __init__(self, trace: ImplicitTrace, value: ImplicitBase):
        init_tracer(self, trace, value.aval)
        self.owner = trace  # (JAX's own reference to it is private)
        self.value = value

    def full_lower(self):
        return self

    def _contents(self):
        return [("value", self.value)]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = object.__getattribute__(self, "value")
            if name in _field_names(type(value)):
                raise AttributeError(
                    _errors.FIELD_OF_TRACER.format(cls=type(value).__name__, name=name)
                ) from None
            raise


class ImplicitTrace(Trace):
    """Interprets primitives on implicit arrays; see the module docstring."""

    # Set once an implicit value has entered a nested transformation's trace (see
    # `implicit_p`): from then on, bodies that hold one are interpreted even when the
    # primitive that carries them has no implicit operand.
    created_implicit = False

    def __init__(self, parent_trace: Trace, tag: TraceTag):
        super().__init__()
        self.parent_trace = parent_trace
        self.tag = tag
        self.requires_low = False
        # Eager: primitives on plain operands run right away (see `eager_jit`).
        self.eager = is_eval_trace(parent_trace)
        # While an eager operator is looked at: the binds it makes (see `_operator`).
        self.recording: list | None = None

    # -- lifting and lowering ------------------------------------------------------------

    def to_value(self, x: Any) -> Any:
        if isinstance(x, ImplicitTracer) and x.owner.tag is self.tag:
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
        if self.recording is not None:
            return self._record(primitive, tracers, params)
        # Hot path (every primitive bound while this trace is current): unwrap and look
        # for implicit operands in one pass, without a method call per operand.
        tag = self.tag
        vals = []
        implicit = False
        for t in tracers:
            if isinstance(t, ImplicitTracer):
                if t.owner.tag is tag:
                    t = t.value  # always implicit
                    implicit = True
            elif not implicit and isinstance(t, ImplicitBase):
                implicit = True
            vals.append(t)
        if not implicit:  # operands straight from `bind`: already canonical
            if not (
                self.created_implicit
                and primitive in _primitive_rules
                and holds_created_implicit(params)
            ):
                if primitive is _JIT and self.eager:
                    compiled = eager_jit(params)
                    if compiled is not None:
                        return compiled(*vals)
                return bind_canonical(self.parent_trace, primitive, vals, params)
            out = _primitive_rules[primitive](self, primitive, vals, params)
        else:
            out = apply_primitive(self, primitive, vals, params)
        if primitive.multiple_results:
            return [self.wrap(o) for o in out]
        return self.wrap(out)

    def _record(self, primitive, tracers, params):
        recording, self.recording = self.recording, None
        try:
            out = self.process_primitive(primitive, tracers, params)
        finally:
            self.recording = recording
        recording.append((primitive, tracers, params, out))
        return out

    def _not_an_operator(self) -> None:
        if self.recording is not None:
            self.recording.append(None)

    def stage_value(self, val):
        if isinstance(val, ImplicitTracer) and val.owner.tag is self.tag:
            return val
        return self.parent_trace.stage_value(val)

    def process_call(self, call_primitive, f, tracers, params):
        # (JAX 0.10's call primitives; later versions bind `eval_jaxpr` instead.)
        self._not_an_operator()
        rule = _dispatch.function_rules[call_primitive]
        return rule(
            self, call_primitive, f, [self.to_value(t) for t in tracers], params
        )

    def process_custom_jvp_call(self, primitive, fun, jvp, tracers, *, symbolic_zeros):
        self._not_an_operator()
        rule = _dispatch.custom_jvp_rules[primitive]
        vals = [self.to_value(t) for t in tracers]
        return rule(self, primitive, fun, jvp, vals, symbolic_zeros=symbolic_zeros)

    def process_custom_vjp_call(
        self, primitive, fun, fwd, bwd, tracers, *, out_trees, symbolic_zeros
    ):
        self._not_an_operator()
        rule = _dispatch.custom_vjp_rules[primitive]
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
        self._not_an_operator()
        rule = _dispatch.function_rules[primitive]
        return rule(self, primitive, fun, [self.to_value(t) for t in tracers], params)


# ----------------------------------------------------------------------------------------
# Eager operators on implicit tracers
#
# ``t * x`` on a tracer runs JAX's `jnp.multiply`, a jitted function. Under any trace
# but the eval trace, JAX stages such a call in Python every time (a C++ cache miss,
# argument parsing, shape inference, `bind`) before its `jit` reaches
# `process_primitive`: several times the cost of the operation itself. Eagerly, the
# `jit` that an operator binds is remembered per (operator, operand types, JAX's
# configuration) the first time, and later calls bind it on the trace directly.

# The dunder methods of `Tracer` that call one `jnp` function on their operands.
_OPERATORS = (
    *(
        f"{prefix}{name}"
        for name in (
            "add",
            "sub",
            "mul",
            "truediv",
            "floordiv",
            "mod",
            "pow",
            "matmul",
            "and",
            "or",
            "xor",
            "lshift",
            "rshift",
        )
        for prefix in ("", "r")
    ),
    *("lt", "le", "gt", "ge", "eq", "ne", "neg", "pos", "abs", "invert"),
)
# (operator, config, operand types) -> (params of the `jit` it binds, where each of its
# operands comes from).
_operator_binds: dict[tuple, tuple] = {}
_OPERATOR_CACHE_LIMIT = 4096
_SCALARS = (bool, int, float, complex)


def _operator(name: str) -> Callable:
    jax_method = getattr(Tracer, f"__{name}__")

    def method(self, *args):
        trace = self.owner
        if trace.eager and trace.recording is None and current_trace() is trace:
            return trace.run_operator(name, jax_method, self, args)
        return jax_method(self, *args)

    method.__name__ = method.__qualname__ = f"__{name}__"
    return method


for _name in _OPERATORS:
    setattr(ImplicitTracer, f"__{_name}__", _operator(_name))


def _operand_key(x: Any, trace: ImplicitTrace) -> Any:
    """What JAX's staging of an operator sees of operand `x`; None: not remembered."""
    if isinstance(x, ImplicitTracer):
        return x.aval if x.owner is trace else None
    if type(x) is ArrayImpl:
        # Concrete scalars may change what `jnp` does (`x ** 2` is an `integer_pow`).
        return (x.aval, x.sharding) if x.ndim else None
    if type(x) in _SCALARS:
        return type(x), repr(x)  # repr: tells 0.0 from -0.0
    return None


def _operand_sources(bound: list, operands: tuple) -> tuple | None:
    """Where each operand of a recorded `jit` bind came from, among `operands`.

    Entries: (index, kind), kind 0 for an implicit tracer (its value is bound), 1 for
    an array (bound as it is), 2 for a Python scalar (bound canonicalized).
    """
    sources = []
    for b in bound:
        for j, x in enumerate(operands):
            if b is x:
                sources.append((j, 0 if isinstance(x, ImplicitTracer) else 1))
                break
            if type(x) in _SCALARS and not isinstance(b, Tracer) and b == x:
                sources.append((j, 2))
                break
        else:
            return None  # a constant of JAX's own: not an operand
    if not any(j == 0 for j, _ in sources):
        return None
    return tuple(sources)


def _run_operator(
    trace: ImplicitTrace, name: str, jax_method: Callable, tracer: Any, args: tuple
) -> Any:
    key = [name, jit_context(), tracer.aval]
    for x in args:
        k = _operand_key(x, trace)
        if k is None:
            return jax_method(tracer, *args)
        key.append(k)
    key = tuple(key)
    found = _operator_binds.get(key)
    operands = (tracer, *args)
    if found is not None:
        params, sources = found
        vals = [
            operands[j].value
            if kind == 0
            else operands[j]
            if kind == 1
            else canonicalize_value(operands[j])
            for j, kind in sources
        ]
        with set_current_trace(trace.parent_trace):  # as `bind` does
            out = apply_primitive(trace, _JIT, vals, params)
        return trace.wrap(out[0])
    recording = trace.recording = []
    try:
        result = jax_method(tracer, *args)
    finally:
        trace.recording = None
    if len(recording) == 1 and recording[0] is not None:
        primitive, bound, params, outs = recording[0]
        if primitive is _JIT and len(outs) == 1 and outs[0] is result:
            sources = _operand_sources(bound, operands)
            if sources is not None:
                if len(_operator_binds) >= _OPERATOR_CACHE_LIMIT:
                    _operator_binds.clear()
                _operator_binds[key] = (params, sources)
    return result


ImplicitTrace.run_operator = _run_operator


# ----------------------------------------------------------------------------------------
# Eager calls of jitted functions

_JIT = primitives_module.jit_p
# The `jit` parameters that `compile_jaxpr` reproduces only at their default values.
_JIT_PARAMS = (
    "in_shardings",
    "out_shardings",
    "in_layouts",
    "out_layouts",
    "donated_invars",
    "ctx_mesh",
    "keep_unused",
    "compiler_options_kvs",
)
_jit_params = operator.itemgetter(*_JIT_PARAMS)
# id(jaxpr) -> (weak reference to it, the parameters it was last bound with, its
# compiled form, None, or `_SEEN_ONCE`). A plain dict: this runs on every eager `jnp`
# call, and a `WeakKeyDictionary` lookup costs more than the rest.
_eager_jits: dict[int, tuple] = {}


def compile_jaxpr(closed: Any, keep_unused: bool = False) -> Callable:
    """`closed` as a `jax.jit`-compiled function of its inputs (returns a list)."""
    return jax.jit(jaxpr_as_fun(closed), keep_unused=keep_unused)


def eager_jit(params: dict) -> Callable | None:
    """A compiled function for an eager `jit` bind with `params`, if one applies.

    Under any trace other than JAX's eval trace, a call of a jitted function (every
    `jnp` function is one) leaves JAX's C++ fast path: JAX stages it and binds a `jit`,
    which the eval trace then compiles and runs through a Python path on every call.
    When such a `jit` reaches an eager `ImplicitTrace` with plain operands, it is run
    instead by a `jax.jit` of its jaxpr (cached per jaxpr), whose calls take the fast
    path. A jaxpr seen for the first time keeps the ordinary path (None): some are
    staged for one call only, which is not worth compiling again. So do parameters
    other than the defaults (shardings, donation, layouts, a mesh, compiler options).
    """
    closed = params["jaxpr"]
    key = id(closed)
    seen = _jit_params(params)
    entry = _eager_jits.get(key)
    if entry is not None and entry[0]() is closed and entry[1] == seen:
        compiled = entry[2]
        if compiled is not _SEEN_ONCE:
            return compiled
        compiled = None
        if jit_params_are_default(params):
            compiled = compile_jaxpr(closed, params["keep_unused"])
    else:
        compiled = _SEEN_ONCE
    _eager_jits[key] = (weakref.ref(closed, _forget(key)), seen, compiled)
    return None if compiled is _SEEN_ONCE else compiled


def _forget(key: int, entries: dict = _eager_jits) -> Callable:
    # `entries` is bound now: at interpreter exit module globals are already gone.
    def callback(ref):
        entry = entries.get(key)
        if entry is not None and entry[0] is ref:
            del entries[key]

    return callback


_SEEN_ONCE = object()


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

    stacked = any(map(_stacked_examples, vals))
    if not stacked:
        types = tuple(map(_dispatch.dispatch_type, vals))
        handler = _dispatch.lookup(primitive, types)
        if handler is not None:
            kwargs = _dispatch.params_for(handler, primitive, params)
            out = call_with_children(trace, handler, primitive, *vals, **kwargs)
            if out is not NotImplemented:
                _check_result(handler, primitive, vals, params, out)
                return out

    rule = _primitive_rules.get(primitive)
    if rule is not None:
        return rule(trace, primitive, vals, params)
    if stacked:
        return _unstacked_apply(trace, primitive, vals, params)

    cls = type(next(v for v in vals if isinstance(v, ImplicitBase)))
    if cls.default_handler.__func__ is not _BASE_DEFAULT_HANDLER:
        out = call_with_children(
            trace, cls.default_handler, primitive, *vals, params=params
        )
        if out is not NotImplemented:
            return out
    return materialize_and_bind(trace, primitive, vals, params)


def _stacked_examples(v: Any) -> bool:
    """Whether `v` is a stack of examples of a type that declares no batch axes."""
    return isinstance(v, ImplicitBase) and bool(
        STACKED in v.__dict__ and v.__dict__.get(NB)
    )


def _unstacked_apply(trace: ImplicitTrace, primitive: Primitive, vals, params):
    """`apply_primitive` after materializing the operands that `vmap` stacked from
    examples of a type that declares no batch axes: its handlers and `default_handler`
    are written for one example."""
    dense = []
    for v in vals:
        if _stacked_examples(v):
            if not quiet_materialization.get():
                reason = _errors.STACKED_UNDECLARED.format(
                    cls=type(v).__name__, n=v.shape[0] if v.shape else 0
                )
                report(
                    MaterializationEvent(
                        primitive.name,
                        type(v),
                        v.shape,
                        v.dtype,
                        _source_line(),
                        reason,
                    )
                )
            v = materialize_one_layer(trace, v)
        dense.append(v)
    if any(isinstance(v, ImplicitBase) for v in dense):
        return apply_primitive(trace, primitive, dense, params)
    return _bind_dense(trace, primitive, dense, params)


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
    return _bind_dense(trace, primitive, dense, params)


def _bind_dense(trace: ImplicitTrace, primitive: Primitive, dense: list, params):
    """Bind `primitive` on operands that are no longer implicit, on `trace`."""
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


def _field_names(cls: type) -> tuple[str, ...]:
    names = getattr(cls, "__dataclass_fields__", None)
    return tuple(names) if names else ()


def _half_built_fields(value: ImplicitBase) -> list[str]:
    """``Type.field`` for each child field of `value` (or of an implicit array nested in
    it) that is None, as `eqx.partition` leaves them."""
    found = []
    for name in type(value)._qax_child_names():
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
        parent = trace.parent_trace
        if current_trace() is parent:  # inside `bind`, eagerly
            return fn(*args, **kwargs)
        with set_current_trace(parent):
            return fn(*args, **kwargs)
    with set_current_trace(trace):
        out = fn(*new_args, **kwargs)
    if out is NotImplemented:
        return out
    return trace.unwrap_tree(out)


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    if isinstance(x, ImplicitBase):
        return tuple(x.shape), np.dtype(x.dtype)
    aval = _key_aval(x)
    return tuple(aval.shape), aval.dtype


def _key_aval(x: Any) -> Any:
    """`typeof(x)`, up to its sharding (cheaper for arrays, tracers, implicit arrays)."""
    if type(x) is ArrayImpl or isinstance(x, (ImplicitBase, Tracer)):
        return x.aval
    return typeof(x)


def _expected_shapes(primitive: Primitive, vals: list, params: dict) -> list | None:
    """The (shape, dtype) of each result of `primitive`, by its abstract rule.

    None when the primitive has no abstract rule for these operands (nothing to check).
    """
    in_avals = [v.aval if isinstance(v, ImplicitBase) else typeof(v) for v in vals]
    try:
        expected, _ = primitive.abstract_eval(*in_avals, **params)
    except Exception:  # noqa: BLE001 (no abstract rule: nothing to check against)
        return None
    expected = list(expected) if primitive.multiple_results else [expected]
    return [(tuple(e.shape), e.dtype, e.str_short()) for e in expected]


# Shape rules are pure: their answers are cached per (primitive, operand avals, params),
# which saves most of the cost of the check below, eagerly and while tracing (see
# benchmarks/). Shardings are left out of the key: they do not change shapes or dtypes.
_expected_cache: dict[tuple, list | None] = {}
_EXPECTED_CACHE_LIMIT = 8192


def _check_result(handler, primitive, vals, params, out) -> None:
    """Report a handler result whose shape or dtype differs from the primitive's."""
    try:
        key = (
            primitive,
            tuple(map(_key_aval, vals)),
            tuple(params.items()),
            jax.config.jax_enable_x64,
        )
        expected = _expected_cache[key]
    except TypeError:  # unhashable params
        expected = _expected_shapes(primitive, vals, params)
    except KeyError:
        expected = _expected_shapes(primitive, vals, params)
        if len(_expected_cache) >= _EXPECTED_CACHE_LIMIT:
            _expected_cache.clear()
        _expected_cache[key] = expected
    if expected is None:
        return
    outs = list(out) if primitive.multiple_results else [out]
    problem = len(outs) != len(expected)
    found = []
    for o, (shape_e, dtype_e, _) in zip(outs, expected):
        try:
            shape, dtype = _shape_dtype(o)
        except TypeError:
            problem, shape, dtype = True, None, type(o).__name__
        found.append((shape, dtype))
        if shape != shape_e or dtype != dtype_e:
            problem = True
    if problem:
        got = [f"{d}{list(s) if s is not None else ''}" for s, d in found]
        raise _errors.HandlerError(
            _errors.BAD_HANDLER_RESULT.format(
                handler=_dispatch.describe_handler(handler),
                primitive=primitive.name,
                got=", ".join(got),
                expected=", ".join(e[2] for e in expected),
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
    if x.__dict__.get(NB, 0) is None:
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
    sees them as JAX arrays of their `shape`/`dtype` (their fields are not readable
    there). Each primitive applied to one is resolved in this order: a handler
    registered with `qax.primitive_handler` for the operand types; for `jit`, `scan`,
    `cond`, `while_loop`, `checkpoint` and custom derivatives, the function body runs on
    the implicit values; the class's `default_handler`; otherwise the implicit operands
    are materialized, with a `qax.MaterializationWarning`. Implicit arrays may be
    returned. It composes with `jax.jit`, `jax.grad`, `jax.vmap` and friends on either
    side.

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
        trace = reused or ImplicitTrace(parent, ImplicitTag())
        token = check_declared_avals.set(False)
        try:
            out = _run(trace, f, leaves, treedef, variables)
        except Exception as e:
            _raise_if_half_built(leaves, e)
            _show_once(e)
            _note_structure_error(e)
            raise
        finally:
            check_declared_avals.reset(token)
            if reused is not None:
                _eager.in_use = False
        if reused is None and not trace.tag.rules_outlive_call:
            with ensure_no_leaks(trace):
                del trace
        return out

    return api_boundary(implicit_f)


# qax's frames are left out of the tracebacks JAX filters, like JAX's own.
hide_frames_of(_package_dir(sys.modules[__package__]))

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
        trace = _eager.trace = ImplicitTrace(parent, ImplicitTag())
    _eager.in_use = True
    return trace


def sub_trace(tag: TraceTag) -> ImplicitTrace:
    """An `ImplicitTrace` with `tag` on top of the current trace.

    The thread's eager trace when it is that trace (so that JAX's caches keyed on the
    current trace keep hitting, see `_eager_trace`), else a new one.
    """
    parent = current_trace()
    trace = getattr(_eager, "trace", None)
    if trace is not None and trace.tag is tag and trace.parent_trace is parent:
        return trace
    return ImplicitTrace(parent, tag)


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
        return tuple(trace.wrap(v) for v in values)
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


# ----------------------------------------------------------------------------------------
# Implicit values created under a nested transformation
#
# A function transformed inside `use_implicit_args` (`use_implicit_args(jax.jit(f))`)
# runs on the transformation's trace, which cannot hold an implicit array that `f`
# creates. Such a value enters that trace as `implicit_p` of its leaves: a primitive
# whose result looks like the dense array. Transformations that pass it on (`vmap` and
# `grad` do when its leaves are not batched or differentiated) hand it to the
# `ImplicitTrace` below, which takes the implicit value back; a staged one (`jit`,
# `checkpoint`) meets the `ImplicitTrace` when the staged body is interpreted again by
# its rule. Where no `ImplicitTrace` takes it, the value is materialized.

_OUTSIDE_REASON = (
    "An implicit {cls} created inside a transformation that ran inside "
    "`qax.use_implicit_args` is now evaluated outside of it (for example, a `jax.jit` "
    "function first traced inside `use_implicit_args` and called again outside), so "
    "it is materialized. Call the function inside `use_implicit_args` to keep it "
    "implicit."
)
_BATCHED_REASON = (
    "An implicit {cls} was built inside `jax.vmap` from batched values; a `vmap` "
    "applied inside `qax.use_implicit_args` cannot keep it implicit, so it is "
    "materialized. Apply `vmap` outside `use_implicit_args` "
    "(`jax.vmap(qax.use_implicit_args(f))`) to keep it implicit."
)
_DIFFERENTIATED_REASON = (
    "An implicit {cls} was built inside `jax.grad`/`jax.jvp` from differentiated "
    "values; a derivative taken inside `qax.use_implicit_args` sees it as a dense "
    "array, so its tangent is formed through `materialize()`. Take the derivative "
    "outside (`jax.grad(qax.use_implicit_args(f))`) to keep it implicit."
)


class _ImplicitPrimitive(Primitive):
    """`implicit_p`: see the comment above."""

    def bind_with_trace(self, trace, args, avals, params, /):
        if isinstance(trace, ImplicitTrace):
            leaves = [trace.to_value(a) for a in args]
            return trace.wrap(jax.tree_util.tree_unflatten(params["tree"], leaves))
        return trace.process_primitive(self, args, params)


implicit_p = _ImplicitPrimitive("qax_implicit")


def box(value: ImplicitBase) -> Any:
    """`value` as a value of the current (non-implicit) trace; see `implicit_p`."""
    ImplicitTrace.created_implicit = True
    leaves, tree = jax.tree_util.tree_flatten(value)
    return implicit_p.bind(*leaves, tree=tree, aval=value.aval)


# Per jaxpr: whether it (or a jaxpr inside it) binds `implicit_p`.
_holds_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def holds_created_implicit(params: dict) -> bool:
    """Whether a primitive's `params` hold a body that binds `implicit_p`.

    A body traced inside `use_implicit_args` keeps its `implicit_p` equations when JAX
    reuses the trace, so this looks at the body itself (once per jaxpr).
    """
    for value in params.values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, (Jaxpr, ClosedJaxpr)) and _jaxpr_holds(item):
                return True
    return False


def _jaxpr_holds(jaxpr: Any) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's open jaxpr
    found = _holds_cache.get(jaxpr)
    if found is None:
        found = _holds_cache[jaxpr] = any(
            eqn.primitive is implicit_p or holds_created_implicit(eqn.params)
            for eqn in jaxpr.eqns
        )
    return found


def _report_unboxed(tree: Any, leaves: Sequence, reason: str) -> None:
    """Report the materialization of the value of `leaves` that `reason` explains."""
    if quiet_materialization.get():
        return
    value = jax.tree_util.tree_unflatten(tree, list(leaves))
    why = reason.format(cls=type(value).__name__)
    shape, dtype = tuple(value.shape), value.dtype
    report(
        MaterializationEvent(
            implicit_p.name, type(value), shape, dtype, _source_line(), why
        )
    )


def _unboxed_dense(tree: Any, *leaves: Any) -> Any:
    """The dense array that the implicit value with `leaves` represents (reported)."""
    token = quiet_materialization.set(True)
    try:
        value = jax.tree_util.tree_unflatten(tree, list(leaves))
        return materialize_nested(value, full=True)
    finally:
        quiet_materialization.reset(token)


def _implicit_impl(*leaves, tree, aval):
    _report_unboxed(tree, leaves, _OUTSIDE_REASON)
    return _unboxed_dense(tree, *leaves)


def _implicit_jvp(primals, tangents, *, tree, aval):
    out = implicit_p.bind(*primals, tree=tree, aval=aval)
    _report_unboxed(tree, primals, _DIFFERENTIATED_REASON)
    tangents = tuple(instantiate_zeros(t) for t in tangents)
    dense = functools.partial(_unboxed_dense, tree)
    return out, jax.jvp(dense, tuple(primals), tangents)[1]


def _implicit_batch(args, dims, *, tree, aval):
    _report_unboxed(tree, args, _BATCHED_REASON)
    # `dims` holds None for the leaves that are not batched, as `in_axes` does.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    dense = functools.partial(_unboxed_dense, tree)
    return jax.vmap(dense, in_axes=list(dims), axis_size=size)(*args), 0


implicit_p.def_impl(_implicit_impl)
implicit_p.def_abstract_eval(lambda *avals, tree, aval: aval)
register_lowering_fun(implicit_p, _implicit_impl)
primitive_jvps[implicit_p] = _implicit_jvp
primitive_batchers[implicit_p] = _implicit_batch


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
