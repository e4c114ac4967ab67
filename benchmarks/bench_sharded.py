"""LoRA and QLoRA training sharded over a 2x4 (data x model) mesh: qax vs hand-written.

The GPT-style model of `bench_lora.py`, every matmul weight a rank-r LoRA (``lora``) or
a LoRA over an int8 weight (``qlora``: int8 codes with one scale per output column).
Two layouts, both over a ``("data", "model")`` mesh of 2 x 4 devices:

- ``fsdp``: every weight matrix (and the token embedding) sharded along its first
  dimension over all 8 devices, the batch too;
- ``megatron``: tensor parallelism over ``model`` (q/k/v, the first MLP matrix and the
  head column-parallel, attention output and the second MLP matrix row-parallel; the
  rest replicated), data parallelism over ``data``.

The dense model's `PartitionSpec`s are written once; `qax.sharding.implicit_shardings`
derives the shardings of the LoRA factors and quantization scales from them, as the
types declare (`qax.array_field(..., follows=...)`). The hand-written variant holds the
very same leaves (plain dicts) with the very same shardings, and computes
``x @ w + (x @ a) @ b.T`` (``(x @ q) * scale`` for int8) itself. Both train steps
differentiate with respect to the factors, apply adam, and return the parameters
(factors updated, base weights untouched) with in/out shardings given to `jax.jit`.

Measured per (kind, layout): the collectives in the compiled (optimized) HLO, count
and bytes by opcode, and the steady-state step time, qax vs hand-written.

Run from the repository root (the script sets the 8-device flag itself):

    PYTHONPATH=. python benchmarks/bench_sharded.py            # full run
    PYTHONPATH=. python benchmarks/bench_sharded.py --quick    # smoke run

The tests (`tests/_sharded_training_cases.py`) import the model code from here.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
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
    LoraMatrix,
    dense_linear,
    init_params,
    lora_factors,
    make_loss,
    with_factors,
)

import qax  # noqa: E402

# ----------------------------------------------------------------------------------------
# A quantized weight type (public qax API only): int8 codes, one scale per column


@dataclasses.dataclass
class Int8Matrix(qax.ImplicitArray):
    """``q * scale``: int8 codes ``q [m, n]`` and float scales ``scale [n]``."""

    q: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
    scale: qax.ArrayValue = qax.array_field(ndim=1, follows=(1,))

    def compute_shape(self):
        return self.q.shape

    def compute_dtype(self):
        return self.scale.dtype

    def materialize(self):
        return self.q.astype(self.scale.dtype) * self.scale

    @classmethod
    def from_array(cls, w: jax.Array) -> Int8Matrix:
        absmax = jnp.max(jnp.abs(w), axis=0)
        scale = jnp.where(absmax > 0, absmax / 127, 1.0).astype(w.dtype)
        return cls(jnp.round(w / scale).astype(jnp.int8), scale)


def _plain_matmul(x: Any, w: Any, dimension_numbers: Any) -> bool:
    (lc, rc), (lb, rb) = dimension_numbers
    return w.ndim == 2 and tuple(lc) == (x.ndim - 1,) and tuple(rc) == (0,) and not lb


@qax.primitive_handler("dot_general")
def int8_matmul(primitive, x: jax.Array, w: Int8Matrix, *, dimension_numbers, **params):
    if not _plain_matmul(x, w, dimension_numbers):
        return NotImplemented
    params = dict(params, dimension_numbers=dimension_numbers)
    return qax.default_handler(primitive, x, w.q.astype(x.dtype), **params) * w.scale


# ----------------------------------------------------------------------------------------
# Parameters: implicit (LoRA / QLoRA) and the same leaves as plain dicts


KINDS = ("lora", "qlora")
LAYOUTS = ("fsdp", "megatron")
AXES = ("data", "model")


def implicit_params(cfg: Config, kind: str, key: jax.Array) -> tuple[dict, dict]:
    """The dense parameters, and the same with every matmul weight a LoRA (over int8
    codes for ``qlora``); ``b`` is random so that the factors' gradients are not
    trivially zero."""
    key_params, key_lora = jax.random.split(key)
    dense = init_params(cfg, key_params, stacked=False)

    def convert(path, w):
        if getattr(path[-1], "key", None) not in MATMUL_WEIGHTS:
            return w
        k = jax.random.fold_in(key_lora, len(jax.tree_util.keystr(path)))
        ka, kb = jax.random.split(jax.random.fold_in(k, w.shape[0] * w.shape[1]))
        a = 0.02 * jax.random.normal(ka, (w.shape[0], cfg.rank), w.dtype)
        b = 0.02 * jax.random.normal(kb, (w.shape[1], cfg.rank), w.dtype)
        base = Int8Matrix.from_array(w) if kind == "qlora" else w
        return LoraMatrix(base, a, b)

    return dense, jax.tree_util.tree_map_with_path(convert, dense)


def _implicit(x: Any) -> bool:
    return isinstance(x, qax.ImplicitArray)


def to_hand(tree: Any) -> Any:
    """The same leaves in plain dicts: ``{"w", "a", "b"}``, int8 as ``{"q", "scale"}``.

    Works on parameters and on trees of shardings or specs shaped like them."""

    def convert(x):
        if isinstance(x, LoraMatrix):
            return {"w": convert(x.w), "a": x.a, "b": x.b}
        if isinstance(x, Int8Matrix):
            return {"q": x.q, "scale": x.scale}
        return x

    return jax.tree_util.tree_map(convert, tree, is_leaf=_implicit)


def hand_linear(x: jax.Array, p: dict) -> jax.Array:
    """Hand-written (Q)LoRA: ``x @ w + (x @ a) @ b.T``, ``x @ w = (x @ q) * scale``."""
    w = p["w"]
    base = (x @ w["q"].astype(x.dtype)) * w["scale"] if isinstance(w, dict) else x @ w
    return base + (x @ p["a"]) @ p["b"].T


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


def make_step(loss: Callable) -> Callable:
    """(params, opt_state, tokens) -> (params, opt_state, loss); only the factors move."""

    def step(params, opt_state, tokens):
        trainable = lora_factors(params)
        value, grads = jax.value_and_grad(
            lambda t: loss(with_factors(params, t), tokens)
        )(trainable)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, trainable)
        new = with_factors(params, optax.apply_updates(trainable, updates))
        return new, opt_state, value

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


def build(cfg: Config, kind: str, layout: str, mesh: jax.sharding.Mesh) -> dict:
    """``{"qax": Setup, "hand": Setup}`` for one kind and layout, same leaves/shardings."""
    key_params, key_tokens = jax.random.split(jax.random.PRNGKey(0))
    dense, params = jax.jit(implicit_params, static_argnums=(0, 1))(
        cfg, kind, key_params
    )
    tokens = jax.random.randint(key_tokens, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    specs, token_spec = dense_specs(dense, layout)
    shardings = qax.sharding.implicit_shardings(params, specs, mesh)
    replicated = NamedSharding(mesh, P())
    token_sharding = NamedSharding(mesh, token_spec)
    dense_loss = make_loss(cfg, dense_linear, scan=False)
    out = {}
    for name, tree, sh, loss in (
        ("qax", params, shardings, qax.use_implicit_args(dense_loss)),
        (
            "hand",
            to_hand(params),
            to_hand(shardings),
            make_loss(cfg, hand_linear, False),
        ),
    ):
        opt_state = OPTIMIZER.init(lora_factors(tree))
        opt_sh = optax.tree_map_params(
            OPTIMIZER,
            lambda _p, s: s,
            opt_state,
            lora_factors(sh),
            transform_non_params=lambda _: replicated,
        )
        out[name] = Setup(
            make_step(loss),
            (tree, opt_state, tokens),
            (sh, opt_sh, token_sharding),
            (sh, opt_sh, replicated),
        )
    return out


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


# ----------------------------------------------------------------------------------------
# Benchmark


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    args = parser.parse_args(argv)
    warnings.simplefilter("error", qax.MaterializationWarning)
    if jax.device_count() < 8:
        raise SystemExit("needs 8 devices: run as a script (it sets XLA_FLAGS itself)")
    if args.quick:
        cfg, reps = Config(n_layers=2, d_model=64, d_ff=256, seq=16, batch=8), 5
    else:
        cfg, reps = Config(batch=8), 15
    mesh = make_mesh()
    print(f"JAX {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} ")
    print(f"devices on {os.cpu_count()} CPUs; mesh {dict(mesh.shape)}; model: {cfg}\n")

    comm_rows, time_rows, notes = [], [], []
    for kind in KINDS:
        for layout in LAYOUTS:
            print(f"{kind} / {layout} ...", file=sys.stderr)
            setups = build(cfg, kind, layout, mesh)
            placed = {n: s.placed() for n, s in setups.items()}
            compiled = {
                n: s.jitted().lower(*placed[n]).compile() for n, s in setups.items()
            }
            comm = {n: collectives(c.as_text()) for n, c in compiled.items()}
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

            times = interleaved(
                {
                    n: (lambda f=compiled[n], a=placed[n]: jax.block_until_ready(f(*a)))
                    for n in setups
                },
                reps,
                warmup=2,
            )
            time_rows.append(
                [
                    kind,
                    layout,
                    fmt_seconds(median(times["hand"])),
                    fmt_seconds(median(times["qax"])),
                    f"{paired_ratio(times, 'qax', 'hand'):.3f}",
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
    print(f"\n### Steady-state train step time (median of {reps})\n")
    print(
        markdown_table(
            ["kind", "layout", "hand-written", "qax", "qax/hand"],
            time_rows,
        )
    )
    for note in notes:
        print(f"\nnote: {note}")


if __name__ == "__main__":
    main()
