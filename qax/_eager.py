"""Eager calls: the fast paths of a `use_implicit_args` call made outside any transformation.

Eagerly, every `jnp` function is a jitted function that JAX stages in Python each time
it is called under a trace other than its eval trace (a C++ cache miss, argument
parsing, shape inference, `bind`): several times the cost of the operation itself. Two
fast paths bring the eager cost down, both in `EagerTrace`, the `ImplicitTrace` that
`use_implicit_args` opens on top of the eval trace:

- a `jit` bound on plain operands runs a `jax.jit` of its jaxpr, compiled once per
  jaxpr (`eager_jit`), whose later calls take JAX's C++ fast path;
- an operator on an implicit tracer (``t * x``) remembers the `jit` that its `jnp`
  function binds, per (operator, JAX's configuration, operand types), and later binds
  it directly (`EagerTracer`, `EagerTrace.run_operator`).

One thread shares one eager trace across calls (`eager_trace`): JAX keys its caches of
`jit` traces on the current trace. Setting the environment variable
``QAX_EAGER_FAST_PATHS=0`` turns all of this off (plain `ImplicitTrace`s, as under a
transformation), to tell whether a problem comes from here.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax

from ._base import ImplicitBase
from ._compat import (
    ArrayImpl,
    Trace,
    Tracer,
    TraceTag,
    bind_canonical,
    canonicalize_value,
    current_trace,
    is_eval_trace,
    jaxpr_as_fun,
    jit_context,
    jit_params_are_default,
    primitives_module,
    set_current_trace,
)
from ._interpreter import ImplicitTag, ImplicitTrace, ImplicitTracer, apply_primitive

ENABLED = os.environ.get("QAX_EAGER_FAST_PATHS", "1") != "0"

_JIT = primitives_module.jit_p

# ----------------------------------------------------------------------------------------
# Operators on eager tracers
#
# ``t * x`` on a tracer runs JAX's `jnp.multiply`, a jitted function. Under any trace
# but the eval trace, JAX stages such a call in Python every time (a C++ cache miss,
# argument parsing, shape inference, `bind`) before its `jit` reaches
# `process_primitive`: several times the cost of the operation itself. Eagerly, the
# `jit` that an operator binds is remembered per (operator, operand types, JAX's
# configuration) the first time, and later calls bind it on the trace directly.

# (operator, config, operand types) -> (params of the `jit` it binds, where each of its
# operands comes from).
_operator_binds: dict[tuple, tuple] = {}
_OPERATOR_CACHE_LIMIT = 4096
_SCALARS = (bool, int, float, complex)


def _operator(name: str) -> Callable:
    """The dunder `__{name}__` of `EagerTracer`."""
    jax_method = getattr(Tracer, f"__{name}__")

    def method(self, *args):
        trace = self.owner
        if trace.recording is None and current_trace() is trace:
            return trace.run_operator(name, jax_method, self, args)
        return jax_method(self, *args)

    method.__name__ = method.__qualname__ = f"__{name}__"
    return method


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


class EagerTracer(ImplicitTracer):
    """An `ImplicitTracer` of an `EagerTrace`: its operators bind remembered `jit`s."""

    __slots__ = ()

    __add__ = _operator("add")
    __radd__ = _operator("radd")
    __sub__ = _operator("sub")
    __rsub__ = _operator("rsub")
    __mul__ = _operator("mul")
    __rmul__ = _operator("rmul")
    __truediv__ = _operator("truediv")
    __rtruediv__ = _operator("rtruediv")
    __floordiv__ = _operator("floordiv")
    __rfloordiv__ = _operator("rfloordiv")
    __mod__ = _operator("mod")
    __rmod__ = _operator("rmod")
    __pow__ = _operator("pow")
    __rpow__ = _operator("rpow")
    __matmul__ = _operator("matmul")
    __rmatmul__ = _operator("rmatmul")
    __and__ = _operator("and")
    __rand__ = _operator("rand")
    __or__ = _operator("or")
    __ror__ = _operator("ror")
    __xor__ = _operator("xor")
    __rxor__ = _operator("rxor")
    __lshift__ = _operator("lshift")
    __rlshift__ = _operator("rlshift")
    __rshift__ = _operator("rshift")
    __rrshift__ = _operator("rrshift")
    __lt__ = _operator("lt")
    __le__ = _operator("le")
    __gt__ = _operator("gt")
    __ge__ = _operator("ge")
    __eq__ = _operator("eq")
    __ne__ = _operator("ne")
    __neg__ = _operator("neg")
    __pos__ = _operator("pos")
    __abs__ = _operator("abs")
    __invert__ = _operator("invert")


class EagerTrace(ImplicitTrace):
    """The `ImplicitTrace` of a `use_implicit_args` call outside any transformation."""

    eager = True

    def __init__(self, parent_trace: Trace, tag: TraceTag):
        super().__init__(parent_trace, tag)
        # While an operator is looked at: the binds it makes (see `run_operator`).
        self.recording: list | None = None

    def wrap(self, x: Any) -> Any:
        return EagerTracer(self, x) if isinstance(x, ImplicitBase) else x

    def bind_plain(self, primitive, vals, params):
        if primitive is _JIT:
            compiled = eager_jit(params)
            if compiled is not None:
                return compiled(*vals)
        return bind_canonical(self.parent_trace, primitive, vals, params)

    def process_primitive(self, primitive, tracers, params):
        if self.recording is None:
            return super().process_primitive(primitive, tracers, params)
        recording, self.recording = self.recording, None
        try:
            out = super().process_primitive(primitive, tracers, params)
        finally:
            self.recording = recording
        recording.append((primitive, tracers, params, out))
        return out

    # A call, custom derivative or `shard_map` is never an operator's only bind.

    def process_call(self, *args, **kwargs):
        self._not_an_operator()
        return super().process_call(*args, **kwargs)

    def process_custom_jvp_call(self, *args, **kwargs):
        self._not_an_operator()
        return super().process_custom_jvp_call(*args, **kwargs)

    def process_custom_vjp_call(self, *args, **kwargs):
        self._not_an_operator()
        return super().process_custom_vjp_call(*args, **kwargs)

    def process_shard_map(self, *args, **kwargs):
        self._not_an_operator()
        return super().process_shard_map(*args, **kwargs)

    def _not_an_operator(self) -> None:
        if self.recording is not None:
            self.recording.append(None)

    def run_operator(
        self, name: str, jax_method: Callable, tracer: Any, args: tuple
    ) -> Any:
        """`jax_method(tracer, *args)`, binding the `jit` remembered for it if any."""
        key = [name, jit_context(), tracer.aval]
        for x in args:
            k = _operand_key(x, self)
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
            with set_current_trace(self.parent_trace):  # as `bind` does
                out = apply_primitive(self, _JIT, vals, params)
            return self.wrap(out[0])
        recording = self.recording = []
        try:
            result = jax_method(tracer, *args)
        finally:
            self.recording = None
        if len(recording) == 1 and recording[0] is not None:
            primitive, bound, params, outs = recording[0]
            if primitive is _JIT and len(outs) == 1 and outs[0] is result:
                sources = _operand_sources(bound, operands)
                if sources is not None:
                    if len(_operator_binds) >= _OPERATOR_CACHE_LIMIT:
                        _operator_binds.clear()
                    _operator_binds[key] = (params, sources)
        return result


# ----------------------------------------------------------------------------------------
# Eager calls of jitted functions
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
# One eager trace per thread

_thread = threading.local()


def new_trace(parent: Trace, tag: TraceTag) -> ImplicitTrace:
    """An `ImplicitTrace` with `tag` on `parent`: eager on JAX's eval trace."""
    if ENABLED and is_eval_trace(parent):
        return EagerTrace(parent, tag)
    return ImplicitTrace(parent, tag)


def eager_trace(parent: Trace) -> ImplicitTrace | None:
    """The thread's reusable trace for eager calls, if it applies and is free; the
    caller hands it back with `release`.

    JAX keys its caches of `jit` traces (every `jnp` function is a jit) on the current
    trace: a new trace per eager call would miss them every time and grow them without
    bound. Eager calls therefore share one trace per thread, unless a call is already
    using it (nesting) or tracer-leak checking is on (which needs a trace per call).
    """
    if not ENABLED or not is_eval_trace(parent) or jax.config.jax_check_tracer_leaks:
        return None
    if getattr(_thread, "in_use", False):
        return None
    trace = getattr(_thread, "trace", None)
    if trace is None or trace.parent_trace is not parent:
        trace = _thread.trace = EagerTrace(parent, ImplicitTag())
    _thread.in_use = True
    return trace


def release() -> None:
    """Mark the thread's eager trace free again (see `eager_trace`)."""
    _thread.in_use = False


def sub_trace(tag: TraceTag) -> ImplicitTrace:
    """An `ImplicitTrace` with `tag` on top of the current trace.

    The thread's eager trace when it is that trace (so that JAX's caches keyed on the
    current trace keep hitting, see `eager_trace`), else a new one.
    """
    parent = current_trace()
    trace = getattr(_thread, "trace", None)
    if trace is not None and trace.tag is tag and trace.parent_trace is parent:
        return trace
    return new_trace(parent, tag)
