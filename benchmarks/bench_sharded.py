"""LoRA and QLoRA training sharded over a 2x4 (data x model) mesh: qax vs hand-written.

The GPT-style model of `bench_lora.py`, every matmul weight a rank-r
`qax.lora.LoraWeight` over the dense weight (``lora``) or over a `qax.quant` weight
(``int8``: one scale per output column; ``int4`` and ``nf4``: two codes per byte, one
scale per block of 64). Two layouts, both over a ``("data", "model")`` mesh of 2 x 4
devices:

- ``fsdp``: every weight matrix (and the token embedding) sharded along its first
  dimension over all 8 devices, the batch too;
- ``megatron``: tensor parallelism over ``model`` (q/k/v, the first MLP matrix and the
  head column-parallel, attention output and the second MLP matrix row-parallel; the
  rest replicated), data parallelism over ``data``.

The dense model's `PartitionSpec`s are written once; `qax.sharding.implicit_shardings`
derives the shardings of the LoRA factors, codes and scales from them, as the types
declare. The hand-written variant holds the very same leaves (plain dicts) with the
very same shardings, and computes ``x @ w + (x @ a) @ b`` itself, decoding quantized
weights before the product as the `qax.quant` handlers do. Both train steps
differentiate with respect to the factors, apply adam, and return the parameters
(factors updated, base weights untouched) with in/out shardings given to `jax.jit`.

The `qax.quant` types declare their codes and scales ``stored``: qax moves them between
devices as stored and decodes after the move (see `qax.sharding`). Hand-written code
does not get that: XLA decodes where the codes lie and moves the floats.

Measured per (kind, layout): the collectives in the compiled (optimized) HLO, count
and bytes by opcode; the all-gather bytes of the base weights (results shaped like a
dense weight, its codes or its scales); and the steady-state step time of qax, of the
hand-written step and of hand-written LoRA (f32 base) side by side.

Run from the repository root (the script sets the 8-device flag itself):

    PYTHONPATH=. python benchmarks/bench_sharded.py            # full run
    PYTHONPATH=. python benchmarks/bench_sharded.py --quick    # smoke run
    PYTHONPATH=. python benchmarks/bench_sharded.py --quick --processes 2

``--processes 2`` runs the qax step on the same 2 x 4 mesh as two processes of 4 CPU
devices (JAX's multi-controller runtime, gloo collectives on localhost; ``"data"``
runs across the processes) beside the one-process run, and prints one row per kind
and layout: the collectives' count and bytes in each (equal: the same program) and
the step time of each.

The tests (`tests/_sharded_training_cases.py`) import the model code from here.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts
    import sys as _sys

    # one process of a 2-process run (`--processes 2`) holds 4 of the 8 devices
    _local = 4 if "--process-id" in " ".join(_sys.argv) else 8
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={_local}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import collections
import dataclasses
import re
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    fmt_seconds,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
)
from bench_lora import (  # noqa: E402
    MATMUL_WEIGHTS,
    Config,
    dense_linear,
    init_params,
    make_loss,
)

import qax  # noqa: E402

# ----------------------------------------------------------------------------------------
# Parameters: built-in implicit types, and the same leaves as plain dicts


KINDS = ("lora", "int8", "int4", "nf4")
QUANTIZED = ("int8", "int4", "nf4")
LAYOUTS = ("fsdp", "megatron")
AXES = ("data", "model")
BLOCK = 64  # numbers per scale of the 4-bit formats
# LoRA rank: 32, so that no factor has the shape of a block scale ([m, n / 64]), and
# the all-gathers of the base weights are told apart by their shapes.
RANK = 32
LoraWeight = qax.lora.LoraWeight


def with_lora(
    dense: dict, kind: str, rng: np.random.Generator, rank: int, block: int = BLOCK
) -> dict:
    """`dense` with every matmul weight a `LoraWeight` over the weight (``lora``) or
    over its `qax.quant` format (`kind`, 4-bit formats with `block` numbers per
    scale); ``b`` is random so that the factors' gradients are not trivially zero."""
    options = {"int4": {"group_size": block}, "nf4": {"block_size": block}}

    def convert(path, w):
        if getattr(path[-1], "key", None) not in MATMUL_WEIGHTS:
            return w
        a = jnp.asarray(0.02 * rng.standard_normal((w.shape[0], rank)), w.dtype)
        b = jnp.asarray(0.02 * rng.standard_normal((rank, w.shape[1])), w.dtype)
        if kind != "lora":
            w = qax.quant.quantize(
                w, kind, filter=lambda *_: True, **options.get(kind, {})
            )
        return LoraWeight(w, a, b)

    return jax.tree_util.tree_map_with_path(convert, dense)


def implicit_params(cfg: Config, kind: str, seed: int = 0) -> tuple[dict, dict]:
    """The dense parameters and the same with every matmul weight a `LoraWeight`."""
    dense = jax.jit(init_params, static_argnums=(0, 2))(
        cfg, jax.random.PRNGKey(seed), False
    )
    return dense, with_lora(dense, kind, np.random.default_rng(seed), cfg.rank)


def _implicit(x: Any) -> bool:
    return isinstance(x, qax.ImplicitBase)


# The leaves of each quantized type, by field name, as the hand-written dicts hold them.
_STORED = {
    qax.quant.Int8Weight: ("q", "scale"),
    qax.quant.Int4Weight: ("packed", "scale"),
    qax.quant.NF4Weight: ("packed", "absmax"),
}


def to_hand(tree: Any) -> Any:
    """The same leaves in plain dicts: ``{"w", "a", "b"}``, a quantized ``w`` as the
    dict of its fields (``{"q", "scale"}``, ``{"packed", "scale"}`` for int4,
    ``{"packed", "absmax"}`` for nf4).

    Works on parameters and on trees of shardings or specs shaped like them."""

    def convert(x):
        if isinstance(x, LoraWeight):
            return {"w": convert(x.w), "a": x.a, "b": x.b}
        if type(x) in _STORED:
            return {name: getattr(x, name) for name in _STORED[type(x)]}
        return x

    return jax.tree_util.tree_map(convert, tree, is_leaf=_implicit)


def _unpack(packed: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte, the even element in the low nibble."""
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return codes.reshape(*packed.shape[:-1], -1)


def _per_block(values: jax.Array, scale: jax.Array) -> jax.Array:
    """``values`` times one scale per block along the last axis (blocks of equal size)."""
    blocks = values.reshape(*scale.shape, -1) * scale[..., None]
    return blocks.reshape(values.shape)


def hand_decode(w: Any, dtype: Any) -> jax.Array:
    """The dense weight of a hand-written quantized dict (a dense weight unchanged)."""
    if not isinstance(w, dict):
        return w
    if "q" in w:
        return w["q"].astype(dtype) * w["scale"]
    if "scale" in w:
        return _per_block(
            (_unpack(w["packed"]).astype(jnp.int32) - 8).astype(dtype), w["scale"]
        )
    levels = jnp.asarray(qax.quant.NF4_LEVELS, dtype)[_unpack(w["packed"])]
    return _per_block(levels, w["absmax"])


def hand_linear(x: jax.Array, p: dict) -> jax.Array:
    """Hand-written (Q)LoRA: ``x @ w + (x @ a) @ b``, a quantized ``w`` decoded first."""
    return x @ hand_decode(p["w"], x.dtype) + (x @ p["a"]) @ p["b"]


def _is_hand_lora(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {"w", "a", "b"}


def hand_split(params: Any) -> tuple[Any, Any]:
    """`qax.lora.split` for the hand-written dicts: (factors, everything)."""
    adapters = jax.tree_util.tree_map(
        lambda x: {"a": x["a"], "b": x["b"]} if _is_hand_lora(x) else None,
        params,
        is_leaf=_is_hand_lora,
    )
    return adapters, params


def hand_combine(adapters: Any, params: Any) -> Any:
    """`qax.lora.combine` for the hand-written dicts."""
    return jax.tree_util.tree_map(
        lambda ad, x: x if ad is None else {"w": x["w"], **ad},
        adapters,
        params,
        is_leaf=lambda x: x is None or (isinstance(x, dict) and set(x) == {"a", "b"}),
    )


QAX = (qax.lora.split, qax.lora.combine)
HAND = (hand_split, hand_combine)


def dense_specs(dense: dict, layout: str) -> tuple[dict, P]:
    """The dense model's `PartitionSpec`s for `layout`, and the spec of the tokens."""
    column = ("wq", "wk", "wv", "w1", "head")
    row = ("wo", "w2")

    def spec(path, x):
        name = getattr(path[-1], "key", None)
        if layout == "fsdp":
            matrix = name in MATMUL_WEIGHTS or name == "wte"
            return P(AXES) if matrix else P()
        if name in column:
            return P(None, "model")
        if name in row:
            return P("model", None)
        if name == "b1":
            return P("model")
        return P()

    tokens = P(AXES) if layout == "fsdp" else P("data")
    return jax.tree_util.tree_map_with_path(spec, dense), tokens


# ----------------------------------------------------------------------------------------
# The train step and its sharded setup


OPTIMIZER = optax.adam(1e-2)


def make_mesh() -> jax.sharding.Mesh:
    """The 2 x 4 ``("data", "model")`` mesh (automatic sharding propagation)."""
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), AXES)


def make_step(loss: Callable, split: Callable, combine: Callable) -> Callable:
    """(params, opt_state, tokens) -> (params, opt_state, loss); only the factors move."""

    def step(params, opt_state, tokens):
        adapters, base = split(params)
        value, grads = jax.value_and_grad(lambda ad: loss(combine(ad, base), tokens))(
            adapters
        )
        updates, opt_state = OPTIMIZER.update(grads, opt_state, adapters)
        return combine(optax.apply_updates(adapters, updates), base), opt_state, value

    return step


@dataclasses.dataclass
class Setup:
    """One variant's step, arguments and shardings."""

    step: Callable
    args: tuple  # (params, opt_state, tokens), unplaced
    in_shardings: tuple
    out_shardings: tuple

    def jitted(self) -> Callable:
        return jax.jit(
            self.step, in_shardings=self.in_shardings, out_shardings=self.out_shardings
        )

    def placed(self) -> tuple:
        return jax.device_put(self.args, self.in_shardings)


def build(
    cfg: Config,
    params: tuple[dict, dict],
    layout: str,
    mesh: jax.sharding.Mesh,
    tokens: jax.Array,
) -> dict:
    """``{"qax": Setup, "hand": Setup}`` for one kind's ``(dense, implicit)`` params
    and a layout: the same leaves with the same shardings."""
    dense, implicit = params
    specs, token_spec = dense_specs(dense, layout)
    shardings = qax.sharding.implicit_shardings(implicit, specs, mesh)
    replicated = NamedSharding(mesh, P())
    token_sharding = NamedSharding(mesh, token_spec)
    activations = {
        "residual": NamedSharding(mesh, P(*token_spec, None, None)),
        "hidden": NamedSharding(
            mesh, P(*token_spec, None, "model" if layout == "megatron" else None)
        ),
    }

    def constrain(x, name):  # activations laid out as FSDP / Megatron code lays them
        return jax.lax.with_sharding_constraint(x, activations[name])

    dense_loss = make_loss(cfg, dense_linear, scan=False, layout=constrain)
    out = {}
    for name, tree, sh, loss, (split, combine) in (
        ("qax", implicit, shardings, qax.use_implicit_args(dense_loss), QAX),
        (
            "hand",
            to_hand(implicit),
            to_hand(shardings),
            hand_loss(cfg, constrain),
            HAND,
        ),
    ):
        opt_state = OPTIMIZER.init(split(tree)[0])
        opt_sh = optax.tree_map_params(
            OPTIMIZER,
            lambda _p, s: s,
            opt_state,
            split(sh)[0],
            transform_non_params=lambda _: replicated,
        )
        out[name] = Setup(
            make_step(loss, split, combine),
            (tree, opt_state, tokens),
            (sh, opt_sh, token_sharding),
            (sh, opt_sh, replicated),
        )
    return out


def hand_loss(cfg: Config, layout: Callable | None = None) -> Callable:
    return make_loss(cfg, hand_linear, scan=False, layout=layout)


def make_tokens(cfg: Config, seed: int = 1) -> jax.Array:
    return jax.random.randint(
        jax.random.PRNGKey(seed), (cfg.batch, cfg.seq + 1), 0, cfg.vocab
    )


# ----------------------------------------------------------------------------------------
# Collectives in the compiled HLO

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
# `  %x = f32[8,64]{1,0} all-reduce(...)`, also tuple-shaped results and `-start` ops.
_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}


def _nbytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        size = _BYTES.get(dtype, 8 if dtype.endswith("64") else 4)
        total += size * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """``{opcode: (count, bytes of results)}`` of the collectives in optimized HLO."""
    found: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if match and not line.lstrip().startswith("//"):
            shape_text, op = match.group(1), match.group(2)
            found[op][0] += 1
            found[op][1] += _nbytes(shape_text)
    return {op: (found[op][0], found[op][1]) for op in COLLECTIVES}


def base_shapes(implicit: Any) -> set[tuple[int, ...]]:
    """The shapes of the base weights of every `LoraWeight` in `implicit`: the dense
    weight's, and those of its codes and scales when it is quantized.

    Raises:
      ValueError: a LoRA factor or another array has one of those shapes (its gathers
        would count).
    """
    shapes, others = set(), set()
    for x in jax.tree_util.tree_leaves(
        implicit, is_leaf=lambda y: isinstance(y, LoraWeight)
    ):
        if isinstance(x, LoraWeight):
            shapes.add(tuple(x.w.shape))
            shapes.update(tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(x.w))
            others.update((tuple(x.a.shape), tuple(x.b.shape)))
        else:
            others.add(tuple(x.shape))
    if shapes & others:
        raise ValueError(
            f"arrays of shapes {sorted(shapes & others)} look like base weights in the "
            "HLO: pick another rank or size."
        )
    return shapes


def gathered_arrays(
    hlo_text: str, shapes: set[tuple[int, ...]]
) -> dict[tuple[str, tuple[int, ...]], int]:
    """``{(element type, shape): bytes}`` of the all-gather results in optimized HLO
    whose shape is one of `shapes` (the base weights', see `base_shapes`)."""
    found: dict = collections.Counter()
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if (
            not match
            or match.group(2) != "all-gather"
            or line.lstrip().startswith("//")
        ):
            continue
        for dtype, dims in _ARRAY.findall(match.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if shape in shapes:
                found[dtype, shape] += _nbytes(f"{dtype}[{dims}]")
    return dict(found)


def gathered_bytes(hlo_text: str, shapes: set[tuple[int, ...]]) -> dict[str, int]:
    """``{element type: bytes}`` of `gathered_arrays`."""
    found: dict[str, int] = collections.Counter()
    for (dtype, _), n in gathered_arrays(hlo_text, shapes).items():
        found[dtype] += n
    return dict(found)


def _types(by_type: dict[str, int]) -> str:
    return ", ".join(sorted(by_type)) or "-"


# ----------------------------------------------------------------------------------------
# Benchmark


def _config(quick: bool) -> tuple[Config, int]:
    if quick:
        # (d_model 256: four blocks of 64 per row, so that columns split four ways)
        return Config(n_layers=1, d_model=256, d_ff=256, seq=16, batch=8, rank=RANK), 3
    return Config(batch=8, rank=RANK), 7


def _qax_facts(cfg: Config, reps: int) -> dict:
    """``{"kind/layout": [collective count, bytes, median step seconds]}`` of the qax
    step on the 2 x 4 mesh of this run (one process or several)."""
    mesh, tokens = make_mesh(), make_tokens(cfg)
    out = {}
    for layout in LAYOUTS:
        for kind in KINDS:
            setup = build(cfg, implicit_params(cfg, kind), layout, mesh, tokens)["qax"]
            placed = setup.placed()
            compiled = setup.jitted().lower(*placed).compile()
            comm = collectives(compiled.as_text()).values()
            times = interleaved(
                {"qax": lambda c=compiled, a=placed: jax.block_until_ready(c(*a))},
                reps,
                warmup=2,
            )
            out[f"{kind}/{layout}"] = [
                sum(c for c, _ in comm),
                sum(b for _, b in comm),
                median(times["qax"]),
            ]
    return out


def _process_main(args) -> None:
    """One process of a ``--processes 2`` run: its facts as JSON (process 0)."""
    import json

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=2,
        process_id=args.process_id,
    )
    facts = _qax_facts(*_config(args.quick))
    if jax.process_index() == 0:
        print("FACTS " + json.dumps(facts))


def _two_process_rows(args) -> list[list[str]]:
    """Launch this script as 2 processes x 4 devices; rows beside this process's."""
    import json
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, os.path.abspath(__file__), f"--port={port}"]
    command += ["--quick"] if args.quick else []
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [*command, f"--process-id={i}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    line = next(x for x in outs[0].splitlines() if x.startswith("FACTS "))
    two = json.loads(line[len("FACTS ") :])
    one = _qax_facts(*_config(args.quick))
    rows = []
    for key, (count, nbytes, seconds) in one.items():
        count2, nbytes2, seconds2 = two[key]
        kind, layout = key.split("/")
        rows.append(
            [
                kind,
                layout,
                f"{count} / {count2}",
                f"{nbytes:,} / {nbytes2:,}",
                "yes" if (count, nbytes) == (count2, nbytes2) else "**no**",
                fmt_seconds(seconds),
                fmt_seconds(seconds2),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        choices=(1, 2),
        help="2: also the qax step as 2 processes x 4 devices",
    )
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.process_id is not None:
        return _process_main(args)
    if args.processes == 2:
        rows = _two_process_rows(args)
        print("### qax step: 1 process x 8 devices / 2 processes x 4 devices\n")
        print(
            markdown_table(
                [
                    "kind",
                    "layout",
                    "collectives (1 / 2 processes)",
                    "bytes (1 / 2)",
                    "equal",
                    "step, 1 process",
                    "step, 2 processes",
                ],
                rows,
            )
        )
        return None
    warnings.simplefilter("error", qax.MaterializationWarning)
    if jax.device_count() < 8:
        raise SystemExit("needs 8 devices: run as a script (it sets XLA_FLAGS itself)")
    cfg, reps = _config(args.quick)
    mesh = make_mesh()
    tokens = make_tokens(cfg)
    print(
        f"JAX {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} "
        f"devices on {os.cpu_count()} CPUs; mesh {dict(mesh.shape)}; model: {cfg}\n"
    )

    comm_rows, base_rows, time_rows, notes = [], [], [], []
    for layout in LAYOUTS:
        lora_bytes, lora_step = None, None
        for kind in KINDS:
            print(f"{kind} / {layout} ...", file=sys.stderr)
            params = implicit_params(cfg, kind)
            setups = build(cfg, params, layout, mesh, tokens)
            placed = {n: s.placed() for n, s in setups.items()}
            compiled = {
                n: s.jitted().lower(*placed[n]).compile() for n, s in setups.items()
            }
            texts = {n: c.as_text() for n, c in compiled.items()}
            comm = {n: collectives(t) for n, t in texts.items()}
            total = {n: [0, 0] for n in comm}
            for op in COLLECTIVES:
                (qc, qb), (hc, hb) = comm["qax"][op], comm["hand"][op]
                for n, (c, b) in (("qax", (qc, qb)), ("hand", (hc, hb))):
                    total[n][0] += c
                    total[n][1] += b
                if qc or hc:
                    comm_rows.append(
                        [kind, layout, op, str(hc), str(qc), f"{hb:,}", f"{qb:,}"]
                    )
            (qc, qb), (hc, hb) = total["qax"], total["hand"]
            comm_rows.append(
                [kind, layout, "**total**", str(hc), str(qc), f"{hb:,}", f"{qb:,}"]
            )
            if qb > hb:
                notes.append(f"{kind}/{layout}: qax moves MORE bytes than hand-written")

            shapes = base_shapes(params[1])
            base = {n: gathered_bytes(t, shapes) for n, t in texts.items()}
            sums = {n: sum(b.values()) for n, b in base.items()}
            if kind == "lora":
                lora_bytes = sums["hand"]
                lora_step = (compiled["hand"], placed["hand"])
            fraction = (
                f"1/{lora_bytes / sums['qax']:.2f}"
                if sums["qax"] and lora_bytes
                else "-"
            )
            base_rows.append(
                [
                    kind,
                    layout,
                    f"{sums['hand']:,} ({_types(base['hand'])})",
                    f"{sums['qax']:,} ({_types(base['qax'])})",
                    fraction,
                ]
            )

            runs = {
                n: (lambda f=compiled[n], a=placed[n]: jax.block_until_ready(f(*a)))
                for n in setups
            }
            if kind != "lora":
                f, a = lora_step
                runs["hand lora"] = lambda f=f, a=a: jax.block_until_ready(f(*a))
            times = interleaved(runs, reps, warmup=2)
            time_rows.append(
                [
                    kind,
                    layout,
                    fmt_seconds(median(times["hand"])),
                    fmt_seconds(median(times["qax"])),
                    f"{paired_ratio(times, 'qax', 'hand'):.3f}",
                    "-"
                    if kind == "lora"
                    else f"{paired_ratio(times, 'qax', 'hand lora'):.3f}",
                ]
            )

    print("### Collectives in the compiled train step (count, bytes of results)\n")
    print(
        markdown_table(
            [
                "kind",
                "layout",
                "collective",
                "hand count",
                "qax count",
                "hand bytes",
                "qax bytes",
            ],
            comm_rows,
        )
    )
    print("\n### All-gather bytes of the base weights (element types)\n")
    print(
        markdown_table(
            ["kind", "layout", "hand-written", "qax", "qax / LoRA's f32"], base_rows
        )
    )
    print(f"\n### Steady-state train step time (median of {reps})\n")
    print(
        markdown_table(
            ["kind", "layout", "hand-written", "qax", "qax/hand", "qax/hand LoRA"],
            time_rows,
        )
    )
    for note in notes:
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
