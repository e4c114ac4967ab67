"""LoRA fine-tuning of a small GPT-style Flax model with qax, end to end.

    python notebooks/lora_finetune.py                  # well under a minute on 2 CPUs
    python notebooks/lora_finetune.py --steps 3000 --d-model 256 --layers 6 --seq-len 128

    python notebooks/lora_finetune.py --quantize nf4   # QLoRA: a 4-bit base model

The walk-through, in the order the code below does it:

1. Build a GPT-2 style model with Flax (`models.py`; it knows nothing about qax) and
   random-initialise it from a fixed seed. It plays the part of a pretrained model.
   With `--quantize nf4` (or `int8`, `int4`) its `Dense` kernels are stored quantized
   (`qax.quant.quantize`): QLoRA.
2. `qax.lora.loraify` replaces every `Dense` kernel W by a `qax.lora.LoraWeight`: an
   implicit array that *behaves* like the dense matrix W + s·A·B but is stored as W and
   the two thin factors. B starts at zero, so the model's output is exactly unchanged.
3. `qax.lora`'s handlers turn `x @ (W + s·A·B)` into `x @ W + s·((x @ A) @ B)` (and
   `x @ W` into a product with the decoded 4-bit kernel under QLoRA). The model code
   runs unmodified under `qax.use_implicit_args`; the big sum is never formed.
4. `qax.lora.split` separates the factors (the adapters) from the base model; Adam sees
   the adapters only, so its state holds moments for A and B and nothing else.
5. Report trainable vs total parameters, the base model's bytes, the optimizer-state
   size, the step time, that the frozen weights are bitwise unchanged, and that merging
   the factors back into dense kernels (`qax.lora.merge`) gives the same logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from models import GPT, CharTokenizer, GPTConfig, random_variables
from tqdm.auto import tqdm

import qax

CORPUS = pathlib.Path(__file__).with_name("data") / "corpus.txt"


def is_lora(x: Any) -> bool:
    return isinstance(x, qax.lora.LoraWeight)


# ----------------------------------------------------------------------------------------
# Data


def load_corpus(path: pathlib.Path, val_fraction: float = 0.1):
    """A character tokenizer for the text, and its ids split into train / validation."""
    text = path.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    cut = int(len(ids) * (1 - val_fraction))
    return tokenizer, ids[:cut], ids[cut:]


def random_windows(rng: np.random.Generator, ids: np.ndarray, count: int, length: int):
    """`count` random windows of `length + 1` tokens (inputs and shifted targets)."""
    starts = rng.integers(0, len(ids) - length - 1, size=count)
    return np.stack([ids[s : s + length + 1] for s in starts])


def even_windows(ids: np.ndarray, count: int, length: int) -> np.ndarray:
    """`count` evenly spaced windows: a fixed evaluation set."""
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return np.stack([ids[s : s + length + 1] for s in starts])


# ----------------------------------------------------------------------------------------
# Command line


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="LoRA fine-tuning of a small GPT-style Flax model with qax.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=_positive, default=500, help="training steps")
    p.add_argument("--rank", type=_positive, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA scale = alpha/rank")
    p.add_argument(
        "--quantize",
        choices=("none", "nf4", "int8", "int4"),
        default="none",
        help="store the base model's Dense kernels quantized (nf4: QLoRA)",
    )
    p.add_argument("--d-model", type=_positive, default=64, help="model width")
    p.add_argument("--layers", type=_positive, default=2, help="transformer blocks")
    p.add_argument("--heads", type=_positive, default=4, help="attention heads")
    p.add_argument("--seq-len", type=_positive, default=64, help="tokens per window")
    p.add_argument("--batch-size", type=_positive, default=16, help="windows per step")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="model, LoRA and data seed")
    p.add_argument("--log-every", type=_positive, default=50, help="loss every N steps")
    p.add_argument("--corpus", type=pathlib.Path, default=CORPUS, help="a text file")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    args = p.parse_args(argv)
    if args.d_model % args.heads:
        p.error(
            f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})"
        )
    if not args.corpus.is_file():
        p.error(f"--corpus: no file at {args.corpus}")
    return args


# ----------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class Result:
    """What `main` returns; `summary(result)` is what the command line prints."""

    args: argparse.Namespace
    config: GPTConfig
    losses: list[float]  # training loss of every step
    val_before: float
    val_after: float
    trainable: int  # numbers the optimizer may change (the LoRA factors)
    total: int  # the base model plus the LoRA factors
    base_bytes: int  # the base model as trained on (quantized with --quantize)
    dense_bytes: int  # the base model in float32
    opt_state_bytes: int
    step_seconds: float  # median, compilation excluded
    first_step_seconds: float  # includes compilation
    frozen_unchanged: bool
    merge_error: float  # max |logits(merged dense weights) - logits(LoRA)|
    params: Any  # the final parameters, LoraWeight leaves included


def _size(tree) -> int:
    return sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(tree))


def _nbytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(tree))


def _bitwise_equal(x, y) -> bool:
    x, y = np.asarray(x), np.asarray(y)
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def main(argv=None) -> Result:
    args = parse_args(argv)
    log = (lambda _: None) if args.quiet else tqdm.write
    tokenizer, train_ids, val_ids = load_corpus(args.corpus)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        max_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
    )

    # 1. The "pretrained" model: ordinary Flax, random weights from a fixed seed.
    model = GPT(config)
    example = jnp.zeros((1, args.seq_len), jnp.int32)
    dense = random_variables(model, example, seed=args.seed)["params"]
    if args.quantize != "none":  # QLoRA: 4-bit (or 8-bit) Dense kernels
        options = {"nf4": {"block_size": 32}, "int4": {"group_size": 32}}
        dense_base = qax.quant.quantize(
            dense, args.quantize, **options.get(args.quantize, {})
        )
    else:
        dense_base = dense

    # 2. LoRA factors on every Dense kernel; `split` separates them from the base.
    params = qax.lora.loraify(
        dense_base, args.rank, key=jax.random.PRNGKey(args.seed + 1), alpha=args.alpha
    )
    adapters, base = qax.lora.split(params)
    frozen_before = jax.tree_util.tree_map(np.array, base)  # a copy, for the check

    # 3. The unmodified model, run on implicit arrays.
    @qax.use_implicit_args
    def apply(params, windows):
        return model.apply({"params": params}, windows)

    def loss_fn(adapters, base, windows):
        logits = apply(qax.lora.combine(adapters, base), windows[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1))

    # 4. Adam on the adapters only: no state, no update for anything else.
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(adapters)

    @jax.jit
    def train_step(adapters, opt_state, base, windows):
        loss, grads = jax.value_and_grad(loss_fn)(adapters, base, windows)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    evaluate = jax.jit(loss_fn)
    val_set = jnp.asarray(even_windows(val_ids, 2 * args.batch_size, args.seq_len))
    val_before = float(evaluate(adapters, base, val_set))
    log(f"validation loss before fine-tuning: {val_before:.4f}")

    rng = np.random.default_rng(args.seed)
    losses, seconds = [], []
    steps = tqdm(
        range(1, args.steps + 1),
        desc="LoRA fine-tuning",
        unit="step",
        disable=args.quiet,
    )
    for step in steps:
        windows = random_windows(rng, train_ids, args.batch_size, args.seq_len)
        start = time.perf_counter()
        adapters, opt_state, loss = train_step(
            adapters, opt_state, base, jnp.asarray(windows)
        )
        losses.append(float(loss))  # float() waits for the step to finish
        seconds.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step in (1, args.steps):
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
            log(f"step {step:5d}  loss {losses[-1]:.4f}")
    steps.close()
    val_after = float(evaluate(adapters, base, val_set))

    # 5. Checks.
    params = qax.lora.combine(adapters, base)
    before, before_tree = jax.tree_util.tree_flatten(frozen_before)
    after, after_tree = jax.tree_util.tree_flatten(qax.lora.split(params)[1])
    frozen_unchanged = before_tree == after_tree and all(
        map(_bitwise_equal, before, after)
    )
    sample = val_set[:2, :-1]
    dense_logits = jax.jit(model.apply)(
        {"params": jax.jit(qax.lora.merge)(params)}, sample
    )
    lora_logits = jax.jit(apply)(params, sample)
    trainable = qax.lora.trainable_count(adapters)

    result = Result(
        args=args,
        config=config,
        losses=losses,
        val_before=val_before,
        val_after=val_after,
        trainable=trainable,
        total=_size(dense) + trainable,
        base_bytes=_nbytes(base),
        dense_bytes=_nbytes(dense),
        opt_state_bytes=_nbytes(opt_state),
        step_seconds=statistics.median(seconds[1:] or seconds),
        first_step_seconds=seconds[0],
        frozen_unchanged=frozen_unchanged,
        merge_error=float(jnp.max(jnp.abs(dense_logits - lora_logits))),
        params=params,
    )
    if not args.quiet:
        print(summary(result))
    return result


def summary(r: Result) -> str:
    """The closing report, one fact per line."""
    a, c = r.args, r.config
    window = max(1, min(20, len(r.losses) // 5))
    first, last = (
        statistics.fmean(r.losses[:window]),
        statistics.fmean(r.losses[-window:]),
    )
    frozen = "bitwise unchanged" if r.frozen_unchanged else "CHANGED: this is a bug"
    rows = [
        ("model", f"GPT-style, {c.n_layers} layers, width {c.d_model}, vocab {c.vocab_size}"),
        ("LoRA", f"rank {a.rank}, alpha {a.alpha:g}, on every Dense kernel"),
        ("base model", f"{r.base_bytes / 1024:,.1f} KiB ({a.quantize} kernels; float32: {r.dense_bytes / 1024:,.1f} KiB)"),
        ("trainable params", f"{r.trainable:,} of {r.total:,} ({r.trainable / r.total:.1%})"),
        ("optimizer state", f"{r.opt_state_bytes / 1024:,.1f} KiB (Adam moments of A, B)"),
        ("step time", f"{r.step_seconds * 1e3:.1f} ms median ({r.first_step_seconds:.1f} s for the first, compiling)"),
        ("train loss", f"{first:.3f} -> {last:.3f} (mean of the first / last {window} steps)"),
        ("validation loss", f"{r.val_before:.3f} -> {r.val_after:.3f}"),
        ("frozen weights", frozen),
        ("merged W + sAB", f"same logits as the LoRA form (max difference {r.merge_error:.1e})"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(["", "Summary", "-------", *lines])


if __name__ == "__main__":
    main()
