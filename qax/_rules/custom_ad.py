"""Rules for functions handed over as `WrappedFun`s: `call`, `custom_jvp`, `custom_vjp`.

These rules wrap the function (and its derivative rules) to work on flat leaves and
rebind the primitive; the wrappers run later, maybe more than once, maybe not at all,
depending on the parent trace (see `_staging._Outputs`). Custom derivative rules are
kept. Also here: JAX > 0.11's `eval_jaxpr` (the inlined `call`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import _dispatch, _errors
from .._base import ImplicitBase
from .._compat import (
    CALL_JAXPR_P,
    CALL_PRIMITIVES,
    SymbolicZero,
    Zero,
    bind_with_trace,
    jaxpr_as_fun,
    join_bwd_result,
    may_run_rules_later,
    may_stage,
    primitives_module,
    set_current_trace,
    split_bwd_result,
    transformation2,
    typeof,
)
from .._entry import densify, materialize_nested
from .._interpreter import ImplicitTrace
from .._report import quietly
from ._staging import (
    _differentiable,
    _enter,
    _has_implicit,
    _leaves,
    _Outputs,
    _per_value,
    _unwrap_all,
)


def _quiet_dense(x: Any) -> Any:
    """Materialize a value again, without reporting it (it was reported once)."""
    if not isinstance(x, ImplicitBase):
        return x
    with quietly():
        return materialize_nested(x, full=True)


def _fun_name(fun: Any) -> str:
    info = getattr(fun, "debug_info", None)
    return getattr(info, "func_name", None) or getattr(fun, "__name__", "function")


def _settle(outs: list, name: str, primitive: str) -> list:
    """Materialize the outputs of a custom-derivative function that must be dense.

    An implicit output without differentiable data (a symbolic zero) stays implicit:
    its tangent is zero, whatever the rule says. Any other implicit output is
    materialized, so that the rule's tangent for it applies.
    """
    settled = []
    for i, o in enumerate(outs):
        if isinstance(o, ImplicitBase) and _differentiable(o):
            reason = _errors.CUSTOM_RULE_SETTLED.format(
                name=name, index=i, cls=type(o).__name__
            )
            o = densify(o, primitive, reason)
        settled.append(o)
    return settled


def _decided_primal_leaves(info: _Outputs, primals_out: list, name: str) -> list:
    """Leaves of a rule's primal outputs, in the structure the function's outputs have."""
    if info.differentiable:
        raise RuntimeError(_errors.CUSTOM_RULE_KEPT_DIFFERENTIATED.format(name=name))
    settled = [
        p if kept else _quiet_dense(p)
        for kept, p in zip(info.kept, primals_out, strict=True)
    ]
    leaves, tree = jax.tree_util.tree_flatten(settled)
    if tree != info.tree:
        raise TypeError(
            f"The custom derivative rule of `{name}` returned primal outputs with "
            f"implicit structure {tree}, but `{name}` itself returned {info.tree}. "
            "Make the rule compute its primal outputs by calling the function."
        )
    return leaves


def _implicit_fun(f, tag, in_tree, info: _Outputs, settle: tuple | None, *leaves):
    """`f` (a function of the values) as a function of their flat leaves.

    With `settle` (the function's name and its call primitive's), outputs are settled
    as for a function with a custom derivative rule.
    """
    sub, wrapped = _enter(tag, jax.tree_util.tree_unflatten(in_tree, leaves))
    with set_current_trace(sub):
        outs = f(*wrapped)
    del wrapped
    outs = _unwrap_all(sub, outs)
    if settle is not None and may_stage(sub.parent_trace):
        # Recorded, so maybe differentiated later, when the rule must apply.
        outs = _settle(outs, *settle)
    info.decide(outs)
    return jax.tree_util.tree_leaves(outs)


def _call_rule(trace, primitive, f, vals, params):
    if not _has_implicit(vals):
        with set_current_trace(trace.parent_trace):
            return primitive.bind(f, *vals, **params)
    info = _Outputs()
    in_tree = jax.tree_util.tree_structure(vals)
    f2 = transformation2(_implicit_fun, f, trace.tag, in_tree, info, None)
    with set_current_trace(trace.parent_trace):
        outs = primitive.bind(*_leaves(vals), subfuns=(f2,), **params)
    return [trace.wrap(o) for o in jax.tree_util.tree_unflatten(info.tree, outs)]


for _primitive in CALL_PRIMITIVES:
    _dispatch.function_rules[_primitive] = _call_rule


def _eval_jaxpr_rule(trace, primitive, vals, params):
    """An inlined call of a jaxpr (JAX > 0.11's `call_p`/`closed_call_p`): its body
    runs on the implicit values where it stands."""
    body = jaxpr_as_fun(params["call_jaxpr"])
    with set_current_trace(trace):
        outs = body(*map(trace.wrap, vals))
    return [trace.to_value(o) for o in outs]


if CALL_JAXPR_P is not None:
    _dispatch.primitive_rules[CALL_JAXPR_P] = _eval_jaxpr_rule


def _zeros(aval: Any) -> Any:
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, jax.dtypes.float0)
    return jax.numpy.zeros(aval.shape, aval.dtype)


def _instantiate(t: Any, leaf: Any) -> Any:
    if isinstance(t, (SymbolicZero, Zero)):
        return _zeros(typeof(leaf).to_tangent_aval())
    return t


def _through_materialize(value: ImplicitBase, transform: Callable, *args: Any) -> Any:
    """`transform(dense, leaves, *args)` with `dense` the leaves-to-array function."""
    leaves, tree = jax.tree_util.tree_flatten(value)

    def dense(*ls):
        return materialize_nested(jax.tree_util.tree_unflatten(tree, ls), full=True)

    with quietly():
        return transform(dense, leaves, *args)


def _dense_tangent(value: ImplicitBase, tangents: list) -> Any:
    """The tangent of `value.materialize()` given tangents of `value`'s leaves."""

    def jvp(dense, leaves, tangents):
        return jax.jvp(dense, tuple(leaves), tuple(tangents))[1]

    return _through_materialize(value, jvp, tangents)


def _leaf_cotangents(value: ImplicitBase, ct: Any) -> list:
    """Cotangents of the leaves of `value` given one of `value.materialize()`."""

    def vjp(dense, leaves, ct):
        return list(jax.vjp(dense, *leaves)[1](ct))

    return _through_materialize(value, vjp, ct)


def _implicit_jvp(f, tag, in_tree, info: _Outputs, name, symbolic_zeros, *args):
    """The custom JVP rule `f`, as a rule over the flat leaves of implicit values.

    Tangents of an implicit value's leaves become a tangent of the array it represents
    (through the JVP of `materialize()`), which the rule receives with the implicit
    value itself as the primal.
    """
    n = len(args) // 2
    vals = jax.tree_util.tree_unflatten(in_tree, args[:n])
    tangents = []
    for v, leaves, ts in zip(
        vals, _per_value(vals, args[:n]), _per_value(vals, args[n:]), strict=True
    ):
        if not isinstance(v, ImplicitBase):
            tangents.append(ts[0])
        elif symbolic_zeros and all(isinstance(t, SymbolicZero) for t in ts):
            tangents.append(SymbolicZero(v.aval.to_tangent_aval()))
        else:
            ts = [_instantiate(t, leaf) for t, leaf in zip(ts, leaves, strict=True)]
            tangents.append(_dense_tangent(v, ts))
    sub, wrapped = _enter(tag, vals)
    with set_current_trace(sub):
        outs = f(*wrapped, *tangents)
    del wrapped
    outs = _unwrap_all(sub, outs)
    primals_out, tangents_out = outs[: len(outs) // 2], outs[len(outs) // 2 :]
    if info.kept is None:  # the function itself did not run: this rule decides
        info.decide(_settle(primals_out, name, "custom_jvp_call"))
    primal_leaves = _decided_primal_leaves(info, primals_out, name)
    tangent_leaves = []
    for kept, p, t in zip(info.kept, primals_out, tangents_out, strict=True):
        if kept:  # no differentiable data: zero tangents for its leaves
            leaves = jax.tree_util.tree_leaves(p)
            tangent_leaves += [_zeros(typeof(x).to_tangent_aval()) for x in leaves]
        else:
            tangent_leaves.append(t if isinstance(t, SymbolicZero) else _quiet_dense(t))
    return [*primal_leaves, *tangent_leaves]


def _note_deferred_rules(trace: ImplicitTrace) -> None:
    """Mark `trace`'s call when the rules bound now may run after it returns.

    The rules may close over the call's tracers (they are seen again through a
    sub-trace with the same tag), so those are not leaks; see `ImplicitTag`.
    """
    if may_run_rules_later(trace.parent_trace):
        trace.tag.rules_outlive_call = True


def _custom_jvp_rule(trace, primitive, fun, jvp, vals, *, symbolic_zeros):
    # Wrapped even without implicit operands: the function and its rule may close over
    # implicit values (or get them through `nondiff_argnums`), which only a sub-trace
    # with this trace's tag can see.
    in_tree, name, info = jax.tree_util.tree_structure(vals), _fun_name(fun), _Outputs()
    settle = (name, primitive.name)
    fun2 = transformation2(_implicit_fun, fun, trace.tag, in_tree, info, settle)
    jvp2 = transformation2(
        _implicit_jvp, jvp, trace.tag, in_tree, info, name, symbolic_zeros
    )
    params = dict(subfuns=(fun2, jvp2), symbolic_zeros=symbolic_zeros)
    _note_deferred_rules(trace)
    outs = bind_with_trace(trace.parent_trace, primitive, _leaves(vals), params)
    return [trace.wrap(o) for o in jax.tree_util.tree_unflatten(info.tree, outs)]


_dispatch.custom_jvp_rules[primitives_module.custom_jvp_call_p] = _custom_jvp_rule


def _implicit_fwd(f, tag, in_tree, info: _Outputs, name, out_trees, *args):
    """The custom VJP forward rule `f`, over the flat leaves of implicit values.

    Its residuals are the rule's own (all of them, flattened) followed by the implicit
    inputs, whose leaves the backward rule linearizes `materialize()` at.
    """
    leaves, nonzeros = args[::2], args[1::2]
    vals = jax.tree_util.tree_unflatten(in_tree, leaves)
    flags = [any(group) for group in _per_value(vals, nonzeros)]
    sub, wrapped = _enter(tag, vals)
    with set_current_trace(sub):
        outs = f(*[x for pair in zip(wrapped, flags, strict=True) for x in pair])
    _, res_tree, input_fwds = out_trees()
    n_res = res_tree.num_leaves - sum(i is not None for i in input_fwds)
    res_out = iter(outs[:n_res])
    res = [next(res_out) if i is None else wrapped[i] for i in input_fwds]
    del wrapped
    res, primals_out = _unwrap_all(sub, res), _unwrap_all(sub, outs[n_res:])
    if info.kept is None:  # the function itself did not run: this rule decides
        info.decide(_settle(primals_out, name, "custom_vjp_call"))
    primal_leaves = _decided_primal_leaves(info, primals_out, name)
    implicit_inputs = [v for v in vals if isinstance(v, ImplicitBase)]
    res_leaves, info.res_tree = jax.tree_util.tree_flatten((res, implicit_inputs))
    return [*res_leaves, *primal_leaves]


def _implicit_bwd(f, tag, in_implicit, info: _Outputs, *args):
    """The custom VJP backward rule `f`, giving cotangents for the input leaves.

    A cotangent for an implicit input's array becomes cotangents for its leaves through
    the VJP of `materialize()` at the input's leaves.
    """
    n_res = info.res_tree.num_leaves
    res, implicit_inputs = jax.tree_util.tree_unflatten(info.res_tree, args[:n_res])
    ct_leaves = iter(args[n_res:])
    cts = []
    for kept, size, aval in zip(info.kept, info.sizes, info.avals, strict=True):
        if kept:  # no differentiable data: its cotangent is zero
            for _ in range(size):
                next(ct_leaves)
            cts.append(_zeros(aval.to_tangent_aval()))
        else:
            cts.append(next(ct_leaves))
    sub, wrapped = _enter(tag, res)
    with set_current_trace(sub):
        cts_in, logs = split_bwd_result(f(*wrapped, *cts))
    del wrapped
    cts_in = _unwrap_all(sub, cts_in)
    if logs is not None:
        logs = sub.unwrap_tree(logs)
    implicit_inputs = iter(implicit_inputs)
    out = []
    for is_implicit, ct in zip(in_implicit, cts_in, strict=True):
        if not is_implicit:
            out.append(_quiet_dense(ct))
            continue
        value = next(implicit_inputs)
        if isinstance(ct, (Zero, SymbolicZero)):
            zero_cts = (Zero(typeof(x).to_tangent_aval()) for x in _leaves([value]))
            out.extend(zero_cts)
        else:
            out.extend(_leaf_cotangents(value, _quiet_dense(ct)))
    return join_bwd_result(out, logs)


def _custom_vjp_rule(
    trace, primitive, fun, fwd, bwd, vals, *, out_trees, symbolic_zeros
):
    # Wrapped even without implicit operands (see `_custom_jvp_rule`).
    in_tree, name, info = jax.tree_util.tree_structure(vals), _fun_name(fun), _Outputs()
    in_implicit = tuple(isinstance(v, ImplicitBase) for v in vals)
    settle = (name, primitive.name)
    fun2 = transformation2(_implicit_fun, fun, trace.tag, in_tree, info, settle)
    fwd2 = transformation2(
        _implicit_fwd, fwd, trace.tag, in_tree, info, name, out_trees
    )
    bwd2 = transformation2(_implicit_bwd, bwd, trace.tag, in_implicit, info)

    def out_trees2():
        return info.tree, info.res_tree, [None] * info.res_tree.num_leaves

    params = dict(
        subfuns=(fun2, fwd2, bwd2), out_trees=out_trees2, symbolic_zeros=symbolic_zeros
    )
    _note_deferred_rules(trace)
    outs = bind_with_trace(trace.parent_trace, primitive, _leaves(vals), params)
    return [trace.wrap(o) for o in jax.tree_util.tree_unflatten(info.tree, outs)]


_dispatch.custom_vjp_rules[primitives_module.custom_vjp_call_p] = _custom_vjp_rule
