"""Rules for primitives that carry a function or only annotate values.

Higher-order primitives (`jit`, `cond`, `scan`, `while`, `remat2`, `custom_jvp_call`,
`custom_vjp_call`, `closed_call`, `shard_map`) hold a body written for dense arrays. Every
rule here re-traces that body with `trace_body`: the body runs under a fresh
`ImplicitTrace` on the implicit values, and is staged into a new jaxpr over their flat
leaves. The primitive is then bound on the leaves, so implicit values cross it as their
leaves and stay implicit; handlers inside the body apply as usual.

Where the body's outputs must share a structure (the branches of a `cond`, the carry of a
loop), the outputs are brought to their largest common structure
(`get_common_prefix_transforms`) before binding: only the parts that differ are
materialized, with a warning that says why.

Primitives that only annotate or move a value (`pvary`, `sharding_constraint`, `name`,
`optimization_barrier`, `copy`, `device_put`, `stop_gradient`) are applied to every leaf
of an implicit operand and the implicit array is rebuilt around the results.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _dispatch
from ._base import ImplicitBase, is_implicit, quiet_materialization
from ._compat import (
    UNSPECIFIED,
    ClosedJaxpr,
    FlatTree,
    ShapedArray,
    SymbolicZero,
    Tracer,
    Zero,
    bind_with_trace,
    convert_constvars_jaxpr,
    current_trace,
    eval_jaxpr,
    is_eval_trace,
    make_debug_info,
    mapped_aval,
    merge_common_consts,
    primitives_module,
    pvary_p,
    reset_stores,
    separate_consts,
    set_current_trace,
    shard_map_p,
    trace_to_jaxpr_dynamic,
    transformation2,
    typeof,
    user_source_line,
    wrap_init,
)
from ._interpreter import (
    ImplicitTrace,
    MaterializationEvent,
    _recording,
    holding_reports,
    materialize_nested,
    replay,
    report,
    structural_rules,
)
from ._tree_util import flatten_one_implicit_layer, tree_flatten_with_implicit

# ----------------------------------------------------------------------------------------
# Staging a body on implicit values


@dataclasses.dataclass
class TracedBody:
    """A body staged with implicit inputs: call it on the flat input leaves.

    Attributes:
      jaxpr: the staged body, over the flat leaves of the inputs.
      out_tree: how its flat outputs rebuild the output values.
      events: the materializations that happened while staging it.
      out_avals: the avals of its flat outputs.
    """

    jaxpr: ClosedJaxpr
    out_tree: Any
    events: list
    out_avals: list = dataclasses.field(default_factory=list)

    def out_skeleton(self) -> list:
        """The output values with avals in place of arrays (for comparing structures)."""
        return jax.tree_util.tree_unflatten(self.out_tree, self.out_avals)

    @property
    def cacheable(self) -> bool:
        return not any(isinstance(c, Tracer) for c in self.jaxpr.consts)


def flatten_values(vals: Sequence) -> tuple[list, Any]:
    """Flatten values to array leaves (implicit arrays are opened all the way down)."""
    return jax.tree_util.tree_flatten(list(vals))


def _unwrap_all(trace: ImplicitTrace, outs: Sequence) -> list:
    """Replace `trace`'s tracers by their values, also inside implicit values."""
    outs = [trace.to_value(o) for o in outs]
    return trace.unwrap_tree(outs)


def trace_body(
    trace: ImplicitTrace,
    body: Callable[[list], Sequence],
    in_vals: Sequence,
    name: str,
    *,
    in_avals: Sequence | None = None,
    fix_outs: Callable[[list], list] | None = None,
) -> tuple[TracedBody, list]:
    """Stage `body` (run on wrapped implicit values) into a jaxpr over flat leaves.

    This is the one re-tracing helper behind every rule in this module.

    Args:
      trace: the trace whose primitive is being interpreted.
      body: called with the input values (implicit ones as tracers of a sub-trace)
        while that sub-trace is current; returns a sequence of output values.
      in_vals: the input values, at the parent level.
      name: used in the jaxpr's debug info.
      in_avals: the avals of the flat input leaves, if not those of `in_vals` (a scan
        body sees slices of its `xs`).
      fix_outs: applied to the output values (plain values, no tracers of the
        sub-trace) before they are flattened, e.g. to materialize some of them.

    Returns:
      The staged body and the flat parent-level leaves to call it with.
    """
    flat_in, in_tree = flatten_values(in_vals)
    if in_avals is None:
        in_avals = [typeof(x) for x in flat_in]
    out_tree_box = []

    def flat_body(*leaves):
        sub = ImplicitTrace(current_trace(), trace.tag)
        vals = jax.tree_util.tree_unflatten(in_tree, leaves)
        wrapped = [sub.wrap(v) for v in vals]
        with set_current_trace(sub):
            outs = body(wrapped)
        del wrapped
        outs = _unwrap_all(sub, outs)
        if fix_outs is not None:
            outs = fix_outs(outs)
        out_leaves, out_tree = jax.tree_util.tree_flatten(outs)
        out_tree_box.append(out_tree)
        return out_leaves

    events: list = []
    with _recording(events), set_current_trace(trace.parent_trace):
        jaxpr, out_avals, consts = trace_to_jaxpr_dynamic(
            wrap_init(flat_body, debug_info=make_debug_info(name)), list(in_avals)
        )
    traced = TracedBody(ClosedJaxpr(jaxpr, consts), out_tree_box[-1], events, out_avals)
    return traced, flat_in


def _jaxpr_body(closed: ClosedJaxpr) -> Callable[[list], list]:
    def body(wrapped):
        return eval_jaxpr(closed.jaxpr, closed.consts, *wrapped)

    return body


def _hoisted(traced: TracedBody) -> tuple[ClosedJaxpr, list]:
    """The body with its constants turned into leading inputs, and those constants.

    Loops take their constants as operands: constants that are tracers of an outer
    transformation (e.g. `grad`) then keep their derivatives.
    """
    jaxpr = traced.jaxpr
    return ClosedJaxpr(convert_constvars_jaxpr(jaxpr.jaxpr), ()), list(jaxpr.consts)


# Re-traced bodies, per original jaxpr, per input structure and handler generation.
# Values never hold tracers (checked by `TracedBody.cacheable`).
_body_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cache_lookup(anchor: Any, key: tuple) -> Any:
    return _body_cache.get(anchor, {}).get((*key, _dispatch.generation[0]))


def _cache_store(anchor: Any, key: tuple, value: Any, traced: Sequence[TracedBody]) -> None:
    if all(t.cacheable for t in traced):
        _body_cache.setdefault(anchor, {})[(*key, _dispatch.generation[0])] = value


def _signature(flat_in: Sequence, in_tree: Any) -> tuple:
    return (in_tree, tuple(typeof(x) for x in flat_in))


# ----------------------------------------------------------------------------------------
# Common structure of several trees


def _aval(x: Any) -> Any:
    if isinstance(x, ShapedArray):
        return x
    return typeof(x)


def _same_type(items: Sequence) -> bool:
    """Whether `items` (dense leaves or implicit arrays) have one shape and dtype."""
    first = items[0]
    shape, dtype = tuple(np.shape(first) if not hasattr(first, "shape") else first.shape), (
        first.dtype if hasattr(first, "dtype") else _aval(first).dtype
    )
    for x in items[1:]:
        x_shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        x_dtype = x.dtype if hasattr(x, "dtype") else _aval(x).dtype
        if x_shape != shape or x_dtype != dtype:
            return False
    return True


def _reconcile(group: Sequence, path: tuple, paths: set) -> bool:
    """Mark in `paths` what must be materialized for `group` to share one structure.

    `group` holds the values found at one position of every tree. Returns False if even
    the dense versions differ in shape or dtype (the enclosing implicit array, if any,
    must then be materialized).
    """
    implicit = [is_implicit(x) for x in group]
    if not any(implicit):
        return _same_type(group)
    if all(implicit) and len({type(x) for x in group}) == 1:
        opened = [flatten_one_implicit_layer(x) for x in group]
        treedef = opened[0][1]
        if all(t == treedef for _, t in opened[1:]):
            children = [leaves for leaves, _ in opened]
            if all(
                [
                    _reconcile(list(child_group), (*path, i), paths)
                    for i, child_group in enumerate(zip(*children))
                ]
            ):
                return True
    paths.add(path)
    return _same_type(group)


def common_structure_paths(trees: Sequence) -> frozenset:
    """The positions at which `trees` must be materialized to share one structure.

    A position is a tuple of indices: the first indexes the leaves of
    `tree_flatten_with_implicit(tree)`, the next ones the children of an implicit array
    (one layer, as `flatten_one_implicit_layer` opens it).

    Raises:
      ValueError: if the trees differ even once fully materialized.
    """
    flat = [tree_flatten_with_implicit(t) for t in trees]
    structure = flat[0][1]
    for i, (_, other) in enumerate(flat[1:], 1):
        if other != structure:
            raise ValueError(
                "These trees do not have the same structure even after materializing "
                f"their implicit arrays: tree 0 is {structure}, tree {i} is {other}."
            )
    paths: set = set()
    for i, group in enumerate(zip(*(leaves for leaves, _ in flat))):
        if not _reconcile(list(group), (i,), paths):
            described = ", ".join(_describe(x) for x in group)
            raise ValueError(
                f"Leaf {i} has different shapes or dtypes in these trees ({described}), "
                "so no materialization can give them a common structure."
            )
    return frozenset(paths)


def _describe(x: Any) -> str:
    if is_implicit(x):
        return f"{type(x).__name__}{list(x.shape)}:{np.dtype(x.dtype).name}"
    return _aval(x).str_short()


def materialize_at(tree: Any, paths: frozenset, densify: Callable[[Any, tuple], Any]) -> Any:
    """Replace the implicit arrays at `paths` in `tree` by `densify(value, path)`."""
    if not paths:
        return tree
    prefixes = {p[:n] for p in paths for n in range(1, len(p))}
    leaves, treedef = tree_flatten_with_implicit(tree)

    def visit(x: Any, path: tuple) -> Any:
        if not is_implicit(x):
            return x
        if path in paths:
            return densify(x, path)
        if path not in prefixes:
            return x
        children, layer = flatten_one_implicit_layer(x)
        new = [visit(c, (*path, i)) for i, c in enumerate(children)]
        return jax.tree_util.tree_unflatten(layer, new)

    return jax.tree_util.tree_unflatten(
        treedef, [visit(x, (i,)) for i, x in enumerate(leaves)]
    )


def get_common_prefix_transforms(trees: Sequence) -> list[Callable[[Any], Any]]:
    """Functions that bring each of `trees` to their largest common structure.

    The trees must be equal once every implicit array in them is materialized (same
    pytree structure, same shapes and dtypes). Where they differ (an implicit array in
    one, a dense array or another implicit type in the other, or the same type with
    different metadata or leaf shapes), the implicit arrays are materialized; where they
    agree they stay implicit, also inside nested implicit arrays.

    >>> a = [Zeros(shape=(3,)), jnp.ones(3)]
    >>> b = [Zeros(shape=(3,)), Zeros(shape=(3,))]
    >>> fa, fb = qax.utils.get_common_prefix_transforms([a, b])
    >>> fb(b)  # [Zeros(shape=(3,)), Array([0., 0., 0.])]

    Args:
      trees: pytrees in which implicit arrays may appear.

    Returns:
      One function per tree, mapping a tree of that structure to the common structure.

    Raises:
      ValueError: if the trees differ even once fully materialized.
    """
    trees = list(trees)
    if len(trees) <= 1:
        return [lambda x: x for _ in trees]
    paths = common_structure_paths(trees)

    def transform(tree: Any) -> Any:
        return materialize_at(tree, paths, lambda x, _: materialize_nested(x, full=True))

    return [transform for _ in trees]


# ----------------------------------------------------------------------------------------
# Materializing with a reason


def _densify(value: ImplicitBase, primitive: str, reason: str | None) -> Any:
    """Report and fully materialize `value`; runs with the value's own trace current."""
    if not quiet_materialization.get():
        report(
            MaterializationEvent(
                primitive, type(value), tuple(value.shape), value.dtype,
                user_source_line(), reason,
            )
        )
    return materialize_nested(value, full=True)


def _densify_parent(trace: ImplicitTrace, value: Any, primitive: str, reason=None) -> Any:
    """`_densify` for a parent-level value, from inside a rule."""
    if not isinstance(value, ImplicitBase):
        return value
    with set_current_trace(trace.parent_trace):
        return _densify(value, primitive, reason)


def _path_name(path: tuple) -> str:
    return "".join(f"[{i}]" for i in path)


# ----------------------------------------------------------------------------------------
# jit


def _per_leaf(values: Sequence, per_value: Sequence, leaf_param: Callable) -> tuple:
    """Expand a per-operand parameter to one entry per flat leaf.

    `leaf_param(param, value, leaf)` gives the entry for one leaf of an implicit value.
    """
    out = []
    for v, p in zip(values, per_value):
        if isinstance(v, ImplicitBase):
            out.extend(leaf_param(p, v, leaf) for leaf in jax.tree_util.tree_leaves(v))
        else:
            out.append(p)
    return tuple(out)


def _const(default: Any) -> Callable:
    return lambda _p, _v, _leaf: default


def _spec_fits(spec: Any, value: ImplicitBase, leaf: Any) -> bool:
    """Whether a leaf can take the partition `spec` meant for the represented array.

    It can when every partitioned dimension exists in the leaf with the size it has in
    the represented array (the leaf is laid out like the array along those
    dimensions, as the witness leaf always is).
    """
    shape = np.shape(leaf) if not hasattr(leaf, "shape") else tuple(leaf.shape)
    if len(spec) > len(shape):
        return False
    for d, axes in enumerate(spec):
        if axes is not None and (d >= len(value.shape) or shape[d] != value.shape[d]):
            return False
    return True


def _leaf_sharding(sharding: Any, value: ImplicitBase, leaf: Any, fallback: Any) -> Any:
    """The sharding a leaf of `value` gets when `value` is given `sharding`.

    Like JAX does for a pytree given one sharding, each leaf gets the same sharding;
    a leaf that cannot be partitioned that way (a LoRA factor whose dimensions do not
    match the represented array's) gets `fallback` instead.
    """
    if sharding is None or sharding is UNSPECIFIED:
        return sharding
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return sharding if _spec_fits(spec, value, leaf) else fallback
    if getattr(sharding, "is_fully_replicated", False):
        return sharding
    return fallback


def _jit_body(trace, closed, vals, name) -> tuple[TracedBody, list]:
    flat_in, in_tree = flatten_values(vals)
    key = _signature(flat_in, in_tree)
    hit = _cache_lookup(closed, key)
    if hit is not None:
        replay(hit.events)
        return hit, flat_in
    traced, flat_in = trace_body(trace, _jaxpr_body(closed), vals, name)
    _cache_store(closed, key, traced, [traced])
    return traced, flat_in


def _jit_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    closed = params["jaxpr"]
    if params.get("inline") and not is_eval_trace(trace.parent_trace):
        # The parent would inline this body anyway: interpret it in place.
        with set_current_trace(trace):
            outs = eval_jaxpr(closed.jaxpr, closed.consts, *map(trace.wrap, vals))
        return _unwrap_all(trace, outs)

    traced, flat_in = _jit_body(trace, closed, vals, params.get("name", "jit"))
    out_vals = jax.tree_util.tree_unflatten(traced.out_tree, traced.out_avals)

    def sharding(p, v, leaf):
        return _leaf_sharding(p, v, leaf, UNSPECIFIED)

    new_params = dict(
        params,
        jaxpr=traced.jaxpr,
        donated_invars=_per_leaf(vals, params["donated_invars"], _const(False)),
        in_shardings=_per_leaf(vals, params["in_shardings"], sharding),
        in_layouts=_per_leaf(vals, params["in_layouts"], _const(None)),
        out_shardings=_per_leaf(out_vals, params["out_shardings"], sharding),
        out_layouts=_per_leaf(out_vals, params["out_layouts"], _const(None)),
    )
    outs = bind_with_trace(trace.parent_trace, primitive, flat_in, new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


# ----------------------------------------------------------------------------------------
# cond / switch

_COND_REASON = (
    "The branches of a `lax.cond`/`lax.switch` return different implicit structures "
    "for output {path} ({described}); this {cls} is materialized so that all branches "
    "return the same structure."
)


def _cond_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    index, *ops = vals
    index = _densify_parent(trace, index, primitive.name)
    branches = params["branches"]
    flat_in, in_tree = flatten_values(ops)
    key = _signature(flat_in, in_tree)
    plan = _cache_lookup(branches[0], (branches, *key))
    if plan is None:
        plan = _plan_cond(trace, branches, ops)
        _cache_store(branches[0], (branches, *key), plan, plan.traced)
    else:
        replay(plan.events)
    jaxprs, consts = plan.jaxprs, plan.consts
    outs = bind_with_trace(
        trace.parent_trace,
        primitive,
        [index, *consts, *flat_in],
        dict(params, branches=tuple(jaxprs)),
    )
    return jax.tree_util.tree_unflatten(plan.traced[0].out_tree, outs)


@dataclasses.dataclass
class _CondPlan:
    traced: list
    jaxprs: list
    consts: list
    events: list


def _plan_cond(trace, branches, ops) -> _CondPlan:
    traced = [
        trace_body(trace, _jaxpr_body(b), ops, f"branch{i}")[0] for i, b in enumerate(branches)
    ]
    events = [e for t in traced for e in t.events]
    skeletons = [t.out_skeleton() for t in traced]
    paths = common_structure_paths(skeletons)
    if paths:
        held: list = []
        with holding_reports(held):
            for i, branch in enumerate(branches):
                if _has_implicit_at(skeletons[i], paths):
                    fix = _cond_fix(paths, skeletons)
                    traced[i] = trace_body(
                        trace, _jaxpr_body(branch), ops, f"branch{i}", fix_outs=fix
                    )[0]
        new = [e for e in held if e not in events]
        replay(new)
        events += new
    out_trees = {t.out_tree for t in traced}
    avals = [[(a.shape, a.dtype) for a in t.out_avals] for t in traced]
    if len(out_trees) != 1 or any(a != avals[0] for a in avals[1:]):  # pragma: no cover
        raise AssertionError(f"cond branches still differ after reconciling: {avals}")
    split = [separate_consts(t.jaxpr) for t in traced]
    jaxprs, consts = merge_common_consts([j for j, _ in split], [c for _, c in split])
    return _CondPlan(traced, list(jaxprs), list(consts), events)


def _has_implicit_at(tree, paths) -> bool:
    found = []
    materialize_at(tree, paths, lambda x, p: found.append(p) or x)
    return bool(found)


def _cond_fix(paths, skeletons) -> Callable[[list], list]:
    def densify(x, path):
        described = " vs. ".join(
            _describe(_at_path(s, path)) if _at_path(s, path) is not None else "?"
            for s in skeletons
        )
        reason = _COND_REASON.format(
            path=_path_name(path), described=described, cls=type(x).__name__
        )
        return _densify(x, "cond", reason)

    return lambda outs: materialize_at(outs, paths, densify)


def _at_path(tree: Any, path: tuple) -> Any:
    leaves, _ = tree_flatten_with_implicit(tree)
    x = leaves[path[0]]
    for i in path[1:]:
        if not is_implicit(x):
            return x
        x = flatten_one_implicit_layer(x)[0][i]
    return x


# ----------------------------------------------------------------------------------------
# Loops: scan and while share the search for a stable carry structure

_CARRY_REASON = (
    "The carry {path} of a `{loop}` enters the loop as {before} but the loop body "
    "returns {after}; implicit arrays in a carry must keep their structure across "
    "iterations, so this {cls} is materialized {where}."
)
_XS_REASON = (
    "`lax.scan` slices `xs` along its leading axis, but this {cls} has a leaf of shape "
    "{leaf_shape} that does not have the scanned length {length} as its leading "
    "dimension, so it is materialized before the loop."
)
_PRED_REASON = (
    "The predicate of a `lax.while_loop` must be a concrete boolean, but the loop's "
    "`cond_fun` returned an implicit {cls}; it is materialized."
)
_MAX_ATTEMPTS = 64


def _weak_fixes(in_avals: Sequence, out_avals: Sequence) -> tuple[set, set]:
    """Carry leaves whose weak type differs: (to strengthen in the init, in the body)."""
    init_side, body_side = set(), set()
    for i, (a, b) in enumerate(zip(in_avals, out_avals)):
        if a.weak_type and not b.weak_type:
            init_side.add(i)
        elif b.weak_type and not a.weak_type:
            body_side.add(i)
    return init_side, body_side


def _strengthen(leaves: list, which: set) -> list:
    return [
        jax.lax.convert_element_type(x, _aval(x).dtype) if i in which else x
        for i, x in enumerate(leaves)
    ]


@dataclasses.dataclass
class _LoopPlan:
    """How to run a loop body on implicit carries.

    `paths` and `weak_init` say how the initial carry is changed before the loop;
    `traced` is the body for the changed carry; `events` what staging it reported.
    """

    paths: frozenset
    weak_init: frozenset
    traced: TracedBody
    events: list


def _prepare_carry(trace, init: list, plan_paths, weak_init, loop: str, cls_info) -> list:
    """Apply a loop plan to the initial carry (at the parent level)."""

    def densify(x, path):
        before, after = cls_info.get(path, (_describe(x), "a different structure"))
        reason = _CARRY_REASON.format(
            path=_path_name(path), loop=loop, before=before, after=after,
            cls=type(x).__name__, where="before the loop",
        )
        return _densify_parent(trace, x, loop, reason)

    init = materialize_at(init, plan_paths, densify)
    if weak_init:
        leaves, tree = jax.tree_util.tree_flatten(init)
        with set_current_trace(trace.parent_trace):
            leaves = _strengthen(leaves, weak_init)
        init = jax.tree_util.tree_unflatten(tree, leaves)
    return init


def _plan_loop(
    trace: ImplicitTrace,
    body: Callable[[list], Sequence],
    consts: list,
    init: list,
    xs: list,
    slice_xs: Callable[[list], list],
    loop: str,
) -> tuple[_LoopPlan, list]:
    """Find the carry structure that the loop body preserves, and stage the body.

    The body is traced with the current carry structure. If the carry it returns has
    another structure (or another weak type), the differing parts are materialized, in
    the initial carry and in the body's output, and the body is traced again, until the
    structure is stable. Returns the plan and the (changed) initial carry.
    """
    n_carry = len(init)
    paths: frozenset = frozenset()
    weak_init: frozenset = frozenset()
    weak_body: frozenset = frozenset()
    described: dict = {}
    first_events: list | None = None
    held: list = []
    for _attempt in range(_MAX_ATTEMPTS):
        carry = _prepare_carry(trace, init, paths, weak_init, loop, described)
        in_vals = [*consts, *carry, *xs]
        flat_in, _ = flatten_values(in_vals)
        n_before_xs = len(flat_in) - len(flatten_values(xs)[0])
        in_avals = [typeof(x) for x in flat_in[:n_before_xs]]
        in_avals += slice_xs(flat_in[n_before_xs:])
        fix = _carry_fix(paths, weak_body, n_carry, loop, described)
        if first_events is None:
            traced, _ = trace_body(trace, body, in_vals, loop, in_avals=in_avals, fix_outs=fix)
            first_events = traced.events
        else:
            with holding_reports(held):
                traced, _ = trace_body(
                    trace, body, in_vals, loop, in_avals=in_avals, fix_outs=fix
                )
        out_skeleton = traced.out_skeleton()[:n_carry]
        in_skeleton = jax.tree_util.tree_map(_aval, carry)
        new_paths = common_structure_paths([in_skeleton, out_skeleton])
        n_const_leaves = len(flatten_values(consts)[0])
        n_carry_leaves = len(flatten_values(carry)[0])
        carry_in_avals = in_avals[n_const_leaves : n_const_leaves + n_carry_leaves]
        carry_out_avals = traced.out_avals[:n_carry_leaves]
        new_weak_init, new_weak_body = (set(), set())
        if not new_paths:
            new_weak_init, new_weak_body = _weak_fixes(carry_in_avals, carry_out_avals)
        if not new_paths and not new_weak_init and not new_weak_body:
            break
        for p in new_paths:
            described[p] = (
                _describe(_at_path(in_skeleton, p)),
                _describe(_at_path(out_skeleton, p)),
            )
        paths |= new_paths
        # Leaf indices refer to the carry of this attempt; a structure change re-numbers
        # them, so weak-type fixes are only collected once the structure is stable.
        weak_init |= new_weak_init
        weak_body |= new_weak_body
    else:  # pragma: no cover (each attempt materializes more, so this terminates)
        raise RuntimeError(f"Could not find a stable carry structure for `{loop}`.")
    new = [e for e in held if e not in first_events]
    replay(new)
    events = list(first_events) + new
    plan = _LoopPlan(paths, weak_init, traced, events)
    return plan, carry


def _carry_fix(paths, weak_body, n_carry, loop, described) -> Callable | None:
    if not paths and not weak_body:
        return None

    def densify(x, path):
        before, after = described.get(path, ("?", _describe(x)))
        reason = _CARRY_REASON.format(
            path=_path_name(path), loop=loop, before=before, after=after,
            cls=type(x).__name__, where="at the end of each iteration",
        )
        return _densify(x, loop, reason)

    def fix(outs):
        carry = materialize_at(list(outs[:n_carry]), paths, densify)
        if weak_body:
            leaves, tree = jax.tree_util.tree_flatten(carry)
            carry = jax.tree_util.tree_unflatten(tree, _strengthen(leaves, weak_body))
        return [*carry, *outs[n_carry:]]

    return fix


def _loop_key(consts, init, xs) -> tuple:
    flat, tree = flatten_values([*consts, *init, *xs])
    return (len(consts), len(init), *_signature(flat, tree))


def _loop_plan(trace, anchor, extra_key, body, consts, init, xs, slice_xs, loop):
    key = (*extra_key, *_loop_key(consts, init, xs))
    plan = _cache_lookup(anchor, key)
    if plan is not None:
        carry = _prepare_carry(trace, init, plan.paths, plan.weak_init, loop, {})
        replay(plan.events)
        return plan, carry
    plan, carry = _plan_loop(trace, body, consts, init, xs, slice_xs, loop)
    _cache_store(anchor, key, plan, [plan.traced])
    return plan, carry


def _check_scannable(trace, x: Any, length: int) -> Any:
    """Materialize an implicit `xs` whose leaves are not all stacked along axis 0."""
    if not isinstance(x, ImplicitBase):
        return x
    for leaf in jax.tree_util.tree_leaves(x):
        shape = np.shape(leaf)
        if not shape or shape[0] != length:
            reason = _XS_REASON.format(
                cls=type(x).__name__, leaf_shape=shape, length=length
            )
            return _densify_parent(trace, x, "scan", reason)
    return x


def _scan_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
    consts, init, xs = vals[:n_consts], vals[n_consts : n_consts + n_carry], vals[n_consts + n_carry :]
    xs = [_check_scannable(trace, x, length) for x in xs]
    closed = params["jaxpr"]

    def slice_xs(leaves):
        return [mapped_aval(length, 0, typeof(x)) for x in leaves]

    plan, carry = _loop_plan(
        trace, closed, (), _jaxpr_body(closed), consts, init, xs, slice_xs, "lax.scan"
    )
    jaxpr, hoisted = _hoisted(plan.traced)
    flat_consts = flatten_values(consts)[0]
    flat_carry = flatten_values(carry)[0]
    flat_xs = flatten_values(xs)[0]
    new_params = dict(
        params,
        jaxpr=jaxpr,
        num_consts=len(hoisted) + len(flat_consts),
        num_carry=len(flat_carry),
    )
    outs = bind_with_trace(
        trace.parent_trace,
        primitive,
        [*hoisted, *flat_consts, *flat_carry, *flat_xs],
        new_params,
    )
    return jax.tree_util.tree_unflatten(plan.traced.out_tree, outs)


def _while_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = vals[:n_cond]
    body_consts = vals[n_cond : n_cond + n_body]
    init = vals[n_cond + n_body :]
    body_jaxpr, cond_jaxpr = params["body_jaxpr"], params["cond_jaxpr"]
    plan, carry = _loop_plan(
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
    n_cond_vals = len(cond_consts)

    def predicate_fix(outs):
        (pred,) = outs
        if isinstance(pred, ImplicitBase):
            reason = _PRED_REASON.format(cls=type(pred).__name__)
            pred = _densify(pred, "while", reason)
        return [pred]

    cond_traced, cond_flat_in = trace_body(
        trace,
        lambda wrapped: _jaxpr_body(cond_jaxpr)(wrapped),
        [*cond_consts, *carry],
        "while_cond",
        fix_outs=predicate_fix,
    )
    del n_cond_vals
    body, body_hoisted = _hoisted(plan.traced)
    cond, cond_hoisted = _hoisted(cond_traced)
    flat_cond_consts = flatten_values(cond_consts)[0]
    flat_body_consts = flatten_values(body_consts)[0]
    flat_carry = flatten_values(carry)[0]
    new_params = dict(
        params,
        body_jaxpr=body,
        cond_jaxpr=cond,
        body_nconsts=len(body_hoisted) + len(flat_body_consts),
        cond_nconsts=len(cond_hoisted) + len(flat_cond_consts),
    )
    outs = bind_with_trace(
        trace.parent_trace,
        primitive,
        [
            *cond_hoisted, *flat_cond_consts,
            *body_hoisted, *flat_body_consts,
            *flat_carry,
        ],
        new_params,
    )
    return jax.tree_util.tree_unflatten(plan.traced.out_tree, outs)


# ----------------------------------------------------------------------------------------
# remat


def _remat_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    jaxpr = params["jaxpr"]  # an open Jaxpr without constvars
    flat_in, in_tree = flatten_values(vals)
    key = _signature(flat_in, in_tree)
    traced = _cache_lookup(jaxpr, key)
    if traced is None:

        def body(wrapped):
            return eval_jaxpr(jaxpr, (), *wrapped)

        traced, _ = trace_body(trace, body, vals, "checkpoint")
        _cache_store(jaxpr, key, traced, [traced])
    else:
        replay(traced.events)
    body_jaxpr, hoisted = _hoisted(traced)
    prevent_cse = params["prevent_cse"]
    if isinstance(prevent_cse, tuple):
        prevent_cse = (True,) * len(hoisted) + _per_leaf(
            vals, prevent_cse, lambda p, _v, _leaf: p
        )
    new_params = dict(params, jaxpr=body_jaxpr.jaxpr, prevent_cse=prevent_cse)
    outs = bind_with_trace(trace.parent_trace, primitive, [*hoisted, *flat_in], new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


# ----------------------------------------------------------------------------------------
# Call primitives and custom derivatives: the function is wrapped, not re-staged here


def _has_implicit(vals) -> bool:
    return any(isinstance(v, ImplicitBase) for v in vals)


class _OutInfo:
    """What the wrapped function and its rule agreed on about the outputs.

    Holds tree structures and flags only, never tracers.
    """

    def __init__(self):
        self.tree = None
        # Per output, once decided: (kept implicit, number of leaves, represented aval).
        self.outs = None
        self.res_tree = None

    @property
    def implicit(self) -> list | None:
        return None if self.outs is None else [keep for keep, _, _ in self.outs]

    def decide(self, outs: list) -> None:
        self.tree = jax.tree_util.tree_structure(outs)
        self.outs = [
            (isinstance(o, ImplicitBase), len(jax.tree_util.tree_leaves(o)), _value_aval(o))
            for o in outs
        ]


def _value_aval(x: Any) -> Any:
    return x.aval if isinstance(x, ImplicitBase) else _aval(x)


_SETTLE_REASON = (
    "`{name}` has a custom derivative rule and was called on implicit arrays; its "
    "output {index} came out as an implicit {cls} that holds differentiable data, which "
    "the rule cannot give tangents for, so it is materialized."
)


def _differentiable(value: ImplicitBase) -> bool:
    for leaf in jax.tree_util.tree_leaves(value):
        aval = _aval(leaf)
        if np.prod(aval.shape, dtype=np.int64) > 0 and jax.numpy.issubdtype(
            aval.dtype, jax.numpy.inexact
        ):
            return True
    return False


def _settle(outs: list, name: str, quiet: bool) -> list:
    """Materialize the outputs of a custom-derivative function that must be dense.

    An implicit output without differentiable data (a symbolic zero, an integer-valued
    type) stays implicit: its tangent is zero, whatever the rule says. Any other
    implicit output is materialized, so that the custom rule's tangent for it applies.
    """
    settled = []
    for i, o in enumerate(outs):
        if isinstance(o, ImplicitBase) and _differentiable(o):
            reason = _SETTLE_REASON.format(name=name, index=i, cls=type(o).__name__)
            if quiet:
                o = materialize_nested(o, full=True)
            else:
                o = _densify(o, "custom_jvp_call", reason)
        settled.append(o)
    return settled


def _fun_name(fun) -> str:
    info = getattr(fun, "debug_info", None)
    return getattr(info, "func_name", None) or getattr(fun, "__name__", "function")


def _enter(tag, vals):
    sub = ImplicitTrace(current_trace(), tag)
    return sub, [sub.wrap(v) for v in vals]


def _implicit_fun(f, tag, in_tree, info: _OutInfo, settle_name: str | None, *leaves):
    """`f` (a function of the values) as a function of their flat leaves.

    With `settle_name`, outputs are settled as for a custom-derivative function.
    """
    vals = jax.tree_util.tree_unflatten(in_tree, leaves)
    sub, wrapped = _enter(tag, vals)
    with set_current_trace(sub):
        outs = f(*wrapped)
    del wrapped
    outs = _unwrap_all(sub, outs)
    if settle_name is not None:
        outs = _settle(outs, settle_name, quiet=False)
    info.decide(outs)
    return jax.tree_util.tree_leaves(outs)


def _instantiate(t: Any, aval: Any) -> Any:
    if isinstance(t, (SymbolicZero, Zero)):
        return _zeros(aval.to_tangent_aval())
    return t


def _zeros(aval: Any) -> Any:
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, jax.dtypes.float0)
    return jax.numpy.zeros(aval.shape, aval.dtype)


def _dense_tangent(value: ImplicitBase, leaves: list, tangents: list) -> Any:
    """The tangent of `value.materialize()` given tangents of its leaves."""
    tree = jax.tree_util.tree_structure(value)

    def dense(*ls):
        return materialize_nested(jax.tree_util.tree_unflatten(tree, ls), full=True)

    token = quiet_materialization.set(True)
    try:
        _, tangent = jax.jvp(dense, tuple(leaves), tuple(tangents))
    finally:
        quiet_materialization.reset(token)
    return tangent


def _split_by_value(vals: list, leaves: Sequence) -> list[list]:
    """Group flat `leaves` (one per leaf of `vals`) by the value they belong to."""
    groups, i = [], 0
    for v in vals:
        n = len(jax.tree_util.tree_leaves(v)) if isinstance(v, ImplicitBase) else 1
        groups.append(list(leaves[i : i + n]))
        i += n
    return groups


def _dense_value(x: Any) -> Any:
    """Quietly materialize a value computed a second time (already reported once)."""
    if isinstance(x, ImplicitBase):
        token = quiet_materialization.set(True)
        try:
            return materialize_nested(x, full=True)
        finally:
            quiet_materialization.reset(token)
    return x


def _implicit_jvp(f, tag, in_tree, info: _OutInfo, name: str, symbolic_zeros, *args):
    """The custom JVP rule `f`, as a rule over the flat leaves of implicit values."""
    n = len(args) // 2
    primal_leaves, tangent_leaves = list(args[:n]), list(args[n:])
    vals = jax.tree_util.tree_unflatten(in_tree, primal_leaves)
    tangents = []
    for v, ls, ts in zip(
        vals, _split_by_value(vals, primal_leaves), _split_by_value(vals, tangent_leaves)
    ):
        if not isinstance(v, ImplicitBase):
            tangents.append(ts[0])
        elif symbolic_zeros and all(isinstance(t, SymbolicZero) for t in ts):
            tangents.append(SymbolicZero(v.aval.to_tangent_aval()))
        else:
            ts = [_instantiate(t, _aval(leaf)) for t, leaf in zip(ts, ls)]
            tangents.append(_dense_tangent(v, ls, ts))
    sub, wrapped = _enter(tag, vals)
    with set_current_trace(sub):
        outs = f(*wrapped, *tangents)
    del wrapped
    outs = _unwrap_all(sub, outs)
    m = len(outs) // 2
    primals_out, tangents_out = outs[:m], outs[m:]
    if info.outs is None:  # the function itself was not run: this rule decides
        primals_out = _settle(primals_out, name, quiet=False)
        info.decide(primals_out)
    out_primal_leaves, out_tangent_leaves = [], []
    for keep, p, t in zip(info.implicit, primals_out, tangents_out):
        if keep:
            if not isinstance(p, ImplicitBase):
                raise TypeError(
                    f"The custom JVP rule of `{name}` returned a dense primal output "
                    f"where `{name}` itself returned an implicit {type(p).__name__}; "
                    "make the rule compute its primal output by calling the function."
                )
            leaves = jax.tree_util.tree_leaves(p)
            out_primal_leaves += leaves
            out_tangent_leaves += [_zeros(_aval(leaf).to_tangent_aval()) for leaf in leaves]
        else:
            out_primal_leaves.append(_dense_value(p))
            out_tangent_leaves.append(t if isinstance(t, SymbolicZero) else _dense_value(t))
    return [*out_primal_leaves, *out_tangent_leaves]


def _custom_jvp_rule(trace, primitive, fun, jvp, vals, *, symbolic_zeros):
    if not _has_implicit(vals):
        params = dict(subfuns=(fun, jvp), symbolic_zeros=symbolic_zeros)
        return bind_with_trace(trace.parent_trace, primitive, vals, params)
    flat_in, in_tree = flatten_values(vals)
    name = _fun_name(fun)
    info = _OutInfo()
    fun2 = transformation2(_implicit_fun, fun, trace.tag, in_tree, info, name)
    jvp2 = transformation2(_implicit_jvp, jvp, trace.tag, in_tree, info, name, symbolic_zeros)
    params = dict(subfuns=(fun2, jvp2), symbolic_zeros=symbolic_zeros)
    outs = bind_with_trace(trace.parent_trace, primitive, flat_in, params)
    return [trace.wrap(o) for o in jax.tree_util.tree_unflatten(info.tree, outs)]


def _implicit_fwd(f, tag, in_tree, info: _OutInfo, name, out_trees, *args):
    """The custom VJP forward rule `f`, over the flat leaves of implicit values.

    Its residuals are the original residuals (flattened) and the implicit inputs, whose
    leaves the backward rule needs to turn dense cotangents into leaf cotangents.
    """
    leaves, nonzeros = list(args[::2]), list(args[1::2])
    vals = jax.tree_util.tree_unflatten(in_tree, leaves)
    flags = [any(group) for group in _split_by_value(vals, nonzeros)]
    sub, wrapped = _enter(tag, vals)
    with set_current_trace(sub):
        outs = f(*[x for pair in zip(wrapped, flags) for x in pair])
    _, res_tree, input_fwds = out_trees()
    n_res_out = res_tree.num_leaves - sum(i is not None for i in input_fwds)
    res_out = iter(outs[:n_res_out])
    res = [next(res_out) if i is None else wrapped[i] for i in input_fwds]
    primals_out = outs[n_res_out:]
    del wrapped
    res, primals_out = _unwrap_all(sub, res), _unwrap_all(sub, primals_out)
    if info.outs is None:  # the function itself was not run: this rule decides
        primals_out = _settle(primals_out, name, quiet=False)
        info.decide(primals_out)
    else:
        primals_out = [
            p if keep else _dense_value(p) for keep, p in zip(info.implicit, primals_out)
        ]
    implicit_inputs = [v for v in vals if isinstance(v, ImplicitBase)]
    res_leaves, info.res_tree = jax.tree_util.tree_flatten((res, implicit_inputs))
    return [*res_leaves, *jax.tree_util.tree_leaves(primals_out)]


def _implicit_bwd(f, tag, in_implicit, info: _OutInfo, *args):
    """The custom VJP backward rule `f`, giving cotangents for the leaves of the inputs.

    A dense cotangent for an implicit input becomes cotangents for its leaves through
    the VJP of its `materialize()` at the input's leaves (kept as residuals).
    """
    n_res = info.res_tree.num_leaves
    res, implicit_inputs = jax.tree_util.tree_unflatten(info.res_tree, args[:n_res])
    ct_leaves = iter(args[n_res:])
    cts = []
    for keep, n_leaves, aval in info.outs:
        if keep:  # no differentiable data: its cotangent is zero
            for _ in range(n_leaves):
                next(ct_leaves)
            cts.append(_zeros(aval.to_tangent_aval()))
        else:
            cts.append(next(ct_leaves))
    sub, wrapped_res = _enter(tag, res)
    with set_current_trace(sub):
        cts_in = f(*wrapped_res, *cts)
    del wrapped_res
    cts_in = _unwrap_all(sub, cts_in)
    implicit_inputs = iter(implicit_inputs)
    out = []
    for is_implicit_input, ct in zip(in_implicit, cts_in):
        if not is_implicit_input:
            out.append(_dense_value(ct))
            continue
        value = next(implicit_inputs)
        if isinstance(ct, (Zero, SymbolicZero)):
            leaves = jax.tree_util.tree_leaves(value)
            out += [Zero(_aval(leaf).to_tangent_aval()) for leaf in leaves]
        else:
            out += _leaf_cotangents(value, _dense_value(ct))
    return out


def _leaf_cotangents(value: ImplicitBase, ct: Any) -> list:
    """Cotangents of the leaves of `value` given one of `value.materialize()`."""
    leaves, tree = jax.tree_util.tree_flatten(value)

    def dense(*ls):
        return materialize_nested(jax.tree_util.tree_unflatten(tree, ls), full=True)

    token = quiet_materialization.set(True)
    try:
        _, vjp = jax.vjp(dense, *leaves)
        return list(vjp(ct))
    finally:
        quiet_materialization.reset(token)


def _custom_vjp_rule(trace, primitive, fun, fwd, bwd, vals, *, out_trees, symbolic_zeros):
    if not _has_implicit(vals):
        params = dict(
            subfuns=(fun, fwd, bwd), out_trees=out_trees, symbolic_zeros=symbolic_zeros
        )
        return bind_with_trace(trace.parent_trace, primitive, vals, params)
    flat_in, in_tree = flatten_values(vals)
    name = _fun_name(fun)
    info = _OutInfo()
    fun2 = transformation2(_implicit_fun, fun, trace.tag, in_tree, info, name)
    fwd2 = transformation2(_implicit_fwd, fwd, trace.tag, in_tree, info, name, out_trees)
    in_implicit = tuple(isinstance(v, ImplicitBase) for v in vals)
    bwd2 = transformation2(_implicit_bwd, bwd, trace.tag, in_implicit, info)

    def out_trees2():
        return info.tree, info.res_tree, [None] * info.res_tree.num_leaves

    params = dict(subfuns=(fun2, fwd2, bwd2), out_trees=out_trees2, symbolic_zeros=symbolic_zeros)
    outs = bind_with_trace(trace.parent_trace, primitive, flat_in, params)
    return [trace.wrap(o) for o in jax.tree_util.tree_unflatten(info.tree, outs)]


def _call_rule(trace, primitive, f, vals, params):
    if not _has_implicit(vals):
        with set_current_trace(trace.parent_trace):
            return primitive.bind(f, *vals, **params)
    flat_in, in_tree = flatten_values(vals)
    info = _OutInfo()
    f2 = transformation2(_implicit_fun, f, trace.tag, in_tree, info, None)
    with set_current_trace(trace.parent_trace):
        outs = primitive.bind(*flat_in, subfuns=(f2,), **params)
    return [trace.wrap(o) for o in jax.tree_util.tree_unflatten(info.tree, outs)]


# ----------------------------------------------------------------------------------------
# shard_map

_SHARD_REASON = (
    "`shard_map` splits this {cls} with the partition spec {spec}, but its leaf of shape "
    "{leaf_shape} is not laid out like the array it represents ({shape}) along the "
    "partitioned dimensions, so it is materialized. Pass it replicated (`P()`) to keep "
    "it implicit."
)


def _fit_spec(value: Any, spec: Any, where: str) -> Any:
    """`value`, materialized if its leaves cannot all be partitioned by `spec`.

    Splitting an implicit array splits each of its leaves the same way, as JAX does for
    a pytree given one spec (and as `vmap` and `scan` slice every leaf).
    """
    if not isinstance(value, ImplicitBase):
        return value
    for leaf in jax.tree_util.tree_leaves(value):
        if not _spec_fits(spec, value, leaf):
            reason = _SHARD_REASON.format(
                cls=type(value).__name__, spec=spec, leaf_shape=np.shape(leaf),
                shape=tuple(value.shape),
            )
            del where
            return _densify(value, "shard_map", reason)
    return value


def _shard_map_rule(trace, primitive, fun, vals, params):
    if not _has_implicit(vals):
        with set_current_trace(trace.parent_trace):
            return primitive.bind(*vals, subfuns=(fun,), **params)
    with set_current_trace(trace.parent_trace):
        vals = [_fit_spec(v, s, "in") for v, s in zip(vals, params["in_specs"], strict=True)]
    flat_in, in_tree = flatten_values(vals)
    leaf_specs = _per_leaf(vals, params["in_specs"], lambda spec, _v, _leaf: spec)
    info = _OutInfo()

    def body(*leaves):
        sub, wrapped = _enter(trace.tag, jax.tree_util.tree_unflatten(in_tree, leaves))
        with set_current_trace(sub):
            out = fun(*wrapped)
        del wrapped
        ans, out_specs = out.unpack_aux()
        values = _unwrap_all(sub, list(ans.vals))
        values = [_fit_spec(v, s, "out") for v, s in zip(values, out_specs, strict=True)]
        info.decide(values)
        info.template = ans.update([None] * len(values))
        specs = _per_leaf(values, out_specs, lambda spec, _v, _leaf: spec)
        flat = jax.tree_util.tree_leaves(values)
        return FlatTree.flatten(tuple(flat)).with_aux(specs)

    new_params = dict(params, in_specs=leaf_specs)
    with set_current_trace(trace.parent_trace):
        out = primitive.bind(*flat_in, subfuns=(body,), **new_params)
    values = jax.tree_util.tree_unflatten(info.tree, list(out.vals))
    return info.template.update([trace.wrap(v) for v in values])


# ----------------------------------------------------------------------------------------
# Primitives that only annotate or move values: applied leaf by leaf


def _same(params: dict, _value: Any, _leaf: Any) -> dict:
    return params


def _pvary_params(params: dict, _value: Any, leaf: Any) -> dict | None:
    varying = _aval(leaf).mat.varying
    axes = tuple(a for a in params["axes"] if a not in varying)
    return dict(params, axes=axes) if axes else None


def _constraint_params(params: dict, value: Any, leaf: Any) -> dict | None:
    sharding = _leaf_sharding(params["sharding"], value, leaf, None)
    if sharding is None:
        return None
    layout = params.get("layout") if np.shape(leaf) == tuple(value.shape) else None
    return dict(params, sharding=sharding, layout=layout)


def _replicated_like(sharding: Any) -> Any:
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return sharding
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _device_put_entry(name: str) -> Callable:
    def entry(p: Any, value: Any, leaf: Any) -> Any:
        if name == "devices" and isinstance(p, jax.sharding.Sharding):
            return _leaf_sharding(p, value, leaf, _replicated_like(p))
        return p

    return entry


# Per-leaf parameters of the single-operand primitives (None: leave the leaf alone).
_SINGLE: dict = {
    jax.lax.stop_gradient_p: _same,
    jax.lax.copy_p: _same,
    primitives_module.name_p: _same,
    jax.lax.sharding_constraint_p: _constraint_params,
}
if pvary_p is not None:
    _SINGLE[pvary_p] = _pvary_params
# Per-operand tuple parameters of the multiple-operand primitives.
_MULTI: dict = {
    jax.lax.optimization_barrier_p: (),
    jax.lax.device_put_p: ("devices", "srcs", "copy_semantics"),
}


def _has_data(leaf: Any) -> bool:
    return np.prod(np.shape(leaf), dtype=np.int64) > 0


def _leafwise_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> Any:
    """Apply an annotating primitive to each leaf of the implicit operands.

    Leaves without data (the zero-size witness of an implicit array's shape) are
    passed through unchanged.
    """
    if primitive in _SINGLE:
        (value,) = vals
        leaves, tree = jax.tree_util.tree_flatten(value)
        out = []
        for leaf in leaves:
            leaf_params = _SINGLE[primitive](params, value, leaf) if _has_data(leaf) else None
            if leaf_params is None:
                out.append(leaf)
            else:
                out.append(bind_with_trace(trace.parent_trace, primitive, [leaf], leaf_params))
        return jax.tree_util.tree_unflatten(tree, out)

    flat, tree = flatten_values(vals)
    per_leaf = {
        name: _per_leaf(vals, params[name], _device_put_entry(name))
        for name in _MULTI[primitive]
    }
    keep = [i for i, leaf in enumerate(flat) if _has_data(leaf)]
    new_params = dict(params, **{n: tuple(p[i] for i in keep) for n, p in per_leaf.items()})
    results = bind_with_trace(trace.parent_trace, primitive, [flat[i] for i in keep], new_params)
    for i, r in zip(keep, results, strict=True):
        flat[i] = r
    return jax.tree_util.tree_unflatten(tree, flat)


structural_rules[primitives_module.jit_p] = _jit_rule
structural_rules[jax.lax.cond_p] = _cond_rule
structural_rules[jax.lax.scan_p] = _scan_rule
structural_rules[jax.lax.while_p] = _while_rule
structural_rules[primitives_module.remat_p] = _remat_rule
structural_rules[primitives_module.call_p] = _call_rule
structural_rules[primitives_module.closed_call_p] = _call_rule
structural_rules[primitives_module.custom_jvp_call_p] = _custom_jvp_rule
structural_rules[primitives_module.custom_vjp_call_p] = _custom_vjp_rule
if shard_map_p is not None:
    structural_rules[shard_map_p] = _shard_map_rule
for _primitive in (*_SINGLE, *_MULTI):
    structural_rules[_primitive] = _leafwise_rule
