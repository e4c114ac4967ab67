"""LoRA and QLoRA on mixture-of-experts layers: qax beside a hand-written per-expert LoRA.

The Mixtral-style block of `qax.examples.moe` (top-2 router, SwiGLU experts stacked
``(E, d, f)`` through `jax.lax.ragged_dot`, layers under `jax.lax.scan`), every expert
weight adapted (one pair of factors per layer and expert), one adam step of the
factors (`qax.lora.split` / `combine`):

- **qax LoRA**: the example block, unchanged, under `qax.use_implicit_args`, its
  experts `qax.lora.LoraWeight`s (`loraify(..., batch_ndim=1)`: the expert axis found
  by path and shape);
- **hand LoRA**: the same block with the adapter written into it, as SkyRL and the
  JAX serving engines write it: ``ragged_dot(x, w) + s·ragged_dot(ragged_dot(x, a),
  b)`` per expert weight;
- **qax QLoRA** / **hand QLoRA**: the same over nf4 experts (block size 64): qax's
  `LoraWeight` over a `qax.quant.NF4Weight`; by hand, the block decodes the codes
  (``NF4Weight.dequantize``) before its grouped product.

Rows: the jitted step (interleaved, median), qax ÷ hand (paired), the compiled step's
FLOPs and temporary memory (`memory_analysis`) ÷ hand. Both sides agree on the loss
(checked). Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_moe.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_seconds, interleaved, markdown_table, median, paired_ratio  # noqa: E402

import qax  # noqa: E402
from qax.examples.moe import MoEConfig, init_moe, moe_layers, route  # noqa: E402

ALPHA = 16.0


# ----------------------------------------------------------------------------------------
# The hand-written block: the example's, with the adapter written into each product


def _grouped(x, p, group_sizes, s):
    """``ragged_dot(x, w) + s·ragged_dot(ragged_dot(x, a), b)`` (``w``: dense, or
    nf4 codes decoded here)."""
    w = p["w"].dequantize() if isinstance(p["w"], qax.quant.NF4Weight) else p["w"]
    out = lax.ragged_dot(x, w, group_sizes)
    t = lax.ragged_dot(x, p["a"], group_sizes) * s
    return out + lax.ragged_dot(t, p["b"], group_sizes)


def _hand_block(p, x, cfg, s):
    tokens = x.reshape(-1, x.shape[-1])
    chosen, weights = route(p["router"]["kernel"], tokens, cfg.top_k)
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    xs = jnp.take(tokens, order // cfg.top_k, axis=0)
    gs = jnp.bincount(flat, length=cfg.n_experts).astype(jnp.int32)
    e = p["experts"]
    h = jax.nn.silu(_grouped(xs, e["w_gate"], gs, s)) * _grouped(xs, e["w_up"], gs, s)
    ys = _grouped(h, e["w_down"], gs, s)
    ys = jnp.zeros_like(ys).at[order].set(ys).reshape(*chosen.shape, -1)
    out = jnp.einsum("tkd,tk->td", ys, weights.astype(ys.dtype))
    return out.reshape(x.shape).astype(x.dtype)


def _hand_layers(params, x, cfg, s):
    def layer(h, p):
        var = jnp.mean(jnp.square(h), axis=-1, keepdims=True)
        y = h * lax.rsqrt(var + 1e-6) * p["norm"]["scale"]
        return h + _hand_block(p, y, cfg, s), None

    return lax.scan(layer, x, params["layers"])[0]


def _as_dicts(adapters, base):
    """The hand-written block's parameters: ``{w, a, b}`` per adapted weight."""

    def one(ad, w):
        if ad is None:
            return w
        return {"w": w, "a": ad.a, "b": ad.b}

    is_ad = lambda v: v is None or isinstance(v, qax.lora.LoraAdapter)  # noqa: E731
    return jax.tree_util.tree_map(one, adapters, base, is_leaf=is_ad)


# ----------------------------------------------------------------------------------------
# Variants


def variants(cfg: MoEConfig, rank: int, batch: int, seq: int, fmt: str | None):
    k_params, k_lora, k_x = jax.random.split(jax.random.PRNGKey(0), 3)
    params = init_moe(k_params, cfg)
    x = jax.random.normal(k_x, (batch, seq, cfg.d_model), jnp.float32)
    lora = qax.lora.loraify(params, rank, key=k_lora, alpha=ALPHA, batch_ndim=1)
    adapters, base = qax.lora.split(lora)
    adapters = jax.tree_util.tree_map(lambda v: v + 0.01, adapters)  # a non-zero b
    if fmt is not None:
        base = qax.quant.quantize(base, fmt, batch_ndim=1, block_size=64)
    opt = optax.adam(1e-3)

    def target(y):
        return jnp.mean(jnp.square(y - 1.0))

    def qax_loss(adapters, base, x):
        params = qax.lora.combine(adapters, base)
        return target(qax.use_implicit_args(moe_layers)(params, x, cfg))

    def hand_loss(adapters, base, x):
        return target(_hand_layers(_as_dicts(adapters, base), x, cfg, ALPHA / rank))

    def make_step(loss):
        def step(adapters, opt_state, base, x):
            value, grads = jax.value_and_grad(loss)(adapters, base, x)
            updates, opt_state = opt.update(grads, opt_state, adapters)
            return optax.apply_updates(adapters, updates), opt_state, value

        return step

    args = (adapters, opt.init(adapters), base, x)
    tag = "QLoRA" if fmt else "LoRA"
    return {
        f"qax {tag}": (make_step(qax_loss), args),
        f"hand {tag}": (make_step(hand_loss), args),
    }


def table(vs: dict, reps: int) -> str:
    names = list(vs)
    qax_name, hand_name = names
    jitted = {n: jax.jit(step) for n, (step, _) in vs.items()}
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        values = {n: float(jitted[n](*args)[2]) for n, (_, args) in vs.items()}
    np.testing.assert_allclose(values[qax_name], values[hand_name], rtol=1e-4)
    times = interleaved(
        {
            n: (lambda n=n, args=args: jax.block_until_ready(jitted[n](*args)))
            for n, (_, args) in vs.items()
        },
        reps,
        warmup=2,
    )
    compiled = {n: jitted[n].lower(*args).compile() for n, (_, args) in vs.items()}
    temp = {n: compiled[n].memory_analysis().temp_size_in_bytes for n in vs}
    flops = {}
    for n in vs:
        cost = compiled[n].cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops[n] = float(cost.get("flops", float("nan")))
    rows = [
        [
            n,
            fmt_seconds(median(times[n])),
            f"{paired_ratio(times, n, hand_name):.3f}",
            f"{flops[n]:.3g}",
            f"{flops[n] / flops[hand_name]:.3f}",
            f"{temp[n] / 2**20:.2f} MiB",
            f"{temp[n] / temp[hand_name]:.3f}",
        ]
        for n in vs
    ]
    headers = [
        "",
        "jitted step",
        "÷ hand",
        "FLOPs",
        "÷ hand",
        "compiled temp",
        "÷ hand",
    ]
    return markdown_table(headers, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    args = parser.parse_args(argv)
    if args.quick:
        cfg, rank, batch, seq, reps = MoEConfig(64, 128, 4, 2, 2), 4, 2, 16, 5
    else:
        cfg, rank, batch, seq, reps = MoEConfig(256, 512, 8, 2, 2), 8, 4, 64, 25
    warnings.simplefilter("error", qax.MaterializationWarning)
    print(
        f"JAX {jax.__version__}, {jax.devices()[0].platform}; d_model {cfg.d_model}, "
        f"d_ff {cfg.d_ff}, {cfg.n_experts} experts (top {cfg.top_k}), "
        f"{cfg.n_layers} layers, rank {rank}, batch {batch} x {seq}\n"
    )
    for fmt in (None, "nf4"):
        print(f"### experts: {fmt or 'float32'}\n")
        print(table(variants(cfg, rank, batch, seq, fmt), reps))
        print()


if __name__ == "__main__":
    main()
