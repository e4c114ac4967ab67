"""Expert parallelism: the MoE block of `qax.examples.moe` with LoRA / QLoRA experts
sharded along the expert axis over a 2x4 mesh, run by `test_moe.py` on 8 devices.

The expert axis of every expert weight (and so of its factors, codes and scales, as
the types declare) is split over the mesh axis ``"model"`` (one expert per device), the
tokens over ``"data"``. The oracle is the same training step on one device.

Run directly with `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/_moe_sharded_cases.py`; without 8 devices every case is skipped.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qax
from qax.examples.moe import MoEConfig, init_moe, moe_layers

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS)", allow_module_level=True)

CFG = MoEConfig(d_model=16, d_ff=32, n_experts=4, top_k=2, n_layers=2)
MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
EXPERT = P(None, "model")  # (layers, experts, d_in, d_out): experts over "model"
SPECS = {
    "layers": {
        "norm": {"scale": P()},
        "router": {"kernel": P()},
        "experts": {k: EXPERT for k in ("w_gate", "w_up", "w_down")},
    }
}


def _params(kind):
    params = init_moe(jax.random.PRNGKey(0), CFG)
    lora = qax.lora.loraify(params, 2, key=jax.random.PRNGKey(1), batch_ndim=1)
    rng = np.random.default_rng(5)

    def nonzero_b(w):  # so that the gradients of `a` are not zero
        if not isinstance(w, qax.lora.LoraWeight):
            return w
        b = 0.3 * rng.standard_normal(w.b.shape)
        return dataclasses.replace(w, b=jnp.asarray(b, jnp.float32))

    is_lora = lambda v: isinstance(v, qax.lora.LoraWeight)  # noqa: E731
    lora = jax.tree.map(nonzero_b, lora, is_leaf=is_lora)
    if kind == "nf4":
        lora = qax.quant.quantize(lora, "nf4", block_size=16)
    return lora


def _loss(adapters, base, x):
    params = qax.lora.combine(adapters, base)
    y = qax.use_implicit_args(moe_layers)(params, x, CFG)
    return jnp.mean(jnp.square(y - 1.0))


def test_expert_parallel_step_matches_one_device():
    # QLoRA over nf4 experts: the factors, codes and scales all split by expert.
    params = _params("nf4")
    x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 6, 16)), jnp.float32)
    want_loss, want = jax.jit(jax.value_and_grad(_loss))(*qax.lora.split(params), x)
    shardings = qax.sharding.implicit_shardings(params, SPECS, MESH)
    placed = jax.device_put(params, shardings)
    adapters, base = qax.lora.split(placed)
    # The factors (and codes, scales) of each expert live with its expert.
    experts = [v for v in jax.tree.leaves((adapters, base)) if v.ndim == 4]
    assert len(experts) == 12  # a, b, codes and scales of three expert weights
    for leaf in experts:
        assert leaf.sharding.spec[:2] == (None, "model")
        assert leaf.addressable_shards[0].data.shape[1] == 1
    xs = jax.device_put(x, NamedSharding(MESH, P("data")))
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        step = jax.jit(jax.value_and_grad(_loss)).lower(adapters, base, xs).compile()
    loss, grads = step(adapters, base, xs)
    # Expert parallelism: each device keeps its expert's codes, scales and factors;
    # what moves are tokens and router outputs (no expert stack, 3-D or more, is
    # gathered).
    gathered = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather\(", step.as_text())
    assert all(len(dims.split(",")) <= 2 for dims in gathered), gathered
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, expected in zip(
        jax.tree.leaves(grads), jax.tree.leaves(want), strict=True
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert any(np.any(g) for g in jax.tree.leaves(grads))
