"""Flax NNX: an unmodified model with LoRA kernels, eager, under nnx.jit / jax.jit, trained."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import LoraKernel, assert_close, lora_kernel

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

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


# ----------------------------------------------------------------------------------------
# QLoRA: LoRA factors over a quantized base, trained the documented way (`nnx.split`,
# `qax.lora.split`/`combine`), eager, under `jax.jit` and in place under `nnx.jit`


class QNet(nnx.Module):
    """An embedding, a layer norm and two Linear layers (quantized, with LoRA)."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, tokens):
        return self.fc2(jax.nn.gelu(self.fc1(self.norm(self.embed(tokens)))))


Q_TARGET = jax.random.normal(jax.random.key(7), (2, 6, 16))
LORA = qnnx.holds(qax.lora.LoraWeight)
CODES = {"nf4": "packed", "int8": "q"}


def qlora_model(fmt):
    model = QNet(nnx.Rngs(0))
    options = {"block_size": 16} if fmt == "nf4" else {}
    base = qax.quant.quantize(nnx.state(model, nnx.Param), fmt, **options)
    nnx.update(model, qax.lora.loraify(base, 2, key=jax.random.key(1), alpha=4.0))
    # Non-zero `b`, so that the factors change the outputs and both get gradients.
    for layer in (model.fc1, model.fc2):
        lora = layer.kernel.get_value()
        b = 0.1 * jax.random.normal(jax.random.key(2), lora.b.shape)
        layer.kernel.set_value(qax.lora.LoraWeight(lora.w, lora.a, b, alpha=4.0))
    return model


def q_loss(model, tokens, target):
    out = qax.use_implicit_args(lambda m, t: m(t))(model, tokens)
    return jnp.mean((out - target) ** 2)


def dense_q_loss(graphdef, adapters, base, rest, tokens, target):
    """The oracle: the merged dense model (base decoded, `w + s·a@b` formed), no qax."""
    dense = qax.lora.merge(qax.lora.combine(adapters, base))
    out = nnx.merge(graphdef, dense, rest)(tokens)
    return jnp.mean((out - target) ** 2)


def q_train_step(graphdef, tx):
    """One step of the recipe in docs/guides/frameworks.md (QLoRA under NNX)."""

    def step(adapters, opt_state, base, rest, tokens, target):
        def loss(adapters):
            model = nnx.merge(graphdef, qax.lora.combine(adapters, base), rest)
            return q_loss(model, tokens, target)

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value, grads

    return step


def _codes(model, fmt):
    return [
        np.asarray(getattr(layer.kernel.get_value().w, CODES[fmt]))
        for layer in (model.fc1, model.fc2)
    ]


@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_qlora_steps_match_the_merged_dense_model(fmt, mode):
    model = qlora_model(fmt)
    codes = _codes(model, fmt)
    graphdef, lora_state, rest = nnx.split(model, LORA, ...)
    adapters, base = qax.lora.split(lora_state)
    tx = optax.adam(1e-2)
    opt_state = tx.init(adapters)
    step = q_train_step(graphdef, tx)
    if mode == "jit":
        step = jax.jit(step)
    want_adapters, want_state = adapters, opt_state
    for _ in range(2):
        args = (base, rest, TOKENS, Q_TARGET)
        adapters, opt_state, value, grads = step(adapters, opt_state, *args)
        want_value, want_grads = jax.value_and_grad(
            functools.partial(dense_q_loss, graphdef)
        )(want_adapters, *args)
        assert_close(value, want_value, rtol=1e-5, atol=1e-6)
        assert_close(grads, want_grads, rtol=1e-4, atol=1e-6)
        # Only the factors are differentiated: 2 layers x (a, b), all floating.
        leaves = jax.tree_util.tree_leaves(grads)
        assert len(leaves) == 4 and all(g.dtype == jnp.float32 for g in leaves)
        updates, want_state = tx.update(want_grads, want_state, want_adapters)
        want_adapters = optax.apply_updates(want_adapters, updates)
    assert_close(adapters, want_adapters, rtol=1e-4, atol=1e-6)
    nnx.update(model, qax.lora.combine(adapters, base))
    assert all(
        np.array_equal(a, b) for a, b in zip(_codes(model, fmt), codes, strict=True)
    )
    assert_close(
        model.fc1.kernel.get_value().a,
        want_adapters["fc1"]["kernel"].get_value().a,
        rtol=1e-4,
        atol=1e-6,
    )


@pytest.mark.parametrize("fmt", ["nf4", "int8"])
def test_qlora_trains_in_place_under_nnx_jit(fmt):
    model = qlora_model(fmt)
    reference = qlora_model(fmt)
    codes = _codes(model, fmt)
    tx = optax.adam(1e-2)
    opt_state = tx.init(qax.lora.split(nnx.state(model, LORA))[0])
    ref_state = opt_state

    @nnx.jit
    def train_step(model, opt_state, tokens, target):
        graphdef, lora_state, rest = nnx.split(model, LORA, ...)
        adapters, base = qax.lora.split(lora_state)

        def loss(adapters):
            return q_loss(
                nnx.merge(graphdef, qax.lora.combine(adapters, base), rest),
                tokens,
                target,
            )

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        new = qax.lora.combine(optax.apply_updates(adapters, updates), base)
        nnx.update(model, new)
        return value, opt_state

    losses = []
    for _ in range(3):
        value, opt_state = train_step(model, opt_state, TOKENS, Q_TARGET)
        losses.append(float(value))
        # The oracle: the same step on the merged dense model.
        graphdef, lora_state, rest = nnx.split(reference, LORA, ...)
        adapters, base = qax.lora.split(lora_state)
        want, grads = jax.value_and_grad(functools.partial(dense_q_loss, graphdef))(
            adapters, base, rest, TOKENS, Q_TARGET
        )
        assert_close(value, want, rtol=1e-5, atol=1e-6)
        updates, ref_state = tx.update(grads, ref_state, adapters)
        nnx.update(
            reference, qax.lora.combine(optax.apply_updates(adapters, updates), base)
        )
    assert losses[-1] < losses[0], losses
    for layer, ref in ((model.fc1, reference.fc1), (model.fc2, reference.fc2)):
        got, want = layer.kernel.get_value(), ref.kernel.get_value()
        assert isinstance(got, qax.lora.LoraWeight)
        assert isinstance(got.w, qax.quant.QuantizedWeight)
        assert_close(got.a, want.a, rtol=1e-4, atol=1e-6)
        assert_close(got.b, want.b, rtol=1e-4, atol=1e-6)
    assert all(
        np.array_equal(a, b) for a, b in zip(_codes(model, fmt), codes, strict=True)
    )


# ----------------------------------------------------------------------------------------
# Layers stacked with nnx.vmap and run with nnx.scan


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(8, 16, rngs=rngs)
        self.out = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, h):
        return h + self.out(jax.nn.gelu(self.fc(h)))


class Stack(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, block):
            return block(h)

        return body(x, self.blocks)


H = jax.random.normal(jax.random.key(5), (4, 8))


def _stack(batch_ndim, quantize):
    model = Stack(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    if quantize:
        params = qax.quant.quantize(params, "int8", batch_ndim=batch_ndim)
    params = qax.lora.loraify(params, 2, key=jax.random.key(1), batch_ndim=batch_ndim)
    nnx.update(model, params)
    return model


def _dense_out(model):
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, qax.lora.merge(qax.quant.dequantize(state)))(H)


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_a_scanned_stack_without_batch_ndim_warns_with_the_fix(quantize):
    model = _stack(0, quantize)
    kernel = model.blocks.fc.kernel.get_value()
    assert kernel.shape == (3, 8, 16) and kernel.b.shape == (2, 16)  # one b: shared
    forward = qax.use_implicit_args(lambda m, x: m(x))
    with pytest.warns(qax.MaterializationWarning) as seen:
        got = nnx.jit(forward)(model, H)
    texts = [str(w.message) for w in seen]
    assert texts and all(
        "LoraWeight along axis 0" in t and "loraify(params, ..., batch_ndim=1)" in t
        for t in texts
    ), texts
    assert_close(got, _dense_out(model), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_a_scanned_stack_with_batch_ndim_stays_implicit(quantize):
    model = _stack(1, quantize)
    kernel = model.blocks.fc.kernel.get_value()
    assert kernel.a.shape == (3, 8, 2) and kernel.b.shape == (3, 2, 16)
    forward = qax.use_implicit_args(lambda m, x: m(x))
    with qax.materialization_policy(qax.lora.LoraWeight, "error"):
        with qax.materialization_policy(qax.quant.Int8Weight, "error"):
            got = nnx.jit(forward)(model, H)
            eager = forward(model, H)
    want = _dense_out(model)
    assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert_close(eager, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Flax's own nnx.Optimizer on implicit parameters


@pytest.mark.xfail(
    strict=True,
    raises=(ValueError, TypeError),
    reason="nnx.Optimizer.update writes its state back through NNX's graph "
    "flattening, which takes each implicit array in it apart (Flax 0.12); Flax has no "
    "hook for a pytree type to stay whole. Use qax.nnx.Optimizer. If this passes, "
    "Flax changed: update qax.nnx's docstring and docs/guides/frameworks.md.",
)
def test_flax_optimizer_on_implicit_parameters_matches_qax_optimizer():
    trainable = qnnx.holds(LoraKernel)
    tx = qax.freeze_keys(optax.adam(3e-2), LoraKernel, ["w"])
    models = [loraify(Net(nnx.Rngs(0))), loraify(Net(nnx.Rngs(0)))]
    opts = [
        qnnx.Optimizer(models[0], tx, wrt=trainable),
        nnx.Optimizer(models[1], tx, wrt=trainable),
    ]
    step = nnx.jit(_train_step(trainable))
    for model, opt in zip(models, opts, strict=True):
        for _ in range(2):
            step(model, opt, TOKENS, TARGET)
    assert_close(nnx.state(models[1]), nnx.state(models[0]), rtol=1e-6, atol=1e-6)


def test_optimizer_never_moves_a_frozen_base_weight():
    # `freeze_w=True` without `freeze_keys`: adamw's weight decay would move `w`
    # through plain optax; qax.nnx.Optimizer keeps it bitwise.
    model = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
    w = model.kernel.get_value()
    model.kernel.set_value(
        qax.lora.LoraWeight(w, 0.1 * jnp.ones((6, 2)), 0.1 * jnp.ones((2, 4)))
    )
    opt = qnnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.5), wrt=nnx.Param)
    x = jnp.ones((3, 6))

    def loss(m):
        return jnp.sum(qax.use_implicit_args(m)(x) ** 2)

    for _ in range(3):
        opt.update(model, nnx.grad(loss)(model))
    kernel = model.kernel.get_value()
    np.testing.assert_array_equal(kernel.w, w)
    assert not np.allclose(kernel.a, 0.1)


# ----------------------------------------------------------------------------------------
# The QLoRA recipe over a scanned stack whose layer is rematerialized (issue 42, item 1)


class RematStack(Stack):
    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(h, block):
            return block(h)

        return body(x, self.blocks)


@pytest.mark.parametrize("quantize", [False, True], ids=["lora", "qlora"])
def test_split_recipe_over_a_rematerialized_scanned_stack(quantize):
    model = RematStack(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    if quantize:
        params = qax.quant.quantize(params, "nf4", block_size=8, batch_ndim=1)
    params = qax.lora.loraify(params, 2, key=jax.random.key(1), batch_ndim=1)
    nnx.update(model, params)
    graphdef, lora_state, rest = nnx.split(model, LORA, ...)
    adapters, base = qax.lora.split(lora_state)
    target = jnp.zeros_like(H)

    def loss(adapters, base, rest):
        m = nnx.merge(graphdef, qax.lora.combine(adapters, base), rest)
        out = qax.use_implicit_args(lambda m, x: m(x))(m, H)
        return jnp.mean((out - target) ** 2)

    def dense_loss(adapters, base, rest):
        # Variables rebuilt under this trace, as NNX transforms need them.
        dense = qax.lora.merge(qax.lora.combine(adapters, base))
        dense, rest = jax.tree.map(lambda x: x, (dense, rest))
        return jnp.mean((nnx.merge(graphdef, dense, rest)(H) - target) ** 2)

    for run in (jax.value_and_grad, lambda f: jax.jit(jax.value_and_grad(f))):
        value, grads = run(loss)(adapters, base, rest)
        want, want_grads = jax.value_and_grad(dense_loss)(adapters, base, rest)
        assert_close(value, want, rtol=1e-5, atol=1e-6)
        assert_close(grads, want_grads, rtol=1e-4, atol=1e-6)
