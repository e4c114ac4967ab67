"""`qax.explain`: candidates, the chosen handler, precedence, and why the others lost."""

import re
from typing import Union

import jax
import jax.numpy as jnp
import pytest

import qax


class Ex(qax.ImplicitArray):
    default_dtype = jnp.float32

    def materialize(self):
        return jnp.full(self.shape, 2.0, self.dtype)


class ExChild(Ex):
    pass


class ExOther(qax.ImplicitArray):
    """Unrelated to `Ex`: keeps the `rem` handlers below from matching other tests' types."""

    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


class ExDefault(Ex):
    @classmethod
    def default_handler(cls, primitive, *args, params):
        return NotImplemented


# atan2: a base-class handler, a more specific one, and one for the other operand order.
@qax.primitive_handler("atan2")
def atan2_ex(primitive, a: Ex, b: jax.Array):
    return jnp.full(a.shape, 1.0)


@qax.primitive_handler("atan2")
def atan2_child(primitive, a: ExChild, b: jax.Array):
    return jnp.full(a.shape, 2.0)


@qax.primitive_handler("atan2")
def atan2_right(primitive, a: jax.Array, b: Ex):
    return jnp.full(b.shape, 3.0)


# rem: two incomparable signatures, precedence decides.
@qax.primitive_handler("rem")
def rem_low(primitive, a: Ex, b: qax.ArrayValue):
    return jnp.zeros(a.shape)


@qax.primitive_handler("rem", precedence=1)
def rem_high(primitive, a: Union[Ex, ExOther], b: jax.Array):  # noqa: UP007
    return jnp.ones(a.shape)


# nextafter: two incomparable signatures with equal precedence: ambiguous on (Ex, Ex).
@qax.primitive_handler("nextafter")
def nextafter_left(primitive, a: Ex, b: qax.ArrayValue):
    return jnp.zeros(a.shape)


@qax.primitive_handler("nextafter")
def nextafter_right(primitive, a: qax.ArrayValue, b: Ex):
    return jnp.zeros(a.shape)


# sub: a handler that takes any number of operands.
@qax.primitive_handler("sub")
def sub_varargs(primitive, a: ExChild, *rest: jax.Array):
    return jnp.zeros(a.shape)


@qax.primitive_handler("mul")
def mul_ex(primitive, a: ExChild, b: jax.Array):
    return jnp.zeros(jnp.broadcast_shapes(a.shape, b.shape))


def mine(explanation, *handlers):
    """The candidates of `explanation` for `handlers` (other tests register more)."""
    found = {c.handler: c for c in explanation.candidates}
    return [found[h] for h in handlers]


def test_most_specific_handler_is_chosen_and_the_others_say_why():
    e = qax.explain("atan2", ExChild, jax.Array)
    assert e.chosen is atan2_child and not e.ambiguous
    child, base, right = mine(e, atan2_child, atan2_ex, atan2_right)
    assert e.candidates[0] is child
    assert (child.outcome, child.signature, child.precedence) == (
        "chosen",
        "ExChild, Array",
        0,
    )
    assert base.outcome == "less specific" and "atan2_child" in base.reason
    assert right.outcome == "no match"
    assert right.reason == "operand 1 is ExChild, not Array"


def test_explain_agrees_with_dispatch():
    x = jnp.ones(3)
    got = qax.use_implicit_args(jax.lax.atan2)(ExChild(shape=(3,)), x)
    assert jnp.all(got == 2.0)
    assert qax.explain("atan2", ExChild(shape=(3,)), x).chosen is atan2_child
    got = qax.use_implicit_args(jax.lax.atan2)(Ex(shape=(3,)), x)
    assert jnp.all(got == 1.0)
    assert qax.explain(jax.lax.atan2_p, Ex, jnp.ndarray).chosen is atan2_ex


def test_precedence_breaks_a_tie():
    e = qax.explain("rem", Ex, jax.Array)
    assert e.chosen is rem_high
    high, low = mine(e, rem_high, rem_low)
    assert (high.outcome, high.precedence) == ("chosen", 1)
    assert low.outcome == "lower precedence" and "rem_high" in low.reason
    got = qax.use_implicit_args(jax.lax.rem)(Ex(shape=(2,)), jnp.ones(2))
    assert jnp.all(got == 1.0)


def test_ambiguity_is_explained_and_the_error_points_to_explain():
    e = qax.explain("nextafter", Ex, Ex)
    assert e.chosen is None and e.ambiguous
    left, right = mine(e, nextafter_left, nextafter_right)
    assert left.outcome == right.outcome == "ambiguous"
    assert "nextafter_right" in left.reason
    assert "Ambiguous" in str(e)
    with pytest.raises(qax.HandlerError, match=r'qax\.explain\("nextafter", Ex, Ex\)'):
        qax.use_implicit_args(jax.lax.nextafter)(Ex(shape=(2,)), Ex(shape=(2,)))


def test_arity_mismatch_and_varargs():
    e = qax.explain("atan2", ExChild)
    assert mine(e, atan2_child)[0].reason == "takes 2 operands, got 1"
    e = qax.explain("sub", ExChild, jax.Array)
    (varargs,) = mine(e, sub_varargs)
    assert varargs.outcome == "chosen" and varargs.signature == "ExChild, *Array"
    assert mine(qax.explain("sub", Ex, jax.Array), sub_varargs)[0].reason == (
        "operand 1 is Ex, not ExChild"
    )


def test_commutative_swap_is_shown():
    e = qax.explain("mul", jax.Array, ExChild)
    assert e.swapped and e.operand_types == (ExChild, jax.Array)
    assert e.chosen is mul_ex
    assert "swapped" in str(e)


def test_fallback_lists_materialization_with_the_policy_in_force():
    e = qax.explain("cos", Ex)
    assert e.chosen is None
    assert e.policies == {Ex: ("warn", "class default")}
    assert "Ex is materialized, with a MaterializationWarning (policy" in e.fallback[-1]
    with qax.materialization_policy(Ex, "error"):
        e = qax.explain("cos", Ex)
    assert e.policies[Ex][0] == "error"
    assert "raises MaterializationError" in str(e)


def test_fallback_mentions_default_handler_and_structural_rules():
    e = qax.explain("cos", ExDefault)
    assert e.fallback[0].startswith("ExDefault.default_handler")
    e = qax.explain("jit", Ex)
    assert e.fallback == (
        "the structural rule for jit runs its body on the implicit values (it "
        "materializes nothing itself)",
    )


def test_no_implicit_operand_and_printing():
    assert "qax does not intervene" in str(qax.explain("cos", jax.Array))
    text = str(qax.explain("atan2", ExChild, jax.Array))
    lines = text.splitlines()
    assert lines[0] == "qax.explain('atan2', ExChild, Array)"
    chosen = r"\[chosen\]\s+atan2_child\s+\(ExChild, Array\)\s+precedence=0"
    assert any(re.match(chosen, line.strip()) for line in lines)
    assert "=> atan2_child" in text
    assert repr(qax.explain("atan2", ExChild, jax.Array)) == text


def test_unknown_primitive_name():
    with pytest.raises(ValueError, match="Did you mean 'atan2'"):
        qax.explain("atann2", Ex)
