"""Machinery shared by the structural rules of `qax._rules`.

Staging a body on implicit values (`trace_body`, `TracedBody`; `qax._bodies` keeps
what is staged), materializing with a reason, parameters expanded per leaf
(`_per_leaf`) and the shardings of leaves (`_leaf_shardings`), and the `_Outputs`
record shared by the wrappers of a function that JAX hands over as a `WrappedFun`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from .. import _errors
from .._base import ImplicitBase
from .._compat import (
    UNSPECIFIED,
    ClosedJaxpr,
    Tracer,
    convert_constvars_jaxpr,
    current_trace,
    eval_jaxpr,
    make_debug_info,
    set_current_trace,
    trace_to_jaxpr_dynamic,
    typeof,
    wrap_init,
)
from .._eager import sub_trace
from .._entry import densify
from .._interpreter import ImplicitTrace
from .._partition import Undeclared, first_undeclared, leaf_specs
from .._report import recording, same_values

# ----------------------------------------------------------------------------------------
# Staging a body on implicit values


@dataclasses.dataclass
class TracedBody:
    """A body staged with implicit inputs, to be called on their flat leaves.

    Attributes:
      jaxpr: the staged body, over the flat leaves of the inputs.
      out_tree: how its flat outputs rebuild the output values.
      events: the materializations that happened while staging it.
      out_avals: the avals of its flat outputs.
    """

    jaxpr: ClosedJaxpr
    out_tree: Any
    events: list
    out_avals: list

    def out_skeleton(self) -> list:
        """The output values with avals in place of arrays (to compare structures)."""
        return jax.tree_util.tree_unflatten(self.out_tree, self.out_avals)

    @property
    def cacheable(self) -> bool:
        return not any(isinstance(c, Tracer) for c in self.jaxpr.consts)


def flatten_values(vals: Sequence) -> tuple[list, Any]:
    """Flatten values to array leaves (implicit arrays are opened all the way down)."""
    return jax.tree_util.tree_flatten(list(vals))


def _leaves(vals: Sequence) -> list:
    return jax.tree_util.tree_leaves(list(vals))


def _unwrap_all(trace: ImplicitTrace, outs: Sequence) -> list:
    """`trace`'s tracers replaced by their values, also inside implicit values."""
    return trace.unwrap_tree([trace.to_value(o) for o in outs])


def _has_implicit(vals: Sequence) -> bool:
    return any(isinstance(v, ImplicitBase) for v in vals)


def _per_value(vals: list, leaves: Sequence) -> list[list]:
    """Group flat `leaves` (one per leaf of `vals`) by the value they belong to."""
    groups, start = [], 0
    for v in vals:
        n = len(jax.tree_util.tree_leaves(v)) if isinstance(v, ImplicitBase) else 1
        groups.append(list(leaves[start : start + n]))
        start += n
    return groups


def trace_body(
    trace: ImplicitTrace,
    body: Callable[[list], Sequence],
    in_vals: Sequence,
    name: str,
    *,
    in_avals: Sequence | None = None,
    declared: Sequence | None = None,
    fix_outs: Callable[[list], list] | None = None,
) -> tuple[TracedBody, list]:
    """Stage `body` (run on wrapped implicit values) into a jaxpr over flat leaves.

    The one re-tracing helper behind the structural rules (`qax._rules`), which call it
    as `_staging.trace_body` (so that tests can count re-tracings by patching it here).

    Args:
      trace: the trace whose primitive is being interpreted.
      body: called with the input values (implicit ones as tracers of a sub-trace)
        while that sub-trace is current; returns a sequence of output values.
      in_vals: the input values, at the parent level.
      name: used in the jaxpr's debug info.
      in_avals: the avals of the flat input leaves, if not those of `in_vals` (a scan
        body sees slices of its `xs`).
      declared: the avals that the original body declares for `in_vals`, one per
        value. A plain value is traced with the declared weak type, as JAX runs a body
        whose inputs are weaker than the operands bound to it (the tangent inputs of a
        differentiated `jnp` function are as weak as its primal inputs).
      fix_outs: applied to the output values (plain values, no tracers of the
        sub-trace) before they are flattened, e.g. to materialize some of them.

    Returns:
      The staged body, and the flat parent-level leaves to call it with.
    """
    flat_in, in_tree = flatten_values(in_vals)
    if in_avals is None:
        in_avals = [typeof(x) for x in flat_in]
        if declared is not None:
            in_avals = _declared_weak_types(in_vals, declared, in_avals)
    out_trees = []

    def flat_body(*leaves):
        sub = ImplicitTrace(current_trace(), trace.tag)
        values = jax.tree_util.tree_unflatten(in_tree, leaves)
        wrapped = [sub.wrap(v) for v in values]
        with set_current_trace(sub), same_values(in_vals, values):  # names in reports
            outs = body(wrapped)
        del values
        del wrapped
        outs = _unwrap_all(sub, outs)
        if fix_outs is not None:
            outs = fix_outs(outs)
        out_leaves, out_tree = jax.tree_util.tree_flatten(outs)
        out_trees.append(out_tree)
        return out_leaves

    events: list = []
    with recording(events), set_current_trace(trace.parent_trace):
        jaxpr, out_avals, consts = trace_to_jaxpr_dynamic(
            wrap_init(flat_body, debug_info=make_debug_info(name)), list(in_avals)
        )
    traced = TracedBody(ClosedJaxpr(jaxpr, consts), out_trees[-1], events, out_avals)
    return traced, flat_in


def _declared_weak_types(vals: Sequence, declared: Sequence, avals: list) -> list:
    """`avals` (of the flat leaves of `vals`), with plain values as weak as declared."""
    out = []
    for v, d, group in zip(vals, declared, _per_value(vals, avals), strict=True):
        if not isinstance(v, ImplicitBase):
            (a,) = group
            if a.weak_type != d.weak_type and (a.shape, a.dtype) == (d.shape, d.dtype):
                group = [a.update(weak_type=d.weak_type)]
        out.extend(group)
    return out


def _jaxpr_body(closed: ClosedJaxpr) -> Callable[[list], list]:
    return lambda wrapped: eval_jaxpr(closed.jaxpr, closed.consts, *wrapped)


def _hoisted(traced: TracedBody) -> tuple[ClosedJaxpr, list]:
    """The body with its constants turned into leading inputs, and those constants.

    Loops take their constants as operands, so that constants which are tracers of
    an outer transformation keep their derivatives.
    """
    return (
        ClosedJaxpr(convert_constvars_jaxpr(traced.jaxpr.jaxpr), ()),
        list(traced.jaxpr.consts),
    )


# ----------------------------------------------------------------------------------------
# Materializing, with a reason


def _densify_parent(trace: ImplicitTrace, value: Any, primitive: str, reason=None):
    """`densify` for a parent-level value, from inside a rule.

    (`densify` reports and fully materializes a value; its own trace must be current.)
    """
    if not isinstance(value, ImplicitBase):
        return value
    with set_current_trace(trace.parent_trace):
        return densify(value, primitive, reason)


def _path_name(path: tuple) -> str:
    return "".join(f"[{i}]" for i in path)


# ----------------------------------------------------------------------------------------
# Per-operand parameters and shardings


def _per_leaf(values: Sequence, per_value: Sequence, expand: Callable) -> tuple:
    """Expand a per-operand parameter to one entry per flat leaf.

    `expand(param, value)` gives the entries for the leaves of an implicit value, in
    `tree_leaves` order.
    """
    out = []
    for v, p in zip(values, per_value, strict=True):
        if isinstance(v, ImplicitBase):
            out.extend(expand(p, v))
        else:
            out.append(p)
    return tuple(out)


def _same_for_all(p: Any, v: Any) -> list:
    """`p` for every leaf of `v`."""
    return [p] * len(jax.tree_util.tree_leaves(v))


def _leaf_shardings(sharding: Any, value: ImplicitBase, fallback: Any, what: str):
    """The sharding of each leaf of `value` when `value` is given `sharding`.

    A `NamedSharding` is the sharding of the array `value` represents; its leaves are
    partitioned as the type declares (`qax.array_field(follows=...)` or
    `field_dims()`, see `qax.sharding`). A leaf of a field that declares nothing gets
    `fallback` (with a warning) where the spec partitions one of the array's own
    dimensions. Other shardings go to every leaf when fully replicated, else `fallback`.
    """
    n = len(jax.tree_util.tree_leaves(value))
    if sharding is None or sharding is UNSPECIFIED:
        return [sharding] * n
    if not isinstance(sharding, jax.sharding.NamedSharding):
        replicated = getattr(sharding, "is_fully_replicated", False)
        return [sharding if replicated else fallback] * n
    specs = leaf_specs(value, sharding.spec)
    missing = first_undeclared(specs)
    if missing is not None:
        fate = (
            "are left to JAX" if fallback in (None, UNSPECIFIED) else "are replicated"
        )
        warnings.warn(
            _errors.UNDECLARED_SHARDING.format(
                what=what, message=missing.message, fallback=fate
            ),
            stacklevel=2,
        )
    return [
        fallback if isinstance(s, Undeclared) else sharding.update(spec=s)
        for s in specs
    ]


# ----------------------------------------------------------------------------------------
# Functions handed over as WrappedFuns (call, custom_jvp, custom_vjp, shard_map)


class _Outputs:
    """Output structure decided by whichever wrapper runs first (no tracers here).

    The rules for primitives whose function JAX hands over as a `WrappedFun` (`call`,
    `custom_jvp`, `custom_vjp` in `qax._rules.custom_ad`, `shard_map` in
    `qax._rules.sharding`) wrap the function (and its derivative rules) to work on flat
    leaves and rebind the primitive; the wrappers run later, maybe more than once,
    maybe not at all, depending on the parent trace. What they agree on about the
    outputs lives in an `_Outputs` record shared by the wrappers of one call.
    """

    def __init__(self):
        self.tree = None
        self.kept = None  # per output: stays implicit
        self.avals = None  # per output: the represented aval
        self.sizes = None  # per output: number of leaves
        self.res_tree = None  # custom_vjp: structure of the residuals
        self.differentiable = False  # an implicit output holds differentiable data

    def decide(self, outs: list) -> None:
        self.tree = jax.tree_util.tree_structure(outs)
        self.kept = [isinstance(o, ImplicitBase) for o in outs]
        self.avals = [
            o.aval if isinstance(o, ImplicitBase) else typeof(o) for o in outs
        ]
        self.sizes = [len(jax.tree_util.tree_leaves(o)) for o in outs]
        self.differentiable = any(
            isinstance(o, ImplicitBase) and _differentiable(o) for o in outs
        )


def _enter(tag, vals: Sequence) -> tuple[ImplicitTrace, list]:
    """A sub-trace of the current trace, and `vals` wrapped into it."""
    sub = sub_trace(tag)
    return sub, [sub.wrap(v) for v in vals]


def _differentiable(value: ImplicitBase) -> bool:
    return any(
        np.size(leaf) > 0
        and jax.numpy.issubdtype(typeof(leaf).dtype, jax.numpy.inexact)
        for leaf in jax.tree_util.tree_leaves(value)
    )
