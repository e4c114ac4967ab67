"""Types that declare no batch axes: JAX's pytree meaning under `vmap` outside
`use_implicit_args`, stacks of examples that stay right everywhere else.

The oracle is the materialized computation; where a stack of examples meets a handler
written for one example, it is materialized first (never wrong numbers).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from tests.helpers import LoraMatrix, UndeclaredLora, assert_close

KEY = jax.random.PRNGKey(7)


@dataclass
class FilledConst(qax.ImplicitArray):
    """An array filled with `value`; `tag` is an extra leaf that plays no part."""

    value: qax.ArrayValue
    tag: qax.ArrayValue
    default_dtype = jnp.float32

    def materialize(self):
        return jnp.full(self.shape, self.value, dtype=self.dtype)


@qax.primitive_handler("mul")
def _filled_mul(primitive, a: FilledConst, b: jax.Array):
    return jnp.broadcast_to(a.value * b, a.shape).astype(a.dtype)


# Not helpers.Scaled: its `mul` handler takes any operand and is right for one example
# only (what this file tests); helpers.Scaled's refuses a non-scalar operand.
@dataclass
class UndeclaredScaled(qax.ImplicitArray):
    """`x * s` for a scalar `s`; its handler is written for one example."""

    x: qax.ArrayValue
    s: qax.ArrayValue

    def materialize(self):
        return self.x * self.s


@qax.primitive_handler("mul")
def _scaled_mul(primitive, a: UndeclaredScaled, b: jax.Array):
    # Right for a scalar `s` only: on a stack of examples (`s` of shape [n]) it would
    # broadcast `s` along the last axis.
    return a.x * a.s * b


@dataclass
class Wrapper(qax.ImplicitArray):
    """An undeclared type around a declared one."""

    inner: qax.ArrayValue
    bias: qax.ArrayValue

    def materialize(self):
        return qax.materialize_nested(self.inner) + self.bias


def _lora(cls, key, stack=(), m=8, n=6, r=2, **kw):
    kw_, ka, kb = jax.random.split(key, 3)
    return cls(
        jax.random.normal(kw_, (*stack, m, n)),
        jax.random.normal(ka, (*stack, m, r)),
        jax.random.normal(kb, (*stack, n, r)),
        **kw,
    )


def _dense(x):
    if isinstance(x, qax.ImplicitArray):
        return qax.materialize_nested(x, full=True)
    return x


# ----------------------------------------------------------------------------------------
# vmap outside `use_implicit_args`: each leaf is mapped, each example rebuilt


def test_vmap_maps_each_leaf_and_keeps_a_shape_that_materialize_reads():
    # As in the original Qax: three constants of shape (7, 11), one per value.
    xs = FilledConst(jnp.arange(3.0), jnp.arange(-100, -97), shape=(7, 11))
    ys = jax.random.normal(KEY, (7, 11))

    def f(x, y):
        return jnp.sum(x * y)

    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        got = jax.vmap(qax.use_implicit_args(f), in_axes=(0, None))(xs, ys)
    want = jax.vmap(f, in_axes=(0, None))(
        jnp.broadcast_to(jnp.arange(3.0)[:, None, None], (3, 7, 11)), ys
    )
    assert_close(got, want, rtol=1e-5)


def test_vmap_examples_get_the_shape_of_what_they_materialize():
    stacked = _lora(UndeclaredLora, KEY, stack=(3,), shape=(3, 8, 6), dtype=jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 8))
    seen = []

    def f(x, w):
        seen.append(w.shape)
        return x @ w

    with pytest.warns(qax.MaterializationWarning, match="dot_general"):
        got = jax.vmap(qax.use_implicit_args(f))(x, stacked)
    assert seen == [(8, 6)]
    want = jax.vmap(lambda x, w, a, b: x @ (w + a @ b.T))(
        x, stacked.w, stacked.a, stacked.b
    )
    assert_close(got, want, rtol=1e-4)


def test_vmap_with_a_leaf_that_cannot_be_mapped_fails_as_for_any_pytree():
    v = UndeclaredScaled(jnp.ones((3, 4)), jnp.asarray(2.0))
    with pytest.raises(ValueError, match="rank"):
        jax.vmap(qax.use_implicit_args(lambda v: v.sum()))(v)


# ----------------------------------------------------------------------------------------
# Instances built inside `vmap` come out as stacks of examples


def test_instances_built_inside_vmap_come_out_stacked():
    xs = jax.random.normal(KEY, (4, 3))
    scales = jnp.arange(1.0, 5.0)
    stacked = jax.vmap(UndeclaredScaled)(xs, scales)
    assert isinstance(stacked, UndeclaredScaled)
    assert stacked.shape == (4, 3) and stacked.x.shape == (4, 3)
    assert stacked.s.shape == (4,)
    assert_close(stacked.materialize(), xs * scales[:, None])
    # and a `vmap` over it hands back the examples
    rows = jax.vmap(lambda e: (e.shape, e.materialize()))(stacked)
    assert_close(rows[1], xs * scales[:, None])


def test_a_stack_of_examples_never_reaches_a_handler_for_one_example():
    xs = jax.random.normal(KEY, (4, 4))  # square: a wrong broadcast would not fail
    scales = jnp.arange(1.0, 5.0)
    stacked = jax.vmap(UndeclaredScaled)(xs, scales)
    y = jax.random.normal(jax.random.PRNGKey(2), (4, 4))
    with pytest.warns(qax.MaterializationWarning, match="stacked by `jax.vmap`"):
        got = qax.use_implicit_args(lambda a, y: a * y)(stacked, y)
    assert_close(got, xs * scales[:, None] * y)
    # mapped again outside, each example meets the handler, implicitly
    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        mapped = jax.vmap(qax.use_implicit_args(lambda a, y: a * y))(stacked, y)
    assert_close(mapped, xs * scales[:, None] * y)


def test_stacks_of_examples_nest_and_survive_jit_grad_and_scan():
    xs = jax.random.normal(KEY, (2, 3, 5))
    scales = jax.random.normal(jax.random.PRNGKey(3), (2, 3))
    twice = jax.vmap(jax.vmap(UndeclaredScaled))(xs, scales)
    assert twice.shape == (2, 3, 5)
    want = xs * scales[..., None]
    assert_close(twice.materialize(), want)
    # through jit (flattened and rebuilt)
    assert_close(jax.jit(lambda t: t.materialize())(twice), want)
    # a scan outside slices leaves: each row is a stack of 3 examples
    _, rows = lax.scan(lambda c, row: (c, row.materialize()), 0.0, twice)
    assert_close(rows, want)
    # indexing leaves gives one example of the outer stack
    first = jax.tree_util.tree_map(lambda leaf: leaf[0], twice)
    assert first.shape == (3, 5)
    assert_close(first.materialize(), want[0])
    # gradients with respect to the leaves of a stack
    grads = jax.grad(lambda t: jnp.sum(jnp.sin(t.materialize())))(twice)
    assert isinstance(grads, UndeclaredScaled) and grads.shape == twice.shape
    assert_close(grads.x, jnp.cos(want) * scales[..., None], rtol=1e-5)


def test_vmap_stacks_an_undeclared_type_around_a_declared_one():
    keys = jax.random.split(KEY, 3)

    def build(key):
        return Wrapper(_lora(LoraMatrix, key), jnp.ones(6))

    stacked = jax.vmap(build)(keys)
    assert isinstance(stacked, Wrapper) and stacked.shape == (3, 8, 6)
    assert isinstance(stacked.inner, LoraMatrix) and stacked.inner.shape == (3, 8, 6)
    want = jnp.stack([_dense(build(k)) for k in keys])
    assert_close(stacked.materialize(), want, rtol=1e-5)
    x = jax.random.normal(KEY, (5, 8))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", qax.MaterializationWarning)
        got = jax.vmap(qax.use_implicit_args(lambda w: x @ w))(stacked)
    assert any("Wrapper" in str(w.message) for w in seen)
    assert_close(got, jnp.einsum("ij,ljk->lik", x, want), rtol=1e-4)


def test_scan_inside_slices_a_stack_of_examples_leaf_by_leaf():
    xs = jax.random.normal(KEY, (4, 3))
    scales = jnp.arange(1.0, 5.0)
    stacked = jax.vmap(UndeclaredScaled)(xs, scales)
    y = jnp.ones(3)

    def f(a):
        def body(c, row):
            return (
                c + row * y,
                None,
            )  # `row` is one UndeclaredScaled: its handler applies

        return lax.scan(body, jnp.zeros(3), a)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error", qax.MaterializationWarning)
        got = qax.use_implicit_args(f)(stacked)
    assert_close(got, (xs * scales[:, None]).sum(0), rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Inside `use_implicit_args`: declared batching only, else the dense numbers


def test_vmap_inside_use_implicit_args_gives_the_dense_numbers():
    v = UndeclaredScaled(jax.random.normal(KEY, (3, 4)), jnp.asarray(2.0))

    def f(v):
        return jax.vmap(lambda row: jnp.sum(row * row))(v)

    with pytest.warns(qax.MaterializationWarning, match="mul"):
        got = qax.use_implicit_args(f)(v)
    assert_close(got, f(_dense(v)))


def test_scan_inside_over_an_undeclared_type_is_materialized_with_a_warning():
    v = UndeclaredScaled(jax.random.normal(KEY, (3, 4)), jnp.asarray(2.0))

    def f(v):
        return lax.scan(lambda c, row: (c + row, None), jnp.zeros(4), v)[0]

    with pytest.warns(qax.MaterializationWarning, match="does not declare"):
        got = qax.use_implicit_args(f)(v)
    assert_close(got, f(_dense(v)))


def test_stacked_values_in_nested_vmaps_match_the_dense_stack():
    keys = jax.random.split(KEY, 6).reshape(2, 3, 2)
    stacked = jax.vmap(jax.vmap(lambda k: _lora(UndeclaredLora, k, m=4, n=4)))(keys)
    assert stacked.shape == (2, 3, 4, 4)
    want = np.stack(
        [
            np.stack([_dense(_lora(UndeclaredLora, k, m=4, n=4)) for k in row])
            for row in keys
        ]
    )
    assert_close(stacked.materialize(), want, rtol=1e-5)
    y = jax.random.normal(KEY, (4, 4))
    with pytest.warns(qax.MaterializationWarning):
        got = qax.use_implicit_args(lambda w: w @ y)(stacked)
    assert_close(got, want @ y, rtol=1e-4)


def test_vmap_over_a_value_built_inside_maps_its_leaves_as_the_dense_program_does():
    xs = jax.random.normal(KEY, (4, 3))
    scales = jnp.arange(1.0, 5.0)

    def f(xs, scales):
        # `shape` given for one example, as the original Qax's types did
        stack = UndeclaredScaled(xs, scales, shape=(3,), dtype=jnp.float32)
        return jax.vmap(lambda e: _dense(e * 2.0))(stack)

    with pytest.warns(qax.MaterializationWarning, match="built inside `jax.vmap`"):
        got = qax.use_implicit_args(f)(xs, scales)
    assert_close(got, f(xs, scales))
    assert_close(got, 2.0 * xs * scales[:, None])
