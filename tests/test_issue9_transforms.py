"""Transformations meeting implicit arrays in less common ways (issue 9).

Custom derivative functions that close over implicit arrays, custom-VJP outputs that
stay implicit, implicit arrays created inside a transformation that runs inside
`use_implicit_args`, weak types of tangents, and symbolic scalars used as control
values. Oracle: the same program on materialized arrays; unexpected materialization is
an error (see setup.cfg).
"""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _ho_types import (
    HScaled,
    HZeros,
    assert_close,
    check_mode,
    dense,
    make_lora,
    materializations,
)
from jax import lax

import qax
from qax.symbols import SymbolicConstant

X = jax.random.normal(jax.random.PRNGKey(1), (3, 5))
ALL = ["eager", "jit", "grad", "jit_grad"]

# ----------------------------------------------------------------------------------------
# custom_jvp / custom_vjp closing over implicit arrays


def check_closure(mode, f, *args, argnums):
    """`check_mode`; under `jit` without JAX's leak checker.

    Under `jit`, JAX keeps a custom-derivative rule (and whatever it closes over, here
    a tracer of the `use_implicit_args` call) in the staged program; its leak checker
    flags the same for a plain traced array closed over under `jit` and `jit(grad)`
    (`test_dense_closure_leaks_under_jit_too`).
    """
    if mode.startswith("jit"):
        with jax.check_tracer_leaks(False):
            check_mode(mode, f, *args, argnums=argnums)
    else:
        check_mode(mode, f, *args, argnums=argnums)


def test_dense_closure_leaks_under_jit_too():
    w = dense(make_lora())
    grad = jax.grad(lambda w, x: _closing_custom_jvp(w, x).sum(), argnums=1)
    with jax.check_tracer_leaks(True):
        with pytest.raises(Exception, match="Leaked trace"):
            jax.jit(_closing_custom_jvp)(w, X)
        with pytest.raises(Exception, match="Leaked trace"):
            jax.jit(grad)(w, X)


def _closing_custom_jvp(w, x):
    @jax.custom_jvp
    def g(x):
        return jnp.tanh(x @ w)

    @g.defjvp
    def g_jvp(primals, tangents):
        # Twice the true derivative, so that a test sees whose rule ran.
        (x,), (dx,) = primals, tangents
        y = g(x)
        return y, 2.0 * (1 - y**2) * (dx @ w)

    return g(x)


@pytest.mark.parametrize("mode", ALL)
def test_custom_jvp_closing_over_implicit(mode):
    check_closure(mode, _closing_custom_jvp, make_lora(), X, argnums=1)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _nondiff_matmul(w, x):
    return jnp.tanh(x @ w)


@_nondiff_matmul.defjvp
def _nondiff_matmul_jvp(w, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _nondiff_matmul(w, x)
    return y, 3.0 * (1 - y**2) * (dx @ w)  # three times the true derivative


@pytest.mark.parametrize("mode", ALL)
def test_custom_jvp_implicit_nondiff_argnum(mode):
    check_closure(mode, _nondiff_matmul, make_lora(), X, argnums=1)


def test_custom_jvp_implicit_nondiff_argnum_gets_no_gradient():
    # JAX stops gradients through `nondiff_argnums`; so does the implicit version.
    check_closure("jit_grad", _nondiff_matmul, make_lora(), X, argnums=0)


def _lora_t_matmul(g, w):
    """``g @ w.T`` as the contraction the LoRA handler covers (no transpose of `w`)."""
    return lax.dot_general(g, w, (((1,), (1,)), ((), ())))


def _closing_custom_vjp(w, x):
    @jax.custom_vjp
    def k(x):
        return jnp.tanh(x @ w)

    def fwd(x):
        y = k(x)
        return y, y

    def bwd(y, g):
        g = jnp.clip(g * (1 - y**2), -0.1, 0.1)  # not the true derivative
        return (_lora_t_matmul(g, w),)

    k.defvjp(fwd, bwd)
    return k(x)


@pytest.mark.parametrize("mode", ALL)
def test_custom_vjp_closing_over_implicit(mode):
    w = helpers.make_lora(jax.random.PRNGKey(2))
    x = jax.random.normal(jax.random.PRNGKey(3), (3, 6))
    check_closure(mode, _closing_custom_vjp, w, x, argnums=1)


# ----------------------------------------------------------------------------------------
# custom_vjp outputs stay implicit unless differentiated


@jax.custom_vjp
def _double(s):
    return s * 2.0


def _double_fwd(s):
    return _double(s), None


def _double_bwd(_, g):
    return (g * 5.0,)  # deliberately not the true derivative


_double.defvjp(_double_fwd, _double_bwd)


def _scaled():
    return HScaled(jnp.arange(1.0, 4.0), jnp.asarray(3.0))


def test_custom_vjp_output_stays_implicit_when_not_differentiated():
    out = qax.use_implicit_args(lambda s: _double(s) * 4.0)(_scaled())
    assert isinstance(out, HScaled)  # the later `* 4.0` reached the HScaled handler
    assert_close(out, dense(_scaled()) * 8.0)


@pytest.mark.parametrize("transform", ["vmap", "grad_of_other_input"])
def test_custom_vjp_output_stays_implicit_under_non_staging_transforms(transform):
    if transform == "vmap":
        xs = jnp.arange(1.0, 3.0)

        def per_row(x):
            out = qax.use_implicit_args(lambda s: _double(s) * x)(_scaled())
            assert isinstance(out, HScaled)
            return dense(out)

        assert_close(jax.vmap(per_row)(xs), xs[:, None] * 2.0 * dense(_scaled()))
    else:  # the custom function's input is not differentiated: nothing to settle

        def loss(y):
            out = qax.use_implicit_args(lambda s, y: _double(s) * y)(_scaled(), y)
            assert isinstance(out, HScaled)
            return jnp.sum(dense(out))

        assert_close(jax.grad(loss)(2.0), jnp.sum(dense(_scaled())) * 2.0)


def test_custom_vjp_output_recorded_under_jit_is_materialized_and_honours_rule():
    # JAX may differentiate a recorded program later (here: `grad` of the `jit`), when
    # the rule must apply to a dense output; so under `jit` it is materialized.
    run = jax.jit(qax.use_implicit_args(_double))
    with materializations() as found:
        assert_close(run(_scaled()), dense(_scaled()) * 2.0)
    assert any("recorded" in msg for msg in found)

    def loss(f):
        return lambda s: jnp.sum(jnp.sin(f(s)))

    with materializations():
        got = jax.grad(loss(run))(_scaled())
    expected = jax.grad(loss(lambda s: _double(dense(s))))(_scaled())
    assert_close(got.x, expected.x)
    assert_close(got.s, expected.s)


@pytest.mark.parametrize("mode", ["grad", "jit_grad"])
def test_custom_vjp_output_differentiated_honours_rule(mode):
    with materializations() as found:
        check_mode(mode, _double, _scaled())
    assert found and all("_double" in msg for msg in found)


# ----------------------------------------------------------------------------------------
# Weak types


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jvp_tangent_at_weak_implicit_keeps_weak_type(jit):
    bf16 = jnp.ones(3, jnp.bfloat16)

    def f(w, t):
        _, tangent = jax.jvp(jnp.sin, (w,), (t,))
        return tangent * bf16, jax.typeof(tangent).weak_type

    w = SymbolicConstant(2.0, shape=(3,))
    assert w.aval.weak_type
    run = qax.use_implicit_args(f)
    if jit:
        run = jax.jit(run, static_argnums=())
    t = jnp.ones(3)
    (got, got_weak), (expected, expected_weak) = run(w, t), f(dense(w), t)
    assert got.dtype == expected.dtype == jnp.bfloat16
    assert bool(got_weak) == bool(expected_weak)
    assert_close(got, expected)


# ----------------------------------------------------------------------------------------
# Symbolic scalars as control values


def _cond(p, x):
    return lax.cond(p, jnp.sin, jnp.cos, x)


def _switch(i, x):
    return lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x)


def _index(i, x):
    return x[i] * 2.0


def _dynamic_slice(i, x):
    return lax.dynamic_slice(x, (i,), (2,))


CONTROL = [
    (_cond, SymbolicConstant(True, shape=())),
    (_cond, SymbolicConstant(False, shape=())),
    (_switch, SymbolicConstant(1, shape=())),
    (_switch, SymbolicConstant(7, shape=())),  # clamped, as lax.switch does
    (_index, SymbolicConstant(2, shape=())),
    (_index, SymbolicConstant(-1, shape=(), dtype=jnp.int32)),
    (_dynamic_slice, SymbolicConstant(1, shape=())),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
    ("f", "c"),
    CONTROL,
    ids=[
        "cond-true",
        "cond-false",
        "switch",
        "switch-clamped",
        "index",
        "neg",
        "slice",
    ],
)
def test_symbolic_scalar_as_control_value_is_silent(f, c, jit):
    x = jnp.arange(4.0)
    run = qax.use_implicit_args(f)
    if jit:
        run = jax.jit(run)
    with qax.materialization_policy(SymbolicConstant, "error"):
        got = run(c, x)
    assert_close(got, f(dense(c), x))


def test_cond_on_symbolic_predicate_keeps_the_chosen_branch_implicit():
    # Only the chosen branch runs, so its implicit output need not agree with the
    # other branch's structure.
    def f(p, z, x):
        return lax.cond(p, lambda z, x: z * x, lambda z, x: x + 1.0, z, x)

    z, x = HZeros(shape=(3,)), jnp.arange(3.0)
    out = qax.use_implicit_args(f)(SymbolicConstant(True, shape=()), z, x)
    assert isinstance(out, HZeros)
    out = qax.use_implicit_args(f)(SymbolicConstant(False, shape=()), z, x)
    assert_close(out, x + 1.0)


def test_symbolic_scalar_with_an_array_operand_still_warns():
    # Only rank-0 constants are literals; a constant array used where no handler
    # applies is still materialized with the standard warning.
    c = SymbolicConstant(1.0, shape=(4,))
    with materializations() as found:
        out = qax.use_implicit_args(jnp.cumsum)(c)
    assert_close(out, np.cumsum(np.ones(4)))
    assert any("cumsum" in msg for msg in found)


# ----------------------------------------------------------------------------------------
# Implicit arrays created inside a transformation that runs inside `use_implicit_args`


def _creates_zeros(x):
    z = HZeros(shape=(3,))
    y = z * x  # an HZeros, by its handler
    return jnp.sin(y) + x  # `jnp` on it must reach the handlers too


def _creates_constant(x):
    c = SymbolicConstant(2.0, shape=(3,)) * 3.0  # folded: a constant 6.0
    return jnp.sin(c) * x + jnp.cos(c)


def _returns_implicit(x):
    return jnp.sin(HZeros(shape=(3,)) * x)  # an HZeros, by the handlers


TRANSFORMS = {
    "jit": jax.jit,
    "vmap": jax.vmap,
    "checkpoint": jax.checkpoint,
    "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x))),
}


def _input(name):
    return jnp.arange(6.0).reshape(2, 3) if name == "vmap" else jnp.arange(1.0, 4.0)


@pytest.mark.parametrize("name", list(TRANSFORMS))
@pytest.mark.parametrize("f", [_creates_zeros, _creates_constant])
def test_implicit_created_inside_nested_transformation(name, f):
    if name == "grad" and f is _creates_zeros:
        pytest.skip("the derivative of sin needs cos, which HZeros has no handler for")
    transform, x = TRANSFORMS[name], _input(name)
    inside = qax.use_implicit_args(transform(f))(x)
    outside = transform(qax.use_implicit_args(f))(x)
    assert_close(inside, outside)
    assert_close(inside, transform(_dense_version(f))(x))


def _dense_version(f):
    """`f` with its implicit arrays replaced by the dense arrays they represent."""
    if f is _creates_zeros:
        return lambda x: jnp.sin(jnp.zeros(3) * x) + x
    return lambda x: jnp.sin(jnp.full(3, 6.0)) * x + jnp.cos(jnp.full(3, 6.0))


@pytest.mark.parametrize("name", ["jit", "checkpoint"])
def test_implicit_output_of_nested_transformation_stays_implicit(name):
    transform, x = TRANSFORMS[name], _input(name)
    inside = qax.use_implicit_args(transform(_returns_implicit))(x)
    outside = transform(qax.use_implicit_args(_returns_implicit))(x)
    assert isinstance(inside, HZeros) and isinstance(outside, HZeros)
    assert inside.shape == outside.shape == (3,)


def test_nested_jit_of_created_implicit_leaves_no_trace_in_jaxpr():
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(jax.jit(_creates_zeros)))(
        _input("jit")
    )
    names = [e.primitive.name for e in _all_eqns(jaxpr)]
    assert "qax_implicit" not in names
    assert "sin" not in names  # sin of the zeros was folded by the handler


def _all_eqns(jaxpr):
    from _ho_types import all_eqns

    return list(all_eqns(jaxpr))


def test_created_implicit_reaching_plain_jax_is_materialized_with_warning():
    # A jit traced inside `use_implicit_args` is reused outside of it: the value is
    # materialized there, with a warning that says so, and the numbers are right.
    f = jax.jit(_creates_zeros)
    x = _input("jit")
    assert_close(qax.use_implicit_args(f)(x), x)
    with materializations() as found:
        out = f(x)
    assert_close(out, x)
    assert any("outside of it" in msg for msg in found)


def test_created_implicit_from_differentiated_values_warns_and_is_right():
    def f(x):
        s = HScaled(x, 2.0)  # built from the differentiated input
        return jnp.sum(s * 3.0)

    x = _input("grad")
    with materializations() as found:
        got = qax.use_implicit_args(jax.grad(f))(x)
    assert_close(got, jnp.full(3, 6.0))
    assert any("jax.grad" in msg for msg in found)


def test_created_implicit_from_batched_values_warns_and_is_right():
    def f(x):
        return jnp.sum(HScaled(x, 2.0) * 3.0)

    xs = _input("vmap")
    with materializations() as found:
        got = qax.use_implicit_args(jax.vmap(f))(xs)
    assert_close(got, jnp.sum(xs, axis=1) * 6.0)
    assert any("jax.vmap" in msg for msg in found)


def _scan_creating(xs, g=_creates_zeros):
    def body(c, x):
        return c + g(x), None

    return lax.scan(body, jnp.zeros(3), xs)[0]


def _cond_creating(x, g=_creates_zeros):
    return lax.cond(x[0] > 0, g, jnp.cos, x)


def _while_creating(x, g=_creates_zeros):
    return lax.while_loop(lambda c: c[0] < 10.0, lambda c: g(c) + 1.0, x)


def _jit_of_scan_creating(xs, g=_creates_zeros):
    return jax.jit(functools.partial(_scan_creating, g=g))(xs)


@pytest.mark.parametrize(
    "f", [_scan_creating, _cond_creating, _while_creating, _jit_of_scan_creating]
)
def test_implicit_created_inside_control_flow_body(f):
    x = jnp.arange(6.0).reshape(2, 3) if "scan" in f.__name__ else jnp.arange(1.0, 4.0)
    expected = f(x, g=_dense_version(_creates_zeros))
    assert_close(qax.use_implicit_args(f)(x), expected)
    assert_close(jax.jit(qax.use_implicit_args(f))(x), expected)
