"""The largest common structure of several pytrees that hold implicit arrays.

Several values that must share one structure (the outputs of the branches of a `cond`,
the carry of a loop before and after an iteration) may hold different implicit types in
the same place. They are reconciled by materializing only where they differ: a position
is described by a path, a tuple of indices whose first entry indexes the leaves of
`tree_flatten_with_implicit(tree)` and whose next entries index the children of an
implicit array, one layer at a time (as `flatten_one_implicit_layer` opens it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._base import is_implicit
from ._compat import ShapedArray, typeof
from ._entry import materialize_nested
from ._tree_util import flatten_one_implicit_layer, tree_flatten_with_implicit

Path = tuple[int, ...]


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of an implicit array, an array, or an abstract value."""
    if is_implicit(x):
        return tuple(x.shape), np.dtype(x.dtype)
    aval = x if isinstance(x, ShapedArray) else typeof(x)
    return tuple(aval.shape), np.dtype(aval.dtype)


def describe(x: Any) -> str:
    """A short description: the implicit array's repr (fields, metadata), or an aval."""
    if is_implicit(x):
        return repr(x)
    return (x if isinstance(x, ShapedArray) else typeof(x)).str_short()


def _reconcile(group: Sequence, path: Path, paths: set) -> bool:
    """Add to `paths` what must be materialized for `group` to share one structure.

    `group` holds the values found at `path` in every tree. Returns False if even the
    dense versions differ in shape or dtype, in which case the enclosing implicit array
    (if any) must be materialized instead.
    """
    same_type = len({_shape_dtype(x) for x in group}) == 1
    implicit = [is_implicit(x) for x in group]
    if not any(implicit):
        return same_type
    if all(implicit) and len({type(x) for x in group}) == 1:
        opened = [flatten_one_implicit_layer(x) for x in group]
        if all(layer == opened[0][1] for _, layer in opened[1:]):
            children = zip(*(leaves for leaves, _ in opened), strict=True)
            results = [
                _reconcile(child_group, (*path, i), paths)
                for i, child_group in enumerate(children)
            ]
            if all(results):
                return True
    paths.add(path)
    return same_type


def common_structure_paths(trees: Sequence) -> frozenset[Path]:
    """The paths at which `trees` must be materialized to share one structure.

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
    groups = zip(*(leaves for leaves, _ in flat), strict=True)
    for i, group in enumerate(groups):
        if not _reconcile(group, (i,), paths):
            raise ValueError(
                f"Leaf {i} has different shapes or dtypes in these trees "
                f"({', '.join(map(describe, group))}), so no materialization can give "
                "them a common structure."
            )
    return frozenset(paths)


def value_at(tree: Any, path: Path) -> Any:
    """The value found at `path` in `tree` (a dense value ends the descent early)."""
    x = tree_flatten_with_implicit(tree)[0][path[0]]
    for i in path[1:]:
        if not is_implicit(x):
            break
        x = flatten_one_implicit_layer(x)[0][i]
    return x


def materialize_at(
    tree: Any, paths: frozenset[Path], densify: Callable[[Any, Path], Any]
) -> Any:
    """`tree` with the implicit array at each of `paths` replaced by `densify(x, path)`."""
    if not paths:
        return tree
    prefixes = {p[:n] for p in paths for n in range(1, len(p))}

    def visit(x: Any, path: Path) -> Any:
        if not is_implicit(x):
            return x
        if path in paths:
            return densify(x, path)
        if path not in prefixes:
            return x
        children, layer = flatten_one_implicit_layer(x)
        new = [visit(c, (*path, i)) for i, c in enumerate(children)]
        return jax.tree_util.tree_unflatten(layer, new)

    leaves, treedef = tree_flatten_with_implicit(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [visit(x, (i,)) for i, x in enumerate(leaves)]
    )


def get_common_prefix_transforms(trees: Sequence) -> list[Callable[[Any], Any]]:
    """Functions that bring each of `trees` to their largest common structure.

    The trees must be equal once every implicit array in them is materialized (same
    pytree structure, shapes and dtypes). Where they differ (an implicit array in one
    and a dense array or another implicit type in another, or the same type with
    different metadata or leaf shapes) the implicit arrays are materialized; where they
    agree they stay implicit, also inside nested implicit arrays. This is how the
    branches of `lax.cond` are reconciled.

    Examples:
        >>> t1 = [Zeros(shape=(3,)), Zeros(shape=(2,))]
        >>> t2 = [jnp.ones(3), Zeros(shape=(2,))]
        >>> f1, f2 = qax.utils.get_common_prefix_transforms([t1, t2])
        >>> f1(t1)  # [Array([0., 0., 0.]), Zeros(shape=(2,))]

    Args:
      trees: pytrees in which implicit arrays may appear at any depth.

    Returns:
      One function per tree, mapping a tree of that structure to the common structure
      (by materializing, never by building implicit arrays).

    Raises:
      ValueError: if the trees differ even once fully materialized.
    """
    trees = list(trees)
    if len(trees) <= 1:
        return [lambda x: x for _ in trees]
    paths = common_structure_paths(trees)

    def transform(tree: Any) -> Any:
        return materialize_at(
            tree, paths, lambda x, _: materialize_nested(x, full=True)
        )

    return [transform for _ in trees]
