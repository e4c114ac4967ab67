"""`qax.qat`: fake quantization against the quantized oracle, straight-through
gradients, handlers under transformations, trees, and a QAT run that beats PTQ."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax
from qax.qat import FakeQuant, convert, fake_quantize
from qax.testing import check_handler
from tests.helpers import all_eqns, check_equation, find_eqn

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

# Every format name `qax.quant.quantize` may accept; those it does not (yet) accept in
# this build are skipped, so new formats are covered as soon as they exist.
CANDIDATES = ["int8", "int4", "nf4", "fp8_e4m3", "fp8_e5m2"] + [
    f"int{k}" for k in range(2, 8) if k != 4
]
CANDIDATES += ["nf4_dq", "mxfp4", "nvfp4"]


def _accepted(fmt):
    try:
        qax.quant.quantize(
            {"w": jnp.ones((2, 64))}, fmt, filter=lambda path, leaf: True
        )
    except ValueError:
        return False
    return True


FORMATS = [f for f in CANDIDATES if _accepted(f)]
DTYPES = [pytest.param(jnp.float32, id="f32"), pytest.param(jnp.bfloat16, id="bf16")]
# Every format in f32; in bf16, one of each kind (per-channel int8, block NF4, float8,
# packed k-bit). A FakeQuant computes through its format's quantized type, whose own
# handlers tests/test_quant.py checks in every format and both dtypes; this keeps the
# suite's time in bounds.
BF16_FORMATS = {"int8", "nf4", "fp8_e4m3", "int3"}
FORMAT_DTYPES = [
    pytest.param(fmt, dtype, id=f"{fmt}-{name}")
    for fmt in FORMATS
    for name, dtype in (("f32", jnp.float32), ("bf16", jnp.bfloat16))
    if name == "f32" or fmt in BF16_FORMATS
]


def test_the_core_formats_are_covered():
    assert {"int8", "int4", "nf4"} <= set(FORMATS)


def normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


def strict():
    """Any fallback materialization of a `FakeQuant` is an error in this block."""
    return qax.materialization_policy(FakeQuant, "error")


def image(fq):
    """The oracle: the weight `qax.quant.quantize` gives, decoded."""
    return fq.quantized().dequantize()


# ----------------------------------------------------------------------------------------
# The value: bitwise the decoded quantized weight


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("clip", [1.0, 0.75], ids=["noclip", "clip0.75"])
def test_forward_is_the_decoded_quantized_weight_bitwise(fmt, clip):
    w = normal((32, 64))
    fq = FakeQuant.from_array(w, fmt, clip_ratio=clip)
    plain = qax.quant.quantize({"w": w}, fmt, filter=lambda path, leaf: True)["w"]
    if clip == 1.0:  # no clipping: exactly `qax.quant.quantize` of the weight
        assert type(fq.quantized()) is type(plain)
        for a, b in zip(jax.tree.leaves(fq.quantized()), jax.tree.leaves(plain)):
            np.testing.assert_array_equal(a, b)
    want = image(fq)
    np.testing.assert_array_equal(fq.materialize(), want)
    np.testing.assert_array_equal(jax.jit(lambda f: f.materialize())(fq), want)
    # A product computes as the deployed quantized weight computes it (int8 on its
    # codes, the scales applied to the output), bitwise.
    x = normal((5, 32), seed=1)
    product = jax.jit(qax.use_implicit_args(lambda x, w: x @ w))
    with strict():
        got = product(x, fq)
    np.testing.assert_array_equal(got, product(x, fq.quantized()))
    np.testing.assert_allclose(got, x @ want, rtol=1e-5, atol=1e-5)


def test_clipping_is_per_channel_or_block_of_the_format():
    w = normal((32, 64))
    # int8 scales the last axis (one scale per column): clip each column.
    fq = FakeQuant.from_array(w, "int8", clip_ratio=0.5)
    limit = 0.5 * np.abs(np.asarray(w)).max(axis=0, keepdims=True)
    np.testing.assert_array_equal(fq.in_range(), np.abs(w) <= limit)
    np.testing.assert_array_equal(
        image(fq), image(FakeQuant.from_array(jnp.clip(w, -limit, limit), "int8"))
    )
    # int4 scales blocks of 16 along the last axis.
    fq = FakeQuant.from_array(w, "int4", clip_ratio=0.5, group_size=16)
    blocks = np.abs(np.asarray(w)).reshape(32, 4, 16).max(-1, keepdims=True)
    limit = np.broadcast_to(0.5 * blocks, (32, 4, 16)).reshape(32, 64)
    np.testing.assert_array_equal(fq.in_range(), np.abs(w) <= limit)
    assert 0 < fq.in_range().mean() < 1


# ----------------------------------------------------------------------------------------
# Straight-through gradients


@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES)
def test_straight_through_gradient(fmt, dtype):
    w = normal((32, 64), dtype=dtype)
    cot = normal((32, 64), seed=3, dtype=dtype)

    def grad(clip):
        def loss(w):
            fq = FakeQuant.from_array(w, fmt, clip_ratio=clip)
            out = qax.use_implicit_args(lambda f: f * 1.0)(fq)
            return jnp.sum(out.astype(jnp.float32) * cot.astype(jnp.float32))

        return jax.jit(jax.grad(loss))(w)

    # No clipping: the identity everywhere.
    np.testing.assert_array_equal(grad(1.0), cot)
    # Clipped values get none; the others the identity.
    mask = FakeQuant.from_array(w, fmt, clip_ratio=0.6).in_range()
    assert 0 < float(jnp.mean(mask)) < 1
    np.testing.assert_array_equal(grad(0.6), jnp.where(mask, cot, 0))


def test_forward_mode_is_straight_through_too():
    w = normal((16, 64))
    t = normal((16, 64), seed=2)
    fn = lambda w: FakeQuant.from_array(w, "int4", clip_ratio=0.7).materialize()  # noqa: E731
    out, tan = jax.jvp(fn, (w,), (t,))
    mask = FakeQuant.from_array(w, "int4", clip_ratio=0.7).in_range()
    np.testing.assert_array_equal(out, fn(w))
    np.testing.assert_array_equal(tan, jnp.where(mask, t, 0))


# ----------------------------------------------------------------------------------------
# Handlers against "materialize, then run the primitive"


def check(fn, name, *args, **tol):
    """`check_equation`, every transformation run and passed."""
    report = check_equation(fn, name, *args, **tol)
    checks = dict(report.checks)
    assert {"eager", "jit", "vmap", "grad"} <= set(checks)
    assert set(checks.values()) == {"passed"}, checks
    return report


def conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def bf16_tolerance(dtype):
    # bf16: gradients of a bf16 product summed in different orders.
    return {"rtol": 5e-2, "atol": 5e-1} if dtype == jnp.bfloat16 else {}


# The handlers run the primitive on the image, whatever the format: every primitive is
# checked on int8, the products (what differs per format is the image) on every format.
def check_gather(fq, **tol):
    ids = jnp.array([[3, 31, 0], [7, 7, 1]])
    dense = fq.materialize()
    eqn = find_eqn(jax.make_jaxpr(lambda w, i: w[i])(dense, ids).jaxpr, "gather")
    report = check_handler("gather", fq, ids[..., None], **eqn.params, **tol)
    assert not report.materializations


def check_convert(fq, **tol):
    other = jnp.float32 if fq.dtype == jnp.bfloat16 else jnp.bfloat16
    check(lambda w: w.astype(other), "convert_element_type", fq, rtol=5e-2, atol=5e-1)


def check_conv(fq, **tol):
    kernel = FakeQuant.from_array(normal((2, 2, 4, 64), dtype=fq.dtype), fq.fmt)
    images = normal((1, 3, 3, 4), seed=4, dtype=fq.dtype)
    check(conv, "conv_general_dilated", images, kernel, **tol)


HANDLER_CHECKS = {
    "W@x": lambda fq, **tol: check(
        lambda w, y: w @ y, "dot_general", fq, normal((64, 5), 2, fq.dtype), **tol
    ),
    "gather": check_gather,
    "convert": check_convert,
    "transpose": lambda fq, **tol: check(lambda w: w.T, "transpose", fq, **tol),
    "conv": check_conv,
}


@pytest.mark.parametrize("name", list(HANDLER_CHECKS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_handlers_pass_check_handler(name, dtype):
    fq = FakeQuant.from_array(normal((32, 64), dtype=dtype), "int8")
    HANDLER_CHECKS[name](fq, **bf16_tolerance(dtype))


@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES)
def test_products_pass_check_handler_in_every_format(fmt, dtype):
    fq = FakeQuant.from_array(normal((32, 64), dtype=dtype), fmt)
    x = normal((3, 32), seed=1, dtype=dtype)
    check(lambda x, w: x @ w, "dot_general", x, fq, **bf16_tolerance(dtype))


def test_convert_keeps_a_fake_quant_decoding_in_the_new_dtype():
    # The codes come from the float32 weight; a bf16 cast decodes them in bf16, as the
    # deployed quantized weight cast to bf16 does.
    fq = FakeQuant.from_array(normal((32, 64)), "int4", group_size=16)
    with strict():
        cast = qax.use_implicit_args(lambda w: w.astype(jnp.bfloat16))(fq)
        deployed = qax.use_implicit_args(lambda w: w.astype(jnp.bfloat16))(
            fq.quantized()
        )
    assert isinstance(cast, FakeQuant) and cast.dtype == jnp.bfloat16
    assert cast.w.dtype == jnp.float32
    np.testing.assert_array_equal(cast.materialize(), deployed.dequantize())


def test_other_primitives_use_the_image_without_warnings():
    fq = FakeQuant.from_array(normal((16, 64)), "nf4")
    fn = lambda w: jnp.tanh(w * 2.0 + 1.0).sum(axis=0) + w[3]  # noqa: E731
    with strict():
        got = jax.jit(qax.use_implicit_args(fn))(fq)
    np.testing.assert_allclose(got, fn(image(fq)), rtol=1e-6, atol=1e-6)


def test_the_program_fake_quantizes_the_weight():
    fq = FakeQuant.from_array(normal((32, 64)), "int8")
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda x, w: x @ w))(
        normal((2, 32)), fq
    )
    names = {e.primitive.name for e in all_eqns(jaxpr.jaxpr)}
    assert "round" in names  # the quantize-dequantize is traced into the program
    dot = find_eqn(jaxpr.jaxpr, "dot_general")
    assert [tuple(v.aval.shape) for v in dot.invars] == [(2, 32), (32, 64)]


# ----------------------------------------------------------------------------------------
# Models under jit, grad, vmap, scan; f32 and bf16


def mlp(params, x, dtype):
    # tanh, not relu: a bf16 oracle must not flip the derivative at a kink.
    p = {k: v.astype(dtype) for k, v in params.items()}
    return jnp.tanh(x @ p["w1"]) @ p["w2"]


# Per channel (int8: a product on the codes) and per block (nf4); the products of
# every format pass `check_handler` (eager, jit, vmap, grad) above, and `scan` in every
# format below.
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_under_jit_grad_vmap_scan(dtype):
    raw = {"w1": normal((32, 64), 0), "w2": normal((64, 64), 1) * 0.1}
    params = fake_quantize(raw, "int8", rules=[("w2", {"format": "nf4"})])
    assert params["w1"].fmt == "int8" and params["w2"].fmt == "nf4"
    deployed = convert(params)
    xs = normal((3, 4, 32), seed=9, dtype=dtype)

    def scanned(params, xs):
        return lax.scan(lambda c, x: (c, mlp(params, x, dtype)), 0.0, xs)[1]

    def loss(params, x):
        return jnp.sum(jnp.sin(mlp(params, x, dtype).astype(jnp.float32)))

    run = qax.use_implicit_args
    with strict():
        got = {
            "jit": jax.jit(run(mlp), static_argnums=2)(params, xs[0], dtype),
            "vmap": jax.vmap(run(mlp), (None, 0, None))(params, xs, dtype),
            "scan": jax.jit(run(scanned))(params, xs),
            "grad": jax.jit(jax.grad(run(loss)))(params, xs[0]),
        }
        # The deployed quantized model computes the same forward pass, bitwise.
        want_jit = jax.jit(run(mlp), static_argnums=2)(deployed, xs[0], dtype)
    np.testing.assert_array_equal(got["jit"], want_jit)
    dense = {k: image(v) for k, v in params.items()}
    want = {
        "jit": mlp(dense, xs[0], dtype),
        "vmap": jax.vmap(mlp, (None, 0, None))(dense, xs, dtype),
        "scan": scanned(dense, xs),
        # Straight-through (nothing clipped): the gradient at the image.
        "grad": jax.grad(loss)(dense, xs[0]),
    }
    rel = 3e-2 if dtype == jnp.bfloat16 else 1e-5
    for k in want:
        for g, w in zip(jax.tree.leaves(got[k]), jax.tree.leaves(want[k])):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            np.testing.assert_allclose(
                g, w, rtol=rel, atol=rel * np.abs(w).max(), err_msg=k
            )
    assert got["grad"]["w1"].w.shape == (32, 64)  # a gradient for the float weight


@pytest.mark.parametrize("fmt, dtype", FORMAT_DTYPES)
def test_scan_and_its_gradient_in_every_format(fmt, dtype):
    fq = FakeQuant.from_array(normal((64, 64), dtype=dtype) * 0.2, fmt)
    xs = normal((3, 2, 64), seed=5, dtype=dtype)

    def loss(w, xs):
        def body(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h

        ys = lax.scan(body, jnp.zeros((2, 64), dtype), xs)[1]
        return jnp.sum(ys.astype(jnp.float32))

    with strict():
        value, grad = jax.jit(jax.value_and_grad(qax.use_implicit_args(loss)))(fq, xs)
    want, want_grad = jax.value_and_grad(loss)(image(fq), xs)
    rel = 3e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(value, want, rtol=rel)
    scale = float(jnp.abs(want_grad.astype(jnp.float32)).max())
    np.testing.assert_allclose(
        np.asarray(grad.w, np.float32),
        np.asarray(want_grad, np.float32),
        rtol=rel,
        atol=rel * scale,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_stacked_layers_scan_each_with_its_own_scales(dtype):
    layers = normal((3, 64, 64), dtype=dtype) * 0.2
    fq = fake_quantize({"w": layers}, "int4", group_size=32, batch_ndim=1)["w"]
    assert fq.weight_ndim == 2 and fq.batch_ndim == 1
    per_layer = jnp.stack(
        [image(FakeQuant.from_array(w, "int4", group_size=32)) for w in layers]
    )
    np.testing.assert_array_equal(image(fq), per_layer)
    x = normal((4, 64), seed=5, dtype=dtype)

    def body(h, w):
        return jnp.tanh(h @ w), None

    def net(ws, x):
        return jnp.sum(lax.scan(body, x, ws)[0].astype(jnp.float32))

    with strict():
        got, grads = jax.jit(jax.value_and_grad(qax.use_implicit_args(net)))(fq, x)
    rel = 3e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, net(per_layer, x), rtol=rel)
    want = jax.grad(net)(per_layer, x)
    np.testing.assert_allclose(
        np.asarray(grads.w, np.float32),
        np.asarray(want, np.float32),
        rtol=rel,
        atol=rel * float(jnp.abs(want.astype(jnp.float32)).max()),
    )


def test_activation_fake_quantization():
    w = normal((32, 64))
    fq = FakeQuant.from_array(w, "int8", activation_bits=8)
    x = normal((4, 32), seed=1)
    scale = jnp.max(jnp.abs(x)) / 127
    x_q = jnp.clip(jnp.round(x / scale), -127, 127) * scale
    with strict():
        got = jax.jit(qax.use_implicit_args(lambda x, w: x @ w))(x, fq)
        got_t = qax.use_implicit_args(lambda w, y: w @ y)(fq, normal((64, 2)))
        product = qax.use_implicit_args(lambda x, w: x @ w)
        gx = jax.grad(lambda x: jnp.sum(product(x, fq)))(x)
    np.testing.assert_allclose(got, x_q @ image(fq), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, x @ image(fq), rtol=1e-5, atol=1e-5)
    assert got_t.shape == (32, 2)
    # Straight-through for the activations as well.
    np.testing.assert_allclose(gx, jnp.ones((4, 64)) @ image(fq).T, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Trees: the same choice as `qax.quant.quantize`, and the way back


def tree():
    return {
        "embed": {"embedding": normal((100, 64), 0)},
        "attn": {"kernel": normal((64, 64), 1), "bias": normal((64,), 2)},
        "mlp": {"kernel": normal((64, 128), 3)},
        "head": {"kernel": normal((64, 10), 4)},
        "norm": {"scale": jnp.ones(64)},
    }


def assert_same_quantized(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "kwargs, warns",
    [
        pytest.param({"fmt": "int8"}, False, id="int8"),
        pytest.param({"fmt": "nf4", "block_size": 32}, True, id="nf4-block32"),
        pytest.param(
            {
                "fmt": "int4",
                "group_size": 32,
                "rules": [
                    (".*attn.*", {"format": "int8"}),
                    (".*mlp.*", {"format": "nf4"}),
                    (".*head.*", None),
                ],
            },
            False,
            id="rules",
        ),
        pytest.param(
            {"fmt": "int8", "filter": lambda path, leaf: "mlp" in path},
            False,
            id="filter",
        ),
        pytest.param(
            {"fmt": "int4", "group_size": 16, "batch_ndim": lambda path, leaf: 0},
            True,
            id="batch_ndim-function",
        ),
    ],
)
def test_convert_of_fake_quantize_is_quantize(kwargs, warns):
    kwargs = dict(kwargs)
    fmt = kwargs.pop("fmt")
    expect = pytest.warns(UserWarning) if warns else contextlib.nullcontext()
    with expect:
        want = qax.quant.quantize(tree(), fmt, **kwargs)
    expect = pytest.warns(UserWarning) if warns else contextlib.nullcontext()
    with expect:
        qat = fake_quantize(tree(), fmt, **kwargs)
    leaves = jax.tree.leaves(qat, is_leaf=lambda x: isinstance(x, FakeQuant))
    assert any(isinstance(x, FakeQuant) for x in leaves)
    assert_same_quantized(convert(qat), want)


def test_head_skipped_with_a_warning_naming_it():
    with pytest.warns(UserWarning, match=r"head/kernel \(64, 10\)"):
        qat = fake_quantize(tree(), "int4", group_size=32)
    assert not isinstance(qat["head"]["kernel"], FakeQuant)
    assert isinstance(qat["mlp"]["kernel"], FakeQuant)
    assert not isinstance(qat["norm"]["scale"], FakeQuant)
    assert not isinstance(qat["embed"]["embedding"], FakeQuant)


def test_rules_set_clip_ratio_and_activation_bits():
    qat = fake_quantize(
        tree(),
        "int8",
        clip_ratio=0.9,
        rules=[(".*mlp.*", {"clip_ratio": 0.5, "activation_bits": 8})],
    )
    assert qat["attn"]["kernel"].clip_ratio == 0.9
    assert qat["mlp"]["kernel"].clip_ratio == 0.5
    assert qat["mlp"]["kernel"].activation_bits == 8
    assert qat["attn"]["kernel"].activation_bits is None


def test_bad_input_errors_name_the_fix():
    w = normal((32, 64))
    with pytest.raises(ValueError, match="unknown format 'int9'"):
        FakeQuant.from_array(w, "int9")
    with pytest.raises(ValueError, match="block size that divides"):
        FakeQuant.from_array(normal((32, 60)), "int4", group_size=32)
    with pytest.raises(ValueError, match=r"clip_ratio=1.5 is outside \(0, 1\]"):
        FakeQuant.from_array(w, "int8", clip_ratio=1.5)
    with pytest.raises(ValueError, match="activation_bits must be None"):
        FakeQuant.from_array(w, "int8", activation_bits=1)
    with pytest.raises(ValueError, match="floating-point weight"):
        FakeQuant.from_array(jnp.ones((4, 4), jnp.int32), "int8")
    with pytest.raises(ValueError, match="batch_ndim=3"):
        FakeQuant.from_array(w, "int8", batch_ndim=3)
    with pytest.raises(ValueError, match="unknown format"):
        fake_quantize(tree(), "int9")
    with pytest.raises(ValueError, match="fake_quantize"):
        fake_quantize(tree(), "int8", rules=[(".*", {"rank": 3})])


# ----------------------------------------------------------------------------------------
# Training: QAT recovers what post-training quantization loses


def test_qat_beats_post_training_quantization_and_converts_exactly():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k1, (256, 16))
    y = jnp.tanh(x @ jax.random.normal(k2, (16, 32))) @ jax.random.normal(k3, (32, 4))
    y = y / jnp.std(y)
    params = {
        "w1": jax.random.normal(k4, (16, 64)) / 4,
        "w2": jax.random.normal(jax.random.fold_in(k4, 1), (64, 4)) / 8,
    }

    def model(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    def loss(p):
        return jnp.mean((qax.use_implicit_args(model)(p, x) - y) ** 2)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def train(p, steps, lr):
        opt = optax.adam(optax.cosine_decay_schedule(lr, steps))

        def step(i, carry):
            p, s = carry
            u, s = opt.update(jax.grad(loss)(p), s, p)
            return optax.apply_updates(p, u), s

        return lax.fori_loop(0, steps, step, (p, opt.init(p)))[0]

    run = jax.jit(qax.use_implicit_args(model))
    dense = train(params, 1000, 1e-2)
    # int4 in blocks of 16; the head's last axis of 4 gets int8 by a rule.
    settings = dict(
        group_size=16,
        filter=lambda path, leaf: True,
        rules=[("w2", {"format": "int8"})],
    )
    ptq_out = run(qax.quant.quantize(dense, "int4", **settings), x)
    qat = train(fake_quantize(dense, "int4", **settings), 50, 1e-3)
    assert isinstance(qat["w1"], FakeQuant) and qat["w2"].fmt == "int8"
    deployed = convert(qat)
    assert isinstance(deployed["w1"], qax.quant.Int4Weight)
    qat_out = run(deployed, x)
    ptq_loss = float(jnp.mean((ptq_out - y) ** 2))
    qat_loss = float(jnp.mean((qat_out - y) ** 2))
    assert qat_loss < 0.7 * ptq_loss, (qat_loss, ptq_loss)
    # The deployed model computes exactly the trained forward pass.
    np.testing.assert_array_equal(qat_out, run(qat, x))


def test_convert_reaches_fake_quant_inside_other_implicit_arrays():
    fq = FakeQuant.from_array(normal((32, 64)), "int8")
    a, b = normal((32, 4), seed=1), normal((4, 64), seed=2)
    tree = {"lora": qax.lora.LoraWeight(fq, a, b), "plain": fq}
    out = convert(tree)
    assert isinstance(out["lora"].w, qax.quant.Int8Weight)
    assert isinstance(out["plain"], qax.quant.Int8Weight)
    x = normal((3, 32), seed=3)
    run = jax.jit(qax.use_implicit_args(lambda x, w: x @ w))
    with strict():
        np.testing.assert_array_equal(run(x, out["lora"]), run(x, tree["lora"]))


def test_quantize_takes_the_codes_of_a_fake_quant():
    qat = fake_quantize(tree(), "int8", clip_ratio=0.8)
    got = qax.quant.quantize(qat, "int8")
    assert not isinstance(got["attn"]["kernel"], FakeQuant)
    assert_same_quantized(got, convert(qat))
    # The leaf's own format wins (the codes it was trained against), and a FakeQuant
    # under a LoRA adapter becomes the quantized base of a QLoRA weight.
    assert_same_quantized(qax.quant.quantize(qat, "nf4"), convert(qat))
    lora = qax.lora.loraify(qat, 2, key=jax.random.key(0))
    qlora = qax.quant.quantize(lora, "nf4")
    kernel = qlora["attn"]["kernel"]
    assert isinstance(kernel, qax.lora.LoraWeight)
    assert isinstance(kernel.w, qax.quant.Int8Weight)
    np.testing.assert_array_equal(kernel.w.q, convert(qat)["attn"]["kernel"].q)


def test_fake_quantize_reports_a_rule_that_decides_no_weight_and_skips_biases():
    params = {
        "q_einsum": {"w": normal((2, 8, 64), 1), "b": normal((2, 64), 2)},
    }
    rules = [("q_einsum", {"clip_ratio": 0.9})]
    with pytest.warns(UserWarning, match="'q_einsum' matched no weight") as caught:
        qat = fake_quantize(params, "int8", rules=rules)
    assert caught[0].filename == __file__
    assert "q_einsum/w" in str(caught[0].message)
    assert isinstance(qat["q_einsum"]["w"], FakeQuant)
    assert qat["q_einsum"]["b"] is params["q_einsum"]["b"]  # a bias (issue 36)
    with pytest.raises(ValueError, match="fake_quantize: the rule 'q_einsum'"):
        fake_quantize(params, "int8", rules=rules, strict_rules=True)
