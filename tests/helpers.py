"""Implicit types shared by the core tests, written with the public API only."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import qax


def assert_close(a, b, rtol=1e-5, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


class Zeros(qax.ImplicitArray):
    """A symbolic all-zeros array with add/mul/broadcast handlers (as in the how-to)."""

    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


def _binop_shape_dtype(a, b):
    return jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)), jnp.result_type(
        a.dtype, b.dtype
    )


@qax.primitive_handler("add")
def _zeros_add(primitive, a: Zeros, b: qax.ArrayValue):
    shape, dtype = _binop_shape_dtype(a, b)
    if isinstance(b, Zeros):
        return Zeros(shape=shape, dtype=dtype)
    return jnp.broadcast_to(b, shape).astype(dtype)


@qax.primitive_handler("mul")
def _zeros_mul(primitive, a: Zeros, b: qax.ArrayValue):
    shape, dtype = _binop_shape_dtype(a, b)
    return Zeros(shape=shape, dtype=dtype)


@qax.primitive_handler("broadcast_in_dim")
def _zeros_broadcast(primitive, a: Zeros, *, shape, broadcast_dimensions, sharding):
    return Zeros(shape=shape, dtype=a.dtype)


@dataclass
class LoraMatrix(qax.ImplicitArray):
    """W + A Bᵀ, never formed by `x @ w`."""

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.w + self.a @ self.b.T


def _matmul_side(x, w, dimension_numbers):
    """0 for `x @ w`, 1 for `x @ w.T`, None for any other contraction."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if w.ndim != 2 or lhs_batch or rhs_batch or tuple(lhs_contract) != (x.ndim - 1,):
        return None
    return {(0,): 0, (1,): 1}.get(tuple(rhs_contract))


@qax.primitive_handler("dot_general")
def _lora_matmul(
    primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params
):
    side = _matmul_side(x, w, dimension_numbers)
    if side is None:
        return NotImplemented
    out = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **params
    )
    first, second = (w.a, w.b) if side == 0 else (w.b, w.a)
    return out + (x @ first) @ second.T


@dataclass
class BackwardTag(qax.ImplicitArray):
    """Wraps an array; a per-type default rule wraps every result too (seeds/001)."""

    array: qax.ArrayValue

    def compute_shape(self):
        return jnp.shape(self.array)

    def compute_dtype(self):
        return jnp.result_type(self.array)

    def materialize(self):
        raise ValueError("Refusing to materialize BackwardTag")

    @classmethod
    def default_handler(cls, primitive, *args, params):
        raw = [a.array if isinstance(a, BackwardTag) else a for a in args]
        out = primitive.bind(*raw, **params)
        if primitive.multiple_results:
            return [BackwardTag(o) for o in out]
        return BackwardTag(out)


def make_lora(key, m=6, n=5, r=2, dtype=jnp.float32):
    kw, ka, kb = jax.random.split(key, 3)
    return LoraMatrix(
        jax.random.normal(kw, (m, n), dtype),
        jax.random.normal(ka, (m, r), dtype),
        jax.random.normal(kb, (n, r), dtype),
    )


def primitive_names(jaxpr) -> list[str]:
    """Names of every primitive in a (closed) jaxpr, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    names.extend(primitive_names(sub))
    return names
