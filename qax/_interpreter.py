"""The interpreter: a stackless JAX `Trace` whose tracers carry implicit arrays.

`use_implicit_args(f)` runs `f` with an `ImplicitTrace` current. Implicit arguments enter
as `ImplicitTracer`s; every primitive bound while the trace is current reaches
`ImplicitTrace.process_primitive`. Primitives without implicit operands go straight to the
parent trace (plain JAX, untouched); the others are resolved by `apply_primitive`.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _dispatch, _errors
from ._arrival import PRODUCTS, arrived_operands, stored_fields
from ._base import (
    BUILT,
    NB,
    STACKED,
    ImplicitBase,
    in_rule,
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
    bind_canonical,
    current_trace,
    init_tracer,
    set_current_trace,
    typeof,
)
from ._fields import field_names, fields_of
from ._report import report_materialization
from .constants import COMMUTATIVE_OPS

_COMMUTATIVE = frozenset(
    p for p in (getattr(jax.lax, f"{n}_p", None) for n in COMMUTATIVE_OPS) if p
)

_primitive_rules = _dispatch.primitive_rules


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

    def __init__(self, trace: ImplicitTrace, value: ImplicitBase, aval: Any = None):
        init_tracer(self, trace, value.aval if aval is None else aval)
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
            if name in field_names(type(value)):
                if BUILT in value.__dict__:  # built by the code that reads it
                    return getattr(value, name)
                raise AttributeError(
                    _errors.FIELD_OF_TRACER.format(cls=type(value).__name__, name=name)
                ) from None
            raise


class ImplicitTrace(Trace):
    """Interprets primitives on implicit arrays; see the module docstring."""

    def __init__(self, parent_trace: Trace, tag: TraceTag):
        super().__init__()
        self.parent_trace = parent_trace
        self.tag = tag
        self.requires_low = False

    # -- lifting and lowering ------------------------------------------------------------

    def to_value(self, x: Any) -> Any:
        if isinstance(x, ImplicitTracer) and x.owner.tag is self.tag:
            return x.value
        return x

    def wrap(self, x: Any) -> Any:
        return ImplicitTracer(self, x) if isinstance(x, ImplicitBase) else x

    def adopt(self, x: ImplicitBase) -> Any:
        """`x`, an implicit array that code running on this trace built, as a tracer.

        Its fields may hold this trace's tracers (``Wrap(w)`` with `w` an implicit
        argument), at any depth: they become the implicit values they carry, so that
        `x` is an ordinary nested implicit array whose handlers and `materialize()`
        see the values, and no tracer of this trace is kept past it.
        """
        leaves, tree = jax.tree_util.tree_flatten(x)
        tag = self.tag
        if any(isinstance(v, ImplicitTracer) and v.owner.tag is tag for v in leaves):
            x = jax.tree_util.tree_unflatten(tree, [self.to_value(v) for v in leaves])
        return self.wrap(x)

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
            if isinstance(t, ImplicitTracer):
                if t.owner.tag is tag:
                    t = t.value  # always implicit
                    implicit = True
            elif not implicit and isinstance(t, ImplicitBase):
                implicit = True
            vals.append(t)
        if not implicit:  # operands straight from `bind`: already canonical
            if not (
                _implicit_p_bound
                and primitive in _primitive_rules
                and holds_created_implicit(params)
            ):
                return self.bind_plain(primitive, vals, params)
            out = _primitive_rules[primitive](self, primitive, vals, params)
        else:
            out = apply_primitive(self, primitive, vals, params)
        if primitive.multiple_results:
            return [self.wrap(o) for o in out]
        return self.wrap(out)

    def bind_plain(self, primitive, vals, params):
        """Bind `primitive` on plain operands: on the parent trace, as it stands."""
        return bind_canonical(self.parent_trace, primitive, vals, params)

    def stage_value(self, val):
        if isinstance(val, ImplicitTracer) and val.owner.tag is self.tag:
            return val
        return self.parent_trace.stage_value(val)

    def process_call(self, call_primitive, f, tracers, params):
        # (JAX 0.10's call primitives; later versions bind `eval_jaxpr` instead.)
        rule = _dispatch.function_rules[call_primitive]
        return rule(
            self, call_primitive, f, [self.to_value(t) for t in tracers], params
        )

    def process_custom_jvp_call(self, primitive, fun, jvp, tracers, *, symbolic_zeros):
        rule = _dispatch.custom_jvp_rules[primitive]
        vals = [self.to_value(t) for t in tracers]
        return rule(self, primitive, fun, jvp, vals, symbolic_zeros=symbolic_zeros)

    def process_custom_vjp_call(
        self, primitive, fun, fwd, bwd, tracers, *, out_trees, symbolic_zeros
    ):
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
        rule = _dispatch.function_rules[primitive]
        return rule(self, primitive, fun, [self.to_value(t) for t in tracers], params)


# ----------------------------------------------------------------------------------------
# Resolving one primitive on implicit operands


def apply_primitive(
    trace: ImplicitTrace, primitive: Primitive, vals: list, params: dict
):
    """Run `primitive` on `vals`, at least one of which is implicit.

    The steps of `qax._route.ROUTE` (swap, arrival, handler, rule, stacked,
    default_handler, materialize), in that order: each is marked ``# route: <name>``
    below, where the route's description of it is. `qax.explain` reports the same
    steps for given operands; `tests/test_explain_route.py` checks that what it reports
    is what runs.
    """
    # route: swap (`swaps_operands`, inlined: every primitive on an implicit operand
    # runs this)
    if (
        len(vals) == 2
        and primitive in _COMMUTATIVE
        and not isinstance(vals[0], ImplicitBase)
        and vals[1].commute_ops
    ):
        vals = [vals[1], vals[0]]

    # route: arrival
    if primitive in PRODUCTS and any(map(stored_fields, vals)):
        vals = arrived_operands(trace, vals)
    stacked, reason = any(map(_stacked_examples, vals)), None
    if not stacked:  # route: handler
        types = tuple(map(_dispatch.dispatch_type, vals))
        handler = _dispatch.lookup(primitive, types)
        if handler is not None:
            kwargs = _dispatch.params_for(handler, primitive, params)
            out = call_with_children(trace, handler, primitive, *vals, **kwargs)
            if isinstance(out, _dispatch.Declined):  # `qax.decline`: pass, saying why
                reason = out.reason
            elif out is not NotImplemented:
                _check_result(handler, primitive, vals, params, out)
                return out

    rule = _primitive_rules.get(primitive)  # route: rule
    if rule is not None:
        return rule(trace, primitive, vals, params)
    if stacked:  # route: stacked
        return _unstacked_apply(trace, primitive, vals, params)

    cls = type(next(v for v in vals if isinstance(v, ImplicitBase)))
    if has_default_rule(cls):  # route: default_handler
        out = call_with_children(
            trace, cls.default_handler, primitive, *vals, params=params
        )
        if out is not NotImplemented:
            return out
    # route: materialize
    return materialize_and_bind(trace, primitive, vals, params, reason)


def _stacked_examples(v: Any) -> bool:
    """Whether `v` is a stack of examples of a type that declares no batch axes (the
    route's step "stacked"; `qax.explain` asks too)."""
    return isinstance(v, ImplicitBase) and bool(
        STACKED in v.__dict__ and v.__dict__.get(NB)
    )


def _unstacked_apply(trace: ImplicitTrace, primitive: Primitive, vals, params):
    """The route's step "stacked": `apply_primitive` after materializing the operands
    that `vmap` stacked from examples of a type that declares no batch axes: its
    handlers and `default_handler` are written for one example."""
    dense = []
    for v in vals:
        if _stacked_examples(v):
            if not quiet_materialization.get():
                reason = _errors.STACKED_UNDECLARED.format(
                    cls=type(v).__name__, n=v.shape[0] if v.shape else 0
                )
                report_materialization(primitive.name, v, reason)
            v = materialize_one_layer(trace, v)
        dense.append(v)
    if any(isinstance(v, ImplicitBase) for v in dense):
        return apply_primitive(trace, primitive, dense, params)
    return _bind_dense(trace, primitive, dense, params)


def swaps_operands(primitive: Primitive, types: tuple[type, ...]) -> bool:
    """The route's step "swap": whether a commutative binary primitive gets its
    operands of `types` swapped, to put the implicit one first (`qax.explain` asks too)."""
    return (
        len(types) == 2
        and primitive in _COMMUTATIVE
        and not issubclass(types[0], ImplicitBase)
        and issubclass(types[1], ImplicitBase)
        and types[1].commute_ops
    )


# The base rule only says "materialize": classes that keep it skip the call.
_BASE_DEFAULT_HANDLER = ImplicitBase.default_handler.__func__


def has_default_rule(cls: type) -> bool:
    """The route's step "default_handler": whether `cls` overrides `default_handler`."""
    return cls.default_handler.__func__ is not _BASE_DEFAULT_HANDLER


def materialize_and_bind(
    trace: ImplicitTrace, primitive: Primitive, vals, params, reason: str | None = None
):
    """The route's step "materialize": densify the implicit operands and run `primitive`
    (`reason`: why, for the report, when a rule gives up)."""
    dense = []
    for v in vals:
        if isinstance(v, ImplicitBase):
            report_materialization(primitive.name, v, reason)
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
    if got.weak_type and not isinstance(out, ImplicitBase) and not value.aval.weak_type:
        # The dense array has the weak type JAX saw for the implicit value (`aval`),
        # so that what follows promotes dtypes as it would have.
        with set_current_trace(trace.parent_trace):
            out = jax.lax.convert_element_type(out, got.dtype)
    return out


def implicit_children(value: ImplicitBase) -> list[tuple[str, Any]]:
    """The (field name, child) pairs of `value` that contain implicit arrays."""
    found = []
    for name in fields_of(type(value)).children:
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
            children = implicit_children(arg)
            if children:
                nested = True
                arg = copy.copy(arg)
                for name, child in children:
                    wrapped = jax.tree_util.tree_map(
                        trace.wrap, child, is_leaf=is_implicit
                    )
                    object.__setattr__(arg, name, wrapped)
                new_args[i] = arg
    token = in_rule.set(True)  # values it builds stay plain implicit arrays
    try:
        if not nested:
            parent = trace.parent_trace
            if current_trace() is parent:  # inside `bind`, eagerly
                return fn(*args, **kwargs)
            with set_current_trace(parent):
                return fn(*args, **kwargs)
        with set_current_trace(trace):
            out = fn(*new_args, **kwargs)
    finally:
        in_rule.reset(token)
    if out is NotImplemented or isinstance(out, _dispatch.Declined):
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


class _ImplicitPrimitive(Primitive):
    """`implicit_p`: see the comment above."""

    def bind_with_trace(self, trace, args, avals, params, /):
        if isinstance(trace, ImplicitTrace):
            leaves = [trace.to_value(a) for a in args]
            return trace.wrap(jax.tree_util.tree_unflatten(params["tree"], leaves))
        return trace.process_primitive(self, args, params)


implicit_p = _ImplicitPrimitive("qax_implicit")


# Whether `implicit_p` has been bound in this process. A body that binds it (an implicit
# value created inside a nested transformation) is interpreted by its rule even when the
# primitive that carries it has no implicit operand (`ImplicitTrace.process_primitive`);
# until `implicit_p` has been bound once, no body can hold it, and that per-body look is
# skipped. So it only skips work that would find nothing: no call behaves differently
# for it, whichever calls came before. It is not per call because JAX reuses a body
# traced by one call in later ones (its caches of `jit` traces), and not cleared by
# `qax.clear_caches()` because those bodies outlive qax's caches.
_implicit_p_bound = False


def box(value: ImplicitBase) -> Any:
    """`value` as a value of the current (non-implicit) trace; see `implicit_p`."""
    global _implicit_p_bound
    _implicit_p_bound = True
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


def clear_caches() -> None:
    """Empty the caches of shape rules' answers and of jaxprs holding `implicit_p`."""
    _expected_cache.clear()
    _holds_cache.clear()
