"""primitive_handler: multiple dispatch, precedence, fallbacks and errors."""

import re
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import primitives

import qax
from qax._dispatch import resolve_primitive
from tests.helpers import assert_close


def _simple_type(name, **class_kwargs):
    """A fresh implicit type (so handlers registered in one test never leak into another)."""

    def materialize(self):
        return self.x

    cls = type(
        name,
        (qax.ImplicitArray,),
        {"__annotations__": {"x": qax.ArrayValue}, "materialize": materialize},
        **class_kwargs,
    )
    return dataclass(cls)


def test_names_primitives_and_lists_register_and_decorator_returns_function():
    T = _simple_type("T1")
    calls = []

    def handler(primitive, a: T, *rest, **params):
        calls.append(primitive.name)
        return qax.default_handler(primitive, a.x, *rest, **params)

    assert qax.primitive_handler(["sin", jax.lax.cos_p])(handler) is handler
    qax.primitive_handler(jax.lax.exp_p)(handler)
    f = qax.use_implicit_args(lambda t: jnp.sin(t) + jnp.cos(t) + jnp.exp(t))
    t = T(jnp.arange(3.0))
    assert_close(f(t), jnp.sin(t.x) + jnp.cos(t.x) + jnp.exp(t.x))
    assert calls == ["sin", "cos", "exp"]


def test_unknown_primitive_name_suggests_close_names():
    with pytest.raises(
        ValueError,
        match=r"Unknown primitive name 'dot_genral'.*Did you mean 'dot_general'",
    ):
        qax.primitive_handler("dot_genral")
    with pytest.raises(TypeError, match="name"):
        qax.primitive_handler(3)


def test_aliases_and_non_lax_primitives_resolve():
    assert resolve_primitive("pjit").name == "jit"
    assert resolve_primitive("jit").name == "jit"
    assert resolve_primitive("custom_jvp_call").name == "custom_jvp_call"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("checkpoint", primitives.remat_p),
        ("remat", primitives.remat_p),
        ("remat2", primitives.remat_p),  # the primitive's own name
        ("pjit", primitives.jit_p),
        ("scan", jax.lax.scan_p),
        ("while", jax.lax.while_p),
        ("cond", jax.lax.cond_p),
    ],
)
def test_documented_names_resolve(name, expected):
    assert resolve_primitive(name) is expected


def test_every_name_in_qax_constants_resolves():
    for group in (
        qax.constants.COMMUTATIVE_OPS,
        qax.constants.ELEMENTWISE_UNOPS,
        qax.constants.ELEMENTWISE_BINOPS,
        qax.constants.REDUCTION_OPS,
        qax.constants.CUMULATIVE_REDUCTION_OPS,
    ):
        for name in group:
            assert resolve_primitive(name).name == name


def test_dispatch_is_over_all_positional_argument_types():
    A = _simple_type("A")
    B = _simple_type("B")
    seen = []

    @qax.primitive_handler("mul")
    def a_times_array(primitive, a: A, b: jax.Array):
        seen.append("A*array")
        return a.x * b

    @qax.primitive_handler("mul")
    def a_times_b(primitive, a: A, b: B):
        seen.append("A*B")
        return a.x * b.x

    f = qax.use_implicit_args(lambda u, v: u * v)
    a, b = A(jnp.arange(3.0)), B(jnp.ones(3) * 2)
    assert_close(f(a, jnp.ones(3)), a.x)
    assert_close(f(a, b), a.x * 2)
    assert seen == ["A*array", "A*B"]


def test_precedence_breaks_ties_and_ambiguity_names_both_handlers():
    L = _simple_type("L")
    S = _simple_type("S")

    @qax.primitive_handler("add")
    def l_first(primitive, a: L, b: qax.ArrayValue):
        return a.x + qax.materialize_nested(b) if isinstance(b, S) else a.x + b

    @qax.primitive_handler("add")
    def s_second(primitive, a: qax.ArrayValue, b: S):
        return b.x * 0 - 1

    f = qax.use_implicit_args(lambda u, v: u + v)
    l_val, s_val = L(jnp.ones(2)), S(jnp.ones(2))
    with pytest.raises(qax.HandlerError) as info:
        f(l_val, s_val)
    message = str(info.value)
    assert "l_first" in message and "s_second" in message
    # Readable annotated types, not plum's raw signatures cut mid-word.
    assert "l_first(primitive, a: L, b: qax.ArrayValue) at " in message
    assert "s_second(primitive, a: qax.ArrayValue, b: S) at " in message
    assert "Signature(" not in message and "typing.Union" not in message
    assert (
        "precedence=" in message
        and "use_implicit_args" in message
        and "qax.explain" in message
    )

    @qax.primitive_handler("add", precedence=1)
    def s_wins(primitive, a: qax.ArrayValue, b: S):
        return b.x * 0 - 1

    assert_close(f(l_val, s_val), -jnp.ones(2))


def test_not_implemented_falls_back_to_materialization_with_warning():
    T = _simple_type("NotImpl")

    @qax.primitive_handler("sin")
    def only_vectors(primitive, a: T, **params):
        if a.ndim != 1:
            return NotImplemented
        return jnp.full(a.shape, 7.0)

    f = qax.use_implicit_args(jnp.sin)
    assert_close(f(T(jnp.ones(3))), jnp.full(3, 7.0))
    with pytest.warns(qax.MaterializationWarning) as record:
        out = f(T(jnp.ones((2, 2))))
    assert_close(out, jnp.sin(jnp.ones((2, 2))))
    # The original Qax's text, then which argument it was (issue 36, 1).
    assert str(record[0].message) == (
        "Primitive sin was not handled by class NotImpl, so implicit args will be "
        "materialized. The NotImpl is argument 0."
    )
    assert issubclass(qax.MaterializationWarning, UserWarning)
    assert record[0].filename == __file__  # points at the user's line, not into JAX


def test_commutative_ops_put_the_implicit_operand_first():
    T = _simple_type("Comm")
    order = []

    @qax.primitive_handler(["mul", "sub"])
    def handler(primitive, a: T, b: jax.Array):
        order.append(primitive.name)
        return qax.default_handler(primitive, a.x, b)

    f = qax.use_implicit_args(lambda u, v: v * u)
    t = T(jnp.arange(3.0))
    assert_close(f(t, jnp.ones(3) * 2), t.x * 2)
    assert order == ["mul"]
    # sub is not commutative: `array - T` finds no handler and materializes
    with pytest.warns(qax.MaterializationWarning, match="sub"):
        qax.use_implicit_args(lambda u, v: v - u)(t, jnp.ones(3))


def test_commute_ops_false_opts_out():
    T = _simple_type("NoComm", commute_ops=False)

    @qax.primitive_handler("mul")
    def handler(primitive, a: T, b: jax.Array):
        return a.x * b

    t = T(jnp.arange(3.0))
    assert_close(qax.use_implicit_args(lambda u: u * 2.0)(t), t.x * 2)
    with pytest.warns(
        qax.MaterializationWarning, match="mul was not handled by class NoComm"
    ):
        qax.use_implicit_args(lambda u: 2.0 * u)(t)


def test_handler_may_call_jnp_on_nested_implicit_values():
    Outer = _simple_type("Outer")
    Inner = _simple_type("Inner")
    inner_calls = []

    @qax.primitive_handler("neg")
    def inner_neg(primitive, a: Inner):
        inner_calls.append(1)
        return -a.x

    @qax.primitive_handler("neg")
    def outer_neg(primitive, a: Outer):
        return jnp.negative(a.x) * 10  # a.x is implicit: re-dispatched to inner_neg

    value = Outer(Inner(jnp.arange(3.0)))
    out = qax.use_implicit_args(lambda v: -v)(value)
    assert_close(out, -jnp.arange(3.0) * 10)
    assert inner_calls == [1]


def test_handler_result_with_wrong_shape_or_dtype_is_reported():
    T = _simple_type("Bad")

    @qax.primitive_handler("cos")
    def wrong_shape(primitive, a: T, **params):
        return jnp.zeros((5,))

    @qax.primitive_handler("tan")
    def wrong_dtype(primitive, a: T, **params):
        return jnp.zeros(a.shape, jnp.int32)

    t = T(jnp.ones(3))
    with pytest.raises(
        qax.HandlerError,
        match=r"wrong_shape.*returned float32\[5\].*produces float32\[3\]",
    ):
        qax.use_implicit_args(jnp.cos)(t)
    with pytest.raises(qax.HandlerError, match=r"wrong_dtype.*returned int32\[3\]"):
        qax.use_implicit_args(jnp.tan)(t)


def test_handler_without_params_keyword_gets_only_what_it_accepts():
    T = _simple_type("Strict")

    @qax.primitive_handler("mul")
    def no_params(primitive, a: T, b):  # `mul` has an `out_dtype` parameter (None)
        return a.x * b

    assert_close(
        qax.use_implicit_args(lambda u: u * 3.0)(T(jnp.ones(2))), 3 * jnp.ones(2)
    )


def test_dispatch_cache_is_invalidated_by_new_registrations():
    T = _simple_type("Late")
    f = qax.use_implicit_args(jnp.floor)
    with pytest.warns(qax.MaterializationWarning):
        f(T(jnp.ones(2) * 1.5))

    @qax.primitive_handler("floor")
    def handler(primitive, a: T, **params):
        return jnp.full(a.shape, 42.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(f(T(jnp.ones(2))), jnp.full(2, 42.0))


def test_default_handler_refuses_implicit_operands_with_a_clear_message():
    T = _simple_type("Refused")

    @qax.primitive_handler("sign")
    def handler(primitive, a: T, **params):
        return qax.default_handler(primitive, a, **params)

    with pytest.raises(TypeError, match=re.escape("qax.default_handler(sign, ...)")):
        qax.use_implicit_args(jnp.sign)(T(jnp.ones(2)))


def test_did_you_mean_matmul_points_at_dot_general():
    with pytest.raises(ValueError, match=r"Did you mean 'dot_general'"):
        qax.primitive_handler("matmul")
