"""The documented training recipe (`qax.utils.freeze_keys`) against hand-written LoRA.

The how-to trains with ``qax.utils.freeze_keys(optax.adam(...), LoraMatrix, ["w"])`` over
*all* parameters, and the jitted step returns all parameters, frozen `w` included. Without
donation, every step copies each `w` into a fresh output buffer; with
``donate_argnums=(0, 1)`` XLA reuses the input buffers and the copy disappears. This script
measures, interleaved in one run, on the model of `bench_lora.py`:

- **hand**: hand-written LoRA; the step differentiates and updates only the `(a, b)`
  factors and returns them (the baseline of `bench_lora.py`);
- **recipe**: the documented qax recipe, not donated;
- **recipe, donated**: the same step jitted with ``donate_argnums=(0, 1)``;
- **hand, full params, donated**: hand-written LoRA written in the recipe's style (all
  params in and out, frozen by `freeze_keys`-like masking), donated.

Run: ``PYTHONPATH=. python benchmarks/bench_recipe.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import fmt_seconds, interleaved, markdown_table, median, paired_ratio  # noqa: E402
from bench_lora import (  # noqa: E402
    Config,
    LoraMatrix,
    add_lora,
    dense_linear,
    hand_lora_linear,
    init_params,
    lora_factors,
    make_loss,
    with_factors,
)

import qax  # noqa: E402


def build(cfg: Config):
    key_params, key_lora, key_tokens = jax.random.split(jax.random.PRNGKey(0), 3)
    dense = init_params(cfg, key_params, stacked=False)
    tokens = jax.random.randint(key_tokens, (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    adam = optax.adam(1e-3)

    hand_params = add_lora(dense, key_lora, cfg.rank, implicit=False)
    hand_loss = make_loss(cfg, hand_lora_linear, False)

    def hand_step(factors, opt_state, params, tokens):
        value, grads = jax.value_and_grad(
            lambda t: hand_loss(with_factors(params, t), tokens)
        )(factors)
        updates, opt_state = adam.update(grads, opt_state, factors)
        return optax.apply_updates(factors, updates), opt_state

    def frozen_label(path, _):
        return "freeze" if getattr(path[-1], "key", None) == "w" else "train"

    hand_full_opt = optax.multi_transform(
        {"train": adam, "freeze": optax.set_to_zero()},
        lambda params: jax.tree_util.tree_map_with_path(frozen_label, params),
    )

    def hand_full_step(params, opt_state, tokens):
        grads = jax.grad(hand_loss)(params, tokens)
        updates, opt_state = hand_full_opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    qax_params = add_lora(dense, key_lora, cfg.rank, implicit=True)
    qax_loss = qax.use_implicit_args(make_loss(cfg, dense_linear, False))
    recipe_opt = qax.utils.freeze_keys(adam, LoraMatrix, ["w"])

    def recipe_step(params, opt_state, tokens):
        grads = jax.grad(qax_loss)(params, tokens)
        updates, opt_state = recipe_opt.update(grads, opt_state, params)
        return qax.utils.apply_updates(params, updates), opt_state

    return dict(
        tokens=tokens,
        hand=(hand_step, lora_factors(hand_params), hand_params),
        hand_opt=adam.init(lora_factors(hand_params)),
        hand_full=(hand_full_step, hand_params, hand_full_opt.init(hand_params)),
        recipe=(recipe_step, qax_params, recipe_opt.init(qax_params)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, few reps")
    args = parser.parse_args()
    cfg = Config(n_layers=2, d_model=64, d_ff=256, vocab=128, seq=16, batch=2)
    if not args.quick:
        cfg = Config()
    reps = 6 if args.quick else 30
    b = build(cfg)
    tokens = b["tokens"]

    def copy(tree):
        return jax.tree_util.tree_map(lambda x: x.copy(), tree)

    hand_step, factors, hand_params = b["hand"]
    hand_jit = jax.jit(hand_step)
    state = {"hand": (factors, b["hand_opt"])}

    def run_hand():
        state["hand"] = hand_jit(*state["hand"], hand_params, tokens)
        return jax.block_until_ready(state["hand"])

    def donated_runner(name, step, params, opt_state, donate):
        fn = jax.jit(step, donate_argnums=(0, 1) if donate else ())
        state[name] = (copy(params), copy(opt_state))

        def run():
            state[name] = fn(*state[name], tokens)
            return jax.block_until_ready(state[name])

        return run

    recipe_step, qax_params, recipe_state = b["recipe"]
    full_step, full_params, full_state = b["hand_full"]
    fns = {
        "hand": run_hand,
        "recipe": donated_runner(
            "recipe", recipe_step, qax_params, recipe_state, False
        ),
        "recipe, donated": donated_runner(
            "recipe, donated", recipe_step, qax_params, recipe_state, True
        ),
        "hand, full params, donated": donated_runner(
            "hand full", full_step, full_params, full_state, True
        ),
    }
    times = interleaved(fns, reps, warmup=3)

    # The frozen weights stay bitwise unchanged through the donated steps.
    w_before = np.asarray(qax_params["layers"][0]["attn"]["wq"].w)
    w_after = np.asarray(state["recipe, donated"][0]["layers"][0]["attn"]["wq"].w)
    np.testing.assert_array_equal(w_before, w_after)

    rows = [
        [name, fmt_seconds(median(t)), f"{paired_ratio(times, name, 'hand'):.3f}"]
        for name, t in times.items()
    ]
    print(f"- JAX {jax.__version__} on {jax.default_backend()}, model: {cfg}")
    print(f"- {reps} interleaved repetitions; ratios are medians of paired ratios\n")
    print(markdown_table(["train step (jitted, steady)", "median", "÷ hand"], rows))


if __name__ == "__main__":
    main()
