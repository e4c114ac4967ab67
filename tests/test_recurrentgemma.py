"""LoRA and QLoRA on DeepMind's `recurrentgemma` (Griffin, its Flax linen model).

The model is `recurrentgemma.jax.Griffin` in a tiny configuration written here: a
recurrent block (RG-LRU run by `lax.scan` or `lax.associative_scan`, its gates
block-diagonal einsums, a temporal Conv1D written as row lookups and products) and a
local-attention block, each under `nn.remat`, run unchanged through
`qax.use_implicit_args`. The adapters are PEFT's layout, read from one abstract trace
(`qax.lora.contracted_axes`). The oracle is the merged dense model (`qax.lora.merge`)
run without qax: forward, gradients, and a decoding step from a cache.

`recurrentgemma` is optional (``pip install -e ".[recurrentgemma]"``; it pins
``typeguard<3``, which `gemma` cannot share: each has its own environment in `.ci/run`);
without it this file is skipped. No weights are downloaded: every parameter is drawn
from a fixed seed.
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

rg = pytest.importorskip(
    "recurrentgemma.jax",
    reason="DeepMind's `recurrentgemma` is not installed (pip install -e '.[recurrentgemma]')",
)

# Whole models on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check


def config(scan_type):
    return rg.GriffinConfig(
        vocab_size=64,
        width=32,
        mlp_expanded_width=64,
        num_heads=4,
        block_types=(rg.TemporalBlockType.RECURRENT, rg.TemporalBlockType.ATTENTION),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=8,
        logits_soft_cap=30.0,
        scan_type=scan_type,
    )


SCANS = {
    "lax.scan": rg.ScanType.LINEAR_NATIVE,
    "associative_scan": rg.ScanType.ASSOCIATIVE_NATIVE,
}
MODELS = {name: rg.Griffin(config(scan)) for name, scan in SCANS.items()}
MODEL = MODELS["lax.scan"]
RANK = 4
TOKENS = jax.random.randint(jax.random.key(0), (2, 7), 1, 64)
POSITIONS = jnp.broadcast_to(jnp.arange(7), (2, 7))
# The kernels that get adapters: every linear layer and MLP kernel, the block-diagonal
# RG-LRU gates and the Conv1D taps; never the embedding, a norm, a bias or `a_param`.
RECURRENT = "blocks.0/recurrent_block"
KERNELS = {
    *(
        f"blocks.{i}/mlp_block/{n}"
        for i in range(2)
        for n in ("ffw_up/w", "ffw_down/kernel")
    ),
    *(f"{RECURRENT}/{n}/kernel" for n in ("linear_x", "linear_y", "linear_out")),
    *(f"{RECURRENT}/rg_lru/{n}/w" for n in ("a_gate", "input_gate")),
    f"{RECURRENT}/conv_1d/w",
    *(f"blocks.1/attention_block/proj_{n}/kernel" for n in ("q", "k", "v", "final")),
}


def logits(params, tokens, model=MODEL):
    return model.apply({"params": params}, tokens, POSITIONS, return_cache=False)[0]


def loss(params, tokens):
    out = logits(params, tokens)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(out, tokens[:, 1:]).mean()


def no_densifying():
    return qax.materialization_policy(qax.ImplicitArray, "error")


def lora_leaves(params) -> dict:
    is_lora = lambda x: isinstance(x, qax.lora.LoraWeight)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_lora)[0]
    path = lambda keys: "/".join(str(k.key) for k in keys)  # noqa: E731
    return {path(p): x for p, x in flat if is_lora(x)}


@functools.cache
def base_params():
    """What `Griffin.init` makes, drawn by numpy from a fixed seed (no program to
    compile)."""
    shapes = jax.eval_shape(MODEL.init, jax.random.key(0), TOKENS, POSITIONS)["params"]
    rng = np.random.default_rng(1)
    draw = lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape, np.float32))  # noqa: E731
    return jax.tree.map(draw, shapes)


@functools.cache
def lora_params(fmt: str | None = None):
    """LoRA in PEFT's layout over a float, NF4 or int8 base, ``b`` non-zero."""
    params = base_params()
    if fmt is not None:
        options = {"block_size": 8} if fmt == "nf4" else {}
        params = qax.quant.quantize(params, fmt, **options)
    layout = qax.lora.contracted_axes(logits, base_params(), TOKENS)
    params = qax.lora.loraify(params, RANK, key=jax.random.key(2), a_axes=layout)
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


def test_adapters_are_peft_shaped():
    weights = lora_leaves(lora_params())
    assert set(weights) == KERNELS
    shapes = {p: (w.a.shape, w.b.shape) for p, w in weights.items()}
    # A block-diagonal gate (blocks, in, out): `a` along the contracted `in`.
    assert shapes[f"{RECURRENT}/rg_lru/a_gate/w"] == ((8, RANK), (RANK, 4, 8))
    # The gated MLP's stacked up-projection (2, width, hidden): `a` along `width`.
    assert shapes["blocks.0/mlp_block/ffw_up/w"] == ((32, RANK), (RANK, 2, 64))
    # The Conv1D taps (width of the window, channels): no product contracts them;
    # loraify's default layout.
    assert shapes[f"{RECURRENT}/conv_1d/w"] == ((4, RANK), (RANK, 32))
    # rank * (a's size + b's size) per kernel: the MLPs 2 * (640 + 384), the three
    # recurrent linears 3 * 256, the gates 2 * 160, the taps 144, attention
    # 256 + 160 + 160 + 256.
    assert qax.lora.trainable_count(lora_params()) == 4112


@functools.cache
def _forward(scan: str):
    model = MODELS[scan]
    ours = jax.jit(qax.use_implicit_args(functools.partial(logits, model=model)))
    return ours, jax.jit(functools.partial(logits, model=model))


@pytest.mark.parametrize(
    "fmt, scan",
    [
        (None, "lax.scan"),
        (None, "associative_scan"),
        ("nf4", "lax.scan"),
        ("int8", "associative_scan"),
    ],
)
def test_lora_and_qlora_match_the_merged_dense_model(fmt, scan):
    params = lora_params(fmt)
    ours, dense = _forward(scan)
    with no_densifying():
        out = ours(params, TOKENS)
    assert_close(out, dense(qax.lora.merge(params), TOKENS), rtol=1e-5, atol=1e-5)


def test_a_training_step_moves_only_the_factors():
    params = lora_params("nf4")  # QLoRA: the codes are not even differentiable
    adapters, base = qax.lora.split(params)

    def our_loss(adapters, base, tokens):
        return qax.use_implicit_args(loss)(qax.lora.combine(adapters, base), tokens)

    step = jax.jit(jax.value_and_grad(our_loss))
    with no_densifying():
        value, grads = step(adapters, base, TOKENS)
    dense = qax.lora.merge(params)
    dense_value, dense_grads = jax.jit(jax.value_and_grad(loss))(dense, TOKENS)
    assert_close(value, dense_value, rtol=1e-5, atol=1e-6)
    # Every factor gets the dense model's gradient through it: d/dB of W + A B is
    # Aᵀ dW (a block-diagonal gate: contracted along `in`, per block).
    g = lora_leaves(qax.lora.combine(grads, base))
    assert set(g) == KERNELS
    w = lora_leaves(params)
    gate = f"{RECURRENT}/rg_lru/input_gate/w"
    dw = dense_grads["blocks.0"]["recurrent_block"]["rg_lru"]["input_gate"]["w"]
    assert_close(g[gate].b, jnp.einsum("ir,hij->rhj", w[gate].a, dw), atol=1e-5)
    x = f"{RECURRENT}/linear_x/kernel"
    dw = dense_grads["blocks.0"]["recurrent_block"]["linear_x"]["kernel"]
    assert_close(g[x].a, dw @ w[x].b.T, atol=1e-5)
    # One SGD step on the factors lowers the loss.
    updated = optax.apply_updates(adapters, jax.tree.map(lambda t: -1e-2 * t, grads))
    with no_densifying():
        after, _ = step(updated, base, TOKENS)
    assert after < value


def test_decoding_from_a_cache():
    """Prefill a prompt (filling the RG-LRU, Conv1D and attention caches), then
    decode one token from the cache: the logits and the new cache are the merged
    dense model's."""
    params = lora_params()

    def prefill_and_decode(params, prompt, token):
        _, cache = MODEL.apply({"params": params}, prompt, POSITIONS[:, :-1])
        out, cache = MODEL.apply({"params": params}, token, POSITIONS[:, -1:], cache)
        return out, cache

    with no_densifying():
        out, cache = jax.jit(qax.use_implicit_args(prefill_and_decode))(
            params, TOKENS[:, :-1], TOKENS[:, -1:]
        )
    expected = jax.jit(prefill_and_decode)(
        qax.lora.merge(params), TOKENS[:, :-1], TOKENS[:, -1:]
    )
    assert out.shape == (2, 1, 64)
    assert_close((out, cache), expected, rtol=1e-5, atol=1e-5)
    # The step from the cache computes what the full sequence computes last.
    assert_close(
        out[:, 0],
        jax.jit(logits)(qax.lora.merge(params), TOKENS)[:, -1],
        rtol=1e-4,
        atol=1e-4,
    )
