"""Flax NNX: an unmodified model with LoRA kernels, eager, under nnx.jit / jax.jit, trained."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import LoraKernel, assert_close, lora_kernel

nnx = pytest.importorskip("flax.nnx")
treescope = pytest.importorskip("treescope")
qnnx = pytest.importorskip("qax.nnx")


class Net(nnx.Module):
    """Embedding, conv, layer norm, attention and MLP, from NNX's own layers."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 8, rngs=rngs)
        self.conv = nnx.Conv(8, 8, kernel_size=(3,), rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
        )
        self.fc1 = nnx.Linear(8, 16, rngs=rngs)
        self.fc2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, tokens):
        h = self.norm(self.conv(self.embed(tokens)))
        h = h + self.attn(h)
        return self.fc2(jax.nn.gelu(self.fc1(h)))


def loraify(model, rank=2, seed=1):
    """Give every Linear / LinearGeneral kernel of `model` a LoRA."""
    key = jax.random.key(seed)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, (nnx.Linear, nnx.LinearGeneral)):
            split = (
                len(getattr(module, "in_features", ()))
                if isinstance(module, nnx.LinearGeneral)
                else 1
            )
            key, sub = jax.random.split(key)
            w = module.kernel.get_value()
            module.kernel.set_value(lora_kernel(w, rank, sub, split=split))
    return model


def dense_copy(model):
    """The same model with every LoRA kernel materialized (the oracle)."""
    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map(
        lambda x: x.dense() if isinstance(x, LoraKernel) else x,
        state,
        is_leaf=lambda x: isinstance(x, LoraKernel),
    )
    return nnx.merge(graphdef, state)


def apply(model, tokens):
    return model(tokens)


TOKENS = jnp.array([[1, 5, 7, 2, 9, 3], [4, 4, 0, 19, 8, 6]])
TARGET = jax.random.normal(jax.random.key(3), (2, 6, 4))


@pytest.fixture
def model():
    return loraify(Net(nnx.Rngs(0)))


def _lora_kernels(model):
    return [
        v.get_value()
        for _, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Variable) and isinstance(v.get_value(), LoraKernel)
    ]


def test_forward_eager_and_jitted_in_every_order(model):
    assert len(_lora_kernels(model)) == 6  # q, k, v, out, fc1, fc2
    want = apply(dense_copy(model), TOKENS)
    wrapped = qax.use_implicit_args(apply)
    assert_close(wrapped(model, TOKENS), want, rtol=1e-4, atol=1e-4)
    assert_close(nnx.jit(wrapped)(model, TOKENS), want, rtol=1e-4, atol=1e-4)
    assert_close(
        qax.use_implicit_args(nnx.jit(apply))(model, TOKENS), want, rtol=1e-4, atol=1e-4
    )
    graphdef, state = nnx.split(model)
    by_state = jax.jit(qax.use_implicit_args(lambda s, t: nnx.merge(graphdef, s)(t)))(
        state, TOKENS
    )
    assert_close(by_state, want, rtol=1e-4, atol=1e-4)


def test_jaxpr_never_forms_the_dense_kernel(model):
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(
        qax.use_implicit_args(lambda s, t: nnx.merge(graphdef, s)(t))
    )(state, TOKENS)
    # W + A Bᵀ would be an add whose operands have the kernel's shape (16, 4) etc.
    kernel_shapes = {tuple(k.shape) for k in _lora_kernels(model)}
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "add":
            shapes = {tuple(v.aval.shape) for v in eqn.invars}
            assert not shapes & kernel_shapes - {(8,)}, eqn


def loss_fn(model, tokens, target):
    return jnp.mean((qax.use_implicit_args(apply)(model, tokens) - target) ** 2)


def _snapshot(model):
    return jax.tree_util.tree_map(np.asarray, nnx.state(model))


def _train_step(trainable):
    def step(model, opt, tokens, target):
        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable))
        loss, grads = grad_fn(model, tokens, target)
        opt.update(model, grads)
        return loss

    return step


def _train(model, jit, steps=4):
    trainable = qnnx.holds(LoraKernel)
    tx = qax.freeze_keys(optax.adam(3e-2), LoraKernel, ["w"])
    opt = qnnx.Optimizer(model, tx, wrt=trainable)
    step = _train_step(trainable)
    if jit:
        step = nnx.jit(step)
    return [float(step(model, opt, TOKENS, TARGET)) for _ in range(steps)], opt


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_training_moves_only_the_factors(model, jit):
    before = _snapshot(model)
    steps = 4 if jit else 2  # eager steps interpret every primitive: keep them few
    losses, opt = _train(model, jit, steps)
    assert losses[-1] < losses[0], losses
    assert int(opt.step[...]) == steps
    after = _snapshot(model)
    flat_before = dict(jax.tree_util.tree_leaves_with_path(before))
    changed = {
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(after)
        if not np.array_equal(leaf, flat_before[path])
    }
    # Only the factors moved; the base kernels, biases, embedding, conv and norm are
    # bitwise unchanged.
    assert changed and all(p.endswith((".a", ".b")) for p in changed), changed
    assert len(changed) == 12
    for k in _lora_kernels(model):
        assert isinstance(k, LoraKernel)


def test_optimizer_inside_the_wrapper_says_where_it_belongs(model):
    trainable = qnnx.holds(LoraKernel)
    opt = qnnx.Optimizer(model, optax.sgd(0.1), wrt=trainable)
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, trainable))(
        model, TOKENS, TARGET
    )
    with pytest.raises(
        RuntimeError, match=r"(?s)inside `qax.use_implicit_args`.*def loss_fn"
    ):
        qax.use_implicit_args(lambda m, o, g: o.update(m, g))(model, opt, grads)


class Stats(nnx.Module):
    """A LoRA layer followed by batch norm, whose statistics update in place."""

    def __init__(self, rngs):
        self.fc = nnx.Linear(6, 5, rngs=rngs)
        self.bn = nnx.BatchNorm(5, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.fc(x))


@pytest.mark.parametrize(
    "order",
    ["wrapped", "jit(wrapped)", "wrapped(jit)"],
)
def test_in_place_updates_reach_the_caller_in_every_order(order):
    x = jax.random.normal(jax.random.key(4), (8, 6))
    model = Stats(nnx.Rngs(0))
    model.fc.kernel.set_value(
        lora_kernel(model.fc.kernel.get_value(), 2, jax.random.key(5))
    )
    dense = dense_copy(model)
    fn = {
        "wrapped": qax.use_implicit_args(apply),
        "jit(wrapped)": nnx.jit(qax.use_implicit_args(apply)),
        "wrapped(jit)": qax.use_implicit_args(nnx.jit(apply)),
    }[order]
    for _ in range(2):
        got, want = fn(model, x), apply(dense, x)
    assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert_close(model.bn.mean.get_value(), dense.bn.mean.get_value(), rtol=1e-5)
    assert_close(model.bn.var.get_value(), dense.bn.var.get_value(), rtol=1e-5)
    assert np.abs(np.asarray(model.bn.mean.get_value())).sum() > 0
    assert isinstance(model.fc.kernel.get_value(), LoraKernel)


def test_optimizer_matches_nnx_on_plain_models():
    x = jax.random.normal(jax.random.key(4), (8, 6))
    models = [Stats(nnx.Rngs(0)), Stats(nnx.Rngs(0))]
    opts = [
        nnx.Optimizer(models[0], optax.adam(1e-2), wrt=nnx.Param),
        qnnx.Optimizer(models[1], optax.adam(1e-2), wrt=nnx.Param),
    ]

    @nnx.jit
    def step(model, opt):
        opt.update(model, nnx.grad(lambda m: jnp.mean(m(x) ** 2))(model))

    for m, opt in zip(models, opts):
        for _ in range(2):
            step(m, opt)
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, nnx.state(models[0]), nnx.state(models[1])
    )


def test_holds_filter(model):
    state = nnx.state(model, qnnx.holds(LoraKernel))
    leaves = qax.utils.tree_leaves_with_implicit(state)
    assert len(leaves) == 6 and all(isinstance(x, LoraKernel) for x in leaves)
    assert (
        not qax.utils.tree_leaves_with_implicit(nnx.state(model, nnx.Not(qnnx.holds())))
        == []
    )
    with pytest.raises(TypeError, match="implicit array classes"):
        qnnx.holds(jax.Array)


def test_display(model):
    text = repr(model)
    assert "LoraKernel2(" in text and "LoraKernel3(" in text and "split=2" in text
    rendered = treescope.render_to_text(model.fc1.kernel.get_value())
    assert rendered.startswith("LoraKernel2(")
    for part in ("w=", "a=", "b=", "split=1", "shape=(8, 16)", "float32"):
        assert part in rendered, part
    assert "LoraKernel3(" in treescope.render_to_text(model)
