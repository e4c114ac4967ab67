"""Eager (un-jitted) calls: the fast paths give what the ordinary paths give.

Outside `jax.jit`, qax skips JAX's Python staging where it can: operators on implicit
tracers bind the `jit` remembered for their operand types, `jnp` calls on plain arrays
run a compiled copy of their jaxpr, and bodies that only forward values skip XLA. These
tests compare every fast path with the computation on materialized arrays, and check
that nothing is cached that must not be (scalar values, JAX's configuration, handler
registrations, Python side effects, warnings).
"""

import operator
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax import _interpreter
from qax.symbols import SymbolicConstant
from tests.helpers import Zeros, assert_close, make_lora

X = jnp.arange(12.0).reshape(3, 4) - 5.0

BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "truediv": operator.truediv,
    "pow": operator.pow,
    "lt": operator.lt,
    "ge": operator.ge,
    "eq": operator.eq,
}


def _twice(f, *args):
    """`f(*args)` twice: the first call fills the caches, the second uses them."""
    first = f(*args)
    second = f(*args)
    return first, second


@pytest.mark.parametrize("name", list(BINARY), ids=list(BINARY))
@pytest.mark.parametrize("side", ["implicit_left", "implicit_right"])
def test_operators_match_dense(name, side):
    op = BINARY[name]
    c = SymbolicConstant(2.0, shape=(3, 4), dtype=jnp.float32)
    if side == "implicit_left":
        f = qax.use_implicit_args(lambda c, x: op(c, x))
        expected = op(jnp.full((3, 4), 2.0), X)
    else:
        f = qax.use_implicit_args(lambda c, x: op(x, c))
        expected = op(X, jnp.full((3, 4), 2.0))
    for got in _twice(f, c, X):
        assert_close(qax.materialize_nested(got, full=True), expected)
    if side == "implicit_left":  # the second call took the remembered `jit`
        assert any(key[0] == name for key in _interpreter._operator_binds)


@pytest.mark.parametrize("name", ["neg", "abs", "pos"])
def test_unary_operators_match_dense(name):
    op = getattr(operator, name)
    c = SymbolicConstant(-3.0, shape=(2,), dtype=jnp.float32)
    f = qax.use_implicit_args(op)
    for got in _twice(f, c):
        assert isinstance(got, SymbolicConstant)
        assert_close(got.materialize(), op(jnp.full((2,), -3.0)))


def test_scalar_operand_values_are_not_cached():
    """`c * 2.0` and `c * 3.0` share operand types, not results."""
    c = SymbolicConstant(1.5, shape=(2,), dtype=jnp.float32)
    f = qax.use_implicit_args(lambda c, s: c * s)
    for s in (2.0, 3.0, 2.0, -0.0, 0.0):
        got = f(c, s)
        assert isinstance(got, SymbolicConstant)
        assert got.value == 1.5 * s
        assert np.signbit(got.value) == np.signbit(1.5 * s)


def test_operator_reruns_handlers_and_python_side_effects():
    calls = []

    def f(z, x):
        calls.append(1)  # a Python side effect of the user's function
        return z * x + x

    f_implicit = qax.use_implicit_args(f)
    for _ in range(3):
        got = f_implicit(Zeros(shape=(3, 4)), X)
        assert_close(got, X)
    assert len(calls) == 3


def test_operator_follows_jax_configuration():
    """Cached under one rank-promotion mode, still refused under "raise"."""
    z = Zeros(shape=(3, 4))
    row = jnp.ones((4,))
    f = qax.use_implicit_args(lambda z, r: z * r)
    _twice(f, z, row)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="rank_promotion"):
            f(z, row)


def test_operator_sees_new_handlers():
    """A handler registered after an operator was cached applies to the next call."""

    class Tagged(qax.ImplicitArray):
        default_dtype = jnp.float32

        def materialize(self):
            return jnp.ones(self.shape, self.dtype)

    t = Tagged(shape=(3, 4))
    f = qax.use_implicit_args(lambda t, x: t * x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        for got in _twice(f, t, X):
            assert_close(got, X)

    @qax.primitive_handler("mul")
    def tagged_mul(primitive, a: Tagged, b: jax.Array):
        return b * 2.0

    assert_close(f(t, X), 2.0 * X)


def test_materialization_warns_on_every_call():
    lora = make_lora(jax.random.PRNGKey(0))
    f = qax.use_implicit_args(lambda w: w + 1.0)
    for _ in range(3):
        with pytest.warns(qax.MaterializationWarning):
            got = f(lora)
        assert_close(got, lora.materialize() + 1.0)


def test_operator_on_implicit_array_outside_use_implicit_args():
    z = Zeros(shape=(3, 4))
    for _ in range(3):
        got = z * X
        assert isinstance(got, Zeros)
        assert got.shape == (3, 4)
        assert_close(z + X, X)


def test_forwarding_body_returns_the_operand():
    """`zeros + x` compiles to a body without equations: no XLA call, same values."""
    f = qax.use_implicit_args(lambda z, x: jnp.add(z, x))
    for got in _twice(f, Zeros(shape=(3, 4)), X):
        assert_close(got, X)


def test_plain_jnp_calls_inside_match_dense():
    lora = make_lora(jax.random.PRNGKey(1))
    x = jax.random.normal(jax.random.PRNGKey(2), (4, 6))

    def model(w, x):
        h = jnp.tanh(x @ w)
        scores = jnp.einsum("ij,kj->ik", h, h)
        return jax.nn.softmax(scores, axis=-1).sum(axis=0) + jnp.mean(h)

    f = qax.use_implicit_args(model)
    expected = model(lora.materialize(), x)
    for _ in range(3):
        assert_close(f(lora, x), expected, rtol=1e-4, atol=1e-5)


def test_user_jit_with_donation_and_shardings_inside():
    """`jit`s with non-default parameters keep JAX's own eager path."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    g = jax.jit(lambda a, b: a * b + 1.0, out_shardings=sharding)
    h = jax.jit(lambda a: a - 1.0, donate_argnums=0)

    def f(z, x):
        return h(g(x, x)) + z

    f_implicit = qax.use_implicit_args(f)
    for _ in range(3):
        assert_close(f_implicit(Zeros(shape=(3, 4)), X), X * X)


def test_eager_caches_do_not_grow_over_calls():
    lora = make_lora(jax.random.PRNGKey(3))
    x = jnp.ones((2, 6))

    def f(w, x, z):
        return jnp.sum(jax.nn.relu(x @ w) * 2.0), z * 3.0

    f_implicit = qax.use_implicit_args(f)
    z = Zeros(shape=(3,))
    for _ in range(3):
        f_implicit(lora, x, z)
    sizes = (len(_interpreter._eager_jits), len(_interpreter._operator_binds))
    for _ in range(20):
        f_implicit(lora, x, z)
    assert (len(_interpreter._eager_jits), len(_interpreter._operator_binds)) == sizes


def test_effects_inside_jits_run_on_every_call(capsys):
    g = jax.jit(lambda a: (jax.debug.print("seen {}", a.sum()), a * 2.0)[1])
    f = qax.use_implicit_args(lambda z, x: g(x) + z)
    for _ in range(3):
        assert_close(f(Zeros(shape=(3, 4)), X), 2.0 * X)
    jax.effects_barrier()
    assert capsys.readouterr().out.count("seen") == 3


def test_warm_jit_caches_do_not_bypass_implicit_operands():
    """The eager trace keys `jit` caches as the eval trace does (`share_jit_key`).

    Calls compiled at top level are then reused inside for plain operands; a call with
    an implicit operand of the same shape must still reach its handler.
    """
    g = jax.jit(lambda a, b: a * b + b)
    x = jnp.full((3, 4), 3.0)
    assert_close(g(x, X), 4.0 * X)  # compiled for f32[3,4] at top level
    assert_close(jnp.multiply(x, X), 3.0 * X)

    def f(z, x):
        return g(z, x), jnp.multiply(z, x), g(x, x), jnp.multiply(x, x)

    f_implicit = qax.use_implicit_args(f)
    with qax.materialization_policy(Zeros, "error"):
        for _ in range(3):
            via_jit, product, plain_jit, plain = f_implicit(Zeros(shape=(3, 4)), x)
            assert isinstance(product, Zeros)
            assert_close(via_jit, x)
            assert_close(plain_jit, x * x + x)
            assert_close(plain, x * x)


def test_eager_trace_shares_the_top_level_jit_key():
    """Plain `jnp` calls inside an eager call hit what the same calls compiled outside.

    A jitted function's C++ cache holds one entry per (signature, `jit` key): calls
    inside add none. (With tracer-leak checking on, each eager call gets a trace of its
    own, so the harness's setting is turned off here.)
    """
    h = jax.jit(lambda a: jnp.sin(a) * 2.0)
    with jax.check_tracer_leaks(False):
        h(X)
        assert h._cache_size() == 1
        f = qax.use_implicit_args(lambda z, x: h(x) + z)
        for _ in range(3):
            assert_close(f(Zeros(shape=(3, 4)), X), jnp.sin(X) * 2.0)
        assert h._cache_size() == 1
