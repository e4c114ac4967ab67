"""Control-flow, call and annotation primitives on implicit arrays (`qax._rules`).

Oracle: the same program on materialized arrays, for values and gradients, eagerly and
under `jax.jit`. Unexpected materialization is an error (see setup.cfg).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import qax
from qax import _structure
from qax._rules import _staging
from tests.helpers import (
    ALL_MODES,
    MODES,
    ClosedZeros,
    PlainMatmulLora,
    Scaled,
    all_eqns,
    assert_close,
    check_mode,
    dense,
    forms_full_lora,
    keys,
    materializations,
    scaled_lora,
    weight_shaped_sums,
)

X = jax.random.normal(keys(1, 7)[0], (3, 5))


def all_eqn_names(jaxpr):
    return [e.primitive.name for e in all_eqns(jaxpr)]


# ----------------------------------------------------------------------------------------
# jit


@jax.jit
def _inner_matmul(x, w):
    return jnp.tanh(x @ w)


@pytest.mark.parametrize("mode", ["eager", "jit_grad"])
def test_nested_jit(mode):
    def f(w, x):
        return _inner_matmul(x, w).sum(0) * 2.0

    check_mode(mode, f, scaled_lora(), X)


def test_nested_jit_stays_a_jit_call_without_forming_the_weight():
    def f(w, x):
        return _inner_matmul(x, w)

    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(scaled_lora(), X)
    assert "jit" in [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert not forms_full_lora(jaxpr, 5, 6, 2)


def _count_body_traces(monkeypatch) -> list:
    """Names of the bodies that `trace_body` stages from now on (for cache tests)."""
    calls = []
    original = _staging.trace_body

    def counting(*args, **kwargs):
        calls.append(args[3])
        return original(*args, **kwargs)

    monkeypatch.setattr(_staging, "trace_body", counting)
    return calls


def test_nested_jit_body_is_cached(monkeypatch):
    calls = _count_body_traces(monkeypatch)

    def f(w, x):
        return _inner_matmul(x, w)

    for _ in range(2):
        jax.make_jaxpr(qax.use_implicit_args(f))(scaled_lora(), X)
    assert calls.count("_inner_matmul") <= 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_nested_inline_jit(mode):
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w), inline=True)
    check_mode(mode, lambda w, x: inner(x, w), scaled_lora(), X)


def test_nested_jit_returns_implicit_output():
    @jax.jit
    def twice(z):
        return z * 2.0

    out = qax.use_implicit_args(twice)(ClosedZeros(shape=(3, 4)))
    assert isinstance(out, ClosedZeros) and out.shape == (3, 4)


# ----------------------------------------------------------------------------------------
# cond and switch


def _cond_fn(p, w, x):
    return lax.cond(p, lambda w, x: x @ w, lambda w, x: jnp.sin(x @ w), w, x)


@pytest.mark.parametrize("mode", ["eager", "jit_grad"])
@pytest.mark.parametrize("pred", [True, False], ids=["true", "false"])
def test_cond(mode, pred):
    check_mode(mode, functools.partial(_cond_fn, pred), scaled_lora(), X)


@pytest.mark.parametrize(
    ("mode", "index"), [("eager", 0), ("jit", 7), ("jit_grad", 1)], ids=["0", "7", "1"]
)
def test_switch(mode, index):
    def f(w, x):
        branches = [
            lambda w, x: x @ w,
            lambda w, x: jnp.cos(x @ w),
            lambda w, x: (x * 2.0) @ w,
        ]
        return lax.switch(index, branches, w, x)

    check_mode(mode, f, scaled_lora(), X)


def test_cond_same_implicit_type_stays_implicit():
    def f(p, z):
        return lax.cond(p, lambda z: z * 2.0, lambda z: -z, z)

    for p in (True, False):
        out = qax.use_implicit_args(f)(p, ClosedZeros(shape=(2, 3)))
        assert isinstance(out, ClosedZeros) and out.shape == (2, 3)
    out = jax.jit(qax.use_implicit_args(f))(True, ClosedZeros(shape=(2, 3)))
    assert isinstance(out, ClosedZeros)


def test_cond_different_structures_materialize_to_common_structure():
    def f(p, z, x):
        return lax.cond(p, lambda z, x: (z * 2.0, z), lambda z, x: (z + x, -z), z, x)

    z, x = ClosedZeros(shape=(3,)), jnp.arange(3.0)
    for p in (True, False):
        with pytest.warns(qax.MaterializationWarning, match="lax.cond"):
            first, second = qax.use_implicit_args(f)(p, z, x)
        assert not isinstance(first, qax.ImplicitArray)
        assert isinstance(
            second, ClosedZeros
        )  # agrees in both branches: stays implicit
        assert_close((first, second), f(p, dense(z), x))


@pytest.mark.parametrize("mode", MODES)
def test_cond_branches_capturing_constants(mode):
    # Regression: each branch closes over its own non-scalar constants.
    c_true = np.linspace(-1.0, 1.0, 6, dtype=np.float32)
    c_false = jnp.arange(6.0) * 0.5
    c_shared = np.full((6,), 3.0, np.float32)

    def f(w, x):
        def yes(w, x):
            return (x @ w) * c_true + c_shared

        def no(w, x):
            return (x @ w) - c_false * c_shared

        return lax.cond(x.sum() > 0, yes, no, w, x), lax.cond(
            x.sum() <= 0, yes, no, w, x
        )

    check_mode(mode, f, scaled_lora(), X)


# ----------------------------------------------------------------------------------------
# scan


@pytest.mark.parametrize(
    ("mode", "reverse", "unroll"),
    [
        ("eager", False, 1),
        ("jit", True, 2),
        ("jit_grad", True, 1),
        ("jit_grad", False, 3),
    ],
    ids=["eager", "jit-reverse-unroll2", "jit_grad-reverse", "jit_grad-unroll3"],
)
def test_scan_implicit_consts(mode, reverse, unroll):
    def f(w, x):
        def body(c, _):
            c = jnp.tanh(c @ w)
            return c, c.sum()

        return lax.scan(body, x, None, length=3, reverse=reverse, unroll=unroll)

    check_mode(mode, f, scaled_lora(5, 5), X)


@pytest.mark.parametrize("mode", ["jit", "jit_grad"])
def test_scan_implicit_xs(mode):
    def f(ws, x):
        def body(c, w):
            return jnp.tanh(c @ w), (c @ w).sum(-1)

        return lax.scan(body, x, ws)

    check_mode(mode, f, scaled_lora(5, 5, lead=(4,)), X)


def test_scan_over_layers_does_not_form_the_weights():
    def f(ws, x):
        return lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(scaled_lora(5, 5, lead=(4,)), X)
    assert "scan" in all_eqn_names(jaxpr)
    assert not forms_full_lora(jaxpr, 5, 5, 2)


def test_scan_slices_aux_shape_of_xs():
    seen = []

    def f(zs, c0):
        def body(c, z):
            seen.append(z.shape)
            return c + z, z * 2.0

        return lax.scan(body, c0, zs)

    c, ys = qax.use_implicit_args(f)(ClosedZeros(shape=(5, 4)), jnp.ones(4))
    assert seen == [(4,)]
    assert isinstance(ys, ClosedZeros) and ys.shape == (5, 4)
    assert_close(c, jnp.ones(4))


@pytest.mark.parametrize("mode", ["eager", "jit_grad"])
def test_scan_stable_implicit_carry(mode):
    def f(z, x):
        def body(carry, xi):
            zc, dc = carry
            return (zc * 2.0, dc + xi), (zc * xi).sum()

        return lax.scan(body, (z, jnp.zeros(5)), x)

    if mode.endswith("grad"):
        check_mode(mode, f, ClosedZeros(shape=(5,)), X, argnums=1)
    else:
        check_mode(mode, f, ClosedZeros(shape=(5,)), X)
    (zc, _), _ = qax.use_implicit_args(f)(ClosedZeros(shape=(5,)), X)
    assert isinstance(zc, ClosedZeros)


def test_scan_carry_changing_structure_is_materialized_with_warning():
    def f(z, x):
        return lax.scan(lambda c, xi: (c + xi, c.sum()), z, x)

    with pytest.warns(qax.MaterializationWarning, match="carry .*lax.scan"):
        out = qax.use_implicit_args(f)(ClosedZeros(shape=(5,)), X)
    assert_close(out, f(jnp.zeros(5), X))


def test_scan_carry_becoming_implicit_is_materialized_with_warning():
    def f(z, x):
        return lax.scan(lambda c, xi: (c * z, c.sum()), x[0], x)

    z = ClosedZeros(shape=(5,))
    with pytest.warns(qax.MaterializationWarning, match="carry"):
        out = qax.use_implicit_args(f)(z, X)
    assert_close(out, f(dense(z), X))


def _module_level_layer(c, w):
    return jnp.tanh(c @ w), None


def test_scan_body_is_cached(monkeypatch):
    calls = _count_body_traces(monkeypatch)

    def f(ws, x):
        return lax.scan(_module_level_layer, x, ws)[0]

    for _ in range(3):
        jax.make_jaxpr(qax.use_implicit_args(f))(scaled_lora(5, 5, lead=(3,)), X)
    assert calls.count("lax.scan") == 1


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_scan_carry_leaf_changing_weak_type(mode):
    # The scale starts as a Python float (weak) and becomes a strong float32.
    def f(c, xs):
        return lax.scan(lambda c, x: (c * x, None), c, xs)[0]

    def run(xs):
        out = qax.use_implicit_args(f)(Scaled(jnp.ones(3), 1.0), xs)
        assert isinstance(out, Scaled)
        return out

    xs = jnp.arange(1.0, 4.0)
    got = (jax.jit(run) if mode == "jit" else run)(xs)
    assert_close(got, f(jnp.ones(3), xs))


@pytest.mark.parametrize("primitive", ["jit", "cond", "scan", "checkpoint", "copy"])
def test_implicit_built_inside_jit_with_python_scalar_leaf(primitive):
    ops = {
        "jit": lambda c: jax.jit(lambda c: c * 2.0)(c),
        "cond": lambda c: lax.cond(True, lambda c: c * 2.0, lambda c: c * 3.0, c),
        "scan": lambda c: lax.scan(lambda c, _: (c * 2.0, None), c, None, length=1)[0],
        "checkpoint": jax.checkpoint(lambda c: c * 2.0),
        "copy": lambda c: jnp.copy(c) * 2.0,
    }

    @jax.jit
    def run():
        out = qax.use_implicit_args(ops[primitive])(Scaled(jnp.ones(3), 1.0))
        assert isinstance(out, Scaled)
        return out

    assert_close(run(), 2.0 * jnp.ones(3))


def test_scan_xs_with_unstacked_leaves_is_materialized():
    lora = scaled_lora(
        4, 4
    )  # w is (4, 4) but a, b are (4, 2): not stacked along axis 0

    def f(w, c):
        return lax.scan(lambda c, row: (c + row, row.sum()), c, w)

    with pytest.warns(qax.MaterializationWarning, match="leading dimension"):
        out = qax.use_implicit_args(f)(scaled_lora(4, 3), jnp.zeros(3))
    assert_close(out, f(dense(scaled_lora(4, 3)), jnp.zeros(3)))
    del lora


# ----------------------------------------------------------------------------------------
# while_loop and fori_loop


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_while_loop(mode):
    def f(w, x):
        def cond(c):
            return c[0] < 4

        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        return lax.while_loop(cond, body, (0, x))

    check_mode(mode, f, scaled_lora(5, 5), X)


def test_while_loop_jvp():
    lora = scaled_lora(5, 5)

    def f(w, x):
        return lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x)
        )[1]

    tangent = jax.tree_util.tree_map(jnp.ones_like, lora)
    got = jax.jvp(lambda w: qax.use_implicit_args(f)(w, X), (lora,), (tangent,))

    def oracle(w):
        return f(dense(w), X)

    expected = jax.jvp(oracle, (lora,), (tangent,))
    assert_close(got, expected)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_while_loop_implicit_carry(mode):
    def f(z, x):
        return lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0, c[2] + c[1]), (0, z, x)
        )

    check_mode(mode, f, ClosedZeros(shape=(3, 5)), X)
    out = qax.use_implicit_args(f)(ClosedZeros(shape=(3, 5)), X)
    assert isinstance(out[1], ClosedZeros)


@pytest.mark.parametrize(
    ("mode", "static"),
    [("eager", True), ("jit_grad", True), ("jit", False)],
    ids=["static-eager", "static-jit_grad", "dynamic-jit"],
)
def test_fori_loop(mode, static):
    def f(w, x, n):
        return lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w) + i, x)

    n = 3 if static else jnp.int32(3)
    check_mode(mode, lambda w, x: f(w, x, n), scaled_lora(5, 5), X)


# ----------------------------------------------------------------------------------------
# checkpoint / remat


@pytest.mark.parametrize(
    ("mode", "policy"),
    [
        ("eager", None),
        ("jit_grad", None),
        ("jit_grad", jax.checkpoint_policies.checkpoint_dots),
        ("jit_grad", jax.checkpoint_policies.nothing_saveable),
        ("jit_grad", jax.checkpoint_policies.save_only_these_names("hidden")),
    ],
    ids=["eager", "jit_grad", "dots-jit_grad", "nothing-jit_grad", "names-jit_grad"],
)
def test_checkpoint(mode, policy):
    def f(w, x):
        @functools.partial(jax.checkpoint, policy=policy)
        def layer(w, x):
            h = checkpoint_name(jnp.sin(x @ w), "hidden")
            return jnp.tanh(h @ w)

        return layer(w, layer(w, x))

    check_mode(mode, f, scaled_lora(5, 5), X)


def test_checkpoint_name_on_implicit_value_keeps_it_implicit():
    def f(w, x):
        return x @ checkpoint_name(w, "weights")

    lora = scaled_lora()
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(lora, X)
    assert not forms_full_lora(jaxpr, 5, 6, 2)
    assert_close(qax.use_implicit_args(f)(lora, X), f(dense(lora), X))


# ----------------------------------------------------------------------------------------
# custom_jvp / custom_vjp


@jax.custom_jvp
def scaled_tanh_matmul(x, w):
    return jnp.tanh(x @ w)


@scaled_tanh_matmul.defjvp
def _scaled_tanh_matmul_jvp(primals, tangents):
    # Deliberately not the true derivative (twice it), so the test sees whose rule ran.
    x, w = primals
    dx, dw = tangents
    y = scaled_tanh_matmul(x, w)
    return y, 2.0 * (1 - y**2) * (dx @ w + x @ dw)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_custom_jvp_user_rule_with_multi_leaf_input(mode):
    check_mode(mode, lambda w, x: scaled_tanh_matmul(x, w), scaled_lora(), X)


@pytest.mark.parametrize(
    ("mode", "fn"),
    [
        ("eager", jax.nn.relu),
        ("jit", jax.nn.relu),
        ("grad", jax.nn.relu),
        ("jit_grad", jax.nn.relu),
        ("jit_grad", jax.nn.relu6),
        ("grad", jax.nn.softplus),
    ],
    ids=["relu-eager", "relu-jit", "relu-grad", "relu-jit_grad", "relu6", "softplus"],
)
def test_custom_jvp_nn_functions_honour_their_rule(mode, fn):
    # w + a @ b.T is exactly zero here: relu'(0) is 0 by relu's rule, 0.5 by max's.
    k = keys(2)
    lora = PlainMatmulLora(
        jnp.zeros((4, 4)), jnp.zeros((4, 2)), jax.random.normal(k[0], (4, 2))
    )
    lora = PlainMatmulLora(lora.w.at[0].set(1.0), lora.a, lora.b)
    with materializations() as found:
        check_mode(mode, lambda w: fn(w) * 3.0, lora)
    # Only the elementwise primitives inside fn lack PlainMatmulLora handlers; no structural one.
    assert not any(n in msg for msg in found for n in ("custom_jvp", "jit ", "pjit"))


def test_relu_of_symbolic_zeros_stays_implicit():
    out = qax.use_implicit_args(jax.nn.relu)(ClosedZeros(shape=(3,)))
    assert isinstance(out, ClosedZeros)

    def loss(x, z):
        return qax.use_implicit_args(lambda x, z: jnp.sum(jax.nn.relu(z) * x + x))(x, z)

    assert_close(jax.grad(loss)(jnp.ones(3), ClosedZeros(shape=(3,))), jnp.ones(3))


@jax.custom_jvp
def matmul_symbolic_rule(x, w):
    return x @ w


@functools.partial(matmul_symbolic_rule.defjvp, symbolic_zeros=True)
def _matmul_symbolic_rule_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    out = matmul_symbolic_rule(x, w)
    dout = jnp.zeros_like(out)
    if not isinstance(dx, jax.custom_derivatives.SymbolicZero):
        dout = dout + 3.0 * (dx @ w)  # deliberately three times the true derivative
    if not isinstance(dw, jax.custom_derivatives.SymbolicZero):
        dout = dout + x @ dw
    return out, dout


@pytest.mark.parametrize("argnums", [0, 1], ids=["wrt_implicit", "wrt_dense"])
def test_custom_jvp_with_symbolic_zeros(argnums):
    def f(w, x):
        return jnp.tanh(matmul_symbolic_rule(x, w))

    check_mode("jit_grad", f, scaled_lora(), X, argnums=argnums)


@jax.custom_vjp
def clipped_matmul(x, w):
    return x @ w


def _clipped_fwd(x, w):
    return x @ w, (x,)


def _clipped_bwd(res, g):
    (x,) = res
    g = jnp.clip(g, -0.5, 0.5)
    return g @ jnp.ones((6, 5)), x.T @ g


clipped_matmul.defvjp(_clipped_fwd, _clipped_bwd)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_custom_vjp_user_rule(mode):
    check_mode(
        mode, lambda w, x: jnp.tanh(clipped_matmul(x, w)) * 3.0, scaled_lora(), X
    )


@pytest.mark.parametrize("mode", ["jit_grad"])
def test_custom_vjp_gradient_wrt_dense_operand(mode):
    check_mode(
        mode,
        lambda w, x: jnp.tanh(clipped_matmul(x, w)) * 3.0,
        scaled_lora(),
        X,
        argnums=1,
    )


# ----------------------------------------------------------------------------------------
# call primitives and vmap inside


@pytest.mark.parametrize("mode", ["eager", "jit_grad"])
def test_closed_call(mode):
    from jax.extend.core import primitives

    inner = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(X, jnp.ones((5, 6)))

    def f(w, x):
        params = primitives.closed_call_p.get_bind_params(dict(call_jaxpr=inner))
        (out,) = primitives.closed_call_p.bind(x, w, **params)
        return out

    check_mode(mode, f, scaled_lora(), X)


@pytest.mark.parametrize("mode", ["eager", "jit_grad"])
def test_vmap_inside_over_dense_with_implicit_closure(mode):
    def f(w, x):
        return jax.vmap(lambda row: jnp.tanh(row @ w))(x)

    check_mode(mode, f, scaled_lora(), X)


def test_vmap_inside_over_symbolic_zeros():
    def f(z, x):
        return jax.vmap(lambda zi, xi: (zi * xi, zi + xi))(z, x)

    prod, total = qax.use_implicit_args(f)(ClosedZeros(shape=(3, 4)), jnp.ones((3, 4)))
    assert isinstance(prod, ClosedZeros) and prod.shape == (3, 4)
    assert_close(total, jnp.ones((3, 4)))


# ----------------------------------------------------------------------------------------
# Annotations applied leaf by leaf


def _single_device_rows():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))


ANNOTATIONS = {
    "name": lambda w: checkpoint_name(w, "w"),
    "optimization_barrier": lambda w: lax.optimization_barrier((w, 1.0))[0],
    "copy": jnp.copy,
    "device_put": jax.device_put,
    "sharding_constraint": lambda w: lax.with_sharding_constraint(
        w, _single_device_rows()
    ),
    "stop_gradient": lax.stop_gradient,
}


@pytest.mark.parametrize("primitive", list(ANNOTATIONS))
def test_annotation_applies_to_each_leaf(primitive):
    def f(w, x):
        return jnp.tanh(x @ ANNOTATIONS[primitive](w))

    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(scaled_lora(), X)
    applied = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == primitive]
    shapes = sorted(tuple(v.aval.shape) for e in applied for v in e.invars)
    # w, a and b. For a constraint by rows, `PlainMatmulLora` declares that w and a run along
    # the rows and b (6, 2) along the columns: b is constrained whole.
    expected = {"optimization_barrier": [(), (5, 2), (5, 6), (6, 2)]}
    assert shapes == expected.get(primitive, [(5, 2), (5, 6), (6, 2)])
    if primitive == "sharding_constraint":
        specs = {e.invars[0].aval.shape: e.params["sharding"].spec for e in applied}
        P = jax.sharding.PartitionSpec
        assert specs == {
            (5, 6): P("i", None),
            (5, 2): P("i", None),
            (6, 2): P(None, None),
        }
    assert not forms_full_lora(jaxpr, 5, 6, 2)


@pytest.mark.parametrize("mode", ["eager", "jit_grad"])
def test_annotations_keep_values_and_gradients(mode):
    def f(w, x):
        for name, annotate in ANNOTATIONS.items():
            if name != "stop_gradient":
                w = annotate(w)
        return jnp.tanh(x @ w)

    check_mode(mode, f, scaled_lora(), X)


def test_stop_gradient_on_implicit_blocks_leaf_gradients():
    def loss(w):
        return jnp.sum(
            qax.use_implicit_args(lambda w, x: x @ lax.stop_gradient(w))(w, X)
        )

    grads = jax.grad(loss)(scaled_lora())
    for leaf in jax.tree_util.tree_leaves(grads):
        assert not np.any(np.asarray(leaf))


# ----------------------------------------------------------------------------------------
# LoRA training step: scan over layers, checkpointed layers, optax


def test_lora_training_step_keeps_weights_implicit():
    n_layers, d, rank = 3, 6, 2
    k = keys(4, 3)
    frozen = jax.random.normal(k[0], (n_layers, d, d)) / d
    params = {
        "a": jax.random.normal(k[1], (n_layers, d, rank)) * 0.1,
        "b": jax.random.normal(k[2], (n_layers, d, rank)) * 0.1,
    }
    x = jax.random.normal(k[3], (4, d))
    y = jnp.ones((4, d))

    def model(ws, x):
        @jax.checkpoint
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return lax.scan(layer, x, ws)[0]

    def loss(params, frozen, x, y):
        ws = PlainMatmulLora(frozen, params["a"], params["b"])
        pred = qax.use_implicit_args(model)(ws, x)
        return jnp.mean((pred - y) ** 2)

    def dense_loss(params, frozen, x, y):
        ws = frozen + params["a"] @ jnp.swapaxes(params["b"], -1, -2)
        return jnp.mean((model(ws, x) - y) ** 2)

    opt = optax.adam(1e-2)

    def step(loss_fn, params, opt_state):
        value, grads = jax.value_and_grad(loss_fn)(params, frozen, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    state = opt.init(params)
    got = jax.jit(functools.partial(step, loss))(params, state)
    expected = jax.jit(functools.partial(step, dense_loss))(params, state)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)

    jaxpr = jax.make_jaxpr(functools.partial(step, loss))(params, state)
    names = all_eqn_names(jaxpr)
    assert "scan" in names and "remat2" in names
    assert not forms_full_lora(jaxpr, d, d, rank)
    assert not weight_shaped_sums(jaxpr, [(d, d), (n_layers, d, d)])


# ----------------------------------------------------------------------------------------
# get_common_prefix_transforms


def test_common_prefix_keeps_what_agrees():
    w, b = jnp.ones((3, 4)), jnp.ones((4, 2))
    t1 = [PlainMatmulLora(w, ClosedZeros(shape=(3, 2)), b), ClosedZeros(shape=(2,))]
    t2 = [PlainMatmulLora(w, jnp.ones((3, 2)), b), ClosedZeros(shape=(2,))]
    f1, f2 = _structure.get_common_prefix_transforms([t1, t2])
    out1, out2 = f1(t1), f2(t2)
    assert isinstance(out1[0], PlainMatmulLora) and not isinstance(
        out1[0].a, qax.ImplicitArray
    )
    assert isinstance(out1[1], ClosedZeros) and isinstance(out2[1], ClosedZeros)
    assert_close(out1[0].a, jnp.zeros((3, 2)))
    assert out2[0] is t2[0] or isinstance(out2[0].a, jax.Array)


@pytest.mark.parametrize(
    "other",
    [
        lambda: jnp.ones((3, 4)),
        lambda: ClosedZeros(shape=(3, 4)),
        lambda: PlainMatmulLora(jnp.ones((3, 4)), jnp.ones((3, 1)), jnp.ones((4, 1))),
    ],
    ids=["dense", "other_type", "other_rank"],
)
def test_common_prefix_materializes_what_differs(other):
    lora = PlainMatmulLora(jnp.ones((3, 4)), jnp.ones((3, 2)), jnp.ones((4, 2)))
    f1, f2 = _structure.get_common_prefix_transforms([lora, other()])
    assert not isinstance(f1(lora), qax.ImplicitArray)
    assert not isinstance(f2(other()), qax.ImplicitArray)


def test_common_prefix_rejects_incompatible_trees():
    with pytest.raises(ValueError, match="shapes or dtypes"):
        _structure.get_common_prefix_transforms([ClosedZeros(shape=(2,)), jnp.ones(3)])
    with pytest.raises(ValueError, match="structure"):
        _structure.get_common_prefix_transforms([[jnp.ones(2)], (jnp.ones(2),)])


# ----------------------------------------------------------------------------------------
# The built-in symbolic constants through control flow


def test_symbolic_constants_through_control_flow():
    from qax.symbols import SymbolicConstant

    zeros = SymbolicConstant(0.0, shape=(5, 4), dtype=jnp.float32)
    twos = SymbolicConstant(2.0, shape=(5, 4), dtype=jnp.float32)

    def f(zs, ts, c):
        c, ys = lax.scan(lambda c, z: (c + z, jax.nn.relu(z) * 3.0), c, zs)
        same = lax.cond(c.sum() > 0, lambda t: t + 0.0, lambda t: t * 1.0, ts)
        return c, ys, same

    for run in (qax.use_implicit_args(f), jax.jit(qax.use_implicit_args(f))):
        c, ys, same = run(zeros, twos, jnp.ones(4))
        assert isinstance(ys, SymbolicConstant) and ys.shape == (5, 4)
        assert isinstance(same, SymbolicConstant) and same.value == 2.0
        assert_close(c, jnp.ones(4))


# ----------------------------------------------------------------------------------------
# Loop carries whose implicit structure changes reach a fixed point (materialized)

_LOOPS = {
    "scan": lambda body, c: lax.scan(lambda c, _: (body(c), None), c, None, length=3)[
        0
    ],
    "fori_loop": lambda body, c: lax.fori_loop(0, 3, lambda i, c: body(c), c),
    "while_loop": lambda body, c: lax.while_loop(
        lambda ic: ic[0] < 3, lambda ic: (ic[0] + 1, body(ic[1])), (0, c)
    )[1],
}


def _symbolic_zero_lora():
    from qax.symbols import SymbolicConstant

    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    w = SymbolicConstant(0.0, shape=(4, 3), dtype=jnp.float32)
    return qax.lora.LoraWeight(
        w, jax.random.normal(k1, (4, 2)), jax.random.normal(k2, (2, 3))
    )


_CARRIES = {
    # SymbolicConstant(0.0) -> SymbolicConstant(1.0) -> ...: the value is static
    "constant_plus_one": (
        lambda: qax.symbols.SymbolicConstant(0.0, shape=(3,), dtype=jnp.float32),
        lambda c: c + 1.0,
    ),
    "constant_to_dense": (
        lambda: qax.symbols.SymbolicConstant(0.0, shape=(3,), dtype=jnp.float32),
        lambda c: c + jnp.arange(3.0),
    ),
    "lora_symbolic_w_plus_one": (_symbolic_zero_lora, lambda c: c + 1.0),
    "lora_symbolic_w_sin": (_symbolic_zero_lora, jnp.sin),
}


@pytest.mark.parametrize("loop", list(_LOOPS))
@pytest.mark.parametrize("case", list(_CARRIES))
def test_loop_carry_changing_structure_runs_with_the_dense_answer(loop, case):
    make, body = _CARRIES[case]
    carry = make()

    def f(c):
        return _LOOPS[loop](body, c)

    for run in (qax.use_implicit_args(f), jax.jit(qax.use_implicit_args(f))):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", qax.MaterializationWarning)
            got = run(carry)
        assert any("carry" in str(w.message) for w in seen)
        assert_close(dense(got), f(dense(carry)))


@pytest.mark.parametrize("loop", list(_LOOPS))
def test_a_carry_built_inside_changing_structure_runs_as_an_argument_does(loop):
    # Built inside the wrapped function, the carry is a value of the trace, as an
    # implicit argument is: JAX's loops see one array, and qax materializes the carry
    # down to the structure the body gives back.
    def f(x):
        init = qax.symbols.SymbolicConstant(0.0, shape=(3,), dtype=jnp.float32)
        return _LOOPS[loop](lambda c: c + x, init)

    g = qax.use_implicit_args(lambda init, x: _LOOPS[loop](lambda c: c + x, init))
    init = qax.symbols.SymbolicConstant(0.0, shape=(3,), dtype=jnp.float32)
    for run, args in (
        (qax.use_implicit_args(f), ()),
        (jax.jit(qax.use_implicit_args(f)), ()),
        (g, (init,)),
    ):
        with pytest.warns(qax.MaterializationWarning, match="carry"):
            got = run(*args, jnp.arange(3.0))
        assert_close(got, 3.0 * jnp.arange(3.0))


def test_an_unrelated_structure_error_gets_no_note():
    def f(x):
        return lax.scan(lambda c, _: ((c, c), None), x, None, length=2)

    with pytest.raises(TypeError, match="pytree structure") as info:
        qax.use_implicit_args(f)(jnp.ones(3))
    assert not any("qax:" in n for n in getattr(info.value, "__notes__", []))
