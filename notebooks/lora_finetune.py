"""LoRA fine-tuning of a small GPT-style Flax model with qax, end to end.

    python notebooks/lora_finetune.py                  # about a minute on 2 CPU cores
    python notebooks/lora_finetune.py --steps 3000 --d-model 256 --layers 6 --seq-len 128

The walk-through, in the order the code below does it:

1. Build a GPT-2 style model with Flax (`models.py`; it knows nothing about qax) and
   random-initialise it from a fixed seed. It plays the part of a pretrained model.
2. Replace every `Dense` kernel W by a `LoraMatrix(w=W, a=A, b=B)`: an implicit array that
   *behaves* like the dense matrix W + s·A·Bᵀ but is stored as its three factors. B starts
   at zero, so the model's output is exactly unchanged.
3. One handler teaches qax that `x @ (W + s·A·Bᵀ)` is `x @ W + s·((x @ A) @ Bᵀ)`. The
   model code runs unmodified under `qax.use_implicit_args` and the big sum is never
   formed.
4. Train with Adam wrapped in `qax.utils.freeze_keys(..., LoraMatrix, ["w"])`: only the
   LoRA factors A and B move; everything else of the model is not handed to the optimizer
   at all.
5. Report trainable vs total parameters, the optimizer-state size, the step time, that the
   frozen weights are bitwise unchanged, and that merging the factors back into dense
   kernels gives the same logits.
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


# ----------------------------------------------------------------------------------------
# LoRA as an implicit array


@dataclasses.dataclass
class LoraMatrix(qax.ImplicitArray):
    """The weight matrix ``w + scale * a @ b.T``, stored as its factors.

    `w` has shape (d_in, d_out), `a` (d_in, rank) and `b` (d_out, rank).
    """

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue
    scale: float = qax.aux_field(default=1.0)

    def materialize(self):
        return self.w + self.scale * (self.a @ self.b.T)


@qax.primitive_handler("dot_general")
def lora_matmul(primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params):
    """``x @ (w + s a bᵀ)`` computed as ``x @ w + s (x @ a) @ bᵀ``.

    Covers every product that contracts one axis of `x` with the input axis (0) of the
    matrix, which is what `flax.linen.Dense` does. Anything else returns `NotImplemented`
    and qax falls back to the dense matrix (with a warning).
    """
    (x_contract, w_contract), (x_batch, w_batch) = dimension_numbers
    if w_contract != (0,) or len(x_contract) != 1 or x_batch or w_batch:
        return NotImplemented
    base = qax.default_handler(primitive, x, w.w, dimension_numbers=dimension_numbers, **params)
    xa = qax.default_handler(primitive, x, w.a, dimension_numbers=dimension_numbers, **params)
    # Contract the rank axis of xa with the rank axis of b: (..., r) x (d_out, r).
    rank_contract = (((xa.ndim - 1,), (1,)), ((), ()))
    xab = qax.default_handler(primitive, xa, w.b, dimension_numbers=rank_contract, **params)
    return base + w.scale * xab


def is_lora(x: Any) -> bool:
    return isinstance(x, LoraMatrix)


def add_lora(params, rank: int, alpha: float, seed: int):
    """Wrap every `Dense` kernel of a Flax parameter tree in a `LoraMatrix`.

    `a` is random (drawn with numpy from `seed`), `b` is zero: at the start the model
    computes exactly what it computed before.
    """
    rng = np.random.default_rng(seed)

    def convert(path, w):
        if path[-1] != jax.tree_util.DictKey("kernel"):
            return w
        d_in, d_out = w.shape
        a = (rng.standard_normal((d_in, rank)) / np.sqrt(d_in)).astype(w.dtype)
        b = np.zeros((d_out, rank), w.dtype)
        return LoraMatrix(w=w, a=jnp.asarray(a), b=jnp.asarray(b), scale=alpha / rank)

    return jax.tree_util.tree_map_with_path(convert, params)


def split_lora(params):
    """`(lora, rest)`: the `LoraMatrix` leaves and everything else, as two trees."""
    lora = jax.tree_util.tree_map(lambda x: x if is_lora(x) else None, params, is_leaf=is_lora)
    rest = jax.tree_util.tree_map(lambda x: None if is_lora(x) else x, params, is_leaf=is_lora)
    return lora, rest


def join_lora(lora, rest):
    """Inverse of `split_lora`."""
    return jax.tree_util.tree_map(
        lambda x, y: y if x is None else x,
        lora,
        rest,
        is_leaf=lambda x: x is None or is_lora(x),
    )


def merge_lora(params):
    """Dense parameters for deployment: each `LoraMatrix` becomes ``w + s a bᵀ``."""
    return jax.tree_util.tree_map(
        lambda x: x.materialize() if is_lora(x) else x, params, is_leaf=is_lora
    )


# ----------------------------------------------------------------------------------------
# Data


def load_corpus(path: pathlib.Path, val_fraction: float = 0.1):
    text = path.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    cut = int(len(ids) * (1 - val_fraction))
    return tokenizer, ids[:cut], ids[cut:]


def sample_batch(rng: np.random.Generator, ids: np.ndarray, batch: int, length: int):
    """`batch` random windows of `length + 1` tokens (inputs and shifted targets)."""
    starts = rng.integers(0, len(ids) - length - 1, size=batch)
    return np.stack([ids[s : s + length + 1] for s in starts])


def fixed_batches(ids: np.ndarray, length: int, count: int) -> np.ndarray:
    """`count` evenly spaced windows: a deterministic evaluation set."""
    starts = np.linspace(0, len(ids) - length - 1, count).astype(int)
    return np.stack([ids[s : s + length + 1] for s in starts])


# ----------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class Result:
    """What `main` returns (the command line prints it as the summary)."""

    config: GPTConfig
    args: argparse.Namespace
    losses: list[float]
    val_before: float
    val_after: float
    trainable: int
    total: int
    opt_state_bytes: int
    step_seconds: float
    first_step_seconds: float
    frozen_unchanged: bool
    merge_error: float
    params: Any  # the final parameters, LoraMatrix leaves included


def count(tree) -> int:
    return sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(tree))


def nbytes(tree) -> int:
    return sum(int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(tree))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16.0, help="LoRA scale is alpha/rank")
    p.add_argument("--d-model", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training window")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25, help="print the loss every N steps")
    p.add_argument("--corpus", type=pathlib.Path, default=CORPUS)
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    args = p.parse_args(argv)
    for flag in ("steps", "rank", "d_model", "layers", "heads", "seq_len", "batch_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads:
        p.error(f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})")
    if not args.corpus.is_file():
        p.error(f"--corpus: no file at {args.corpus}")
    return args


def main(argv=None) -> Result:
    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else tqdm.write
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
    base = random_variables(model, jnp.zeros((1, args.seq_len), jnp.int32), seed=args.seed)
    base = base["params"]
    frozen_copy = jax.tree_util.tree_map(np.array, base)

    # 2. LoRA factors on every Dense kernel; the optimizer only ever sees `lora`.
    params = add_lora(base, args.rank, args.alpha, seed=args.seed + 1)
    lora, rest = split_lora(params)

    # 3. The unmodified model, run on implicit arrays.
    @qax.use_implicit_args
    def loss_fn(lora, rest, batch):
        logits = model.apply({"params": join_lora(lora, rest)}, batch[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))

    # 4. Adam on everything it is given, except the `w` field of each LoraMatrix.
    optimizer = qax.utils.freeze_keys(optax.adam(args.lr), LoraMatrix, ["w"])
    opt_state = optimizer.init(lora)

    @jax.jit
    def train_step(lora, opt_state, rest, batch):
        loss, grads = jax.value_and_grad(loss_fn)(lora, rest, batch)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    evaluate = jax.jit(loss_fn)
    val_set = jnp.asarray(fixed_batches(val_ids, args.seq_len, 2 * args.batch_size))
    val_before = float(evaluate(lora, rest, val_set))

    rng = np.random.default_rng(args.seed)
    losses, times = [], []
    bar = tqdm(range(args.steps), desc="LoRA fine-tuning", unit="step", disable=args.quiet)
    for step in bar:
        batch = jnp.asarray(sample_batch(rng, train_ids, args.batch_size, args.seq_len))
        start = time.perf_counter()
        lora, opt_state, loss = train_step(lora, opt_state, rest, batch)
        losses.append(float(loss))  # float() waits for the step to finish
        times.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step == args.steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            say(f"step {step:5d}  loss {losses[-1]:.4f}")
    bar.close()
    val_after = float(evaluate(lora, rest, val_set))

    # 5. Checks and summary.
    params = join_lora(lora, rest)
    now = jax.tree_util.tree_map(np.asarray, merge_frozen(params))
    frozen_unchanged = jax.tree_util.tree_all(
        jax.tree_util.tree_map(
            lambda x, y: x.dtype == y.dtype and x.tobytes() == y.tobytes(), frozen_copy, now
        )
    )
    trainable = count([(m.a, m.b) for m in jax.tree_util.tree_leaves(lora, is_leaf=is_lora)])
    total = count(base) + trainable
    dense_logits = jax.jit(model.apply)({"params": jax.jit(merge_lora)(params)}, val_set[:2, :-1])
    lora_apply = jax.jit(qax.use_implicit_args(model.apply))
    lora_logits = lora_apply({"params": params}, val_set[:2, :-1])
    merge_error = float(jnp.max(jnp.abs(dense_logits - lora_logits)))
    result = Result(
        config=config,
        args=args,
        losses=losses,
        val_before=val_before,
        val_after=val_after,
        trainable=trainable,
        total=total,
        opt_state_bytes=nbytes(opt_state),
        step_seconds=statistics.median(times[1:]) if len(times) > 1 else times[0],
        first_step_seconds=times[0],
        frozen_unchanged=frozen_unchanged,
        merge_error=merge_error,
        params=params,
    )
    if not args.quiet:
        print(summary(result))
    return result


def merge_frozen(params):
    """The frozen part of `params`: each LoraMatrix replaced by its `w`."""
    return jax.tree_util.tree_map(lambda x: x.w if is_lora(x) else x, params, is_leaf=is_lora)


def summary(r: Result) -> str:
    a, c = r.args, r.config
    window = max(1, min(20, len(r.losses) // 5))
    first = statistics.fmean(r.losses[:window])
    last = statistics.fmean(r.losses[-window:])
    rows = [
        ("model", f"GPT, {c.n_layers} layers, width {c.d_model}, vocab {c.vocab_size}"),
        ("LoRA", f"rank {a.rank}, alpha {a.alpha:g}, on every Dense kernel"),
        ("trainable params", f"{r.trainable:,} of {r.total:,} ({r.trainable / r.total:.1%})"),
        ("optimizer state", f"{r.opt_state_bytes / 1024:,.1f} KiB (Adam moments of A, B)"),
        (
            "step time",
            f"{r.step_seconds * 1e3:.1f} ms (median; first step with compilation "
            f"{r.first_step_seconds:.1f} s)",
        ),
        ("train loss", f"{first:.3f} -> {last:.3f} (mean of first/last {window} steps)"),
        ("validation loss", f"{r.val_before:.3f} -> {r.val_after:.3f}"),
        ("frozen weights", "bitwise unchanged" if r.frozen_unchanged else "CHANGED (bug!)"),
        ("merged W + sABᵀ", f"max |logit difference| {r.merge_error:.1e} vs the LoRA path"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "Summary", "-------"] + [f"{k:<{width}}  {v}" for k, v in rows])


if __name__ == "__main__":
    main()
