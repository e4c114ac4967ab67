"""Adapter banks on Flax models (NNX and linen): one adapter per example through the
unchanged model, served and trained.

The oracle is each example run alone through the merged dense model with its adapter
(`tests/test_lora_bank.py` has the pure-JAX cases and the layouts).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import dense

# Whole models: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

RANKS = (2, 3)


def no_materialization():
    return qax.materialization_policy(qax.ImplicitArray, "error")


def assert_close(got, want, tol=1e-5):
    for g, w in zip(
        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def _banks(tree) -> list:
    """``(path, LoraBank)`` for each bank in ``tree``, in order."""
    found = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, qax.lora.LoraBank)
    )[0]
    return [
        (qax.utils.path_string(p), x)
        for p, x in found
        if isinstance(x, qax.lora.LoraBank)
    ]


def _noisy(adapters, seed):
    noise = jax.random.key(seed)
    return jax.tree_util.tree_map(
        lambda x: x + 0.2 * jax.random.normal(noise, x.shape), adapters
    )


nnx = pytest.importorskip("flax.nnx")
qnnx = pytest.importorskip("qax.nnx")
NT = pytest.importorskip("qax.examples.nnx_transformer")

NNX_VARIANTS = {
    "gqa": NT.TransformerConfig(num_heads=4, num_kv_heads=2),
    "scan": NT.TransformerConfig(num_heads=4, num_kv_heads=2, scan_layers=True),
}
PEFT_RULES = [
    (r".*/q_einsum/kernel/value", {"a_axes": (1,)}),
    (r".*/kv_einsum/kernel/value", {"a_axes": (2,)}),
]


def _nnx_bank(variant: str, fmt: str | None):
    config = NNX_VARIANTS[variant]
    model = NT.Transformer(config)
    stacked = int(config.scan_layers)
    params = nnx.state(model, nnx.Param)
    if fmt is not None:
        options = {"block_size": 8} if fmt == "nf4" else {}
        params = qax.quant.quantize(params, fmt, batch_ndim=stacked, **options)
    adapters = []
    for i, r in enumerate(RANKS):
        lora = qax.lora.loraify(
            params,
            r,
            key=jax.random.key(i),
            alpha=4.0,
            batch_ndim=stacked,
            rules=PEFT_RULES,
        )
        found, base = qax.lora.split(lora)
        adapters.append(_noisy(found, 50 + i))
    nnx.update(model, qax.lora.bank(base, adapters))
    return model, adapters, base


def _call(model, tokens):
    return model(tokens)


@pytest.mark.parametrize("variant, fmt", [("gqa", None), ("scan", "nf4")])
def test_the_nnx_transformer_serves_a_mixed_batch(variant, fmt):
    model, adapters, base = _nnx_bank(variant, fmt)
    tokens = jax.random.randint(jax.random.key(0), (4, 9), 0, 64)
    ids = jnp.array([1, -1, 0, 1])
    with no_materialization():
        got = jax.jit(qax.lora.per_example(_call))(ids, model, tokens)
    graphdef, rest = nnx.graphdef(model), nnx.state(model, nnx.Not(nnx.Param))

    @jax.jit
    def alone(params, tokens):
        return nnx.merge(graphdef, params, rest)(tokens)

    want = []
    for i, j in enumerate(np.asarray(ids)):
        p = base if j < 0 else qax.lora.combine(adapters[j], base)
        want.append(alone(dense(p), tokens[i : i + 1]))
    assert_close(got, jnp.concatenate(want))


def test_the_qax_nnx_optimizer_trains_a_bank_in_place():
    model, adapters, base = _nnx_bank("gqa", "int8")
    tokens = jax.random.randint(jax.random.key(1), (4, 9), 0, 64)
    ids = jnp.array([1, 0, 0, 1])
    before = _banks(nnx.state(model, nnx.Param))  # the values now
    # Only the banks train (the factors: `w` is frozen), not the norms or embedding.
    tx = qax.freeze_keys(optax.adam(1e-2), qax.lora.LoraBank, ["w"])
    opt = qnnx.Optimizer(model, tx, wrt=qnnx.holds(qax.lora.LoraBank))

    def loss(model):
        logits = qax.lora.per_example(_call)(ids, model, tokens[:, :-1])
        return -jnp.mean(
            jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)
        )

    @nnx.jit
    def step(model, opt):
        value, grads = qnnx.value_and_grad(
            loss, argnums=nnx.DiffState(0, qnnx.holds(qax.lora.LoraBank))
        )(model)
        opt.update(model, grads)
        return value

    with no_materialization():
        first = step(model, opt)
        step(model, opt)
        last = loss(model)
    assert last < first
    after = _banks(nnx.state(model, nnx.Param))
    banks = {p: (b, a) for (p, b), (_, a) in zip(before, after, strict=True)}
    assert banks
    for path, (b, a) in banks.items():
        # The shared base stays bitwise what it was; the factors moved, the padding
        # past each adapter's rank stayed zero.
        for x, y in zip(jax.tree_util.tree_leaves(b.w), jax.tree_util.tree_leaves(a.w)):
            np.testing.assert_array_equal(x, y)
        assert float(jnp.abs(a.b - b.b).max()) > 0, path
        assert not np.asarray(a.a[0, ..., RANKS[0] :]).any(), path


# ----------------------------------------------------------------------------------------
# linen


M = pytest.importorskip("qax.examples.models")


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_a_linen_gpt_serves_a_mixed_batch(fmt):
    config = M.GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_len=16)
    gpt, variables = M.init_gpt(config)
    params = variables["params"]
    if fmt is not None:
        params = qax.quant.quantize(params, fmt)
    adapters = []
    for i, r in enumerate(RANKS):
        lora = qax.lora.loraify(params, r, key=jax.random.key(i), alpha=8.0)
        found, base = qax.lora.split(lora)
        adapters.append(_noisy(found, 70 + i))
    served = qax.lora.bank(base, adapters)

    def apply(params, tokens):
        return gpt.apply({"params": params}, tokens)

    tokens = jax.random.randint(jax.random.key(2), (5, 12), 0, 64)
    ids = np.array([0, 1, -1, 1, 0])
    with no_materialization():
        got = jax.jit(qax.lora.per_example(apply))(ids, served, tokens)
    alone = jax.jit(apply)
    want = []
    for i, j in enumerate(ids):
        p = base if j < 0 else qax.lora.combine(adapters[j], base)
        want.append(alone(dense(p), tokens[i : i + 1]))
    assert_close(got, jnp.concatenate(want))
