"""More `LoraWeight` handlers: one layer of a stack, transposes that keep the stack
axes, and the addition of a dense array (see `qax.lora`).

This module uses qax's public API only.
"""

from __future__ import annotations

from typing import Any, Final

import jax
import jax.numpy as jnp
from jax import lax

import qax

from ._weight import LoraWeight, _batch_ndim, _replace

DENSE_ADDITION: Final = (
    "LoraWeight: adding a dense array of the weight's whole shape forms the dense "
    "weight: the result is a plain array and the factors are gone. If this is an "
    "optimizer step (`optax.apply_updates(params, updates)` inside "
    "`qax.use_implicit_args`), take the step outside the wrapper and keep only the "
    "loss inside it: differentiate with respect to the factors (`adapters, base = "
    "qax.lora.split(params)`, `qax.lora.combine(adapters, base)` inside the loss), "
    "then `optimizer.update` and `optax.apply_updates` on the adapters."
)


@qax.primitive_handler("add")
def _add_dense(primitive, w: LoraWeight, x: jax.Array) -> Any:
    """``W + X`` with ``X`` dense of ``W``'s shape forms ``W``: declined, saying why
    (an optimizer step inside the wrapper is the usual cause)."""
    if tuple(jnp.shape(x)) != tuple(w.shape):
        return NotImplemented
    return qax.decline(DENSE_ADDITION)


@qax.primitive_handler("transpose")
def _transpose(primitive, w: LoraWeight, *, permutation) -> Any:
    """Any permutation that keeps the stack axes of a stack in place is again a
    `LoraWeight` (``(w + a b)ᵀ = wᵀ + bᵀ aᵀ``, layer by layer: ``jnp.swapaxes(stack,
    -1, -2)``, ``w.T`` under `jax.vmap`). One that keeps the axes of ``a`` together and
    those of ``b`` together keeps the leading-axes layout; any other moves
    ``a_axes``."""
    nb = _batch_ndim(w.w.ndim, w.a.ndim, w.b.ndim)
    perm = tuple(permutation)
    if perm[:nb] != tuple(range(nb)):
        return NotImplemented  # moves a stack axis
    lead = tuple(range(nb))
    q = tuple(i - nb for i in perm[nb:])  # the permutation of one weight
    p, k = w.a.ndim - nb - 1, w.ndim - nb

    def moved(x: Any, axes: Any) -> Any:
        return lax.transpose(x, (*lead, *(nb + i for i in axes)))

    new_w = lax.transpose(w.w, perm)
    if w.a_axes is None and sorted(q[:p]) == list(range(p)):
        new_a = moved(w.a, (*q[:p], p))
        new_b = moved(w.b, (0, *(i - p + 1 for i in q[p:])))
    elif w.a_axes is None and sorted(q[: k - p]) == list(range(p, k)):
        # b's axes come first: the new a is b (rank moved last), the new b is a.
        new_a = moved(w.b, (*(i - p + 1 for i in q[: k - p]), 0))
        new_b = moved(w.a, (p, *q[k - p :]))
    else:
        # `a` stays; its axes get new positions (`a_axes`), and `b`'s axes are put
        # in the new order of the weight's.
        where = {old: new for new, old in enumerate(q)}
        a_axes, b_axes = w.axes()
        new = [where[i] for i in b_axes]
        order = sorted(range(len(new)), key=new.__getitem__)
        new_b = moved(w.b, (0, *(1 + j for j in order)))
        return _replace(w, w=new_w, b=new_b, a_axes=tuple(where[i] for i in a_axes))
    return _replace(w, w=new_w, a=new_a, b=new_b)
