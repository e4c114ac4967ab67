"""A LoRA kernel of any rank for the library integration tests (public API only).

`LoraKernel(w, a, b, split=k)` represents ``w + (a @ b.T).reshape(w.shape)`` where
``a`` has ``prod(w.shape[:k])`` rows and ``b`` has ``prod(w.shape[k:])`` rows: ``x @ W``
layouts (Flax: kernel ``(in..., out...)``, ``split`` = number of input dims) and
``W @ x`` layouts (Equinox: weight ``(out, in)``, ``split=1``) both stay implicit. Its
`materialize()` raises, so a passing test proves that every use went through a handler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import qax


@dataclass
class LoraKernel(qax.ImplicitArray):
    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue
    split: int = qax.aux_field(default=1)

    def compute_shape(self):
        return jnp.shape(self.w)

    def compute_dtype(self):
        return jnp.result_type(self.w)

    def materialize(self):
        raise ValueError("LoraKernel must stay implicit in these tests")

    def dense(self):
        """The represented array, for oracles outside `use_implicit_args`."""
        delta = self.a @ jnp.swapaxes(self.b, -1, -2)
        return self.w + delta.reshape(self.w.shape).astype(self.w.dtype)


@dataclass
class LoraKernel2(LoraKernel):
    """A `LoraKernel` over a 2-D kernel, with declared ranks (scanned stacks slice it)."""

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)


@dataclass
class LoraKernel3(LoraKernel):
    """A `LoraKernel` over a 3-D kernel (attention projections)."""

    w: qax.ArrayValue = qax.array_field(ndim=3)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)


def lora_kernel(w, rank, key, split=1, scale=0.1, batch=0):
    """A `LoraKernel` over `w` whose product is nonzero (so the factors matter).

    `batch` leading dims of `w` are a stack of kernels (scanned layers).
    """
    stack, core = w.shape[:batch], w.shape[batch:]
    lead = math.prod(core[:split])
    trail = math.prod(core[split:])
    ka, kb = jax.random.split(key)
    a = scale * jax.random.normal(ka, (*stack, lead, rank), w.dtype)
    b = scale * jax.random.normal(kb, (*stack, trail, rank), w.dtype)
    cls = {2: LoraKernel2, 3: LoraKernel3}.get(len(core), LoraKernel)
    return cls(w, a, b, split=split)


def _move_flat(x, dims, front):
    """`x` with `dims` moved to the front (or back) and flattened into one axis."""
    rest = [d for d in range(x.ndim) if d not in dims]
    free = [x.shape[d] for d in rest]
    size = math.prod(x.shape[d] for d in dims)
    if front:
        return jnp.transpose(x, [*dims, *rest]).reshape(size, -1), free
    return jnp.transpose(x, [*rest, *dims]).reshape(-1, size), free


@qax.primitive_handler("dot_general")
def _x_at_kernel(
    primitive, x: jax.Array, k: LoraKernel, *, dimension_numbers, **params
):
    (x_c, k_c), (x_b, k_b) = dimension_numbers
    if x_b or k_b or tuple(k_c) != tuple(range(k.split)):
        return NotImplemented
    out = qax.default_handler(
        primitive, x, k.w, dimension_numbers=dimension_numbers, **params
    )
    flat, free = _move_flat(x, tuple(x_c), front=False)
    delta = ((flat @ k.a) @ k.b.T).reshape(*free, *k.shape[k.split :])
    return out + delta.astype(out.dtype)


@qax.primitive_handler("dot_general")
def _kernel_at_x(
    primitive, k: LoraKernel, x: jax.Array, *, dimension_numbers, **params
):
    (k_c, x_c), (k_b, x_b) = dimension_numbers
    if k_b or x_b or tuple(k_c) != tuple(range(k.split, k.ndim)):
        return NotImplemented
    out = qax.default_handler(
        primitive, k.w, x, dimension_numbers=dimension_numbers, **params
    )
    flat, free = _move_flat(x, tuple(x_c), front=True)
    delta = (k.a @ (k.b.T @ flat)).reshape(*k.shape[: k.split], *free)
    return out + delta.astype(out.dtype)


@qax.primitive_handler("convert_element_type")
def _convert(primitive, k: LoraKernel, *, new_dtype, **params):
    if np.dtype(new_dtype) == np.dtype(k.dtype):
        return k
    return NotImplemented
