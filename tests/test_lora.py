"""`qax.lora`: every handler against the materialized oracle, the tree helpers, training."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax
from qax.lora import LoraAdapter, LoraWeight
from qax.testing import check_handler


def make_lora_weight(
    shape, split_at=None, rank=3, dtype=jnp.float32, seed=0, freeze_w=False
):
    """A LoraWeight with random (non-zero) factors, so the low-rank part matters."""
    p = len(shape) - 1 if split_at is None else split_at
    kw, ka, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    w = jax.random.normal(kw, shape).astype(dtype)
    a = (0.5 * jax.random.normal(ka, (*shape[:p], rank))).astype(dtype)
    b = (0.5 * jax.random.normal(kb, (rank, *shape[p:]))).astype(dtype)
    return LoraWeight(w, a, b, alpha=2.0 * rank, freeze_w=freeze_w)


def normal(shape, dtype=jnp.float32, seed=1):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


def find_eqn(jaxpr, name):
    """The first equation of primitive `name`, searching nested jaxprs too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = find_eqn(sub, name)
            if found is not None:
                return found
    return None


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def check_primitive(fn, name, *args, **tol):
    """`check_handler` for the `name` equation that `fn` produces on dense inputs.

    The parameters are taken from the jaxpr of `fn` on the materialized arguments, so
    they are exactly those the handler receives.
    """
    dense = [a.materialize() if isinstance(a, LoraWeight) else a for a in args]
    eqn = find_eqn(jax.make_jaxpr(fn)(*dense).jaxpr, name)
    assert eqn is not None, f"{fn} binds no {name}"
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    if shapes == [tuple(jnp.shape(a)) for a in args[::-1]]:
        args = args[::-1]  # the weight is the left operand (W @ x)
    assert shapes == [tuple(jnp.shape(a)) for a in args], (shapes, eqn)
    low = any(jnp.result_type(a) == jnp.bfloat16 for a in args)
    # bf16 keeps 8 bits of mantissa: sums of products in another order differ by a few
    # units in the last place, relative to the largest term.
    if low and not tol:
        tol = dict(rtol=5e-2, atol=2e-1)
    return check_handler(name, *args, **eqn.params, **tol)


def assert_no_dense_weight(fn, *args, shape):
    """Nothing the size of the weight is computed: no product has the weight's shape,
    and nothing is materialized."""
    with qax.materialization_policy(LoraWeight, "error"):
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(fn))(*args)
    for eqn in all_eqns(jaxpr.jaxpr):
        if eqn.primitive.name in ("dot_general", "add"):
            for v in eqn.outvars:
                assert tuple(v.aval.shape) != tuple(shape), (
                    f"{eqn.primitive.name} builds a {shape} array:\n{eqn}"
                )


# ----------------------------------------------------------------------------------------
# dot_general in every layout

# (name, weight shape, split_at, x shape, function of (x, w))
DOT_CASES = [
    ("x@W", (6, 5), 1, (4, 6), lambda x, w: x @ w),
    # (x @ W.T, contracting with b first, is checked by
    # test_the_handler_contracts_x_with_the_matching_factor_first and
    # test_composed_layouts_stay_implicit; batch-on-a-contract-b has its gradients.)
    ("W@x", (5, 6), 1, (6, 4), lambda x, w: w @ x),
    ("vec@W", (6, 5), 1, (6,), lambda x, w: x @ w),
    (
        "q-proj",
        (8, 2, 4),
        1,
        (2, 3, 8),
        lambda x, w: jnp.einsum("btd,dhk->bthk", x, w),
    ),
    (
        "out-proj",
        (2, 4, 8),
        2,
        (2, 3, 2, 4),
        lambda x, w: jnp.einsum("bthk,hkd->btd", x, w),
    ),
    (
        "batch-on-a-contract-b",
        (3, 6, 5),
        1,
        (3, 4, 6),
        lambda x, w: jnp.einsum("hbi,hio->hbo", x, w),
    ),
    (
        "batch-on-b",
        (6, 3, 5),
        1,
        (3, 4, 6),
        lambda x, w: jnp.einsum("hbi,iho->boh", x, w),
    ),
]


def _with_dtypes(cases, bf16_names):
    """Every case in f32; the named ones in bf16 too (each check runs five traces, so
    bf16, which only changes the casts in the handler, gets one representative)."""
    out = [pytest.param(*c, jnp.float32, id=f"{c[0]}-f32") for c in cases]
    out += [
        pytest.param(*c, jnp.bfloat16, id=f"{c[0]}-bf16")
        for c in cases
        if c[0] in bf16_names
    ]
    return out


@pytest.mark.parametrize(
    "name, shape, split_at, x_shape, fn, dtype",
    _with_dtypes(DOT_CASES, {"q-proj"}),
)
def test_dot_general_layouts(name, shape, split_at, x_shape, fn, dtype):
    lora = make_lora_weight(shape, split_at, dtype=dtype)
    x = normal(x_shape, dtype)
    report = check_primitive(fn, "dot_general", x, lora)
    assert dict(report.checks) == {
        "eager": "passed",
        "jit": "passed",
        "vmap": "passed",
        "grad": "passed",
    }
    assert not report.materializations
    assert_no_dense_weight(fn, x, lora, shape=shape)


def test_preferred_element_type_f32_over_bf16():
    lora = make_lora_weight((6, 5), dtype=jnp.bfloat16)
    x = normal((4, 6), jnp.bfloat16)

    def fn(x, w):
        return lax.dot_general(
            x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    report = check_primitive(fn, "dot_general", x, lora)
    assert report.checks[0] == ("eager", "passed")


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w: x @ w.T,
        lambda x, w: (w @ x.T).T,
        lambda x, w: jnp.dot(x, w.T.astype(jnp.bfloat16).astype(jnp.float32)),
    ],
    ids=["x@W.T", "W@x.T", "cast-roundtrip"],
)
def test_composed_layouts_stay_implicit(fn):
    lora = make_lora_weight((5, 6), 1)
    x = normal((4, 6))
    want = fn(x, lora.materialize())
    with qax.materialization_policy(LoraWeight, "error"):
        got = jax.jit(qax.use_implicit_args(fn))(x, lora)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=5e-2)
    assert_no_dense_weight(fn, x, lora, shape=(5, 6))
    assert_no_dense_weight(fn, x, lora, shape=(6, 5))


def test_the_handler_contracts_x_with_the_matching_factor_first():
    """x @ W.T with W (out, in): x contracts with b's axis, so x·b comes first and every
    intermediate has the rank axis (no (batch, in) x (in, out) dense detour)."""
    lora = make_lora_weight((5, 64), 1, rank=2)
    x = normal((7, 64))
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda x, w: x @ w.T))(x, lora)
    shapes = [
        tuple(e.outvars[0].aval.shape)
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name == "dot_general"
    ]
    assert sorted(shapes) == sorted([(7, 5), (7, 2), (7, 5)])


# ----------------------------------------------------------------------------------------
# Convolutions

# The handler is the same code for every spatial rank: one representative per factor
# layout (Flax: `a` holds the spatial and input axes; Equinox: `b` does), one in bf16.
CONV_CASES = [
    # (name, x shape, kernel shape, split_at, dimension_numbers, dtype)
    ("1d-flax-f32", (1, 6, 3), (3, 3, 4), 2, ("NWC", "WIO", "NWC"), jnp.float32),
    (
        "2d-equinox-bf16",
        (1, 3, 5, 4),
        (4, 3, 3, 3),
        1,
        ("NCHW", "OIHW", "NCHW"),
        jnp.bfloat16,
    ),
]


@pytest.mark.parametrize(
    "name, x_shape, k_shape, split_at, dn, dtype",
    CONV_CASES,
    ids=[c[0] for c in CONV_CASES],
)
def test_convolutions(name, x_shape, k_shape, split_at, dn, dtype):
    lora = make_lora_weight(k_shape, split_at, rank=2, dtype=dtype)
    x = normal(x_shape, dtype)
    spatial = len(k_shape) - 2

    def fn(x, w):
        return lax.conv_general_dilated(
            x,
            w,
            window_strides=(1,) * spatial,
            padding="SAME",
            rhs_dilation=(2,) + (1,) * (spatial - 1),
            dimension_numbers=dn,
        )

    report = check_primitive(fn, "conv_general_dilated", x, lora)
    assert dict(report.checks)["grad"] == "passed"
    assert not report.materializations
    with qax.materialization_policy(LoraWeight, "error"):
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(fn))(x, lora)
    # One convolution with the base kernel, one with the rank-`r` factor.
    convs = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name.startswith("conv")]
    kernels = sorted(tuple(e.invars[1].aval.shape) for e in convs)
    factor = lora.a.shape if split_at == len(k_shape) - 1 else lora.b.shape
    assert kernels == sorted([k_shape, factor])


def test_grouped_convolution_falls_back_with_a_warning():
    lora = make_lora_weight((3, 3, 2, 4), rank=2)
    x = normal((1, 5, 5, 4))

    def fn(x, w):
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=2,
        )  # fmt: skip

    with pytest.warns(qax.MaterializationWarning, match="conv_general_dilated"):
        got = qax.use_implicit_args(fn)(x, lora)
    np.testing.assert_allclose(got, fn(x, lora.materialize()), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Embedding lookups and the structural ops


@pytest.mark.parametrize(
    "fn, dtype",
    [
        (lambda w, ids: w[ids], jnp.float32),
        (lambda w, ids: jnp.take(w, ids, axis=0), jnp.bfloat16),
        (lambda w, ids: w[ids[0, 0]], jnp.float32),
    ],
    ids=["index-f32", "take-bf16", "one-row-f32"],
)
def test_embedding_lookup(fn, dtype):
    lora = make_lora_weight((10, 6), dtype=dtype)
    ids = jnp.array([[1, 9, 0], [4, 4, 2]])
    want = fn(lora.materialize(), ids)
    with qax.materialization_policy(LoraWeight, "error"):
        got = jax.jit(qax.use_implicit_args(fn))(lora, ids)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )
    assert_no_dense_weight(fn, lora, ids, shape=(10, 6))
    # check_handler on the gather itself, with the indices as `jnp` prepares them.
    eqn = find_eqn(jax.make_jaxpr(fn)(lora.materialize(), ids).jaxpr, "gather")
    if eqn is not None:
        index_shape = tuple(eqn.invars[1].aval.shape)
        indices = jnp.reshape(ids.ravel()[: int(np.prod(index_shape))], index_shape)
        report = check_handler("gather", lora, indices, **eqn.params)
        assert not report.materializations


def test_column_gather_falls_back():
    lora = make_lora_weight((10, 6))
    with pytest.warns(qax.MaterializationWarning, match="gather"):
        got = qax.use_implicit_args(lambda w: w[:, jnp.array([0, 2])])(lora)
    np.testing.assert_allclose(got, lora.materialize()[:, jnp.array([0, 2])], rtol=1e-6)


STRUCTURAL = [
    ("transpose-3d-keep", (2, 3, 4), 2, lambda w: jnp.transpose(w, (1, 0, 2))),
    ("transpose-3d-swap", (2, 3, 4), 1, lambda w: jnp.transpose(w, (2, 1, 0))),
    ("reshape-qkv", (4, 12), 1, lambda w: w.reshape(4, 3, 4)),
    ("reshape-merge", (2, 3, 4), 2, lambda w: w.reshape(6, 4)),
    ("squeeze", (1, 4, 5), 2, lambda w: jnp.squeeze(w, 0)),
    ("slice-b", (4, 12), 1, lambda w: w[:, 4:8]),
    ("slice-a", (6, 5), 1, lambda w: w[1:5:2]),
    ("split", (4, 12), 1, lambda w: jnp.split(w, 3, axis=1)[1]),
    ("astype-bf16", (6, 5), 1, lambda w: w.astype(jnp.bfloat16)),
    ("scalar-mul", (6, 5), 1, lambda w: w * 3.0),
    ("traced-scalar-mul", (6, 5), 1, lambda w: w * jnp.float32(0.5)),
]


@pytest.mark.parametrize(
    "name, shape, split_at, fn", STRUCTURAL, ids=[c[0] for c in STRUCTURAL]
)
def test_structural_ops_stay_implicit(name, shape, split_at, fn):
    lora = make_lora_weight(shape, split_at)
    with qax.materialization_policy(LoraWeight, "error"):
        out = qax.use_implicit_args(fn)(lora)
    assert isinstance(out, LoraWeight), type(out)
    want = fn(lora.materialize())
    got = out.materialize()
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2, atol=1e-2
    )


def test_structural_handlers_pass_check_handler():
    lora = make_lora_weight((4, 12))
    check_primitive(lambda w: w.T, "transpose", lora)
    check_primitive(lambda w: w.reshape(4, 3, 4), "reshape", lora)
    check_primitive(lambda w: w[:, 4:8], "slice", lora)
    # (convert_element_type and its gradients: test_bf16_compute_over_f32_factors.)
    check_primitive(lambda w, c: w * c, "mul", lora, jnp.float32(3.0))


def test_fused_qkv_kernel_split_then_used():
    """A fused (d, 3d) kernel: x @ W, split into q, k, v; and the weight itself split."""
    d = 4
    lora = make_lora_weight((d, 3 * d))
    x = normal((2, 5, d))

    def fused(x, w):
        q, k, v = jnp.split(w.reshape(d, 3, d), 3, axis=1)
        return sum(jnp.einsum("btd,de->bte", x, t[:, 0]) for t in (q, k, v))

    want = fused(x, lora.materialize())
    with qax.materialization_policy(LoraWeight, "error"):
        got = jax.jit(qax.use_implicit_args(fused))(x, lora)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_bf16_compute_over_f32_factors():
    lora = make_lora_weight((6, 5))
    x = normal((4, 6))

    def fn(x, w):
        return jnp.sum((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)) ** 2)

    want_val, want_grad = jax.value_and_grad(
        lambda ab: fn(x, dataclasses.replace(lora, a=ab[0], b=ab[1]).materialize())
    )((lora.a, lora.b))
    with qax.materialization_policy(LoraWeight, "error"):
        val, grad = jax.value_and_grad(
            lambda ab: qax.use_implicit_args(fn)(
                x, dataclasses.replace(lora, a=ab[0], b=ab[1])
            )
        )((lora.a, lora.b))
    assert grad[0].dtype == jnp.float32 and grad[1].dtype == jnp.float32
    np.testing.assert_allclose(val, want_val, rtol=2e-2)
    for g, w in zip(grad, want_grad, strict=True):
        np.testing.assert_allclose(g, w, rtol=5e-2, atol=5e-2 * np.abs(w).max())


# ----------------------------------------------------------------------------------------
# Transformations around and inside


def mlp(params, x):
    h = jax.nn.gelu(x @ params["w1"])
    return h @ params["w2"]


def mlp_params(freeze_w=False, dtype=jnp.float32):
    return {
        "w1": make_lora_weight((6, 8), seed=1, freeze_w=freeze_w, dtype=dtype),
        "w2": make_lora_weight((8, 5), seed=2, freeze_w=freeze_w, dtype=dtype),
    }


def dense(params):
    return qax.lora.merge(params)


def test_jit_grad_vmap_scan():
    # f32 only: bf16 changes the casts in the handlers (covered there), not the rules.
    params = mlp_params()
    xs = normal((5, 4, 6))

    def close(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())

    def scanned(params, xs):
        def body(c, x):
            y = mlp(params, x)
            return c + jnp.sum(y), y

        return lax.scan(body, jnp.zeros((), xs.dtype), xs)

    def loss(params, x):
        return jnp.sum(mlp(params, x).astype(jnp.float32) ** 2)

    with qax.materialization_policy(LoraWeight, "error"):
        got_jit = jax.jit(qax.use_implicit_args(mlp))(params, xs[0])
        got_vmap = jax.vmap(qax.use_implicit_args(mlp), in_axes=(None, 0))(params, xs)
        got_scan = jax.jit(qax.use_implicit_args(scanned))(params, xs)
        got_grad = jax.grad(qax.use_implicit_args(loss))(params, xs[0])
    d = dense(params)
    close(got_jit, mlp(d, xs[0]))
    close(got_vmap, jax.vmap(mlp, in_axes=(None, 0))(d, xs))
    close(got_scan[1], scanned(d, xs)[1])

    def loss_of_fields(fields):
        rebuilt = {k: dataclasses.replace(params[k], **fields[k]) for k in params}
        return loss(dense(rebuilt), xs[0])

    # freeze_w=False: w gets the dense gradient too.
    fields = {k: {"w": v.w, "a": v.a, "b": v.b} for k, v in params.items()}
    want = jax.grad(loss_of_fields)(fields)
    for k in params:
        assert isinstance(got_grad[k], LoraWeight)
        for name in ("w", "a", "b"):
            close(getattr(got_grad[k], name), want[k][name])


def test_freeze_w_leaves_no_weight_sized_gradient_in_the_jaxpr():
    params = mlp_params(freeze_w=True)
    x = normal((4, 6))

    def loss(params, x):
        return jnp.sum(mlp(params, x) ** 2)

    grad_fn = jax.grad(qax.use_implicit_args(loss))
    grads = grad_fn(params, x)
    for k in params:
        assert not np.any(np.asarray(grads[k].w)), "w got a gradient"
        assert np.any(np.asarray(grads[k].b))
    jaxpr = jax.make_jaxpr(grad_fn)(params, x)
    shapes = {tuple(p.shape) for p in (params["w1"], params["w2"])}
    products = [
        tuple(v.aval.shape)
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name in ("dot_general", "transpose", "mul", "add")
        for v in e.outvars
    ]
    assert not shapes & set(products), products
    # Without the option, the w gradient is computed (and matches the dense one).
    unfrozen = mlp_params(freeze_w=False)
    jaxpr = jax.make_jaxpr(grad_fn)(unfrozen, x)
    assert any(
        tuple(e.outvars[0].aval.shape) in ((6, 8), (8, 6))
        for e in all_eqns(jaxpr.jaxpr)
        if e.primitive.name == "dot_general"
    )


# ----------------------------------------------------------------------------------------
# Construction


def test_bad_factor_shapes_are_rejected():
    with pytest.raises(ValueError, match=r"a \(\*A, rank\)|\(in, rank\)"):
        LoraWeight(jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="do not fit"):
        LoraWeight(jnp.ones((4, 3)), jnp.ones((5, 2)), jnp.ones((2, 3)))


def test_shape_dtype_rank_scale():
    lora = LoraWeight(
        jnp.ones((4, 3), jnp.bfloat16), jnp.ones((4, 2)), jnp.ones((2, 3)), alpha=8
    )
    assert lora.shape == (4, 3) and lora.dtype == jnp.float32
    assert lora.rank == 2 and lora.scale == 4.0
    np.testing.assert_allclose(lora.materialize(), 1 + 4 * 2 * np.ones((4, 3)))


# ----------------------------------------------------------------------------------------
# Parameter trees: loraify, merge, split, combine, trainable_count


def linen_params():
    flax = pytest.importorskip("flax")
    nn = flax.linen

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(11, 8, name="embed")(ids)
            x = nn.LayerNorm(name="ln_1")(x)
            x = nn.Dense(16, name="up")(x)
            x = nn.Conv(8, (3,), name="conv")(jax.nn.relu(x))
            return nn.Dense(11, name="head")(x)

    model = Model()
    ids = jnp.array([[1, 2, 3, 4]])
    return model, model.init(jax.random.PRNGKey(0), ids)["params"], ids


def test_loraify_linen_default_filter_merge_and_outputs():
    model, params, ids = linen_params()
    lora = qax.lora.loraify(params, 2, key=jax.random.PRNGKey(1), alpha=4.0)
    wrapped = {
        qax.lora.path_string(p)
        for p, x in jax.tree_util.tree_flatten_with_path(
            lora, is_leaf=lambda x: isinstance(x, LoraWeight)
        )[0]
        if isinstance(x, LoraWeight)
    }
    assert wrapped == {"up/kernel", "conv/kernel", "head/kernel"}
    assert lora["conv"]["kernel"].a.shape == (3, 16, 2)
    assert lora["conv"]["kernel"].b.shape == (2, 8)
    # b starts at zero: the model is unchanged; after perturbing b, merge() agrees.
    apply = jax.jit(qax.use_implicit_args(model.apply))  # one compilation for both
    with qax.materialization_policy(LoraWeight, "error"):
        same = apply({"params": lora}, ids)
    np.testing.assert_allclose(same, model.apply({"params": params}, ids), atol=1e-6)
    lora = jax.tree_util.tree_map(
        lambda x: (
            dataclasses.replace(x, b=x.b + 0.1) if isinstance(x, LoraWeight) else x
        ),
        lora,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )
    with qax.materialization_policy(LoraWeight, "error"):
        got = apply({"params": lora}, ids)
    want = model.apply({"params": qax.lora.merge(lora)}, ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(want, model.apply({"params": params}, ids))
    assert qax.lora.trainable_count(lora) == (8 * 2 + 2 * 16) + (3 * 16 * 2 + 2 * 8) + (
        8 * 2 + 2 * 11
    )


def test_loraify_nnx_state():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Sequential(
        nnx.Linear(6, 8, rngs=nnx.Rngs(0)),
        nnx.LayerNorm(8, rngs=nnx.Rngs(0)),
        nnx.Linear(8, 3, rngs=nnx.Rngs(1)),
    )
    graphdef, state = nnx.split(model)
    lora = qax.lora.loraify(state, 2, key=jax.random.PRNGKey(0))
    assert qax.lora.trainable_count(lora) == (6 * 2 + 2 * 8) + (8 * 2 + 2 * 3)
    x = normal((4, 6))

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(apply)(lora, x)
    np.testing.assert_allclose(got, model(x), rtol=1e-5, atol=1e-5)


def test_loraify_equinox_module():
    eqx = pytest.importorskip("equinox")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    model = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3, 4, 3, padding=1, key=keys[0]),
            eqx.nn.Lambda(lambda x: x.reshape(-1)),
            eqx.nn.Linear(4 * 5 * 5, 7, key=keys[1]),
        ]
    )
    lora = qax.lora.loraify(model, 2, key=keys[2], split_at=1)
    lora = jax.tree_util.tree_map(
        lambda x: (
            dataclasses.replace(x, b=x.b + 0.05) if isinstance(x, LoraWeight) else x
        ),
        lora,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )
    assert qax.lora.trainable_count(lora) == (4 * 2 + 2 * 3 * 9) + (7 * 2 + 2 * 100)
    x = normal((3, 5, 5))
    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(lambda m, x: m(x))(lora, x)
    np.testing.assert_allclose(got, qax.lora.merge(lora)(x), rtol=1e-5, atol=1e-5)


def test_loraify_filter_and_errors():
    params = {"a": jnp.ones((4, 3)), "b": jnp.ones((4, 3)), "bias": jnp.ones(3)}
    only_a = qax.lora.loraify(
        params, 1, key=jax.random.PRNGKey(0), filter=lambda path, x: path == "a"
    )
    assert isinstance(only_a["a"], LoraWeight) and not isinstance(
        only_a["b"], LoraWeight
    )
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        qax.lora.loraify(params, 0, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="split_at=2 .* 'a' of shape \\(4, 3\\)"):
        qax.lora.loraify(params, 1, key=jax.random.PRNGKey(0), split_at=2)
    # Already-LoRA weights are left alone.
    again = qax.lora.loraify(only_a, 1, key=jax.random.PRNGKey(0))
    assert again["a"] is only_a["a"]


def test_split_combine_round_trip_and_errors():
    _, params, _ = linen_params()
    lora = qax.lora.loraify(params, 2, key=jax.random.PRNGKey(1), alpha=4.0)
    adapters, base = qax.lora.split(lora)
    # base is exactly the original parameters; adapters hold only the factors.
    assert jax.tree_util.tree_structure(base) == jax.tree_util.tree_structure(params)
    for x, y in zip(
        jax.tree_util.tree_leaves(base), jax.tree_util.tree_leaves(params), strict=True
    ):
        assert x is y
    leaves = jax.tree_util.tree_leaves(adapters)
    assert sum(x.size for x in leaves) == qax.lora.trainable_count(lora)
    assert qax.lora.trainable_count(adapters) == qax.lora.trainable_count(lora)
    assert isinstance(adapters["up"]["kernel"], LoraAdapter)
    assert adapters["up"]["bias"] is None and adapters["embed"]["embedding"] is None
    back = qax.lora.combine(adapters, base)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(lora)
    assert back["up"]["kernel"].alpha == 4.0
    with pytest.raises(ValueError, match="combine: `adapters` must have the structure"):
        qax.lora.combine(adapters, {"up": base["up"]})


def test_training_recipe_factors_only():
    """The documented recipe: adam state for the factors only, base untouched."""
    params = {
        "w1": jax.random.normal(jax.random.PRNGKey(0), (6, 8)),
        "w2": jax.random.normal(jax.random.PRNGKey(1), (8, 3)),
    }
    x, y = normal((16, 6), seed=2), normal((16, 3), seed=3)
    lora = qax.lora.loraify(params, 2, key=jax.random.PRNGKey(4), alpha=4.0)
    adapters, base = qax.lora.split(lora)
    opt = optax.adam(3e-2)
    opt_state = opt.init(adapters)
    moments = sum(
        x.size for x in jax.tree_util.tree_leaves(opt_state) if jnp.ndim(x) > 0
    )
    assert moments == 2 * qax.lora.trainable_count(adapters)

    def loss_fn(params, x, y):
        return jnp.mean((mlp(params, x) - y) ** 2)

    @jax.jit
    def step(adapters, opt_state, base):
        def loss(adapters):
            params = qax.lora.combine(adapters, base)
            return qax.use_implicit_args(loss_fn)(params, x, y)

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    with qax.materialization_policy(LoraWeight, "error"):
        losses = []
        for _ in range(40):
            adapters, opt_state, value = step(adapters, opt_state, base)
            losses.append(float(value))
    assert losses[-1] < 0.7 * losses[0], losses
    assert base["w1"] is params["w1"]
    trained = qax.lora.combine(adapters, base)
    np.testing.assert_allclose(
        loss_fn(qax.lora.merge(trained), x, y), losses[-1], rtol=0.2
    )


def test_default_filter():
    w = jnp.ones((4, 4))
    assert qax.lora.default_filter("h_0/attn/c_attn/kernel", w)
    assert qax.lora.default_filter("layers/0/mlp/value", w)
    for path in (
        "wte",
        "embed/embedding",
        "ln_f/scale",
        "h_0/ln_1/kernel",
        "RMSNorm_0/w",
    ):
        assert not qax.lora.default_filter(path, w), path
    assert not qax.lora.default_filter("bias", jnp.ones(4))
    assert not qax.lora.default_filter("ids", jnp.ones((4, 4), jnp.int32))


def test_merge_outside_use_implicit_args_warns_nothing():
    params = mlp_params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = qax.lora.merge(params)
    np.testing.assert_allclose(merged["w1"], params["w1"].materialize())


# ----------------------------------------------------------------------------------------
# Stacked weights (layers under lax.scan)


def stacked_model(layers, x):
    def body(h, p):
        return jnp.tanh(h @ p["w1"]) @ p["w2"], None

    return lax.scan(body, x, layers)[0]


def test_scan_over_stacked_lora_weights_stays_implicit():
    """A stack of LoRA layers, one over dense weights and one over NF4 (QLoRA)."""
    layers = {
        "w1": normal((3, 8, 32), seed=1) * 0.3,
        "w2": normal((3, 32, 8), seed=2) * 0.3,
    }
    layers["w2"] = qax.quant.NF4Weight.from_array(layers["w2"], 8, batch_ndim=1)
    lora = qax.lora.loraify(layers, 2, key=jax.random.PRNGKey(0), batch_ndim=1)
    lora = jax.tree_util.tree_map(
        lambda w: dataclasses.replace(w, b=w.b + 0.1),
        lora,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )
    w1 = lora["w1"]
    assert (
        w1.shape == (3, 8, 32) and w1.a.shape == (3, 8, 2) and w1.b.shape == (3, 2, 32)
    )
    x = normal((4, 8), seed=3)
    want = stacked_model(qax.lora.merge(lora), x)
    with qax.materialization_policy(LoraWeight, "error"):
        with qax.materialization_policy(qax.quant.NF4Weight, "error"):
            got = jax.jit(qax.use_implicit_args(stacked_model))(lora, x)
            jaxpr = jax.make_jaxpr(qax.use_implicit_args(stacked_model))(lora, x)
            # vmap over the stack too: layer i's weight applied to x.
            per_layer = jax.vmap(
                qax.use_implicit_args(lambda w, x: x @ w), in_axes=(0, None)
            )(lora["w1"], x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        per_layer, jnp.einsum("bi,lio->lbo", x, qax.lora.merge(lora)["w1"]), rtol=1e-5,
        atol=1e-5,
    )  # fmt: skip
    scan = find_eqn(jaxpr.jaxpr, "scan")
    body_shapes = [
        tuple(v.aval.shape)
        for e in all_eqns(scan.params["jaxpr"].jaxpr)
        if e.primitive.name == "dot_general"
        for v in e.outvars
    ]
    assert (8, 32) not in body_shapes and (32, 8) not in body_shapes

    # Training the stacked factors through the scan.
    adapters, base = qax.lora.split(lora)

    def loss(adapters):
        params = qax.lora.combine(adapters, base)
        return jnp.sum(qax.use_implicit_args(stacked_model)(params, x) ** 2)

    grads = jax.grad(loss)(adapters)
    want_grads = jax.grad(
        lambda ad: jnp.sum(
            stacked_model(qax.lora.merge(qax.lora.combine(ad, base)), x) ** 2
        )
    )(adapters)
    for g, w in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_grads)
    ):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------
# PEFT-style adapters on einsum kernels: `a` along any axes of the weight (`a_axes`)


def make_axes_weight(shape, a_axes, rank=3, seed=0, batch=()):
    """A LoraWeight whose `a` runs along the weight axes `a_axes`, with random factors."""
    kw, ka, kb = jax.random.split(jax.random.PRNGKey(seed), 3)
    rest = [i for i in range(len(shape)) if i not in a_axes]
    w = jax.random.normal(kw, (*batch, *shape))
    a = 0.5 * jax.random.normal(ka, (*batch, *(shape[i] for i in a_axes), rank))
    b = 0.5 * jax.random.normal(kb, (*batch, rank, *(shape[i] for i in rest)))
    return LoraWeight(w, a, b, alpha=2.0 * rank, a_axes=a_axes)


# (name, weight shape, a_axes, x shape, function of (x, w)): the kernels of a Gemma-style
# attention block, with `a` on the contracted axes as PEFT and qwix lay them out.
AXES_DOT_CASES = [
    ("q (N,D,H)", (2, 8, 4), (1,), (3, 5, 8), lambda x, w: jnp.einsum("btd,ndh->btnh", x, w)),
    ("kv (2,K,D,H)", (2, 1, 8, 4), (2,), (3, 5, 8), lambda x, w: jnp.einsum("btd,ckdh->cbtkh", x, w)),
    ("qkv (3,N,D,H)", (3, 2, 8, 4), (2,), (5, 8), lambda x, w: jnp.einsum("td,cndh->ctnh", x, w)),
    ("out (N,H,D) on b", (2, 4, 8), (2,), (3, 2, 4), lambda x, w: jnp.einsum("bnh,nhd->bd", x, w)),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, shape, a_axes, x_shape, fn",
    AXES_DOT_CASES,
    ids=[c[0] for c in AXES_DOT_CASES],
)
def test_adapters_along_any_axes_stay_implicit_in_products(
    name, shape, a_axes, x_shape, fn
):
    lora = make_axes_weight(shape, a_axes)
    x = normal(x_shape)
    assert lora.a_axes == a_axes
    np.testing.assert_allclose(
        lora.materialize(),
        lora.w + lora.scale * jnp.moveaxis(
            jnp.tensordot(lora.a, lora.b, 1), tuple(range(len(a_axes))), a_axes
        ),
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    report = check_primitive(fn, "dot_general", x, lora)
    assert set(dict(report.checks).values()) == {"passed"}
    assert not report.materializations
    assert_no_dense_weight(fn, x, lora, shape=shape)


AXES_STRUCTURAL = [
    ("transpose-to-leading", lambda w: jnp.transpose(w, (1, 0, 2))),
    ("transpose-reorders-b", lambda w: jnp.transpose(w, (2, 1, 0))),
    ("slice", lambda w: w[1:, :5, ::2]),
    ("split-a-axis", lambda w: jnp.split(w, [3], axis=1)[0]),
    ("split-b-axis", lambda w: jnp.split(w, [1], axis=0)[1]),
    ("dynamic-slice", lambda w: lax.dynamic_slice(w, (1, 2, 0), (1, 3, 4))),
    ("scalar-mul", lambda w: w * 3.0),
    ("astype-bf16", lambda w: w.astype(jnp.bfloat16)),
]


@pytest.mark.parametrize(
    "name, fn", AXES_STRUCTURAL, ids=[c[0] for c in AXES_STRUCTURAL]
)
def test_structural_ops_on_adapters_along_any_axes(name, fn):
    lora = make_axes_weight((2, 8, 4), (1,))
    with qax.materialization_policy(LoraWeight, "error"):
        out = qax.use_implicit_args(fn)(lora)
    assert isinstance(out, LoraWeight), type(out)
    want = fn(lora.materialize())
    got = out.materialize()
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )


def test_transposes_of_adapters_along_any_axes_pass_check_handler():
    lora = make_axes_weight((2, 8, 4), (1,))
    check_primitive(lambda w: jnp.transpose(w, (2, 1, 0)), "transpose", lora)
    check_primitive(lambda w: w[1:, :5], "slice", lora)
    # The two-axis layouts a transpose of a leading-axes weight can give, too.
    flat = make_lora_weight((3, 4, 5), split_at=1)
    out = qax.use_implicit_args(lambda w: jnp.transpose(w, (1, 0, 2)))(flat)
    assert out.a_axes == (1,)
    check_primitive(lambda w: jnp.transpose(w, (1, 0, 2)), "transpose", flat)


def test_loraify_a_axes_gives_peft_style_adapters_and_counts():
    n, d, h, k, r = 4, 16, 8, 2, 4
    key = jax.random.key(0)
    params = {
        "q_einsum": {"kernel": normal((n, d, h))},
        "kv_einsum": {"kernel": normal((2, k, d, h))},
        "attn_vec": {"kernel": normal((n, h, d))},
    }
    rules = [
        ("q_einsum/kernel", {"a_axes": (1,)}),
        ("kv_einsum/kernel", {"a_axes": (-2,)}),
    ]
    out = qax.lora.loraify(params, r, key=key, rules=rules)
    q, kv, o = (out[m]["kernel"] for m in ("q_einsum", "kv_einsum", "attn_vec"))
    assert (q.a.shape, q.b.shape, q.a_axes) == ((d, r), (r, n, h), (1,))
    assert (kv.a.shape, kv.b.shape, kv.a_axes) == ((d, r), (r, 2, k, h), (2,))
    # attn_vec (N, H, D) contracts its leading axes: the default layout already.
    assert (o.a.shape, o.b.shape, o.a_axes) == ((n, h, r), (r, d), None)
    want = r * (d + n * h) + r * (d + 2 * k * h) + r * (n * h + d)
    assert qax.lora.trainable_count(out) == want
    # The contiguous split would give q a (N, D, r): more numbers, one b for all heads.
    plain = qax.lora.loraify(params, r, key=key)
    assert qax.lora.trainable_count(plain) > want
    # b starts at zero: the model computes what it computed before.
    np.testing.assert_array_equal(
        qax.lora.merge(out)["q_einsum"]["kernel"], params["q_einsum"]["kernel"]
    )
    # split / combine and a function of (path, leaf) keep the layout.
    adapters, base = qax.lora.split(out)
    assert qax.lora.combine(adapters, base)["q_einsum"]["kernel"].a_axes == (1,)
    by_fn = qax.lora.loraify(params, r, key=key, a_axes=lambda path, w: (w.ndim - 2,))
    assert by_fn["q_einsum"]["kernel"].a_axes == (1,)
    assert by_fn["attn_vec"]["kernel"].a_axes == (1,)


def test_a_axes_errors_name_the_weight_and_the_fix():
    w = normal((2, 8, 4))
    for bad in [(0, 0), (5,), (0, 1, 2), ()]:
        with pytest.raises(ValueError, match=r"a_axes=.*'q'.*distinct axes"):
            qax.lora.loraify({"q": w}, 2, key=jax.random.key(0), a_axes=bad)
    with pytest.raises(ValueError, match=r"a_axes=\(0,\).*`a` must have shape"):
        LoraWeight(w, jnp.ones((8, 2)), jnp.ones((2, 2, 4)), a_axes=(0,))
    with pytest.raises(ValueError, match="distinct axes"):
        LoraWeight(w, jnp.ones((8, 2)), jnp.ones((2, 2, 4)), a_axes=(1, 1))


def test_stacked_adapters_along_any_axes_scan_and_train():
    """A layer stack (batch_ndim=1) with PEFT-style adapters: lax.scan slices it, and
    gradients of the factors match the dense oracle."""
    stack = qax.lora.loraify(
        {"q": normal((3, 2, 8, 4))}, 2, key=jax.random.key(1), a_axes=(1,), batch_ndim=1
    )["q"]
    assert (stack.a.shape, stack.b.shape) == ((3, 8, 2), (3, 2, 2, 4))
    stack = LoraWeight(stack.w, stack.a, normal(stack.b.shape), a_axes=(1,))
    assert stack.field_dims() == {"w": (0, 1, 2), "a": (1, None), "b": (None, 0, 2)}
    x = normal((5, 8))

    def loss(w):
        def body(h, layer):
            y = jnp.einsum("td,ndh->tnh", h, layer)
            return jnp.tanh(y.sum(-1) @ jnp.ones((2, 8))), None

        return jnp.sum(lax.scan(body, x, w)[0] ** 2)

    def of_factors(f, a, b):
        return f(LoraWeight(stack.w, a, b, a_axes=(1,)))

    with qax.materialization_policy(LoraWeight, "error"):
        got = jax.jit(
            jax.grad(lambda a, b: of_factors(qax.use_implicit_args(loss), a, b), (0, 1))
        )(stack.a, stack.b)
    want = jax.grad(
        lambda a, b: loss(LoraWeight(stack.w, a, b, a_axes=(1,)).materialize()), (0, 1)
    )(stack.a, stack.b)
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


# Products with a stack of weights (layers stacked for scan, an ensemble): the stack axis
# is a batch axis of the product (vmap over both), a free one (vmap over the weights
# only) or contracted (a sum over the layers); each stays two thin products.
STACK_PRODUCTS = [
    ("vmap-both", (3, 4, 8), lambda x, w: jax.vmap(lambda x, w: x @ w)(x, w)),
    ("vmap-weights", (4, 8), lambda x, w: jax.vmap(lambda w: x @ w)(w)),
    ("sum-over-layers", (3, 4, 8), lambda x, w: jnp.einsum("ltd,ldo->to", x, w)),
    ("w-on-the-left", (4, 5), lambda x, w: jnp.einsum("ldo,to->ltd", w, x)),
]


@pytest.mark.parametrize(
    "name, x_shape, fn", STACK_PRODUCTS, ids=[c[0] for c in STACK_PRODUCTS]
)
def test_products_with_a_stack_of_weights_stay_implicit(name, x_shape, fn):
    stack = make_axes_weight((8, 5), (0,), batch=(3,))
    assert stack.a_axes is None and stack.a.shape == (3, 8, 3)
    x = normal(x_shape)
    with qax.materialization_policy(LoraWeight, "error"):
        got = jax.jit(qax.use_implicit_args(fn))(x, stack)
        grads = jax.grad(
            lambda a, b: jnp.sum(
                qax.use_implicit_args(fn)(x, LoraWeight(stack.w, a, b)) ** 2
            ),
            (0, 1),
        )(stack.a, stack.b)
    np.testing.assert_allclose(got, fn(x, stack.materialize()), rtol=1e-4, atol=1e-4)
    want = jax.grad(
        lambda a, b: jnp.sum(fn(x, LoraWeight(stack.w, a, b).materialize()) ** 2),
        (0, 1),
    )(stack.a, stack.b)
    for g, e in zip(grads, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-3)
    assert_no_dense_weight(fn, x, stack, shape=stack.shape)


def test_vmap_over_a_stack_of_peft_style_weights():
    stack = make_axes_weight((2, 8, 4), (1,), batch=(3,))
    x = normal((3, 5, 8))

    def fn(x, w):
        return jax.vmap(lambda x, w: jnp.einsum("td,ndh->tnh", x, w))(x, w)

    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(fn)(x, stack)
    np.testing.assert_allclose(got, fn(x, stack.materialize()), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------
# `batch_ndim` over a whole model: the unstacked weights beside the stack (issue 42, 2)


def test_batch_ndim_over_a_whole_model_adapts_the_head_as_one_weight():
    params = {
        "layers": {"kernel": normal((3, 8, 16), seed=1)},
        "head": {"kernel": normal((16, 4), seed=2)},
    }
    lora = qax.lora.loraify(params, 2, key=jax.random.key(0), batch_ndim=1)
    head, layers = lora["head"]["kernel"], lora["layers"]["kernel"]
    assert isinstance(head, LoraWeight)
    assert head.a.shape == (16, 2) and head.b.shape == (2, 4)
    assert layers.a.shape == (3, 8, 2) and layers.b.shape == (3, 2, 16)
    x = normal((5, 16), seed=3)
    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(lambda w, x: x @ w)(head, x)
    np.testing.assert_allclose(got, x @ qax.lora.merge(head), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# A quantized stack under factors that do not stack: the fix follows from the mistake
# (issue 42, item 7)


def test_loraify_without_batch_ndim_over_a_quantized_stack_names_loraify_batch_ndim():
    stack = qax.quant.quantize(
        {"w": normal((3, 32, 16))}, "nf4", block_size=16, batch_ndim=1
    )
    with pytest.raises(ValueError) as info:
        qax.lora.loraify(stack, 2, key=jax.random.key(0))
    text = str(info.value)
    assert "loraify(..., batch_ndim=1)" in text, text
    assert "batch_ndim=0" not in text, text
    # Following the advice works.
    fixed = qax.lora.loraify(stack, 2, key=jax.random.key(0), batch_ndim=1)
    assert fixed["w"].b.shape == (3, 2, 16)


# ----------------------------------------------------------------------------------------
# The whole optax step inside `qax.use_implicit_args` (issue 42, item 4)


def test_plain_optax_step_inside_the_wrapper_names_the_step_outside():
    lora = qax.lora.loraify({"w": normal((8, 4))}, 2, key=jax.random.key(1))
    tx = optax.adam(1e-2)
    opt_state = tx.init(lora)
    x = jnp.ones((3, 8))

    def step(params, opt_state, x):
        grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    advice = r"(?s)optax.apply_updates.*outside.*qax.lora.split.*qax.lora.combine"
    with pytest.warns(qax.MaterializationWarning, match=advice):
        qax.use_implicit_args(step)(lora, opt_state, x)
    with qax.materialization_policy(LoraWeight, "error"):
        with pytest.raises(qax.MaterializationError, match=advice):
            qax.use_implicit_args(step)(lora, opt_state, x)


# ----------------------------------------------------------------------------------------
# One layer of a stack, and transposes that keep the layer axis, stay implicit
# (issue 42, item 3, the LoRA half)


def _stack_of_loras(a_axes=None):
    shape = (3, 8, 4) if a_axes is None else (3, 2, 8, 4)
    lora = qax.lora.loraify(
        {"w": normal(shape, seed=4)},
        2,
        key=jax.random.key(5),
        batch_ndim=1,
        alpha=3.0,
        a_axes=a_axes,
    )["w"]
    return dataclasses.replace(lora, b=lora.b + 0.1 * normal(lora.b.shape, seed=6))


_LAYER_CASES = {
    "static": lambda w, x: x @ w[1],
    "negative": lambda w, x: x @ w[-1],
    "traced": lambda w, x: x @ w[jnp.argmax(x[0, :3])],
    "fori_loop": lambda w, x: lax.fori_loop(
        0, 3, lambda i, h: jnp.tanh(h @ w[i] @ w[i].T), x
    ),
    "swapaxes": lambda w, x: jnp.einsum("lij,bj->lbi", jnp.swapaxes(w, -1, -2), x),
    "vmap_T": lambda w, x: jax.vmap(lambda one: (x @ one) @ one.T)(w),
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", list(_LAYER_CASES))
def test_one_layer_or_a_transpose_of_a_lora_stack_stays_implicit(case, jit):
    f = _LAYER_CASES[case]
    lora = _stack_of_loras()
    x = normal((5, 8), seed=7)
    want = f(qax.lora.merge(lora), x)
    run = qax.use_implicit_args(f)
    with qax.materialization_policy(LoraWeight, "error"):
        got = (jax.jit(run) if jit else run)(lora, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_one_layer_of_a_lora_stack_is_that_layer():
    lora = _stack_of_loras()
    for i in (0, 2, jnp.int32(1)):
        one = qax.use_implicit_args(lambda w, i: w[i])(lora, i)
        assert isinstance(one, LoraWeight) and one.b.shape == (2, 4)
        np.testing.assert_allclose(
            qax.lora.merge(one), qax.lora.merge(lora)[i], rtol=1e-6, atol=1e-6
        )
    layers = qax.use_implicit_args(lambda w: w[1:])(lora)
    assert isinstance(layers, LoraWeight) and layers.a.shape == (2, 8, 2)
    swapped = qax.use_implicit_args(lambda w: jnp.swapaxes(w, -1, -2))(lora)
    assert isinstance(swapped, LoraWeight) and swapped.shape == (3, 4, 8)
    np.testing.assert_allclose(
        qax.lora.merge(swapped),
        jnp.swapaxes(qax.lora.merge(lora), -1, -2),
        rtol=1e-6,
        atol=1e-6,
    )


def test_a_peft_style_lora_stack_transposes_and_indexes_implicitly():
    lora = _stack_of_loras(a_axes=(1,))  # (3, 2, 8, 4): a along the 8
    x = normal((5, 8), seed=8)

    def f(w, x):
        one = jnp.transpose(w, (0, 2, 1, 3))[2]  # (8, 2, 4)
        return jnp.einsum("bd,dhk->bhk", x, one)

    want = f(qax.lora.merge(lora), x)
    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(f)(lora, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# A per-path rule that only sets `batch_ndim` adapts the stacked kernels, not the biases
# and norms beside them (issue 42)


def test_a_rule_setting_batch_ndim_leaves_biases_and_norms_alone():
    params = {
        "layers": {
            "kernel": normal((3, 8, 8), seed=1) * 0.3,
            "bias": normal((3, 8), seed=2),
            "norm": {"scale": 1 + normal((3, 8), seed=3)},
            "conv": {"bias": normal((3, 8, 1), seed=7)},  # Equinox-style, stacked
        },
        "head": {"kernel": normal((8, 4), seed=4), "bias": normal((4,), seed=5)},
    }
    lora = qax.lora.loraify(
        params, 2, key=jax.random.key(0), rules=[("layers/.*", {"batch_ndim": 1})]
    )
    assert lora["layers"]["kernel"].b.shape == (3, 2, 8)  # one b per layer
    assert lora["layers"]["bias"] is params["layers"]["bias"]
    assert lora["layers"]["norm"]["scale"] is params["layers"]["norm"]["scale"]
    assert lora["layers"]["conv"]["bias"] is params["layers"]["conv"]["bias"]
    assert lora["head"]["kernel"].b.shape == (2, 4)
    assert lora["head"]["bias"] is params["head"]["bias"]

    def model(p, x):
        def body(h, layer):
            h = jnp.tanh(h @ layer["kernel"] + layer["bias"]) * layer["norm"]["scale"]
            return h + layer["conv"]["bias"][:, 0], None

        return (
            lax.scan(body, x, p["layers"])[0] @ p["head"]["kernel"] + p["head"]["bias"]
        )

    x = normal((5, 8), seed=6)
    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(model)(lora, x)
    np.testing.assert_allclose(
        got, model(qax.lora.merge(lora), x), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("case", ["static", "traced", "fori_loop", "vmap_T"])
def test_one_layer_of_a_qlora_stack_stays_implicit(case):
    """The LoRA handlers slice the quantized base too (its own handlers keep it)."""
    f = _LAYER_CASES[case]
    base = qax.quant.quantize({"w": normal((3, 8, 4), seed=4)}, "int8", batch_ndim=1)
    lora = qax.lora.loraify(base, 2, key=jax.random.key(5), batch_ndim=1)["w"]
    lora = dataclasses.replace(lora, b=lora.b + 0.1)
    x = normal((5, 8), seed=7)
    with qax.materialization_policy(qax.ImplicitArray, "error"):
        got = qax.use_implicit_args(f)(lora, x)
    want = f(qax.lora.merge(lora), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------
# What the default filter chooses, decided from the tree's structure; `plan` reports it;
# a rule that decides no weight is reported (issue 36, items 2, 4 and 6)


def griffin_like_params():
    """Haiku/Griffin naming: ``w`` and ``b``; block-diagonal gates with 2-D biases."""
    return {
        "a_gate": {"w": normal((2, 4, 4), seed=1), "b": normal((2, 4), seed=2)},
        "conv1d": {"w": normal((3, 8), seed=3), "b": normal((8,), seed=4)},
        "mlp": {"w": normal((8, 8), seed=5), "b": normal((8,), seed=6)},
        "stack": {"w": normal((3, 8, 8), seed=7), "b": normal((3, 8), seed=8)},
        # No kernel beside them: two weights named `a` and `b`, not a bias.
        "pair": {"a": normal((4, 3), seed=9), "b": normal((4, 3), seed=10)},
    }


def test_default_selection_takes_no_bias_named_b_beside_a_kernel():
    params = griffin_like_params()
    lora = qax.lora.loraify(params, 2, key=jax.random.key(0))
    for name in ("a_gate", "conv1d", "mlp", "stack"):
        assert isinstance(lora[name]["w"], LoraWeight), name
        assert lora[name]["b"] is params[name]["b"], name
    assert isinstance(lora["pair"]["a"], LoraWeight)
    assert isinstance(lora["pair"]["b"], LoraWeight)
    assert qax.lora.biases(params) == {"a_gate/b", "conv1d/b", "mlp/b", "stack/b"}
    # Passing `default_filter` itself means the same.
    same = qax.lora.loraify(
        params, 2, key=jax.random.key(0), filter=qax.lora.default_filter
    )
    assert same["a_gate"]["b"] is params["a_gate"]["b"]
    # A rule does not adapt a bias either (as it never adapts one named `bias`).
    ruled = qax.lora.loraify(
        params, 2, key=jax.random.key(0), rules=[("a_gate/.*", {"rank": 1})]
    )
    assert ruled["a_gate"]["w"].a.shape[-1] == 1
    assert ruled["a_gate"]["b"] is params["a_gate"]["b"]

    def gate(p, x):  # Griffin's BlockDiagonalLinear
        y = jnp.einsum("...hi,hij->...hj", x, p["a_gate"]["w"]) + p["a_gate"]["b"]
        return y.reshape(*x.shape[:-2], 8) @ p["mlp"]["w"] + p["mlp"]["b"]

    x = normal((5, 2, 4), seed=11)
    with qax.materialization_policy(LoraWeight, "error"):
        got = qax.use_implicit_args(gate)(lora, x)
    np.testing.assert_allclose(got, gate(qax.lora.merge(lora), x), rtol=1e-5)


def test_biases_follow_the_frameworks_layouts():
    params = {
        # Flax: (in, out) kernels, the bias along the last axis.
        "dense": {"kernel": normal((4, 6)), "bias": normal((6,))},
        # Equinox / PyTorch: (out, in, ...) weights, the bias along the first axis.
        "conv": {"weight": normal((6, 3, 2, 2)), "bias": normal((6, 1, 1))},
        # NNX states end in `value`.
        "nnx": {"kernel": {"value": normal((3, 5))}, "b": {"value": normal((1, 5))}},
        # The same rank as the kernel: another weight, not a bias.
        "twin": {"w": normal((4, 4)), "b": normal((4, 4))},
        # A scale of another size than the kernel's outputs is not its bias.
        "odd": {"w": normal((4, 4, 6)), "b": normal((4, 5))},
    }
    assert qax.lora.biases(params) == {"dense/bias", "conv/bias", "nnx/b/value"}


def test_plan_reports_what_the_default_filter_chose_and_skipped():
    params = {
        **griffin_like_params(),
        "embed": {"embedding": normal((11, 8))},
        "norm": {"scale": normal((8,))},
        "ids": jnp.zeros((4, 4), jnp.int32),
    }
    plan = qax.lora.plan(params, 2, rules=[("mlp/w", {"rank": 4})])
    lora = qax.lora.loraify(
        params, 2, key=jax.random.key(0), rules=[("mlp/w", {"rank": 4})]
    )
    # The oracle: what loraify did.
    adapted = {
        qax.utils.path_string(p)
        for p, x in qax.utils.tree_flatten_with_path_with_implicit(lora)[0]
        if isinstance(x, LoraWeight)
    }
    assert {row.path for row in plan.chosen} == adapted
    rows = {row.path: row for row in plan.rows}
    assert set(rows) == {
        qax.utils.path_string(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    assert rows["a_gate/b"].why == "bias" and not rows["a_gate/b"].chosen
    assert rows["embed/embedding"].why == "embedding"
    assert rows["norm/scale"].why == "normalisation"
    assert rows["conv1d/b"].why == "bias"
    assert rows["ids"].why == "not floating point"
    assert rows["mlp/w"].detail == "rank 4: a (8, 4), b (4, 8)"
    assert rows["a_gate/w"].detail == "rank 2: a (2, 4, 2), b (2, 4)"
    assert rows["a_gate/w"].shape == (2, 4, 4)
    text = str(plan)
    for path, row in rows.items():
        assert path in text and str(row.shape) in text
    assert "mlp/w" in text and "rule 'mlp/w'" in text
    assert f"{len(adapted)} of {len(rows)}" in text


def test_the_embedding_exclusion_leaves_convolution_kernels_to_the_filter():
    params = {
        "patch_embedding": {"kernel": normal((2, 2, 3, 8), seed=1) * 0.3},
        "pos_embedding": normal((1, 4, 8), seed=2),
        "embedder": {"input_embedding": normal((11, 8), seed=3)},
    }
    assert qax.lora.default_filter("patch_embedding/kernel", jnp.ones((2, 2, 3, 8)))
    lora = qax.lora.loraify(params, 2, key=jax.random.key(0))
    assert isinstance(lora["patch_embedding"]["kernel"], LoraWeight)
    assert lora["pos_embedding"] is params["pos_embedding"]
    assert lora["embedder"]["input_embedding"] is params["embedder"]["input_embedding"]
    lora = jax.tree_util.tree_map(  # a nonzero b: the adapter counts
        lambda x: (
            dataclasses.replace(x, b=normal(x.b.shape, seed=4))
            if isinstance(x, LoraWeight)
            else x
        ),
        lora,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )

    def patches(p, images):  # a ViT's patch embedding
        y = lax.conv_general_dilated(
            images,
            p["patch_embedding"]["kernel"],
            (2, 2),
            "VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return y.reshape(y.shape[0], -1, 8) + p["pos_embedding"]

    images = normal((2, 4, 4, 3), seed=5)
    got = qax.use_implicit_args(patches)(lora, images)
    np.testing.assert_allclose(
        got, patches(qax.lora.merge(lora), images), rtol=1e-5, atol=1e-5
    )


def test_a_rule_that_decides_no_weight_is_reported():
    params = {"layer_0": {"attn": {"q_einsum": {"w": normal((2, 8, 4))}}}}
    rules = [("q_einsum", {"rank": 4})]
    with pytest.warns(UserWarning, match="'q_einsum' matched no weight") as caught:
        lora = qax.lora.loraify(params, 2, key=jax.random.key(0), rules=rules)
    assert caught[0].filename == __file__  # points at the call
    assert "layer_0/attn/q_einsum/w" in str(caught[0].message)  # the closest path
    assert lora["layer_0"]["attn"]["q_einsum"]["w"].a.shape[-1] == 2  # not 4
    with pytest.raises(ValueError, match="'q_einsum' matched no weight"):
        qax.lora.loraify(
            params, 2, key=jax.random.key(0), rules=rules, strict_rules=True
        )
    # A rule shadowed by an earlier one decides nothing either.
    shadowed = [(".*", {"rank": 3}), (".*/w", {"rank": 4})]
    with pytest.warns(UserWarning, match="'.\\*/w' decided no weight: .*'.\\*'"):
        qax.lora.loraify(params, 2, key=jax.random.key(0), rules=shadowed)
    # Rules that decide something say nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qax.lora.loraify(
            params, 2, key=jax.random.key(0), rules=[(".*q_einsum.*", {"rank": 4})]
        )
    assert "q_einsum" in str(qax.lora.plan(params, 2, rules=rules))
