"""`qax.quant` block formats along any axis (``block_axis``): values, handlers, trees.

The oracle for the codes: quantizing with the blocks' axis moved last, then moving it
back, is what ``block_axis`` stores; for everything else, the decoded weight.
"""

from __future__ import annotations

import functools
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax.quant import FP8Weight, Int4Weight, IntKWeight, NF4Weight
from tests.helpers import check_equation, find_eqn

# Every block format, as (class, from_array options), blocks of 16.
BLOCKED = {
    "nf4": (NF4Weight, {"block_size": 16}),
    "int4": (Int4Weight, {"group_size": 16}),
    "int3": (IntKWeight, {"bits": 3, "group_size": 16}),
    "fp8-block": (FP8Weight, {"block_size": 16}),
}
IDS = list(BLOCKED)


def normal(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def make(name, w, **kw):
    cls, options = BLOCKED[name]
    return cls.from_array(w, **options, **kw)


def strict():
    import contextlib

    stack = contextlib.ExitStack()
    for cls in (NF4Weight, Int4Weight, IntKWeight, FP8Weight):
        stack.enter_context(qax.materialization_policy(cls, "error"))
    return stack


@pytest.mark.parametrize("name", IDS)
def test_blocks_along_another_axis_are_the_moved_weights_blocks(name):
    w = normal((2, 64, 32), seed=1)  # two stacked (64, 32) weights
    q = make(name, w, batch_ndim=1, block_axis=0)  # axis 0 of one weight: -2
    assert q.block_axis == -2 and q.shape == w.shape and q.weight_ndim == 2
    codes, scale = (getattr(q, n) for n in q._ARRAYS)
    assert scale.shape == (2, 4, 32)  # 64 / 16 blocks along the input axis
    assert codes.shape[:1] + codes.shape[2:] == (2, 32)  # packed along it, if at all
    moved = make(name, jnp.swapaxes(w, -1, -2), batch_ndim=1)
    np.testing.assert_array_equal(
        q.dequantize(), jnp.swapaxes(moved.dequantize(), -1, -2)
    )
    np.testing.assert_array_equal(
        scale, jnp.swapaxes(getattr(moved, q._ARRAYS[1]), -1, -2)
    )
    assert q.nbytes == moved.nbytes
    again = make(name, w, batch_ndim=1, block_axis=-2)
    np.testing.assert_array_equal(again.dequantize(), q.dequantize())


@pytest.mark.parametrize("name", IDS)
def test_products_with_input_axis_blocks_check_handler(name):
    # eager, jit, vmap and grad (x and the scales) against decode-then-product.
    q = make(name, normal((32, 16)), block_axis=-2)
    check_equation(lambda x, w: x @ w, "dot_general", normal((3, 32), 1), q)


def test_einsum_kernel_blocks_along_the_contracted_axis():
    # An attention kernel (heads, d_model, head_dim): blocks along d_model, the axis
    # the product contracts; under jit with materialization an error.
    kernel = normal((4, 64, 8), seed=2)
    q = NF4Weight.from_array(kernel, block_size=32, block_axis=-2)
    assert q.absmax.shape == (4, 2, 8)
    x = normal((2, 5, 64), seed=3)
    fn = functools.partial(jnp.einsum, "btd,ndh->btnh")
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(x, q)
    np.testing.assert_allclose(got, fn(x, q.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["nf4", "int3", "fp8-block"])
def test_transpose_moves_the_blocks_with_their_axis(name):
    q = make(name, normal((64, 32)), block_axis=-2)
    t = qax.use_implicit_args(lambda w: w.T)(q)
    assert type(t) is type(q) and t.block_axis == -1 and t.shape == (32, 64)
    np.testing.assert_array_equal(t.dequantize(), q.dequantize().T)
    # Stacked weights: axes within a weight move, the stacking axis stays.
    s = make(name, normal((3, 32, 64), seed=4), batch_ndim=1)
    ts = qax.use_implicit_args(lambda w: jnp.swapaxes(w, 1, 2))(s)
    assert type(ts) is type(s) and ts.weight_ndim == 2 and ts.block_axis == -2
    np.testing.assert_array_equal(ts.dequantize(), jnp.swapaxes(s.dequantize(), 1, 2))
    # Moving the stacking axis decodes (and is still right).
    moved = qax.use_implicit_args(lambda w: jnp.transpose(w, (1, 0, 2)))(s)
    assert not isinstance(moved, qax.ImplicitArray)
    np.testing.assert_array_equal(moved, jnp.transpose(s.dequantize(), (1, 0, 2)))


def test_tied_embedding_transpose_stays_four_bit_under_jit():
    # `x @ emb.T` with a 4-bit table: the program holds no transpose of a decoded
    # table: the codes are transposed (uint8), then decoded once for the product.
    emb = NF4Weight.from_array(normal((96, 32), seed=5), block_size=16)
    x = normal((4, 32), seed=6)
    fn = lambda x, e: x @ e.T  # noqa: E731
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(x, emb)
    np.testing.assert_allclose(got, fn(x, emb.dequantize()), rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(fn))(x, emb).jaxpr
    transpose = find_eqn(jaxpr, "transpose")
    assert transpose is not None and transpose.invars[0].aval.dtype == jnp.uint8


def test_gather_rows_of_input_axis_blocks_decode_first():
    table = make("nf4", normal((48, 32), seed=7), block_axis=-2)
    ids = jnp.array([[3, 47, 0], [7, 7, 1]])
    got = jax.jit(qax.use_implicit_args(lambda w, i: w[i]))(table, ids)
    np.testing.assert_array_equal(got, table.dequantize()[ids])


def test_scanned_stack_with_input_axis_blocks_matches_the_oracle():
    ws = jnp.stack([normal((16, 16), seed=i) * 0.3 for i in range(3)])
    stacked = NF4Weight.from_array(ws, block_size=8, batch_ndim=1, block_axis=-2)
    x = normal((2, 16), seed=9)

    def loss(stack, x):
        h = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, stack)[0]
        return jnp.sum(h**2)

    with strict():
        value, g = jax.jit(jax.value_and_grad(qax.use_implicit_args(loss), 1))(
            stacked, x
        )
    want, d = jax.value_and_grad(loss, 1)(stacked.dequantize(), x)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-5)


def test_quantize_takes_block_axis_for_every_block_format_and_rules():
    params = {
        "attn": {"kernel": normal((64, 48), seed=10)},
        "mlp": {"kernel": normal((64, 128), seed=11)},
        "odd": {"kernel": normal((40, 64), seed=12)},  # 40: no multiple of 16
        "head": {"kernel": normal((64, 10), seed=13)},
        "proj": {"kernel": normal((64, 10), seed=16)},
    }
    with pytest.warns(UserWarning, match=r"axis -2 \(block_axis\).*odd/kernel"):
        out = qax.quant.quantize(
            params,
            "nf4",
            block_size=16,
            block_axis=-2,
            rules=[
                (".*attn.*", {"format": "int3"}),  # takes the call's block size, axis
                (".*head.*", {"format": "int8"}),  # per channel: no block axis
                (".*proj.*", {"format": "fp8_e4m3"}),  # the call's blocks and axis
            ],
        )
    assert isinstance(out["mlp"]["kernel"], NF4Weight)
    assert out["mlp"]["kernel"].block_axis == -2
    attn = out["attn"]["kernel"]
    assert isinstance(attn, IntKWeight) and attn.block_axis == -2
    assert attn.group_size == 16 and attn.scale.shape == (4, 48)
    assert isinstance(out["head"]["kernel"], qax.quant.Int8Weight)
    proj = out["proj"]["kernel"]
    assert isinstance(proj, FP8Weight) and proj.block_axis == -2
    assert proj.scale.shape == (4, 10)
    assert not isinstance(out["odd"]["kernel"], qax.ImplicitArray)
    want = qax.quant.quantize_dequantize(
        params["mlp"]["kernel"], "nf4", block_size=16, block_axis=-2
    )
    np.testing.assert_array_equal(out["mlp"]["kernel"].dequantize(), want)


def test_block_axis_errors_name_the_fix():
    w = normal((64, 32))
    with pytest.raises(
        ValueError, match=r"block_axis=2 .*in \[-2, 2\).*-2 for the input"
    ):
        NF4Weight.from_array(w, block_axis=2)
    with pytest.raises(ValueError, match="block_axis=True"):
        Int4Weight.from_array(w, block_axis=True)
    with pytest.raises(ValueError, match="block_axis=-2 without block_size"):
        FP8Weight.from_array(w, block_axis=-2)
    with pytest.raises(
        ValueError, match=r"axis -2 \(block_axis\) .*multiple of group_size=48"
    ):
        IntKWeight.from_array(w, bits=3, group_size=48, block_axis=-2)
    q = NF4Weight.from_array(w, block_size=16)
    with pytest.raises(ValueError, match="block_axis must count from the end"):
        NF4Weight(q.packed, q.absmax, 16, 0)


def test_fake_quantize_with_block_axis_converts_to_the_codes_it_trained_against():
    params = {"dense": {"kernel": normal((64, 32), seed=14)}}
    fq = qax.qat.fake_quantize(params, "int4", group_size=16, block_axis=-2)
    kernel = fq["dense"]["kernel"]
    want = qax.quant.quantize_dequantize(
        params["dense"]["kernel"], "int4", group_size=16, block_axis=-2
    )
    np.testing.assert_array_equal(kernel.materialize(), want)
    converted = qax.qat.convert(fq)["dense"]["kernel"]
    assert isinstance(converted, Int4Weight) and converted.block_axis == -2
    np.testing.assert_array_equal(converted.dequantize(), want)


def test_checkpoint_written_before_block_axis_restores_the_last_axis():
    # A description from before `block_axis` existed (one aux field fewer) rebuilds
    # with the default, the last axis: the codes decode as they always did.
    q = NF4Weight.from_array(normal((8, 64), seed=15), block_size=16)
    desc = qax.checkpoint.describe({"w": q})
    aux = json.loads(desc["implicit"][0]["aux"])
    assert aux["tuple"][0]["tuple"][-1] == {"int": "-1"}
    aux["tuple"][0]["tuple"].pop()
    desc["implicit"][0]["aux"] = json.dumps(aux)
    raw = {"w": {"packed": np.asarray(q.packed), "absmax": np.asarray(q.absmax)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rebuilt = qax.checkpoint.rebuild(raw, desc)["w"]
    assert isinstance(rebuilt, NF4Weight) and rebuilt.block_axis == -1
    np.testing.assert_array_equal(rebuilt.dequantize(), q.dequantize())


def test_quantize_checks_the_blocks_axis_of_stacked_weights():
    # Two stacked (48, 32) weights: block_axis=0 is the 48 of one weight (a multiple
    # of 16), not the stacking axis of 2.
    stack = {"layers": {"kernel": normal((2, 48, 32), seed=17)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = qax.quant.quantize(
            stack, "nf4", block_size=16, block_axis=0, batch_ndim=1
        )
    q = out["layers"]["kernel"]
    assert (
        isinstance(q, NF4Weight) and q.block_axis == -2 and q.absmax.shape == (2, 3, 32)
    )


def test_sharding_specs_follow_the_weights_dimensions():
    # Codes and scales keep the weight's layout (the blocks' axis shortened), so each
    # field is split as the weight is, whatever axis the blocks run along.
    from jax.sharding import PartitionSpec as P

    for axis in (-1, -2):
        q = NF4Weight.from_array(normal((64, 32)), block_size=16, block_axis=axis)
        specs = qax.sharding.implicit_specs({"k": q}, {"k": P("data", "model")})["k"]
        assert specs.packed == P("data", "model") and specs.absmax == P("data", "model")
