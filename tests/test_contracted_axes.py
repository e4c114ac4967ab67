"""`qax.lora.contracted_axes`: PEFT's adapter layout read from one abstract trace.

The oracle for the layout is how the model contracts each weight, written down by hand
(the PEFT rules of the NNX transformer's tests, and small models here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax

pytestmark = pytest.mark.no_leak_check  # whole models traced

nnx = pytest.importorskip("flax.nnx")
T = pytest.importorskip("qax.examples.nnx_transformer")

PEFT_RULES = [
    (r".*/q_einsum/kernel/value", {"a_axes": (1,)}),
    (r".*/(kv|qkv)_einsum/kernel/value", {"a_axes": (2,)}),
]


def _layouts(state) -> dict:
    found = qax.utils.tree_flatten_with_path_with_implicit(state)[0]
    return {
        qax.utils.path_string(p): (w.a_axes, w.a.shape, w.b.shape)
        for p, w in found
        if isinstance(w, qax.lora.LoraWeight)
    }


@pytest.mark.parametrize(
    "config",
    [
        T.TransformerConfig(num_heads=4, num_kv_heads=2),
        T.TransformerConfig(num_heads=4, num_kv_heads=4),
        T.TransformerConfig(num_heads=4, num_kv_heads=2, scan_layers=True),
    ],
    ids=["gqa", "fused", "scan"],
)
def test_the_traced_layout_is_the_peft_layout_without_rules(config):
    model = T.Transformer(config)
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.zeros((2, 9), jnp.int32)

    def call(state, tokens):
        return nnx.merge(graphdef, state, rest)(tokens)

    layout = qax.lora.contracted_axes(call, state, tokens)
    # The tied embedding is looked up (rows) and multiplied (columns): two ways.
    assert set(layout.ambiguous) == {"embedder/embedding/value"}
    stacked = int(config.scan_layers)
    rules = PEFT_RULES if config.num_kv_heads != config.num_heads else PEFT_RULES[1:]
    key = jax.random.key(0)
    traced = qax.lora.loraify(state, 4, key=key, a_axes=layout, batch_ndim=stacked)
    by_rules = qax.lora.loraify(state, 4, key=key, rules=rules, batch_ndim=stacked)
    assert _layouts(traced) == _layouts(by_rules)
    assert qax.lora.trainable_count(traced) == qax.lora.trainable_count(by_rules)
    # Nothing ran: tracing is abstract (a quantized state traces as its dense weights).
    nf4 = qax.quant.quantize(state, "nf4", block_size=8, batch_ndim=stacked)
    assert qax.lora.contracted_axes(call, nf4, tokens) == layout


def test_axes_are_followed_through_transposes_calls_and_scans():
    k = jax.random.split(jax.random.key(0), 6)
    params = {
        "linear": jax.random.normal(k[0], (16, 8)),  # Equinox (out, in): x @ w.T
        "einsum": jax.random.normal(k[1], (4, 8, 2)),  # (heads, in, head_dim)
        "conv": jax.random.normal(k[2], (3, 8, 8)),  # left to the default
        "table": jax.random.normal(k[3], (10, 8)),  # looked up only
        "stack": jax.random.normal(k[4], (2, 8, 8)),  # (layers, in, out) under scan
        "custom": jax.random.normal(k[5], (8, 8)),
    }

    @jax.custom_jvp
    def through(x, w):
        return x @ w.T  # contracts the second axis

    through.defjvp(lambda p, t: (through(*p), through(t[0], p[1])))

    def model(p, ids):
        h = p["table"][ids]
        h = jax.jit(lambda h, w: jnp.einsum("btd,hdk->bthk", h, w))(h, p["einsum"])
        h = h.reshape(*h.shape[:2], 8)
        h = lax.conv_general_dilated(
            h, p["conv"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
        )
        h, _ = lax.scan(
            lambda h, w: (jax.checkpoint(lambda h: h @ w)(h), None), h, p["stack"]
        )
        h = through(h, p["custom"])
        return jnp.tanh(h) @ p["linear"].T

    layout = qax.lora.contracted_axes(model, params, jnp.zeros((2, 5), jnp.int32))
    assert layout.axes == {
        "linear": (1,),
        "einsum": (1,),
        "table": (0,),
        "stack": (0,),
        "custom": (1,),
    }
    assert layout("conv", params["conv"]) is None and not layout.ambiguous
    lora = qax.lora.loraify(
        params,
        2,
        key=k[0],
        a_axes=layout,
        batch_ndim=lambda path, leaf: int(path == "stack"),
        filter=lambda path, leaf: True,
    )
    assert lora["linear"].a.shape == (8, 2) and lora["linear"].b.shape == (2, 16)
    assert lora["conv"].a_axes is None and lora["conv"].a.shape == (3, 8, 2)
    assert lora["stack"].a.shape == (2, 8, 2)
    # The layout changes no number: the model computes what the merged model computes.
    lora = jax.tree_util.tree_map(
        lambda x: x + 0.1,
        lora,
    )
    ids = jnp.arange(10).reshape(2, 5)
    with qax.materialization_policy(qax.ImplicitArray, "error"):
        got = jax.jit(qax.use_implicit_args(model))(lora, ids)
    want = model(qax.lora.merge(lora), ids)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
