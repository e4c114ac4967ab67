"""A small trained language model for the calibrated-quantization tests and benchmark.

The NNX transformer of `qax.examples.nnx_transformer`, trained for a few hundred steps
(Adam, fixed seeds) on the walk-through's corpus (``notebooks/data/corpus.txt``,
prose the project ships), characters as tokens. `trained` returns the model split
(graph, params, rest); `windows` cuts token windows of the text: the first 90 % for
training and calibration, the rest held out for measuring.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from qax.examples import nnx_transformer as T
from qax.examples.models import CharTokenizer

CORPUS = pathlib.Path(__file__).parents[1] / "notebooks" / "data" / "corpus.txt"
SEQ = 32


@functools.cache
def tokens() -> tuple[np.ndarray, np.ndarray]:
    """The corpus as ids: (train part, held-out part)."""
    text = CORPUS.read_text(encoding="utf-8")
    ids = np.asarray(CharTokenizer(text).encode(text), np.int32)
    cut = int(len(ids) * 0.9)
    return ids[:cut], ids[cut:]


def config(scan_layers: bool = False) -> T.TransformerConfig:
    return T.TransformerConfig(
        vocab_size=64,
        num_layers=2,
        embed_dim=64,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        hidden_dim=128,
        scan_layers=scan_layers,
        seed=0,
    )


def windows(ids: np.ndarray, count: int, seed: int | None = None) -> np.ndarray:
    """``count`` windows of ``SEQ + 1`` tokens: random (``seed``) or evenly spaced."""
    if seed is None:
        starts = np.linspace(0, len(ids) - SEQ - 1, count).astype(int)
    else:
        starts = np.random.default_rng(seed).integers(0, len(ids) - SEQ - 1, count)
    return np.stack([ids[s : s + SEQ + 1] for s in starts])


@functools.cache
def trained(steps: int = 300, scan_layers: bool = False, lr: float = 1e-2):
    """(graphdef, params, rest) of the model after ``steps`` Adam steps."""
    model = T.Transformer(config(scan_layers))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = optax.adam(optax.warmup_cosine_decay_schedule(0.0, lr, 20, steps, lr / 10))
    state = opt.init(params)

    @jax.jit
    def step(params, state, batch):
        def loss(p):
            return T.next_token_loss(nnx.merge(graphdef, p, rest), batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    train, _ = tokens()
    for i in range(steps):
        batch = jnp.asarray(windows(train, 16, seed=i))
        params, state, _ = step(params, state, batch)
    return graphdef, params, rest


def logits_fn(graphdef, rest):
    """``f(params, tokens)``: the model's logits (the function `calibrate` runs)."""

    def f(params, batch):
        return nnx.merge(graphdef, params, rest)(batch)

    return f
