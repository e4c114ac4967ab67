"""Rules for primitives that carry a function: jit, call, custom_jvp/vjp, shard_map.

All of them share `trace_body`: run a body under a fresh `ImplicitTrace`, with implicit
inputs flattened to their leaves, and stage it into a new jaxpr on the parent trace.
Implicit values therefore cross the primitive as their leaves and stay implicit.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import jax

from . import _dispatch
from ._base import ImplicitBase
from ._compat import (
    UNSPECIFIED,
    ClosedJaxpr,
    Tracer,
    bind_with_trace,
    canonicalize_value,
    current_trace,
    eval_jaxpr,
    is_eval_trace,
    make_debug_info,
    primitives_module,
    set_current_trace,
    shard_map_p,
    trace_to_jaxpr_dynamic,
    typeof,
    wrap_init,
)
from ._interpreter import ImplicitTrace, _recording, replay, structural_rules


@dataclasses.dataclass
class TracedBody:
    """A body staged with implicit inputs: call it on `flat_in` with `jaxpr`."""

    jaxpr: ClosedJaxpr
    out_tree: Any
    events: list


def flatten_values(vals: list) -> tuple[list, Any]:
    """Flatten values to canonical array leaves (implicit arrays opened all the way down).

    Leaves of implicit arrays may be NumPy arrays (e.g. the zero-size aval leaf), which
    a parent trace only accepts once canonicalized.
    """
    leaves, tree = jax.tree_util.tree_flatten(list(vals))
    return [canonicalize_value(x) for x in leaves], tree


def trace_body(
    trace: ImplicitTrace,
    body: Callable[[list], list],
    in_vals: list,
    name: str,
) -> tuple[TracedBody, list]:
    """Stage `body` (run on wrapped implicit values) into a jaxpr over flat leaves.

    Args:
      trace: the trace whose primitive is being interpreted.
      body: called with the input values (implicit ones as tracers of a sub-trace)
        while that sub-trace is current; returns a list of output values.
      in_vals: the input values, at the parent level.
      name: used in the jaxpr's debug info.

    Returns:
      The staged body and the flat parent-level leaves to call it with.
    """
    flat_in, in_tree = flatten_values(in_vals)
    in_avals = [typeof(x) for x in flat_in]
    out_tree_box = []

    def flat_body(*leaves):
        sub = ImplicitTrace(current_trace(), trace.tag)
        vals = jax.tree_util.tree_unflatten(in_tree, leaves)
        wrapped = [sub.wrap(v) for v in vals]
        with set_current_trace(sub):
            outs = body(wrapped)
        del wrapped
        outs = [sub.to_value(o) for o in outs]
        out_leaves, out_tree = jax.tree_util.tree_flatten(outs)
        out_tree_box.append(out_tree)
        return out_leaves

    events: list = []
    with _recording(events), set_current_trace(trace.parent_trace):
        jaxpr, _, consts = trace_to_jaxpr_dynamic(
            wrap_init(flat_body, debug_info=make_debug_info(name)), in_avals
        )
    return TracedBody(ClosedJaxpr(jaxpr, consts), out_tree_box[0], events), flat_in


# Re-traced jit bodies, per original jaxpr, per input structure and handler generation.
_jit_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_jit_body(trace, closed, vals, name) -> tuple[TracedBody, list]:
    flat_in, in_tree = flatten_values(vals)
    key = (in_tree, tuple(typeof(x) for x in flat_in), _dispatch.generation[0])
    per_jaxpr = _jit_cache.setdefault(closed, {})
    hit = per_jaxpr.get(key)
    if hit is not None:
        replay(hit.events)
        return hit, flat_in

    def body(wrapped):
        return eval_jaxpr(closed.jaxpr, closed.consts, *wrapped)

    traced, flat_in = trace_body(trace, body, vals, name)
    if not any(isinstance(c, Tracer) for c in traced.jaxpr.consts):
        per_jaxpr[key] = traced
    return traced, flat_in


def _per_leaf(values: list, per_value: tuple, implicit_default: Any) -> tuple:
    """Expand a per-operand parameter tuple to one entry per flat leaf."""
    out = []
    for v, p in zip(values, per_value):
        if isinstance(v, ImplicitBase):
            out.extend([implicit_default] * len(jax.tree_util.tree_leaves(v)))
        else:
            out.append(p)
    return tuple(out)


def _jit_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    closed = params["jaxpr"]
    if params.get("inline") and not is_eval_trace(trace.parent_trace):
        # The parent would inline this body anyway: interpret it in place.
        with set_current_trace(trace):
            outs = eval_jaxpr(closed.jaxpr, closed.consts, *map(trace.wrap, vals))
        return [trace.to_value(o) for o in outs]

    traced, flat_in = _cached_jit_body(trace, closed, vals, params.get("name", "jit"))
    out_vals = jax.tree_util.tree_unflatten(traced.out_tree, [0] * traced.out_tree.num_leaves)
    new_params = dict(
        params,
        jaxpr=traced.jaxpr,
        donated_invars=_per_leaf(vals, params["donated_invars"], False),
        in_shardings=_per_leaf(vals, params["in_shardings"], UNSPECIFIED),
        in_layouts=_per_leaf(vals, params["in_layouts"], None),
        out_shardings=_per_leaf(out_vals, params["out_shardings"], UNSPECIFIED),
        out_layouts=_per_leaf(out_vals, params["out_layouts"], None),
    )
    outs = bind_with_trace(trace.parent_trace, primitive, flat_in, new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


def _has_implicit(vals) -> bool:
    return any(isinstance(v, ImplicitBase) for v in vals)


def _call_rule(trace, primitive, f, vals, params):
    if not _has_implicit(vals):
        with set_current_trace(trace.parent_trace):
            return primitive.bind(f, *vals, **params)
    with set_current_trace(trace):
        return f.call_wrapped(*map(trace.wrap, vals))


def _custom_jvp_rule(trace, primitive, fun, jvp, vals, *, symbolic_zeros):
    if not _has_implicit(vals):
        params = dict(subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros)
        return bind_with_trace(trace.parent_trace, primitive, vals, params)
    with set_current_trace(trace):
        return fun.call_wrapped(*map(trace.wrap, vals))


def _custom_vjp_rule(trace, primitive, fun, fwd, bwd, vals, *, out_trees, symbolic_zeros):
    if not _has_implicit(vals):
        params = dict(
            subfuns=(fun, fwd, bwd), out_trees=out_trees, symbolic_zeros=symbolic_zeros
        )
        return bind_with_trace(trace.parent_trace, primitive, vals, params)
    with set_current_trace(trace):
        return fun.call_wrapped(*map(trace.wrap, vals))


def _shard_map_rule(trace, primitive, fun, vals, params):
    if not _has_implicit(vals):
        with set_current_trace(trace.parent_trace):
            return primitive.bind(*vals, subfuns=(fun,), **params)
    raise NotImplementedError(
        "shard_map over implicit arrays is not supported yet; materialize them first "
        "(`qax.materialize_nested(x, full=True)`) or pass their fields separately."
    )


structural_rules[primitives_module.jit_p] = _jit_rule
structural_rules[primitives_module.call_p] = _call_rule
structural_rules[primitives_module.closed_call_p] = _call_rule
structural_rules[primitives_module.custom_jvp_call_p] = _custom_jvp_rule
structural_rules[primitives_module.custom_vjp_call_p] = _custom_vjp_rule
if shard_map_p is not None:
    structural_rules[shard_map_p] = _shard_map_rule
