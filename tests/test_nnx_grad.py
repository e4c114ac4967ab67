"""`qax.nnx.value_and_grad` / `qax.nnx.grad`: QLoRA under NNX by the LoRA recipe
(issue 36, 7).

The recipe of docs/guides/frameworks.md (`nnx.DiffState(0, qax.nnx.holds(LoraWeight))`,
`qax.nnx.Optimizer` with `qax.freeze_keys`) with one name changed, on a quantized base;
the oracle is the documented split recipe on the merged dense model.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import assert_close

# Whole models on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

nnx = pytest.importorskip("flax.nnx")
qnnx = pytest.importorskip("qax.nnx")

LoraWeight = qax.lora.LoraWeight
LORA = qnnx.holds(LoraWeight)
CODES = {"nf4": "packed", "int8": "q", "int3": "packed"}
OPTIONS = {"nf4": {"block_size": 16}, "int8": {}, "int3": {"group_size": 16}}
TOKENS = jnp.array([[1, 5, 7, 2, 9, 3], [4, 4, 0, 19, 8, 6]])
TARGET = jax.random.normal(jax.random.key(7), (2, 6, 16))


class QNet(nnx.Module):
    """An embedding, a layer norm and two Linear layers (quantized, with LoRA)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, tokens):
        return self.fc2(jax.nn.gelu(self.fc1(self.norm(self.embed(tokens)))))


def qlora_model(fmt):
    model = QNet(nnx.Rngs(0))
    base = qax.quant.quantize(nnx.state(model, nnx.Param), fmt, **OPTIONS[fmt])
    nnx.update(model, qax.lora.loraify(base, 2, key=jax.random.key(1), alpha=4.0))
    for layer in (model.fc1, model.fc2):  # non-zero `b`: both factors get gradients
        lora = layer.kernel.get_value()
        b = 0.1 * jax.random.normal(jax.random.key(2), lora.b.shape)
        layer.kernel.set_value(LoraWeight(lora.w, lora.a, b, alpha=4.0))
    return model


def loss_fn(model, tokens, target):
    out = qax.use_implicit_args(lambda m, t: m(t))(model, tokens)
    return jnp.mean((out - target) ** 2)


def dense_loss(graphdef, adapters, base, rest, tokens, target):
    """The oracle: the merged dense model (base decoded, `w + s·a@b` formed), no qax."""
    dense = qax.lora.merge(qax.lora.combine(adapters, base))
    out = nnx.merge(graphdef, dense, rest)(tokens)
    return jnp.mean((out - target) ** 2)


def stored(model, fmt):
    """The base weights' codes and scales, as numpy arrays."""
    return [
        np.asarray(leaf)
        for layer in (model.fc1, model.fc2)
        for leaf in jax.tree_util.tree_leaves(layer.kernel.get_value().w)
    ]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
@pytest.mark.parametrize("fmt", ["nf4", "int8", "int3"])
def test_qlora_trains_by_the_lora_recipe(fmt, jit):
    model, reference = qlora_model(fmt), qlora_model(fmt)
    before = stored(model, fmt)
    tx = qax.freeze_keys(optax.adam(1e-2), LoraWeight, ["w"])
    optimizer = qnnx.Optimizer(model, tx, wrt=LORA)

    def train_step(model, optimizer, tokens, target):
        grad_fn = qnnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LORA))
        loss, grads = grad_fn(model, tokens, target)
        optimizer.update(model, grads)
        return loss

    if jit:
        train_step = nnx.jit(train_step)
    # The oracle: the split recipe, differentiated on the merged dense model.
    graphdef, lora_state, rest = nnx.split(reference, LORA, ...)
    adapters, base = qax.lora.split(lora_state)
    ref_tx = optax.adam(1e-2)
    ref_state = ref_tx.init(adapters)
    oracle = jax.value_and_grad(functools.partial(dense_loss, graphdef))
    losses = []
    for _ in range(3):
        losses.append(train_step(model, optimizer, TOKENS, TARGET))
        want, grads = oracle(adapters, base, rest, TOKENS, TARGET)
        assert_close(losses[-1], want, rtol=1e-5, atol=1e-6)
        updates, ref_state = ref_tx.update(grads, ref_state, adapters)
        adapters = optax.apply_updates(adapters, updates)
    assert float(losses[-1]) < float(losses[0])
    for name in ("fc1", "fc2"):
        got = getattr(model, name).kernel.get_value()
        want = adapters[name]["kernel"].get_value()
        assert isinstance(got, LoraWeight)
        assert isinstance(got.w, qax.quant.QuantizedWeight)
        assert_close(got.a, want.a, rtol=1e-4, atol=1e-6)
        assert_close(got.b, want.b, rtol=1e-4, atol=1e-6)
    # The base (codes and scales) is bitwise what it was.
    after = stored(model, fmt)
    assert all(np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    assert getattr(model.fc1.kernel.get_value().w, CODES[fmt]).dtype in (
        jnp.uint8,
        jnp.int8,
    )


def test_grads_are_the_factors_and_float0_codes():
    # `qax.nnx.grad` (and the decorator form): the factors' gradients are the dense
    # oracle's, the codes get float0 and the frozen base's scales zero.
    model = qlora_model("nf4")

    @qnnx.grad(argnums=nnx.DiffState(0, LORA), has_aux=True)
    def with_aux(model, tokens, target):
        return loss_fn(model, tokens, target), "aux"

    grads, aux = with_aux(model, TOKENS, TARGET)
    assert aux == "aux"
    graphdef, lora_state, rest = nnx.split(model, LORA, ...)
    adapters, base = qax.lora.split(lora_state)
    want = jax.grad(functools.partial(dense_loss, graphdef))(
        adapters, base, rest, TOKENS, TARGET
    )
    for name in ("fc1", "fc2"):
        g = grads[name]["kernel"].get_value()
        assert isinstance(g, LoraWeight)
        w = want[name]["kernel"].get_value()
        assert_close(g.a, w.a, rtol=1e-4, atol=1e-6)
        assert_close(g.b, w.b, rtol=1e-4, atol=1e-6)
        assert g.w.packed.dtype == jax.dtypes.float0
        assert not np.asarray(g.w.absmax).any()


def test_plain_nnx_grad_on_a_quantized_base_names_the_recipe():
    # The recipe unchanged (nnx.value_and_grad) on QLoRA: JAX would refuse the codes;
    # the error names the Variable, the field and the recipe that works.
    model = qlora_model("nf4")
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LORA))
    with pytest.raises(TypeError) as info:
        grad_fn(model, TOKENS, TARGET)
    message = str(info.value)
    for part in ("qax.nnx.value_and_grad", "fc1", "packed", "uint8", "NF4Weight"):
        assert part in message, message
    # With allow_int=True, what JAX does is left alone (float0 for the codes).
    _, grads = nnx.value_and_grad(
        loss_fn, argnums=nnx.DiffState(0, LORA), allow_int=True
    )(model, TOKENS, TARGET)
    assert grads["fc1"]["kernel"].get_value().w.packed.dtype == jax.dtypes.float0


def test_integer_arrays_outside_implicit_values_are_still_refused():
    class Counted(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((3,)))
            self.count = nnx.Param(jnp.arange(3))

        def __call__(self, x):
            return jnp.sum(self.w * x) + jnp.sum(self.count)

    with pytest.raises(TypeError, match=r"int32 at .*count"):
        qnnx.grad(lambda m, x: m(x))(Counted(), jnp.ones((3,)))
    with pytest.raises(TypeError, match="argument 1 has int32"):
        qnnx.grad(lambda x, i: jnp.sum(x) + i, argnums=(0, 1))(
            jnp.ones(3), jnp.int32(2)
        )


def test_on_plain_lora_it_matches_nnx_value_and_grad():
    model = QNet(nnx.Rngs(0))
    nnx.update(
        model,
        qax.lora.loraify(nnx.state(model, nnx.Param), 2, key=jax.random.key(1)),
    )
    ours = qnnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LORA))
    theirs = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, LORA))
    (v1, g1), (v2, g2) = ours(model, TOKENS, TARGET), theirs(model, TOKENS, TARGET)
    assert_close(v1, v2, rtol=1e-6)
    assert_close(g1, g2, rtol=1e-6)
