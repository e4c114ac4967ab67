"""`vmap_all_but_one`: apply a function to every 1-d slice along one axis."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def vmap_all_but_one(f: Callable, axis: int, out_ndim: int = 0) -> Callable:
    """Map `f` over every axis of its arguments except `axis`.

    `f` is called on the 1-d slices along `axis` (one slice of each argument at a time;
    all arguments are mapped over the same axes, those of the first argument). The
    `out_ndim` dimensions of each of `f`'s results take the place of `axis` in the
    output; the other axes keep their order.

    Examples:
        >>> x = jnp.arange(24.0).reshape(2, 3, 4)
        >>> vmap_all_but_one(jnp.sum, axis=1)(x).shape  # == x.sum(axis=1).shape
        (2, 4)
        >>> vmap_all_but_one(jnp.cumsum, axis=1, out_ndim=1)(x).shape
        (2, 3, 4)

    Args:
      f: a function of 1-d arrays.
      axis: the axis handed to `f` (negative values count from the end).
      out_ndim: the number of dimensions of `f`'s outputs.

    Returns:
      The mapped function.

    Raises:
      ValueError: `axis` is out of range for the first argument.
    """

    @functools.wraps(f)
    def mapped(*args: Any) -> Any:
        if not args:
            raise TypeError("vmap_all_but_one: the mapped function needs an argument.")
        ndim = getattr(args[0], "ndim", None)
        ndim = np.ndim(args[0]) if ndim is None else ndim
        kept = axis + ndim if axis < 0 else axis
        if not 0 <= kept < ndim:
            raise ValueError(
                f"vmap_all_but_one: axis {axis} is out of range for an argument with "
                f"{ndim} dimensions."
            )
        fn = f
        for i in reversed(range(ndim)):
            if i > kept:  # after the kept axis, which sits at position 0 by then
                fn = jax.vmap(fn, in_axes=1, out_axes=out_ndim)
            elif i < kept:
                fn = jax.vmap(fn, in_axes=0, out_axes=0)
        return fn(*args)

    return mapped
