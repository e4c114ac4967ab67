"""Rules for primitives that carry a function, and for those that only annotate values.

Higher-order primitives (`jit`, `cond`, `scan`, `while`, `remat2`) hold a body written
for dense arrays. Their rules re-trace that body with `trace_body`: the body runs under a
fresh `ImplicitTrace` on the implicit values and is staged into a new jaxpr over their
flat leaves; the primitive is then bound on the leaves. Implicit values thus cross the
primitive as their leaves and stay implicit, and handlers apply inside the body.

Where outputs must share one structure (the branches of a `cond`, the carry of a loop
before and after an iteration) they are brought to their largest common structure
(`qax._structure`): only the parts that differ are materialized, with a warning that
says why. None of these rules materializes anything otherwise.

Primitives whose function JAX hands over as a `WrappedFun` (`custom_jvp_call`,
`custom_vjp_call`, `call`/`closed_call`, `shard_map`) are rebound with that function
wrapped to take and return flat leaves; custom derivative rules are kept.

Primitives that only annotate or move a value (`pvary`, `sharding_constraint`, `name`,
`optimization_barrier`, `copy`, `device_put`, `stop_gradient`) are applied to the leaves
of an implicit operand, and the implicit array is rebuilt around the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from . import _dispatch
from ._base import NB, ImplicitBase, quiet_materialization
from ._batching import (
    slice_template,
    stack_like,
    stackable,
    undeclared_reason,
    with_sliceable_parts,
)
from ._compat import (
    CALL_JAXPR_P,
    CALL_PRIMITIVES,
    UNSPECIFIED,
    ArrayImpl,
    ClosedJaxpr,
    SymbolicZero,
    Tracer,
    Zero,
    bind_with_trace,
    canonicalize_value,
    convert_constvars_jaxpr,
    current_trace,
    eval_context,
    eval_jaxpr,
    flatten_ft,
    forget_arg_names,
    is_inline_jit,
    jaxpr_as_fun,
    join_bwd_result,
    known_constant,
    make_debug_info,
    mapped_aval,
    may_run_rules_later,
    may_stage,
    merge_common_consts,
    primitives_module,
    pvary_p,
    scan_operand_counts,
    scan_params,
    separate_consts,
    set_current_trace,
    shard_map_p,
    split_bwd_result,
    trace_to_jaxpr_dynamic,
    transformation2,
    typeof,
    weakly_typed,
    wrap_init,
)
from ._eager import compile_jaxpr, sub_trace
from ._entry import densify, materialize_nested
from ._fields import rebuild
from ._interpreter import ImplicitTrace
from ._partition import Undeclared, child_specs, first_undeclared, leaf_specs
from ._report import holding_reports, recording, replay
from ._structure import common_structure_paths, describe, materialize_at, value_at

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

    The one re-tracing helper behind the rules of this module.

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
        wrapped = [sub.wrap(v) for v in jax.tree_util.tree_unflatten(in_tree, leaves)]
        with set_current_trace(sub):
            outs = body(wrapped)
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


# Re-traced bodies and plans, per original jaxpr, per input signature and handler
# generation. Nothing cached holds a tracer (see `TracedBody.cacheable`).
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(vals: Sequence, *extra: Any) -> tuple[tuple, list]:
    """The cache key of a body over `vals` (with `extra`), and their flat leaves."""
    flat, tree = flatten_values(vals)
    return (*extra, tree, tuple(map(_leaf_type, flat)), _dispatch.generation[0]), flat


def _leaf_type(x: Any) -> Any:
    """What determines `typeof(x)` (computed directly for eager arrays: cheaper)."""
    if type(x) is ArrayImpl:
        return x.aval, x.sharding
    return typeof(x)


def _cached(anchor: Any, key: tuple) -> Any:
    return _cache.get(anchor, {}).get(key)


def _store(anchor: Any, key: tuple, value: Any, bodies: Sequence[TracedBody]) -> None:
    if all(body.cacheable for body in bodies):
        _cache.setdefault(anchor, {})[key] = value


# ----------------------------------------------------------------------------------------
# Materializing, with a reason


# Report and fully materialize a value (its own trace must be current).
_densify = densify


def _densify_parent(trace: ImplicitTrace, value: Any, primitive: str, reason=None):
    """`_densify` for a parent-level value, from inside a rule."""
    if not isinstance(value, ImplicitBase):
        return value
    with set_current_trace(trace.parent_trace):
        return _densify(value, primitive, reason)


def _quiet_dense(x: Any) -> Any:
    """Materialize a value again, without reporting it (it was reported once)."""
    if not isinstance(x, ImplicitBase):
        return x
    token = quiet_materialization.set(True)
    try:
        return materialize_nested(x, full=True)
    finally:
        quiet_materialization.reset(token)


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


def _const(default: Any) -> Callable:
    """`default` for every leaf of a value, whatever its parameter."""
    return lambda _p, v: _same_for_all(default, v)


_UNDECLARED_SHARDING = (
    "{what}: {message}. Its leaves {fallback} (a sharding is never guessed from leaf "
    "shapes)."
)


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
            _UNDECLARED_SHARDING.format(
                what=what, message=missing.message, fallback=fate
            ),
            stacklevel=2,
        )
    return [
        fallback if isinstance(s, Undeclared) else sharding.update(spec=s)
        for s in specs
    ]


# ----------------------------------------------------------------------------------------
# jit


def _jit_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    """A nested `jit` on implicit operands: its body, re-traced once per signature.

    The body runs on the implicit values (so their handlers apply) and is staged over
    their leaves; the result is bound as a `jit` again, so the parent sees one cached
    unit (its differentiation, batching and compilation are cached by JAX too). `jnp`
    wrappers (``inline=True``) stay inline; called eagerly, they are compiled and
    dispatched through `jax.jit`'s fast path. Scalars with known values given to a
    `jnp` wrapper are baked into the body, where a traced program sees them as literals.
    """
    closed = params["jaxpr"]
    inline = is_inline_jit(params)
    baked = _scalar_literals(vals) if inline else {}
    dynamic = [v for i, v in enumerate(vals) if i not in baked]
    # Bytes, not values: 0.0 and -0.0 are equal but fold differently.
    scalars = tuple((i, np.asarray(v).tobytes(), typeof(v)) for i, v in baked.items())
    key, flat_dynamic = _signature(dynamic, "jit", scalars)
    entry = _cached(closed, key)
    fresh = entry is None
    if fresh:

        def body(wrapped):
            it = iter(wrapped)
            args = [baked[i] if i in baked else next(it) for i in range(len(vals))]
            return eval_jaxpr(closed.jaxpr, closed.consts, *args)

        declared = [a for i, a in enumerate(closed.in_avals) if i not in baked]
        traced, _ = trace_body(trace, body, dynamic, params["name"], declared=declared)
        entry = _JitEntry(traced)
        _store(closed, key, entry, [traced])
    else:
        replay(entry.traced.events)
    traced = entry.traced
    if inline and trace.eager and not fresh:
        # Compiled on the second call of a signature: some `jnp` functions (`einsum`)
        # stage a new jaxpr per call, for which JAX's own path is cheaper.
        outs = entry.call(flat_dynamic)
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)

    out_vals = traced.out_skeleton()
    if baked:  # drop the baked operands' entries from the per-operand parameters
        kept = [i not in baked for i in range(len(vals))]
        per_operand = ("donated_invars", "in_shardings", "in_layouts")
        params = params | {
            n: tuple(itertools.compress(params[n], kept)) for n in per_operand
        }

    def sharding(p, value):
        return _leaf_shardings(p, value, UNSPECIFIED, "jit shardings")

    new_params = dict(
        params,
        jaxpr=traced.jaxpr,
        donated_invars=_per_leaf(dynamic, params["donated_invars"], _const(False)),
        in_shardings=_per_leaf(dynamic, params["in_shardings"], sharding),
        in_layouts=_per_leaf(dynamic, params["in_layouts"], _const(None)),
        out_shardings=_per_leaf(out_vals, params["out_shardings"], sharding),
        out_layouts=_per_leaf(out_vals, params["out_layouts"], _const(None)),
    )
    outs = bind_with_trace(trace.parent_trace, primitive, flat_dynamic, new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


class _JitEntry:
    """A cached re-traced jit body, and (for eager calls) its compiled form."""

    def __init__(self, traced: TracedBody):
        self.traced = traced
        self._compiled = None

    def call(self, leaves: list) -> list:
        """Run the body eagerly on the flat `leaves`."""
        if self._compiled is None:
            closed = self.traced.jaxpr
            run = _forwarding(closed) or compile_jaxpr(closed)
            weak = [a.weak_type for a in closed.in_avals]
            if any(weak):  # the body was traced with weaker inputs than given

                def run(*leaves, _body=run):
                    return _body(*map(_weaken, leaves, weak))

            self._compiled = run
        return self._compiled(*leaves)


def _forwarding(closed: ClosedJaxpr) -> Callable | None:
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


def _weaken(x: Any, weak: bool) -> Any:
    """`x`, weakly typed if `weak` (as a body traced for a weak input sees it)."""
    aval = typeof(x)
    if not weak or aval.weak_type:
        return x
    with eval_context():  # (eagerly called: inside a `bind`, JAX > 0.10 has no trace)
        return weakly_typed(x)


def _scalar_literals(vals: Sequence) -> dict[int, Any]:
    """The scalar operands whose values are known now (concrete, or trace literals).

    A traced program sees them as literals, so baking them into a re-traced body keeps
    what handlers see (e.g. symbolic constants fold ``c * 2.0``).
    """
    found = {}
    for i, v in enumerate(vals):
        if (type(v) is ArrayImpl and v.ndim) or isinstance(v, ImplicitBase):
            continue
        try:
            aval = typeof(v)
        except TypeError:
            continue
        if aval.shape:
            continue
        if isinstance(v, Tracer):
            v = known_constant(v)
            if v is None:
                continue
        found[i] = canonicalize_value(v)
    return found


# ----------------------------------------------------------------------------------------
# cond and switch

_COND_REASON = (
    "The branches of a `lax.cond`/`lax.switch` return different implicit structures "
    "for output {path} ({described}); this {cls} is materialized so that every branch "
    "returns the same structure."
)


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
    key, flat_ops = _signature(ops, branches[1:])
    plan = _cached(branches[0], key)
    if plan is None:
        plan, traced = _plan_cond(trace, branches, ops)
        _store(branches[0], key, plan, traced)
    else:
        replay(plan.events)
    outs = bind_with_trace(
        trace.parent_trace,
        primitive,
        [index, *plan.consts, *flat_ops],
        dict(params, branches=plan.branches),
    )
    return jax.tree_util.tree_unflatten(plan.out_tree, outs)


def _plan_cond(trace: ImplicitTrace, branches: Sequence, ops: list):
    """Re-trace every branch, materializing outputs whose structures differ.

    Returns the plan and the staged branches.
    """
    traced = [
        trace_body(trace, _jaxpr_body(b), ops, f"branch{i}", declared=b.in_avals)[0]
        for i, b in enumerate(branches)
    ]
    events = [e for t in traced for e in t.events]
    skeletons = [t.out_skeleton() for t in traced]
    paths = common_structure_paths(skeletons)
    if paths:

        def densify(x, path):
            described = " vs. ".join(describe(value_at(s, path)) for s in skeletons)
            reason = _COND_REASON.format(
                path=_path_name(path), described=described, cls=type(x).__name__
            )
            return _densify(x, "cond", reason)

        def fix(outs):
            return materialize_at(outs, paths, densify)

        held: list = []
        with holding_reports(held):
            for i, branch in enumerate(branches):
                if any(
                    isinstance(value_at(skeletons[i], p), ImplicitBase) for p in paths
                ):
                    traced[i], _ = trace_body(
                        trace,
                        _jaxpr_body(branch),
                        ops,
                        f"branch{i}",
                        declared=branch.in_avals,
                        fix_outs=fix,
                    )
        new_events = [e for e in held if e not in events]
        replay(new_events)
        events += new_events
    split = [separate_consts(t.jaxpr) for t in traced]
    jaxprs, consts = merge_common_consts([j for j, _ in split], [c for _, c in split])
    return _CondPlan(traced[0].out_tree, tuple(jaxprs), list(consts), events), traced


# ----------------------------------------------------------------------------------------
# Loops: scan and while share the search for a carry structure that the body preserves

_CARRY_REASON = (
    "The carry {path} of a `{loop}` enters the loop as {before} but the loop body "
    "returns {after}; implicit arrays in a carry must keep their structure across "
    "iterations, so this {cls} is materialized {where}."
)
_PREDICATE_REASON = (
    "The predicate of a `lax.while_loop` must be a plain boolean, but its `cond_fun` "
    "returned an implicit {cls}, which is materialized."
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


def _carry_densifier(plan: _LoopPlan, loop: str, where: str, densify: Callable):
    def densify_path(x, path):
        before, after = plan.described.get(path, (describe(x), "another structure"))
        reason = _CARRY_REASON.format(
            path=_path_name(path),
            loop=loop,
            before=before,
            after=after,
            cls=type(x).__name__,
            where=where,
        )
        return densify(x, reason)

    return densify_path


def _prepare_carry(trace, init: list, plan: _LoopPlan, loop: str) -> list:
    """The initial carry changed as `plan` says (at the parent level)."""
    densify = _carry_densifier(
        plan,
        loop,
        "before the loop",
        lambda x, reason: _densify_parent(trace, x, loop, reason),
    )
    carry = materialize_at(init, plan.paths, densify)
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
    densify = _carry_densifier(
        plan,
        loop,
        "at the end of each iteration",
        lambda x, reason: _densify(x, loop, reason),
    )

    def fix(outs):
        carry = materialize_at(list(outs[:n_carry]), plan.paths, densify)
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
        held: list = []
        with holding_reports(held) if attempt else contextlib.nullcontext():
            carry = _prepare_carry(trace, init, plan, loop)
            in_vals = [*consts, *carry, *xs]
            flat_in = _leaves(in_vals)
            n_xs = len(_leaves(xs))
            in_avals = [*map(typeof, flat_in[: len(flat_in) - n_xs])]
            in_avals += slice_xs(flat_in[len(flat_in) - n_xs :])
            traced, _ = trace_body(
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
    replay([e for e in held if e not in first_events])
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
    key, _ = _signature([*consts, *init, *xs], len(consts), len(init), *extra_key)
    plan = _cached(anchor, key)
    if plan is not None:
        carry = _prepare_carry(trace, init, plan, loop)
        replay(plan.traced.events)
        return plan, carry
    plan, carry = _plan_loop(trace, body, consts, init, xs, slice_xs, loop, fix_ys)
    _store(anchor, key, plan, [plan.traced])
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
                y = _densify(y, "scan", reason)
            ys.append(y)
        return [*outs[:n_carry], *ys]

    return fix


def _scan_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    n_consts, n_carry = scan_operand_counts(params)
    length = params["length"]
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


def _while_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
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
            reason = _PREDICATE_REASON.format(cls=type(pred).__name__)
            pred = _densify(pred, "while", reason)
        return [pred]

    cond_traced, _ = trace_body(
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


# ----------------------------------------------------------------------------------------
# checkpoint / remat


def _remat_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> list:
    jaxpr = params["jaxpr"]  # an open Jaxpr without constvars
    key, flat_vals = _signature(vals)
    traced = _cached(jaxpr, key)
    if traced is None:

        def body(wrapped):
            return eval_jaxpr(jaxpr, (), *wrapped)

        declared = [v.aval for v in jaxpr.invars]
        traced, _ = trace_body(trace, body, vals, "checkpoint", declared=declared)
        _store(jaxpr, key, traced, [traced])
    else:
        replay(traced.events)
    body_jaxpr, hoisted = _hoisted(traced)
    prevent_cse = params["prevent_cse"]
    if isinstance(prevent_cse, tuple):
        per_leaf = _per_leaf(vals, prevent_cse, _same_for_all)
        prevent_cse = (True,) * len(hoisted) + per_leaf
    new_params = dict(params, jaxpr=body_jaxpr.jaxpr, prevent_cse=prevent_cse)
    operands = [*hoisted, *flat_vals]
    outs = bind_with_trace(trace.parent_trace, primitive, operands, new_params)
    return jax.tree_util.tree_unflatten(traced.out_tree, outs)


# ----------------------------------------------------------------------------------------
# Functions handed over as WrappedFuns: call, custom_jvp, custom_vjp
#
# These rules wrap the function (and its derivative rules) to work on flat leaves and
# rebind the primitive; the wrappers run later, maybe more than once, maybe not at
# all, depending on the parent trace. What they agree on about the outputs lives in an
# `_Outputs` record shared by the wrappers of one call.

_SETTLE_REASON = (
    "`{name}` has a custom derivative rule and was called on implicit arrays; its "
    "output {index} is an implicit {cls} holding differentiable data, for which the "
    "rule cannot give tangents, so it is materialized: it is differentiated here, or "
    "recorded (under `jit`, `checkpoint`, ...) in a program that JAX may differentiate "
    "later. Called outside such a transformation, the output stays implicit."
)


class _Outputs:
    """Output structure decided by whichever wrapper runs first (no tracers here)."""

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


def _has_implicit(vals: Sequence) -> bool:
    return any(isinstance(v, ImplicitBase) for v in vals)


def _fun_name(fun: Any) -> str:
    info = getattr(fun, "debug_info", None)
    return getattr(info, "func_name", None) or getattr(fun, "__name__", "function")


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


def _settle(outs: list, name: str, primitive: str) -> list:
    """Materialize the outputs of a custom-derivative function that must be dense.

    An implicit output without differentiable data (a symbolic zero) stays implicit:
    its tangent is zero, whatever the rule says. Any other implicit output is
    materialized, so that the rule's tangent for it applies.
    """
    settled = []
    for i, o in enumerate(outs):
        if isinstance(o, ImplicitBase) and _differentiable(o):
            reason = _SETTLE_REASON.format(name=name, index=i, cls=type(o).__name__)
            o = _densify(o, primitive, reason)
        settled.append(o)
    return settled


_KEPT_DIFFERENTIATED = (
    "`{name}` has a custom derivative rule and returned an implicit array holding "
    "differentiable data; it was kept implicit because no enclosing transformation "
    "could differentiate it, but JAX now differentiates it, and the rule cannot give "
    "tangents for an implicit output. This is a bug in qax: please report it."
)


def _decided_primal_leaves(info: _Outputs, primals_out: list, name: str) -> list:
    """Leaves of a rule's primal outputs, in the structure the function's outputs have."""
    if info.differentiable:
        raise RuntimeError(_KEPT_DIFFERENTIATED.format(name=name))
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


def _eval_jaxpr_rule(trace, primitive, vals, params):
    """An inlined call of a jaxpr (JAX > 0.11's `call_p`/`closed_call_p`): its body
    runs on the implicit values where it stands."""
    body = jaxpr_as_fun(params["call_jaxpr"])
    with set_current_trace(trace):
        outs = body(*map(trace.wrap, vals))
    return [trace.to_value(o) for o in outs]


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

    token = quiet_materialization.set(True)
    try:
        return transform(dense, leaves, *args)
    finally:
        quiet_materialization.reset(token)


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


def _per_value(vals: list, leaves: Sequence) -> list[list]:
    """Group flat `leaves` (one per leaf of `vals`) by the value they belong to."""
    groups, start = [], 0
    for v in vals:
        n = len(jax.tree_util.tree_leaves(v)) if isinstance(v, ImplicitBase) else 1
        groups.append(list(leaves[start : start + n]))
        start += n
    return groups


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


# ----------------------------------------------------------------------------------------
# shard_map

_SHARD_REASON = (
    "`shard_map` splits this {cls} by the partition spec {spec}: {message}; or pass it "
    "replicated (`P()`). It is materialized."
)


def _fit_spec(value: Any, spec: Any) -> Any:
    """`value`, materialized if its type does not declare how `spec` splits its leaves."""
    if not isinstance(value, ImplicitBase):
        return value
    missing = first_undeclared(leaf_specs(value, spec))
    if missing is None:
        return value
    reason = _SHARD_REASON.format(
        cls=type(value).__name__, spec=spec, message=missing.message
    )
    return _densify(value, "shard_map", reason)


def _split_specs(spec: Any, value: ImplicitBase) -> list:
    return leaf_specs(value, spec)


def _spec_sizes(spec: Any, mesh: Any) -> list[int]:
    """How many shards each dimension is split into by `spec` on `mesh`."""
    sizes = []
    for axes in spec:
        n = 1
        for name in (axes,) if isinstance(axes, str) else axes or ():
            n *= mesh.shape[name]
        sizes.append(n)
    return sizes


def _reshard(x: Any, spec: Any, mesh: Any, local: bool) -> Any:
    """`x` with the shape one shard sees (`local`), or the global shape again.

    Shard-map splits the leaves; the shapes that implicit arrays keep as metadata
    (theirs, and those of the implicit arrays their fields hold, split by the specs
    their types declare) are split here.
    """
    if not isinstance(x, ImplicitBase):
        return x
    sizes = _spec_sizes(spec, mesh)
    if len(sizes) > len(x.shape):
        return x
    shape = [
        d // n if local else d * n
        for d, n in zip(x.shape, sizes + [1] * (len(x.shape) - len(sizes)))
    ]
    children = {}
    for name, child_spec in child_specs(x, spec).items():
        child = x.__dict__[name]
        if isinstance(child, ImplicitBase) and not isinstance(child_spec, Undeclared):
            children[name] = _reshard(child, child_spec, mesh, local)
    return rebuild(x, children, tuple(shape), x.__dict__.get(NB, 0))


def _shard_map_rule(trace, primitive, fun, vals, params):
    if not _has_implicit(vals):
        with set_current_trace(trace.parent_trace):
            return primitive.bind(*vals, subfuns=(fun,), **params)
    mesh = params["mesh"]
    with set_current_trace(trace.parent_trace):
        vals = [_fit_spec(v, s) for v, s in zip(vals, params["in_specs"], strict=True)]
    local_vals = [
        _reshard(v, s, mesh, True)
        for v, s in zip(vals, params["in_specs"], strict=True)
    ]
    in_tree, info = jax.tree_util.tree_structure(local_vals), _Outputs()
    template = []
    specs_out = []

    def body(*leaves):
        sub, wrapped = _enter(trace.tag, jax.tree_util.tree_unflatten(in_tree, leaves))
        with set_current_trace(sub):
            ans, out_specs = fun(*wrapped).unpack_aux()
        del wrapped
        outs = _unwrap_all(sub, ans.vals)
        outs = [_fit_spec(v, s) for v, s in zip(outs, out_specs, strict=True)]
        info.decide(outs)
        template[:] = [ans.update([None] * len(outs))]
        specs_out[:] = list(out_specs)
        out_leaf_specs = _per_leaf(outs, out_specs, _split_specs)
        return flatten_ft(tuple(_leaves(outs))).with_aux(out_leaf_specs)

    new_params = dict(
        params,
        in_specs=_per_leaf(vals, params["in_specs"], _split_specs),
        debug_info=forget_arg_names(params.get("debug_info")),
    )
    with set_current_trace(trace.parent_trace):
        out = primitive.bind(*_leaves(vals), subfuns=(body,), **new_params)
    outs = jax.tree_util.tree_unflatten(info.tree, list(out.vals))
    outs = [_reshard(o, s, mesh, False) for o, s in zip(outs, specs_out, strict=True)]
    return template[0].update([trace.wrap(o) for o in outs])


# ----------------------------------------------------------------------------------------
# Primitives that only annotate or move values: applied leaf by leaf


def _pvary_params(params: dict, value: Any) -> list:
    out = []
    for leaf in jax.tree_util.tree_leaves(value):
        varying = typeof(leaf).mat.varying
        axes = tuple(a for a in params["axes"] if a not in varying)
        out.append(dict(params, axes=axes) if axes else None)
    return out


def _constraint_params(params: dict, value: Any) -> list:
    shardings = _leaf_shardings(
        params["sharding"], value, None, "with_sharding_constraint"
    )
    # A layout is the represented array's; it is kept only for a leaf declared to run
    # along all of the array's dimensions, in order.
    layout = params.get("layout")
    exact = _identity_leaves(value) if layout is not None else None
    return [
        None
        if s is None
        else dict(params, sharding=s, layout=layout if exact and exact[i] else None)
        for i, s in enumerate(shardings)
    ]


def _identity_leaves(value: ImplicitBase) -> list[bool]:
    """For each leaf of `value`: whether it is declared laid out like the array."""
    rank = len(value.shape)
    dims = leaf_specs(value, PartitionSpec(*[f"_{d}" for d in range(rank)]))
    return [
        isinstance(s, PartitionSpec) and tuple(s) == tuple(f"_{d}" for d in range(rank))
        for s in dims
    ]


def _device_put_entry(name: str) -> Callable:
    def entry(p: Any, value: Any) -> list:
        if name == "devices" and isinstance(p, jax.sharding.NamedSharding):
            replicated = jax.sharding.NamedSharding(
                p.mesh, jax.sharding.PartitionSpec()
            )
            return _leaf_shardings(p, value, replicated, "device_put")
        return _same_for_all(p, value)

    return entry


# Single-operand primitives: the params for one leaf (None: leave the leaf alone).
_SINGLE: dict = {
    jax.lax.stop_gradient_p: _same_for_all,
    jax.lax.copy_p: _same_for_all,
    primitives_module.name_p: _same_for_all,
    jax.lax.sharding_constraint_p: _constraint_params,
}
if pvary_p is not None:
    _SINGLE[pvary_p] = _pvary_params
# Multiple-operand primitives: their params that hold one entry per operand.
_MULTI: dict = {
    jax.lax.optimization_barrier_p: (),
    jax.lax.device_put_p: ("devices", "srcs", "copy_semantics"),
}


def _has_data(leaf: Any) -> bool:
    return np.size(leaf) > 0


def _leafwise_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> Any:
    """Apply an annotating primitive to the leaves of the implicit operands.

    Leaves without data (zero-size arrays) are passed through unchanged.
    """
    if primitive in _SINGLE:
        (value,) = vals
        leaves, tree = jax.tree_util.tree_flatten(value)
        out = []
        for leaf, leaf_params in zip(
            leaves, _SINGLE[primitive](params, value), strict=True
        ):
            if leaf_params is not None and _has_data(leaf):
                leaf = bind_with_trace(
                    trace.parent_trace, primitive, [leaf], leaf_params
                )
            out.append(leaf)
        return jax.tree_util.tree_unflatten(tree, out)

    flat, tree = flatten_values(vals)
    keep = [i for i, leaf in enumerate(flat) if _has_data(leaf)]
    new_params = dict(params)
    for name in _MULTI[primitive]:
        per_leaf = _per_leaf(vals, params[name], _device_put_entry(name))
        new_params[name] = tuple(per_leaf[i] for i in keep)
    results = bind_with_trace(
        trace.parent_trace, primitive, [flat[i] for i in keep], new_params
    )
    for i, result in zip(keep, results, strict=True):
        flat[i] = result
    return jax.tree_util.tree_unflatten(tree, flat)


# ----------------------------------------------------------------------------------------

_dispatch.primitive_rules[primitives_module.jit_p] = _jit_rule
_dispatch.primitive_rules[jax.lax.cond_p] = _cond_rule
_dispatch.primitive_rules[jax.lax.scan_p] = _scan_rule
_dispatch.primitive_rules[jax.lax.while_p] = _while_rule
_dispatch.primitive_rules[primitives_module.remat_p] = _remat_rule
for _primitive in CALL_PRIMITIVES:
    _dispatch.function_rules[_primitive] = _call_rule
if CALL_JAXPR_P is not None:
    _dispatch.primitive_rules[CALL_JAXPR_P] = _eval_jaxpr_rule
_dispatch.custom_jvp_rules[primitives_module.custom_jvp_call_p] = _custom_jvp_rule
_dispatch.custom_vjp_rules[primitives_module.custom_vjp_call_p] = _custom_vjp_rule
if shard_map_p is not None:
    _dispatch.function_rules[shard_map_p] = _shard_map_rule
for _primitive in (*_SINGLE, *_MULTI):
    _dispatch.primitive_rules[_primitive] = _leafwise_rule
