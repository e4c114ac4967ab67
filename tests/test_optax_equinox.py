"""freeze_keys / freeze_subtrees on Equinox models (callable pytrees) and MultiSteps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from qax.utils import freeze_keys, freeze_subtrees
from tests.helpers import TaggedLora, lora_problem, sizes, state_size

eqx = pytest.importorskip("equinox")


class EqxModel(eqx.Module):
    """The two-layer LoRA model of `lora_problem`, as an Equinox module."""

    l1: TaggedLora
    l2: TaggedLora
    bias: jax.Array

    def __call__(self, x):
        return jnp.tanh(x @ self.l1) @ self.l2 + self.bias


def eqx_problem():
    params, x, y = lora_problem()
    return EqxModel(params["l1"], params["l2"], params["bias"]), x, y


def eqx_train(optimizer, model, x, y, steps=20):
    def loss(model, x, y):
        return jnp.mean((qax.use_implicit_args(model)(x) - y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return value, eqx.apply_updates(model, updates), opt_state

    opt_state = optimizer.init(model)
    first = None
    for _ in range(steps):
        value, model, opt_state = step(model, opt_state)
        first = value if first is None else first
    return model, opt_state, first, value


def test_freeze_keys_on_an_equinox_model():
    model, x, y = eqx_problem()
    optimizer = freeze_keys(optax.adam(0.05), TaggedLora, ["w"])
    trained, opt_state, first, last = eqx_train(optimizer, model, x, y)
    assert first / last >= 5
    for name in ("l1", "l2"):
        before, after = getattr(model, name), getattr(trained, name)
        np.testing.assert_array_equal(after.w, before.w)  # bitwise
        assert not np.allclose(after.a, before.a)
    params = {"l1": model.l1, "l2": model.l2, "bias": model.bias}
    trainable = sizes(params, "ab") + model.bias.size
    assert state_size(opt_state) <= 2 * trainable + 8


def test_freeze_subtrees_with_a_label_tree_that_is_an_equinox_module():
    model, x, y = eqx_problem()
    labels = jax.tree_util.tree_map(lambda _: "train", model)
    labels = eqx.tree_at(lambda m: m.bias, labels, "freeze")
    assert callable(labels)
    optimizer = freeze_subtrees(optax.adam(0.05), labels)
    trained, _, first, last = eqx_train(optimizer, model, x, y, steps=5)
    np.testing.assert_array_equal(trained.bias, model.bias)
    assert not np.allclose(trained.l1.w, model.l1.w)
    assert last < first


def test_multisteps_inside_accumulates_only_trained_leaves():
    model, x, y = eqx_problem()
    params = {"l1": model.l1, "l2": model.l2, "bias": model.bias}
    trainable = sizes(params, "ab") + model.bias.size
    inner = freeze_keys(optax.MultiSteps(optax.adam(0.05), 2), TaggedLora, ["w"])
    trained, opt_state, first, last = eqx_train(inner, model, x, y)
    assert last < first
    np.testing.assert_array_equal(trained.l1.w, model.l1.w)
    # Moments and the gradient accumulator: about 3x the trainable size.
    assert state_size(opt_state) <= 3 * trainable + 16
    # The documented pitfall: MultiSteps outside keeps a W-sized accumulator.
    outer = optax.MultiSteps(freeze_keys(optax.adam(0.05), TaggedLora, ["w"]), 2)
    assert state_size(outer.init(model)) >= state_size(inner.init(model)) + sizes(
        params, "w"
    )
