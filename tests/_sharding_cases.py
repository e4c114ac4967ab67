"""Multi-device cases, run by `test_sharding.py` in a process with 8 CPU devices.

Run directly with `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/_sharding_cases.py`; without 8 devices every case is skipped.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ho_types import (
    HZeros,
    all_eqns,
    assert_close,
    check_mode,
    dense,
    forms_full_lora,
    keys,
    make_lora,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qax

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS)", allow_module_level=True)

MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("i",))
ROWS = NamedSharding(MESH, P("i"))
REPLICATED = NamedSharding(MESH, P())
X = jax.random.normal(keys(1, 5)[0], (8, 16))


def lora():
    return make_lora(16, 6)  # w (16, 6), a (16, 2), b (6, 2)


_inner = jax.jit(
    lambda w, x: jnp.tanh(x @ w), in_shardings=(ROWS, REPLICATED), out_shardings=ROWS
)


@pytest.mark.parametrize("mode", ["eager", "jit", "jit_grad"])
def test_jit_named_shardings_on_implicit_operands(mode):
    check_mode(mode, lambda w, x: _inner(w, x), lora(), X)


def test_jit_named_sharding_goes_to_leaves_laid_out_like_the_array():
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda w, x: _inner(w, x)))(lora(), X)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    w, a, b, x = eqn.params["in_shardings"]
    assert w == ROWS and a == ROWS and x == REPLICATED
    assert not isinstance(b, NamedSharding)  # (6, 2) is not laid out like (16, 6)
    out = qax.use_implicit_args(lambda w, x: _inner(w, x))(lora(), X)
    assert out.sharding == ROWS


def test_jit_sharded_implicit_output():
    double = jax.jit(lambda z: z * 2.0, in_shardings=ROWS, out_shardings=ROWS)
    out = qax.use_implicit_args(double)(HZeros(shape=(16, 6)))
    assert isinstance(out, HZeros) and out.shape == (16, 6)


def test_outer_jit_shards_every_leaf():
    f = jax.jit(
        qax.use_implicit_args(lambda z, y: z * y + y),
        in_shardings=(ROWS, ROWS),
        out_shardings=ROWS,
    )
    out = f(HZeros(shape=(16, 6)), jnp.ones((16, 6)))
    assert out.sharding == ROWS
    assert_close(out, jnp.ones((16, 6)))


def _replicated_weight_map(w, x):
    return jax.shard_map(
        lambda x, w: jnp.tanh(x @ w),
        mesh=MESH,
        in_specs=(P("i"), P()),
        out_specs=P("i"),
    )(x, w)


@pytest.mark.parametrize("mode", ["eager", "jit", "grad", "jit_grad"])
def test_shard_map_with_replicated_lora(mode):
    check_mode(mode, _replicated_weight_map, lora(), X)


def test_shard_map_keeps_lora_implicit_and_inserts_pvary_per_leaf():
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(_replicated_weight_map))(lora(), X)
    names = [e.primitive.name for e in all_eqns(jaxpr)]
    assert "shard_map" in names and "pvary" in names
    assert not forms_full_lora(jaxpr, 16, 6, 2)


def test_shard_map_splits_symbolic_zeros():
    seen = []

    def body(z, x):
        seen.append(z.shape)
        return z * 2.0, z + x

    def f(z, x):
        return jax.shard_map(
            body, mesh=MESH, in_specs=(P("i"), P("i")), out_specs=(P("i"), P("i"))
        )(z, x)

    zeros, total = qax.use_implicit_args(f)(HZeros(shape=(16, 6)), jnp.ones((16, 6)))
    assert seen == [(2, 6)]
    assert isinstance(zeros, HZeros) and zeros.shape == (16, 6)
    assert_close(total, jnp.ones((16, 6)))


def test_shard_map_pvary_on_invariant_implicit():
    def f(z, x):
        return jax.shard_map(
            lambda z, x: z + x * z, mesh=MESH, in_specs=(P(), P("i")), out_specs=P("i")
        )(z, x)

    out = qax.use_implicit_args(f)(HZeros(shape=(2, 6)), jnp.ones((16, 6)))
    assert isinstance(out, HZeros) and out.shape == (16, 6)


def test_shard_map_materializes_leaves_that_cannot_be_split():
    def f(w, x):
        return jax.shard_map(
            lambda w, x: x @ w.T,
            mesh=MESH,
            in_specs=(P("i"), P()),
            out_specs=P(None, "i"),
        )(w, x)

    x = jnp.ones((3, 6))
    with pytest.warns(qax.MaterializationWarning, match="shard_map"):
        out = qax.use_implicit_args(f)(lora(), x)
    assert_close(out, f(dense(lora()), x))


@pytest.mark.parametrize("mode", ["eager", "jit", "jit_grad"])
@pytest.mark.parametrize("place", ["constraint", "device_put"])
def test_sharding_annotations_keep_implicit(mode, place):
    def annotate(w):
        if place == "constraint":
            return jax.lax.with_sharding_constraint(w, ROWS)
        return jax.device_put(w, ROWS)

    def f(w, x):
        return jnp.tanh(x @ annotate(w))

    check_mode(mode, f, lora(), X)
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(lora(), X)
    assert not forms_full_lora(jaxpr, 16, 6, 2)


def test_shard_map_implicit_carry_that_varies():
    # `pcast` makes the implicit weight vary over "i" leaf by leaf; its type must say so
    # too (as the materialized array's would), or scan's carry check fails.
    seen = []

    def body(w, x):
        w = jax.lax.pcast(w, "i", to="varying")
        seen.append(jax.typeof(w))

        def step(carry, _):
            return carry, jnp.sum(x @ carry)

        _, ys = jax.lax.scan(step, w, None, length=3)
        return ys

    def f(w, x):
        return jax.shard_map(body, mesh=MESH, in_specs=(P(), P("i")), out_specs=P("i"))(
            w, x
        )

    w = lora()
    out = qax.use_implicit_args(f)(w, X)
    assert_close(out, f(w.materialize(), X))
    implicit_type, dense_type = seen
    assert implicit_type.manual_axis_type.varying == {"i"}
    assert implicit_type == dense_type
