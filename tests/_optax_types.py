"""A small LoRA matrix for the optax tests (kept out of tests/helpers.py)."""

from dataclasses import dataclass

import jax

import qax


@dataclass
class LoraMatrix(qax.ImplicitArray):
    """``w + a @ b.T`` with a frozen base ``w`` and low-rank factors ``a``, ``b``."""

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue
    tag: str = qax.aux_field(default="lora")

    def materialize(self):
        return self.w + self.a @ self.b.T


@qax.primitive_handler("dot_general")
def _lora_matmul(
    primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params
):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_contract != (x.ndim - 1,) or rhs_contract != (0,) or lhs_batch or rhs_batch:
        return NotImplemented
    return x @ w.w + (x @ w.a) @ w.b.T
