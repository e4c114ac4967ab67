"""Adapters that cancel quantization error: PiSSA / QPiSSA and LoftQ on trained weights.

The model is the walk-through's GPT (`qax.examples.models.GPT`), first *trained* on the
walk-through's corpus (`notebooks/data/corpus.txt`, every parameter, Adam) so that its
kernels carry structure, as pretrained weights do (random matrices would not show what
the initialisers do). Then, for each format and rank, over every `Dense` kernel:

- plain: ``Q(w)``, `qax.quant.quantize` (round to nearest), no adapter;
- QPiSSA: `qax.lora.PiSSA(fmt)`: the principal components in the factors, the residual
  quantized;
- LoftQ (1 and 5 iterations): `qax.lora.LoftQ(fmt)`.

Printed: the weight error ``‖w - (Q + s·a⊗b)‖ / ‖w‖`` over all kernels together, its
reduction against plain quantization (``1 - err / err_plain``, the number the papers
report), and the logits' RMS difference from the float model on held-out windows, also
as a reduction. Every initialiser must reduce both (`tests/test_lora_init.py` runs the
quick size and asserts it).

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_lora_init.py           # ~2 min on 2 cores
    PYTHONPATH=. python benchmarks/bench_lora_init.py --quick   # seconds
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import qax
from qax.examples.models import GPT, CharTokenizer, GPTConfig, random_variables

CORPUS = pathlib.Path(__file__).resolve().parent.parent / "notebooks/data/corpus.txt"

FORMATS = {
    "nf4": {"block_size": 32},
    "int4": {"group_size": 32},
    "int8": {},
}


def trained_gpt(
    d_model: int, layers: int, steps: int, seq_len: int = 64, seed: int = 0
):
    """A GPT trained on the corpus for ``steps`` Adam steps (every parameter):
    ``(model, params, held-out windows)``."""
    text = CORPUS.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    cut = int(0.9 * len(ids))
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        max_len=seq_len,
        d_model=d_model,
        n_layers=layers,
        n_heads=4,
    )
    model = GPT(config)
    params = random_variables(model, jnp.zeros((1, seq_len), jnp.int32), seed=seed)
    params = params["params"]
    opt = optax.adam(3e-3)
    state = opt.init(params)

    def loss(p, w):
        logp = jax.nn.log_softmax(model.apply({"params": p}, w[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(logp, w[:, 1:, None], axis=-1))

    @jax.jit
    def step(p, s, w):
        value, g = jax.value_and_grad(loss)(p, w)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, cut - seq_len - 1, size=16)
        windows = np.stack([ids[s : s + seq_len + 1] for s in starts])
        params, state, _ = step(params, state, jnp.asarray(windows))
    starts = np.linspace(cut, len(ids) - seq_len - 1, 8).astype(int)
    held_out = jnp.asarray(np.stack([ids[s : s + seq_len] for s in starts]))
    return model, params, held_out


def _kernels(tree: Any) -> list:
    """The ``Dense`` kernels of a params tree (or what stands in their place)."""
    out = []

    def visit(path, leaf):
        if qax.utils.path_string(path).endswith("kernel"):
            out.append(leaf)

    qax.utils.tree_map_with_path_with_implicit(visit, tree)
    return out


def _weight_error(dense: Any, approx: Any) -> float:
    num = sum(
        float(jnp.sum((w - jnp.asarray(qax.materialize_nested(v))) ** 2))
        for w, v in zip(_kernels(dense), _kernels(approx), strict=True)
    )
    den = sum(float(jnp.sum(w**2)) for w in _kernels(dense))
    return (num / den) ** 0.5


def measure(model, dense, held_out, ranks, formats, alpha: float | None = None):
    """Rows of ``(format, rank, method, weight error, logits RMS diff)``."""
    apply = jax.jit(qax.use_implicit_args(lambda p, x: model.apply({"params": p}, x)))
    ref = apply(dense, held_out)

    def logits_diff(p):
        return float(jnp.sqrt(jnp.mean((apply(p, held_out) - ref) ** 2)))

    kernel = lambda path, leaf: path.endswith("kernel")  # noqa: E731
    rows = []
    for fmt in formats:
        options = FORMATS[fmt]
        plain = qax.quant.quantize(dense, fmt, filter=kernel, **options)
        base_err, base_logits = _weight_error(dense, plain), logits_diff(plain)
        rows.append((fmt, 0, "plain", base_err, base_logits, 0.0))
        for rank in ranks:
            inits = {
                "QPiSSA": qax.lora.PiSSA(fmt, options),
                "LoftQ 1": qax.lora.LoftQ(fmt, 1, options),
                "LoftQ 5": qax.lora.LoftQ(fmt, 5, options),
            }
            for name, init in inits.items():
                start = time.perf_counter()
                p = qax.lora.loraify(
                    dense,
                    rank,
                    key=jax.random.key(0),
                    alpha=alpha,
                    filter=kernel,
                    init=init,
                )
                jax.block_until_ready(p)
                seconds = time.perf_counter() - start
                err, diff = _weight_error(dense, p), logits_diff(p)
                rows.append((fmt, rank, name, err, diff, seconds))
    return rows


def table(rows) -> str:
    lines = [
        "| format | rank | init | weight error | reduction | logits RMS diff "
        "| reduction | init time |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    plain = {}
    for fmt, rank, name, err, diff, seconds in rows:
        if name == "plain":
            plain[fmt] = (err, diff)
            lines.append(f"| {fmt} | - | plain | {err:.4f} | - | {diff:.4f} | - | - |")
            continue
        e0, d0 = plain[fmt]
        lines.append(
            f"| {fmt} | {rank} | {name} | {err:.4f} | {100 * (1 - err / e0):.1f} % "
            f"| {diff:.4f} | {100 * (1 - diff / d0):.1f} % | {seconds:.2f} s |"
        )
    return "\n".join(lines)


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model, seconds")
    p.add_argument("--json", type=pathlib.Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.quick:
        d_model, layers, steps, ranks = 64, 1, 60, (8,)
    else:
        d_model, layers, steps, ranks = 256, 2, 400, (16, 64)
    start = time.perf_counter()
    model, dense, held_out = trained_gpt(d_model, layers, steps)
    print(
        f"GPT d_model={d_model} layers={layers}, trained {steps} steps "
        f"({time.perf_counter() - start:.0f} s); jax {jax.__version__}, "
        f"Python {sys.version.split()[0]}"
    )
    rows = measure(model, dense, held_out, ranks, list(FORMATS))
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
