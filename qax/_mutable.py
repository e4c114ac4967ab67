"""In-place updates to mutable pytree nodes (Flax NNX `Variable`s) across the wrapper.

`use_implicit_args` rebuilds its arguments with tracers in place of implicit arrays, so
a function that updates a Flax NNX `Variable` in place (a batch-norm statistic, an
`nnx.Optimizer.update`, or the state that `nnx.jit` writes back) updates the rebuilt
copy. `capture` pairs each `Variable` of the caller's arguments with its copy; `write_back`
copies the values that changed back to the caller's `Variable`s, so wrapping a stateful
NNX function behaves as calling it, in either order with `nnx.jit`.

Flax is never imported here: with `flax.nnx` not loaded, arguments cannot hold its
`Variable`s, and `capture` returns at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax


def _variable_type() -> type | None:
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)


def _variables(tree: Any, variable: type) -> list:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, variable))
    return [x for x in leaves if isinstance(x, variable)]


def capture(original: Any, rebuilt: Any) -> list[tuple[Any, Any, Any]] | None:
    """(caller's variable, rebuilt variable, rebuilt value) for each NNX `Variable`.

    Returns None when there is nothing to write back (no NNX, or no `Variable`).
    """
    variable = _variable_type()
    if variable is None:
        return None
    originals = _variables(original, variable)
    if not originals:
        return None
    copies = _variables(rebuilt, variable)
    if len(copies) != len(originals):  # pragma: no cover (same treedef by construction)
        return None
    return [(o, c, c.get_raw_value()) for o, c in zip(originals, copies) if o is not c]


def write_back(pairs: list[tuple[Any, Any, Any]], to_value: Callable) -> None:
    """Give each caller's `Variable` the value its copy holds now, if it changed."""
    for original, rebuilt, before in pairs:
        after = rebuilt.get_raw_value()
        if after is not before:
            original.set_raw_value(jax.tree_util.tree_map(to_value, after))
