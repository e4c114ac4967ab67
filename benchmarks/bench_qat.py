"""`qax.qat`: what quantization-aware training recovers over post-training quantization.

The task: regression onto a fixed random teacher (``y = tanh(2 x T1) T2``, 32 hidden
units, normalized), 64 inputs, 64 outputs, a student MLP (flax linen: Dense 64, tanh,
Dense 64, tanh, Dense 64; biases stay dense), 4096 training and 1024 held-out examples
(the dense student generalizes: its held-out loss is close to its training loss).
Every kernel is quantized (`qax.lora.default_filter`: the three 64x64 matrices).

1. Train the dense student for ``--dense-steps`` (adam, cosine schedule, full batch).
2. For every format `qax.quant.quantize` accepts, with the same budget of
   ``--steps`` more steps (adam, cosine from 1e-3):
   - PTQ: train the dense model those steps too, then quantize it;
   - QAT: fine-tune through `qax.qat.fake_quantize` from the step-1 weights, then
     `qax.qat.convert`.
   The held-out loss of each quantized model; the gain is PTQ loss / QAT loss.
3. Where qwix (0.1.8) has the format, the same with qwix on the same weights: its PTQ
   (`qwix.PtqProvider`) of the PTQ run's weights, and its QAT (`qwix.QtProvider`,
   weights only) from the step-1 weights, then its PTQ of the result. Block formats
   tile the contraction (input) axis on both sides (qax: ``block_axis=-2``), with the
   same block size (the same number of scales); per-channel formats scale each output
   channel in both. One more column: qax's PTQ with its default blocks, along the
   last (output) axis.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_qat.py            # full run (~2 minutes)
    PYTHONPATH=. python benchmarks/bench_qat.py --quick    # smoke run

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax import lax

import qax

CANDIDATES = ["int8", "fp8_e4m3", "fp8_e5m2", "int7", "int6", "int5", "int4", "nf4"]
CANDIDATES += ["int3", "int2"]
BLOCK = 64  # block size of the block formats (qax's default), qwix's tile size too


def accepted(fmt: str) -> bool:
    try:
        qax.quant.quantize({"w": jnp.ones((2, 64))}, fmt, filter=lambda p, l: True)  # noqa: E741
    except ValueError:
        return False
    return True


def qwix_qtype(fmt: str) -> Any:
    """qwix's name for the format, or None."""
    if fmt == "fp8_e4m3":
        return jnp.float8_e4m3fn
    if fmt == "fp8_e5m2":
        return jnp.float8_e5m2
    if fmt == "nf4" or (fmt.startswith("int") and fmt[3:].isdigit()):
        return fmt
    return None


def is_block_format(fmt: str) -> bool:
    return fmt not in ("int8", "fp8_e4m3", "fp8_e5m2")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(64)(x))
        x = jnp.tanh(nn.Dense(64)(x))
        return nn.Dense(64)(x)


def data(seed: int = 0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    t1 = jax.random.normal(k[0], (64, 32)) / 8
    t2 = jax.random.normal(k[1], (32, 64)) / jnp.sqrt(32.0)

    def teacher(x):
        return jnp.tanh(x @ t1 * 2) @ t2

    x, x_eval = jax.random.normal(k[2], (4096, 64)), jax.random.normal(k[3], (1024, 64))
    scale = jnp.std(teacher(x))
    return (x, teacher(x) / scale), (x_eval, teacher(x_eval) / scale)


def make_train(apply, batch):
    """A jitted ``train(params, steps, lr)``: adam with a cosine schedule, full batch,
    a `lax.fori_loop` over the steps (one compilation per parameter structure)."""
    x, y = batch

    def loss(params):
        return jnp.mean((apply(params, x) - y) ** 2)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def train(params, steps, lr):
        opt = optax.adam(optax.cosine_decay_schedule(lr, steps))

        def step(i, carry):
            p, s = carry
            u, s = opt.update(jax.grad(loss)(p), s, p)
            return optax.apply_updates(p, u), s

        return lax.fori_loop(0, steps, step, (params, opt.init(params)))[0]

    return train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dense-steps", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    dense_steps, steps = args.dense_steps, args.steps
    formats = [f for f in CANDIDATES if accepted(f)]
    if args.quick:
        dense_steps, steps, formats = 200, 30, formats[:2]
    start = time.perf_counter()

    model = MLP()
    train_set, (x_eval, y_eval) = data()
    init = model.init(jax.random.PRNGKey(1), train_set[0][:1])["params"]

    def apply(params, x):
        return qax.use_implicit_args(model.apply)({"params": params}, x)

    @jax.jit
    def eval_loss(params):
        return jnp.mean((apply(params, x_eval) - y_eval) ** 2)

    train = make_train(apply, train_set)
    base = train(init, dense_steps, 1e-2)  # step 1
    dense = train(base, steps, 1e-3)  # the PTQ run: the same budget, dense
    rows = []
    try:
        import qwix
    except ImportError:
        qwix = None

    for fmt in formats:
        options = {"group_size" if fmt.startswith("int") else "block_size": BLOCK}
        last = options if is_block_format(fmt) else {}
        options = {**last, "block_axis": -2} if last else {}
        ptq = float(eval_loss(qax.quant.quantize(dense, fmt, **options)))
        ptq_last = float(eval_loss(qax.quant.quantize(dense, fmt, **last)))
        qat = train(qax.qat.fake_quantize(base, fmt, **options), steps, 1e-3)
        qat_loss = float(eval_loss(qax.qat.convert(qat)))
        row = {"fmt": fmt, "ptq": ptq, "qat": qat_loss, "ptq_last": ptq_last}
        qtype = qwix_qtype(fmt)
        if qwix is not None and qtype is not None:
            row.update(qwix_numbers(qwix, model, qtype, fmt, base, dense, steps))
        rows.append(row)

    print(
        f"Dense student: held-out loss {float(eval_loss(base)):.4g} after "
        f"{dense_steps} steps, {float(eval_loss(dense)):.4g} after {steps} more "
        f"(qax {qax.__version__}, JAX {jax.__version__}"
        + (f", qwix {qwix.__version__}" if qwix else "")
        + f"; block formats: blocks of {BLOCK} along the input axis, qax's "
        "block_axis=-2)."
    )
    print()
    print(
        "| format | qax PTQ | qax QAT | qax gain (PTQ / QAT) "
        "| qwix PTQ | qwix QAT | qwix gain | qax PTQ, blocks along the last axis |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = (
            f"{r['qwix_ptq']:.4g} | {r['qwix_qat']:.4g} | "
            f"{r['qwix_ptq'] / r['qwix_qat']:.2f}x"
            if "qwix_ptq" in r
            else "n/a | n/a | n/a"
        )
        print(
            f"| {r['fmt']} | {r['ptq']:.4g} | {r['qat']:.4g} | "
            f"{r['ptq'] / r['qat']:.2f}x | {q} | "
            + (f"{r['ptq_last']:.4g} |" if r["ptq_last"] != r["ptq"] else "(same) |")
        )
    print()
    print(f"({time.perf_counter() - start:.0f} s)")


def qwix_numbers(qwix, model, qtype, fmt, base, dense, steps) -> dict:
    """qwix's PTQ of the dense run's weights, and its QAT from the step-1 weights."""
    tile = BLOCK if is_block_format(fmt) else None
    rule = dict(module_path=".*", weight_qtype=qtype, tile_size=tile)
    ptq_model = qwix.quantize_model(
        model, qwix.PtqProvider([qwix.QuantizationRule(**rule)])
    )
    qt_model = qwix.quantize_model(model, qwix.QtProvider([qwix.QtRule(**rule)]))
    train_set, (x_eval, y_eval) = data()

    abstract = jax.eval_shape(ptq_model.init, jax.random.PRNGKey(0), x_eval[:1])

    def ptq_loss(params):
        quantized = qwix.quantize_params(params, abstract["params"])
        out = ptq_model.apply({"params": quantized}, x_eval)
        return float(jnp.mean((out - y_eval) ** 2))

    train = make_train(lambda p, x: qt_model.apply({"params": p}, x), train_set)
    qat = train(base, steps, 1e-3)
    return {"qwix_ptq": ptq_loss(dense), "qwix_qat": ptq_loss(qat)}


if __name__ == "__main__":
    main()
