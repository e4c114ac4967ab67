"""LoRA and QLoRA on DeepMind's `gemma` library (`gm.nn`, the Gemma 3 text transformer).

The model is gemma's own `gm.nn.Transformer` (a tiny configuration written here:
grouped KV heads, QK norms, a sliding-window layer and a global one, the transposed
gating einsum of Gemma 3), run unchanged through `qax.use_implicit_args`. The
adapters are PEFT's layout, read from one abstract trace of the model
(`qax.lora.contracted_axes`): the same factors, of the same shapes, as gemma's own
LoRA wrapper `gm.nn.LoRA` puts on the same model. The oracles are the merged dense
model (`qax.lora.merge`) run without qax, and `gm.nn.LoRA` given the same factors.
Also: gemma's `Block` stacked by a user's `nn.scan(nn.remat(...))`.

`gemma` is optional (``pip install -e ".[gemma]"``; the install recipe that avoids
TensorFlow's full dependency tree is in `.ci/run`); without it this file is skipped.
No weights are downloaded: every parameter is drawn from a fixed seed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import assert_close

gm = pytest.importorskip(
    "gemma.gm",
    reason="DeepMind's `gemma` is not installed (pip install -e '.[gemma]', Python 3.12+)",
)
nn = pytest.importorskip("flax.linen")
_config = pytest.importorskip("gemma.gm.nn._config")

# Whole models on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

AttentionType = gm.nn.AttentionType
CONFIG = _config.TransformerConfig(
    num_embed=64,
    embed_dim=32,
    hidden_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    final_logit_softcap=None,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    use_qk_norm=True,
    attention_types=(AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL),
    sliding_window_size=4,
    transpose_gating_einsum=True,
    local_base_frequency=10_000,
    global_base_frequency=1_000_000,
)
RANK = 4
MODEL = gm.nn.Transformer(config=CONFIG, dtype=jnp.float32)
GEMMA_LORA = gm.nn.LoRA(rank=RANK, model=MODEL, dtype=jnp.float32)
TOKENS = jax.random.randint(jax.random.key(0), (2, 9), 1, CONFIG.num_embed)
# Every einsum kernel of both layers: q, kv, attention output, gating, linear.
KERNELS = {
    f"layer_{i}/{name}"
    for i in range(2)
    for name in (
        "attn/q_einsum/w",
        "attn/kv_einsum/w",
        "attn/attn_vec_einsum/w",
        "mlp/gating_einsum",
        "mlp/linear",
    )
}


def logits(params, tokens):
    return MODEL.apply({"params": params}, tokens).logits


def loss(params, tokens):
    out = logits(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(out, tokens[:, 1:]).mean()


def no_densifying():
    return qax.materialization_policy(qax.ImplicitArray, "error")


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def lora_leaves(params) -> dict:
    is_lora = lambda x: isinstance(x, qax.lora.LoraWeight)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_lora)[0]
    return {_path(p): x for p, x in flat if is_lora(x)}


def random_params(init, *args, seed: int):
    """The parameters ``init`` would make, drawn by numpy from a fixed seed (no
    program to compile): N(0, 0.2²), norm scales included."""
    shapes = jax.eval_shape(init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)
    draw = lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape, np.float32))  # noqa: E731
    return jax.tree.map(draw, shapes)


@functools.cache
def base_params():
    return random_params(MODEL.init, TOKENS, seed=1)


@functools.cache
def layout():
    return qax.lora.contracted_axes(logits, base_params(), TOKENS)


@functools.cache
def lora_params(fmt: str | None = None):
    """LoRA in PEFT's layout over a float, NF4 or int8 base, ``b`` non-zero."""
    params = base_params()
    if fmt is not None:
        options = {"block_size": 8} if fmt == "nf4" else {}
        params = qax.quant.quantize(params, fmt, **options)
    params = qax.lora.loraify(params, RANK, key=jax.random.key(2), a_axes=layout())
    adapters, base = qax.lora.split(params)
    rng = np.random.default_rng(3)

    def nonzero_b(adapter):
        if adapter is None:
            return None
        b = 0.3 * rng.standard_normal(adapter.b.shape, np.float32)
        return dataclasses.replace(adapter, b=jnp.asarray(b))

    is_adapter = lambda x: isinstance(x, qax.lora.LoraAdapter)  # noqa: E731
    adapters = jax.tree.map(nonzero_b, adapters, is_leaf=is_adapter)
    return qax.lora.combine(adapters, base)


def gemma_lora_name(path: str) -> str:
    """Where `gm.nn.LoRA` keeps the factors of the kernel at ``path``: beside it, in
    ``_LoRAEinsum_0/lora`` (the attention einsums' ``w``) or, for the two MLP
    kernels, which share one scope, ``_LoRAEinsum_<name>/lora``."""
    parent, name = path.rsplit("/", 1)
    return f"{parent}/_LoRAEinsum_{0 if name == 'w' else name}/lora"


def gemma_params_with(params):
    """`gm.nn.LoRA`'s parameters holding the base and the factors of ``params``."""
    ours = {
        gemma_lora_name(p): {"a": x.a, "b": x.b} for p, x in lora_leaves(params).items()
    }
    base = qax.lora.split(params)[1]  # the float base: the kernels as arrays

    def fill(path, leaf):
        path = _path(path)
        parent, name = path.rsplit("/", 1)
        if parent in ours:
            return ours[parent][name]
        return _get(base, path)

    template = _gemma_template()
    return jax.tree_util.tree_map_with_path(fill, template)


def _get(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


@functools.cache
def _gemma_template():
    return jax.eval_shape(GEMMA_LORA.init, jax.random.key(0), TOKENS)["params"]


def gemma_logits(params, tokens):
    return GEMMA_LORA.apply({"params": params}, tokens).logits


def test_the_layout_is_gemmas_own_lora():
    """`contracted_axes` puts on every kernel exactly the factors `gm.nn.LoRA` makes:
    same kernels, same shapes, the same number of trainable numbers."""
    ours = lora_leaves(lora_params())
    assert set(ours) == KERNELS
    theirs = {
        _path(p): x.shape
        for p, x in jax.tree_util.tree_flatten_with_path(_gemma_template())[0]
        if "/lora/" in _path(p)
    }
    for path, weight in ours.items():
        assert theirs[f"{gemma_lora_name(path)}/a"] == weight.a.shape, path
        assert theirs[f"{gemma_lora_name(path)}/b"] == weight.b.shape, path
    assert len(theirs) == 2 * len(ours)
    count = sum(int(np.prod(s)) for s in theirs.values())
    assert qax.lora.trainable_count(lora_params()) == count == 3584
    # The query kernel (heads, d_model, head_dim): `a` along d_model, as PEFT's.
    assert ours["layer_0/attn/q_einsum/w"].a.shape == (32, RANK)
    assert ours["layer_0/attn/q_einsum/w"].b.shape == (RANK, 4, 8)


@functools.cache
def _compiled_forward():
    return jax.jit(qax.use_implicit_args(logits)), jax.jit(logits)


@pytest.mark.parametrize("fmt", [None, "nf4", "int8"])
def test_lora_and_qlora_match_the_merged_dense_model(fmt):
    params = lora_params(fmt)
    ours, dense = _compiled_forward()
    with no_densifying():
        out = ours(params, TOKENS)
    assert_close(out, dense(qax.lora.merge(params), TOKENS), rtol=1e-5, atol=1e-5)


def test_outputs_equal_gemma_lora_given_the_same_factors():
    params = lora_params()
    with no_densifying():
        out = jax.jit(qax.use_implicit_args(logits))(params, TOKENS)
    theirs = jax.jit(gemma_logits)(gemma_params_with(params), TOKENS)
    assert_close(out, theirs, rtol=1e-5, atol=1e-5)


def test_a_training_step_matches_gemma_lora_and_moves_only_the_factors():
    params = lora_params()
    adapters, base = qax.lora.split(params)

    def our_loss(adapters, base, tokens):
        return qax.use_implicit_args(loss)(qax.lora.combine(adapters, base), tokens)

    step = jax.jit(jax.value_and_grad(our_loss))
    with no_densifying():
        value, grads = step(adapters, base, TOKENS)
    # Only the factors are differentiated (the base is an argument the step does
    # not differentiate); every factor gets a gradient.
    grad_leaves = lora_leaves(qax.lora.combine(grads, base))
    assert set(grad_leaves) == KERNELS

    def their_loss(lora, rest, tokens):
        out = gemma_logits(_merge_dicts(rest, lora), tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            out, tokens[:, 1:]
        ).mean()

    theirs = gemma_params_with(params)
    lora, rest = _partition(theirs)
    their_value, their_grads = jax.jit(jax.value_and_grad(their_loss))(
        lora, rest, TOKENS
    )
    assert_close(value, their_value, rtol=1e-5, atol=1e-6)
    for path, g in grad_leaves.items():
        name = gemma_lora_name(path)
        assert_close(g.a, _get(their_grads, f"{name}/a"), rtol=1e-4, atol=1e-6)
        assert_close(g.b, _get(their_grads, f"{name}/b"), rtol=1e-4, atol=1e-6)
    # One SGD step on the factors lowers the loss; the base is not an input to it.
    updated = optax.apply_updates(adapters, jax.tree.map(lambda g: -1e-2 * g, grads))
    with no_densifying():
        after, _ = step(updated, base, TOKENS)
    assert after < value


def _partition(tree, inside=False):
    """(the ``lora`` subtrees, the rest) of a nested dict, each with empty dicts
    where the other has leaves."""
    lora, rest = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            lora[key], rest[key] = _partition(value, inside or key == "lora")
        elif inside:
            lora[key] = value
        else:
            rest[key] = value
    return lora, rest


def _merge_dicts(x, y):
    out = dict(x)
    for key, value in y.items():
        out[key] = (
            _merge_dicts(out.get(key, {}), value) if isinstance(value, dict) else value
        )
    return out


class _Layer(nn.Module):
    """gemma's `Block` as the body of a user's `nn.scan`: ``(carry, *broadcast)``."""

    @nn.compact
    def __call__(self, x, positions, mask):
        block = gm.nn.Block(
            name="block",
            num_heads=CONFIG.num_heads,
            num_kv_heads=CONFIG.num_kv_heads,
            embed_dim=CONFIG.embed_dim,
            head_dim=CONFIG.head_dim,
            hidden_dim=CONFIG.hidden_dim,
            use_post_attn_norm=True,
            use_post_ffw_norm=True,
            attn_type=AttentionType.GLOBAL,
            query_pre_attn_scalar=CONFIG.head_dim**-0.5,
            transpose_gating_einsum=True,
            use_qk_norm=True,
        )
        _, y = block(x, positions, None, mask)
        return y, None


STACK = nn.scan(
    nn.remat(_Layer),
    variable_axes={"params": 0},
    split_rngs={"params": True},
    in_axes=(nn.broadcast, nn.broadcast),
    length=3,
)()


def test_blocks_under_a_user_scan_of_remat():
    """Three of gemma's blocks stacked by `nn.scan(nn.remat(...))`: the layout is
    read through the scan (one layer's axes), each layer gets its own factors, and
    the stack matches the merged dense one, forward and gradients."""
    x = jax.random.normal(jax.random.key(4), (2, 6, CONFIG.embed_dim))
    positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
    base = random_params(STACK.init, x, positions, mask, seed=5)

    def run(params, x):
        return STACK.apply({"params": params}, x, positions, mask)[0]

    stacked_layout = qax.lora.contracted_axes(run, base, x)
    params = qax.lora.loraify(
        base, RANK, key=jax.random.key(6), a_axes=stacked_layout, batch_ndim=1
    )
    q = lora_leaves(params)["block/attn/q_einsum/w"]
    assert (q.a.shape, q.b.shape) == ((3, 32, RANK), (3, RANK, 4, 8))
    adapters, frozen = qax.lora.split(params)
    adapters = jax.tree.map(lambda t: t + 0.1, adapters)  # non-zero `b`
    params = qax.lora.combine(adapters, frozen)
    q = lora_leaves(params)["block/attn/q_einsum/w"]

    def objective(adapters, x):
        return jnp.sum(run(qax.lora.combine(adapters, frozen), x) ** 2)

    with no_densifying():
        value, grads = jax.jit(jax.value_and_grad(qax.use_implicit_args(objective)))(
            adapters, x
        )
    dense_objective = jax.value_and_grad(lambda p, x: jnp.sum(run(p, x) ** 2))
    dense_value, dense_grad = jax.jit(dense_objective)(qax.lora.merge(params), x)
    assert_close(value, dense_value, rtol=1e-5)
    # The gradient of `b` against the dense model's: d/dB of W + A B is Aᵀ dW.
    g = lora_leaves(qax.lora.combine(grads, frozen))["block/attn/q_einsum/w"]
    dw = dense_grad["block"]["attn"]["q_einsum"]["w"]  # (L, heads, d_model, head_dim)
    expected = jnp.einsum("ldr,lndh->lrnh", q.a, dw)
    assert_close(g.b, expected, rtol=1e-3, atol=1e-3 * float(jnp.abs(expected).max()))
