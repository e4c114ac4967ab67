"""Implicit arrays used outside `use_implicit_args`: conversions, iteration, `jnp` calls.

Outside the wrapper an implicit array is a Python object with array methods, and one rule
says what each use does:

1. operators, array methods, indexing and iteration run through the interpreter: a
   handler if one applies, otherwise the value is materialized with a
   `MaterializationWarning`;
2. conversions to a dense array (`np.asarray`, `jnp.asarray`, `jnp.array`, `bool`, `int`,
   `float`, `complex`) materialize it with a `MaterializationWarning`;
3. `jnp`, `jax.nn` and `jax.lax` functions raise a `TypeError` that names the type and
   `qax.use_implicit_args`: they cannot reach handlers, and densifying behind the user's
   back would hide the missing wrapper.

An implicit array built *inside* the wrapped function (``jnp.sum(Lora(w, a, b))``,
``lax.dot_general(x, Wrap(arg), ...)``) is a value of the current trace for all of
these, as an implicit argument is.

Without 1 and 2, NumPy would treat an implicit array as a nested sequence (it has
`__len__` and `__getitem__`) and call ``x[0], x[1], ...`` until an `IndexError` that JAX's
clamped indexing never raises: `np.asarray`, `jnp.asarray`, `list()` and every Flax
layer's dtype promotion used to loop forever.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from . import _errors
from ._base import ImplicitBase
from ._compat import Tracer, jax_array_asker, register_bind_converter
from ._entry import (
    densify,
    enter_current_trace,
    implicit_args_active,
    use_implicit_args,
)


def _has_traced_leaves(x: ImplicitBase) -> bool:
    return any(isinstance(leaf, Tracer) for leaf in jax.tree_util.tree_leaves(x))


def _spans_processes(x: ImplicitBase) -> bool:
    """Whether a leaf of `x` is a global array with shards in other processes."""
    return any(
        isinstance(leaf, jax.Array) and not leaf.is_fully_addressable
        for leaf in jax.tree_util.tree_leaves(x)
    )


def _densify(x: ImplicitBase, how: str) -> Any:
    """`x` materialized all the way down, reported as a conversion by `how`."""
    return densify(x, how, _errors.CONVERTED.format(cls=type(x).__name__, how=how))


def to_numpy(
    x: ImplicitBase, dtype: Any = None, copy: bool | None = None
) -> np.ndarray:
    """`x.__array__`: the dense NumPy array, materialized with a warning.

    Raises:
      TypeError: `x` holds traced values (inside `jit`/`grad`), which NumPy cannot hold.
      RuntimeError: a leaf of `x` spans other processes' devices (multi-controller);
        the message names the process-local alternatives.
    """
    if _has_traced_leaves(x):
        raise TypeError(_errors.TRACED_TO_NUMPY.format(cls=type(x).__name__))
    if _spans_processes(x):
        raise RuntimeError(
            _errors.SPANS_PROCESSES.format(cls=type(x).__name__, how="np.asarray")
        )
    out = np.asarray(_densify(x, "np.asarray"))
    if dtype is not None:
        out = out.astype(dtype, copy=False)
    return out.copy() if copy else out


def jax_array_protocol(x: ImplicitBase) -> Any:
    """The `__jax_array__` attribute, which JAX reads in three kinds of places.

    Inside `use_implicit_args` (an implicit array built in the wrapped function), the
    first two get a function that returns `x` as a value of the current trace: `jnp`
    functions then see it as they see an implicit argument. Outside:

    - Its array constructors (`jnp.asarray`, `jnp.array`): get a function that returns the
      materialized array (rule 2), under `jit` too.
    - The array-like check that starts every `jnp` function: gets an error that names
      `qax.use_implicit_args` (rule 3) instead of JAX's bare "requires ndarray".
    - Its binary operators (``jax_array @ x``) and anything else: no such attribute, so
      that Python calls this type's reflected operator, where handlers apply (rule 1).
    """
    asker, function = jax_array_asker(1)
    if asker != "operator" and implicit_args_active():
        # Built inside the wrapped function: the value of the current trace, exactly as
        # an implicit argument would be there.
        return lambda: enter_current_trace((x,))[0]
    if asker == "constructor":
        return lambda: _densify(x, "jnp.asarray")
    if asker == "check":
        raise TypeError(
            _errors.OUTSIDE_WRAPPER.format(
                function=f"jnp.{function}" if function else "a jnp function",
                cls=type(x).__name__,
            )
        )
    raise AttributeError("__jax_array__")


def bind_operand(x: ImplicitBase) -> Any:
    """`x` handed to `Primitive.bind` directly (``lax.dot_general(y, x, ...)``).

    Inside `use_implicit_args`, the value of the current trace (as for operators);
    outside, a `TypeError` naming `qax.use_implicit_args` (rule 3).
    """
    wrapped = enter_current_trace((x,))
    if wrapped is None:
        raise TypeError(
            _errors.OUTSIDE_WRAPPER.format(
                function="a jax.lax function", cls=type(x).__name__
            )
        )
    return wrapped[0]


register_bind_converter(ImplicitBase, bind_operand)


def getitem(x: ImplicitBase, index: Any) -> Any:
    """`x[index]`, with NumPy's `IndexError` for an integer index past the end.

    (JAX clamps such indices; for iteration protocols that stop at `IndexError`, an
    index that never ends would loop forever.)
    """
    _check_bounds(tuple(x.shape), index)
    wrapped = enter_current_trace((x, index))
    if wrapped is not None:
        return operator.getitem(*wrapped)
    return use_implicit_args(operator.getitem)(x, index)


def _check_bounds(shape: tuple[int, ...], index: Any) -> None:
    entries = index if isinstance(index, tuple) else (index,)
    for axis, entry in enumerate(entries):
        if entry is None or entry is Ellipsis or axis >= len(shape):
            return  # axes no longer line up with the entries: leave it to JAX
        if isinstance(entry, (int, np.integer)) and not isinstance(entry, bool):
            size = shape[axis]
            if not -size <= int(entry) < size:
                raise IndexError(
                    f"index {int(entry)} is out of bounds for axis {axis} with size "
                    f"{size}"
                )
        elif not isinstance(entry, slice):
            return


def iterate(x: ImplicitBase) -> Iterator[Any]:
    """`iter(x)`: the `len(x)` rows ``x[0], x[1], ...`` (each through the interpreter)."""
    if not x.shape:
        raise TypeError("iteration over a 0-d array")
    return (getitem(x, i) for i in range(x.shape[0]))


def scalar(x: ImplicitBase, convert: type) -> Any:
    """`bool(x)`, `int(x)`, `float(x)`, `complex(x)` of a one-element implicit array."""
    if int(np.prod(x.shape, dtype=np.int64)) != 1:
        if convert is bool:
            raise ValueError(
                "The truth value of an array with more than one element is ambiguous. "
                "Use a.any() or a.all()"
            )
        raise TypeError(
            f"only length-1 arrays can be converted to Python scalars; this "
            f"{type(x).__name__} has shape {tuple(x.shape)}"
        )
    return convert(to_numpy(x).reshape(()))
