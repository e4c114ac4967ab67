"""qax vs qwix: LoRA and QLoRA (NF4) on one NNX transformer, side by side.

The model is `qax.examples.nnx_transformer.Transformer` (Gemma-style: `nnx.Einsum`
attention kernels, grouped KV heads, a gated MLP, a tied embedding), its layers in a
Python list: qwix does not run on layers stacked with `nnx.scan`. Both libraries put
adapters of the same rank and alpha, in the same (PEFT) layout, on the same kernels
(every attention and MLP kernel; not the embedding), and start from the same pretrained
weights and the same ``a`` factors (qax's, copied into qwix's), so that LoRA follows
the same trajectory on both sides.

- qax: ``qax.lora.loraify`` (over ``qax.quant.quantize(..., "nf4")`` for QLoRA) on the
  NNX state, and the documented NNX recipe: ``nnx.split(model, holds(LoraWeight), ...)``,
  ``qax.lora.split``, a `jax.jit` step that differentiates the factors only.
- qwix: ``qwix.apply_lora_to_model`` with one ``qwix.LoraRule`` (``weight_qtype="nf4"``
  for QLoRA), and the same `jax.jit` step on ``nnx.split(model, nnx.LoRAParam, ...)``.

Measured, interleaved in one process (see `benchmarks/_timing.py`): train step time,
tracing (to a lowered program) and XLA compile times, compiled memory (``memory_analysis()``), parameter bytes, the
base's quantization error against the float weights, and the loss after N steps on the
same batches. The last column is qax / qwix.

qwix is an optional dependency of this script only (``pip install qwix``).

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_qwix.py            # full run (a few minutes)
    PYTHONPATH=. python benchmarks/bench_qwix.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    fmt_seconds,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
)

import qax  # noqa: E402
import qax.nnx  # noqa: E402
from qax.examples import nnx_transformer as T  # noqa: E402

try:
    import qwix
except ImportError:  # pragma: no cover
    sys.exit("bench_qwix.py needs qwix: `pip install qwix`.")

LORA = qax.nnx.holds(qax.lora.LoraWeight)

# PEFT's (and qwix's) adapters on einsum kernels: `a` along the axes the input is
# contracted with. The output kernel (heads, head_dim, embed) and the MLP kernels
# (in, out) get that from loraify's default layout.
PEFT_RULES = [
    (r".*/q_einsum/kernel/value", {"a_axes": (1,)}),  # (N, D, H): a (D, r)
    (r".*/(kv|qkv)_einsum/kernel/value", {"a_axes": (2,)}),  # (2|3, K, D, H): a (D, r)
]


# NF4 blocks as qwix tiles them: along the contracted axis (`block_axis=-2`: `d_model`
# of the Q/KV kernels, the input of the MLP layers). On the output kernel `(heads,
# head_dim, d_model)`, which contracts two axes, qwix keeps one scale per `d_model`
# column (over all heads); qax's blocks run along one axis: heads * head_dim
# consecutive numbers along `d_model` instead, the same number of scales.
def nf4_rules(cfg: T.TransformerConfig) -> list:
    per_column = cfg.num_heads * cfg.head_dim
    if cfg.embed_dim % per_column:
        return []
    options = {"block_size": per_column, "block_axis": -1}
    return [(r".*/attn_vec_einsum/kernel/value", options)]


# The kernels both libraries adapt (qwix matches module paths).
QWIX_MODULES = r"layers/\d+/(attn|mlp)/.*"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions")
    p.add_argument("--fused", action="store_true", help="fused QKV (no grouped KV)")
    p.add_argument("--steps", type=int, default=None, help="steps for the loss row")
    p.add_argument("--reps", type=int, default=None, help="timed step samples")
    return p.parse_args()


def config(args: argparse.Namespace) -> tuple[T.TransformerConfig, dict]:
    if args.quick:
        cfg = T.TransformerConfig(
            vocab_size=128,
            num_layers=2,
            embed_dim=64,
            num_heads=4,
            head_dim=16,
            hidden_dim=128,
            num_kv_heads=4 if args.fused else 2,
        )
        run = {"batch": 2, "seq": 16, "rank": 4, "block": 16, "steps": 3, "reps": 5}
    else:
        cfg = T.TransformerConfig(
            vocab_size=1024,
            num_layers=4,
            embed_dim=256,
            num_heads=4,
            head_dim=64,
            hidden_dim=1024,
            num_kv_heads=4 if args.fused else 2,
        )
        run = {"batch": 8, "seq": 64, "rank": 8, "block": 64, "steps": 20, "reps": 30}
    run["steps"] = args.steps or run["steps"]
    run["reps"] = args.reps or run["reps"]
    run["alpha"] = 2.0 * run["rank"]
    run["rules"] = nf4_rules(cfg)
    return cfg, run


# ----------------------------------------------------------------------------------------
# The two sides: (params to differentiate, frozen state, step function)


class Side:
    """One library's fine-tuning setup: ``step(trainable, opt_state, frozen, tokens)``."""

    def __init__(self, name: str, trainable: Any, frozen: Any, loss: Callable, lr=1e-3):
        self.name = name
        self.trainable, self.frozen = trainable, frozen
        self.loss = loss  # (trainable, frozen, tokens) -> scalar
        self.tx = optax.adam(lr)
        self.opt_state = self.tx.init(trainable)

        def step(trainable, opt_state, frozen, tokens):
            value, grads = jax.value_and_grad(self.loss)(trainable, frozen, tokens)
            updates, opt_state = self.tx.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, value

        self.step = step
        self.jitted = jax.jit(step)

    def args(self, tokens):
        return self.trainable, self.opt_state, self.frozen, tokens


def qax_side(model: nnx.Module, run: dict, quantized: bool) -> tuple[Side, Any]:
    """qax's recipe; also returns its LoRA state (to copy its `a` factors)."""
    params = nnx.state(model, nnx.Param)
    if quantized:
        params = qax.quant.quantize(
            params, "nf4", block_size=run["block"], block_axis=-2, rules=run["rules"]
        )
    params = qax.lora.loraify(
        params,
        run["rank"],
        key=jax.random.key(1),
        alpha=run["alpha"],
        rules=PEFT_RULES,
    )
    nnx.update(model, params)
    graphdef, lora_state, rest = nnx.split(model, LORA, ...)
    adapters, base = qax.lora.split(lora_state)

    def loss(adapters, frozen, tokens):
        base, rest = frozen
        m = nnx.merge(graphdef, qax.lora.combine(adapters, base), rest)
        return qax.use_implicit_args(T.next_token_loss)(m, tokens)

    return Side("qax", adapters, (base, rest), loss), lora_state


def qwix_side(
    model: nnx.Module, run: dict, quantized: bool, tokens, qax_lora_state
) -> Side:
    extra = {"weight_qtype": "nf4", "tile_size": run["block"]} if quantized else {}
    rule = qwix.LoraRule(
        module_path=QWIX_MODULES, rank=run["rank"], alpha=run["alpha"], **extra
    )
    model = qwix.apply_lora_to_model(
        model, qwix.LoraProvider([rule]), tokens[:, :-1], rngs=nnx.Rngs(1)
    )
    # The same starting factors as qax (`b` is zero on both sides).
    flat = qax.utils.tree_flatten_with_path_with_implicit(qax_lora_state)[0]
    copied = 0
    for path, lora in flat:
        if not isinstance(lora, qax.lora.LoraWeight):
            continue
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        module = model
        for k in keys[: keys.index("kernel")]:
            module = module[k] if isinstance(k, int) else getattr(module, k)
        a = module.kernel_lora_a
        if tuple(a.shape) != tuple(lora.a.shape):
            raise SystemExit(
                f"adapter layouts differ at {keys}: qax a {lora.a.shape}, qwix a "
                f"{a.shape}; the comparison needs the same layout."
            )
        a.set_value(jnp.asarray(lora.a, a.get_value().dtype))
        copied += 1
    graphdef, lora_params, rest = nnx.split(model, nnx.LoRAParam, ...)
    n_qwix = len(jax.tree.leaves(lora_params)) // 2
    if copied != n_qwix:
        raise SystemExit(f"qax adapts {copied} kernels, qwix {n_qwix}")

    def loss(lora_params, rest, tokens):
        return T.next_token_loss(nnx.merge(graphdef, lora_params, rest), tokens)

    side = Side("qwix", lora_params, rest, loss)
    side.model = model
    return side


# ----------------------------------------------------------------------------------------
# Measurements


def nbytes(tree: Any) -> int:
    """Bytes of the arrays in `tree` as stored (sub-byte dtypes at their bit width)."""
    total = 0
    for x in jax.tree.leaves(tree):
        bits = jnp.iinfo(x.dtype).bits if jnp.issubdtype(x.dtype, jnp.integer) else None
        total += x.size * bits // 8 if bits and bits < 8 else x.nbytes
    return total


def frozen_weight_bytes(side: Side) -> int:
    """Bytes of the adapted (frozen, possibly quantized) base kernels."""
    if side.name == "qax":
        base, _ = side.frozen
        return nbytes(base)
    # qwix: the kernels of the adapted modules, in `rest` next to everything else
    flat = nnx.to_flat_state(side.frozen)
    return sum(
        nbytes(v)
        for path, v in flat
        if "kernel" in path and path[0] == "layers" and path[2] in ("attn", "mlp")
    )


def quant_error(side: Side, dense_kernels: dict) -> float:
    """Relative Frobenius error of the decoded base against the float kernels."""
    num = den = 0.0
    if side.name == "qax":
        base, _ = side.frozen
        flat = qax.utils.tree_flatten_with_path_with_implicit(base)[0]
        decoded = {
            qax.utils.path_string(p).removesuffix("/value"): qax.quant.dequantize(w)
            for p, w in flat
            if isinstance(w, qax.quant.QuantizedWeight)
        }
    else:  # the quantized kernels qwix put in the adapted modules
        decoded = {}
        for name in dense_kernels:
            module = side.model
            for k in name.split("/")[:-1]:
                module = module[int(k)] if k.isdigit() else getattr(module, k)
            kernel = module.kernel
            if hasattr(kernel, "array"):  # a `WithAux` around a quantized `QArray`
                decoded[name] = qwix.dequantize(kernel.array)
    if set(decoded) != set(dense_kernels):
        raise SystemExit(f"quantized kernels differ: {sorted(decoded)}")
    for name, w in dense_kernels.items():
        d = np.asarray(decoded[name], np.float64).reshape(w.shape)
        num += float(np.sum((d - w) ** 2))
        den += float(np.sum(w.astype(np.float64) ** 2))
    return float(np.sqrt(num / den))


def memory(side: Side, tokens) -> tuple[int, int]:
    """(temp, argument) bytes of the compiled train step."""
    m = jax.jit(side.step).lower(*side.args(tokens)).compile().memory_analysis()
    return int(m.temp_size_in_bytes), int(m.argument_size_in_bytes)


def train(side: Side, batches) -> list[float]:
    trainable, opt_state = side.trainable, side.opt_state
    losses = []
    for tokens in batches:
        trainable, opt_state, value = side.jitted(
            trainable, opt_state, side.frozen, tokens
        )
        losses.append(float(value))
    return losses


def measure(cfg, run, quantized: bool) -> tuple[list[list[str]], list[str]]:
    what = "QLoRA (NF4)" if quantized else "LoRA"
    print(f"{what}: building ...", file=sys.stderr)
    key = jax.random.key(7)
    batches = [
        jax.random.randint(
            jax.random.fold_in(key, i),
            (run["batch"], run["seq"] + 1),
            0,
            cfg.vocab_size,
        )
        for i in range(run["steps"])
    ]
    tokens = batches[0]
    pretrained = T.Transformer(cfg)
    graphdef, state = nnx.split(pretrained)
    dense_kernels = {
        qax.utils.path_string(p).removesuffix("/value"): np.asarray(x)
        for p, x in jax.tree_util.tree_leaves_with_path(
            nnx.state(pretrained, nnx.Param)
        )
        if qax.lora.default_filter(qax.utils.path_string(p), x)
    }

    def copy():
        return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))

    qx, qax_lora_state = qax_side(copy(), run, quantized)
    qw = qwix_side(copy(), run, quantized, tokens, qax_lora_state)
    sides = {"qax": qx, "qwix": qw}
    notes = []

    # Same model, same factors: the first loss agrees (LoRA exactly; QLoRA up to the
    # two quantizations).
    first = {n: float(s.jitted(*s.args(tokens))[2]) for n, s in sides.items()}
    dense_first = float(jax.jit(T.next_token_loss)(pretrained, tokens))
    if not quantized:
        np.testing.assert_allclose(first["qax"], first["qwix"], rtol=1e-4)
        np.testing.assert_allclose(first["qax"], dense_first, rtol=1e-4)
    n_trainable = {
        n: sum(x.size for x in jax.tree.leaves(s.trainable)) for n, s in sides.items()
    }
    if n_trainable["qax"] != n_trainable["qwix"]:
        notes.append(f"trainable counts differ: {n_trainable}")

    rows: list[list[str]] = []

    def row(label, q, w, fmt=str, ratio=None):
        r = q / w if ratio is None else ratio
        rows.append([f"{what}: {label}", fmt(q), fmt(w), f"{r:.3f}"])

    print(f"{what}: step time ...", file=sys.stderr)
    times = interleaved(
        {
            n: (lambda s=s: jax.block_until_ready(s.jitted(*s.args(tokens))))
            for n, s in sides.items()
        },
        run["reps"],
        warmup=2,
    )
    row(
        "train step (jitted)",
        median(times["qax"]),
        median(times["qwix"]),
        fmt_seconds,
        paired_ratio(times, "qax", "qwix"),
    )

    print(f"{what}: trace, compile ...", file=sys.stderr)
    lowered = {}

    def lower(s):
        fresh = functools.partial(lambda f, *a: f(*a), s.step)  # a new function
        lowered[s.name] = jax.jit(fresh).lower(*s.args(tokens))

    samples = max(3, run["reps"] // 4)
    ttimes = interleaved(
        {n: (lambda s=s: lower(s)) for n, s in sides.items()}, samples, warmup=1
    )
    # XLA's compile of a freshly lowered step (lowered, untimed, before each sample).
    ctimes = interleaved(
        {n: functools.partial(lambda n: lowered[n].compile(), n) for n in sides},
        samples,
        warmup=0,
        setup=lambda fn: lower(sides[fn.args[0]]),
    )
    for label, t in (("trace + lower step", ttimes), ("XLA compile step", ctimes)):
        row(
            label,
            median(t["qax"]),
            median(t["qwix"]),
            fmt_seconds,
            paired_ratio(t, "qax", "qwix"),
        )

    print(f"{what}: memory, bytes, errors ...", file=sys.stderr)
    mem = {n: memory(s, tokens) for n, s in sides.items()}
    row("compiled temp memory (bytes)", mem["qax"][0], mem["qwix"][0], _int)
    row("compiled argument bytes", mem["qax"][1], mem["qwix"][1], _int)
    base = {n: frozen_weight_bytes(s) for n, s in sides.items()}
    row("adapted base kernels (bytes)", base["qax"], base["qwix"], _int)
    train_bytes = {n: nbytes(s.trainable) for n, s in sides.items()}
    row("trainable factors (bytes)", train_bytes["qax"], train_bytes["qwix"], _int)
    if quantized:
        err = {n: quant_error(s, dense_kernels) for n, s in sides.items()}
        row("NF4 error of the base (rel. Frobenius)", err["qax"], err["qwix"], _g)

    print(f"{what}: {run['steps']} training steps ...", file=sys.stderr)
    losses = {n: train(s, batches) for n, s in sides.items()}
    row(
        f"loss after {run['steps']} steps (from {first['qax']:.4f} / {first['qwix']:.4f})",
        losses["qax"][-1],
        losses["qwix"][-1],
        _g,
    )
    return rows, notes


def _int(x) -> str:
    return f"{int(x):,}"


def _g(x) -> str:
    return f"{x:.5g}"


def main() -> None:
    args = parse()
    cfg, run = config(args)
    start = time.perf_counter()
    print(
        f"jax {jax.__version__}, qwix {getattr(qwix, '__version__', '?')}, "
        f"{jax.devices()[0].platform}; model: {cfg.num_layers} layers, width "
        f"{cfg.embed_dim}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of "
        f"{cfg.head_dim}, MLP {cfg.hidden_dim}, vocab {cfg.vocab_size}; batch "
        f"{run['batch']}x{run['seq']}, rank {run['rank']}, alpha {run['alpha']:g}, "
        f"NF4 blocks of {run['block']}"
    )
    rows, notes = [], []
    for quantized in (False, True):
        r, n = measure(cfg, run, quantized)
        rows += r
        notes += n
    print()
    print(markdown_table(["measure", "qax", "qwix", "qax / qwix"], rows))
    for note in notes:
        print(f"- {note}")
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
