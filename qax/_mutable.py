"""In-place updates to mutable pytree nodes (Flax NNX `Variable`s) across the wrapper.

`use_implicit_args` rebuilds its arguments with tracers in place of implicit arrays, so
a function that updates a Flax NNX `Variable` in place (a batch-norm statistic, an
`nnx.Optimizer.update`, or the state that `nnx.jit` writes back) updates the rebuilt
copy. `flatten` notes the caller's `Variable`s, `capture` pairs each with its copy; `write_back`
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


_memos: dict[type, dict[type, bool]] = {}


def _subclass_memo(variable: type) -> dict[type, bool]:
    """type -> "is a subclass of `variable`" (`isinstance` on NNX types is slow)."""
    memo = _memos.get(variable)
    if memo is None:
        memo = _memos[variable] = {}
    return memo


def clear_caches() -> None:
    _memos.clear()


def flatten(tree: Any, is_leaf: Callable) -> tuple[list, Any, list]:
    """`jax.tree_util.tree_flatten(tree, is_leaf)`, and the NNX `Variable`s it passed.

    The `Variable`s are noted during the same traversal (no second one), so arguments
    without them cost what a plain flatten costs.
    """
    variable = _variable_type()
    if variable is None:
        leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
        return leaves, treedef, []
    seen: list = []
    memo = _subclass_memo(variable)

    def noting(x: Any) -> bool:
        kind = type(x)
        is_variable = memo.get(kind)
        if is_variable is None:
            is_variable = memo[kind] = issubclass(kind, variable)
        if is_variable:
            seen.append(x)
            return False
        return is_leaf(x)

    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=noting)
    return leaves, treedef, seen


def capture(originals: list, rebuilt: Any) -> list[tuple[Any, Any, Any]] | None:
    """(caller's variable, rebuilt variable, rebuilt value) for each NNX `Variable`.

    `originals` are the caller's `Variable`s in traversal order (from `flatten`);
    `rebuilt` is the argument tree rebuilt from the same treedef.
    """
    variable = _variable_type()
    leaves = jax.tree_util.tree_leaves(
        rebuilt, is_leaf=lambda x: isinstance(x, variable)
    )
    copies = [x for x in leaves if isinstance(x, variable)]
    if len(copies) != len(originals):  # nested Variables: leave them alone
        return None
    return [(o, c, c.get_raw_value()) for o, c in zip(originals, copies) if o is not c]


def _kept_elsewhere(original: Any, error: Exception) -> bool:
    """Whether `error`, raised by setting `original`, means: a `Param` owned by an
    outer trace, which the call only re-set.

    NNX transforms (`nnx.remat`, `nnx.scan`) set every `Variable` they carry to their
    outputs, so the copy of a parameter that nothing changed holds a new tracer. A
    `Param` made under an outer trace (state passed into a `jax.jit`, merged under
    `jax.grad`, as in the QLoRA recipe) cannot be set from here, and NNX refuses to
    change it from this trace too: it keeps its value. Other variables (batch
    statistics) keep NNX's error.
    """
    flax_errors = sys.modules.get("flax.errors")
    nnx = sys.modules.get("flax.nnx")
    refused = getattr(flax_errors, "TraceContextError", None)
    param = getattr(nnx, "Param", None)
    return (
        refused is not None
        and isinstance(error, refused)
        and param is not None
        and isinstance(original, param)
    )


def write_back(pairs: list[tuple[Any, Any, Any]], to_value: Callable) -> None:
    """Give each caller's `Variable` the value its copy holds now, if it changed.

    A `Param` that cannot be set from the caller's trace keeps its value (see
    `_kept_elsewhere`).
    """
    for original, rebuilt, before in pairs:
        after = rebuilt.get_raw_value()
        if after is not before:
            try:
                original.set_raw_value(jax.tree_util.tree_map(to_value, after))
            except Exception as error:
                if not _kept_elsewhere(original, error):
                    raise
