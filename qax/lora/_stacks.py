"""More `LoraWeight` handlers: one layer of a stack, transposes that keep the stack
axes, and the addition of a dense array (see `qax.lora`).

This module uses qax's public API only.
"""

from __future__ import annotations

from typing import Any, Final

import jax
import jax.numpy as jnp

import qax

from ._weight import LoraWeight

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
