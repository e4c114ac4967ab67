"""Stacks that share a part across their examples: one base under per-example LoRA
factors, built by `jax.vmap` over a closed-over base (inside or outside
`use_implicit_args`) or stacked by hand, of types that declare their batch axes and of
types that declare nothing, over a plain, a symbolic-constant and an implicit base.

Oracle: the same program on the dense stack. A declared stack stays implicit; an
undeclared one is materialized with the reason where it must be; never a crash, nor an
error that blames the user's `materialize()` (issue 35, item 8).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import qax
from qax.symbols import SymbolicConstant
from tests.helpers import assert_close, materializations

L, M, R = 3, 4, 2
_K = jax.random.split(jax.random.PRNGKey(35), 5)
W = jax.random.normal(_K[0], (M, M))
A = 0.5 * jax.random.normal(_K[1], (L, M, R))
B = 0.5 * jax.random.normal(_K[2], (L, M, R))
Y = 0.5 * jax.random.normal(_K[3], (M, M))


def _t(x):
    return jnp.swapaxes(x, -1, -2)


# This file's own types, not tests/helpers.py's: `materialize()` broadcasts over stacked
# factors (helpers.UndeclaredLora's `b.T` reverses every axis of a stack), and the
# handler below is written for one example.


@dataclass
class StackLora(qax.ImplicitArray):
    """Declared: a stack keeps its base stacked beside its factors."""

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.w + self.a @ self.b.T


@dataclass
class PlainLora(qax.ImplicitArray):
    """Declares nothing; its shape is that of `materialize()` (a hand-made stack of
    factors over one base broadcasts)."""

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue

    def materialize(self):
        return self.w + self.a @ _t(self.b)


@qax.primitive_handler("dot_general")
def _plain_lora_matmul(
    primitive, x: jax.Array, w: PlainLora, *, dimension_numbers, **kw
):
    # Written for one (2-D) example.
    (lc, rc), (lb, rb) = dimension_numbers
    if w.ndim != 2 or lb or rb or tuple(lc) != (x.ndim - 1,) or tuple(rc) != (0,):
        return NotImplemented
    out = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **kw
    )
    return out + (x @ w.a) @ w.b.T


@dataclass
class ShapedLora(PlainLora):
    """Declares nothing; its shape comes from `compute_shape()`."""

    def compute_shape(self):
        return (*self.a.shape[:-2], *self.w.shape[-2:])


@dataclass
class Biased(qax.ImplicitArray):
    """Declares nothing, around another implicit array."""

    inner: qax.ArrayValue
    bias: qax.ArrayValue

    def materialize(self):
        return qax.materialize_nested(self.inner) + self.bias


def _dense(x):
    if not isinstance(x, qax.ImplicitArray):
        return x
    with warnings.catch_warnings():  # (a nested base's own materialization)
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        return qax.materialize_nested(x, full=True)


BASES = {
    "array": lambda: W,
    "symbolic": lambda: SymbolicConstant(0.75, shape=(M, M), dtype=jnp.float32),
    "implicit": lambda: StackLora(W, A[0], B[0]),
}


@jax.custom_jvp
def _soft(h):
    return h / (1.0 + jnp.abs(h))


@_soft.defjvp
def _soft_jvp(primals, tangents):
    (h,), (t,) = primals, tangents
    return _soft(h), t / (1.0 + jnp.abs(h)) ** 2


def _scan_rows(s):
    return lax.scan(lambda c, e: (c + e @ Y, None), jnp.zeros((M, M)), s)[0]


def _scan_carry(s):
    return lax.scan(lambda c, _: (jnp.tanh(c), None), s, None, length=2)[0]


def _while(s):
    body = lambda ic: (ic[0] + 1, ic[1] * 0.5 + 1.0)  # noqa: E731
    return lax.while_loop(lambda ic: ic[0] < 2, body, (0, s))[1]


# Programs on a stack `s` of shape (L, M, M).
USES = {
    "vmap": lambda s: jax.vmap(lambda e: jnp.sin(e) @ Y)(s),
    "scan_xs": _scan_rows,
    "scan_carry": _scan_carry,
    "grad": lambda s: jax.grad(lambda s: jnp.sum(jnp.tanh(s @ Y)))(s),
    "custom_jvp": lambda s: _soft(s) + jax.nn.relu(s),
    "while_loop": _while,
    "jit": lambda s: jax.jit(lambda s: (s @ Y).sum(0))(s),
}


def _dense_stack(base):
    return _dense(base()) + A @ _t(B)


def _all_uses(s):
    return tuple(use(s) for use in USES.values())


def _check_uses(build, base, *, inside):
    """Each of `USES` on the stack `build()` (built inside the wrapped function, or
    outside and passed in) against the same program on the dense stack."""
    want = _all_uses(_dense_stack(base))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        if inside:
            got = qax.use_implicit_args(lambda: _all_uses(build()))()
        else:
            got = qax.use_implicit_args(_all_uses)(build())
    for name, g, w in zip(USES, got, want, strict=True):
        try:
            assert_close(g, w, rtol=1e-4, atol=1e-5)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


# ----------------------------------------------------------------------------------------
# Built by `vmap` over a closed-over base


@pytest.mark.parametrize(
    ("cls", "base"),
    [
        (StackLora, "array"),
        (StackLora, "symbolic"),
        (StackLora, "implicit"),
        (PlainLora, "symbolic"),
        (PlainLora, "implicit"),
        (ShapedLora, "symbolic"),
    ],
)
def test_a_stack_built_by_vmap_over_a_shared_base_gives_the_dense_numbers(cls, base):
    make = BASES[base]

    def build():
        return jax.vmap(lambda a, b: cls(make(), a, b))(A, B)

    stack = build()
    assert stack.shape == (L, M, M)
    assert_close(_dense(stack), _dense_stack(make), rtol=1e-5)
    _check_uses(build, make, inside=False)
    _check_uses(build, make, inside=True)


@pytest.mark.parametrize("base", sorted(BASES))
def test_a_declared_stack_built_inside_vmap_inside_the_wrapper_stays_implicit(base):
    make = BASES[base]

    def f():
        return jax.vmap(lambda a, b: StackLora(make(), a, b))(A, B)

    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        for run in (qax.use_implicit_args(f), jax.jit(qax.use_implicit_args(f))):
            got = run()
            assert isinstance(got, StackLora) and got.shape == (L, M, M)
            assert got.a.shape == (L, M, R)
            assert_close(_dense(got), _dense_stack(make), rtol=1e-5)


def test_an_undeclared_stack_built_inside_vmap_inside_the_wrapper_says_why():
    def f():
        return jax.vmap(lambda a, b: PlainLora(W, a, b))(A, B) @ Y

    with materializations() as seen:
        got = qax.use_implicit_args(f)()
    assert any("does not declare" in s and "PlainLora" in s for s in seen), seen
    assert_close(got, _dense_stack(BASES["array"]) @ Y, rtol=1e-4)


# ----------------------------------------------------------------------------------------
# Stacked by hand: one base, stacked factors


@pytest.mark.parametrize(
    ("cls", "base"), [(PlainLora, "array"), (ShapedLora, "symbolic")]
)
def test_a_stack_made_by_hand_gives_the_dense_numbers(cls, base):
    make = BASES[base]

    def build():
        return cls(make(), A, B)

    assert build().shape == (L, M, M)
    _check_uses(build, make, inside=False)
    _check_uses(build, make, inside=True)


# ----------------------------------------------------------------------------------------
# An undeclared part without leaves of its own (a symbolic constant) in a stack


def test_vmap_stacks_an_undeclared_part_around_a_symbolic_constant():
    # `vmap` batches the symbolic constant inside `Biased` whole (it has no leaves to
    # map): the stack was (L, M) biases over an (M, M) constant, which materialized as
    # "vmap got inconsistent sizes".
    consts = jax.vmap(lambda s: SymbolicConstant(0.75, shape=(M, M)))(jnp.arange(L))
    bias = jnp.arange(M, dtype=jnp.float32)

    def build(h):
        return StackLora(Biased(h, bias), A[0], B[0])

    want = jnp.broadcast_to(0.75 + bias + A[0] @ B[0].T, (L, M, M))
    outside = jax.vmap(qax.use_implicit_args(build))(consts)
    assert outside.w.inner.shape == (L, M, M) and outside.w.bias.shape == (L, M)
    with materializations() as seen:  # (built inside `vmap` inside the wrapper)
        inside = qax.use_implicit_args(jax.vmap(build))(consts)
    assert any("Biased" in s and "does not declare" in s for s in seen), seen
    for stack in (outside, inside):
        assert stack.shape == (L, M, M)
        assert_close(_dense(stack), want, rtol=1e-5)
        # mapped again and scanned: each example is one LoRA over one constant
        rows = jax.vmap(lambda e: _dense(e) @ Y)(stack)
        assert_close(rows, want @ Y, rtol=1e-4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", qax.MaterializationWarning)
            total = qax.use_implicit_args(_scan_rows)(stack)
        assert_close(total, (want @ Y).sum(0), rtol=1e-4)


# ----------------------------------------------------------------------------------------
# A stack over a shape-only base, its leaves sliced or stacked outside the wrapper


@pytest.mark.parametrize("cls", [StackLora, PlainLora, ShapedLora])
def test_leaves_sliced_or_stacked_around_a_symbolic_constant_base(cls):
    # A symbolic constant has no leaves: `lax.scan` and `tree_map` slice the factors
    # beside it but not it. It takes their batch shape (it was left (L, M, M) beside
    # (M, R) factors: "fields that do not fit", or a row whose `materialize()` was
    # blamed for the stack's shape).
    stack = jax.vmap(lambda a, b: cls(BASES["symbolic"](), a, b))(A, B)
    want = _dense_stack(BASES["symbolic"])
    x = jnp.ones((5, M))
    with warnings.catch_warnings():  # (`h @ w` materializes: no handler takes it)
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        got = lax.scan(
            qax.use_implicit_args(lambda h, w: (jnp.tanh(h @ w), None)), x, stack
        )
    assert_close(got[0], lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, want)[0])
    row = jax.tree_util.tree_map(lambda leaf: leaf[1], stack)
    assert row.shape == (M, M)
    assert_close(_dense(row), want[1], rtol=1e-5)
    restacked = jax.tree_util.tree_map(lambda *r: jnp.stack(r), row, row)
    assert restacked.shape == (2, M, M)
    assert_close(_dense(restacked), jnp.stack([want[1], want[1]]), rtol=1e-5)
