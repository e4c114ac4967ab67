"""Two small Flax (linen) language models used by the qax examples.

Nothing in this module knows about qax: these are ordinary Flax models, written the way
one would write them for any project, so that the notebook and the fine-tuning script
can show qax working on code it has never seen.

- `GPT`: a decoder-only transformer in the style of GPT-2 (learned position embeddings,
  pre-LayerNorm blocks, biased `Dense` layers, GELU MLP, output tied to the token
  embedding).
- `T5`: an encoder-decoder transformer in the style of T5 (RMS norm without bias,
  bucketed relative position bias, bias-free `Dense` layers, ReLU MLP, tied and rescaled
  output embedding).

Both are tiny and random-initialised from a fixed seed (`init_gpt`, `init_t5`), because
no model hub is reachable from where the examples run. `CharTokenizer` is a minimal
character-level tokenizer for them.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "GPT",
    "T5",
    "CharTokenizer",
    "GPTConfig",
    "T5Config",
    "init_gpt",
    "init_t5",
    "random_variables",
]


# ----------------------------------------------------------------------------------------
# Tokenizer


class CharTokenizer:
    """Maps each character of a fixed alphabet to an id; id 0 is padding / start.

    Examples:
        >>> tok = CharTokenizer("abc ")
        >>> tok.decode(tok.encode("a cab"))
        'a cab'
    """

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self._ids = {c: i + 1 for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - set(self._ids))
        if unknown:
            raise ValueError(f"characters outside the tokenizer's alphabet: {unknown}")
        return [self._ids[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i - 1] for i in ids if 0 < i <= len(self.chars))


# ----------------------------------------------------------------------------------------
# GPT-2 style decoder


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    max_len: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4


def _split_heads(x: jax.Array, n_heads: int) -> jax.Array:
    batch, length, width = x.shape
    return x.reshape(batch, length, n_heads, width // n_heads)


def _attention(q, k, v, bias):
    """Multi-head attention on (batch, length, heads, head_dim) arrays."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    weights = jax.nn.softmax(scores + bias, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.reshape(*out.shape[:2], -1)


def _causal_bias(length: int, dtype) -> jax.Array:
    allowed = jnp.tril(jnp.ones((length, length), dtype=bool))
    return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)


class GPTAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        qkv = nn.Dense(3 * c.d_model, name="c_attn")(x)
        q, k, v = (_split_heads(t, c.n_heads) for t in jnp.split(qkv, 3, axis=-1))
        out = _attention(q, k, v, _causal_bias(x.shape[1], x.dtype))
        return nn.Dense(c.d_model, name="c_proj")(out)


class GPTMLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = nn.gelu(nn.Dense(c.mlp_ratio * c.d_model, name="c_fc")(x))
        return nn.Dense(c.d_model, name="c_proj")(h)


class GPTBlock(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + GPTAttention(self.config, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + GPTMLP(self.config, name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
    """GPT-2 style causal language model: token ids (batch, length) -> logits."""

    config: GPTConfig

    @nn.compact
    def __call__(self, ids: jax.Array) -> jax.Array:
        c = self.config
        if ids.shape[1] > c.max_len:
            raise ValueError(f"sequence length {ids.shape[1]} > max_len {c.max_len}")
        wte = nn.Embed(c.vocab_size, c.d_model, name="wte")
        wpe = nn.Embed(c.max_len, c.d_model, name="wpe")
        x = wte(ids) + wpe(jnp.arange(ids.shape[1]))[None]
        for i in range(c.n_layers):
            x = GPTBlock(c, name=f"h_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return wte.attend(x)


def init_gpt(config: GPTConfig, seed: int = 0):
    """A `GPT` model and random variables for it (`{"params": ...}`), from `seed`."""
    model = GPT(config)
    ids = jnp.zeros((1, 8), jnp.int32)
    return model, random_variables(model, ids, seed=seed)


# ----------------------------------------------------------------------------------------
# T5 style encoder-decoder


@dataclasses.dataclass(frozen=True)
class T5Config:
    vocab_size: int = 64
    d_model: int = 64
    d_kv: int = 16
    d_ff: int = 128
    n_heads: int = 4
    n_layers: int = 2
    n_buckets: int = 16
    max_distance: int = 64


class RMSNorm(nn.Module):
    """Scale by the root mean square; no mean subtraction and no bias (as in T5)."""

    eps: float = 1e-6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(variance + self.eps) * scale


def relative_bucket(
    relative: jax.Array, bidirectional: bool, n_buckets: int, max_distance: int
):
    """Bucket signed distances: exact for small ones, logarithmic up to `max_distance`."""
    bucket = jnp.zeros_like(relative)
    if bidirectional:
        n_buckets //= 2
        bucket = jnp.where(relative > 0, n_buckets, 0)
        distance = jnp.abs(relative)
    else:
        distance = jnp.maximum(-relative, 0)
    exact = n_buckets // 2
    log_ratio = jnp.log(jnp.maximum(distance, 1) / exact) / math.log(
        max_distance / exact
    )
    far = exact + (log_ratio * (n_buckets - exact)).astype(relative.dtype)
    far = jnp.minimum(far, n_buckets - 1)
    return bucket + jnp.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """A learned bias per (head, distance bucket), shaped (1, heads, q_len, k_len)."""

    config: T5Config
    bidirectional: bool

    @nn.compact
    def __call__(self, q_len: int, k_len: int) -> jax.Array:
        c = self.config
        relative = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
        buckets = relative_bucket(
            relative, self.bidirectional, c.n_buckets, c.max_distance
        )
        table = nn.Embed(c.n_buckets, c.n_heads, name="relative_attention_bias")
        return jnp.transpose(table(buckets), (2, 0, 1))[None]


class T5Attention(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array, context: jax.Array, bias: jax.Array) -> jax.Array:
        c = self.config
        inner = c.n_heads * c.d_kv

        def project(name, t):
            return _split_heads(
                nn.Dense(inner, use_bias=False, name=name)(t), c.n_heads
            )

        q, k, v = project("q", x), project("k", context), project("v", context)
        out = _attention(q, k, v, bias)
        return nn.Dense(c.d_model, use_bias=False, name="o")(out)


class T5FeedForward(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        h = nn.relu(nn.Dense(c.d_ff, use_bias=False, name="wi")(x))
        return nn.Dense(c.d_model, use_bias=False, name="wo")(h)


class T5EncoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        h = RMSNorm(name="ln_self")(x)
        x = x + T5Attention(self.config, name="self_attn")(h, h, bias)
        return x + T5FeedForward(self.config, name="ff")(RMSNorm(name="ln_ff")(x))


class T5DecoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x, encoded, self_bias, cross_bias) -> jax.Array:
        h = RMSNorm(name="ln_self")(x)
        x = x + T5Attention(self.config, name="self_attn")(h, h, self_bias)
        h = RMSNorm(name="ln_cross")(x)
        x = x + T5Attention(self.config, name="cross_attn")(h, encoded, cross_bias)
        return x + T5FeedForward(self.config, name="ff")(RMSNorm(name="ln_ff")(x))


class T5(nn.Module):
    """T5 style sequence-to-sequence model.

    `model.apply(variables, input_ids, decoder_input_ids)` returns decoder logits of
    shape (batch, decoder_length, vocab_size).
    """

    config: T5Config

    @nn.compact
    def __call__(self, input_ids: jax.Array, decoder_input_ids: jax.Array) -> jax.Array:
        c = self.config
        shared = nn.Embed(c.vocab_size, c.d_model, name="shared")

        x = shared(input_ids)
        n = x.shape[1]
        bias = RelativePositionBias(c, bidirectional=True, name="encoder_position")(
            n, n
        )
        for i in range(c.n_layers):
            x = T5EncoderLayer(c, name=f"encoder_{i}")(x, bias)
        encoded = RMSNorm(name="encoder_ln")(x)

        y = shared(decoder_input_ids)
        m = y.shape[1]
        position = RelativePositionBias(c, bidirectional=False, name="decoder_position")
        self_bias = position(m, m) + _causal_bias(m, y.dtype)
        cross_bias = jnp.zeros((1, 1, m, n), y.dtype)
        for i in range(c.n_layers):
            y = T5DecoderLayer(c, name=f"decoder_{i}")(
                y, encoded, self_bias, cross_bias
            )
        y = RMSNorm(name="decoder_ln")(y)
        return shared.attend(y * c.d_model**-0.5)


def init_t5(config: T5Config, seed: int = 0):
    """A `T5` model and random variables for it (`{"params": ...}`), from `seed`."""
    model = T5(config)
    ids = jnp.zeros((1, 8), jnp.int32)
    return model, random_variables(model, ids, ids, seed=seed)


# ----------------------------------------------------------------------------------------
# Initialisation


def random_variables(model: nn.Module, *inputs, seed: int = 0):
    """Random variables for `model`, drawn with numpy from `seed`.

    Equivalent in spirit to `model.init(key, *inputs)`, but only the *shapes* are traced
    (`jax.eval_shape`): Flax's initializers would each be compiled by XLA, which takes
    seconds on a CPU even for these tiny models. Values, by parameter name: `kernel`
    ~ N(0, 1/fan_in), `embedding` ~ N(0, 1/width), `bias` ~ N(0, 0.02²), `scale` = 1.
    """
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)
    rng = np.random.default_rng(seed)

    def draw(path, spec):
        name = path[-1].key
        if name == "scale":
            value = np.ones(spec.shape)
        elif name == "bias":
            value = 0.02 * rng.standard_normal(spec.shape)
        elif name == "kernel":
            value = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[0])
        elif name == "embedding":
            value = rng.standard_normal(spec.shape) / np.sqrt(spec.shape[-1])
        else:
            raise ValueError(
                f"no initialisation rule for parameter {jax.tree_util.keystr(path)}"
            )
        return jnp.asarray(value.astype(spec.dtype))

    return jax.tree_util.tree_map_with_path(draw, shapes)
