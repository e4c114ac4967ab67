"""Rules for `shard_map`, `all_gather` and the primitives that only annotate or move values.

`shard_map` splits the leaves of implicit operands by the specs their types declare
(`qax._partition`); an operand whose type does not declare how is materialized. Inside
it, `all_gather` of an implicit array gathers the leaves that run along the gathered
dimension, as stored (int8 codes stay int8), and keeps the others.
Annotating primitives (`pvary`, `sharding_constraint`, `name`, `optimization_barrier`,
`copy`, `device_put`, `stop_gradient`) are applied to the leaves of an implicit operand,
and the implicit array is rebuilt around the results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .. import _dispatch, _errors
from .._base import NB, ImplicitBase
from .._batching import stack_like
from .._compat import (
    bind_with_trace,
    flatten_ft,
    forget_arg_names,
    insert_collective_pvary,
    primitives_module,
    pvary_p,
    set_current_trace,
    shard_map_p,
    tracks_varying_axes,
    typeof,
    varying_axes,
)
from .._entry import densify
from .._fields import rebuild, stackable
from .._interpreter import ImplicitTrace, materialize_and_bind
from .._partition import Undeclared, child_specs, first_undeclared, leaf_specs
from ._staging import (
    _enter,
    _leaf_shardings,
    _leaves,
    _Outputs,
    _per_leaf,
    _same_for_all,
    _unwrap_all,
    flatten_values,
)

# ----------------------------------------------------------------------------------------
# shard_map


def _fit_spec(value: Any, spec: Any) -> Any:
    """`value`, materialized if its type does not declare how `spec` splits its leaves."""
    if not isinstance(value, ImplicitBase):
        return value
    missing = first_undeclared(leaf_specs(value, spec))
    if missing is None:
        return value
    reason = _errors.SHARD_MAP_SPLITS.format(
        cls=type(value).__name__, spec=spec, message=missing.message
    )
    return densify(value, "shard_map", reason)


def _spec_sizes(spec: Any, axis_sizes: Any) -> list[int]:
    """How many shards each dimension is split into by `spec` (`axis_sizes`: the size
    of each mesh axis by name)."""
    sizes = []
    for axes in spec:
        n = 1
        for name in (axes,) if isinstance(axes, str) else axes or ():
            n *= axis_sizes[name]
        sizes.append(n)
    return sizes


def _reshard(x: Any, spec: Any, axis_sizes: Any, local: bool) -> Any:
    """`x` with the shape one shard sees (`local`), or the global shape again.

    Shard-map splits the leaves (and `all_gather` joins them); the shapes that
    implicit arrays keep as metadata (theirs, and those of the implicit arrays their
    fields hold, split by the specs their types declare) are split (joined) here.
    """
    if not isinstance(x, ImplicitBase):
        return x
    sizes = _spec_sizes(spec, axis_sizes)
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
            children[name] = _reshard(child, child_spec, axis_sizes, local)
    return rebuild(x, children, tuple(shape), x.__dict__.get(NB, 0))


def _shard_map_rule(trace, primitive, fun, vals, params):
    # The body is interpreted even without implicit operands: it may close over this
    # call's implicit values (or build some around them), which JAX's own `shard_map`
    # trace cannot hold.
    mesh = params["mesh"]
    with set_current_trace(trace.parent_trace):
        vals = [_fit_spec(v, s) for v, s in zip(vals, params["in_specs"], strict=True)]
    local_vals = [
        _reshard(v, s, mesh.shape, True)
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
        out_leaf_specs = _per_leaf(outs, out_specs, lambda s, v: leaf_specs(v, s))
        return flatten_ft(tuple(_leaves(outs))).with_aux(out_leaf_specs)

    new_params = dict(
        params,
        in_specs=_per_leaf(vals, params["in_specs"], lambda s, v: leaf_specs(v, s)),
        debug_info=forget_arg_names(params.get("debug_info")),
    )
    with set_current_trace(trace.parent_trace):
        out = primitive.bind(*_leaves(vals), subfuns=(body,), **new_params)
    outs = jax.tree_util.tree_unflatten(info.tree, list(out.vals))
    outs = [
        _reshard(o, s, mesh.shape, False) for o, s in zip(outs, specs_out, strict=True)
    ]
    return template[0].update([trace.wrap(o) for o in outs])


if shard_map_p is not None:
    _dispatch.function_rules[shard_map_p] = _shard_map_rule


# ----------------------------------------------------------------------------------------
# all_gather inside shard_map: leaf by leaf, as the type declares

# Marks the gathered dimension in a spec, to find the leaf dimensions that run along it.
_GATHERED = "qax: gathered"


def _all_gather_rule(trace: ImplicitTrace, primitive, vals: list, params: dict) -> Any:
    """`all_gather` of an implicit array: each leaf gathered along its own dimension
    that runs along the gathered one (stacked on a new axis 0: every leaf stacked).

    Leaves that do not run along it are kept, which is right when they are the same on
    every device of the axis (`shard_map` tracks that with ``check_vma=True``, its
    default). Otherwise, and for a dimension a field declares nothing about, the value
    is materialized first (with the reason).
    """
    (x,) = vals
    gathered = _gather_leaves(trace, primitive, x, params)
    if isinstance(gathered, str):
        return materialize_and_bind(trace, primitive, vals, params, reason=gathered)
    return gathered


def _gather_leaves(trace: ImplicitTrace, primitive, x: ImplicitBase, params: dict):
    """The gathered implicit array, or why it cannot be gathered leaf by leaf."""
    axes = params["axis_name"]
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    dim, n = params["all_gather_dimension"], params["axis_size"]
    leaves, tree = jax.tree_util.tree_flatten(x)

    def gather(leaf, leaf_dim, tiled):
        with set_current_trace(trace.parent_trace):
            leaf = insert_collective_pvary(axes, leaf)
        leaf_params = dict(params, all_gather_dimension=leaf_dim, tiled=tiled)
        return bind_with_trace(trace.parent_trace, primitive, [leaf], leaf_params)

    if not params["tiled"]:  # a new axis
        if dim != 0 or not stackable(x):
            return _errors.ALL_GATHER_NEW_AXIS.format(cls=type(x).__name__, dim=dim)
        return stack_like(x, [gather(leaf, 0, False) for leaf in leaves], n)
    marked = PartitionSpec(*([None] * dim), _GATHERED)
    specs = leaf_specs(x, marked)
    missing = first_undeclared(specs)
    if missing is not None:
        return missing.message
    # Per leaf: the dimension to gather along, or None to keep it (checked first, so
    # that nothing is gathered for a value that is then materialized).
    plan = []
    for leaf, spec in zip(leaves, specs, strict=True):
        runs_along = [i for i, entry in enumerate(spec) if entry == _GATHERED]
        if len(runs_along) > 1:
            return _errors.ALL_GATHER_TWICE.format(
                cls=type(x).__name__, dim=dim, shape=tuple(leaf.shape)
            )
        if not runs_along:
            varying = varying_axes(typeof(leaf))
            if not tracks_varying_axes() or any(a in varying for a in axes):
                return _errors.ALL_GATHER_KEPT_LEAF.format(
                    cls=type(x).__name__, dim=dim, axes=axes, shape=tuple(leaf.shape)
                )
        plan.append(runs_along[0] if runs_along else None)
    out = [
        leaf if d is None else gather(leaf, d, True)
        for leaf, d in zip(leaves, plan, strict=True)
    ]
    return _reshard(tree.unflatten(out), marked, {_GATHERED: n}, local=False)


_dispatch.primitive_rules[jax.lax.all_gather_p] = _all_gather_rule


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


for _primitive in (*_SINGLE, *_MULTI):
    _dispatch.primitive_rules[_primitive] = _leafwise_rule
