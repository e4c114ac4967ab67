"""`qax.quant`'s 4-bit float formats, MXFP4 and NVFP4: codes, sizes, error, handlers,
QLoRA and QAT; and `quantize(..., donate=True)`.

The oracles: ``ml_dtypes``' own conversions to ``float4_e2m1fn``, ``float8_e8m0fnu``
and ``float8_e4m3fn`` for the codes and scales (both JAX ends ship them; the formats do
not depend on them); the decoded weight for everything else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import qax
from qax.quant import FP4_LEVELS, MXFP4Weight, NVFP4Weight

FP4 = {"mxfp4": MXFP4Weight, "nvfp4": NVFP4Weight}
IDS = list(FP4)


def normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


def strict():
    import contextlib

    stack = contextlib.ExitStack()
    for cls in (MXFP4Weight, NVFP4Weight, qax.lora.LoraWeight):
        stack.enter_context(qax.materialization_policy(cls, "error"))
    return stack


def rel_rms(got, w):
    got, w = np.asarray(got, np.float64), np.asarray(w, np.float64)
    return float(np.sqrt(np.mean((got - w) ** 2) / np.mean(w**2)))


def test_levels_are_float4_e2m1fn():
    codes = np.arange(16, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(FP4_LEVELS), ref)
    assert np.signbit(FP4_LEVELS[8])  # code 8: -0


def test_codes_round_as_the_fp4_conversion_does():
    # Every midpoint (a tie: to the even code), just beside it, and beyond 6.
    mids = (FP4_LEVELS[1:8] + FP4_LEVELS[:7]) / 2
    x = np.concatenate([mids, mids - 1e-3, mids + 1e-3, [6.5, 7.0, 100.0, 0.0]])
    x = np.concatenate([x, -x]).astype(np.float32)
    got = FP4_LEVELS[np.asarray(qax.quant._fp4.fp4_codes(jnp.asarray(x)))]
    ref = np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, ref)


def test_mxfp4_is_the_ocp_mx_encoding():
    w = normal((8, 128), seed=1) * jnp.exp(normal((8, 1), seed=2))  # varied scales
    q = MXFP4Weight.from_array(w)
    x = np.asarray(w).reshape(8, 4, 32)
    shared = np.floor(np.log2(np.abs(x).max(-1))) - 2  # emax of e2m1
    scale = (2.0**shared).astype(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(np.asarray(q.scale), scale.view(np.uint8))
    s = scale.astype(np.float32)[..., None]
    elems = np.clip(x / s, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(q.dequantize()), (elems * s).reshape(8, 128)
    )


def test_nvfp4_is_nvidias_encoding():
    w = normal((2, 8, 64), seed=3) * jnp.asarray([1.0, 30.0])[:, None, None]
    q = NVFP4Weight.from_array(w, batch_ndim=1)  # one float32 scale per layer
    assert q.tensor_scale.shape == (2, 1, 1) and q.tensor_scale.dtype == jnp.float32
    x = np.asarray(w).reshape(2, 8, 4, 16)
    t = np.abs(x).max(axis=(1, 2, 3), keepdims=True)[..., 0] / (6 * 448)
    np.testing.assert_allclose(np.asarray(q.tensor_scale), t, rtol=1e-7)
    block = (np.abs(x).max(-1) / 6 / t).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(
        np.asarray(q.scale).view(np.uint8), block.view(np.uint8)
    )
    dec = block.astype(np.float32) * t
    elems = np.clip(x / dec[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn)
    ref = (elems.astype(np.float32) * dec[..., None]).reshape(w.shape)
    np.testing.assert_allclose(np.asarray(q.dequantize()), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "fmt, bits, error",
    [("nf4", 4.5, 0.092), ("nvfp4", 4.5, 0.095), ("mxfp4", 4.25, 0.115)],
)
def test_bits_per_number_and_error_on_normal_weights(fmt, bits, error):
    w = normal((256, 512), seed=4)
    q = qax.quant.quantize({"w": w}, fmt)["w"]
    extra = 32 if fmt == "nvfp4" else 0  # the one float32 scale of the weight
    assert (8 * q.nbytes - extra) / q.size == bits
    assert rel_rms(q.dequantize(), w) == pytest.approx(error, abs=0.003)


@pytest.mark.parametrize("name", IDS)
def test_products_run_on_the_codes_in_every_layout(name):
    cls = FP4[name]
    w = normal((64, 32), seed=5)
    q = cls.from_array(w, block_axis=-2)
    dense = q.dequantize()
    x = normal((3, 64), seed=6)
    img = normal((1, 5, 5, 64), seed=7)
    k = cls.from_array(normal((3, 3, 64, 32), seed=8))

    def f(x, q, img, k):
        conv = lax.conv_general_dilated(
            img, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return x @ q, (q.T @ x.T).T, conv

    with strict():
        got = qax.use_implicit_args(f)(x, q, img, k)
    want = f(x, dense, img, k.dequantize())
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("name", IDS)
def test_casts_scalars_and_stop_gradient_keep_the_codes(name):
    q = FP4[name].from_array(normal((4, 64), seed=9))

    @qax.use_implicit_args
    def f(q):
        return q.astype(jnp.bfloat16), lax.stop_gradient(q)

    with strict():
        half, stopped = f(q)
    assert isinstance(half, FP4[name]) and half.dtype == jnp.bfloat16
    np.testing.assert_array_equal(half.packed, q.packed)
    np.testing.assert_array_equal(
        half.dequantize(), q.dequantize().astype(jnp.bfloat16)
    )
    assert isinstance(stopped, FP4[name])
    scaled = qax.use_implicit_args(lambda q: q * 3.0)(q)
    np.testing.assert_allclose(
        qax.materialize_nested(scaled, full=True), 3.0 * q.dequantize(), rtol=1e-6
    )
    assert isinstance(scaled, NVFP4Weight) == (name == "nvfp4")  # MXFP4: decoded


@pytest.mark.parametrize("name", IDS)
def test_layers_of_a_stack_in_a_scan_and_aligned_slices(name):
    cls = FP4[name]
    stack = cls.from_array(normal((3, 64, 32), seed=10), batch_ndim=1)
    x = normal((2, 64), seed=11)

    def model(stack, x):
        def body(h, w):
            return jnp.tanh(h @ w @ w.T), None

        h, _ = lax.scan(body, x, stack)
        return h, stack[1][:16], stack[2, 32:, :]

    with strict():
        got = qax.use_implicit_args(model)(stack, x)
    want = model(stack.dequantize(), x)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(
            qax.materialize_nested(g, full=True), r, rtol=1e-5, atol=1e-5
        )
    assert isinstance(got[1], cls) and isinstance(got[2], cls)  # rows: codes kept
    with pytest.warns(qax.MaterializationWarning, match="cuts the blocks"):
        qax.use_implicit_args(lambda s: s[0, :, 8:24])(stack)


def test_block_sizes_are_the_specifications():
    w = {"w": normal((8, 64))}
    with pytest.raises(ValueError, match="blocks of 32 by its specification"):
        qax.quant.quantize(w, "mxfp4", block_size=64)
    with pytest.raises(ValueError, match="blocks of 16 by its specification"):
        qax.quant.quantize(w, "nvfp4", group_size=32)
    with pytest.raises(ValueError, match="multiple of block_size=32"):
        MXFP4Weight.from_array(normal((8, 48)))
    # A rule that picks them takes the call's block_axis, not its block size.
    q = qax.quant.quantize(
        {"a": normal((64, 32))},
        "nf4",
        block_size=16,
        block_axis=-2,
        rules=[("a", {"format": "nvfp4"})],
    )["a"]
    assert isinstance(q, NVFP4Weight) and q.block_size == 16 and q.block_axis == -2
    with pytest.warns(UserWarning, match="not a multiple of the block size 32"):
        kept = qax.quant.quantize({"w": normal((8, 48))}, "mxfp4")
    assert isinstance(kept["w"], jax.Array)


@functools.cache
def _qlora_case(fmt):
    ks = jax.random.split(jax.random.PRNGKey(12), 3)
    params = {
        "l0": {"kernel": 0.1 * jax.random.normal(ks[0], (64, 64))},
        "l1": {"kernel": 0.1 * jax.random.normal(ks[1], (64, 32))},
    }
    base = qax.quant.quantize(params, fmt)
    adapters, frozen = qax.lora.split(qax.lora.loraify(base, 4, key=ks[2]))
    return params, jax.tree.map(lambda a: a + 0.01, adapters), frozen


@pytest.mark.parametrize("name", IDS)
def test_qlora_gradients_match_the_decoded_base(name):
    params, adapters, frozen = _qlora_case(name)
    x, y = normal((8, 64), seed=13), normal((8, 32), seed=14)

    def model(p, x):
        return jax.nn.relu(x @ p["l0"]["kernel"]) @ p["l1"]["kernel"]

    def loss(adapters, base):
        p = qax.lora.combine(adapters, base)
        return jnp.mean((qax.use_implicit_args(model)(p, x) - y) ** 2)

    with strict():
        got = jax.jit(jax.grad(loss))(adapters, frozen)
    decoded = qax.quant.dequantize(frozen)
    want = jax.grad(loss)(adapters, decoded)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_qat_then_quantize_gives_the_trained_against_codes(name, dtype):
    w = normal((64, 32), seed=15, dtype=dtype)
    fq = qax.qat.FakeQuant.from_array(w, name, block_axis=-2)
    want = qax.quant.quantize_dequantize(w.astype(jnp.float32), name, block_axis=-2)
    np.testing.assert_array_equal(
        qax.materialize_nested(fq, full=True), want.astype(dtype)
    )
    # Straight-through: the gradient of a sum is ones.
    grad = jax.grad(
        lambda w: jnp.sum(
            qax.materialize_nested(qax.qat.FakeQuant.from_array(w, name), full=True)
        )
    )(w)
    np.testing.assert_array_equal(grad, jnp.ones_like(w))
    q = qax.quant.quantize({"w": fq}, "int8")["w"]  # its own format, whatever fmt says
    assert isinstance(q, FP4[name]) and q.dtype == dtype and q.block_axis == -2
    np.testing.assert_array_equal(q.dequantize(), want.astype(dtype))


def test_quantize_with_donate_frees_each_dense_weight_it_replaces():
    tied = normal((8, 64), seed=16)
    params = {
        "a": {"kernel": normal((64, 32), seed=17)},
        "b": {"kernel": normal((32, 64), seed=18), "bias": jnp.zeros(64)},
        "tied": {"kernel": tied},
        "again": {"kernel": tied},  # the same array at two paths: kept
    }
    want = qax.quant.quantize(params, "nvfp4")
    got = qax.quant.quantize(params, "nvfp4", donate=True)
    assert params["a"]["kernel"].is_deleted() and params["b"]["kernel"].is_deleted()
    assert not params["b"]["bias"].is_deleted()  # not quantized: still the model's
    assert not tied.is_deleted()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    # Traced, it changes nothing (no buffers to free).
    out = jax.jit(lambda p: qax.quant.quantize(p, "mxfp4", donate=True))(
        {"k": normal((4, 64))}
    )
    assert isinstance(out["k"], MXFP4Weight)


def test_checkpoint_description_rebuilds_the_new_formats():
    import json

    w = normal((2, 64, 32), seed=19, dtype=jnp.bfloat16)
    tree = {
        fmt: qax.quant.quantize({"w": w}, fmt, batch_ndim=1, block_axis=-2)["w"]
        for fmt in ("mxfp4", "nvfp4", "nf4_dq")
    }
    desc = json.loads(json.dumps(qax.checkpoint.describe(tree)))
    raw = {
        k: {n: np.asarray(getattr(v, n)) for n in v._ARRAYS} for k, v in tree.items()
    }
    back = qax.checkpoint.rebuild(raw, desc)
    for k, q in tree.items():
        assert type(back[k]) is type(q) and back[k].dtype == jnp.bfloat16
        assert back[k].block_axis == -2 and back[k].weight_ndim == 2
        np.testing.assert_array_equal(back[k].dequantize(), q.dequantize())
