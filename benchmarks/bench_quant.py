"""`qax.lora` and `qax.quant` on the benchmark GPT: bytes, errors, memory, speed.

The model is the one of `bench_lora.py` (its `Config`, `init_params` and `make_loss`).
Every matmul weight (q, k, v, o, both MLP matrices, the head) is a LoRA / quantized
weight; embeddings and layer norms stay dense (`qax.lora.default_filter`).

1. Parameter bytes: f32, int8 (per-channel scales), int4 and NF4 (block 64, f32 scales).
2. Quantization error of NF4 vs int4 (same size) on normally distributed weights.
3. The compiled train step's memory (`compiled.memory_analysis()`): dense fine-tuning
   (adam on every weight), LoRA and QLoRA (adam on the factors only, the recipe of
   `qax.lora`: `split` / `combine`).
4. The `qax.lora` train step against LoRA written by hand into the model
   (``x @ w + (x @ a) @ b``, the same factors): jitted step time, `make_jaxpr` time,
   compiled FLOPs, and the jaxpr checked for any weight-sized sum (``W + BA``).

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_quant.py            # full run (a few minutes)
    PYTHONPATH=. python benchmarks/bench_quant.py --quick    # smoke run

Times are medians over interleaved repetitions; ratios are medians of per-repetition
ratios (see `benchmarks/_timing.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    fmt_seconds,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
)
from bench_lora import (  # noqa: E402
    Config,
    compiled_cost,
    dense_linear,
    fresh,
    init_params,
    make_loss,
)

import qax  # noqa: E402
from qax.lora import LoraWeight  # noqa: E402


def nbytes(tree: Any) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(tree))


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


# ----------------------------------------------------------------------------------------
# 1-2. Sizes and errors


def size_table(dense: dict) -> list[list[str]]:
    weights = {
        qax.lora.path_string(p): x
        for p, x in jax.tree_util.tree_flatten_with_path(dense)[0]
        if qax.lora.default_filter(qax.lora.path_string(p), x)
    }
    base = nbytes(dense)
    rows = []
    for name, fmt in [
        ("f32", None),
        ("int8", "int8"),
        ("int4", "int4"),
        ("nf4", "nf4"),
    ]:
        params = dense if fmt is None else qax.quant.quantize(dense, fmt)
        total = nbytes(params)
        matmul = sum(
            nbytes(x)
            for p, x in qax.utils.tree_flatten_with_path_with_implicit(params)[0]
            if qax.lora.path_string(p) in weights
        )
        rows.append(
            [
                name,
                fmt_bytes(matmul),
                f"{matmul / nbytes(list(weights.values())):.3f}",
                fmt_bytes(total),
                f"{total / base:.3f}",
            ]
        )
    return rows


def error_table(n: int = 1024) -> list[list[str]]:
    w = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    rows = []
    for name, q in [
        ("int8 (per channel)", qax.quant.Int8Weight.from_array(w)),
        ("int4 (group 64)", qax.quant.Int4Weight.from_array(w, group_size=64)),
        ("nf4 (block 64)", qax.quant.NF4Weight.from_array(w, block_size=64)),
    ]:
        err = q.dequantize() - w
        rms = float(jnp.sqrt(jnp.mean(err**2)))
        rows.append(
            [name, f"{rms:.4f}", f"{float(jnp.max(jnp.abs(err))):.4f}", f"{q.nbytes:,}"]
        )
    return rows


# ----------------------------------------------------------------------------------------
# 3-4. Train steps


def hand_linear(x, p):
    """LoRA written into the model, in `qax.lora`'s layout: a (in, r), b (r, out)."""
    return x @ p["w"] + (x @ p["a"]) @ p["b"]


def adapters_as_dicts(adapters: Any) -> Any:
    """The same factors as ``{w, a, b}`` dicts for the hand-written model."""
    return jax.tree_util.tree_map(
        lambda ad: {"a": ad.a, "b": ad.b},
        adapters,
        is_leaf=lambda x: isinstance(x, qax.lora.LoraAdapter),
    )


def hand_params(base: dict, factors: Any) -> dict:
    def put(w, f):
        return w if f is None else {"w": w, **f}

    return jax.tree_util.tree_map(put, base, factors)


def make_steps(cfg: Config, scan: bool):
    key_params, key_lora, key_tokens = jax.random.split(jax.random.PRNGKey(0), 3)
    dense = init_params(cfg, key_params, stacked=scan)
    tokens = jax.random.randint(key_tokens, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    dense_loss = make_loss(cfg, dense_linear, scan)
    implicit_loss = qax.use_implicit_args(dense_loss)
    hand_loss = make_loss(cfg, hand_linear, scan)

    def nb(path: str, leaf: Any) -> int:  # stacked layers: one batch axis
        return 1 if scan and path.startswith("layers") else 0

    opt = optax.adam(1e-3)

    lora = qax.lora.loraify(dense, cfg.rank, key=key_lora, batch_ndim=nb)
    # Non-zero b, so that the update is not trivially zero.
    lora = jax.tree_util.tree_map(
        lambda w: (
            LoraWeight(w.w, w.a, w.b + 0.01, alpha=w.alpha)
            if isinstance(w, LoraWeight)
            else w
        ),
        lora,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )
    adapters, base = qax.lora.split(lora)
    quantized = qax.quant.quantize(dense, "nf4", batch_ndim=nb)
    _, qbase = qax.lora.split(
        qax.lora.loraify(quantized, cfg.rank, key=key_lora, batch_ndim=nb)
    )

    def dense_step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(dense_loss)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    def lora_step(adapters, opt_state, base, tokens):
        def loss(adapters):
            return implicit_loss(qax.lora.combine(adapters, base), tokens)

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    hand_factors = adapters_as_dicts(adapters)

    def hand_step(factors, opt_state, base, tokens):
        def loss(factors):
            return hand_loss(hand_params(base, factors), tokens)

        value, grads = jax.value_and_grad(loss)(factors)
        updates, opt_state = opt.update(grads, opt_state, factors)
        return optax.apply_updates(factors, updates), opt_state, value

    steps = {
        "dense": (dense_step, (dense, opt.init(dense), tokens)),
        "hand LoRA": (hand_step, (hand_factors, opt.init(hand_factors), base, tokens)),
        "qax.lora": (lora_step, (adapters, opt.init(adapters), base, tokens)),
        "QLoRA (nf4)": (lora_step, (adapters, opt.init(adapters), qbase, tokens)),
    }
    return steps


def memory_table(steps: dict) -> list[list[str]]:
    rows = []
    for name, (step, args) in steps.items():
        compiled = jax.jit(step).lower(*args).compile()
        mem = compiled.memory_analysis()
        rows.append(
            [
                name,
                fmt_bytes(mem.argument_size_in_bytes),
                fmt_bytes(mem.output_size_in_bytes),
                fmt_bytes(mem.temp_size_in_bytes),
                fmt_bytes(
                    mem.argument_size_in_bytes
                    + mem.output_size_in_bytes
                    + mem.temp_size_in_bytes
                ),
            ]
        )
    return rows


def weight_sized_sums(step: Callable, args: tuple, shapes: set) -> int:
    """`add` equations whose result has the shape of a LoRA weight (``W + BA``)."""
    jaxpr = jax.make_jaxpr(step)(*args)

    def walk(j):
        for eqn in j.eqns:
            if (
                eqn.primitive.name == "add"
                and tuple(eqn.outvars[0].aval.shape) in shapes
            ):
                yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return sum(1 for _ in walk(jaxpr.jaxpr))


def speed_table(steps: dict, reps: int) -> tuple[list[list[str]], list[str]]:
    names = ["hand LoRA", "qax.lora"]
    hand_step, hand_args = steps["hand LoRA"]
    qax_step, qax_args = steps["qax.lora"]
    notes = []
    # Same loss before anything is timed.
    got = jax.jit(qax_step)(*qax_args)[2]
    want = jax.jit(hand_step)(*hand_args)[2]
    np.testing.assert_allclose(got, want, rtol=2e-4, err_msg="qax.lora != hand LoRA")
    jitted = {n: jax.jit(steps[n][0]) for n in names}
    run = {
        n: (lambda n=n: jax.block_until_ready(jitted[n](*steps[n][1]))) for n in names
    }
    step_times = interleaved(run, reps, warmup=2)
    trace = {
        n: (lambda n=n: jax.make_jaxpr(fresh(steps[n][0]))(*steps[n][1])) for n in names
    }
    trace_times = interleaved(trace, max(3, reps // 2))
    flops = {n: compiled_cost(steps[n][0], *steps[n][1]) for n in names}
    adapters = jax.tree_util.tree_leaves(
        qax_args[0], is_leaf=lambda x: isinstance(x, qax.lora.LoraAdapter)
    )
    shapes = {(ad.a.shape[-2], ad.b.shape[-1]) for ad in adapters}
    sums = weight_sized_sums(qax_step, qax_args, shapes)
    if flops["qax.lora"][1] != flops["hand LoRA"][1]:
        notes.append("the compiled HLO of qax.lora and hand LoRA differ")
    rows = [
        [
            "jitted train step",
            fmt_seconds(median(step_times["hand LoRA"])),
            fmt_seconds(median(step_times["qax.lora"])),
            f"{paired_ratio(step_times, 'qax.lora', 'hand LoRA'):.3f}",
        ],
        [
            "make_jaxpr train step",
            fmt_seconds(median(trace_times["hand LoRA"])),
            fmt_seconds(median(trace_times["qax.lora"])),
            f"{paired_ratio(trace_times, 'qax.lora', 'hand LoRA'):.3f}",
        ],
        [
            "compiled FLOPs train step",
            f"{flops['hand LoRA'][0]:.4g}",
            f"{flops['qax.lora'][0]:.4g}",
            f"{flops['qax.lora'][0] / flops['hand LoRA'][0]:.3f}",
        ],
        [
            "weight-sized `add` (W + BA) in the jaxpr",
            "-",
            str(sums),
            "",
        ],
    ]
    return rows, notes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    parser.add_argument(
        "--layout", choices=("both", "loop", "scan"), default="both",
        help="layers as a Python loop, stacked under lax.scan, or both (default)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    warnings.simplefilter("error", qax.MaterializationWarning)
    cfg = Config(n_layers=2, seq=32, batch=4) if args.quick else Config()
    reps = 5 if args.quick else 20
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs"
    )
    print(f"model: {cfg}\n")

    dense = init_params(cfg, jax.random.PRNGKey(0), stacked=False)
    print("### parameter bytes (matmul weights quantized; embeddings, norms dense)\n")
    print(
        markdown_table(
            ["format", "matmul weights", "vs f32", "whole model", "vs f32"],
            size_table(dense),
        )
    )
    print("\n### quantization error on N(0, 1) weights (1024 x 1024)\n")
    print(markdown_table(["format", "RMS error", "max error", "bytes"], error_table()))

    layouts = {"loop": [False], "scan": [True], "both": [False, True]}[args.layout]
    for scan in layouts:
        title = "layers under lax.scan" if scan else "layers as a Python loop"
        print(f"{title}:", file=sys.stderr)
        steps = make_steps(cfg, scan)
        print(f"\n### compiled train step memory ({title})\n")
        print(
            markdown_table(
                ["train step", "arguments", "outputs", "temporaries", "total"],
                memory_table(steps),
            )
        )
        rows, notes = speed_table(steps, reps)
        print(f"\n### qax.lora vs hand-written LoRA ({title})\n")
        print(markdown_table(["measurement", "hand LoRA", "qax.lora", "ratio"], rows))
        for note in notes:
            print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
