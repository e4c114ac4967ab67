"""`qax.lora` and `qax.quant` on the benchmark GPT: bytes, errors, memory, speed.

The model is the one of `bench_lora.py` (its `Config`, `init_params` and `make_loss`).
Every matmul weight (q, k, v, o, both MLP matrices, the head) is a LoRA / quantized
weight; embeddings and layer norms stay dense (`qax.lora.default_filter`).

1. Parameter bytes: f32, int8 (per-channel scales), fp8 (e4m3, e5m2; per-channel
   scales), the k-bit integers int7 ... int2 and int4 (group 64, f32 scales), NF4
   (block 64), NF4 with double quantization (``nf4_dq``: 8-bit block scales, one float
   per 256), and the FP4 formats NVFP4 (block 16: e4m3 scales and one f32 per weight)
   and MXFP4 (block 32: e8m0 scales).
2. Quantization error (RMS and max) of every format on normally distributed weights,
   with bytes and bits per number (scales included).
3. The same weights (the N(0, 1) matrix and the benchmark GPT's matmul weights)
   quantized by Google's qwix (``qwix.quantize``, when it is installed: an optional
   comparison, skipped with a note otherwise) in each format qwix has, with the
   closest scale layout: per channel = one scale per index of the last (output) axis
   (qwix ``channelwise_axes=(last,)``); group / block 64 = one scale per 64
   consecutive numbers along the last axis, per row (qwix ``channelwise_axes`` = the
   other axes, ``tiled_axes={last: 64}``). qwix's bytes are the ``.nbytes`` of its
   qvalue and scale arrays, and also their on-device buffer size.
4. The compiled train step's memory (`compiled.memory_analysis()`): dense fine-tuning
   (adam on every weight), LoRA, and QLoRA over every format of
   `qax.quant.FORMATS` (adam on the factors only, the recipe of `qax.lora`:
   `split` / `combine` over `qax.quant.quantize(params, fmt)`).
5. The `qax.lora` train step against LoRA written by hand into the model
   (``x @ w + (x @ a) @ b``, the same factors): jitted step time, `make_jaxpr` time,
   compiled FLOPs, and the jaxpr checked for any weight-sized sum (``W + BA``).
6. With ``--calibrated``: GPTQ and AWQ (`qax.quant.gptq` / `awq`) on a trained
   transformer, beside round to nearest and qwix's GPTQ/AWQ given the same weights and
   statistics (`bench_calibrate.py`, which also runs alone).

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
# 1-3. Sizes and errors, against qwix

# The formats in table order (every name of `qax.quant.FORMATS`; any name missing here
# is appended, so that no format is left out of the tables).
ORDER = ("int8", "fp8_e4m3", "fp8_e5m2", "int7", "int6", "int5", "int4", "nf4")
ORDER += ("nf4_dq", "nvfp4", "mxfp4", "int3", "int2")
# The block sizes of the formats whose specification fixes them (not an option).
FIXED_BLOCK = {"mxfp4": 32, "nvfp4": 16}


def formats() -> list[str]:
    known = [f for f in ORDER if f in qax.quant.FORMATS]
    return known + [f for f in qax.quant.FORMATS if f not in known]


def default_block(fmt: str) -> int | None:
    """The scale layout of ``quantize(params, fmt)`` with default options: ``None``
    (int8, fp8: one scale per output channel) or the block / group size."""
    if fmt in FIXED_BLOCK:
        return FIXED_BLOCK[fmt]
    return None if fmt in ("int8", "fp8_e4m3", "fp8_e5m2") else 64


def layout(block: int | None) -> str:
    return "per channel" if block is None else f"block {block}"


def load_qwix() -> Any:
    """qwix, or ``None`` (with a note) where it is not installed: never required."""
    try:
        import qwix
    except ImportError as e:
        print(f"\nnote: qwix is not installed ({e}); its columns are skipped\n")
        return None
    return qwix


def qwix_qtype(fmt: str) -> Any:
    """qwix's qtype for a qax format name, or ``None`` where qwix has none."""
    return {
        "int8": jnp.int8,
        "int4": jnp.int4,
        "nf4": "nf4",
        "mxfp4": "mxfp4",  # qwix: scale 2**ceil(log2(absmax / 6)), no clipping
        "nvfp4": "nvfp4",  # qwix: e4m3 scales (stored in the weight's dtype)
        "fp8_e4m3": jnp.float8_e4m3fn,
        "fp8_e5m2": jnp.float8_e5m2,
        **{f"int{k}": f"int{k}" for k in (2, 3, 5, 6, 7)},
    }.get(fmt)


def qwix_quantize(qwix: Any, w: jax.Array, fmt: str, block: int | None) -> Any:
    """``w`` in qwix's format, scales laid out as qax's (see the module docstring);
    ``None`` where qwix has no such format."""
    qtype = qwix_qtype(fmt)
    if qtype is None:
        return None
    last = w.ndim - 1
    if block is None:
        return qwix.quantize(w, qtype, channelwise_axes=(last,))
    return qwix.quantize(
        w, qtype, channelwise_axes=tuple(range(last)), tiled_axes={last: block}
    )


def qwix_bytes(q: Any) -> tuple[int, int | None]:
    """``.nbytes`` of a qwix QArray's arrays (qvalue, scale, zero point), and their
    on-device buffer size (``None`` where the runtime does not say)."""
    leaves = jax.tree_util.tree_leaves(q)
    try:
        device = sum(x.addressable_data(0).on_device_size_in_bytes() for x in leaves)
    except Exception:  # noqa: BLE001 - an optional, runtime-dependent figure
        device = None
    return sum(int(x.nbytes) for x in leaves), device


def errors(approx: list[jax.Array], exact: list[jax.Array]) -> tuple[float, float]:
    """RMS and max absolute error over all the numbers of the arrays together."""
    sq = sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(approx, exact, strict=True))
    n = sum(b.size for b in exact)
    top = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(approx, exact, strict=True)
    )
    return (sq / n) ** 0.5, top


def ratio(a: float, b: float | None) -> str:
    return "—" if b is None or b == 0 else f"{a / b:.3f}"


def cell(x: float | None, spec: str = ".4f") -> str:
    return "—" if x is None else format(x, spec)


def matmul_weights(dense: dict) -> dict[str, jax.Array]:
    return {
        qax.lora.path_string(p): x
        for p, x in jax.tree_util.tree_flatten_with_path(dense)[0]
        if qax.lora.default_filter(qax.lora.path_string(p), x)
    }


def quantized_matmul_weights(params: Any, names: dict) -> dict[str, Any]:
    return {
        qax.lora.path_string(p): x
        for p, x in qax.utils.tree_flatten_with_path_with_implicit(params)[0]
        if qax.lora.path_string(p) in names
    }


def size_table(dense: dict) -> list[list[str]]:
    weights = matmul_weights(dense)
    base = nbytes(dense)
    rows = []
    for fmt in [None, *formats()]:
        params = dense if fmt is None else qax.quant.quantize(dense, fmt)
        total = nbytes(params)
        matmul = sum(map(nbytes, quantized_matmul_weights(params, weights).values()))
        rows.append(
            [
                fmt or "f32",
                "—" if fmt is None else layout(default_block(fmt)),
                fmt_bytes(matmul),
                f"{matmul / nbytes(list(weights.values())):.3f}",
                fmt_bytes(total),
                f"{total / base:.3f}",
            ]
        )
    return rows


def qwix_model_table(qwix: Any, dense: dict) -> list[list[str]]:
    """qax and qwix on the benchmark GPT's matmul weights: bytes and errors, each
    format in the layout ``quantize(params, fmt)`` gives it by default."""
    weights = matmul_weights(dense)
    exact = list(weights.values())
    rows = []
    for fmt in formats():
        block = default_block(fmt)
        ours = quantized_matmul_weights(qax.quant.quantize(dense, fmt), weights)
        q_bytes = sum(map(nbytes, ours.values()))
        q_rms, q_max = errors([ours[k].dequantize() for k in weights], exact)
        theirs = [qwix_quantize(qwix, w, fmt, block) for w in exact]
        if theirs[0] is None:
            w_bytes = w_device = w_rms = w_max = None
        else:
            sizes = [qwix_bytes(t) for t in theirs]
            w_bytes = sum(b for b, _ in sizes)
            devices = [d for _, d in sizes]
            w_device = None if None in devices else sum(devices)
            w_rms, w_max = errors([qwix.dequantize(t) for t in theirs], exact)
        rows.append(
            [
                fmt,
                layout(block),
                fmt_bytes(q_bytes),
                "—" if w_bytes is None else fmt_bytes(w_bytes),
                "—" if w_device is None else fmt_bytes(w_device),
                ratio(q_bytes, w_bytes),
                f"{q_rms:.3e}",
                cell(w_rms, ".3e"),
                ratio(q_rms, w_rms),
                f"{q_max:.3e}",
                cell(w_max, ".3e"),
                ratio(q_max, w_max),
            ]
        )
    return rows


def error_cases() -> list[tuple[str, int | None, Callable[[jax.Array], Any]]]:
    """``(format, block or None: per channel, quantize)``: every format of
    `qax.quant.FORMATS` in its default layout, and a few other layouts."""
    quant = qax.quant
    extra: dict[str, list] = {
        "int8": [(64, lambda w: quant.IntKWeight.from_array(w, 8, group_size=64))],
        "fp8_e4m3": [(64, lambda w: quant.FP8Weight.from_array(w, block_size=64))],
    }
    cases = []
    for fmt in formats():
        block = default_block(fmt)
        key = "block_size" if fmt.startswith(("nf4", "fp8")) else "group_size"
        options = {} if block is None or fmt in FIXED_BLOCK else {key: block}

        def make(w, fmt=fmt, options=options):
            (q,) = jax.tree_util.tree_leaves(
                qax.quant.quantize({"w": w}, fmt, filter=lambda *_: True, **options),
                is_leaf=lambda x: isinstance(x, quant.QuantizedWeight),
            )
            return q

        cases.append((fmt, block, make))
        cases += [(fmt, b, m) for b, m in extra.get(fmt, [])]
    return cases


def error_tables(qwix: Any, n: int = 1024) -> tuple[list[list[str]], list[list[str]]]:
    """qax's error table, and the side-by-side table against qwix (empty without
    qwix), on the same ``n x n`` N(0, 1) weights."""
    w = jax.random.normal(jax.random.PRNGKey(0), (n, n))
    rows, side = [], []
    for fmt, block, make in error_cases():
        q = make(w)
        rms, top = errors([q.dequantize()], [w])
        rows.append(
            [
                f"{fmt} ({layout(block)})",
                f"{rms:.4f}",
                f"{top:.4f}",
                f"{q.nbytes:,}",
                f"{8 * q.nbytes / w.size:.3f}",
            ]
        )
        if qwix is None:
            continue
        theirs = qwix_quantize(qwix, w, fmt, block)
        if theirs is None:
            w_rms = w_max = w_bytes = w_device = None
            stored = "—"
        else:
            w_rms, w_max = errors([qwix.dequantize(theirs)], [w])
            w_bytes, w_device = qwix_bytes(theirs)
            stored = f"{theirs.qvalue.dtype}"
        side.append(
            [
                f"{fmt} ({layout(block)})",
                stored,
                f"{rms:.4f}",
                cell(w_rms),
                ratio(rms, w_rms),
                f"{top:.4f}",
                cell(w_max),
                ratio(top, w_max),
                f"{q.nbytes:,}",
                cell(w_bytes, ","),
                cell(w_device, ","),
                ratio(q.nbytes, w_bytes),
                ratio(q.nbytes, w_device),
            ]
        )
    return rows, side


# ----------------------------------------------------------------------------------------
# 4-5. Train steps


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
    # QLoRA over every format: the frozen bases, or why a format has none.
    qbases, notes = {}, {}
    weights = matmul_weights(dense)
    for fmt in formats():
        try:
            with warnings.catch_warnings():  # kept-dense weights: said in the table
                warnings.simplefilter("ignore", UserWarning)
                quantized = qax.quant.quantize(dense, fmt, batch_ndim=nb)
        except ValueError as e:
            notes[fmt] = f"cannot quantize: {str(e).splitlines()[0]}"
            continue
        held = quantized_matmul_weights(quantized, weights)
        dense_left = [
            f"{k} {tuple(weights[k].shape)}"
            for k, x in held.items()
            if not isinstance(x, qax.quant.QuantizedWeight)
        ]
        if dense_left:
            notes[fmt] = f"cannot hold, kept dense: {', '.join(dense_left)}"
        _, qbases[fmt] = qax.lora.split(
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
    }
    for fmt in formats():
        qbase = qbases.get(fmt)
        steps[f"QLoRA ({fmt})"] = (
            None if qbase is None else lora_step,
            (adapters, opt.init(adapters), qbase, tokens),
        )
    notes = {f"QLoRA ({fmt})": note for fmt, note in notes.items()}
    return steps, notes


def memory_table(steps: dict, notes: dict) -> list[list[str]]:
    rows = []
    for name, (step, args) in steps.items():
        if step is None:  # the format could not quantize the model
            rows.append([name, "—", "—", "—", "—", notes.get(name, "")])
            continue
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
                notes.get(
                    name,
                    "all matmul weights quantized" if name.startswith("QLoRA") else "",
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
    parser.add_argument(
        "--calibrated", action="store_true",
        help="also GPTQ/AWQ on a trained model beside qwix's (bench_calibrate.py)",
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
    qwix = load_qwix()
    print("### parameter bytes (matmul weights quantized; embeddings, norms dense)\n")
    print(
        markdown_table(
            ["format", "scales", "matmul weights", "vs f32", "whole model", "vs f32"],
            size_table(dense),
        )
    )
    n = 256 if args.quick else 1024
    rows, side = error_tables(qwix, n)
    print(f"\n### quantization error on N(0, 1) weights ({n} x {n})\n")
    print(
        markdown_table(
            ["format (scales)", "RMS error", "max error", "bytes", "bits per number"],
            rows,
        )
    )
    if qwix is not None:
        version = getattr(qwix, "__version__", None) or getattr(
            getattr(qwix, "version", None), "__version__", "?"
        )
        print(f"\n### qax vs qwix {version} on the same N(0, 1) weights ({n} x {n})\n")
        print(
            "Scales: per channel = one per index of the last axis; block 64 = one per "
            "64 numbers along the last axis. qwix bytes: `.nbytes` of its qvalue and "
            "scale arrays; on device: their buffers' `on_device_size_in_bytes()`. "
            "Ratios are qax / qwix.\n"
        )
        print(
            markdown_table(
                [
                    "format (scales)",
                    "qwix qvalue dtype",
                    "RMS qax",
                    "RMS qwix",
                    "ratio",
                    "max qax",
                    "max qwix",
                    "ratio",
                    "bytes qax",
                    "bytes qwix (.nbytes)",
                    "bytes qwix (on device)",
                    "ratio (.nbytes)",
                    "ratio (on device)",
                ],
                side,
            )
        )
        print(
            "\n### qax vs qwix on the benchmark GPT's matmul weights "
            "(`quantize(params, fmt)`'s default scales)\n"
        )
        print(
            markdown_table(
                [
                    "format",
                    "scales",
                    "bytes qax",
                    "bytes qwix (.nbytes)",
                    "bytes qwix (on device)",
                    "ratio",
                    "RMS qax",
                    "RMS qwix",
                    "ratio",
                    "max qax",
                    "max qwix",
                    "ratio",
                ],
                qwix_model_table(qwix, dense),
            )
        )

    layouts = {"loop": [False], "scan": [True], "both": [False, True]}[args.layout]
    for scan in layouts:
        title = "layers under lax.scan" if scan else "layers as a Python loop"
        print(f"{title}:", file=sys.stderr)
        steps, notes = make_steps(cfg, scan)
        print(f"\n### compiled train step memory ({title})\n")
        print(
            markdown_table(
                ["train step", "arguments", "outputs", "temporaries", "total", "note"],
                memory_table(steps, notes),
            )
        )
        rows, notes = speed_table(steps, reps)
        print(f"\n### qax.lora vs hand-written LoRA ({title})\n")
        print(markdown_table(["measurement", "hand LoRA", "qax.lora", "ratio"], rows))
        for note in notes:
            print(f"\nnote: {note}")
    if args.calibrated:
        import bench_calibrate

        print("\n### GPTQ and AWQ beside round to nearest and qwix (trained model)")
        bench_calibrate.main(["--quick"] if args.quick else [])


if __name__ == "__main__":
    main()
