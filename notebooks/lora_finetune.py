"""LoRA fine-tuning of a small GPT-style Flax model with qax, end to end.

    python notebooks/lora_finetune.py                  # well under a minute on 2 CPUs
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
4. Train with Adam wrapped in `qax.utils.freeze_keys(..., LoraMatrix, ["w"])`: of the
   LoRA matrices only A and B move. The rest of the model (embeddings, layer norms,
   biases) is not given to the optimizer at all.
5. Report trainable vs total parameters, the optimizer-state size, the step time, that the
   frozen weights are bitwise unchanged, and that merging the factors back into dense
   kernels gives the same logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)
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
    (x_axes, w_axes), (x_batch, w_batch) = dimension_numbers
    if w_axes != (0,) or len(x_axes) != 1 or x_batch or w_batch:
        return NotImplemented
    dot = functools.partial(qax.default_handler, primitive, **params)
    xw = dot(x, w.w, dimension_numbers=dimension_numbers)
    xa = dot(x, w.a, dimension_numbers=dimension_numbers)
    # (..., rank) times b: (d_out, rank), contracting the rank axes: no transpose needed.
    xab = dot(xa, w.b, dimension_numbers=(((xa.ndim - 1,), (1,)), ((), ())))
    return xw + w.scale * xab


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

    def pick(keep_lora):
        return lambda x: x if is_lora(x) == keep_lora else None

    lora = jax.tree_util.tree_map(pick(True), params, is_leaf=is_lora)
    rest = jax.tree_util.tree_map(pick(False), params, is_leaf=is_lora)
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
    merge = lambda x: x.materialize() if is_lora(x) else x  # noqa: E731
    return jax.tree_util.tree_map(merge, params, is_leaf=is_lora)


def frozen_part(params):
    """What must not change in training: each `LoraMatrix` replaced by its `w`."""
    frozen = lambda x: x.w if is_lora(x) else x  # noqa: E731
    return jax.tree_util.tree_map(frozen, params, is_leaf=is_lora)


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
    opt_state_bytes: int
    step_seconds: float  # median, compilation excluded
    first_step_seconds: float  # includes compilation
    frozen_unchanged: bool
    merge_error: float  # max |logits(merged dense weights) - logits(LoRA)|
    params: Any  # the final parameters, LoraMatrix leaves included


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
    base = random_variables(model, example, seed=args.seed)["params"]
    frozen_before = jax.tree_util.tree_map(np.array, base)  # a copy, for the check

    # 2. LoRA factors on every Dense kernel. Only `lora` goes to the optimizer.
    params = add_lora(base, args.rank, args.alpha, seed=args.seed + 1)
    lora, rest = split_lora(params)

    # 3. The unmodified model, run on implicit arrays.
    @qax.use_implicit_args
    def loss_fn(lora, rest, windows):
        logits = model.apply({"params": join_lora(lora, rest)}, windows[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1))

    # 4. Adam on the LoRA matrices, except the `w` field of each.
    optimizer = qax.utils.freeze_keys(optax.adam(args.lr), LoraMatrix, ["w"])
    opt_state = optimizer.init(lora)

    @jax.jit
    def train_step(lora, opt_state, rest, windows):
        loss, grads = jax.value_and_grad(loss_fn)(lora, rest, windows)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        return optax.apply_updates(lora, updates), opt_state, loss

    evaluate = jax.jit(loss_fn)
    val_set = jnp.asarray(even_windows(val_ids, 2 * args.batch_size, args.seq_len))
    val_before = float(evaluate(lora, rest, val_set))
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
        lora, opt_state, loss = train_step(lora, opt_state, rest, jnp.asarray(windows))
        losses.append(float(loss))  # float() waits for the step to finish
        seconds.append(time.perf_counter() - start)
        if step % args.log_every == 0 or step in (1, args.steps):
            steps.set_postfix(loss=f"{losses[-1]:.3f}")
            log(f"step {step:5d}  loss {losses[-1]:.4f}")
    steps.close()
    val_after = float(evaluate(lora, rest, val_set))

    # 5. Checks.
    params = join_lora(lora, rest)
    before, before_tree = jax.tree_util.tree_flatten(frozen_before)
    after, after_tree = jax.tree_util.tree_flatten(frozen_part(params))
    frozen_unchanged = before_tree == after_tree and all(
        map(_bitwise_equal, before, after)
    )
    sample = val_set[:2, :-1]
    dense_logits = jax.jit(model.apply)({"params": jax.jit(merge_lora)(params)}, sample)
    lora_logits = jax.jit(qax.use_implicit_args(model.apply))(
        {"params": params}, sample
    )
    matrices = jax.tree_util.tree_leaves(lora, is_leaf=is_lora)
    trainable = sum(m.a.size + m.b.size for m in matrices)

    result = Result(
        args=args,
        config=config,
        losses=losses,
        val_before=val_before,
        val_after=val_after,
        trainable=trainable,
        total=_size(base) + trainable,
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
        ("trainable params", f"{r.trainable:,} of {r.total:,} ({r.trainable / r.total:.1%})"),
        ("optimizer state", f"{r.opt_state_bytes / 1024:,.1f} KiB (Adam moments of A, B)"),
        ("step time", f"{r.step_seconds * 1e3:.1f} ms median ({r.first_step_seconds:.1f} s for the first, compiling)"),
        ("train loss", f"{first:.3f} -> {last:.3f} (mean of the first / last {window} steps)"),
        ("validation loss", f"{r.val_before:.3f} -> {r.val_after:.3f}"),
        ("frozen weights", frozen),
        ("merged W + sABᵀ", f"same logits as the LoRA form (max difference {r.merge_error:.1e})"),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    return "\n".join(["", "Summary", "-------", *lines])


if __name__ == "__main__":
    main()
