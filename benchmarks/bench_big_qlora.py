"""QLoRA fine-tuning of a ~3B-parameter model that cannot be fine-tuned densely here.

The model is the GPT-style decoder of ``bench_lora.py`` (its ``make_loss``, unchanged:
token + position embeddings, pre-LayerNorm blocks with causal multi-head attention and
a gelu MLP, a final LayerNorm and an output head), at 36 layers of width 2560
(20 heads, MLP 10240, vocabulary 32000): 3.0e9 parameters, 12 GB in f32.

- **Built straight into 4 bits.** The layers are stacked for `lax.scan`: every matmul
  weight (q, k, v, o, both MLP matrices) is one `qax.quant.NF4Weight` of shape
  ``(L, m, n)``, allocated empty and filled one layer at a time: a jitted function draws
  that layer's f32 weights from a fixed seed, quantizes them and writes the codes into
  the (donated) stack, so at most one layer is ever in full precision. The embedding
  table and the head are NF4 too (the embedding lookup decodes only the looked-up rows).
- **QLoRA.** `qax.lora.loraify` puts rank-8 factors on every matmul weight (the six of
  each layer, stacked: ``a (L, m, 8)``, ``b (L, 8, n)``, and the head); `qax.lora.split` separates them; optax adam trains
  the factors only. The loss is ``bench_lora``'s dense model code under
  `qax.use_implicit_args`, its layers run by `lax.scan` with `jax.checkpoint` on the
  layer, so tracing and compiling do not grow with depth.
- **Quantizing a dense model in place.** `qax.quant.quantize(dense, "nf4",
  batch_ndim=1)` of the dense f32 model (``--quantize-layers`` layers, 4 by default),
  in a child process that reads its resident memory from ``/proc/self/status``: the
  increase of the peak (``VmHWM``, reset before quantizing) over what the dense model
  already holds, against the largest weight (one stack of layers). `quantize` works
  one weight at a time, so the increase is the quantized model plus one weight's
  working copy; with ``donate=True`` each dense weight is freed once quantized, and
  the increase is one working copy.
- **Dense fine-tuning does not fit.** The dense f32 train step (adam on every weight,
  parameters and optimizer state donated) is lowered and compiled on abstract shapes
  only (it is never run) and its ``memory_analysis()`` is reported: about 48 GB, twice
  this machine's memory.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_big_qlora.py              # 3.0B, 36 layers
    PYTHONPATH=. python benchmarks/bench_big_qlora.py --layers     # + depth 1/4, 1/2, 1
    PYTHONPATH=. python benchmarks/bench_big_qlora.py --size tiny  # smoke run (under a minute)

``--steps`` sets the number of train steps (default 5), ``--layers 9,18`` chooses the
depths of the scaling table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_seconds, markdown_table  # noqa: E402
from bench_lora import MATMUL_WEIGHTS, Config, dense_linear, make_loss  # noqa: E402

import qax  # noqa: E402
from qax.lora import LoraWeight  # noqa: E402
from qax.quant import NF4Weight  # noqa: E402

SIZES = {
    # ~3.0e9 parameters: 36 x 78.6M in the layers, 2 x 81.9M in the embedding and head.
    "3b": Config(
        n_layers=36,
        d_model=2560,
        n_heads=20,
        d_ff=10240,
        vocab=32000,
        seq=16,
        batch=1,
        rank=8,
    ),
    "tiny": Config(
        n_layers=4, d_model=64, n_heads=4, d_ff=256, vocab=256, seq=16, batch=2, rank=4
    ),
}
BLOCK_SIZE = 64
LAYER_MATRICES = {
    "wq": "dd",
    "wk": "dd",
    "wv": "dd",
    "wo": "dd",
    "w1": "df",
    "w2": "fd",
}

# ----------------------------------------------------------------------------------------
# Measuring


def peak_rss() -> int:
    """Peak resident memory of this process so far, in bytes (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def nbytes(tree: Any) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))


def gb(n: float) -> str:
    """Bytes in GB (MB below 0.1 GB, for the tiny size)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def param_count(cfg: Config) -> int:
    """Numbers in the dense model (every weight, LayerNorm and bias)."""
    shapes = jax.eval_shape(lambda: dense_params(cfg, jax.random.key(0)))
    return sum(int(np.prod(s.shape)) for s in jax.tree_util.tree_leaves(shapes))


# ----------------------------------------------------------------------------------------
# The model's parameters


def _matrix_shape(cfg: Config, kind: str) -> tuple[int, int]:
    size = {"d": cfg.d_model, "f": cfg.d_ff}
    return size[kind[0]], size[kind[1]]


def _small_layer_params(cfg: Config, L: int) -> dict:
    """LayerNorms and biases of `L` stacked layers (f32, frozen)."""
    d, f = cfg.d_model, cfg.d_ff

    def ln():
        return {"scale": jnp.ones((L, d)), "bias": jnp.zeros((L, d))}

    return {
        "ln1": ln(),
        "ln2": ln(),
        "mlp": {"b1": jnp.zeros((L, f)), "b2": jnp.zeros((L, d))},
    }


def _normal(key: jax.Array, name: str, shape: tuple[int, ...]) -> jax.Array:
    k = jax.random.fold_in(
        key, MATMUL_WEIGHTS.index(name) if name in MATMUL_WEIGHTS else 99
    )
    return 0.02 * jax.random.normal(k, shape, jnp.float32)


def dense_params(cfg: Config, key: jax.Array) -> dict:
    """The dense f32 model (stacked layers), from the same seed as `nf4_params`.

    Only ever used under `jax.eval_shape` here (for the dense train step's shapes).
    """
    L = cfg.n_layers
    layers = _small_layer_params(cfg, L)
    keys = jax.random.split(jax.random.fold_in(key, 1), L)
    for name, kind in LAYER_MATRICES.items():
        shape = _matrix_shape(cfg, kind)
        w = jax.vmap(lambda k, n=name, s=shape: _normal(k, n, s))(keys)
        layers.setdefault(_group(name), {})[name] = w
    return {
        "wte": _normal(jax.random.fold_in(key, 2), "wte", (cfg.vocab, cfg.d_model)),
        "wpe": _normal(jax.random.fold_in(key, 3), "wpe", (cfg.seq, cfg.d_model)),
        "layers": layers,
        "ln_f": {"scale": jnp.ones(cfg.d_model), "bias": jnp.zeros(cfg.d_model)},
        "head": _normal(jax.random.fold_in(key, 4), "head", (cfg.d_model, cfg.vocab)),
    }


def _group(name: str) -> str:
    return "attn" if name in ("wq", "wk", "wv", "wo") else "mlp"


def nf4_params(cfg: Config, key: jax.Array, log: Any = None) -> dict:
    """The model with every matmul weight (and the embedding) in NF4, built layer by layer.

    The stacked ``(L, m, n)`` NF4 weights are allocated empty (their structure comes from
    `jax.eval_shape`, nothing is computed), then each layer's f32 weights are drawn,
    quantized and written into the donated stacks by one jitted call: the f32 weights of
    one layer at a time exist, never the model's. Layer ``i`` draws from
    ``fold_in(key, 1)``'s ``i``-th split, as `dense_params` does.
    """
    L = cfg.n_layers

    def stacked_shapes(name: str) -> Any:
        shape = (L, *_matrix_shape(cfg, LAYER_MATRICES[name]))
        return jax.eval_shape(
            lambda: NF4Weight.from_array(
                jnp.zeros(shape), block_size=BLOCK_SIZE, batch_ndim=1
            )
        )

    stacks = {
        name: jax.tree_util.tree_map(
            lambda s: jnp.zeros(s.shape, s.dtype), stacked_shapes(name)
        )
        for name in LAYER_MATRICES
    }

    @jax.jit
    def quantized_layer(k: jax.Array) -> dict:
        out = {}
        for name, kind in LAYER_MATRICES.items():
            w = _normal(k, name, _matrix_shape(cfg, kind))
            out[name] = NF4Weight.from_array(w, block_size=BLOCK_SIZE)
        return out

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def one_matrix(k: jax.Array, name: str, shape: tuple[int, int]) -> NF4Weight:
        return NF4Weight.from_array(_normal(k, name, shape), block_size=BLOCK_SIZE)

    def write(stack: Any, layer: Any, i: jax.Array) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(stack)
        new = jax.tree_util.tree_leaves(layer)
        return jax.tree_util.tree_unflatten(
            treedef,
            [lax.dynamic_update_index_in_dim(s, x, i, 0) for s, x in zip(leaves, new)],
        )

    write_all = jax.jit(
        lambda stacks, layer, i: {n: write(stacks[n], layer[n], i) for n in stacks},
        donate_argnums=0,
    )
    keys = jax.random.split(jax.random.fold_in(key, 1), L)
    for i in range(L):
        stacks = write_all(stacks, quantized_layer(keys[i]), jnp.int32(i))
        if log is not None and (i + 1) % max(1, L // 6) == 0:
            jax.block_until_ready(stacks)
            log(f"  layer {i + 1}/{L} quantized, peak RSS {gb(peak_rss())}")
    layers = _small_layer_params(cfg, L)
    for name in LAYER_MATRICES:
        layers.setdefault(_group(name), {})[name] = stacks[name]
    d, v = cfg.d_model, cfg.vocab
    params = {
        "wte": one_matrix(jax.random.fold_in(key, 2), "wte", (v, d)),
        "wpe": _normal(jax.random.fold_in(key, 3), "wpe", (cfg.seq, d)),
        "layers": layers,
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "head": one_matrix(jax.random.fold_in(key, 4), "head", (d, v)),
    }
    return jax.block_until_ready(params)


def _status(key: str) -> int:
    """A memory figure of this process from ``/proc/self/status``, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def quantize_memory(cfg: Config, donate: bool) -> dict[str, int]:
    """Build the dense model, then measure `qax.quant.quantize` of it (run this in a
    fresh process: see `quantize_rows`)."""
    params = jax.block_until_ready(dense_params(cfg, jax.random.key(0)))
    gc.collect()
    model = nbytes(params)
    largest = max(x.nbytes for x in jax.tree_util.tree_leaves(params))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status("VmRSS")
    q = qax.quant.quantize(params, "nf4", batch_ndim=1, donate=donate)
    jax.block_until_ready(q)
    return {
        "model": model,
        "largest": largest,
        "quantized": nbytes(q),
        "before": before,
        "peak": _status("VmHWM"),
    }


def quantize_rows(size: str, layers: int) -> list[list[str]]:
    """`quantize_memory` in child processes, without and with ``donate``."""
    import json
    import subprocess

    rows = []
    for donate in (False, True):
        out = subprocess.run(
            [sys.executable, __file__, "--size", size, "--measure-quantize"]
            + [str(layers), "--donate" if donate else "--no-donate"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        m = json.loads(out.stdout.strip().splitlines()[-1])
        grew = m["peak"] - m["before"]
        rows.append(
            [
                f"quantize(dense, 'nf4'{', donate=True' if donate else ''})",
                gb(m["model"]),
                gb(m["largest"]),
                gb(m["quantized"]),
                gb(m["before"]),
                gb(m["peak"]),
                f"{gb(grew)} ({grew / m['largest']:.2f} x the largest weight)",
            ]
        )
    return rows


def add_lora(cfg: Config, params: dict, key: jax.Array) -> dict:
    """Rank-``cfg.rank`` LoRA on every matmul weight (the stacked ones per layer)."""

    def is_matmul(path: str, leaf: Any) -> bool:
        return path.split("/")[-1] in MATMUL_WEIGHTS

    k_layers, k_head = jax.random.split(key)
    layers = qax.lora.loraify(
        params["layers"], cfg.rank, key=k_layers, filter=is_matmul, batch_ndim=1
    )
    head = qax.lora.loraify(
        {"head": params["head"]}, cfg.rank, key=k_head, filter=is_matmul
    )["head"]
    return {**params, "layers": layers, "head": head}


# ----------------------------------------------------------------------------------------
# Train steps


def qlora_step_fn(cfg: Config, opt: optax.GradientTransformation):
    loss = qax.use_implicit_args(make_loss(cfg, dense_linear, scan=True))

    def step(adapters, opt_state, base, tokens):
        def f(adapters):
            return loss(qax.lora.combine(adapters, base), tokens)

        value, grads = jax.value_and_grad(f)(adapters)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    return step


def dense_step_fn(cfg: Config, opt: optax.GradientTransformation):
    loss = make_loss(cfg, dense_linear, scan=True)

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def memory(compiled: Any) -> dict[str, int]:
    """Bytes from a compiled program's ``memory_analysis()``.

    ``total`` = arguments + outputs - outputs aliased to (donated) arguments + temps: what
    must be resident at once to run the program.
    """
    m = compiled.memory_analysis()
    out = {
        "arguments": int(m.argument_size_in_bytes),
        "outputs": int(m.output_size_in_bytes),
        "aliased": int(m.alias_size_in_bytes),
        "temps": int(m.temp_size_in_bytes),
    }
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temps"]
    return out


def dense_memory(cfg: Config, opt: optax.GradientTransformation) -> dict[str, Any]:
    """Lower and compile the dense f32 train step on abstract shapes; never run it."""
    params = jax.eval_shape(lambda: dense_params(cfg, jax.random.key(0)))
    opt_state = jax.eval_shape(opt.init, params)
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
    start = time.perf_counter()
    compiled = (
        jax.jit(dense_step_fn(cfg, opt), donate_argnums=(0, 1))
        .lower(params, opt_state, tokens)
        .compile()
    )
    return {
        "params": nbytes_abstract(params),
        "opt_state": nbytes_abstract(opt_state),
        "memory": memory(compiled),
        "compile_s": time.perf_counter() - start,
    }


def nbytes_abstract(tree: Any) -> int:
    return sum(
        int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        for s in jax.tree_util.tree_leaves(tree)
    )


@dataclasses.dataclass
class Run:
    layers: int
    build_s: float
    base_bytes: int
    layer_bytes: int
    adapter_bytes: int
    opt_bytes: int
    trace_s: float
    lower_s: float
    compile_s: float
    memory: dict[str, int]
    losses: list[float]
    step_s: list[float]
    rss_after: int


def first_layers(params: dict, depth: int) -> dict:
    """The model cut to its first `depth` layers (a copy of those layers' leaves)."""

    def cut(x: Any) -> Any:
        if isinstance(x, NF4Weight):
            return dataclasses.replace(
                x, packed=x.packed[:depth], absmax=x.absmax[:depth], shape=None
            )
        return x[:depth]

    is_nf4 = lambda x: isinstance(x, NF4Weight)  # noqa: E731
    layers = jax.tree_util.tree_map(cut, params["layers"], is_leaf=is_nf4)
    return {**params, "layers": layers}


def qlora_run(cfg: Config, base: dict, build_s: float, steps: int, log: Any) -> Run:
    """Add LoRA to the NF4 model `base`, compile the QLoRA step, run `steps` steps."""
    opt = optax.adam(1e-3)
    start = time.perf_counter()
    params = add_lora(cfg, base, jax.random.key(1))
    del base
    adapters, base = qax.lora.split(params)
    del params
    opt_state = opt.init(adapters)
    jax.block_until_ready((adapters, opt_state))
    build_s += time.perf_counter() - start
    tokens = jax.random.randint(
        jax.random.key(2), (cfg.batch, cfg.seq + 1), 0, cfg.vocab, jnp.int32
    )
    step = jax.jit(qlora_step_fn(cfg, opt), donate_argnums=(0, 1))
    with (
        qax.materialization_policy(LoraWeight, "error"),
        qax.materialization_policy(NF4Weight, "error"),
    ):
        t0 = time.perf_counter()
        traced = step.trace(adapters, opt_state, base, tokens)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
    losses, times = [], []
    for i in range(steps):
        gc.collect()
        s = time.perf_counter()
        adapters, opt_state, value = compiled(adapters, opt_state, base, tokens)
        losses.append(float(value))
        times.append(time.perf_counter() - s)
        log(f"  step {i + 1}/{steps}: loss {losses[-1]:.4f}, {fmt_seconds(times[-1])}")
    return Run(
        layers=cfg.n_layers,
        build_s=build_s,
        base_bytes=nbytes(base),
        layer_bytes=nbytes(base["layers"]) + nbytes(adapters["layers"]),
        adapter_bytes=nbytes(adapters),
        opt_bytes=nbytes(opt_state),
        trace_s=t1 - t0,
        lower_s=t2 - t1,
        compile_s=t3 - t2,
        memory=memory(compiled),
        losses=losses,
        step_s=times,
        rss_after=peak_rss(),
    )


def steady(times: list[float]) -> float:
    """Median step time, leaving out the first step (it warms up the allocator)."""
    rest = times[1:] or times
    return float(np.median(rest))


# ----------------------------------------------------------------------------------------
# Main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="3b")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--layers",
        nargs="?",
        const="auto",
        default=None,
        help="also run shallower models: a comma list of depths (default: 1/4, 1/2)",
    )
    parser.add_argument(
        "--depth", type=int, default=None, help="override the number of layers"
    )
    parser.add_argument(
        "--quantize-layers",
        type=int,
        default=4,
        help="layers of the dense model whose quantization is measured (0: skip)",
    )
    parser.add_argument("--measure-quantize", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--donate", action=argparse.BooleanOptionalAction, help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    cfg = SIZES[args.size]
    if args.depth is not None:
        cfg = dataclasses.replace(cfg, n_layers=args.depth)
    if args.measure_quantize is not None:  # the child process of `quantize_rows`
        import json

        cfg_q = dataclasses.replace(cfg, n_layers=args.measure_quantize)
        print(json.dumps(quantize_memory(cfg_q, bool(args.donate))))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    depths = [cfg.n_layers]
    if args.layers is not None:
        if args.layers == "auto":
            extra = [max(1, cfg.n_layers // 4), max(1, cfg.n_layers // 2)]
        else:
            extra = [int(x) for x in args.layers.split(",")]
        depths = sorted({*extra, cfg.n_layers})
        if not 1 <= depths[0] <= depths[-1] == cfg.n_layers:
            parser.error(f"--layers: depths must be between 1 and {cfg.n_layers}")

    n_params = param_count(cfg)
    print(f"- JAX {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs")
    print(f"- model: {cfg}")
    print(f"- {n_params:.3e} parameters; NF4 block size {BLOCK_SIZE}")

    log("dense f32 + adam train step: lower + compile on abstract shapes (not run)")
    opt = optax.adam(1e-3)
    dense = dense_memory(cfg, opt)
    log(f"  compiled in {fmt_seconds(dense['compile_s'])}: {dense['memory']}")
    del opt

    log(f"building the NF4 model ({cfg.n_layers} layers) layer by layer")
    start = time.perf_counter()
    base = nf4_params(cfg, jax.random.key(0), log=log)
    build_s = time.perf_counter() - start
    runs = []
    for L in depths:
        log(f"QLoRA, {L} layers: compile, {args.steps} steps")
        cfg_l = dataclasses.replace(cfg, n_layers=L)
        base_l = base if L == cfg.n_layers else first_layers(base, L)
        runs.append(qlora_run(cfg_l, base_l, build_s, args.steps, log))
        del base_l
        gc.collect()
    del base
    full = runs[-1]
    dm = dense["memory"]
    qm = full.memory
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    print(f"- machine memory: {gb(machine)}")
    print(
        f"- loss over {args.steps} QLoRA steps: "
        + ", ".join(f"{x:.4f}" for x in full.losses)
    )
    print()
    rows = [
        ["parameters", gb(dense["params"]), gb(full.base_bytes + full.adapter_bytes)],
        ["  of which trainable", gb(dense["params"]), gb(full.adapter_bytes)],
        ["optimizer state (adam)", gb(dense["opt_state"]), gb(full.opt_bytes)],
        ["compiled step: arguments", gb(dm["arguments"]), gb(qm["arguments"])],
        ["compiled step: temps", gb(dm["temps"]), gb(qm["temps"])],
        [
            "compiled step: needs (args + outputs - donated + temps)",
            gb(dm["total"]),
            gb(qm["total"]),
        ],
        ["peak resident memory of the process", "not run", gb(full.rss_after)],
        ["seconds per train step", "not run", fmt_seconds(steady(full.step_s))],
    ]
    print(
        markdown_table(
            ["", "dense f32 + adam", f"QLoRA (NF4 + rank-{cfg.rank} LoRA)"], rows
        )
    )
    fits = dm["total"] < machine
    print()
    print(
        f"- dense fine-tuning needs {gb(dm['total'])} "
        f"({dm['total'] / 2**30:.1f} GiB): {'fits' if fits else 'does NOT fit'} in "
        f"{gb(machine)}; QLoRA ran with a peak RSS of {gb(full.rss_after)}."
    )
    print(
        f"- building the NF4 model layer by layer + LoRA: {fmt_seconds(full.build_s)}; "
        f"trace {fmt_seconds(full.trace_s)}, lower {fmt_seconds(full.lower_s)}, "
        f"compile {fmt_seconds(full.compile_s)}"
    )
    if len(runs) > 1:
        print()
        table = []
        for r in runs:
            per_layer = r.layer_bytes / r.layers
            table.append(
                [
                    str(r.layers),
                    gb(r.base_bytes + r.adapter_bytes),
                    f"{per_layer / 1e6:.1f} MB",
                    gb(r.memory["total"]),
                    fmt_seconds(steady(r.step_s)),
                    fmt_seconds(r.trace_s),
                    fmt_seconds(r.compile_s),
                ]
            )
        print(
            markdown_table(
                [
                    "layers",
                    "NF4 + LoRA params",
                    "params per layer",
                    "compiled step needs",
                    "s / step",
                    "trace",
                    "compile",
                ],
                table,
            )
        )
        print()
        print(
            "(peak RSS is the process's maximum over all depths: "
            f"{gb(runs[-1].rss_after)}; params per layer: NF4 codes, block scales, "
            "LayerNorms, biases and LoRA factors of one layer)"
        )
    if args.quantize_layers:
        log(f"quantize(dense, 'nf4') of {args.quantize_layers} dense layers: RSS")
        print()
        print(
            markdown_table(
                [
                    f"{args.quantize_layers} layers, f32",
                    "dense model",
                    "largest weight",
                    "quantized model",
                    "resident before",
                    "peak while quantizing",
                    "peak - before",
                ],
                quantize_rows(args.size, args.quantize_layers),
            )
        )
    ok = full.losses[-1] < full.losses[0]
    print()
    print(f"- loss went down: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
