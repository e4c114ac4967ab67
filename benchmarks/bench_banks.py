"""Many adapters at once: `qax.lora.bank` + `qax.lora.per_example` vs the alternatives.

A model of a few ``d x d`` linear layers (``h = h + gelu(h @ w)``, d 1024, 3 layers) with
a rank-16 LoRA on every weight. A bank holds 64 adapters of it over one shared base; a
batch of 64 examples uses ``k`` distinct adapters (example ``i`` uses adapter
``i % k``). Variants of the same batch:

- **qax bank**: `jax.jit(qax.lora.per_example(model))(ids, bank, x)`: the unchanged
  model code, one adapter per example (vmap over the examples, the base unmapped);
- **hand gather**: the same computation written by hand in plain JAX (gather each
  example's factors, one product with the base for the whole batch, batched products
  with the factors, the scale applied to the rank-sized intermediate): the best peer;
- **per-adapter loop**: serving one adapter at a time: for each distinct adapter, one
  jitted call of the whole model (a `qax.lora.LoraWeight` per weight) on its examples,
  then the outputs put back in batch order;
- **one adapter**: the whole batch through one plain LoRA (`qax.lora.LoraWeight`
  parameters under `qax.use_implicit_args`): what a batch costs when it needs no bank.

Phases: *prefill* (batch 64 x 32 tokens) and *decode* (one token per example: 64 x 1).
Then training: 8 adapters in one step (the bank built inside the loss from the list of
adapter trees, `per_example`, `jax.value_and_grad` over the list, one optax adam state)
against 8 sequential jitted single-adapter steps, each on its adapter's share of the
batch (the same examples; the single steps reach the same updated adapters, which is
checked). And bytes: the bank against one base + N adapters, and the compiled
program's temporaries (``memory_analysis``) and largest array against a per-example copy
of a base weight.

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_banks.py            # full run (~5 min on 2 cores)
    PYTHONPATH=. python benchmarks/bench_banks.py --quick    # smoke run (small model)

A full run writes its numbers to ``benchmarks/results/bench_banks.json`` (one entry per
JAX version; the documentation plots step time against the number of distinct adapters
from it); ``--json PATH`` writes elsewhere, ``--json ''`` nowhere.

Times are medians over interleaved repetitions; ratios are medians of per-repetition
ratios (see `benchmarks/_timing.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
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

import qax  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "bench_banks.json"

VARIANTS = ("qax bank", "hand gather", "per-adapter loop", "one adapter")


@dataclasses.dataclass(frozen=True)
class Config:
    d: int = 1024
    layers: int = 3
    rank: int = 16
    adapters: int = 64  # in the bank
    batch: int = 64
    prefill: int = 32  # tokens per example at prefill
    distinct: tuple[int, ...] = (1, 4, 16, 64)
    train_adapters: int = 8
    # (batch, tokens per example) of the training steps: one sequence per adapter, and
    # a prefill-sized batch (8 sequences per adapter)
    train_sizes: tuple[tuple[int, int], ...] = ((8, 32), (64, 32))


QUICK = Config(
    d=128,
    layers=2,
    rank=8,
    adapters=8,
    batch=8,
    prefill=8,
    distinct=(1, 8),
    train_sizes=((8, 8),),
)


@dataclasses.dataclass(frozen=True)
class Reps:
    prefill: int
    decode: int
    train: int


# ----------------------------------------------------------------------------------------
# The model (plain JAX, written for dense weights) and its adapters


def init(cfg: Config, key: jax.Array) -> dict:
    keys = jax.random.split(key, cfg.layers)
    return {
        f"layer{i}": {"kernel": jax.random.normal(k, (cfg.d, cfg.d)) / math.sqrt(cfg.d)}
        for i, k in enumerate(keys)
    }


def model(params: dict, x: jax.Array) -> jax.Array:
    for layer in params.values():
        x = x + jax.nn.gelu(x @ layer["kernel"])
    return x


def make_adapters(cfg: Config, pretrained: dict, n: int, seed: int = 1):
    """``n`` trained-looking adapters (random, non-zero factors) and their base."""
    found, base = [], None
    for i in range(n):
        lora = qax.lora.loraify(
            pretrained,
            cfg.rank,
            key=jax.random.key(seed + i),
            alpha=2.0 * cfg.rank,
            filter=lambda path, leaf: path.endswith("kernel"),
        )
        adapters, base = qax.lora.split(lora)
        noise = jax.random.key(10_000 + i)

        def perturb(x, noise=noise):
            return x + 0.02 * jax.random.normal(noise, jnp.shape(x), x.dtype)

        found.append(jax.tree_util.tree_map(perturb, adapters))
    return found, base


def hand_model(kernels, a, b, scales, ids, x):
    """The bank written by hand: gather each example's factors, batched products."""
    s = scales[ids][:, None, None]
    for w, a_all, b_all in zip(kernels, a, b, strict=True):
        t = jnp.einsum("bti,bir->btr", x, a_all[ids]) * s
        x = x + jax.nn.gelu(x @ w + jnp.einsum("btr,bro->bto", t, b_all[ids]))
    return x


def hand_args(served: dict) -> tuple:
    banks = [layer["kernel"] for layer in served.values()]
    kernels = [x.w for x in banks]
    return (
        kernels,
        [x.a for x in banks],
        [x.b for x in banks],
        jnp.asarray(banks[0].scales()),
    )


# ----------------------------------------------------------------------------------------
# Serving: one phase (prefill or decode), k distinct adapters


@dataclasses.dataclass
class Serving:
    """Every variant's call on one batch, ready to time (all compiled)."""

    calls: dict[str, Callable[[], Any]]


def serving(cfg: Config, setup: dict, seq: int, k: int) -> Serving:
    served, base, adapters = setup["served"], setup["base"], setup["adapters"]
    x = jax.random.normal(jax.random.key(seq * 1000 + k), (cfg.batch, seq, cfg.d))
    ids = jnp.asarray(np.arange(cfg.batch) % k, jnp.int32)

    bank_f = setup["bank_f"]
    hand_f = setup["hand_f"]
    one_f = setup["one_f"]
    one_params = setup["combined"][0]
    hargs = setup["hand_args"]

    # The per-adapter loop: the examples of each distinct adapter (a server knows them
    # when it forms the batch), one call each, then the outputs back in batch order.
    ids_np = np.asarray(ids)
    groups = [(j, np.flatnonzero(ids_np == j)) for j in np.unique(ids_np)]
    order = np.concatenate([idx for _, idx in groups])
    inverse = jnp.asarray(np.argsort(order))
    group_idx = [jnp.asarray(idx) for _, idx in groups]
    combined = setup["combined"]
    loop_one, loop_put = setup["loop_one"], setup["loop_put"]

    def loop():
        outs = [
            loop_one(combined[j], x, idx)
            for (j, _), idx in zip(groups, group_idx, strict=True)
        ]
        return loop_put(outs, inverse)

    calls = {
        "qax bank": lambda: bank_f(ids, served, x),
        "hand gather": lambda: hand_f(*hargs, ids, x),
        "per-adapter loop": loop,
        "one adapter": lambda: one_f(one_params, x),
    }
    # All variants compute the same outputs (one adapter: when k == 1).
    want = calls["per-adapter loop"]()
    for name in ("qax bank", "hand gather") + (("one adapter",) if k == 1 else ()):
        np.testing.assert_allclose(
            calls[name](), want, rtol=2e-4, atol=2e-4, err_msg=name
        )
    del adapters, base
    return Serving(
        {n: (lambda f=f: jax.block_until_ready(f())) for n, f in calls.items()}
    )


def build(cfg: Config) -> dict:
    pretrained = init(cfg, jax.random.key(0))
    adapters, base = make_adapters(cfg, pretrained, cfg.adapters)
    served = qax.lora.bank(base, adapters)
    combined = [qax.lora.combine(a, base) for a in adapters]
    implicit_model = qax.use_implicit_args(model)

    @jax.jit
    def loop_one(params, x, idx):
        return implicit_model(params, x[idx])

    @jax.jit
    def loop_put(outs, inverse):
        return jnp.concatenate(outs)[inverse]

    return {
        "pretrained": pretrained,
        "adapters": adapters,
        "base": base,
        "served": served,
        "combined": combined,
        "bank_f": jax.jit(qax.lora.per_example(model)),
        "hand_f": jax.jit(hand_model),
        "hand_args": hand_args(served),
        "one_f": jax.jit(implicit_model),
        "loop_one": loop_one,
        "loop_put": loop_put,
    }


def measure_phase(cfg: Config, setup: dict, seq: int, reps: int) -> dict:
    """Times of every variant for each number of distinct adapters."""
    out: dict[str, Any] = {"distinct": list(cfg.distinct), "times": {}}
    for k in cfg.distinct:
        print(f"  {k} distinct adapter(s) ...", file=sys.stderr)
        s = serving(cfg, setup, seq, k)
        out["times"][k] = interleaved(s.calls, reps, warmup=2)
    return out


def phase_rows(phase: dict) -> list[list[str]]:
    rows = []
    for k in phase["distinct"]:
        t = phase["times"][k]
        rows.append(
            [
                str(k),
                *(fmt_seconds(median(t[v])) for v in VARIANTS),
                f"{paired_ratio(t, 'qax bank', 'one adapter'):.2f}",
                f"{paired_ratio(t, 'qax bank', 'hand gather'):.2f}",
                f"{paired_ratio(t, 'per-adapter loop', 'qax bank'):.1f}",
            ]
        )
    return rows


PHASE_HEADERS = [
    "distinct adapters",
    *VARIANTS,
    "bank ÷ one",
    "qax ÷ hand",
    "loop ÷ bank",
]


# ----------------------------------------------------------------------------------------
# Training: n adapters in one step vs n sequential single-adapter steps


def training(cfg: Config, setup: dict, reps: int, batch: int, seq: int) -> dict:
    """One step of ``cfg.train_adapters`` adapters on ``batch`` examples of ``seq``
    tokens (an equal share each) against the single-adapter steps one after another."""
    n = cfg.train_adapters
    adapters, base = setup["adapters"][:n], setup["base"]
    share = batch // n
    x = jax.random.normal(jax.random.key(77), (batch, seq, cfg.d))
    y = jax.random.normal(jax.random.key(78), x.shape)
    ids = jnp.asarray(np.repeat(np.arange(n), share), jnp.int32)
    opt = optax.adam(1e-3)
    per_adapter = share * seq * cfg.d  # numbers in one adapter's loss

    def bank_loss(adapters, base, ids, x, y):
        out = qax.lora.per_example(model)(ids, qax.lora.bank(base, adapters), x)
        # Each adapter's loss is the mean over its own examples: the sum of the n
        # single-adapter losses, so each adapter gets its single step's gradient.
        return jnp.sum((out - y) ** 2) / per_adapter

    @jax.jit
    def bank_step(adapters, opt_state, base, ids, x, y):
        loss, grads = jax.value_and_grad(bank_loss)(adapters, base, ids, x, y)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    implicit_model = qax.use_implicit_args(model)

    def one_loss(adapter, base, x, y):
        out = implicit_model(qax.lora.combine(adapter, base), x)
        return jnp.sum((out - y) ** 2) / per_adapter

    @jax.jit
    def one_step(adapter, opt_state, base, x, y):
        loss, grads = jax.value_and_grad(one_loss)(adapter, base, x, y)
        updates, opt_state = opt.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, loss

    xs = [x[j * share : (j + 1) * share] for j in range(n)]
    ys = [y[j * share : (j + 1) * share] for j in range(n)]
    bank_state = opt.init(adapters)
    one_states = [opt.init(a) for a in adapters]

    def together():
        return bank_step(adapters, bank_state, base, ids, x, y)

    def sequential():
        return [
            one_step(adapters[j], one_states[j], base, xs[j], ys[j]) for j in range(n)
        ]

    # Both ways give each adapter the same gradient (so the same adam step).
    got = jax.jit(jax.grad(bank_loss))(adapters, base, ids, x, y)
    one_grad = jax.jit(jax.grad(one_loss))
    want = [one_grad(adapters[j], base, xs[j], ys[j]) for j in range(n)]
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * np.abs(w).max())
    times = interleaved(
        {
            f"{n} adapters, one step": lambda: jax.block_until_ready(together()),
            f"{n} sequential steps": lambda: jax.block_until_ready(sequential()),
        },
        reps,
        warmup=2,
    )
    return {"adapters": n, "batch": batch, "seq": seq, "times": times}


def train_label(train: dict) -> str:
    share = train["batch"] // train["adapters"]
    return (
        f"{train['adapters']} adapters x {share} example{'s' * (share > 1)} x "
        f"{train['seq']} tokens"
    )


def train_rows(trains: list[dict]) -> list[list[str]]:
    rows = []
    for train in trains:
        t = train["times"]
        one, seq = list(t)
        rows.append(
            [
                train_label(train),
                fmt_seconds(median(t[one])),
                fmt_seconds(median(t[seq])),
                f"{paired_ratio(t, seq, one):.2f}",
            ]
        )
    return rows


# ----------------------------------------------------------------------------------------
# Bytes


def nbytes(tree: Any) -> int:
    return sum(
        int(np.prod(jnp.shape(x))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )


def largest_array(compiled) -> tuple[int, str]:
    """Elements and shape of the largest array an instruction of the optimized HLO
    makes (fusion bodies included)."""
    best = (0, "")
    for m in re.finditer(r"= (\w+)\[([\d,]*)\]", compiled.as_text()):
        dims = [int(d) for d in m.group(2).split(",") if d]
        size = math.prod(dims)
        if size > best[0]:
            best = (size, f"{m.group(1)}[{m.group(2)}]")
    return best


def memory(cfg: Config, setup: dict) -> dict:
    served, base, adapters = setup["served"], setup["base"], setup["adapters"]
    weight = cfg.d * cfg.d
    out = {
        "base_bytes": nbytes(base),
        "adapter_bytes": nbytes(adapters[0]),
        "bank_bytes": nbytes(served),
        "n": cfg.adapters,
        "weight_elements": weight,
        "programs": {},
    }
    ids = jnp.asarray(np.arange(cfg.batch) % cfg.adapters, jnp.int32)
    for phase, seq in (("prefill", cfg.prefill), ("decode", 1)):
        x = jnp.zeros((cfg.batch, seq, cfg.d))
        for name, f, args in (
            ("qax bank", qax.lora.per_example(model), (ids, served, x)),
            ("hand gather", hand_model, (*setup["hand_args"], ids, x)),
            ("one adapter", qax.use_implicit_args(model), (setup["combined"][0], x)),
        ):
            compiled = jax.jit(f).lower(*args).compile()
            stats = compiled.memory_analysis()
            size, shape = largest_array(compiled)
            out["programs"][f"{phase}/{name}"] = {
                "temp_bytes": int(stats.temp_size_in_bytes),
                "argument_bytes": int(stats.argument_size_in_bytes),
                "largest_elements": size,
                "largest_shape": shape,
            }
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_rows(mem: dict, cfg: Config) -> tuple[list[list[str]], list[str]]:
    rows = []
    for key, p in mem["programs"].items():
        rows.append(
            [
                key,
                mib(p["temp_bytes"]),
                mib(p["argument_bytes"]),
                f"{p['largest_shape']} ({p['largest_elements'] / mem['weight_elements']:.2f} weights)",
            ]
        )
    want = mem["base_bytes"] + mem["n"] * mem["adapter_bytes"]
    notes = [
        f"bank: {mib(mem['bank_bytes'])} = base {mib(mem['base_bytes'])} + "
        f"{mem['n']} x adapter {mem['adapter_bytes'] / 2**10:.0f} KiB "
        f"({'exactly' if want == mem['bank_bytes'] else 'NOT: ' + mib(want)})",
        f"a per-example copy of one base weight would be {cfg.batch} x "
        f"{mem['weight_elements']:,} = {cfg.batch * mem['weight_elements']:,} elements "
        f"({mib(cfg.batch * mem['weight_elements'] * 4)}); of the base, "
        f"{mib(cfg.batch * mem['base_bytes'])}",
    ]
    return rows, notes


# ----------------------------------------------------------------------------------------
# Targets, JSON, main


def targets(cfg: Config, phases: dict, trains: list, mem: dict) -> list[list[str]]:
    rows = []
    pre, dec = phases["prefill"]["times"], phases["decode"]["times"]
    top = max(cfg.distinct)
    mid = 16 if 16 in pre else top

    def row(what, value, ok):
        rows.append([what, value, "met" if ok else "MISSED"])

    r = paired_ratio(pre[mid], "qax bank", "one adapter")
    row(f"prefill: {mid} distinct ÷ one adapter ≤ 1.1x", f"{r:.2f}x", r <= 1.1)
    r = paired_ratio(dec[top], "qax bank", "one adapter")
    row(f"decode: {top} distinct ÷ one adapter ≤ 2.0x", f"{r:.2f}x", r <= 2.0)
    r = paired_ratio(dec[top], "per-adapter loop", "qax bank")
    row(
        f"decode: per-adapter loop ÷ bank at {top} adapters ≥ 20x", f"{r:.1f}x", r >= 20
    )
    for train in trains:
        t = train["times"]
        one, seq = list(t)
        r = paired_ratio(t, seq, one)
        row(
            f"training ({train_label(train)}): one step ≥ 1.3x the throughput of "
            "sequential steps",
            f"{r:.2f}x",
            r >= 1.3,
        )
    exact = mem["bank_bytes"] == mem["base_bytes"] + mem["n"] * mem["adapter_bytes"]
    row("bytes: bank = base + N x adapter", "exact" if exact else "differs", exact)
    per_example = cfg.batch * mem["weight_elements"]
    biggest = max(
        p["largest_elements"] for k, p in mem["programs"].items() if "qax" in k
    )
    row(
        "no per-example copy of the base in the compiled program",
        f"largest array {biggest / mem['weight_elements']:.2f} weights",
        biggest < per_example,
    )
    return rows


def to_json(cfg: Config, phases: dict, trains: list, mem: dict, command: str) -> dict:
    def phase_json(p):
        return {
            "distinct": p["distinct"],
            "median_s": {
                v: [median(p["times"][k][v]) for k in p["distinct"]] for v in VARIANTS
            },
            "ratio_to_one_adapter": {
                v: [
                    paired_ratio(p["times"][k], v, "one adapter") for k in p["distinct"]
                ]
                for v in VARIANTS
            },
        }

    return {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "platform": jax.devices()[0].platform,
        "cpus": os.cpu_count(),
        "command": command,
        "config": dataclasses.asdict(cfg),
        "batch": cfg.batch,
        "prefill": {"seq": cfg.prefill, **phase_json(phases["prefill"])},
        "decode": {"seq": 1, **phase_json(phases["decode"])},
        "train": [
            {
                "adapters": train["adapters"],
                "batch": train["batch"],
                "seq": train["seq"],
                "median_s": {k: median(v) for k, v in train["times"].items()},
                "throughput_ratio": paired_ratio(
                    train["times"], *reversed(list(train["times"]))
                ),
            }
            for train in trains
        ],
        "bytes": mem,
    }


def save(path: pathlib.Path, entry: dict) -> None:
    data = {"runs": {}}
    if path.exists():
        data = json.loads(path.read_text())
    data.setdefault("runs", {})[f"JAX {entry['jax']}, Python {entry['python']}"] = entry
    data["runs"] = dict(sorted(data["runs"].items(), reverse=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small model, few repetitions"
    )
    parser.add_argument(
        "--json",
        default=None,
        help=f"where to write the results (default: {RESULTS.relative_to(RESULTS.parents[2])} "
        "for a full run, nowhere for --quick; '' for nowhere)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="layers of the model (default 3; 1 is the plain-JAX reference setup of "
        "one d x d layer)",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("error", qax.MaterializationWarning)
    cfg = QUICK if args.quick else Config()
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, layers=args.layers)
    reps = Reps(3, 5, 3) if args.quick else Reps(prefill=20, decode=40, train=12)
    path = args.json
    if path is None:
        path = "" if args.quick else str(RESULTS)
    command = (
        "PYTHONPATH=. python benchmarks/bench_banks.py"
        + (" --quick" if args.quick else "")
        + (f" --layers {args.layers}" if args.layers is not None else "")
    )

    print(
        f"JAX {jax.__version__}, Python {platform.python_version()}, "
        f"{jax.devices()[0].platform}, {os.cpu_count()} CPUs"
    )
    print(
        f"model: {cfg.layers} layers h + gelu(h @ w), d {cfg.d}, LoRA rank {cfg.rank} on "
        f"every weight; bank of {cfg.adapters} adapters; batch {cfg.batch}; example i "
        "uses adapter i % k"
    )
    print(
        f"times: medians; ratios: medians of paired ratios ({dataclasses.asdict(reps)})\n"
    )

    setup = build(cfg)
    phases = {}
    for phase, seq, n in (
        ("prefill", cfg.prefill, reps.prefill),
        ("decode", 1, reps.decode),
    ):
        print(f"{phase}:", file=sys.stderr)
        phases[phase] = measure_phase(cfg, setup, seq, n)
        print(f"### {phase} (batch {cfg.batch} x {seq} token{'s' * (seq > 1)})\n")
        print(markdown_table(PHASE_HEADERS, phase_rows(phases[phase])))
        print()
    print("training:", file=sys.stderr)
    trains = [
        training(cfg, setup, reps.train, batch, seq) for batch, seq in cfg.train_sizes
    ]
    print(f"### training {cfg.train_adapters} adapters (adam)\n")
    print(
        markdown_table(
            ["batch", "one step, all adapters", "sequential steps", "throughput gain"],
            train_rows(trains),
        )
    )
    print()
    print("bytes:", file=sys.stderr)
    mem = memory(cfg, setup)
    rows, notes = memory_rows(mem, cfg)
    print("### bytes (compiled programs, `memory_analysis`)\n")
    print(
        markdown_table(
            ["program", "temporaries", "arguments", "largest array (in base weights)"],
            rows,
        )
    )
    print()
    for note in notes:
        print(f"- {note}")
    print("\n### targets\n")
    print(markdown_table(["target", "measured", ""], targets(cfg, phases, trains, mem)))
    if path:
        save(pathlib.Path(path), to_json(cfg, phases, trains, mem, command))
        print(f"\n(results written to {path})", file=sys.stderr)


if __name__ == "__main__":
    main()
