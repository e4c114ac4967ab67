"""`qax.clear_caches`: every cache qax keeps, emptied in one call.

Each module that keeps a cache has a small `clear_caches` beside it; `_CLEARS` names
them all, core and built-ins, so this module sits above the built-ins (layer 9).
`tests/test_caches.py` finds module-level caches by walking the package and fails on
one that this list leaves full.
"""

from __future__ import annotations

from collections.abc import Callable

from . import (
    _batching,
    _bodies,
    _dispatch,
    _eager,
    _implicit_array,
    _interpreter,
    _mutable,
    symbols,
)
from .qat import _fake as _qat_fake
from .qat import _params as _qat_params

_CLEARS: tuple[Callable[[], None], ...] = (
    _dispatch.clear_caches,
    _interpreter.clear_caches,
    _mutable.clear_caches,
    _eager.clear_caches,
    _bodies.clear_caches,
    _batching.clear_caches,
    _implicit_array.clear_caches,
    # `qax.symbols` is at the module-size limit, so its caches are named here (they are
    # only ever cleared in place). Its `_nans` stays: it interns NaNs so that equal
    # constants keep equal treedefs.
    symbols._avals.clear,
    symbols._scalar_arrays.clear,
    symbols._abstract_cache.clear,
    symbols._value_cache.clear,
    _qat_fake.clear_caches,
    _qat_params.clear_caches,
)


def clear_caches() -> None:
    """Empty every cache qax keeps.

    qax caches which handler applies to a combination of operand types, re-traced
    bodies of `jit`, `cond`, loops and `remat`, the compiled programs of eager calls
    (lanes and eager `jit`), shape-rule answers, the shape of `materialize()` per type,
    and values that the built-in types fold at trace time. All of them are filled
    again on demand; nothing registered is forgotten: handlers
    (`qax.primitive_handler`), rules, policies and audits stay as they were.

    Use it to free memory (compiled programs held by the eager paths go with their
    entries), or in tests that must start from a known state. Call it between calls,
    not from inside a function that qax is running.

    It calls nothing of JAX's: JAX's own caches of traced and compiled functions stay
    (`jax.clear_caches()` empties those), and values already computed are untouched.

    Examples:
        >>> qax.clear_caches()
    """
    for clear in _CLEARS:
        clear()
