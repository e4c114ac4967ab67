"""Custom derivatives meeting implicit arrays.

`custom_jvp` / `custom_vjp` functions that close over implicit arrays (or take one as a
non-differentiated argument), and custom-VJP outputs that stay implicit unless they are
differentiated. Oracle: the same program on materialized arrays; unexpected
materialization is an error (see setup.cfg).
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import qax
from tests.helpers import (
    ALL_MODES,
    Scaled,
    assert_close,
    check_mode,
    dense,
    make_lora,
    materializations,
    scaled_lora,
)

X = jax.random.normal(jax.random.PRNGKey(1), (3, 5))

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
    w = dense(scaled_lora())
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


@pytest.mark.parametrize("mode", ALL_MODES)
def test_custom_jvp_closing_over_implicit(mode):
    check_closure(mode, _closing_custom_jvp, scaled_lora(), X, argnums=1)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _nondiff_matmul(w, x):
    return jnp.tanh(x @ w)


@_nondiff_matmul.defjvp
def _nondiff_matmul_jvp(w, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _nondiff_matmul(w, x)
    return y, 3.0 * (1 - y**2) * (dx @ w)  # three times the true derivative


@pytest.mark.parametrize("mode", ALL_MODES)
def test_custom_jvp_implicit_nondiff_argnum(mode):
    check_closure(mode, _nondiff_matmul, scaled_lora(), X, argnums=1)


def test_custom_jvp_implicit_nondiff_argnum_gets_no_gradient():
    # JAX stops gradients through `nondiff_argnums`; so does the implicit version.
    check_closure("jit_grad", _nondiff_matmul, scaled_lora(), X, argnums=0)


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


@pytest.mark.parametrize("mode", ALL_MODES)
def test_custom_vjp_closing_over_implicit(mode):
    w = make_lora(jax.random.PRNGKey(2))
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
    return Scaled(jnp.arange(1.0, 4.0), jnp.asarray(3.0))


def test_custom_vjp_output_stays_implicit_when_not_differentiated():
    out = qax.use_implicit_args(lambda s: _double(s) * 4.0)(_scaled())
    assert isinstance(out, Scaled)  # the later `* 4.0` reached the Scaled handler
    assert_close(out, dense(_scaled()) * 8.0)


@pytest.mark.parametrize("transform", ["vmap", "grad_of_other_input"])
def test_custom_vjp_output_stays_implicit_under_non_staging_transforms(transform):
    if transform == "vmap":
        xs = jnp.arange(1.0, 3.0)

        def per_row(x):
            out = qax.use_implicit_args(lambda s: _double(s) * x)(_scaled())
            assert isinstance(out, Scaled)
            return dense(out)

        assert_close(jax.vmap(per_row)(xs), xs[:, None] * 2.0 * dense(_scaled()))
    else:  # the custom function's input is not differentiated: nothing to settle

        def loss(y):
            out = qax.use_implicit_args(lambda s, y: _double(s) * y)(_scaled(), y)
            assert isinstance(out, Scaled)
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
