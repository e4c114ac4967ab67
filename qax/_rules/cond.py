"""The rule for `cond` (`lax.cond`, `lax.switch`): every branch re-traced on implicits.

Outputs whose implicit structures differ between branches are materialized (with a
warning that says why), so that every branch returns the same structure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from .. import _bodies, _dispatch, _errors
from .._base import ImplicitBase
from .._compat import bind_with_trace, merge_common_consts, separate_consts
from .._entry import densify
from .._interpreter import ImplicitTrace
from .._structure import common_structure_paths, describe, materialize_at, value_at
from . import _staging
from ._staging import _densify_parent, _jaxpr_body, _path_name


@dataclasses.dataclass
class _CondPlan:
    """The re-traced branches, with their constants shared (as `lax.cond` does)."""

    out_tree: Any
    branches: tuple
    consts: list
    events: list


def _cond_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    index, *ops = vals
    index = _densify_parent(trace, index, primitive.name)
    branches = params["branches"]
    key, flat_ops = _bodies.signature(ops, branches[1:])
    plan = _bodies.reuse(branches[0], key)
    if plan is None:
        plan, traced = _plan_cond(trace, branches, ops)
        cacheable = all(t.cacheable for t in traced)
        _bodies.keep(branches[0], key, plan, plan.events, cacheable)
    outs = bind_with_trace(
        trace.parent_trace,
        primitive,
        [index, *plan.consts, *flat_ops],
        dict(params, branches=plan.branches),
    )
    return jax.tree_util.tree_unflatten(plan.out_tree, outs)


_dispatch.primitive_rules[jax.lax.cond_p] = _cond_rule


def _plan_cond(trace: ImplicitTrace, branches: Sequence, ops: list):
    """Re-trace every branch, materializing outputs whose structures differ.

    Returns the plan and the staged branches.
    """
    traced = [
        _staging.trace_body(
            trace, _jaxpr_body(b), ops, f"branch{i}", declared=b.in_avals
        )[0]
        for i, b in enumerate(branches)
    ]
    events = [e for t in traced for e in t.events]
    skeletons = [t.out_skeleton() for t in traced]
    paths = common_structure_paths(skeletons)
    if paths:

        def densify_path(x, path):
            described = " vs. ".join(describe(value_at(s, path)) for s in skeletons)
            reason = _errors.COND_BRANCHES_DIFFER.format(
                path=_path_name(path), described=described, cls=type(x).__name__
            )
            return densify(x, "cond", reason)

        def fix(outs):
            return materialize_at(outs, paths, densify_path)

        with _bodies.speculative() as held:
            for i, branch in enumerate(branches):
                if any(
                    isinstance(value_at(skeletons[i], p), ImplicitBase) for p in paths
                ):
                    traced[i], _ = _staging.trace_body(
                        trace,
                        _jaxpr_body(branch),
                        ops,
                        f"branch{i}",
                        declared=branch.in_avals,
                        fix_outs=fix,
                    )
        _bodies.commit(held, events)
    split = [separate_consts(t.jaxpr) for t in traced]
    jaxprs, consts = merge_common_consts([j for j, _ in split], [c for _, c in split])
    return _CondPlan(traced[0].out_tree, tuple(jaxprs), list(consts), events), traced
