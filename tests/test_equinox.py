"""Equinox: an unmodified model (embedding, conv, layer norm, attention, MLP) with LoRA
weights, under `eqx.filter_jit`, trained on the factors with `eqx.partition`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import LoraKernel, assert_close, lora_kernel

eqx = pytest.importorskip("equinox")


class Net(eqx.Module):
    embed: eqx.nn.Embedding
    conv: eqx.nn.Conv1d
    norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k = jax.random.split(key, 4)
        self.embed = eqx.nn.Embedding(20, 8, key=k[0])
        self.conv = eqx.nn.Conv1d(8, 8, kernel_size=3, padding=1, key=k[1])
        self.norm = eqx.nn.LayerNorm(8)
        self.attn = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=k[2])
        self.mlp = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=k[3])

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        h = self.conv(h.T).T
        h = jax.vmap(self.norm)(h)
        h = h + self.attn(h, h, h)
        return jax.vmap(self.mlp)(h)


TOKENS = jnp.array([1, 5, 7, 2, 9, 3])
TARGET = jax.random.normal(jax.random.key(3), (6, 4))


def _is_linear(x):
    return isinstance(x, eqx.nn.Linear)


def loraify(model, rank=2, seed=1):
    """Every `eqx.nn.Linear` weight (out, in) gets a LoRA."""
    linears = [x for x in jax.tree_util.tree_leaves(model, is_leaf=_is_linear)]
    linears = [x for x in linears if _is_linear(x)]
    keys = jax.random.split(jax.random.key(seed), len(linears))
    return eqx.tree_at(
        lambda m: [
            x.weight
            for x in jax.tree_util.tree_leaves(m, is_leaf=_is_linear)
            if _is_linear(x)
        ],
        model,
        replace=[lora_kernel(x.weight, rank, k) for x, k in zip(linears, keys)],
    )


def dense(model):
    return jax.tree_util.tree_map(
        lambda x: x.dense() if isinstance(x, LoraKernel) else x,
        model,
        is_leaf=lambda x: isinstance(x, LoraKernel),
    )


def call(model, tokens):
    return model(tokens)


@pytest.fixture(scope="module")
def model():
    return loraify(Net(jax.random.key(0)))


def test_forward_eager_and_filter_jit(model):
    kernels = [
        x
        for x in qax.utils.tree_leaves_with_implicit(model)
        if isinstance(x, LoraKernel)
    ]
    assert len(kernels) == 7  # q, k, v, out, 3 MLP layers
    want = call(dense(model), TOKENS)
    assert_close(qax.use_implicit_args(call)(model, TOKENS), want, rtol=1e-4, atol=1e-4)
    assert_close(
        eqx.filter_jit(qax.use_implicit_args(call))(model, TOKENS),
        want,
        rtol=1e-4,
        atol=1e-4,
    )


def factors(model):
    """The filter spec of `eqx.partition`: True on the LoRA factors only."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            isinstance(path[-1], jax.tree_util.GetAttrKey)
            and path[-1].name in ("a", "b")
            and eqx.is_array(x)
        ),
        model,
    )


def test_training_moves_only_the_factors(model):
    diff, static = eqx.partition(model, factors(model))
    opt = optax.adam(3e-2)
    state = opt.init(diff)

    def loss_fn(diff, static):
        out = qax.use_implicit_args(call)(eqx.combine(diff, static), TOKENS)
        return jnp.mean((out - TARGET) ** 2)

    @eqx.filter_jit
    def step(diff, state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(diff, static)
        updates, state = opt.update(grads, state, diff)
        return eqx.apply_updates(diff, updates), state, loss

    losses = []
    for _ in range(4):
        diff, state, loss = step(diff, state)
        losses.append(float(loss))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    trained = eqx.combine(diff, static)
    spec = jax.tree_util.tree_leaves(factors(model))
    before = jax.tree_util.tree_leaves(model)
    after = jax.tree_util.tree_leaves(trained)
    assert len(before) == len(after) == len(spec) and sum(spec) == 14
    for is_factor, old, now in zip(spec, before, after):
        if eqx.is_array(old):
            same = np.array_equal(np.asarray(old), np.asarray(now))
            assert same != is_factor
    assert isinstance(trained.mlp.layers[0].weight, LoraKernel)
