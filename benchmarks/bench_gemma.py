"""qax LoRA vs gemma's own LoRA (`gm.nn.LoRA`) on DeepMind's Gemma 3 transformer.

The model is `gemma.gm.nn.Transformer` (grouped KV heads, QK norms, sliding-window and
global layers, the transposed gating einsum of Gemma 3), in a configuration written
here, its parameters drawn from a fixed seed (no weights are downloaded). Both sides
put adapters of the same rank, in the same (PEFT) layout, on the same kernels (every
attention and MLP einsum) and start from the same factors (qax's, copied into gemma's;
``b`` zero on both), so that both follow the same trajectory:

- qax: ``qax.lora.contracted_axes`` reads the layout from one abstract trace of the
  model, ``qax.lora.loraify(..., a_axes=layout)``, ``qax.lora.split``, and a `jax.jit`
  step that differentiates the factors only, the model run by ``qax.use_implicit_args``.
- gemma: ``gm.nn.LoRA(rank=..., model=...)`` (which swaps every einsum for its LoRA
  version through a Flax interceptor), the same `jax.jit` step on its ``lora``
  parameters.

Measured, interleaved in one process (see `benchmarks/_timing.py`): train step time
(adam), tracing (to a lowered program, JAX's and qax's caches emptied before each
sample) and XLA compile times, the trainable count, and
the loss after N steps on the same batches. The last column is qax / gemma.

gemma is an optional dependency of this script only (Python >= 3.12; the light install
recipe is the one in `.ci/run`, ``install_gemma``).

Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_gemma.py            # full run (a few minutes)
    PYTHONPATH=. python benchmarks/bench_gemma.py --quick    # smoke run
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    fmt_seconds,
    interleaved,
    markdown_table,
    median,
    paired_ratio,
)

import qax  # noqa: E402

try:
    from gemma import gm
    from gemma.gm.nn import _config
except ImportError:  # pragma: no cover
    sys.exit("bench_gemma.py needs gemma (Python >= 3.12): see .ci/run, install_gemma.")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, few repetitions")
    p.add_argument("--steps", type=int, default=None, help="steps for the loss row")
    p.add_argument("--reps", type=int, default=None, help="timed step samples")
    return p.parse_args()


def config(args: argparse.Namespace) -> tuple[Any, dict]:
    local, glob = gm.nn.AttentionType.LOCAL_SLIDING, gm.nn.AttentionType.GLOBAL
    common = dict(
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        use_qk_norm=True,
        transpose_gating_einsum=True,
        local_base_frequency=10_000,
        global_base_frequency=1_000_000,
    )
    if args.quick:
        cfg = _config.TransformerConfig(
            num_embed=128,
            embed_dim=64,
            hidden_dim=128,
            num_heads=4,
            head_dim=16,
            num_kv_heads=2,
            attention_types=(local, glob),
            sliding_window_size=8,
            **common,
        )
        run = {"batch": 2, "seq": 16, "rank": 4, "steps": 3, "reps": 5}
    else:
        cfg = _config.TransformerConfig(
            num_embed=1024,
            embed_dim=256,
            hidden_dim=1024,
            num_heads=4,
            head_dim=64,
            num_kv_heads=1,
            attention_types=(local, local, local, glob),
            sliding_window_size=32,
            **common,
        )
        run = {"batch": 8, "seq": 64, "rank": 8, "steps": 20, "reps": 30}
    run["steps"] = args.steps or run["steps"]
    run["reps"] = args.reps or run["reps"]
    return cfg, run


class Side:
    """One library's fine-tuning setup: ``step(trainable, opt_state, frozen, tokens)``."""

    def __init__(self, name: str, trainable: Any, frozen: Any, loss: Callable):
        self.name = name
        self.trainable, self.frozen = trainable, frozen
        self.tx = optax.adam(1e-3)
        self.opt_state = self.tx.init(trainable)

        def step(trainable, opt_state, frozen, tokens):
            value, grads = jax.value_and_grad(loss)(trainable, frozen, tokens)
            updates, opt_state = self.tx.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, value

        self.step = step
        self.jitted = jax.jit(step)

    def args(self, tokens):
        return self.trainable, self.opt_state, self.frozen, tokens


def next_token_loss(logits_fn, params, tokens):
    logits = logits_fn(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def _path(keys) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


def gemma_lora_name(path: str) -> str:
    """Where `gm.nn.LoRA` keeps the factors of the kernel at ``path``."""
    parent, name = path.rsplit("/", 1)
    return f"{parent}/_LoRAEinsum_{0 if name == 'w' else name}/lora"


def sides(cfg, run, tokens) -> dict[str, Side]:
    model = gm.nn.Transformer(config=cfg, dtype=jnp.float32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    rng = np.random.default_rng(0)
    draw = lambda s: jnp.asarray(0.05 * rng.standard_normal(s.shape, np.float32))  # noqa: E731
    pretrained = jax.tree.map(draw, shapes)

    def logits(params, tokens):
        return model.apply({"params": params}, tokens).logits

    # qax
    layout = qax.lora.contracted_axes(logits, pretrained, tokens)
    params = qax.lora.loraify(
        pretrained, run["rank"], key=jax.random.key(1), a_axes=layout
    )
    adapters, base = qax.lora.split(params)

    def qax_loss(adapters, base, tokens):
        implicit = qax.use_implicit_args(functools.partial(next_token_loss, logits))
        return implicit(qax.lora.combine(adapters, base), tokens)

    # gemma: its own LoRA wrapper, with qax's starting factors
    lora_model = gm.nn.LoRA(rank=run["rank"], model=model, dtype=jnp.float32)
    template = jax.eval_shape(lora_model.init, jax.random.key(0), tokens)["params"]
    is_lora = lambda x: isinstance(x, qax.lora.LoraWeight)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_lora)[0]
    factors = {gemma_lora_name(_path(p)): w for p, w in flat if is_lora(w)}

    def fill(path, leaf, part):
        path = _path(path)
        parent, name = path.rsplit("/", 1)
        if parent in factors:
            return getattr(factors[parent], name) if part == "lora" else None
        if part == "lora":
            return None
        tree = pretrained
        for key in path.split("/"):
            tree = tree[key]
        return tree

    lora = jax.tree_util.tree_map_with_path(lambda p, x: fill(p, x, "lora"), template)
    rest = jax.tree_util.tree_map_with_path(lambda p, x: fill(p, x, "rest"), template)
    if len(jax.tree.leaves(lora)) != 2 * len(factors):
        raise SystemExit("gemma's LoRA adapts other kernels than qax's layout")

    def gemma_logits(params, tokens):
        return lora_model.apply({"params": params}, tokens).logits

    def gemma_loss(lora, rest, tokens):
        params = jax.tree.map(
            lambda a, b: a if b is None else b, rest, lora, is_leaf=lambda x: x is None
        )
        return next_token_loss(gemma_logits, params, tokens)

    return {
        "qax": Side("qax", adapters, base, qax_loss),
        "gemma": Side("gemma", lora, rest, gemma_loss),
    }


def measure(cfg, run) -> list[list[str]]:
    key = jax.random.key(7)
    batches = [
        jax.random.randint(
            jax.random.fold_in(key, i), (run["batch"], run["seq"] + 1), 0, cfg.num_embed
        )
        for i in range(run["steps"])
    ]
    tokens = batches[0]
    print("building ...", file=sys.stderr)
    both = sides(cfg, run, tokens[:, :-1])
    rows: list[list[str]] = []

    def row(label, q, g, fmt=str, ratio=None):
        r = q / g if ratio is None else ratio
        rows.append([label, fmt(q), fmt(g), f"{r:.3f}"])

    count = {
        n: sum(x.size for x in jax.tree.leaves(s.trainable)) for n, s in both.items()
    }
    row("trainable numbers", count["qax"], count["gemma"], _int)
    first = {n: float(s.jitted(*s.args(tokens))[2]) for n, s in both.items()}
    np.testing.assert_allclose(first["qax"], first["gemma"], rtol=1e-5)

    print("step time ...", file=sys.stderr)
    times = interleaved(
        {
            n: (lambda s=s: jax.block_until_ready(s.jitted(*s.args(tokens))))
            for n, s in both.items()
        },
        run["reps"],
        warmup=2,
    )
    row(
        "train step (jitted, adam)",
        median(times["qax"]),
        median(times["gemma"]),
        fmt_seconds,
        paired_ratio(times, "qax", "gemma"),
    )

    print("trace, compile ...", file=sys.stderr)
    lowered = {}

    def lower(s):
        fresh = functools.partial(lambda f, *a: f(*a), s.step)  # a new function
        lowered[s.name] = jax.jit(fresh).lower(*s.args(tokens))

    def cold(_):  # tracing from scratch: JAX's and qax's caches emptied
        jax.clear_caches()
        qax.clear_caches()

    samples = max(3, run["reps"] // 6)
    ttimes = interleaved(
        {n: (lambda s=s: lower(s)) for n, s in both.items()}, samples, setup=cold
    )
    ctimes = interleaved(
        {n: functools.partial(lambda n: lowered[n].compile(), n) for n in both},
        samples,
        warmup=0,
        setup=lambda fn: lower(both[fn.args[0]]),
    )
    for label, t in (
        ("trace + lower step (cold caches)", ttimes),
        ("XLA compile step", ctimes),
    ):
        row(
            label,
            median(t["qax"]),
            median(t["gemma"]),
            fmt_seconds,
            paired_ratio(t, "qax", "gemma"),
        )

    print(f"{run['steps']} training steps ...", file=sys.stderr)
    losses = {}
    for name, s in both.items():
        trainable, opt_state = s.trainable, s.opt_state
        for batch in batches:
            trainable, opt_state, value = s.jitted(
                trainable, opt_state, s.frozen, batch
            )
        losses[name] = float(value)
    row(
        f"loss after {run['steps']} steps (from {first['qax']:.4f})",
        losses["qax"],
        losses["gemma"],
        _g,
    )
    return rows


def _int(x) -> str:
    return f"{int(x):,}"


def _g(x) -> str:
    return f"{x:.6g}"


def main() -> None:
    args = parse()
    cfg, run = config(args)
    start = time.perf_counter()
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}; gemma's Transformer: "
        f"{cfg.num_layers} layers, width {cfg.embed_dim}, {cfg.num_heads} heads / "
        f"{cfg.num_kv_heads} KV heads of {cfg.head_dim}, MLP {cfg.hidden_dim}, vocab "
        f"{cfg.num_embed}; batch {run['batch']}x{run['seq']}, rank {run['rank']}"
    )
    rows = measure(cfg, run)
    print()
    print(markdown_table(["measure", "qax", "gemma", "qax / gemma"], rows))
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
