"""Eager calls: the fast paths of a `use_implicit_args` call made outside any transformation.

Eagerly, every `jnp` function is a jitted function that JAX stages in Python each time
it is called under a trace other than its eval trace (a C++ cache miss, argument
parsing, shape inference, `bind`), and every handler runs its Python on every call:
several times the cost of the operation itself. Two fast paths bring the eager cost
down, both in `EagerTrace`, the `ImplicitTrace` that `use_implicit_args` opens on top
of the eval trace:

- a `jit` bound on plain operands runs a `jax.jit` of its jaxpr, compiled once per
  jaxpr (`eager_jit`), whose later calls take JAX's C++ fast path;
- an operation on implicit operands (a primitive, or an operator such as ``t * x``)
  seen again with the same signature runs a compiled copy of what it did, traced once
  (a "lane", `run_lane`); its results go on to the next lane as leaves (`LaneTracer`).

Both are kept by `qax._bodies`, which decides when they are compiled (on their second
sighting) and makes a lane's materialization reports again on every run.

One thread shares one eager trace across calls (`eager_trace`): JAX keys its caches of
`jit` traces on the current trace. Setting the environment variable
``QAX_EAGER_FAST_PATHS=0`` turns all of this off (plain `ImplicitTrace`s, as under a
transformation), to tell whether a problem comes from here.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import threading
from collections.abc import Callable
from typing import Any

import jax

from . import _bodies
from ._base import ImplicitBase
from ._compat import (
    ArrayImpl,
    ClosedJaxpr,
    Trace,
    Tracer,
    TraceTag,
    bind_canonical,
    current_trace,
    eval_context,
    init_tracer,
    is_eval_trace,
    jaxpr_as_fun,
    jit_context,
    jit_params_are_default,
    primitives_module,
    set_current_trace,
    typeof,
    weakly_typed,
)
from ._dispatch import primitive_rules
from ._interpreter import ImplicitTag, ImplicitTrace, ImplicitTracer, apply_primitive
from ._report import recording

ENABLED = os.environ.get("QAX_EAGER_FAST_PATHS", "1") != "0"

_JIT = primitives_module.jit_p

# ----------------------------------------------------------------------------------------
# Lanes: one eager operation on implicit operands, compiled per signature
#
# Eagerly, an operation on implicit operands costs its handler's Python (and each `jnp`
# call inside it) on every call; an operator (``t * x``) first costs JAX's staging of
# its `jnp` function. An operation is keyed by its signature (operand structure, leaf
# types, baked scalars) in `qax._bodies`, which decides when it is compiled: the first
# time it runs the ordinary way and what it materialized and returned is noted; the
# second time it is traced once on abstract leaves, as under `jit`, and compiled,
# unless tracing changes what it does (a handler that reads concrete values fails or
# answers otherwise): then it keeps the ordinary path. Later calls run the compiled
# program (`_bodies.ready` reports its materializations again), and a result that goes
# on to another lane stays leaves (`LaneTracer`).

# (tree, leaf types) of an implicit operand -> one object standing for it, so that the
# keys of lanes hash and compare fast.
_signatures: dict[tuple, object] = {}
_SCALARS = (bool, int, float, complex)


class _Lane:
    """A compiled eager operation: its program, and how its outputs are rebuilt."""

    __slots__ = ("compiled", "trees", "outputs")

    def __init__(self, compiled, trees):
        self.compiled = compiled
        self.trees = trees  # per output: (tree, number of leaves)
        # Per output: (tree or None for an array, number of leaves, signature, aval);
        # known after the first run.
        self.outputs = None

    def run(self, leaves: list) -> tuple[list, list]:
        """(`outputs`, flat results) of the program on `leaves`."""
        outs = self.compiled(*leaves)
        if self.outputs is None:
            self.outputs = _outputs(self.trees, outs)
        return self.outputs, outs


def _outputs(trees: list, outs: list) -> list:
    """How each output of a lane is rebuilt from its flat results `outs`."""
    outputs, start = [], 0
    for tree, n in trees:
        value = tree.unflatten(outs[start : start + n])
        start += n
        if isinstance(value, ImplicitBase):
            found = operand(value)
            signature = found[0] if found is not None else None
            outputs.append((tree, n, signature, value.aval))
        elif n == 1 and tree.num_nodes == 1:  # a plain array
            outputs.append((None, 1, None, None))
        else:
            outputs.append((tree, n, None, None))
    return outputs


def _array_kind(x: ArrayImpl) -> tuple:
    """What a compiled program sees of an eager array (a placed array's sharding too)."""
    return x.shape, x.dtype, x.weak_type, x.committed and x.sharding


def operand(x: Any) -> tuple | None:
    """(signature, leaves) of an operand of a lane; None: it cannot enter one."""
    if type(x) is ArrayImpl:
        return _array_kind(x), (x,)
    if not isinstance(x, ImplicitBase):
        return None
    leaves, tree = jax.tree_util.tree_flatten(x)
    kinds = []
    for leaf in leaves:
        if type(leaf) is ArrayImpl:
            kinds.append(_array_kind(leaf))
        elif isinstance(leaf, Tracer):  # an implicit array built from tracers
            return None
        else:
            try:
                kinds.append(typeof(leaf))
            except TypeError:
                return None
    key = (tree, tuple(kinds))
    try:
        signature = _signatures.get(key)
    except TypeError:  # unhashable aux data
        return None
    if signature is None:
        if len(_signatures) >= _bodies.LIMIT:
            _signatures.clear()
        signature = _signatures[key] = object()
    return signature, leaves


def _tracer_operand(t: ImplicitTracer) -> tuple | None:
    """`operand` of a tracer's value; a `LaneTracer` knows it without rebuilding it."""
    if type(t) is LaneTracer:
        return t.signature, t.leaves
    return operand(t.value)


def run_lane(
    trace: EagerTrace,
    head: tuple,
    operands: list,
    vals: list,
    run: Callable,
    ordinary: Callable[[], list],
    parent: bool = False,
) -> list:
    """The results of an operation (values of `trace`): its lane's, if it has one, else
    `ordinary()`'s.

    `head` names the operation (with the values baked into it); `operands` are the
    `operand`s of `vals` (values, or this trace's tracers); `run` performs the
    operation on values with `sub` (an `ImplicitTrace`) current and returns a list of
    values; `ordinary` performs it the ordinary way and returns a list of results.
    With `parent`, the lane runs with the parent trace current (`jax.jit`'s C++ path
    needs it for an operator).
    """
    sighting, first = _bodies.sight(_bodies.eager_key(head, [o[0] for o in operands]))
    if sighting is None:
        return ordinary()
    if first:
        with recording(sighting.events):
            outs = ordinary()
        sighting.note = [
            jax.tree_util.tree_structure(
                o.value if isinstance(o, ImplicitTracer) else o
            )
            for o in outs
        ]
        return outs
    leaves = [leaf for o in operands for leaf in o[1]]
    if sighting.body is None and not sighting.refused:
        if sighting.note is None or jax.config.jax_disable_jit:
            return ordinary()
        _build_lane(trace, sighting, leaves, vals, run)
    lane = _bodies.ready(sighting)
    if lane is None:
        return ordinary()
    if parent:
        with set_current_trace(trace.parent_trace):
            return trace.wrap_lane(*lane.run(leaves))
    return trace.wrap_lane(*lane.run(leaves))


def _build_lane(trace, sighting: _bodies.Sighting, leaves, vals, run) -> None:
    """Trace `run` on abstract `leaves` (materializations held) and compile it, into
    `sighting`; refuse it if it cannot be traced or does other than first noted."""
    vals = [v.value if isinstance(v, ImplicitTracer) else v for v in vals]
    tree = jax.tree_util.tree_structure(vals)
    trees = []

    def flat(*leaves):
        sub = ImplicitTrace(current_trace(), ImplicitTag())
        with set_current_trace(sub):
            outs = run(sub, jax.tree_util.tree_unflatten(tree, leaves))
        flat_outs = []
        for out in sub.unwrap_tree(outs):
            out_leaves, out_tree = jax.tree_util.tree_flatten(out)
            trees.append((out_tree, len(out_leaves)))
            flat_outs.extend(out_leaves)
        return flat_outs

    try:
        with _bodies.speculative() as events, set_current_trace(trace.parent_trace):
            closed = jax.make_jaxpr(flat)(*leaves)
    except Exception:  # noqa: BLE001 (not traceable: the ordinary path decides)
        sighting.refused = True
        return
    if [t for t, _ in trees] != sighting.note or _sourceless(events) != _sourceless(
        sighting.events
    ):
        sighting.refused = True
        return
    sighting.body = _Lane(compile_jaxpr(closed), trees)
    sighting.events = events
    sighting.context = jit_context()


def _sourceless(events: list) -> list:
    """The events without where they happened (their lines, the weight they name)."""
    return [
        dataclasses.replace(e, source=None, caller=None, weight=None) for e in events
    ]


def _operator(name: str) -> Callable:
    """The dunder `__{name}__` of `EagerTracer`."""
    jax_method = getattr(Tracer, f"__{name}__")

    def method(self, *args):
        trace = self.owner
        if current_trace() is trace:
            return trace.run_operator(name, jax_method, self, args)
        return jax_method(self, *args)

    method.__name__ = method.__qualname__ = f"__{name}__"
    return method


class EagerTracer(ImplicitTracer):
    """An `ImplicitTracer` of an `EagerTrace`: its operators (`_OPERATORS`) run
    through lanes."""

    __slots__ = ()
    __hash__ = None  # (as a class that defines `__eq__` in its body gets)


_OPERATORS = tuple(
    """
add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow
matmul rmatmul and rand or ror xor rxor lshift rlshift rshift rrshift lt le gt
ge eq ne neg pos abs invert
""".split()
)
for _name in _OPERATORS:
    setattr(EagerTracer, f"__{_name}__", _operator(_name))
del _name


class EagerTrace(ImplicitTrace):
    """The `ImplicitTrace` of a `use_implicit_args` call outside any transformation."""

    def wrap(self, x: Any) -> Any:
        return EagerTracer(self, x) if isinstance(x, ImplicitBase) else x

    def bind_plain(self, primitive, vals, params):
        if primitive is _JIT:
            compiled = eager_jit(params)
            if compiled is not None:
                return compiled(*vals)
        return bind_canonical(self.parent_trace, primitive, vals, params)

    def process_primitive(self, primitive, tracers, params):
        if primitive not in primitive_rules:  # (structural rules have their own paths)
            for t in tracers:
                if isinstance(t, (ImplicitTracer, ImplicitBase)):
                    return self._lane_primitive(primitive, tracers, params)
        return super().process_primitive(primitive, tracers, params)

    def _lane_primitive(self, primitive, tracers, params):
        """`primitive` on `tracers` through the lane of its signature, if any."""
        vals, operands = [], []
        for t in tracers:
            if isinstance(t, ImplicitTracer):
                found = _tracer_operand(t) if t.owner.tag is self.tag else None
            else:
                found = operand(t)
            if found is None:
                return ImplicitTrace.process_primitive(self, primitive, tracers, params)
            vals.append(t)
            operands.append(found)
        head = (primitive, tuple(params.items()))  # (unhashable: `run_lane` refuses)

        def ordinary():
            out = ImplicitTrace.process_primitive(self, primitive, tracers, params)
            return out if primitive.multiple_results else [out]

        def run(sub, vals):
            out = apply_primitive(sub, primitive, vals, params)
            return out if primitive.multiple_results else [out]

        outs = run_lane(self, head, operands, vals, run, ordinary)
        return outs if primitive.multiple_results else outs[0]

    def wrap_lane(self, outputs: list, outs: list) -> list:
        """The results of a lane run as values of this trace, from its flat `outs`."""
        results, start = [], 0
        for tree, n, signature, aval in outputs:
            if tree is None:
                results.append(outs[start])
            else:
                part = outs[start : start + n]
                if signature is not None:
                    results.append(LaneTracer(self, tree, part, aval, signature))
                else:
                    value = tree.unflatten(part)
                    results.append(
                        value if aval is None else EagerTracer(self, value, aval)
                    )
            start += n
        return results

    def run_operator(
        self, name: str, jax_method: Callable, tracer: Any, args: tuple
    ) -> Any:
        """`jax_method(tracer, *args)`, through the lane of its signature if any.

        Operands other than this trace's tracers, arrays of rank > 0 and Python scalars
        (whose values are baked into the lane: ``x ** 2`` is an `integer_pow`) take
        JAX's own path.
        """
        vals, operands, pattern = [], [], []
        for x in (tracer, *args):
            if isinstance(x, ImplicitTracer):
                if x.owner is not self:
                    return jax_method(tracer, *args)
                found = _tracer_operand(x)
                if found is None:
                    return jax_method(tracer, *args)
                vals.append(x)
                operands.append(found)
                pattern.append(None)
            elif type(x) is ArrayImpl and x.ndim:
                vals.append(x)
                operands.append(operand(x))
                pattern.append(None)
            elif type(x) in _SCALARS:
                pattern.append((type(x), repr(x)))  # repr: tells 0.0 from -0.0
            else:
                return jax_method(tracer, *args)

        def run(sub, vals):
            it = iter(vals)
            ins = [
                sub.wrap(next(it)) if p is None else x
                for x, p in zip((tracer, *args), pattern)
            ]
            return [jax_method(*ins)]

        def ordinary():
            return [jax_method(tracer, *args)]

        head = (name, *pattern)
        return run_lane(self, head, operands, vals, run, ordinary, parent=True)[0]


class LaneTracer(EagerTracer):
    """An `EagerTracer` made by a lane. It keeps its value's leaves and signature, for
    the next lane, and builds the value itself only when something else asks for it."""

    __slots__ = ("tree", "leaves", "signature", "_value")

    def __init__(self, trace, tree, leaves, aval, signature):
        init_tracer(self, trace, aval)
        self.owner = trace
        self.tree = tree
        self.leaves = leaves
        self.signature = signature
        self._value = None

    @property
    def value(self):
        value = self._value
        if value is None:
            value = self._value = self.tree.unflatten(self.leaves)
        return value


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


def compile_jaxpr(closed: Any, keep_unused: bool = False) -> Callable:
    """`closed` as a compiled function of its inputs (returns a list).

    A `jax.jit` of it, or the function that picks its outputs if it has no equations
    (`forwarding`). Inputs given stronger than the body declares them (a body traced
    with weak inputs) are weakened first, as the body sees them.
    """
    run = forwarding(closed) or jax.jit(jaxpr_as_fun(closed), keep_unused=keep_unused)
    weak = [a.weak_type for a in closed.in_avals]
    if not any(weak):
        return run
    return lambda *leaves: run(*map(_weaken, leaves, weak))


def _weaken(x: Any, weak: bool) -> Any:
    """`x`, weakly typed if `weak` (as a body traced for a weak input sees it)."""
    if not weak or typeof(x).weak_type:
        return x
    with eval_context():  # (eagerly called: inside a `bind`, JAX > 0.10 has no trace)
        return weakly_typed(x)


def forwarding(closed: ClosedJaxpr) -> Callable | None:
    """For a body without equations, the function that picks its outputs, else None.

    Such a body (``zeros * x`` returning a new symbolic zero, ``zeros + x`` returning
    ``x``) only forwards inputs and constants: running it through XLA would cost a
    dispatch for nothing.
    """
    jaxpr = closed.jaxpr
    if jaxpr.eqns or jaxpr.effects:
        return None
    sources = []
    for v in jaxpr.outvars:
        if v in jaxpr.invars:
            sources.append((True, jaxpr.invars.index(v)))
        elif v in jaxpr.constvars:
            sources.append((False, closed.consts[jaxpr.constvars.index(v)]))
        else:  # a literal
            return None
    return lambda *leaves: [leaves[x] if is_input else x for is_input, x in sources]


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
    seen = _jit_params(params)
    sighting, first = _bodies.sight(id(closed), closed)
    if first or sighting.note != seen:  # (a first sighting with these parameters)
        sighting.note, sighting.body, sighting.refused = seen, None, False
        return None
    if sighting.body is None and not sighting.refused:
        if jit_params_are_default(params):
            sighting.body = compile_jaxpr(closed, params["keep_unused"])
        else:
            sighting.refused = True
    return sighting.body  # (no reports to make again: its operands are plain)


def clear_caches() -> None:
    """Forget every operand signature (`qax._bodies` keeps the lanes and eager jits)."""
    _signatures.clear()


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
