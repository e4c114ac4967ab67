"""`vmap` and `scan` on implicit arrays: slicing and stacking them leaf by leaf.

The field schema (`qax._fields`) says how an implicit array's leaves carry leading batch
dimensions. A type that declares its batching (every child field has a declared `ndim`;
or it has no children, its shape living only in metadata, like a symbolic zero) is
registered with `vmap` and sliced or stacked leaf by leaf by `vmap` and `scan`; a part
that cannot be is materialized first, with a warning saying how to declare batching.
Nothing here is guessed from leaf shapes.

A type that declares nothing is not registered with `vmap`: `vmap` (outside
`use_implicit_args`, or on such a value built inside it) treats it as JAX treats any
pytree, as the original Qax did: every leaf is mapped along the `in_axes` entry, each
example is an instance rebuilt from the sliced leaves (its shape derived again), and an
instance returned from the mapped function comes out *stacked*: its leaves gain a
leading dimension. The ranks of its leaves in one example travel in its aux data
(`LeafRanks`), so that unflattening tells a stack from an example; a stack records them
(`STACKED`) and is sliced, scanned and materialized one example at a time along its
stacked dimensions. Its handlers, written for one example, never see a stack: inside
`use_implicit_args` it is materialized before a primitive reaches them. (Arguments of
`use_implicit_args` are tracers there, which `vmap` batches as the arrays they are.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _errors
from ._base import NB, STACKED, ImplicitBase, is_implicit
from ._compat import register_vmappable
from ._entry import densify, materialize_nested
from ._fields import (
    batchable,
    children_of,
    fields_of,
    rebuild,
    shape_only,
    with_batch_shape,
)
from ._report import quietly


def sliceable(x: ImplicitBase, axis: int) -> bool:
    """Whether `x` can be sliced along `axis` leaf by leaf."""
    fields = fields_of(type(x))
    if not fields.declared:  # only along the dimensions its leaves were stacked on
        return axis < (x.__dict__.get(NB) or 0)
    if not fields.children:
        return True
    return axis < x.__dict__.get(NB, 0)


def with_sliceable_parts(x: Any, axis: int, densify_part: Callable) -> Any:
    """`x` with each implicit part (itself, or an implicit array nested in it) that
    cannot be sliced along `axis` leaf by leaf replaced by `densify_part(part)`."""
    if not is_implicit(x):
        return x
    if not sliceable(x, axis):
        return densify_part(x)
    old = children_of(x)
    new = {
        n: _map_child(c, lambda y: with_sliceable_parts(y, axis, densify_part))
        for n, c in old.items()
    }
    if all(
        a is b
        for n in old
        for a, b in zip(
            jax.tree_util.tree_leaves(old[n], is_leaf=is_implicit),
            jax.tree_util.tree_leaves(new[n], is_leaf=is_implicit),
            strict=False,
        )
    ):
        return x
    return rebuild(x, new, x.shape, x.__dict__.get(NB, 0))


def _map_child(child: Any, fn: Callable[[Any], Any]) -> Any:
    """`fn` applied to each array leaf and each implicit array (whole) of a child."""
    if child is None:
        return None
    return jax.tree_util.tree_map(
        fn, child, is_leaf=lambda y: isinstance(y, ImplicitBase)
    )


def undeclared_reason(primitive: str, action: str, x: ImplicitBase, axis: int) -> str:
    """Why `x` cannot be sliced or stacked along `axis` leaf by leaf, and the fix: the
    type's own `batch_axes_advice` (for its users) if it gives one, else how to declare
    batch axes."""
    cls = type(x)
    declared = batchable(cls) or bool(x.__dict__.get(NB))
    advice = getattr(cls, "batch_axes_advice", None)
    if advice:
        nb = x.__dict__.get(NB) or 0
        why = (
            _errors.NOT_ONE_OF_THE_BATCH_AXES.format(cls=cls.__name__, nb=nb, axis=axis)
            if declared
            else "its type does not declare how its fields carry batch axes"
        )
        return _errors.BATCH_AXIS_WITH_ADVICE.format(
            primitive=primitive,
            action=action,
            cls=cls.__name__,
            axis=axis,
            why=why,
            advice=advice,
        )
    if declared:
        return _errors.NOT_A_BATCH_AXIS.format(
            primitive=primitive,
            action=action,
            cls=cls.__name__,
            axis=axis,
            nb=x.__dict__.get(NB) or 0,
        )
    why = "its type does not declare how its fields carry batch axes"
    return _errors.UNDECLARED_BATCH_AXES.format(
        primitive=primitive, action=action, cls=cls.__name__, axis=axis, why=why
    )


# ----------------------------------------------------------------------------------------
# vmap: implicit arrays are "vmappable" types, sliced and stacked as their type declares


def _to_elt(cont: Callable, get_idx: Callable, x: ImplicitBase, spec: Any) -> Any:
    """The per-example value of `x` mapped along axis `spec` (a `vmap` input)."""
    if spec is None:
        return x
    axis = _canonical_axis(spec, len(x.shape), x)
    if not sliceable(x, axis):
        return cont(
            densify(x, "vmap", undeclared_reason("vmap", "maps", x, axis)), axis
        )
    children = {
        n: _map_child(c, lambda y: _child_to_elt(cont, y, axis))
        for n, c in children_of(x).items()
    }
    shape = x.shape[:axis] + x.shape[axis + 1 :]
    nb = max(x.__dict__.get(NB, 0) - 1, 0)
    return rebuild(x, children, shape, nb)


def _from_elt(cont: Callable, axis_size: int, x: ImplicitBase, spec: Any) -> Any:
    """The batched value of a per-example output `x`, batched along axis `spec`."""
    if spec is None:
        children = {
            n: _map_child(c, lambda y: _child_from_elt(cont, axis_size, y, None))
            for n, c in children_of(x).items()
        }
        return rebuild(x, children, x.shape, x.__dict__.get(NB, 0))
    axis = _canonical_axis(spec, len(x.shape) + 1, x)
    fields = fields_of(type(x))
    nb = x.__dict__.get(NB, 0)
    if not fields.declared or (fields.children and axis > nb):
        reason = undeclared_reason("vmap", "stacks its outputs of type", x, axis)
        return cont(axis_size, densify(x, "vmap", reason), axis)
    children = {
        n: _map_child(c, lambda y: _child_from_elt(cont, axis_size, y, axis))
        for n, c in children_of(x).items()
    }
    shape = (*x.shape[:axis], axis_size, *x.shape[axis:])
    return rebuild(x, children, shape, nb + 1 if fields.children else 0)


# ----------------------------------------------------------------------------------------
# Types that declare nothing: JAX's pytree meaning, with the batch read off the leaves


class LeafRanks(tuple):
    """The ranks of a value's leaves in one example, kept in its pytree aux data.

    They are read off the leaves, so they tell two tree structures apart no more than
    the leaves' shapes do: all `LeafRanks` compare equal. A tree of masks or `float0`
    gradients (leaves of other ranks) therefore has the value's tree structure.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LeafRanks)

    def __ne__(self, other: object) -> bool:
        return not isinstance(other, LeafRanks)

    def __hash__(self) -> int:
        return 0


def leaf_ranks(children: list) -> LeafRanks:
    """The rank of each leaf of `children` (implicit arrays whole), in order."""
    ranks = []
    for child in children:
        shape = getattr(child, "shape", None)
        if shape is not None:
            ranks.append(len(shape))
            continue
        # A leaf without a shape has rank 0: a Python scalar, or what a tree shaped
        # like the value holds in place of an array (a `PartitionSpec` of
        # `qax.sharding.implicit_specs`, a sharding), which `np.ndim` may not read.
        for leaf in jax.tree_util.tree_leaves(child, is_leaf=is_implicit):
            shape = getattr(leaf, "shape", None)
            ranks.append(len(shape) if shape is not None else 0)
    return LeafRanks(ranks)


def undeclared_layout(obj: ImplicitBase, children: list, ranks: tuple) -> None:
    """Shape and batch dimensions of `obj`, of a type that declares nothing, rebuilt by
    a pytree unflattening from `children` whose leaves had the per-example `ranks`.

    Leaves with the same extra leading dimensions: a stack of examples (`vmap`'s output,
    `jnp.stack` over a `tree_map`), or a stack sliced along its stacked dimensions (a
    `lax.scan` row); the shape follows. Leaves sliced otherwise (`vmap`'s input, a
    `tree_map` indexing them): one new example, whose shape is derived as for a new
    instance (see `_example_shape`).
    """
    d = obj.__dict__
    shape, nb = d["shape"], d[NB]
    found = None
    example = False
    shaped = False  # an array leaf (not a nested implicit array) was seen
    shape_only_parts = []  # (field position, per-example rank): see `fit_shape_only`
    i = 0
    for k, child in enumerate(children):
        if shape_only(child) and i < len(ranks) and child.shape is not None:
            shape_only_parts.append((k, ranks[i]))
            i += 1
            continue
        shape_of = getattr(child, "shape", None)
        leaves = (
            (child,)
            if shape_of is not None
            else jax.tree_util.tree_leaves(child, is_leaf=is_implicit)
        )
        for leaf in leaves:
            leaf_shape = getattr(leaf, "shape", None)
            rank = ranks[i] if i < len(ranks) else None
            i += 1
            shaped = shaped or (leaf_shape is not None and not is_implicit(leaf))
            if leaf_shape is None or rank is None:
                continue
            n = len(leaf_shape) - rank
            if n < 0 or (found is not None and tuple(leaf_shape[:n]) != found):
                example = True
                break
            found = tuple(leaf_shape[:n])
        if example:
            break
    if not shaped and i != len(ranks):
        # Placeholders (JAX's `None` layouts, trees of specs or shardings): no array
        # to derive a layout from, and fewer leaves than recorded (`None` has none).
        return
    if example or i != len(ranks):
        d[NB] = 0
        d.pop(STACKED, None)
        d["shape"] = _example_shape(obj, shape)
        return
    if found is None or shape is None or nb is None:
        return  # placeholders (JAX unflattens trees of axes and sentinels)
    if shape_only_parts:
        _fit_shape_only_parts(obj, shape_only_parts, found)
    if len(found) != nb or shape[:nb] != found:
        d["shape"], d[NB] = (*found, *shape[nb:]), len(found)
    if d[NB]:
        d[STACKED] = ranks
    else:
        d.pop(STACKED, None)


def _fit_shape_only_parts(obj: ImplicitBase, parts: list, batch: tuple) -> None:
    """Give the shape-only children of `obj` (a symbolic constant under per-example
    factors: the same in every example) the batch shape of the leaves beside them,
    which a pytree map or `lax.scan` sliced or stacked without them."""
    d = obj.__dict__
    names = fields_of(type(obj)).children
    for k, rank in parts:
        fitted = with_batch_shape(d[names[k]], rank, batch)
        if fitted is not None:
            d[names[k]] = fitted


def _example_shape(obj: ImplicitBase, shape: Any) -> Any:
    """The shape of a new example `obj` built from pytree-sliced leaves.

    `compute_shape()` (or `default_shape`) if the type gives one; else the shape of
    `materialize()`, which sees the shape of the value that was sliced first (a type
    whose `materialize` fills `self.shape` keeps it, as in the original Qax) and that
    shape without its leading dimension second; else the shape of the value sliced.
    """
    compute = getattr(obj, "compute_shape", None)
    try:
        own = compute() if compute is not None else None
    except Exception:  # noqa: BLE001 (written for other fields: try materialize())
        own = None
    if own is not None:
        return tuple(int(d) for d in own)
    if shape is None:
        return None
    leaves = jax.tree_util.tree_leaves(
        [getattr(obj, n) for n in fields_of(type(obj)).children]
    )
    try:
        avals = tuple(_abstract(leaf) for leaf in leaves)
    except TypeError:
        return shape
    for candidate in (tuple(shape), tuple(shape[1:])):
        probe = rebuild(obj, {}, candidate, 0)
        found = _materialized_shape(jax.tree_util.tree_structure(probe), avals)
        if found is not None:
            return found
    return shape


def _abstract(leaf: Any) -> tuple:
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        aval = jax.typeof(leaf)
        shape, dtype = aval.shape, aval.dtype
    weak = bool(getattr(getattr(leaf, "aval", None), "weak_type", False))
    return (tuple(shape), np.dtype(dtype), weak)


@functools.lru_cache(maxsize=1024)
def _materialized_shape(tree: Any, avals: tuple) -> tuple | None:
    """The shape of `materialize()` of the value with treedef `tree` and leaves of
    `avals`, or None if it fails."""
    structs = [jax.ShapeDtypeStruct(s, d, weak_type=w) for s, d, w in avals]

    def run(*leaves):
        return materialize_nested(jax.tree_util.tree_unflatten(tree, leaves), full=True)

    try:
        with quietly():
            return tuple(jax.eval_shape(run, *structs).shape)
    except Exception:  # noqa: BLE001 (any failure means "not this shape")
        return None


def clear_caches() -> None:
    _materialized_shape.cache_clear()


def _child_to_elt(cont: Callable, y: Any, axis: int) -> Any:
    """`cont(y, axis)` for a part `y` of a declared value; a nested implicit array of a
    type that declares nothing is a pytree for `vmap`, sliced leaf by leaf only along
    the dimensions its leaves were stacked on."""
    if not is_implicit(y) or batchable(type(y)):
        return cont(y, axis)
    if sliceable(y, axis):
        return _map_parts(y, lambda part: _child_to_elt(cont, part, axis))
    return cont(densify(y, "vmap", undeclared_reason("vmap", "maps", y, axis)), axis)


def _child_from_elt(cont: Callable, axis_size: int, y: Any, axis: int | None) -> Any:
    """`cont(axis_size, y, axis)` for a part `y` of a declared value (see
    `_child_to_elt`)."""
    if not is_implicit(y) or batchable(type(y)):
        return cont(axis_size, y, axis)
    if axis is None or axis <= (y.__dict__.get(NB) or 0):
        return _map_parts(y, lambda part: _child_from_elt(cont, axis_size, part, axis))
    reason = undeclared_reason("vmap", "stacks its outputs of type", y, axis)
    return cont(axis_size, densify(y, "vmap", reason), axis)


def _map_parts(y: ImplicitBase, fn: Callable[[Any], Any]) -> ImplicitBase:
    """`y`, of a type that declares nothing, rebuilt (as a pytree) from `fn` of each of
    its array leaves and of each implicit array nested in it, whole: `vmap` batches a
    nested declared value by its own rules, and one without leaves (a symbolic
    constant) too, which a map over leaves would leave unbatched beside batched ones."""
    return jax.tree_util.tree_map(
        fn, y, is_leaf=lambda z: z is not y and is_implicit(z)
    )


def _canonical_axis(axis: Any, ndim: int, x: ImplicitBase) -> int:
    if not isinstance(axis, int) or not -ndim <= axis < ndim:
        raise ValueError(
            f"vmap got axis {axis!r} for a {type(x).__name__} of shape {x.shape}: "
            f"implicit arrays take an integer axis in [{-ndim}, {ndim}) or None."
        )
    return axis % ndim


def register_batching(cls: type) -> None:
    """Make `vmap` slice and stack `cls` as it declares; a type that declares nothing
    stays a plain pytree for `vmap` (see `undeclared_layout`)."""
    if batchable(cls):
        register_vmappable(cls, _to_elt, _from_elt)


# ----------------------------------------------------------------------------------------
# Materializing a batched value, one batch element at a time


def per_element(fn: Callable[[ImplicitBase], Any], x: ImplicitBase) -> Any:
    """`fn(x)` for a batched `x`: `fn` runs on the unbatched elements (vmapped)."""
    names = fields_of(type(x)).children
    nb = x.__dict__.get(NB, 0)
    values = [x.__dict__[n] for n in names]
    shape = None if x.shape is None else x.shape[1:]

    def one(*children):
        return fn(rebuild(x, dict(zip(names, children, strict=True)), shape, nb - 1))

    values = [_map_child(v, _sliceable_along_0) for v in values]
    axes = [None if v is None else 0 for v in values]
    return jax.vmap(one, in_axes=axes)(*values)


def _sliceable_along_0(y: Any) -> Any:
    """`y`, materialized if it is implicit, declares nothing and is not a stack."""
    if not is_implicit(y) or batchable(type(y)) or sliceable(y, 0):
        return y
    return densify(y, "vmap", undeclared_reason("vmap", "maps", y, 0))


def slice_template(x: ImplicitBase) -> ImplicitBase:
    """`x` as one row along axis 0 looks to a pytree unflattening its sliced leaves."""
    children = {
        n: _map_child(c, lambda y: slice_template(y) if is_implicit(y) else y)
        for n, c in children_of(x).items()
    }
    return rebuild(x, children, x.shape[1:], max(x.__dict__.get(NB, 0) - 1, 0))


def stack_like(template: Any, leaves: list, length: int) -> Any:
    """Rebuild `template` (a row) around `leaves` stacked `length` times on axis 0."""
    it = iter(leaves)

    def build(t: Any) -> Any:
        if not is_implicit(t):
            return next(it)
        children = {n: _map_child(c, build) for n, c in children_of(t).items()}
        nb = t.__dict__.get(NB, 0) + 1 if fields_of(type(t)).children else 0
        return rebuild(t, children, (length, *t.shape), nb)

    out = jax.tree_util.tree_map(build, template, is_leaf=is_implicit)
    return out
