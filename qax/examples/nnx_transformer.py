"""A small Gemma-style decoder written with Flax NNX.

Nothing in this module knows about qax: it is an ordinary NNX model with the kinds of
layers real NNX language models use, so that tests and benchmarks can show qax (and
other libraries) working on code they have never seen:

- a token embedding (`Embedder`) that also produces the output logits (tied weights);
- `RMSNorm` before attention and before the MLP;
- attention whose projections are `nnx.Einsum` kernels: with as many key/value heads
  as query heads, one fused kernel of shape ``(3, heads, embed, head_dim)`` gives the
  queries, keys and values; with fewer key/value heads (grouped-query attention) a
  kernel ``(heads, embed, head_dim)`` gives the queries and one of shape
  ``(2, kv_heads, embed, head_dim)`` the keys and values; an output kernel
  ``(heads, head_dim, embed)`` brings the heads back to the embedding width;
- optional rotary position embeddings and a causal mask;
- a gated MLP of three bias-free `nnx.Linear` layers (gelu gate times a linear branch);
- layers kept in a list, or (``scan_layers=True``) created stacked with `nnx.vmap` and run
  with `nnx.scan`, each weight then carrying a leading layer axis.

Weights are random, from a fixed seed (`TransformerConfig.seed`).

Examples:
    >>> config = TransformerConfig(num_heads=4, num_kv_heads=2)
    >>> model = Transformer(config)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> model(tokens).shape
    (2, 16, 64)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "Attention",
    "Block",
    "Embedder",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerConfig",
    "apply_rope",
    "next_token_loss",
]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The sizes and options of a `Transformer`.

    Attributes:
      vocab_size: the number of token ids.
      num_layers: the number of decoder blocks.
      embed_dim: the width of the residual stream.
      num_heads: query heads.
      num_kv_heads: key/value heads. Equal to ``num_heads``: one fused QKV kernel;
        a divisor of it below it: separate query and key/value kernels (grouped-query
        attention, each key/value head shared by ``num_heads // num_kv_heads`` query
        heads).
      head_dim: the width of one head.
      hidden_dim: the width of the MLP.
      use_rope: rotary position embeddings on queries and keys.
      rope_base: the base wavelength of the rotary embeddings.
      scan_layers: create the blocks stacked with `nnx.vmap` (every block weight gets
        a leading axis of size ``num_layers``) and run them with `nnx.scan`.
      seed: the seed of the random initial weights.
    """

    vocab_size: int = 64
    num_layers: int = 2
    embed_dim: int = 32
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 8
    hidden_dim: int = 64
    use_rope: bool = True
    rope_base: float = 10_000.0
    scan_layers: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TransformerConfig: num_kv_heads={self.num_kv_heads} must divide "
                f"num_heads={self.num_heads}."
            )
        if self.use_rope and self.head_dim % 2:
            raise ValueError(
                f"TransformerConfig: rotary embeddings need an even head_dim, got "
                f"{self.head_dim}; pass use_rope=False or an even head_dim."
            )

    @property
    def fused_qkv(self) -> bool:
        """Whether attention uses one fused QKV kernel (as many KV heads as heads)."""
        return self.num_kv_heads == self.num_heads


def _normal(std: float) -> nnx.Initializer:
    return nnx.initializers.normal(stddev=std)


class Embedder(nnx.Module):
    """A token embedding table, used for the input and (tied) for the output logits.

    Args:
      vocab_size: the number of token ids.
      embed_dim: the embedding width.
      rngs: the random generators.
    """

    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        init = _normal(embed_dim**-0.5)
        self.embedding = nnx.Param(init(rngs.params(), (vocab_size, embed_dim)))

    def encode(self, tokens: jax.Array) -> jax.Array:
        """The embeddings of `tokens`, scaled by ``sqrt(embed_dim)``.

        Args:
          tokens: integer token ids, any shape.

        Returns:
          An array of shape ``(*tokens.shape, embed_dim)``.
        """
        table = self.embedding[...]
        return table[tokens] * jnp.sqrt(float(table.shape[-1])).astype(table.dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        """Logits over the vocabulary: ``x`` times the transposed embedding table.

        Args:
          x: activations of shape ``(..., embed_dim)``.

        Returns:
          An array of shape ``(..., vocab_size)``.
        """
        return jnp.dot(x, self.embedding[...].T)


class RMSNorm(nnx.Module):
    """Root-mean-square normalisation with a learned ``1 + scale`` factor.

    Args:
      dim: the width of the normalised axis (the last one).
      eps: added to the mean square.
      rngs: unused (kept for a uniform constructor).
    """

    def __init__(self, dim: int, *, eps: float = 1e-6, rngs: nnx.Rngs):
        del rngs
        self.scale = nnx.Param(jnp.zeros((dim,)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise the last axis of `x`.

        Args:
          x: activations.

        Returns:
          ``x`` divided by its root mean square, times ``1 + scale``.
        """
        ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(ms + self.eps) * (1.0 + self.scale[...])


def apply_rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary position embeddings on the last axis of `x`.

    The first and second halves of each head form pairs rotated by
    ``position / base ** (2 i / head_dim)``.

    Args:
      x: queries or keys, ``(batch, seq, heads, head_dim)``.
      positions: ``(seq,)`` or ``(batch, seq)`` integer positions.
      base: the base wavelength.

    Returns:
      ``x`` rotated, same shape and dtype.
    """
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # (..., seq, half)
    angle = angle[..., None, :]  # a heads axis
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = x[..., :half], x[..., half:]
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head or grouped-query attention on `nnx.Einsum` kernels.

    With ``config.fused_qkv``, ``qkv_einsum`` has a kernel ``(3, heads, embed,
    head_dim)``; otherwise ``q_einsum`` has ``(heads, embed, head_dim)`` and
    ``kv_einsum`` ``(2, kv_heads, embed, head_dim)``. ``attn_vec_einsum`` has
    ``(heads, head_dim, embed)``.

    Args:
      config: the model's sizes.
      rngs: the random generators.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        into = _normal(c.embed_dim**-0.5)
        if c.fused_qkv:
            self.qkv_einsum = nnx.Einsum(
                "BTD,SNDH->SBTNH",
                (3, c.num_heads, c.embed_dim, c.head_dim),
                kernel_init=into,
                rngs=rngs,
            )
        else:
            self.q_einsum = nnx.Einsum(
                "BTD,NDH->BTNH",
                (c.num_heads, c.embed_dim, c.head_dim),
                kernel_init=into,
                rngs=rngs,
            )
            self.kv_einsum = nnx.Einsum(
                "BSD,CKDH->CBSKH",
                (2, c.num_kv_heads, c.embed_dim, c.head_dim),
                kernel_init=into,
                rngs=rngs,
            )
        self.attn_vec_einsum = nnx.Einsum(
            "BTNH,NHD->BTD",
            (c.num_heads, c.head_dim, c.embed_dim),
            kernel_init=_normal((c.num_heads * c.head_dim) ** -0.5),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Attend over the sequence of `x`, each position to itself and earlier ones.

        Args:
          x: ``(batch, seq, embed)`` activations.
          positions: ``(seq,)`` positions (for the rotary embeddings).

        Returns:
          ``(batch, seq, embed)``.
        """
        c = self.config
        if c.fused_qkv:
            q, k, v = self.qkv_einsum(x)
        else:
            q = self.q_einsum(x)
            k, v = self.kv_einsum(x)
        if c.use_rope:
            q = apply_rope(q, positions, c.rope_base)
            k = apply_rope(k, positions, c.rope_base)
        q = q * c.head_dim**-0.5
        batch, seq = x.shape[:2]
        groups = c.num_heads // c.num_kv_heads
        q = q.reshape(batch, seq, c.num_kv_heads, groups, c.head_dim)
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits, axis=-1)
        encoded = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
        encoded = encoded.reshape(batch, seq, c.num_heads, c.head_dim)
        return self.attn_vec_einsum(encoded)


class FeedForward(nnx.Module):
    """A gated MLP: ``down(gelu(gate(x)) * up(x))``, three bias-free `nnx.Linear`.

    Args:
      embed_dim: the input and output width.
      hidden_dim: the hidden width.
      rngs: the random generators.
    """

    def __init__(self, embed_dim: int, hidden_dim: int, *, rngs: nnx.Rngs):
        into, out = _normal(embed_dim**-0.5), _normal(hidden_dim**-0.5)
        self.gate_proj = nnx.Linear(
            embed_dim, hidden_dim, use_bias=False, kernel_init=into, rngs=rngs
        )
        self.up_proj = nnx.Linear(
            embed_dim, hidden_dim, use_bias=False, kernel_init=into, rngs=rngs
        )
        self.down_proj = nnx.Linear(
            hidden_dim, embed_dim, use_bias=False, kernel_init=out, rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the MLP to the last axis of `x`.

        Args:
          x: ``(..., embed_dim)``.

        Returns:
          ``(..., embed_dim)``.
        """
        return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """A pre-norm decoder block: attention and MLP, each with a residual connection.

    Args:
      config: the model's sizes.
      rngs: the random generators.
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(config.embed_dim, rngs=rngs)
        self.attn = Attention(config, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(config.embed_dim, rngs=rngs)
        self.mlp = FeedForward(config.embed_dim, config.hidden_dim, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """One block on the residual stream.

        Args:
          x: ``(batch, seq, embed)``.
          positions: ``(seq,)``.

        Returns:
          ``(batch, seq, embed)``.
        """
        x = x + self.attn(self.pre_attention_norm(x), positions)
        return x + self.mlp(self.pre_ffw_norm(x))


class Transformer(nnx.Module):
    """A decoder-only language model: tokens in, next-token logits out.

    Args:
      config: the sizes and options (default: `TransformerConfig()`, tiny).
      rngs: the random generators (default: ``nnx.Rngs(config.seed)``).
    """

    def __init__(
        self, config: TransformerConfig | None = None, *, rngs: nnx.Rngs | None = None
    ):
        config = TransformerConfig() if config is None else config
        rngs = nnx.Rngs(config.seed) if rngs is None else rngs
        self.config = config
        self.embedder = Embedder(config.vocab_size, config.embed_dim, rngs=rngs)
        if config.scan_layers:

            @nnx.split_rngs(splits=config.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> Block:
                return Block(config, rngs=rngs)

            self.layers = stacked(rngs)
        else:
            self.layers = nnx.List(
                [Block(config, rngs=rngs) for _ in range(config.num_layers)]
            )
        self.final_norm = RMSNorm(config.embed_dim, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Next-token logits for every position.

        Args:
          tokens: ``(batch, seq)`` integer token ids.

        Returns:
          ``(batch, seq, vocab_size)`` logits; position ``t`` sees tokens ``<= t``.
        """
        positions = jnp.arange(tokens.shape[-1])
        x = self.embedder.encode(tokens)
        if self.config.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x: jax.Array, block: Block) -> jax.Array:
                return block(x, positions)

            x = run(x, self.layers)
        else:
            for block in self.layers:
                x = block(x, positions)
        return self.embedder.decode(self.final_norm(x))


def next_token_loss(model: Transformer, tokens: jax.Array) -> jax.Array:
    """The mean cross-entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    Examples:
        >>> next_token_loss(Transformer(), jnp.zeros((2, 9), jnp.int32)).shape
        ()

    Args:
      model: a `Transformer` (or anything that maps tokens to logits).
      tokens: ``(batch, seq + 1)`` integer token ids.

    Returns:
      A scalar.
    """
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
    return -jnp.mean(picked)
