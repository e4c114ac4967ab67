"""NF4 with double quantization (`qax.quant.NF4DQWeight`, format ``"nf4_dq"``): the
stored bits, the error beside plain NF4, the groups of absmax scales, and the handlers
and indexing that keep it quantized.

The oracles: plain `NF4Weight` (the codes against the decoded absmax), and the decoded
weight for everything else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax.quant import NF4DQWeight, NF4Weight
from qax.quant._nf4dq import groups


def normal(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def rel_rms(got, w):
    got, w = np.asarray(got, np.float64), np.asarray(w, np.float64)
    return float(np.sqrt(np.mean((got - w) ** 2) / np.mean(w**2)))


@pytest.mark.parametrize("block_axis", [-1, -2])
def test_4_127_bits_and_error_within_one_percent_of_nf4(block_axis):
    w = normal((256, 512), seed=1)
    q = qax.quant.quantize({"w": w}, "nf4_dq", block_axis=block_axis)["w"]
    plain = qax.quant.quantize({"w": w}, "nf4", block_axis=block_axis)["w"]
    assert isinstance(q, NF4DQWeight) and isinstance(plain, NF4Weight)
    assert 8 * q.nbytes / q.size == 4 + 8 / 64 + 32 / (64 * 256)  # 4.127
    assert q.absmax.dtype == jnp.uint8 and q.absmax_scale.size * 256 == q.absmax.size
    e, e0 = rel_rms(q.dequantize(), w), rel_rms(plain.dequantize(), w)
    assert abs(e / e0 - 1) < 0.01


def test_groups_are_boxes_of_at_most_256_absmax():
    assert groups((4096, 64), 0) == (4, 64)  # 4 whole rows
    assert groups((64, 4096), 0) == (1, 256)  # blocks along the input axis
    assert groups((4096, 172), 0) == (1, 172)  # no box of 256: one row
    assert groups((3, 16, 2), 1) == (1, 16, 2)  # batch axes: one group per layer


def test_decoding_is_codes_times_the_decoded_absmax():
    w = normal((8, 256), seed=2) * jnp.exp(normal((8, 1), seed=3))
    q = NF4DQWeight.from_array(w)
    absmax = q.absmax.astype(jnp.float32) * q.absmax_scale  # one group: (1, 1)
    assert q.absmax_scale.shape == (1, 1)
    assert int(q.absmax.min()) >= 1  # nonzero blocks never decode to zero
    ref = NF4Weight(q.packed, absmax, 64, -1).dequantize()
    np.testing.assert_array_equal(q.dequantize(), ref)
    # The codes are NF4's against that absmax.
    blocks = np.asarray(w).reshape(8, 4, 64) / np.asarray(absmax)[..., None]
    mid = (qax.quant.NF4_LEVELS[1:] + qax.quant.NF4_LEVELS[:-1]) / 2
    codes = np.searchsorted(mid, blocks.reshape(8, 256))
    np.testing.assert_array_equal(
        np.asarray(ref), qax.quant.NF4_LEVELS[codes] * np.repeat(absmax, 64, -1)
    )


def test_products_stacks_and_slices_stay_quantized():
    stack = NF4DQWeight.from_array(normal((2, 256, 64), seed=4), batch_ndim=1)
    assert stack.absmax_scale.shape == (2, 1, 1)
    big = NF4DQWeight.from_array(normal((1024, 128), seed=5))  # groups: 128 rows
    assert big.absmax_scale.shape == (8, 1)
    x = normal((3, 256), seed=6)

    def f(stack, big, x):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w @ w.T), None), x, stack)
        return h, big[256:512], big[:, 64:], x @ big[:256], big.T.astype(jnp.bfloat16)

    with qax.materialization_policy(NF4DQWeight, "error"):
        got = qax.use_implicit_args(f)(stack, big, x)
    want = f(stack.dequantize(), big.dequantize(), x)
    for g, r in zip(got, want, strict=True):
        tol = 1e-5 if g.dtype == jnp.float32 else 2e-2  # bf16 decodes in bf16
        np.testing.assert_allclose(
            qax.materialize_nested(g, full=True).astype(jnp.float32),
            r.astype(jnp.float32),
            rtol=tol,
            atol=tol,
        )
    assert all(isinstance(g, NF4DQWeight) for g in got[1:3] + got[4:])
    assert got[4].dtype == jnp.bfloat16 and got[4].absmax.dtype == jnp.uint8
    # Rows that cut a group of absmax scales decode, saying so.
    with pytest.warns(qax.MaterializationWarning, match="groups of its absmax_scale"):
        cut = qax.use_implicit_args(lambda w: w[100:200])(big)
    np.testing.assert_array_equal(cut, big.dequantize()[100:200])


def test_nf4_stays_plain_and_qlora_and_qat_work_over_nf4_dq():
    params = {"l": {"kernel": 0.1 * normal((256, 64), seed=7)}}
    assert isinstance(qax.quant.quantize(params, "nf4")["l"]["kernel"], NF4Weight)
    base = qax.quant.quantize(params, "nf4_dq")
    adapters, frozen = qax.lora.split(
        qax.lora.loraify(base, 4, key=jax.random.PRNGKey(8))
    )
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)
    x = normal((4, 256), seed=9)

    def loss(adapters, base):
        p = qax.lora.combine(adapters, base)
        out = qax.use_implicit_args(lambda p, x: x @ p["l"]["kernel"])(p, x)
        return jnp.mean(out**2)

    with qax.materialization_policy(NF4DQWeight, "error"):
        got = jax.grad(loss)(adapters, frozen)
    want = jax.grad(loss)(adapters, qax.quant.dequantize(frozen))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    fq = qax.qat.fake_quantize(params, "nf4_dq")
    q = qax.quant.quantize(fq, "int8")["l"]["kernel"]
    assert isinstance(q, NF4DQWeight)
    np.testing.assert_array_equal(
        q.dequantize(), qax.materialize_nested(fq["l"]["kernel"], full=True)
    )


def test_sharding_specs_split_the_group_scales_only_where_they_have_groups():
    from jax.sharding import PartitionSpec as P

    stack = NF4DQWeight.from_array(normal((3, 64, 128)), batch_ndim=1)  # one group
    (got,) = qax.sharding.implicit_specs([stack], [P(None, "data", "model")])
    assert got.packed == got.absmax == P(None, "data", "model")
    assert got.absmax_scale == P(None, None, None)  # (3, 1, 1): broadcast
    big = NF4DQWeight.from_array(normal((1024, 128)))  # groups of 128 rows: (8, 1)
    (got,) = qax.sharding.implicit_specs([big], [P("data", "model")])
    assert got.absmax_scale == P("data", None)
