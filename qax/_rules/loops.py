"""Rules for loops, `scan` and `while`, on implicit carries, consts and `xs`.

Both search for a carry structure that the loop body preserves (`_plan_loop`): parts
of the carry whose structure changes across an iteration are materialized, with a
warning that says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from .. import _bodies, _dispatch, _errors
from .._base import ImplicitBase
from .._batching import (
    slice_template,
    stack_like,
    undeclared_reason,
    with_sliceable_parts,
)
from .._compat import (
    bind_with_trace,
    jaxpr_as_fun,
    mapped_aval,
    scan_operand_counts,
    scan_params,
    set_current_trace,
    typeof,
    weakly_typed,
)
from .._entry import densify
from .._fields import stackable
from .._interpreter import ImplicitTrace
from .._structure import common_structure_paths, describe, materialize_at, value_at
from . import _staging
from ._staging import (
    TracedBody,
    _densify_parent,
    _hoisted,
    _jaxpr_body,
    _leaves,
    _path_name,
)

_MAX_ATTEMPTS = 64


@dataclasses.dataclass
class _LoopPlan:
    """How a loop runs on implicit carries, and its body staged accordingly.

    `paths` are materialized in the carry (before the loop and at the end of each
    iteration); `weak_init`/`weak_body` index carry leaves given a strong type before
    the loop / at the end of each iteration; `described` says what each path was.
    """

    paths: frozenset = frozenset()
    weak_init: frozenset = frozenset()
    weak_body: frozenset = frozenset()
    described: dict = dataclasses.field(default_factory=dict)
    traced: TracedBody | None = None


def _strengthen(leaves: list, which: frozenset) -> list:
    if not which:
        return leaves
    return [
        jax.lax.convert_element_type(x, typeof(x).dtype) if i in which else x
        for i, x in enumerate(leaves)
    ]


def _carry_densifier(plan: _LoopPlan, loop: str, where: str, to_dense: Callable):
    def densify_path(x, path):
        before, after = plan.described.get(path, (describe(x), "another structure"))
        reason = _errors.CARRY_CHANGES.format(
            path=_path_name(path),
            loop=loop,
            before=before,
            after=after,
            cls=type(x).__name__,
            where=where,
        )
        return to_dense(x, reason)

    return densify_path


def _prepare_carry(trace, init: list, plan: _LoopPlan, loop: str) -> list:
    """The initial carry changed as `plan` says (at the parent level)."""
    densify_path = _carry_densifier(
        plan,
        loop,
        "before the loop",
        lambda x, reason: _densify_parent(trace, x, loop, reason),
    )
    carry = materialize_at(init, plan.paths, densify_path)
    if plan.weak_init:
        leaves, tree = jax.tree_util.tree_flatten(carry)
        with set_current_trace(trace.parent_trace):
            leaves = _strengthen(leaves, plan.weak_init)
        carry = jax.tree_util.tree_unflatten(tree, leaves)
    return carry


def _carry_fix(plan: _LoopPlan, n_carry: int, loop: str) -> Callable | None:
    """The change of the body's output carry that `plan` says (inside the body)."""
    if not plan.paths and not plan.weak_body:
        return None
    densify_path = _carry_densifier(
        plan,
        loop,
        "at the end of each iteration",
        lambda x, reason: densify(x, loop, reason),
    )

    def fix(outs):
        carry = materialize_at(list(outs[:n_carry]), plan.paths, densify_path)
        leaves, tree = jax.tree_util.tree_flatten(carry)
        carry = jax.tree_util.tree_unflatten(tree, _strengthen(leaves, plan.weak_body))
        return [*carry, *outs[n_carry:]]

    return fix


def _carry_changes(carry: list, traced: TracedBody) -> tuple[frozenset, dict, set, set]:
    """How the carry returned by `traced` differs from `carry`.

    Returns the paths to materialize (with descriptions), or, when the structures
    agree, the carry leaves whose weak type differs (to strengthen in the initial
    carry, and in the body's output).
    """
    before = jax.tree_util.tree_map(typeof, carry)
    after = traced.out_skeleton()[: len(carry)]
    paths = common_structure_paths([before, after])
    if paths:
        described = {
            p: (describe(value_at(before, p)), describe(value_at(after, p)))
            for p in paths
        }
        return paths, described, set(), set()
    weak_init, weak_body = set(), set()
    in_avals = jax.tree_util.tree_leaves(before)
    for i, (a, b) in enumerate(zip(in_avals, traced.out_avals, strict=False)):
        if a.weak_type and not b.weak_type:
            weak_init.add(i)
        elif b.weak_type and not a.weak_type:
            weak_body.add(i)
    return paths, {}, weak_init, weak_body


def _plan_loop(
    trace, body, consts, init, xs, slice_xs, loop, fix_ys=None
) -> tuple[_LoopPlan, list]:
    """Find the carry structure that the loop body preserves, and stage the body.

    The body is traced with the carry's structure. If the carry it returns has another
    structure (or another weak type), the parts that differ are materialized, in the
    initial carry and in the body's output, and the body is traced again, until the
    structure is stable. Attempts after the first hold their reports; those of the
    final attempt that the first did not make are reported at the end.

    Returns the plan and the initial carry changed as it says.
    """
    plan = _LoopPlan()
    first_events = None
    for attempt in range(_MAX_ATTEMPTS):
        with _bodies.speculative() if attempt else contextlib.nullcontext() as held:
            carry = _prepare_carry(trace, init, plan, loop)
            in_vals = [*consts, *carry, *xs]
            flat_in = _leaves(in_vals)
            n_xs = len(_leaves(xs))
            in_avals = [*map(typeof, flat_in[: len(flat_in) - n_xs])]
            in_avals += slice_xs(flat_in[len(flat_in) - n_xs :])
            traced, _ = _staging.trace_body(
                trace,
                body,
                in_vals,
                loop,
                in_avals=in_avals,
                fix_outs=_then(_carry_fix(plan, len(init), loop), fix_ys),
            )
        if first_events is None:
            first_events = traced.events
        paths, described, weak_init, weak_body = _carry_changes(carry, traced)
        if not (paths or weak_init or weak_body):
            break
        plan = dataclasses.replace(
            plan,
            paths=plan.paths | paths,
            described={**plan.described, **described},
            weak_init=plan.weak_init | weak_init,
            weak_body=plan.weak_body | weak_body,
        )
    else:  # pragma: no cover (every attempt materializes more, so this terminates)
        raise RuntimeError(f"Found no stable carry structure for `{loop}`.")
    if attempt:
        _bodies.commit(held, list(first_events))
    plan.traced = traced
    return plan, carry


def _then(first: Callable | None, second: Callable | None) -> Callable | None:
    if first is None or second is None:
        return first or second
    return lambda outs: second(first(outs))


def _loop(
    trace, anchor, extra_key, body, consts, init, xs, slice_xs, loop, fix_ys=None
):
    """`_plan_loop`, cached: a cached plan is applied to the initial carry again."""
    key, _ = _bodies.signature(
        [*consts, *init, *xs], len(consts), len(init), *extra_key
    )
    plan = _bodies.reuse(anchor, key)
    if plan is not None:
        return plan, _prepare_carry(trace, init, plan, loop)
    plan, carry = _plan_loop(trace, body, consts, init, xs, slice_xs, loop, fix_ys)
    _bodies.keep(anchor, key, plan, plan.traced.events, plan.traced.cacheable)
    return plan, carry


def _scannable(trace, x: Any) -> Any:
    """`x` with the implicit parts that cannot be sliced along axis 0 leaf by leaf (their
    type does not declare batch axes, or axis 0 is not one of them) materialized."""

    def densify_part(part):
        reason = undeclared_reason("lax.scan", "slices", part, 0)
        return _densify_parent(trace, part, "scan", reason)

    return with_sliceable_parts(x, 0, densify_part)


def _stackable_ys(n_carry: int, loop: str) -> Callable[[list], list]:
    """Materialize (inside the body) the implicit `ys` that cannot be stacked leaf by leaf."""

    def fix(outs):
        ys = []
        for y in outs[n_carry:]:
            if isinstance(y, ImplicitBase) and not stackable(y):
                reason = undeclared_reason(loop, "stacks its outputs of type", y, 0)
                y = densify(y, "scan", reason)
            ys.append(y)
        return [*outs[:n_carry], *ys]

    return fix


def _scan_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    n_consts, n_carry = scan_operand_counts(params)
    length = params["length"]
    vals = _as_weak_as_declared(trace, vals, params["jaxpr"].in_avals)
    consts = vals[:n_consts]
    init = vals[n_consts : n_consts + n_carry]
    xs = [_scannable(trace, x) for x in vals[n_consts + n_carry :]]
    # The body sees one row of each `xs`: implicit ones are unflattened from their
    # sliced leaves with the shape of a row.
    rows = [slice_template(x) if isinstance(x, ImplicitBase) else x for x in xs]
    closed = params["jaxpr"]

    def slice_xs(leaves):
        return [mapped_aval(length, 0, typeof(x)) for x in leaves]

    plan, carry = _loop(
        trace,
        closed,
        (),
        _jaxpr_body(closed),
        consts,
        init,
        rows,
        slice_xs,
        "lax.scan",
        _stackable_ys(n_carry, "lax.scan"),
    )
    jaxpr, hoisted = _hoisted(plan.traced)
    flat_consts, flat_carry = [*hoisted, *_leaves(consts)], _leaves(carry)
    flat_xs = _leaves(xs)
    n_ys = len(jaxpr.out_avals) - len(flat_carry)
    counts = (len(flat_consts), len(flat_carry), len(flat_xs), n_ys)
    new_params = scan_params(params, jaxpr, counts)
    operands = [*flat_consts, *flat_carry, *flat_xs]
    outs = bind_with_trace(trace.parent_trace, primitive, operands, new_params)
    skeleton = plan.traced.out_skeleton()
    carry_skeleton, ys_skeleton = skeleton[:n_carry], skeleton[n_carry:]
    n_carry_leaves = len(_leaves(carry_skeleton))
    final = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(carry_skeleton), outs[:n_carry_leaves]
    )
    ys = stack_like(ys_skeleton, list(outs[n_carry_leaves:]), length)
    return [*final, *ys]


_dispatch.primitive_rules[jax.lax.scan_p] = _scan_rule


def _as_weak_as_declared(trace: ImplicitTrace, vals: list, declared: list) -> list:
    """`vals`, a loop's operands, with the plain ones as weak as the loop's body
    declares them: JAX runs a body whose inputs are weaker than its operands (the
    tangent carry of a differentiated loop is as weak as its primal carry), and its
    outputs keep that weak type."""
    out = list(vals)
    for i, (v, d) in enumerate(zip(vals, declared, strict=True)):
        if d.weak_type and not isinstance(v, ImplicitBase):
            aval = typeof(v)
            if not aval.weak_type and aval.dtype == d.dtype:
                with set_current_trace(trace.parent_trace):
                    out[i] = weakly_typed(v)
    return out


def _while_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    declared = params["cond_jaxpr"].in_avals[:n_cond] + params["body_jaxpr"].in_avals
    vals = _as_weak_as_declared(trace, vals, declared)
    cond_consts = vals[:n_cond]
    body_consts = vals[n_cond : n_cond + n_body]
    init = vals[n_cond + n_body :]
    body_jaxpr, cond_jaxpr = params["body_jaxpr"], params["cond_jaxpr"]
    plan, carry = _loop(
        trace,
        body_jaxpr,
        (cond_jaxpr,),
        _jaxpr_body(body_jaxpr),
        body_consts,
        init,
        [],
        lambda leaves: [],
        "lax.while_loop",
    )

    def plain_predicate(outs):
        (pred,) = outs
        if isinstance(pred, ImplicitBase):
            reason = _errors.IMPLICIT_PREDICATE.format(cls=type(pred).__name__)
            pred = densify(pred, "while", reason)
        return [pred]

    cond_traced, _ = _staging.trace_body(
        trace,
        _jaxpr_body(cond_jaxpr),
        [*cond_consts, *carry],
        "cond_fun",
        fix_outs=plain_predicate,
    )
    body, body_hoisted = _hoisted(plan.traced)
    cond, cond_hoisted = _hoisted(cond_traced)
    flat_cond_consts = [*cond_hoisted, *_leaves(cond_consts)]
    flat_body_consts = [*body_hoisted, *_leaves(body_consts)]
    cond_fun, body_fun = jaxpr_as_fun(cond), jaxpr_as_fun(body)

    def predicate(carry):
        (pred,) = cond_fun(*flat_cond_consts, *carry)
        return pred

    with set_current_trace(trace.parent_trace):
        outs = jax.lax.while_loop(
            predicate,
            lambda carry: body_fun(*flat_body_consts, *carry),
            _leaves(carry),
        )
    return jax.tree_util.tree_unflatten(plan.traced.out_tree, outs)


_dispatch.primitive_rules[jax.lax.while_p] = _while_rule
