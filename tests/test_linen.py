"""Flax linen: an unmodified model (embedding, conv, layer norm, attention, and an
`nn.scan` + `nn.remat` stack of MLP blocks) with LoRA kernels, trained on the factors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import LoraKernel, assert_close, lora_kernel

nn = pytest.importorskip("flax.linen")


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        y = nn.Dense(16)(nn.LayerNorm()(h))
        return h + nn.Dense(8)(nn.gelu(y)), None


class Net(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        h = nn.LayerNorm()(nn.Conv(8, kernel_size=(3,))(nn.Embed(20, 8)(tokens)))
        h = h + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h)
        stack = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        h, _ = stack(name="blocks")(h, None)
        return nn.Dense(4)(h)


TOKENS = jnp.array([[1, 5, 7, 2, 9, 3], [4, 4, 0, 19, 8, 6]])
TARGET = jax.random.normal(jax.random.key(3), (2, 6, 4))
MODEL = Net()


def _name(key):
    return getattr(key, "key", getattr(key, "name", None))


def loraify(params, rank=2, seed=1):
    """Every Dense / DenseGeneral kernel gets a LoRA (the scanned ones stacked)."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def convert(path, x):
        names = [_name(k) for k in path]
        if names[-1] != "kernel" or any(str(n).startswith("Conv") for n in names):
            return x
        split = 2 if "out" in names else 1
        batch = 1 if "blocks" in names else 0
        return lora_kernel(x, rank, next(keys), split=split, batch=batch)

    return jax.tree_util.tree_map_with_path(convert, params)


def dense(params):
    return jax.tree_util.tree_map(
        lambda x: x.dense() if isinstance(x, LoraKernel) else x,
        params,
        is_leaf=lambda x: isinstance(x, LoraKernel),
    )


@pytest.fixture(scope="module")
def params():
    return loraify(MODEL.init(jax.random.key(0), TOKENS)["params"])


def apply(params, tokens):
    return MODEL.apply({"params": params}, tokens)


def test_forward_eager_and_jitted(params):
    kernels = [
        x
        for x in qax.utils.tree_leaves_with_implicit(params)
        if isinstance(x, LoraKernel)
    ]
    assert len(kernels) == 7  # q, k, v, out, 2 stacked block denses, head
    assert {k.shape for k in kernels} >= {(3, 8, 16), (3, 16, 8), (2, 4, 8)}
    want = apply(dense(params), TOKENS)
    assert_close(
        qax.use_implicit_args(apply)(params, TOKENS), want, rtol=1e-4, atol=1e-4
    )
    assert_close(
        jax.jit(qax.use_implicit_args(apply))(params, TOKENS),
        want,
        rtol=1e-4,
        atol=1e-4,
    )


def factor_labels(params):
    """'train' for the LoRA factors, 'freeze' for everything else."""

    def label(path, _):
        inside = any(isinstance(k, jax.tree_util.GetAttrKey) for k in path)
        return "train" if inside and _name(path[-1]) in ("a", "b") else "freeze"

    return jax.tree_util.tree_map_with_path(label, params)


def loss_fn(params, tokens, target):
    return jnp.mean((qax.use_implicit_args(apply)(params, tokens) - target) ** 2)


def test_training_moves_only_the_factors(params):
    tx = qax.utils.freeze_subtrees(optax.adam(3e-2), factor_labels)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params, TOKENS, TARGET)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    new, losses = params, []
    for _ in range(4):
        new, state, loss = step(new, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] * 0.9, losses
    labels = jax.tree_util.tree_leaves(factor_labels(params))
    for label, old, now in zip(
        labels, jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new)
    ):
        same = np.array_equal(np.asarray(old), np.asarray(now))
        assert same == (label == "freeze")
    assert labels.count("train") == 14
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(params)


def _stack_params():
    variables = MODEL.init(jax.random.key(0), TOKENS)["params"]
    return {"blocks": variables["blocks"]}


def _blocks(params, h):
    stack = nn.scan(
        nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
        length=3,
    )  # fmt: skip
    return stack().apply({"params": params["blocks"]}, h, None)[0]


H = jax.random.normal(jax.random.key(5), (2, 6, 8))


def _dense_stack(params):
    """The oracle: LoRA weights merged, quantized ones decoded."""
    return qax.quant.dequantize(qax.lora.merge(params))


@pytest.mark.parametrize("kind", ["lora", "int8", "qlora"])
def test_a_scanned_stack_built_without_batch_ndim_names_it(kind):
    """Forgetting `batch_ndim=1` densifies the stack at every step; the warning says
    which argument builds it stacked. With it, nothing is materialized."""
    params = _stack_params()

    def build(batch_ndim):
        p = params
        if kind in ("int8", "qlora"):
            p = qax.quant.quantize(p, "int8", batch_ndim=batch_ndim)
        if kind in ("lora", "qlora"):
            p = qax.lora.loraify(p, 2, key=jax.random.key(1), batch_ndim=batch_ndim)
        return p

    fix = (
        "quantize(params, ..., batch_ndim=1)"
        if kind == "int8"
        else "loraify(params, ..., "
    )
    unbatched = build(0)
    with pytest.warns(qax.MaterializationWarning) as seen:
        got = jax.jit(qax.use_implicit_args(_blocks))(unbatched, H)
    texts = [str(w.message) for w in seen]
    assert all("batch_ndim=1" in t and fix in t for t in texts), texts
    assert_close(got, _blocks(_dense_stack(unbatched), H))

    stacked = build(1)
    with qax.materialization_policy(qax.ImplicitArray, "error"):
        got = jax.jit(qax.use_implicit_args(_blocks))(stacked, H)
    assert_close(got, _blocks(_dense_stack(stacked), H))
