"""Implicit types and oracles for the higher-order and sharding tests.

`HLora` is a LoRA weight `w + a @ b.T` with a `dot_general` handler for `x @ W`;
`HZeros` is a symbolic zero whose shape lives only in metadata, with handlers that keep
it symbolic. Both names are prefixed to stay clear of other test modules' types.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import qax

# ----------------------------------------------------------------------------------------
# Types


@dataclass
class HLora(qax.ImplicitArray):
    """`w + a @ b.T`, never formed by `x @ W` (see `hlora_matmul`).

    `follows`: `a` [m, r] runs along the rows of `w`, `b` [n, r] along its columns
    (how shardings of the weight split them).
    """

    w: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
    a: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, None))
    b: qax.ArrayValue = qax.array_field(ndim=2, follows=(1, None))

    def materialize(self):
        return self.w + self.a @ jnp.swapaxes(self.b, -1, -2)

    def compute_shape(self):
        return self.w.shape

    def compute_dtype(self):
        return self.w.dtype


def _is_plain_matmul(x, dimension_numbers) -> bool:
    (lc, rc), (lb, rb) = dimension_numbers
    return lc == (x.ndim - 1,) and rc == (0,) and lb == () and rb == ()


@qax.primitive_handler("dot_general")
def hlora_matmul(primitive, x: jax.Array, w: HLora, *, dimension_numbers, **params):
    if not _is_plain_matmul(x, dimension_numbers):
        return NotImplemented
    return x @ w.w + (x @ w.a) @ w.b.T


class HZeros(qax.ImplicitArray):
    """A symbolic array of zeros: no data, the shape is metadata."""

    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


def _shape_dtype(*xs):
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in xs))
    return shape, jnp.result_type(*(x.dtype for x in xs))


@qax.primitive_handler("add")
def hzeros_add(primitive, z: HZeros, other: qax.ArrayValue):
    shape, dtype = _shape_dtype(z, other)
    if isinstance(other, HZeros):
        return HZeros(shape=shape, dtype=dtype)
    return jnp.broadcast_to(other, shape).astype(dtype)


@qax.primitive_handler("mul")
def hzeros_mul(primitive, z: HZeros, other: qax.ArrayValue):
    shape, dtype = _shape_dtype(z, other)
    return HZeros(shape=shape, dtype=dtype)


@qax.primitive_handler(["neg", "sin", "stop_gradient"])
def hzeros_unary(primitive, z: HZeros, **params):
    return HZeros(shape=z.shape, dtype=z.dtype)


@qax.primitive_handler("max")
def hzeros_max(primitive, z: HZeros, other: qax.ArrayValue):
    # max(0, c) is symbolic when c is a known non-positive constant (e.g. relu's 0).
    if isinstance(other, jax.core.Tracer) or isinstance(other, qax.ImplicitArray):
        return NotImplemented
    if np.any(np.asarray(other) > 0):
        return NotImplemented
    shape, dtype = _shape_dtype(z, other)
    return HZeros(shape=shape, dtype=dtype)


@qax.primitive_handler("broadcast_in_dim")
def hzeros_broadcast(primitive, z: HZeros, *, shape, **params):
    return HZeros(shape=shape, dtype=z.dtype)


@qax.primitive_handler("convert_element_type")
def hzeros_convert(primitive, z: HZeros, *, new_dtype, **params):
    return HZeros(shape=z.shape, dtype=new_dtype)


@qax.primitive_handler("reduce_sum")
def hzeros_sum(primitive, z: HZeros, *, axes, **params):
    shape = tuple(d for i, d in enumerate(z.shape) if i not in axes)
    return HZeros(shape=shape, dtype=z.dtype)


@qax.primitive_handler("dot_general")
def hzeros_matmul(primitive, x: jax.Array, z: HZeros, *, dimension_numbers, **params):
    out = jax.eval_shape(
        lambda a, b: jax.lax.dot_general(a, b, dimension_numbers, **params),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(z.shape, z.dtype),
    )
    return HZeros(shape=out.shape, dtype=out.dtype)


@dataclass
class HScaled(qax.ImplicitArray):
    """`x * s` for a scalar `s` (which may be a Python float: a weak-typed leaf)."""

    x: qax.ArrayValue
    s: qax.ArrayValue

    def materialize(self):
        return self.x * self.s

    def compute_shape(self):
        return jnp.shape(self.x)

    def compute_dtype(self):
        return jnp.result_type(self.x)


@qax.primitive_handler("mul")
def hscaled_mul(primitive, a: HScaled, b: jax.Array):
    if jnp.ndim(b) != 0:
        return NotImplemented
    return HScaled(a.x, a.s * b)


# ----------------------------------------------------------------------------------------
# Values


def keys(n: int, seed: int = 0) -> list:
    return list(jax.random.split(jax.random.PRNGKey(seed), n))


def make_lora(d_in: int = 5, d_out: int = 6, rank: int = 2, seed: int = 0, lead=()):
    k = keys(3, seed)
    scale = 1.0 / np.sqrt(d_in)
    return HLora(
        jax.random.normal(k[0], (*lead, d_in, d_out)) * scale,
        jax.random.normal(k[1], (*lead, d_in, rank)) * scale,
        jax.random.normal(k[2], (*lead, d_out, rank)) * 0.5,
    )


def dense(x):
    """Fully materialized version of every implicit array in `x`."""
    return jax.tree_util.tree_map(
        lambda v: (
            qax.materialize_nested(v, full=True)
            if isinstance(v, qax.ImplicitArray)
            else v
        ),
        x,
        is_leaf=lambda v: isinstance(v, qax.ImplicitArray),
    )


# ----------------------------------------------------------------------------------------
# Oracles


def assert_close(got, expected, rtol=1e-5, atol=1e-5):
    got, expected = dense(got), dense(expected)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    leaves = jax.tree_util.tree_leaves
    for g, e in zip(leaves(got), leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)


def _total(out) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(dense(out))
    return sum(
        jnp.sum(jnp.sin(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)
    )


def implicit_loss(f):
    def loss(*args):
        return _total(qax.use_implicit_args(f)(*args))

    return loss


def dense_loss(f):
    def loss(*args):
        return _total(f(*dense(args)))

    return loss


# "grad" (eager, op by op) is slow: most tests use MODES, a few ALL_MODES.
MODES = ["eager", "jit", "jit_grad"]
ALL_MODES = ["eager", "jit", "grad", "jit_grad"]


def check_mode(mode: str, f, *args, argnums=0) -> None:
    """`use_implicit_args(f)` agrees with `f` on the materialized arguments in `mode`.

    For the gradient modes, the loss is differentiated with respect to the leaves of
    the implicit arguments; the oracle differentiates through `materialize()`.
    """
    if mode in ("eager", "jit"):
        run = qax.use_implicit_args(f)
        if mode == "jit":
            run = jax.jit(run)
        assert_close(run(*args), f(*dense(args)))
        return
    got = jax.grad(implicit_loss(f), argnums=argnums)
    expected = jax.grad(dense_loss(f), argnums=argnums)
    if mode == "jit_grad":
        got = jax.jit(got)
    assert_close(got(*args), expected(*args), rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def materializations():
    """Collect the primitive names of MaterializationWarnings (not raised as errors)."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qax.MaterializationWarning)
        yield found
    for w in caught:
        if issubclass(w.category, qax.MaterializationWarning):
            found.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def all_eqns(jaxpr):
    """Every equation of a (Closed)Jaxpr, including those of sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from all_eqns(sub)


def weight_shaped_sums(jaxpr, shapes) -> list:
    """The `add`/`add_any` equations whose result has one of `shapes`."""
    return [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name in ("add", "add_any")
        and tuple(e.outvars[0].aval.shape) in shapes
    ]


def forms_full_lora(jaxpr, d_in: int, d_out: int, rank: int) -> bool:
    """Whether the jaxpr forms `a @ b.T` (a contraction over the rank) of weight size."""
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        out = eqn.outvars[0].aval
        contracted = [lhs.shape[d] for d in lc]
        if contracted == [rank] and tuple(out.shape[-2:]) in (
            (d_in, d_out),
            (d_out, d_in),
        ):
            return True
    return False
