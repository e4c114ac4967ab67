"""`qax.quant`: formats, handlers against the decoded oracle, trees, and QLoRA."""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax
from qax.lora import LoraWeight
from qax.quant import (
    NF4_LEVELS,
    FP8Weight,
    Int4Weight,
    Int8Weight,
    IntKWeight,
    NF4Weight,
    QuantizedWeight,
)
from qax.testing import check_handler
from tests.helpers import all_eqns, check_equation, find_eqn

FORMATS = [
    pytest.param(lambda w: Int8Weight.from_array(w), id="int8"),
    pytest.param(lambda w: Int4Weight.from_array(w, group_size=16), id="int4"),
    pytest.param(lambda w: NF4Weight.from_array(w, block_size=16), id="nf4"),
]
# The handlers are shared by the formats and differ only in how they decode (tested on
# every format by the round trip): the expensive handler checks run on one or two.


def normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


def strict():
    """Materializing any quantized or LoRA weight is an error inside this block."""
    import contextlib

    stack = contextlib.ExitStack()
    for cls in (Int8Weight, Int4Weight, NF4Weight, FP8Weight, IntKWeight, LoraWeight):
        stack.enter_context(qax.materialization_policy(cls, "error"))
    return stack


# ----------------------------------------------------------------------------------------
# The formats


def test_nf4_levels():
    levels = np.asarray(NF4_LEVELS)
    assert levels.shape == (16,) and np.all(np.diff(levels) > 0)
    assert levels[0] == -1 and levels[-1] == 1 and 0.0 in levels
    assert (levels < 0).sum() == 7 and (levels > 0).sum() == 8
    # Levels sit at normal quantiles: denser near zero than at the ends.
    gaps = np.diff(levels)
    assert gaps[7] < gaps[0] and gaps[8] < gaps[-1]


@pytest.mark.parametrize("make", FORMATS)
def test_round_trip_error_is_within_half_a_step(make):
    w = normal((8, 64))
    q = make(w)
    err = np.abs(np.asarray(q.dequantize() - w))
    if isinstance(q, Int8Weight):
        step = np.broadcast_to(np.asarray(q.scale), w.shape)
    elif isinstance(q, Int4Weight):
        step = np.repeat(np.asarray(q.scale), q.group_size, axis=-1)
    else:  # the largest gap between NF4 levels, times the block's absmax
        step = np.repeat(np.asarray(q.absmax), q.block_size, axis=-1) * np.max(
            np.diff(NF4_LEVELS)
        )
    assert np.all(err <= step / 2 + 1e-6)
    assert q.shape == w.shape and q.dtype == w.dtype


def test_storage_really_is_8_and_4_bits():
    w = normal((64, 256))
    int8 = Int8Weight.from_array(w)
    int4 = Int4Weight.from_array(w, group_size=64)
    nf4 = NF4Weight.from_array(w, block_size=64)
    assert int8.q.dtype == jnp.int8 and int8.q.nbytes == w.size
    assert int4.packed.dtype == jnp.uint8 and int4.packed.nbytes == w.size // 2
    assert nf4.packed.dtype == jnp.uint8 and nf4.packed.nbytes == w.size // 2
    assert int4.scale.size == nf4.absmax.size == w.size // 64
    assert nf4.nbytes == w.size // 2 + 4 * (w.size // 64)


def test_nf4_beats_int4_on_normal_weights():
    w = normal((256, 256), seed=3)
    nf4 = NF4Weight.from_array(w, block_size=64).dequantize()
    int4 = Int4Weight.from_array(w, group_size=64).dequantize()
    rms = lambda d: float(jnp.sqrt(jnp.mean((d - w) ** 2)))  # noqa: E731
    assert rms(nf4) < 0.95 * rms(int4), (rms(nf4), rms(int4))


def test_zero_weights_and_bad_shapes():
    for cls in (Int8Weight, Int4Weight, NF4Weight):
        zero = cls.from_array(jnp.zeros((4, 64)))
        np.testing.assert_array_equal(zero.dequantize(), 0)
    with pytest.raises(ValueError, match="multiple of block_size=64"):
        NF4Weight.from_array(jnp.ones((4, 65)))
    with pytest.raises(ValueError, match="group_size=3"):
        Int4Weight.from_array(jnp.ones((4, 6)), group_size=3)
    with pytest.raises(ValueError, match="weight_ndim must be .* got -1"):
        Int8Weight.from_array(jnp.ones((4, 3)), batch_ndim=3)


def test_int8_scales_along_any_set_of_axes():
    # An einsum kernel (heads, d, k): one scale per head and output unit (issue 22, 7),
    # where one per output unit alone shares each scale across the heads.
    w = normal((4, 32, 8)) * jnp.asarray([0.1, 1.0, 3.0, 10.0])[:, None, None]
    per_head = Int8Weight.from_array(w, axis=(0, -1))
    shared = Int8Weight.from_array(w)
    assert per_head.scale.shape == (4, 1, 8) and shared.scale.shape == (1, 1, 8)
    expected = jnp.max(jnp.abs(w), axis=1, keepdims=True) / 127
    np.testing.assert_allclose(per_head.scale, expected, rtol=1e-6)
    assert np.max(np.abs(per_head.dequantize() - w)) <= float(jnp.max(expected)) / 2
    # the quietest head: its own scales, or those of the loudest one
    err = {
        k: float(jnp.sqrt(jnp.mean((q.dequantize()[0] - w[0]) ** 2)))
        for k, q in (("per_head", per_head), ("shared", shared))
    }
    assert err["per_head"] < err["shared"] / 10, err
    assert qax.sharding.field_dims(per_head) == {"q": (0, 1, 2), "scale": (0, None, 2)}

    x = normal((3, 32), seed=1)
    einsum = qax.use_implicit_args(lambda x, w: jnp.einsum("bd,hdk->bhk", x, w))
    with strict():
        got = jax.jit(einsum)(x, per_head)
    np.testing.assert_allclose(
        got, jnp.einsum("bd,hdk->bhk", x, per_head.dequantize()), rtol=1e-5, atol=1e-5
    )
    tree = qax.quant.quantize({"kernel": w}, "int8", axis=(0, 2))
    np.testing.assert_array_equal(tree["kernel"].scale, per_head.scale)
    stacked = Int8Weight.from_array(jnp.stack([w, 2 * w]), axis=(1, 3), batch_ndim=1)
    assert stacked.scale.shape == (2, 4, 1, 8) and stacked.weight_ndim == 3
    with pytest.raises(ValueError, match=r"axis=\(0, 3\).*\[-3, 3\)"):
        Int8Weight.from_array(w, axis=(0, 3))


# ----------------------------------------------------------------------------------------
# Handlers against "decode, then run the primitive"


DOTS = [
    ("x@W", (3, 32), lambda x, w: x @ w),
    ("W@x", (32, 5), lambda x, w: jnp.einsum("io,ib->ob", w, x)),
    ("x@W.T", (3, 16), lambda x, w: jnp.einsum("bo,io->bi", x, w)),
    ("batched", (2, 3, 32), lambda x, w: jnp.einsum("hbi,io->hbo", x, w)),
]


# The handlers bind `dot_general` with the caller's parameters on the decoded weight:
# the layout is not theirs to handle, only which side the weight is on.
@pytest.mark.parametrize(
    "make, name, x_shape, fn",
    [
        pytest.param(FORMATS[0].values[0], *DOTS[1], id="int8-W@x"),
        pytest.param(FORMATS[1].values[0], *DOTS[0], id="int4-x@W"),
        pytest.param(FORMATS[2].values[0], *DOTS[3], id="nf4-batched"),
    ],
)
def test_dot_general(make, name, x_shape, fn):
    q = make(normal((32, 16)))
    check_equation(fn, "dot_general", normal(x_shape, seed=1), q)


def test_conv():
    # The handler is the one checked for dot_general (decode, then bind, so its
    # gradients and batching are those): here, that it is registered for convolutions
    # and that a 4-D weight decodes.
    kernel = NF4Weight.from_array(normal((3, 3, 4, 16)), block_size=16)
    x = normal((1, 4, 4, 4), seed=1)

    def fn(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(x, kernel)
    np.testing.assert_allclose(got, fn(x, kernel.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", [FORMATS[0], FORMATS[2]])  # per-channel, per-block
def test_embedding_gather_decodes_only_the_rows(make):
    table = make(normal((50, 32)))
    ids = jnp.array([[3, 49, 0], [7, 7, 1]])
    fn = lambda w, i: w[i]  # noqa: E731
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(table, ids)
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(fn))(table, ids)
    np.testing.assert_array_equal(got, table.dequantize()[ids])
    # Nothing of the table's size is decoded: only gathered rows become floats.
    floats = [
        tuple(v.aval.shape)
        for e in all_eqns(jaxpr.jaxpr)
        for v in e.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    ]
    assert all(int(np.prod(s)) <= ids.size * 32 for s in floats), floats
    eqn = find_eqn(jax.make_jaxpr(fn)(table.dequantize(), ids).jaxpr, "gather")
    check_handler("gather", table, ids[..., None], **eqn.params)


def test_convert_mul_stop_gradient_stay_quantized():
    for make in FORMATS:
        q = make.values[0](normal((16, 32)))
        with strict():
            bf16 = qax.use_implicit_args(lambda w: w.astype(jnp.bfloat16))(q)
            scaled = qax.use_implicit_args(lambda w: w * 3.0)(q)
            stopped = qax.use_implicit_args(lax.stop_gradient)(q)
        assert type(bf16) is type(q) and bf16.dtype == jnp.bfloat16
        np.testing.assert_allclose(
            np.asarray(bf16.dequantize(), np.float32),
            np.asarray(q.dequantize().astype(jnp.bfloat16), np.float32),
            rtol=1e-2,
        )
        assert type(scaled) is type(q)
        np.testing.assert_allclose(scaled.dequantize(), 3 * q.dequantize(), rtol=1e-6)
        assert type(stopped) is type(q)


def test_convert_and_mul_handlers_pass_check_handler():
    # Shared by the formats; NF4's scales are its `absmax` field.
    q = NF4Weight.from_array(normal((16, 32)), block_size=16)
    # Decoding in bf16 sums the scales' gradients in bf16.
    check_equation(
        lambda w: w.astype(jnp.bfloat16), "convert_element_type", q, rtol=5e-2, atol=5.0
    )
    check_equation(lambda w, c: w * c, "mul", q, jnp.float32(0.5))


def test_int8_transpose_stays_int8():
    q = Int8Weight.from_array(normal((16, 32)))
    with strict():
        t = qax.use_implicit_args(lambda w: w.T)(q)
    assert isinstance(t, Int8Weight) and t.shape == (32, 16)
    np.testing.assert_array_equal(t.dequantize(), q.dequantize().T)


# ----------------------------------------------------------------------------------------
# Models, transformations, dtypes


def mlp(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


def mlp_params(seed=0):
    return {"w1": normal((32, 64), seed), "w2": normal((64, 32), seed + 1) * 0.1}


def test_model_under_jit_grad_vmap_scan():
    # The transformation rules do not depend on the format (the handlers do, and are
    # checked above): one int8 and one nf4 weight, computing in bf16 (a cast each).
    dtype = jnp.bfloat16
    weights = mlp_params()
    params = {
        "w1": Int8Weight.from_array(weights["w1"]),
        "w2": NF4Weight.from_array(weights["w2"], block_size=32),
    }
    dense = qax.quant.dequantize(params)
    xs = normal((4, 5, 32), seed=9, dtype=dtype)

    def cast(params):
        return {k: v.astype(dtype) for k, v in params.items()}

    def model(params, x):
        return mlp(cast(params), x)

    def scanned(params, xs):
        return lax.scan(lambda c, x: (c, model(params, x)), 0.0, xs)[1]

    def loss(params, x):
        return jnp.sum(model(params, x).astype(jnp.float32) ** 2)

    with strict():
        got = {
            "jit": jax.jit(qax.use_implicit_args(model))(params, xs[0]),
            "vmap": jax.vmap(qax.use_implicit_args(model), (None, 0))(params, xs),
            "scan": jax.jit(qax.use_implicit_args(scanned))(params, xs),
            "grad_x": jax.grad(qax.use_implicit_args(loss), argnums=1)(params, xs[0]),
        }
    want = {
        "jit": model(dense, xs[0]),
        "vmap": jax.vmap(model, (None, 0))(dense, xs),
        "scan": scanned(dense, xs),
        "grad_x": jax.grad(loss, argnums=1)(dense, xs[0]),
    }
    for k in want:
        g, w = np.asarray(got[k], np.float32), np.asarray(want[k], np.float32)
        rel = 3e-2  # bf16: 8 bits of mantissa
        np.testing.assert_allclose(
            g, w, rtol=rel, atol=rel * np.abs(w).max(), err_msg=k
        )


def test_no_dense_weight_enters_the_program():
    params = qax.quant.quantize(mlp_params(), "nf4", block_size=32)
    x = normal((4, 32))
    with strict():
        jaxpr = jax.make_jaxpr(jax.jit(qax.use_implicit_args(mlp)))(params, x)
    inputs = [v.aval for v in jaxpr.jaxpr.invars]
    floats = [a.shape for a in inputs if jnp.issubdtype(a.dtype, jnp.floating)]
    assert (32, 64) not in floats and (64, 32) not in floats
    assert sum(a.dtype == jnp.uint8 for a in inputs) == 2


def test_a_stopped_quantized_weight_has_no_weight_sized_gradient():
    params = qax.quant.quantize(mlp_params(), "int8")
    x = normal((4, 32))

    def loss(scales, stop):
        p = {k: Int8Weight(params[k].q, scales[k]) for k in params}

        def inner(p):
            if stop:
                p = jax.tree_util.tree_map(lax.stop_gradient, p)
            return jnp.sum(mlp(p, x) ** 2)

        return qax.use_implicit_args(inner)(p)

    scales = {k: v.scale for k, v in params.items()}
    with strict():
        free = jax.grad(lambda s: loss(s, False))(scales)
        stopped = jax.grad(lambda s: loss(s, True))(scales)
        jaxpr = jax.make_jaxpr(jax.grad(lambda s: loss(s, True)))(scales)
    # Without stop_gradient the scales get the decoded weight's gradient (the oracle).
    want = jax.grad(
        lambda s: jnp.sum(
            mlp({"w1": params["w1"].q * s, "w2": params["w2"].dequantize()}, x) ** 2
        )
    )(params["w1"].scale)
    np.testing.assert_allclose(free["w1"], want, rtol=1e-4)
    assert not np.any(np.asarray(stopped["w1"]))
    shapes = [
        tuple(e.outvars[0].aval.shape)
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert (32, 64) not in shapes and (64, 32) not in shapes, shapes


# ----------------------------------------------------------------------------------------
# Trees


def test_quantize_tree_defaults_filter_and_errors():
    params = {
        "embed": {"embedding": normal((10, 64))},
        "dense": {"kernel": normal((64, 64)), "bias": jnp.zeros(64)},
        "head": {"kernel": normal((64, 10))},  # 10 is no multiple of 64: left alone
    }
    with pytest.warns(UserWarning, match=r"kept 1 weight.*head/kernel \(64, 10\)"):
        q = qax.quant.quantize(params, "nf4")
    assert isinstance(q["dense"]["kernel"], NF4Weight)
    assert not isinstance(q["embed"]["embedding"], QuantizedWeight)
    assert not isinstance(q["head"]["kernel"], QuantizedWeight)
    assert q["dense"]["bias"] is params["dense"]["bias"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # int8 holds any shape: nothing skipped
        q8 = qax.quant.quantize(params, Int8Weight)
    assert isinstance(q8["head"]["kernel"], Int8Weight)
    everything = qax.quant.quantize(params, "int8", filter=lambda path, x: x.ndim == 2)
    assert isinstance(everything["embed"]["embedding"], Int8Weight)
    back = qax.quant.dequantize(q8)
    np.testing.assert_allclose(
        back["dense"]["kernel"], params["dense"]["kernel"], atol=0.05
    )
    with pytest.raises(ValueError, match="unknown format 'fp3'"):
        qax.quant.quantize(params, "fp3")
    with pytest.raises(ValueError, match="multiple of block_size=64"):
        qax.quant.quantize(params, "nf4", filter=lambda path, x: x.ndim == 2)


# ----------------------------------------------------------------------------------------
# QLoRA


def qlora_params(seed=0):
    base = qax.quant.quantize(mlp_params(seed), "nf4", block_size=32)
    params = qax.lora.loraify(base, 4, key=jax.random.PRNGKey(seed + 7), alpha=8.0)
    return jax.tree_util.tree_map(
        lambda w: LoraWeight(w.w, w.a, w.b + 0.05, alpha=w.alpha),
        params,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )


def test_qlora_matmul_against_the_oracle():
    params = qlora_params()
    w = params["w1"]
    assert isinstance(w.w, NF4Weight)
    x = normal((3, 32), seed=2)
    report = check_equation(lambda x, w: x @ w, "dot_general", x, w)
    assert dict(report.checks)["grad"] == "passed"
    # The base product went to the NF4 handler: nothing was materialized. The oracle
    # (materialize) is QLoRA's formula.
    assert not report.materializations
    want = w.w.dequantize() + w.scale * (w.a @ w.b)
    np.testing.assert_allclose(w.materialize(), want, rtol=1e-5, atol=1e-5)


def test_qlora_trains_with_optax_and_keeps_the_base_4_bit():
    params = qlora_params()
    adapters, base = qax.lora.split(params)
    x, y = normal((16, 32), seed=3), normal((16, 32), seed=4)
    opt = optax.adam(1e-2)
    opt_state = opt.init(adapters)

    @jax.jit
    def step(adapters, opt_state, base):
        def loss(adapters):
            p = qax.lora.combine(adapters, base)
            return qax.use_implicit_args(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(p)

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    with strict():
        losses = []
        for _ in range(30):
            adapters, opt_state, value = step(adapters, opt_state, base)
            losses.append(float(value))
        jaxpr = jax.make_jaxpr(step)(adapters, opt_state, base)
    assert losses[-1] < 0.8 * losses[0], losses
    inputs = [v.aval for v in jaxpr.jaxpr.invars]
    assert not any(
        a.shape in ((32, 64), (64, 32)) and jnp.issubdtype(a.dtype, jnp.floating)
        for a in inputs
    )
    # Adam moments for the factors only.
    moments = sum(
        x.size for x in jax.tree_util.tree_leaves(opt_state) if jnp.ndim(x) > 0
    )
    assert moments == 2 * qax.lora.trainable_count(adapters)
    merged = qax.lora.merge(qax.lora.combine(adapters, base))
    assert all(isinstance(v, jax.Array) for v in merged.values())
    np.testing.assert_allclose(
        jnp.mean((mlp(merged, x) - y) ** 2), losses[-1], rtol=0.1
    )


def test_quantize_and_loraify_take_per_path_rules_first_match_wins():
    params = {
        "layers": [
            {
                "attn": {"kernel": normal((32, 64), seed=i)},
                "mlp": {"kernel": normal((64, 32), seed=9 + i)},
            }
            for i in range(2)
        ],
        "head": {"kernel": normal((32, 48), seed=5)},
        "embed": {"embedding": normal((48, 32), seed=6)},
    }
    rules = [
        (r"layers/1/attn/.*", None),  # first match wins: stays dense
        (r"layers/\d+/attn/.*", {"format": "int8", "axis": 0}),
        (r"head/.*", {"block_size": 16}),
        (r"embed/.*", {"format": "int4", "group_size": 8}),  # chosen despite the filter
    ]
    q = qax.quant.quantize(params, "nf4", block_size=32, rules=rules)
    assert isinstance(q["layers"][0]["attn"]["kernel"], Int8Weight)
    assert q["layers"][0]["attn"]["kernel"].scale.shape == (32, 1)  # axis=0
    assert not isinstance(q["layers"][1]["attn"]["kernel"], QuantizedWeight)
    mlp = q["layers"][0]["mlp"]["kernel"]  # no rule: the call's format and options
    assert isinstance(mlp, NF4Weight) and mlp.block_size == 32
    assert (
        isinstance(q["head"]["kernel"], NF4Weight)
        and q["head"]["kernel"].block_size == 16
    )
    emb = q["embed"]["embedding"]
    assert isinstance(emb, Int4Weight) and emb.group_size == 8
    np.testing.assert_array_equal(
        q["embed"]["embedding"].dequantize(),
        Int4Weight.from_array(params["embed"]["embedding"], group_size=8).dequantize(),
    )

    lora = qax.lora.loraify(
        q,
        4,
        key=jax.random.PRNGKey(0),
        rules=[
            (r"layers/0/.*", {"rank": 8, "alpha": 16.0}),
            (r"head/.*", None),
        ],
    )
    first = lora["layers"][0]["attn"]["kernel"]
    assert isinstance(first, LoraWeight) and first.a.shape == (32, 8)
    assert first.alpha == 16.0 and isinstance(first.w, Int8Weight)
    assert lora["layers"][1]["mlp"]["kernel"].a.shape == (64, 4)  # the call's rank
    assert not isinstance(lora["head"]["kernel"], LoraWeight)
    assert not isinstance(lora["embed"]["embedding"], LoraWeight)  # default filter

    with pytest.raises(ValueError, match=r"sets \['rnk'\]"):
        qax.lora.loraify(
            params, 4, key=jax.random.PRNGKey(0), rules=[(".*", {"rnk": 2})]
        )
    with pytest.raises(ValueError, match="not a regular expression"):
        qax.quant.quantize(params, "int8", rules=[("(", {})])
    with pytest.raises(ValueError, match="unknown format 'int9'"):
        qax.quant.quantize(params, "int8", rules=[(".*", {"format": "int9"})])
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        qax.lora.loraify(
            params, 4, key=jax.random.PRNGKey(0), rules=[(".*", {"rank": 0})]
        )


# ----------------------------------------------------------------------------------------
# FP8 and k-bit integers (issue 25)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Every new format, as (class, from_array options): fp8 per channel and block-wise, and
# the k-bit integers that have a name (4 and 8 keep Int4Weight / Int8Weight).
NEW = {
    "fp8_e4m3": (FP8Weight, {}),
    "fp8_e5m2": (FP8Weight, {"fp8_dtype": E5M2}),
    "fp8_e4m3-block": (FP8Weight, {"block_size": 16}),
    "fp8_e5m2-block": (FP8Weight, {"fp8_dtype": E5M2, "block_size": 16}),
    **{f"int{k}": (IntKWeight, {"bits": k, "group_size": 16}) for k in (2, 3, 5, 6, 7)},
}
NEW_IDS = list(NEW)
# Every format, the first three included, for the handler checks in both dtypes.
EVERY = {
    "int8": (Int8Weight, {}),
    "int4": (Int4Weight, {"group_size": 16}),
    "nf4": (NF4Weight, {"block_size": 16}),
    **NEW,
}
EVERY_IDS = list(EVERY)
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
# bf16: the oracle decodes to bf16 and sums the scales' gradients (|code| * |x|, codes
# up to 448 or 57344 for fp8) in bf16; the handler's sums round differently.
BF16_TOL = {"rtol": 5e-2, "atol": 5e-2}


def make_new(name, w, **kw):
    cls, options = EVERY[name]
    return cls.from_array(w, **options, **kw)


def tol(dtype):
    return BF16_TOL if dtype == jnp.bfloat16 else {}


@pytest.mark.parametrize("name", NEW_IDS)
def test_new_formats_round_trip_within_half_a_step(name):
    w = normal((8, 64), seed=2) * jnp.linspace(0.01, 3.0, 64)  # channels of any size
    q = make_new(name, w)
    assert q.shape == w.shape and q.dtype == w.dtype
    err = np.abs(np.asarray(q.dequantize() - w))
    groups = np.asarray(w).reshape(8, 4, 16)
    w = np.abs(np.asarray(w))
    if isinstance(q, FP8Weight):
        # Half a unit in the last place of the code: relative (eps / 2) for normal
        # codes, half the smallest subnormal (times the scale) below them.
        info = jnp.finfo(q.q.dtype)
        scale = np.asarray(q.scale, np.float32)
        if q.block_size is not None:
            scale = np.repeat(scale, q.block_size, axis=-1)
        bound = w * float(info.eps) / 2 + scale * float(info.smallest_subnormal) / 2
        assert np.all(np.abs(np.asarray(q.q, np.float32)) <= float(info.max))
    else:
        bound = np.repeat(np.asarray(q.scale), q.group_size, axis=-1) / 2
        top = 2 ** (q.bits - 1) - 1
        if q.bits >= 4:  # the largest number is top steps, or the most negative -top-1
            want = np.maximum(groups.max(-1) / top, -groups.min(-1) / (top + 1))
        else:  # the absmax is top + 1/2 steps: it rounds half a step inwards
            want = np.abs(groups).max(-1) / (top + 0.5)
        np.testing.assert_allclose(q.scale, want, rtol=1e-6)
        codes = np.round(np.asarray(q.dequantize()).reshape(8, 4, 16) / want[..., None])
        assert codes.min() >= -top - 1 and codes.max() <= top
        if q.bits <= 3:  # every level is used on these weights
            assert len(np.unique(codes)) == 2**q.bits
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7), np.max(err - bound)
    bf16 = make_new(name, w.astype(jnp.bfloat16))
    assert bf16.dtype == jnp.bfloat16 and bf16.dequantize().dtype == jnp.bfloat16
    zero = make_new(name, jnp.zeros((4, 32)))
    np.testing.assert_array_equal(zero.dequantize(), 0)


@pytest.mark.parametrize("bits", range(2, 9))
def test_intk_storage_is_exactly_k_bits_per_number(bits):
    w = normal((16, 192), seed=bits)
    q = IntKWeight.from_array(w, bits, group_size=64)
    assert q.packed.dtype == jnp.uint8 and q.packed.nbytes * 8 == w.size * bits
    assert q.nbytes == w.size * bits // 8 + 4 * w.size // 64
    # The documented layout, rebuilt with numpy: code i of a row in bits i*k..i*k+k-1
    # of the row's bytes, least significant bit first.
    top = 2 ** (bits - 1) - 1
    scale = np.repeat(np.asarray(q.scale), 64, axis=-1)
    codes = np.rint(np.asarray(q.dequantize()) / scale).astype(np.int64) + top + 1
    assert codes.min() >= 0 and codes.max() <= 2 * top + 1  # every level allowed
    stream = (codes[..., None] >> np.arange(bits)) & 1
    expected = np.packbits(stream.reshape(16, -1).astype(np.uint8), -1, "little")
    np.testing.assert_array_equal(q.packed, expected)


def test_intk_with_4_and_8_bits_and_fp8_storage():
    w = normal((8, 64), seed=4)
    four = IntKWeight.from_array(w, 4, group_size=16)
    int4 = Int4Weight.from_array(w, group_size=16)
    np.testing.assert_array_equal(four.packed, int4.packed)  # the same bytes
    np.testing.assert_array_equal(four.dequantize(), int4.dequantize())
    eight = qax.quant.quantize({"k": w}, IntKWeight, bits=8, group_size=16)["k"]
    assert eight.bits == 8 and eight.packed.dtype == jnp.uint8
    assert eight.packed.nbytes == w.size and eight.scale.shape == (8, 4)
    # group-wise int8: within half a step of its group's scale
    err = np.abs(np.asarray(eight.dequantize() - w))
    assert np.all(err <= np.repeat(np.asarray(eight.scale), 16, -1) / 2 + 1e-7)
    for dtype, name in ((E4M3, "fp8_e4m3"), (E5M2, "fp8_e5m2")):
        q = qax.quant.quantize({"k": w}, name)["k"]
        assert isinstance(q, FP8Weight) and q.q.dtype == dtype
        assert q.q.nbytes == w.size and q.scale.shape == (1, 64)
        largest = float(jnp.finfo(dtype).max)  # absmax maps to the largest code
        np.testing.assert_allclose(
            np.max(np.abs(np.asarray(q.q, np.float32)), 0), largest, rtol=1e-6
        )
    blocks = qax.quant.quantize({"k": w}, "fp8_e5m2", block_size=32)["k"]
    assert blocks.block_size == 32 and blocks.scale.shape == (8, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", EVERY_IDS)
def test_every_format_dot_general_check_handler(name, dtype):
    # check_handler: eager, jit, vmap and grad (every float leaf: x and the scales;
    # the fp8 codes get none, as in `dequantize`) against decode-then-product.
    q = make_new(name, normal((32, 16), dtype=dtype))
    x = normal((3, 32), 1, dtype)
    if dtype == jnp.bfloat16 and name in ("int8", "fp8_e4m3", "fp8_e5m2"):
        # Per-channel scales' gradients sum code * x * cotangent terms with codes up
        # to 127 (int8), 448 or 57344 (fp8); for a random x those sums cancel down to
        # bf16 noise on both sides (each off the float32 value by ~1% of the largest).
        # Rows of x with one nonzero each make every output one code times x.
        x = (
            jnp.zeros_like(x)
            .at[jnp.arange(3), jnp.array([3, 17, 30])]
            .set(jnp.array([1.5, -0.75, 2.0], dtype))
        )
    check_equation(lambda x, w: x @ w, "dot_general", x, q, **tol(dtype))


def jaxpr_dot_operands(fn, *args):
    dot = find_eqn(
        jax.make_jaxpr(qax.use_implicit_args(fn))(*args).jaxpr, "dot_general"
    )
    return [v.aval.dtype for v in dot.invars]


def einsum(spec, weight_first=False):
    if weight_first:
        return lambda x, w: jnp.einsum(spec, w, x)
    return lambda x, w: jnp.einsum(spec, x, w)


# Per-channel weights in every layout: the narrow product where the scales run along
# output axes only (batched heads included), decode-then-product where they do not.
# (name, x shape, w shape, the scales' axes, narrow?, the product)
NARROW_LAYOUTS = [
    ("x@W", (3, 32), (32, 16), -1, True, einsum("bi,io->bo")),
    ("W@x", (32, 2, 5), (32, 16), -1, True, einsum("io,ibc->obc", True)),
    ("heads", (4, 3, 32), (4, 32, 16), (0, 2), True, einsum("hbi,hio->hbo")),
    ("rows", (3, 32), (16, 32, 2), (0, 2), True, einsum("bi,oiz->bzo")),
    ("x@W.T", (3, 16), (32, 16), -1, False, einsum("bo,io->bi")),
]


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8_e4m3"])
@pytest.mark.parametrize("layout", NARROW_LAYOUTS, ids=[c[0] for c in NARROW_LAYOUTS])
def test_per_channel_products_narrow_or_decoded(layout, fp8):
    _, x_shape, w_shape, axis, narrow, fn = layout
    w = normal(w_shape)
    q = (
        FP8Weight.from_array(w, axis=axis)
        if fp8
        else Int8Weight.from_array(w, axis=axis)
    )
    x = normal(x_shape, seed=1)
    check_equation(fn, "dot_general", x, q)
    operands = jaxpr_dot_operands(fn, x, q)
    assert (q.q.dtype in operands) == narrow, operands


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8_e4m3"])
def test_narrow_product_in_the_compiled_program(fp8):
    # A bf16 model: x (bf16) @ w (int8 / fp8 codes, bf16 scales per output unit).
    w = normal((32, 16), dtype=jnp.bfloat16)
    q = FP8Weight.from_array(w) if fp8 else Int8Weight.from_array(w)
    x = normal((3, 32), seed=1, dtype=jnp.bfloat16)
    f = jax.jit(qax.use_implicit_args(lambda x, w: x @ w))
    with strict():
        got = f(x, q)
        # The jaxpr: the product's operand is the codes, and no value of the weight's
        # shape is a float (nothing is decoded; the scales multiply the (3, 16) output).
        assert jaxpr_dot_operands(lambda x, w: x @ w, x, q) == [x.dtype, q.q.dtype]
        jaxpr = jax.make_jaxpr(f)(x, q)
        tpu = f.trace(x, q).lower(lowering_platforms=("tpu",)).as_text()
        cpu = f.lower(x, q).compile().as_text()
    ref = x @ q.dequantize()
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=5e-2
    )
    floats = {
        tuple(v.aval.shape)
        for e in all_eqns(jaxpr.jaxpr)
        for v in e.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.dtype.itemsize > 1
    }
    assert (32, 16) not in floats, floats  # (fp8 codes aside)
    # The program: JAX lowers a dot with operands of two dtypes as it is for TPU, so
    # the TPU program (lowered here without a TPU) multiplies bf16 by the 8-bit codes.
    # For CPU and GPU, JAX's lowering converts both operands to the output dtype
    # first (`_handle_dot_precision` in jax/_src/lax/lax.py: those backends lack mixed
    # dots), so XLA:CPU's compiled program converts the 8-bit parameter for its dot;
    # in both, nothing multiplies the weight by its scales.
    code = "f8E4M3FN" if fp8 else "i8"
    dot = [line for line in tpu.splitlines() if "stablehlo.dot_general" in line]
    assert len(dot) == 1 and f"tensor<32x16x{code}>" in dot[0], dot
    param = "f8e4m3fn[32,16]" if fp8 else "s8[32,16]"
    assert param in cpu.split("ENTRY")[1].splitlines()[0], cpu  # the codes come in
    assert re.search(r"\[3,16\]\S* multiply\(", cpu), cpu  # the scales: on the output
    assert not re.search(r"\[32,16\]\S* multiply\(", cpu), cpu


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2-block", "int3", "int6"])
def test_new_formats_gather_rows(name):
    table = make_new(name, normal((50, 32)))
    ids = jnp.array([[3, 49, 0], [7, 7, 1]])
    fn = lambda w, i: w[i]  # noqa: E731
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(table, ids)
    np.testing.assert_array_equal(got, table.dequantize()[ids])
    eqn = find_eqn(jax.make_jaxpr(fn)(table.dequantize(), ids).jaxpr, "gather")
    report = check_handler("gather", table, ids[..., None], **eqn.params)
    assert not report.materializations


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", EVERY_IDS)
def test_every_format_under_scan_of_stacked_layers(name, dtype):
    # Three layers stacked on a batch axis: `lax.scan` slices the codes and scales
    # (no decoding of the stack), value and gradient (x and the scales) as the oracle.
    ws = jnp.stack([normal((16, 16), seed=i) * 0.3 for i in range(3)]).astype(dtype)
    stacked = make_new(name, ws, batch_ndim=1)
    assert stacked.shape == (3, 16, 16) and stacked.weight_ndim == 2
    x = normal((2, 16), seed=5, dtype=dtype)

    def net(stacked, x):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, stacked)[0]

    def loss(stacked, x):
        return jnp.sum(net(stacked, x).astype(jnp.float32) ** 2)

    field = "absmax" if isinstance(stacked, NF4Weight) else "scale"

    def implicit(scale, x):
        with_scale = dataclasses.replace(stacked, **{field: scale})
        return qax.use_implicit_args(loss)(with_scale, x)

    def oracle(scale, x):  # the decoded stack
        return loss(dataclasses.replace(stacked, **{field: scale}).dequantize(), x)

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1))
    with strict():
        value, (g_scale, g_x) = jax.jit(grad(implicit))(getattr(stacked, field), x)
    want, (d_scale, d_x) = grad(oracle)(getattr(stacked, field), x)
    r = 5e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(float(value), float(want), rtol=r)
    for g, d in ((g_scale, d_scale), (g_x, d_x)):
        g, d = np.asarray(g, np.float32), np.asarray(d, np.float32)
        np.testing.assert_allclose(g, d, rtol=r, atol=r * np.abs(d).max())


@pytest.mark.parametrize(
    "fmt", ["fp8_e4m3", "fp8_e5m2", "int2", "int3", "int5", "int6", "int7"]
)
def test_qlora_over_each_new_format(fmt):
    options = {} if fmt.startswith("fp8") else {"group_size": 32}
    base = qax.quant.quantize(mlp_params(), fmt, **options)
    assert all(isinstance(w, QuantizedWeight) for w in base.values())
    params = qax.lora.loraify(base, 4, key=jax.random.PRNGKey(7), alpha=8.0)
    adapters, frozen = qax.lora.split(params)
    x, y = normal((16, 32), seed=3), normal((16, 32), seed=4)

    def loss(adapters):
        p = qax.lora.combine(adapters, frozen)
        return qax.use_implicit_args(lambda p: jnp.mean((mlp(p, x) - y) ** 2))(p)

    def oracle(adapters):  # every weight materialized: base decoded, plus B A
        p = qax.lora.combine(adapters, frozen)
        p = {k: qax.materialize_nested(w, full=True) for k, w in p.items()}
        return jnp.mean((mlp(p, x) - y) ** 2)

    opt = optax.adam(1e-2)

    @jax.jit
    def step(adapters, opt_state):
        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value, grads

    opt_state = opt.init(adapters)
    with strict():
        losses = []
        for i in range(6):
            if i == 1:  # the gradient of a trained step (B != 0) against the oracle
                want = jax.grad(oracle)(adapters)
            adapters, opt_state, value, grads = step(adapters, opt_state)
            if i == 1:
                for g, d in zip(
                    jax.tree_util.tree_leaves(grads),
                    jax.tree_util.tree_leaves(want),
                    strict=True,
                ):
                    np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-6)
            losses.append(float(value))
    assert losses[-1] < losses[0], losses
    np.testing.assert_allclose(
        float(oracle(adapters)), float(loss(adapters)), rtol=1e-5
    )
    # The base never changed: the same codes and scales as quantized.
    after = qax.lora.combine(adapters, frozen)
    for k in base:
        for a, b in zip(
            jax.tree_util.tree_leaves(after[k].w),
            jax.tree_util.tree_leaves(base[k]),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)


def test_new_format_errors_name_the_fix():
    w = normal((4, 64))
    for bits in (0, 1, 9, 2.5, True, "3"):
        match = rf"bits={re.escape(repr(bits))}; bits must be an integer from 2 to 8"
        with pytest.raises(ValueError, match=match):
            IntKWeight.from_array(w, bits)
    with pytest.raises(ValueError, match="group_size a multiple of 8: each group of 3"):
        IntKWeight.from_array(w, 3, group_size=4)  # 12 bits: no whole bytes
    IntKWeight.from_array(w, 6, group_size=4)  # 24 bits: 3 bytes
    with pytest.raises(ValueError, match="multiple of group_size=48"):
        IntKWeight.from_array(w, 6, group_size=48)
    for dtype in (jnp.int8, "float16", "e4m3"):
        with pytest.raises(
            ValueError, match="is not an FP8 format; use jnp.float8_e4m3fn"
        ):
            FP8Weight.from_array(w, dtype)
    with pytest.raises(ValueError, match="axis= for per-channel .* not both"):
        FP8Weight.from_array(w, axis=0, block_size=16)
    with pytest.raises(ValueError, match="multiple of block_size=24"):
        FP8Weight.from_array(w, block_size=24)
    params = {"k": w}
    for bad in ("int1", "int9", "fp8", "fp8_e4m3fn"):
        with pytest.raises(ValueError, match=f"unknown format '{bad}'.*int2, int3"):
            qax.quant.quantize(params, bad)
    with pytest.raises(ValueError, match="format 'int3' means bits=3, but bits=5"):
        qax.quant.quantize(params, "int3", bits=5)
    with pytest.raises(ValueError, match="'fp8_e5m2' means fp8_dtype=float8_e5m2"):
        qax.quant.quantize(params, "fp8_e5m2", fp8_dtype=E4M3)
    with pytest.raises(ValueError, match="IntKWeight needs bits="):
        qax.quant.quantize(params, IntKWeight)
    with pytest.raises(ValueError, match="format 'int3' means bits=3"):
        qax.quant.quantize(
            params, "int5", rules=[(".*", {"format": "int3", "bits": 5})]
        )
    # What the group cannot hold, the default filter skips, with the warning.
    with pytest.warns(UserWarning, match=r"kept 1 weight.*b \(4, 40\).*group_size="):
        q = qax.quant.quantize({"a": w, "b": normal((4, 40))}, "int3")
    assert isinstance(q["a"], IntKWeight) and not isinstance(q["b"], QuantizedWeight)


def test_quantize_by_name_and_rule_quantize_dequantize_and_frozen_codes():
    params = {
        "attn": {"kernel": normal((32, 64))},
        "mlp": {"kernel": normal((64, 32), 1)},
        "head": {"kernel": normal((32, 48), 2)},
        "proj": {"kernel": normal((64, 48), 3)},
    }
    rules = [
        ("attn/.*", {"format": "fp8_e5m2"}),
        ("proj/.*", {"format": "fp8_e4m3", "block_size": None, "axis": 0}),
        ("head/.*", {"format": "int3", "group_size": 16}),
    ]
    q = qax.quant.quantize(params, "int5", group_size=32, rules=rules)
    attn, mlp_k, head = (q[k]["kernel"] for k in ("attn", "mlp", "head"))
    # fp8 by a rule: the call's block size, under fp8's name for it
    assert isinstance(attn, FP8Weight) and attn.q.dtype == E5M2
    assert attn.block_size == 32 and attn.scale.shape == (32, 2)
    assert isinstance(mlp_k, IntKWeight) and (mlp_k.bits, mlp_k.group_size) == (5, 32)
    proj = q["proj"]["kernel"]  # a rule's own settings win: per channel, along axis 0
    assert isinstance(proj, FP8Weight) and proj.q.dtype == E4M3
    assert proj.block_size is None and proj.scale.shape == (64, 1)
    assert isinstance(head, IntKWeight) and (head.bits, head.group_size) == (3, 16)

    w = params["attn"]["kernel"]
    everything = lambda path, x: True  # noqa: E731
    for fmt, options in (
        ("fp8_e4m3", {"block_size": 16}),
        ("int3", {"group_size": 32}),
        (IntKWeight, {"bits": 8}),
    ):
        got = qax.quant.quantize_dequantize(w, fmt, **options)
        tree = qax.quant.quantize({"w": w}, fmt, filter=everything, **options)
        np.testing.assert_array_equal(got, tree["w"].dequantize())
        assert got.shape == w.shape and got.dtype == w.dtype
    assert set(qax.quant.FORMATS) >= {"int2", "int3", "int5", "int6", "int7"}

    # The codes are frozen: optimizer updates move the scales only (fp8 codes are
    # floats, and would otherwise move).
    ones = jax.tree_util.tree_map(jnp.ones_like, attn)
    moved = qax.utils.apply_updates(attn, ones)
    np.testing.assert_array_equal(moved.q, attn.q)
    np.testing.assert_allclose(moved.scale, attn.scale + 1)
    assert attn.frozen_fields() == ("q",) and head.frozen_fields() == ("packed",)


# ----------------------------------------------------------------------------------------
# `batch_ndim` over a whole model: the unstacked weights beside the stack (issue 42, 2)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "nf4"])
def test_batch_ndim_over_a_whole_model_quantizes_the_head_as_one_weight(fmt):
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "layers": {"kernel": jax.random.normal(keys[0], (3, 32, 64))},
        "head": {"kernel": jax.random.normal(keys[1], (64, 32))},
    }
    options = {"block_size": 32} if fmt == "nf4" else {}
    whole = qax.quant.quantize(params, fmt, batch_ndim=1, **options)
    alone = qax.quant.quantize(params["head"], fmt, **options)
    head = whole["head"]["kernel"]
    assert qax.utils.batch_ndim(head) == 0
    assert head.nbytes < params["head"]["kernel"].nbytes / 2
    assert jax.tree.structure(head) == jax.tree.structure(alone["kernel"])
    for got, want in zip(jax.tree.leaves(head), jax.tree.leaves(alone["kernel"])):
        np.testing.assert_array_equal(got, want)
    assert qax.utils.batch_ndim(whole["layers"]["kernel"]) == 1


# ----------------------------------------------------------------------------------------
# The steps in the other order: `quantize(loraify(params))` (issue 42, item 8)


@pytest.mark.parametrize("stacked", [False, True], ids=["one", "stack"])
def test_quantize_after_loraify_quantizes_the_bases(stacked):
    lead = (3,) if stacked else ()
    params = {"fc": {"kernel": normal((*lead, 32, 64)), "bias": normal((*lead, 64))}}
    nb = len(lead)
    lora = qax.lora.loraify(params, 2, key=jax.random.key(0), batch_ndim=nb)
    got = qax.quant.quantize(lora, "nf4", block_size=32, batch_ndim=nb)
    want = qax.lora.loraify(
        qax.quant.quantize(params, "nf4", block_size=32, batch_ndim=nb),
        2,
        key=jax.random.key(0),
        batch_ndim=nb,
    )
    kernel = got["fc"]["kernel"]
    assert isinstance(kernel, LoraWeight) and isinstance(kernel.w, NF4Weight)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    # The factors are the ones loraify made.
    assert kernel.a is lora["fc"]["kernel"].a and kernel.b is lora["fc"]["kernel"].b


def test_a_rule_setting_batch_ndim_keeps_stacked_vectors_dense():
    """Issue 42: a rule that sets `batch_ndim` for a stack of layers matches the stacked
    biases too; each is a stack of vectors, kept dense (not one 2-D weight)."""
    params = {
        "layers": {"kernel": normal((3, 32, 64)), "bias": normal((3, 64), seed=1)},
        "head": {"kernel": normal((64, 32), seed=2)},
    }
    q = qax.quant.quantize(params, "int8", rules=[("layers/.*", {"batch_ndim": 1})])
    assert qax.utils.batch_ndim(q["layers"]["kernel"]) == 1
    assert q["layers"]["bias"] is params["layers"]["bias"]
    assert isinstance(q["head"]["kernel"], Int8Weight)


# ----------------------------------------------------------------------------------------
# The default selection skips biases by the tree's structure; `plan` reports it; a rule
# that decides no weight is reported; errors name the weight (issue 36, items 2, 4, 6)


def test_quantize_keeps_biases_named_b_beside_a_kernel_and_plan_reports_it():
    params = {
        "a_gate": {"w": normal((2, 64, 64), seed=1), "b": normal((2, 64), seed=2)},
        "mlp": {"w": normal((64, 96), seed=3), "b": normal((96,), seed=4)},
        "head": {"kernel": normal((64, 40), seed=5)},  # 40: no block of 64 fits
        "patch_embedding": {"kernel": normal((2, 2, 3, 64), seed=6)},
    }
    with pytest.warns(UserWarning, match="head/kernel"):
        q = qax.quant.quantize(params, "nf4", block_size=32)
    assert q["a_gate"]["b"] is params["a_gate"]["b"]
    assert isinstance(q["a_gate"]["w"], NF4Weight)
    assert isinstance(q["patch_embedding"]["kernel"], NF4Weight)
    plan = qax.quant.plan(params, "nf4", block_size=32)
    quantized = {
        qax.utils.path_string(p)
        for p, x in qax.utils.tree_flatten_with_path_with_implicit(q)[0]
        if isinstance(x, QuantizedWeight)
    }
    assert {row.path for row in plan.chosen} == quantized  # the oracle: quantize
    rows = {row.path: row for row in plan.rows}
    assert rows["a_gate/b"].why == "bias"
    assert rows["head/kernel"].why == (
        "the last axis (40) is not a multiple of the block size 32"
    )
    assert rows["mlp/w"].detail == "NF4Weight, block_size=32"
    text = str(plan)
    assert "NF4Weight" in text and "a_gate/b" in text and "(2, 64)" in text
    ruled = qax.quant.plan(params, "nf4", rules=[("head/.*", {"format": "int8"})])
    assert {r.path: r for r in ruled.rows}["head/kernel"].detail == "Int8Weight"


def test_quantize_with_a_filter_names_the_weight_the_format_cannot_hold():
    params = {"blocks": {"kernel": normal((8, 30))}}
    with pytest.raises(ValueError, match="quantize, the weight at 'blocks/kernel'"):
        qax.quant.quantize(params, "nf4", filter=lambda path, x: True)


def test_quantize_reports_a_rule_that_decides_no_weight():
    params = {"layer_0": {"attn": {"q_einsum": {"w": normal((2, 8, 64))}}}}
    rules = [("q_einsum", {"format": "int8"})]
    with pytest.warns(UserWarning, match="'q_einsum' matched no weight") as caught:
        q = qax.quant.quantize(params, "nf4", rules=rules)
    assert caught[0].filename == __file__
    assert "layer_0/attn/q_einsum/w" in str(caught[0].message)
    assert isinstance(q["layer_0"]["attn"]["q_einsum"]["w"], NF4Weight)  # not int8
    with pytest.raises(ValueError, match="quantize: the rule 'q_einsum'"):
        qax.quant.quantize(params, "nf4", rules=rules, strict_rules=True)
