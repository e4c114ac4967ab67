"""DoRA beside LoRA: train step time and compiled memory, over a dense and an NF4 base.

The model of `bench_lora.py` (a GPT-style model, every matmul weight adapted, rank 8),
one adam step of the trainable part (`qax.lora.split` / `combine`):

- **LoRA**: `qax.lora.LoraWeight` (the factors);
- **DoRA (qax)**: `qax.lora.DoraWeight` (`qax.lora.to_dora`: the factors and the
  magnitude), whose products never form ``W + sAB``;
- **DoRA (dense norm)**: the same DoRA written as PEFT and keras-hub write it, forming
  ``W + sAB`` for the column norm on every call (the reference for what the factored
  norm saves).

Rows: the jitted step (interleaved, median), DoRA ÷ LoRA, the compiled step's temporary
memory (`memory_analysis`) and FLOPs. Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_dora.py [--quick]
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
from bench_lora import MATMUL_WEIGHTS, Config, dense_linear, init_params, make_loss  # noqa: E402

import qax  # noqa: E402


def _adapted(path: str, leaf) -> bool:
    return path.split("/")[-1] in MATMUL_WEIGHTS


def dense_norm_linear(x, p):
    """DoRA as PEFT computes it: the dense ``V = W + s·a⊗b`` and its column norm."""
    v = p["w"] + p["s"] * (p["a"] @ p["b"])
    norm = lax.stop_gradient(jnp.linalg.norm(v, axis=0))
    return (x @ v) * (p["m"] / norm)


def variants(cfg: Config, fmt: str | None):
    key_params, key_lora, key_tokens = jax.random.split(jax.random.PRNGKey(0), 3)
    params = init_params(cfg, key_params, stacked=False)
    tokens = jax.random.randint(key_tokens, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    if fmt is not None:
        params = qax.quant.quantize(params, fmt, filter=_adapted)
    lora = qax.lora.loraify(params, cfg.rank, key=key_lora, alpha=16.0, filter=_adapted)
    adapters, base = qax.lora.split(lora)
    adapters = jax.tree_util.tree_map(lambda x: x + 0.01, adapters)  # a non-zero b
    lora = qax.lora.combine(adapters, base)
    dora = qax.lora.to_dora(lora)
    loss = qax.use_implicit_args(make_loss(cfg, dense_linear, scan=False))
    opt = optax.adam(1e-3)

    def make_step(params, loss_of):
        adapters, base = qax.lora.split(params)

        def step(adapters, opt_state, tokens):
            value, grads = jax.value_and_grad(lambda t: loss_of(t, base, tokens))(
                adapters
            )
            updates, opt_state = opt.update(grads, opt_state, adapters)
            return optax.apply_updates(adapters, updates), opt_state, value

        return step, (adapters, opt.init(adapters), tokens)

    def implicit_loss(adapters, base, tokens):
        return loss(qax.lora.combine(adapters, base), tokens)

    out = {
        "LoRA": make_step(lora, implicit_loss),
        "DoRA (qax)": make_step(dora, implicit_loss),
    }
    if fmt is None:
        dense_loss = make_loss(cfg, dense_norm_linear, scan=False)

        def as_dicts(adapters, base):
            def one(ad, w):
                if not isinstance(ad, qax.lora.DoraAdapter):
                    return w
                return {"w": w.w, "a": ad.a, "b": ad.b, "m": ad.m, "s": 16.0 / cfg.rank}

            return jax.tree_util.tree_map(
                one,
                adapters,
                base,
                is_leaf=lambda x: x is None or isinstance(x, qax.lora.DoraAdapter),
            )

        out["DoRA (dense norm)"] = make_step(
            dora, lambda t, base, tokens: dense_loss(as_dicts(t, base), tokens)
        )
    return out


def table(vs: dict, reps: int) -> str:
    jitted = {n: jax.jit(step) for n, (step, _) in vs.items()}
    values = {n: float(jitted[n](*args)[2]) for n, (_, args) in vs.items()}
    for n in values:
        if n.startswith("DoRA"):
            np.testing.assert_allclose(values[n], values["DoRA (qax)"], rtol=1e-4)
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
    rows = []
    for n in vs:
        rows.append(
            [
                n,
                fmt_seconds(median(times[n])),
                f"{paired_ratio(times, n, 'LoRA'):.3f}",
                f"{temp[n] / 2**20:.1f} MiB",
                f"{temp[n] / temp['LoRA']:.3f}",
                f"{flops[n] / flops['LoRA']:.3f}",
            ]
        )
    headers = ["", "jitted step", "÷ LoRA", "compiled temp", "÷ LoRA", "FLOPs ÷ LoRA"]
    return markdown_table(headers, rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    args = parser.parse_args(argv)
    cfg = Config(d_model=64, d_ff=256, seq=16, batch=2) if args.quick else Config()
    reps = 5 if args.quick else 25
    warnings.simplefilter("error", qax.MaterializationWarning)
    print(
        f"JAX {jax.__version__}, {jax.devices()[0].platform}; d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, rank {cfg.rank}, batch {cfg.batch} x {cfg.seq}\n"
    )
    for fmt in (None, "nf4"):
        print(f"### base: {fmt or 'float32'}\n")
        print(table(variants(cfg, fmt), reps))
        print()


if __name__ == "__main__":
    main()
