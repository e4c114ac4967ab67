"""Pytree helpers that treat implicit arrays as leaves."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ._base import is_implicit
from ._fields import children_of


class _EmptyNodeType:
    """The type of `EmptyNode`: a pytree node with no children and no leaves."""

    _instance: _EmptyNodeType | None = None

    def __new__(cls) -> _EmptyNodeType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "EmptyNode"

    def __reduce__(self) -> str:
        return "EmptyNode"  # pickles as the module attribute: stays the singleton


EmptyNode = _EmptyNodeType()
"""The empty pytree node: a placeholder that every tree function skips.

As in the original Qax it is a single object, not a class:
``jax.tree_util.tree_leaves({"f": qax.EmptyNode}) == []``.
"""

jax.tree_util.register_pytree_node(
    _EmptyNodeType, lambda _: ((), None), lambda _aux, _children: EmptyNode
)


def _combine_leaf(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    if is_leaf is None:
        return is_implicit
    return lambda x: is_implicit(x) or is_leaf(x)


def tree_flatten_with_implicit(tree: Any, is_leaf: Callable[[Any], bool] | None = None):
    """`jax.tree_util.tree_flatten`, keeping implicit arrays whole as leaves."""
    return jax.tree_util.tree_flatten(tree, is_leaf=_combine_leaf(is_leaf))


def tree_flatten_with_path_with_implicit(tree: Any, is_leaf=None):
    """`jax.tree_util.tree_flatten_with_path`, keeping implicit arrays whole as leaves."""
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=_combine_leaf(is_leaf))


def tree_leaves_with_implicit(tree: Any, is_leaf=None) -> list[Any]:
    """`jax.tree_util.tree_leaves`, keeping implicit arrays whole as leaves."""
    return jax.tree_util.tree_leaves(tree, is_leaf=_combine_leaf(is_leaf))


def tree_structure_with_implicit(tree: Any, is_leaf=None):
    """`jax.tree_util.tree_structure`, keeping implicit arrays whole as leaves."""
    return jax.tree_util.tree_structure(tree, is_leaf=_combine_leaf(is_leaf))


def tree_map_with_implicit(f: Callable, tree: Any, *rest: Any, is_leaf=None) -> Any:
    """`jax.tree_util.tree_map`, calling `f` on implicit arrays instead of their leaves.

    Examples:
        >>> tree_map_with_implicit(lambda x: x.shape, {"w": lora, "b": jnp.ones(3)})
        {'b': (3,), 'w': (6, 5)}
    """
    return jax.tree_util.tree_map(f, tree, *rest, is_leaf=_combine_leaf(is_leaf))


def tree_map_with_path_with_implicit(f: Callable, tree: Any, *rest: Any, is_leaf=None):
    """`jax.tree_util.tree_map_with_path`, calling `f` on implicit arrays whole."""
    return jax.tree_util.tree_map_with_path(
        f, tree, *rest, is_leaf=_combine_leaf(is_leaf)
    )


def tree_unflatten(treedef, leaves):
    """`jax.tree_util.tree_unflatten` (works for treedefs from any of these helpers)."""
    return jax.tree_util.tree_unflatten(treedef, leaves)


def implicit_depth(tree: Any) -> int:
    """How many layers of implicit arrays are nested in `tree` (0: none at all).

    Examples:
        >>> implicit_depth(jnp.ones(3))
        0
    """
    best = 0
    for leaf in tree_leaves_with_implicit(tree):
        if is_implicit(leaf):
            best = max(best, 1 + implicit_depth(children_of(leaf)))
    return best


def flatten_one_implicit_layer(tree: Any) -> tuple[list[Any], Any]:
    """Flatten `tree`, opening the outermost implicit arrays but not the ones inside them.

    Returns the leaves (plain arrays or implicit arrays one layer down) and a treedef.
    """

    def is_leaf(x: Any) -> bool:
        return is_implicit(x) and x not in top

    top_leaves = tree_leaves_with_implicit(tree)
    top = _IdentitySet(x for x in top_leaves if is_implicit(x))
    return jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)


class _IdentitySet:
    """A set of objects compared by identity (implicit arrays define `==` elementwise)."""

    def __init__(self, items):
        self._ids = {id(x) for x in items}

    def __contains__(self, x: Any) -> bool:
        return id(x) in self._ids


def key_value(key: Any) -> Any:
    """The value of one entry of a pytree key path: a dict key, an attribute name or a
    sequence index (its string for other kinds of keys)."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def path_string(path: Sequence[Any]) -> str:
    """``"layers/0/attn/kernel"``: the entries of a pytree key path joined by ``/``.

    Examples:
        >>> qax.utils.path_string(jax.tree_util.tree_flatten_with_path({"a": [1]})[0][0][0])
        'a/0'
    """
    return "/".join(str(key_value(k)) for k in path)


def path_rules(rules: Any, allowed: Sequence[str], caller: str) -> Callable[[str], Any]:
    """A lookup of per-path settings: ``lookup(path) -> (matched, settings)``.

    `rules` is an ordered sequence of ``(pattern, settings)``; the first pattern (a
    regular expression) that matches all of a path (`re.fullmatch`) gives its settings:
    a dict whose keys are among `allowed`, or ``None`` (leave that path alone).
    ``(False, None)`` when no pattern matches.

    Examples:
        >>> lookup = qax.utils.path_rules([("layers/.*/attn/.*", {"rank": 4})],
        ...                               ["rank"], "loraify")
        >>> lookup("layers/0/attn/kernel"), lookup("head/kernel")
        ((True, {'rank': 4}), (False, None))

    Args:
      rules: the rules (``None``: none).
      allowed: the setting names the caller understands.
      caller: the caller's name, for the errors.

    Returns:
      The lookup function.

    Raises:
      ValueError: a rule is not a ``(pattern, settings)`` pair, its pattern is not a
        regular expression, or its settings name something not in `allowed`.
    """
    compiled = []
    for rule in rules or ():
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise ValueError(
                f"{caller}: each rule is a (path pattern, settings) pair, got {rule!r}."
            )
        pattern, settings = rule
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(
                f"{caller}: the rule pattern {pattern!r} is not a regular expression "
                f"({e})."
            ) from None
        if settings is not None:
            unknown = sorted(set(settings) - set(allowed))
            if unknown:
                raise ValueError(
                    f"{caller}: the rule for {pattern!r} sets {unknown}; a rule sets "
                    f"{sorted(allowed)}, or is None to leave the matching weights alone."
                )
            settings = dict(settings)
        compiled.append((regex, settings))

    def lookup(path: str) -> tuple[bool, Any]:
        for regex, settings in compiled:
            if regex.fullmatch(path):
                return True, settings
        return False, None

    return lookup
