"""LoRA weights built inside the wrapped loss function, beside the documented recipe.

The model of `bench_lora.py` (a GPT-style model, every matmul weight with a rank-8 LoRA),
three train steps of the same factors:

- **hand**: LoRA written into the model code: ``x @ w + (x @ a) @ b.T``;
- **qax (outside)**: the documented recipe: the `LoraMatrix` weights are built outside
  the wrapped loss and passed to it;
- **qax (inside)**: the loss function receives the base weights and the factors and
  builds each ``LoraMatrix(w, a, b)`` itself, inside `qax.use_implicit_args` (what a
  model that assembles its weights at run time, or a loss calling
  `qax.lora.combine`, does).

Rows: tracing of the train step (`make_jaxpr`, fresh function each time), the jitted
step, and the compiled FLOPs (which must be equal: building inside changes nothing in
the program). Run from the repository root:

    PYTHONPATH=. python benchmarks/bench_built_inside.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import fmt_seconds, interleaved, markdown_table, median, paired_ratio  # noqa: E402
from bench_lora import (  # noqa: E402
    Config,
    LoraMatrix,
    add_lora,
    compiled_cost,
    dense_linear,
    fresh,
    hand_lora_linear,
    init_params,
    lora_factors,
    make_loss,
    with_factors,
)

import qax  # noqa: E402


def _is_lora_dict(x) -> bool:
    return isinstance(x, dict) and set(x) == {"w", "a", "b"}


def build(params: dict) -> dict:
    """Every ``{w, a, b}`` dict as a `LoraMatrix` (inside the wrapper: built there)."""
    return jax.tree_util.tree_map(
        lambda x: LoraMatrix(x["w"], x["a"], x["b"]) if _is_lora_dict(x) else x,
        params,
        is_leaf=_is_lora_dict,
    )


def variants(cfg: Config, scan: bool):
    key_params, key_lora, key_tokens = jax.random.split(jax.random.PRNGKey(0), 3)
    dense = init_params(cfg, key_params, stacked=scan)
    tokens = jax.random.randint(key_tokens, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    dense_loss = make_loss(cfg, dense_linear, scan)
    hand_params = add_lora(dense, key_lora, cfg.rank, implicit=False)
    qax_params = add_lora(dense, key_lora, cfg.rank, implicit=True)
    inside_loss = qax.use_implicit_args(lambda p, t: dense_loss(build(p), t))
    losses = {
        "hand": (make_loss(cfg, hand_lora_linear, scan), hand_params),
        "qax (outside)": (qax.use_implicit_args(dense_loss), qax_params),
        "qax (inside)": (inside_loss, hand_params),  # plain dicts, built inside
    }
    opt = optax.adam(1e-3)
    out = {}
    for name, (loss, params) in losses.items():

        def step(params, opt_state, tokens, loss=loss):
            trainable = lora_factors(params)
            value, grads = jax.value_and_grad(
                lambda t: loss(with_factors(params, t), tokens)
            )(trainable)
            updates, opt_state = opt.update(grads, opt_state, trainable)
            return optax.apply_updates(trainable, updates), opt_state, value

        out[name] = (loss, step, params, opt.init(lora_factors(params)))
    return out, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    args = parser.parse_args(argv)
    cfg = Config(d_model=64, d_ff=256, seq=16, batch=2) if args.quick else Config()
    reps = (3, 5) if args.quick else (15, 30)
    warnings.simplefilter("error", qax.MaterializationWarning)
    print(
        f"JAX {jax.__version__}, {jax.devices()[0].platform}; d_model {cfg.d_model}, "
        f"{cfg.n_layers} layers, rank {cfg.rank}, batch {cfg.batch} x {cfg.seq}\n"
    )
    for scan in (False, True):
        print(f"### {'scan' if scan else 'loop'} layout\n")
        print(table(*variants(cfg, scan), reps))
        print()


def table(vs: dict, tokens: jax.Array, reps: tuple[int, int]) -> str:
    """The Markdown table of one layout: tracing, jitted step, FLOPs."""
    values = {n: float(jax.jit(loss)(p, tokens)) for n, (loss, _, p, _) in vs.items()}
    for n in values:
        np.testing.assert_allclose(values[n], values["hand"], rtol=2e-4, err_msg=n)
    traced = interleaved(
        {
            n: (lambda s=s, p=p, o=o: jax.make_jaxpr(fresh(s))(p, o, tokens))
            for n, (_, s, p, o) in vs.items()
        },
        reps[0],
    )
    jitted = {n: jax.jit(s) for n, (_, s, _, _) in vs.items()}
    steady = interleaved(
        {
            n: (lambda n=n, p=p, o=o: jax.block_until_ready(jitted[n](p, o, tokens)))
            for n, (_, _, p, o) in vs.items()
        },
        reps[1],
        warmup=2,
    )
    flops = {n: compiled_cost(s, p, o, tokens)[0] for n, (_, s, p, o) in vs.items()}
    rows = []
    for label, times in (
        ("make_jaxpr train step", traced),
        ("jitted train step", steady),
    ):
        rows.append(
            [
                label,
                *(fmt_seconds(median(times[n])) for n in vs),
                f"{paired_ratio(times, 'qax (inside)', 'hand'):.3f}",
                f"{paired_ratio(times, 'qax (inside)', 'qax (outside)'):.3f}",
            ]
        )
    rows.append(
        [
            "compiled FLOPs train step",
            *(f"{flops[n]:.4g}" for n in vs),
            f"{flops['qax (inside)'] / flops['hand']:.3f}",
            f"{flops['qax (inside)'] / flops['qax (outside)']:.3f}",
        ]
    )
    return markdown_table(["", *vs, "inside ÷ hand", "inside ÷ outside"], rows)


if __name__ == "__main__":
    main()
