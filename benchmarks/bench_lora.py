"""LoRA through qax vs hand-written LoRA vs the dense model: tracing, compile, run, FLOPs.

A small GPT-style model (token + position embeddings, pre-LayerNorm blocks with causal
multi-head attention and a gelu MLP, a final LayerNorm and an output head) in pure JAX.
Every weight matrix used in a matmul (q, k, v, o, the two MLP matrices, the head) gets a
rank-8 LoRA. Three variants of the same model:

- ``dense``: plain weights, ``x @ w`` (its train step fine-tunes every weight);
- ``hand``: LoRA written into the model, ``x @ w + (x @ a) @ b.T``;
- ``qax``: the *unmodified dense model code* under `qax.use_implicit_args`, each weight a
  ``LoraMatrix(qax.ImplicitArray)`` with a ``dot_general`` handler defined below (public
  API only).

The LoRA train steps differentiate with respect to the ``a``/``b`` factors only and
apply an optax adam update to them; the base weights stay frozen because they are never
updated. Two layouts are measured: a Python loop over layers, and layers stacked and
run with `lax.scan` (with `jax.checkpoint` on the layer). The scan row needs scan
support for implicit arrays; where it is missing the qax column says so.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_lora.py            # full run (a few minutes)
    PYTHONPATH=. python benchmarks/bench_lora.py --quick    # smoke run (well under a minute)

Times are medians over interleaved repetitions; ratios are medians of per-repetition
ratios (see `benchmarks/_timing.py`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    fmt_seconds,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
)

import qax  # noqa: E402

# ----------------------------------------------------------------------------------------
# The implicit LoRA type (public qax API only)


@dataclasses.dataclass
class LoraMatrix(qax.ImplicitArray):
    """``w + a @ b.T``, never formed: matmuls against it run the two products."""

    # `follows`: the weight dimension each factor dimension runs along (for
    # `qax.sharding`; see benchmarks/bench_sharded.py).
    w: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
    a: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, None))
    b: qax.ArrayValue = qax.array_field(ndim=2, follows=(1, None))

    def compute_shape(self):
        return self.w.shape

    def compute_dtype(self):
        return self.w.dtype

    def materialize(self):
        return self.w + self.a @ jnp.swapaxes(self.b, -1, -2)


@qax.primitive_handler("dot_general")
def lora_matmul(primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if (
        w.ndim != 2
        or tuple(lhs_contract) != (x.ndim - 1,)
        or tuple(rhs_contract) != (0,)
        or lhs_batch
        or rhs_batch
    ):
        return NotImplemented
    params = dict(params, dimension_numbers=dimension_numbers)
    out = qax.default_handler(primitive, x, w.w, **params)
    xa = qax.default_handler(primitive, x, w.a, **params)
    return out + qax.default_handler(primitive, xa, w.b.T, **params)


# ----------------------------------------------------------------------------------------
# The model


@dataclasses.dataclass(frozen=True)
class Config:
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    vocab: int = 512
    seq: int = 64
    batch: int = 8
    rank: int = 8


MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w1", "w2", "head")


def init_params(cfg: Config, key: jax.Array, stacked: bool) -> dict:
    """Dense parameters; layer parameters have a leading layer axis when `stacked`."""
    keys = iter(jax.random.split(key, 16))
    L, d, f = cfg.n_layers, cfg.d_model, cfg.d_ff

    def normal(*shape, scale=0.02):
        return scale * jax.random.normal(next(keys), shape, jnp.float32)

    def ln(*lead):
        return {"scale": jnp.ones((*lead, d)), "bias": jnp.zeros((*lead, d))}

    layers = {
        "ln1": ln(L),
        "attn": {name: normal(L, d, d) for name in ("wq", "wk", "wv", "wo")},
        "ln2": ln(L),
        "mlp": {
            "w1": normal(L, d, f),
            "b1": jnp.zeros((L, f)),
            "w2": normal(L, f, d),
            "b2": jnp.zeros((L, d)),
        },
    }
    if not stacked:
        layers = [jax.tree_util.tree_map(lambda x, i=i: x[i], layers) for i in range(L)]
    return {
        "wte": normal(cfg.vocab, d),
        "wpe": normal(cfg.seq, d),
        "layers": layers,
        "ln_f": ln(),
        "head": normal(d, cfg.vocab),
    }


def dense_linear(x, w):
    return x @ w


def hand_lora_linear(x, p):
    return x @ p["w"] + (x @ p["a"]) @ p["b"].T


def make_loss(
    cfg: Config, linear: Callable, scan: bool, layout: Callable | None = None
) -> Callable:
    """The model's next-token loss; every matmul against a weight goes through `linear`.

    `layout(x, name)`, if given, is applied to the residual stream (``"residual"``,
    after the embedding and after each block) and to the MLP's hidden activations
    (``"hidden"``): a sharded program constrains its activations there (see
    `bench_sharded.py`).
    """
    layout = layout or (lambda x, name: x)

    def layer_norm(x, p):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
        return (x - mean) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def attention(x, p):
        B, T, D = x.shape
        H = cfg.n_heads
        q, k, v = (linear(x, p[n]).reshape(B, T, H, D // H) for n in ("wq", "wk", "wv"))
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D // H)
        causal = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v)
        return linear(out.reshape(B, T, D), p["wo"])

    def mlp(x, p):
        h = layout(jax.nn.gelu(linear(x, p["w1"]) + p["b1"]), "hidden")
        return linear(h, p["w2"]) + p["b2"]

    def block(x, p):
        x = x + attention(layer_norm(x, p["ln1"]), p["attn"])
        return x + mlp(layer_norm(x, p["ln2"]), p["mlp"])

    def loss(params, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = params["wte"][inputs] + params["wpe"][: inputs.shape[1]]
        x = layout(x, "residual")
        if scan:
            body = jax.checkpoint(lambda x, p: (layout(block(x, p), "residual"), None))
            x, _ = lax.scan(body, x, params["layers"])
        else:
            for p in params["layers"]:
                x = layout(block(x, p), "residual")
        logits = linear(layer_norm(x, params["ln_f"]), params["head"])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss


# ----------------------------------------------------------------------------------------
# LoRA parameters and the train step


def _is_lora(x: Any) -> bool:
    return isinstance(x, LoraMatrix) or (
        isinstance(x, dict) and set(x) == {"w", "a", "b"}
    )


def add_lora(params: dict, key: jax.Array, rank: int, implicit: bool) -> dict:
    """Replace every matmul weight by a LoRA: a `LoraMatrix` or a ``{w, a, b}`` dict."""

    def convert(path, w):
        if getattr(path[-1], "key", None) not in MATMUL_WEIGHTS:
            return w
        k = jax.random.fold_in(key, hash(jax.tree_util.keystr(path)) % (2**31))
        ka, kb = jax.random.split(k)
        a = 0.02 * jax.random.normal(ka, (*w.shape[:-1], rank), w.dtype)
        b = 0.02 * jax.random.normal(kb, (*w.shape[:-2], w.shape[-1], rank), w.dtype)
        return LoraMatrix(w, a, b) if implicit else {"w": w, "a": a, "b": b}

    return jax.tree_util.tree_map_with_path(convert, params)


def lora_factors(params: dict) -> Any:
    """The trainable part: ``(a, b)`` for each LoRA, None elsewhere."""

    def get(x):
        if isinstance(x, LoraMatrix):
            return (x.a, x.b)
        if _is_lora(x):
            return (x["a"], x["b"])
        return None

    return jax.tree_util.tree_map(get, params, is_leaf=_is_lora)


def with_factors(params: dict, factors: Any) -> dict:
    def put(x, ab):
        if isinstance(x, LoraMatrix):
            return dataclasses.replace(x, a=ab[0], b=ab[1])
        if _is_lora(x):
            return {"w": x["w"], "a": ab[0], "b": ab[1]}
        return x

    return jax.tree_util.tree_map(put, params, factors, is_leaf=_is_lora)


@dataclasses.dataclass
class Variant:
    name: str
    loss: Callable  # (params, tokens) -> scalar
    step: Callable  # (params, opt_state, tokens) -> (trainable, opt_state, loss)
    params: Any
    opt_state: Any


def make_variant(name, loss, params, trainable_of, merge) -> Variant:
    opt = optax.adam(1e-3)

    def step(params, opt_state, tokens):
        trainable = trainable_of(params)
        value, grads = jax.value_and_grad(lambda t: loss(merge(params, t), tokens))(
            trainable
        )
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    return Variant(name, loss, step, params, opt.init(trainable_of(params)))


def build_variants(cfg: Config, scan: bool) -> tuple[dict[str, Variant], jax.Array]:
    key_params, key_lora, key_tokens = jax.random.split(jax.random.PRNGKey(0), 3)
    dense = init_params(cfg, key_params, stacked=scan)
    tokens = jax.random.randint(key_tokens, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    dense_loss = make_loss(cfg, dense_linear, scan)
    variants = {
        "dense": make_variant("dense", dense_loss, dense, lambda p: p, lambda p, t: t),
        "hand": make_variant(
            "hand",
            make_loss(cfg, hand_lora_linear, scan),
            add_lora(dense, key_lora, cfg.rank, implicit=False),
            lora_factors,
            with_factors,
        ),
        "qax": make_variant(
            "qax",
            qax.use_implicit_args(dense_loss),
            add_lora(dense, key_lora, cfg.rank, implicit=True),
            lora_factors,
            with_factors,
        ),
    }
    return variants, tokens


# ----------------------------------------------------------------------------------------
# Measurements


def fresh(f: Callable) -> Callable:
    """A new function object, so that JAX's per-function trace caches miss."""
    return lambda *args: f(*args)


def compiled_cost(f: Callable, *args) -> tuple[float, collections.Counter]:
    """FLOPs of the compiled program, and its instructions as (opcode, shape) counts."""
    compiled = jax.jit(f).lower(*args).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    instructions = collections.Counter()
    for line in compiled.as_text().splitlines():
        match = _HLO_INSTRUCTION.match(line)
        if match:
            instructions[match.group(2), match.group(1)] += 1
    return float(cost["flops"]), instructions


# `  name = f32[8,64]{1,0} dot(...)`: shape and opcode of one optimized-HLO instruction.
_HLO_INSTRUCTION = re.compile(r"\s*(?:ROOT )?\S+ = (\S+) ([\w-]+)\(")


@dataclasses.dataclass
class Reps:
    trace_fwd: int
    trace_step: int
    first_call: int
    steady: int


def measure(cfg: Config, scan: bool, reps: Reps) -> tuple[list[list[str]], list[str]]:
    variants, tokens = build_variants(cfg, scan)
    notes: list[str] = []

    # The qax variant must run (and agree with hand-written LoRA) to be measured.
    try:
        got = jax.jit(variants["qax"].loss)(variants["qax"].params, tokens)
        jax.make_jaxpr(variants["qax"].step)(
            variants["qax"].params, variants["qax"].opt_state, tokens
        )
    except Exception as e:  # noqa: BLE001 (reported in the table)
        if not scan:
            raise
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        notes.append(f"qax under scan failed ({reason}); scan support pending.")
        traceback.print_exc(limit=3, file=sys.stderr)
        del variants["qax"]
    else:
        want = jax.jit(variants["hand"].loss)(variants["hand"].params, tokens)
        np.testing.assert_allclose(got, want, rtol=2e-4, err_msg="qax != hand LoRA")

    def per_variant(make: Callable[[Variant], Callable[[], object]]):
        return {name: make(v) for name, v in variants.items()}

    results: dict[str, dict[str, list[float]]] = {}
    print("  make_jaxpr(forward) ...", file=sys.stderr)
    results["make_jaxpr forward"] = interleaved(
        per_variant(lambda v: lambda: jax.make_jaxpr(fresh(v.loss))(v.params, tokens)),
        reps.trace_fwd,
    )
    print("  make_jaxpr(train step) ...", file=sys.stderr)
    results["make_jaxpr train step"] = interleaved(
        per_variant(
            lambda v: (
                lambda: jax.make_jaxpr(fresh(v.step))(v.params, v.opt_state, tokens)
            )
        ),
        reps.trace_step,
    )
    print("  jitted train step ...", file=sys.stderr)
    jitted = {name: jax.jit(v.step) for name, v in variants.items()}
    results["jitted train step (steady)"] = interleaved(
        per_variant(
            lambda v: (
                lambda: jax.block_until_ready(
                    jitted[v.name](v.params, v.opt_state, tokens)
                )
            )
        ),
        reps.steady,
        warmup=2,
    )
    print("  first jit call ...", file=sys.stderr)
    results["first jit call train step (trace+compile)"] = interleaved(
        per_variant(
            lambda v: (
                lambda: jax.block_until_ready(
                    jax.jit(fresh(v.step))(v.params, v.opt_state, tokens)
                )
            )
        ),
        reps.first_call,
        warmup=0,
        setup=lambda fn: jax.clear_caches(),
    )
    print("  compiled FLOPs ...", file=sys.stderr)
    costs = {
        "forward": {
            n: compiled_cost(v.loss, v.params, tokens) for n, v in variants.items()
        },
        "train step": {
            n: compiled_cost(v.step, v.params, v.opt_state, tokens)
            for n, v in variants.items()
        },
    }

    rows = []
    has_qax = "qax" in variants
    na = "n/a (scan support pending)"
    for label, times in results.items():
        row = [label, *(fmt_seconds(median(times[n])) for n in ("dense", "hand"))]
        if has_qax:
            row += [
                fmt_seconds(median(times["qax"])),
                f"{paired_ratio(times, 'qax', 'hand'):.3f}",
                f"{paired_ratio(times, 'qax', 'dense'):.3f}",
            ]
        else:
            row += [na, "n/a", "n/a"]
        rows.append(row)
    for what, per_variant_cost in costs.items():
        counts = {n: c[0] for n, c in per_variant_cost.items()}
        label = f"compiled FLOPs {what}"
        row = [label, f"{counts['dense']:.4g}", f"{counts['hand']:.4g}"]
        if has_qax:
            row += [
                f"{counts['qax']:.4g}",
                f"{counts['qax'] / counts['hand']:.3f}",
                f"{counts['qax'] / counts['dense']:.3f}",
            ]
            if counts["qax"] > counts["hand"]:
                notes.append(f"{label}: qax EXCEEDS hand-written LoRA.")
        else:
            row += [na, "n/a", "n/a"]
        rows.append(row)
    for what, per_variant_cost in costs.items():
        ops = {n: c[1] for n, c in per_variant_cost.items()}
        row = [f"compiled HLO instructions {what}"]
        row += [str(sum(ops[n].values())) for n in ("dense", "hand")]
        if has_qax:
            same = "same ops" if ops["qax"] == ops["hand"] else "DIFFERENT ops"
            row += [str(sum(ops["qax"].values())), same, ""]
        else:
            row += [na, "n/a", "n/a"]
        rows.append(row)
    return rows, notes


# The models of the eager table: the benchmark GPT, and a small one whose ops are so
# small that per-op dispatch (Python) dominates.
SMALL = Config(d_model=64, d_ff=256, seq=16, batch=2)


def eager_rows(configs: dict[str, Config], reps: int, inner: int) -> list[list[str]]:
    """Un-jitted forward passes: each variant's loss called directly, per call."""
    rows = []
    for label, cfg in configs.items():
        variants, tokens = build_variants(cfg, scan=False)
        got = variants["qax"].loss(variants["qax"].params, tokens)
        want = variants["hand"].loss(variants["hand"].params, tokens)
        np.testing.assert_allclose(got, want, rtol=2e-4, err_msg="qax != hand LoRA")
        times = interleaved(
            {
                name: (lambda v=v, t=tokens: jax.block_until_ready(v.loss(v.params, t)))
                for name, v in variants.items()
            },
            reps,
            warmup=2,
            inner=inner,
        )
        rows.append(
            [
                f"{label} (d_model {cfg.d_model}, {cfg.n_layers} layers, "
                f"batch {cfg.batch}x{cfg.seq})",
                *(fmt_seconds(median(times[n])) for n in ("dense", "hand", "qax")),
                f"{paired_ratio(times, 'qax', 'hand'):.2f}",
                f"{paired_ratio(times, 'qax', 'dense'):.2f}",
            ]
        )
    return rows


# Calls inside `use_implicit_args` of `jnp` functions on plain arrays run what the same
# calls compiled at top level, if any ran (qax shares the eval trace's `jit` key); in
# `eager_rows` the dense and hand-written variants make those calls first. A program
# that only runs the qax model never does: `eager_alone_rows` times each variant in a
# process of its own, where nothing else ran.
def eager_alone(variant: str, cfg: Config, calls: int) -> None:
    """(In a subprocess) print the median seconds of `variant`'s eager forward."""
    v = build_variants(cfg, scan=False)[0][variant]
    tokens = jax.random.randint(
        jax.random.PRNGKey(7), (cfg.batch, cfg.seq + 1), 0, cfg.vocab
    )
    times = interleaved(
        {variant: lambda: jax.block_until_ready(v.loss(v.params, tokens))},
        reps=calls,
        warmup=3,
    )
    print(median(times[variant]))


def eager_alone_rows(
    configs: dict[str, Config], pairs: int, calls: int, quick: bool
) -> list[list[str]]:
    """Hand-written and qax eager forwards, each in a fresh process, `pairs` times."""
    rows = []
    for label, cfg in configs.items():
        model = "small" if cfg == SMALL else "benchmark"
        times: dict[str, list[float]] = {"hand": [], "qax": []}
        for i in range(pairs):
            for variant in ("hand", "qax") if i % 2 == 0 else ("qax", "hand"):
                command = [__file__, "--eager-alone", variant, model, str(calls)]
                out = subprocess.run(
                    [sys.executable, *command, *(["--quick"] if quick else [])],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                times[variant].append(float(out.stdout.split()[-1]))
        rows.append(
            [
                label,
                fmt_seconds(median(times["hand"])),
                fmt_seconds(median(times["qax"])),
                f"{paired_ratio(times, 'qax', 'hand'):.2f}",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small model, few repetitions"
    )
    parser.add_argument(
        "--layout",
        choices=("both", "loop", "scan"),
        default="both",
        help="layers as a Python loop, stacked under lax.scan, or both (default)",
    )
    parser.add_argument(
        "--eager-only",
        action="store_true",
        help="only the eager (un-jitted) forward table",
    )
    parser.add_argument(
        "--jit-only",
        action="store_true",
        help="skip the eager tables (tracing and jitted steps only)",
    )
    parser.add_argument(
        "--eager-alone",
        nargs=3,
        metavar=("VARIANT", "MODEL", "CALLS"),
        help=argparse.SUPPRESS,  # one variant in this process (see `eager_alone`)
    )
    args = parser.parse_args(argv)
    # Any materialization in the qax variant means it is not measuring LoRA any more.
    warnings.simplefilter("error", qax.MaterializationWarning)
    if args.quick:
        cfg = Config(n_layers=2, seq=32, batch=4)
        reps = Reps(trace_fwd=5, trace_step=3, first_call=1, steady=5)
        eager_reps, eager_inner = 5, 2
        alone_pairs, alone_calls = 2, 10
    else:
        cfg = Config()
        reps = Reps(trace_fwd=15, trace_step=10, first_call=5, steady=20)
        eager_reps, eager_inner = 21, 5
        alone_pairs, alone_calls = 6, 40
    if args.eager_alone:
        variant, model, calls = args.eager_alone
        eager_alone(variant, SMALL if model == "small" else cfg, int(calls))
        return

    print(
        f"JAX {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs"
    )
    print(f"model: {cfg}")
    print(
        "times: medians; ratios: medians of per-repetition ratios "
        f"(repetitions: {dataclasses.asdict(reps)})\n"
    )
    if not args.jit_only:
        eager_tables(args, cfg, eager_reps, eager_inner, alone_pairs, alone_calls)
    if args.eager_only:
        return
    _jit_tables(args, cfg, reps)


def eager_tables(args, cfg, eager_reps, eager_inner, alone_pairs, alone_calls) -> None:
    print("eager forward:", file=sys.stderr)
    print(
        "### eager (un-jitted) forward, layers as a Python loop "
        f"({eager_reps} x {eager_inner} calls)\n"
    )
    print(
        markdown_table(
            ["model", "dense", "hand LoRA", "qax LoRA", "qax/hand", "qax/dense"],
            eager_rows(
                {"benchmark GPT": cfg, "small GPT": SMALL}, eager_reps, eager_inner
            ),
        )
    )
    print(
        "\n### eager forward, each variant alone in a fresh process "
        f"({alone_pairs} processes each, {alone_calls} calls per process)\n"
    )
    print(
        markdown_table(
            ["model", "hand LoRA", "qax LoRA", "qax/hand"],
            eager_alone_rows(
                {"benchmark GPT": cfg, "small GPT": SMALL},
                alone_pairs,
                alone_calls,
                args.quick,
            ),
        )
    )
    print()


def _jit_tables(args, cfg, reps) -> None:
    headers = ["measurement", "dense", "hand LoRA", "qax LoRA", "qax/hand", "qax/dense"]
    layouts = {"loop": [False], "scan": [True], "both": [False, True]}[args.layout]
    for scan in layouts:
        title = (
            "layers under lax.scan + jax.checkpoint"
            if scan
            else "layers as a Python loop"
        )
        print(f"{title}:", file=sys.stderr)
        rows, notes = measure(cfg, scan, reps)
        print(f"### {title}\n")
        print(markdown_table(headers, rows))
        for note in notes:
            print(f"\nnote: {note}")
        print()


if __name__ == "__main__":
    main()
