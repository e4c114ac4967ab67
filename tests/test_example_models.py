"""The small Flax models of the examples (`qax.examples.models`) behave as described."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("flax")
    return importlib.import_module("qax.examples.models")


def _changed_positions(apply, ids, position):
    """Which output positions change when the token at `position` changes."""
    other = ids.at[0, position].set((ids[0, position] % 20) + 1)
    diff = jnp.abs(apply(other) - apply(ids)).max(axis=-1)[0]
    return set(np.flatnonzero(np.asarray(diff) > 1e-6).tolist())


def test_gpt_is_causal_and_deterministic(models):
    config = models.GPTConfig(vocab_size=24, max_len=16, d_model=32, n_heads=4)
    model, variables = models.init_gpt(config, seed=1)
    _, again = models.init_gpt(config, seed=1)
    _, other = models.init_gpt(config, seed=2)
    leaves = jax.tree_util.tree_leaves
    assert all(np.array_equal(x, y) for x, y in zip(leaves(variables), leaves(again)))
    assert not np.array_equal(leaves(variables)[0], leaves(other)[0])

    ids = jnp.arange(1, 9)[None]
    apply = jax.jit(lambda ids: model.apply(variables, ids))
    assert apply(ids).shape == (1, 8, 24)
    assert _changed_positions(apply, ids, 5) == {5, 6, 7}


def test_t5_encoder_sees_everything_and_decoder_is_causal(models):
    config = models.T5Config(vocab_size=24, d_model=32, d_kv=8, d_ff=64, n_heads=4)
    model, variables = models.init_t5(config, seed=0)
    enc = jnp.arange(1, 7)[None]
    dec = jnp.arange(2, 10)[None]

    @jax.jit
    def by_decoder(ids):
        return model.apply(variables, enc, ids)

    @jax.jit
    def by_encoder(ids):
        return model.apply(variables, ids, dec)

    assert by_decoder(dec).shape == (1, 8, 24)
    assert _changed_positions(by_decoder, dec, 3) == {3, 4, 5, 6, 7}
    assert _changed_positions(by_encoder, enc, 4) == set(range(8))


def test_relative_buckets_are_exact_near_and_logarithmic_far(models):
    distance = jnp.arange(-40, 41)
    causal = models.relative_bucket(distance, False, n_buckets=16, max_distance=64)
    both = models.relative_bucket(distance, True, n_buckets=16, max_distance=64)
    # Looking back up to 7 tokens: one bucket per distance; the future is bucket 0.
    assert causal[40 - 7 : 41].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]
    assert set(causal[41:].tolist()) == {0}
    assert int(causal.max()) <= 15 and np.all(np.diff(np.asarray(causal[:41])) <= 0)
    # Bidirectional: the two directions use disjoint halves of the buckets.
    assert set(both[:40].tolist()).isdisjoint(both[41:].tolist())


def test_char_tokenizer_round_trip_and_unknown_characters(models):
    tok = models.CharTokenizer("hello world")
    assert tok.vocab_size == len(set("hello world")) + 1
    assert tok.decode(tok.encode("low  hello")) == "low  hello"
    with pytest.raises(ValueError, match=r"outside the tokenizer's alphabet: \['z'\]"):
        tok.encode("low zoo")
