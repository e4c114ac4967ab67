"""Implicit types for the audit, explain and testing tests (handlers register on import).

`LoraMatrix` handles ``x @ w`` only; `TransposableLora` also handles ``w.T``, so a model
that uses both is fully handled for it and materializes once for `LoraMatrix`.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

import qax


@dataclass
class LoraMatrix(qax.ImplicitArray):
    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.w + self.a @ self.b.T


class TransposableLora(LoraMatrix):
    pass


class QuietLora(LoraMatrix, warn_on_materialize=False):
    pass


def is_plain_matmul(x, dimension_numbers) -> bool:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    return (
        lhs_contract == (x.ndim - 1,)
        and rhs_contract == (0,)
        and lhs_batch == ()
        and rhs_batch == ()
    )


@qax.primitive_handler("dot_general")
def lora_matmul(primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params):
    """``x @ W + (x @ A) @ B.T``, never forming ``W + A @ B.T``."""
    if not is_plain_matmul(x, dimension_numbers):
        return NotImplemented
    dense = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **params
    )
    return dense + (x @ w.a) @ w.b.T


@qax.primitive_handler("transpose")
def lora_transpose(primitive, w: TransposableLora, *, permutation):
    return TransposableLora(w.w.T, w.b, w.a)


def make_lora(key, rows: int, cols: int, rank: int = 2, cls=LoraMatrix):
    k_w, k_a, k_b = jax.random.split(key, 3)
    return cls(
        jax.random.normal(k_w, (rows, cols)),
        jax.random.normal(k_a, (rows, rank)),
        jax.random.normal(k_b, (cols, rank)),
    )


class Zeros(qax.ImplicitArray):
    """An array of zeros: `mul` by anything stays `Zeros`."""

    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


@qax.primitive_handler("mul")
def zeros_mul(primitive, z: Zeros, other: qax.ArrayValue):
    shape = jnp.broadcast_shapes(z.shape, jnp.shape(other))
    return Zeros(shape=shape, dtype=jnp.result_type(z.dtype, other.dtype))
