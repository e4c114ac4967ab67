"""Walkthroughs: the flows of the original Qax how-to and the Quax tutorials, written with
this API and checked against materialized oracles."""

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

import qax
from tests.helpers import LoraMatrix, NeverMaterialize, Zeros, assert_close

# -- The Qax how-to ----------------------------------------------------------------------


def test_howto_zeros_flow_under_jit_returns_zeros():
    z = Zeros(shape=(2, 3))
    f = qax.use_implicit_args(lambda x, y: (x + y)[0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(f(z, jnp.ones(3)), 1.0)
    g = jax.jit(qax.use_implicit_args(lambda x, y: (1 + x) * y))
    out = g(z, z)
    assert isinstance(out, Zeros) and out.shape == (2, 3)


def test_howto_lora_validation_in_post_init():
    @dataclass
    class ValidatedLora(qax.ImplicitArray):
        w: qax.ArrayValue
        a: qax.ArrayValue
        b: qax.ArrayValue
        is_array_happy: bool = qax.aux_field(default=True)

        def __post_init__(self):
            super().__post_init__()
            if self.a.shape[1] != self.b.shape[1] or self.a.shape[0] != self.w.shape[0]:
                raise ValueError("LoRA factors do not match the weight")

        def materialize(self):
            return self.w + self.a @ self.b.T

    ValidatedLora(jnp.ones((3, 4)), jnp.ones((3, 2)), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="do not match"):
        ValidatedLora(
            jnp.ones((3, 4)),
            jnp.ones((3, 2)),
            jnp.ones((4, 3)),
            shape=(3, 4),
            dtype=jnp.float32,
        )
    # without a declared shape, inference from materialize() fails first, and says why
    with pytest.raises(qax.UninitializedAval, match="contracting dimensions"):
        ValidatedLora(jnp.ones((3, 4)), jnp.ones((3, 2)), jnp.ones((4, 3)))


def test_howto_lora_dot_general_falls_back_for_other_contractions():
    lora = LoraMatrix(jnp.ones((3, 4)), jnp.ones((3, 2)), jnp.zeros((4, 2)))
    x = jnp.arange(3.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(
            qax.use_implicit_args(lambda w: x @ w)(lora), x @ lora.materialize()
        )
    batched = lambda w: jnp.einsum("ij,ij->j", w, w)  # noqa: E731
    with pytest.warns(
        qax.MaterializationWarning,
        match="dot_general was not handled by class LoraMatrix",
    ):
        out = qax.use_implicit_args(batched)(lora)
    assert_close(out, batched(lora.materialize()))


def test_howto_nesting_lora_with_symbolic_zeros():
    w = jnp.ones((3, 5))
    x = jnp.arange(3, dtype=jnp.float32)
    nested = LoraMatrix(w=w, a=Zeros(shape=(3, 6)), b=Zeros(shape=(5, 6)))
    g = qax.use_implicit_args(lambda w, x: jnp.sum(x @ w))
    with pytest.warns(qax.MaterializationWarning) as record:
        out = g(nested, x)
    assert_close(out, 15.0)
    assert {str(r.message).split()[1] for r in record} <= {"dot_general", "transpose"}


# -- Tutorial: re-dispatch to a type written by someone else -----------------------------


# The tutorial's own LoRA: it refuses to materialize and its one handler is `W @ y` for
# a vector `y`, re-dispatching on `y`'s type (not the shared `LoraMatrix`'s `x @ W`).
@dataclass
class RankOneLora(qax.ImplicitArray):
    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue

    def materialize(self):
        raise ValueError("Refusing to materialize RankOneLora")

    def compute_shape(self):
        return self.w.shape

    def compute_dtype(self):
        return self.w.dtype


def _lora_matvec(w, a, b, y):
    return w @ y + a * jnp.dot(b, y)


@qax.primitive_handler("dot_general")
def _rank_one_matvec(
    primitive, x: RankOneLora, y: qax.ArrayValue, *, dimension_numbers, **params
):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if (
        jnp.ndim(y) != 1
        or lhs_batch
        or rhs_batch
        or lhs_contract != (1,)
        or rhs_contract != (0,)
    ):
        return NotImplemented
    # Re-dispatch on the type of y, whatever it is.
    return qax.use_implicit_args(_lora_matvec)(x.w, x.a, x.b, y)


@dataclass
class OneHotVector(qax.ImplicitArray):
    """Written "by someone else": a vector with one non-zero value."""

    index: qax.ArrayValue
    value: qax.ArrayValue
    length: int = qax.aux_field(default=0)

    def compute_shape(self):
        return (self.length,)

    def compute_dtype(self):
        return jnp.result_type(self.value)

    def materialize(self):
        raise ValueError("Refusing to materialize OneHotVector")


@qax.primitive_handler("dot_general")
def _dense_times_one_hot(
    primitive, x: jax.Array, y: OneHotVector, *, dimension_numbers, **params
):
    if jnp.ndim(x) == 1:
        return x[y.index] * y.value
    return x[:, y.index] * y.value


def test_quax_redispatch_tutorial():
    lora = RankOneLora(jnp.ones((3, 4)), jnp.ones(3), jnp.ones(4))
    matmul = qax.use_implicit_args(lambda a, b: a @ b)
    assert_close(matmul(lora, jnp.arange(4.0)), jnp.array([12.0, 12.0, 12.0]))
    sparse = OneHotVector(jnp.array(2), jnp.array(5.0), length=4)
    assert_close(matmul(lora, sparse), jnp.array([10.0, 10.0, 10.0]))


def test_quax_ambiguity_tutorial_error_names_both_handlers():
    @dataclass
    class LeftLora(qax.ImplicitArray):
        w: qax.ArrayValue

        def materialize(self):
            return self.w

    @dataclass
    class RightSparse(qax.ImplicitArray):
        v: qax.ArrayValue

        def materialize(self):
            return self.v

    @qax.primitive_handler("dot_general")
    def lora_any(primitive, x: LeftLora, y: qax.ArrayValue, **params):
        return NotImplemented

    @qax.primitive_handler("dot_general")
    def any_sparse(primitive, x: qax.ArrayValue, y: RightSparse, **params):
        return NotImplemented

    with pytest.raises(
        qax.HandlerError, match="(?s)lora_any.*any_sparse|any_sparse.*lora_any"
    ):
        qax.use_implicit_args(lambda a, b: a @ b)(
            LeftLora(jnp.ones((2, 2))), RightSparse(jnp.ones(2))
        )


# -- Tutorial: a backward-pass tag as a per-type default rule ----------------------------
# The tag is `NeverMaterialize` (tests/helpers.py): its default rule wraps every result.


_tagged_matmuls = []


@qax.primitive_handler("dot_general")
def _tagged_matmul(primitive, lhs: NeverMaterialize, rhs: jax.Array, **params):
    _tagged_matmuls.append("lhs")
    return NeverMaterialize(primitive.bind(lhs.array, rhs, **params))


def tagged_value_and_grad(fn):
    def wrapped(arg):
        out, fn_vjp = jax.vjp(fn, arg)
        (grad,) = qax.use_implicit_args(fn_vjp)(NeverMaterialize(jnp.ones_like(out)))
        return out, grad.array if isinstance(grad, NeverMaterialize) else grad

    return wrapped


def test_backward_tag_tutorial():
    ws = [
        jax.random.normal(jax.random.PRNGKey(i), shape)
        for i, shape in enumerate([(2, 8), (8, 8), (8, 1)])
    ]

    def mlp(x):
        for w in ws[:-1]:
            x = jax.nn.tanh(x @ w)
        return (x @ ws[-1])[0]

    x = jnp.array([3.0, 4.0])
    _tagged_matmuls.clear()
    value, grad = tagged_value_and_grad(mlp)(x)
    ref_value, ref_grad = jax.value_and_grad(mlp)(x)
    assert_close(value, ref_value)
    assert_close(grad, ref_grad)
    assert len(_tagged_matmuls) == 3  # one matmul per layer in the backward pass


# -- Tutorial: a DiagonalArray ----------------------------------------------------------


@dataclass
class DiagonalArray(qax.ImplicitArray):
    diagonal: qax.ArrayValue

    def compute_shape(self):
        n = jnp.shape(self.diagonal)[0]
        return (n, n)

    def compute_dtype(self):
        return jnp.result_type(self.diagonal)

    def materialize(self):
        return jnp.diag(self.diagonal)


ZERO_PRESERVING = ["sin", "tanh", "neg", "abs", "sqrt", "expm1", "sign"]


@qax.primitive_handler(ZERO_PRESERVING)
def _diag_unary(primitive, d: DiagonalArray, **params):
    return DiagonalArray(primitive.bind(d.diagonal, **params))


@qax.primitive_handler("dot_general")
def _diag_matmul(
    primitive, d: DiagonalArray, x: jax.Array, *, dimension_numbers, **params
):
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lhs_contract != (1,) or rhs_contract != (0,) or lhs_batch or rhs_batch:
        return NotImplemented
    scale = d.diagonal.reshape((-1,) + (1,) * (x.ndim - 1))
    return (scale * x).astype(params.get("preferred_element_type") or x.dtype)


def test_diagonal_array_stays_diagonal():
    d = DiagonalArray(jnp.array([1.0, 2.0, 3.0]))
    x = jnp.arange(6.0).reshape(3, 2)
    out = qax.use_implicit_args(lambda d, x: d @ x)(d, x)
    assert_close(out, d.materialize() @ x)
    s = qax.use_implicit_args(lambda d: jnp.sin(jnp.tanh(d)))(d)
    assert isinstance(s, DiagonalArray)
    assert_close(s.materialize(), jnp.sin(jnp.tanh(d.materialize())))
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda d, x: d @ x))(d, x)
    assert "dot_general" not in str(jaxpr)


def test_diagonal_array_exp_falls_back_with_warning_under_jit_and_grad():
    d = DiagonalArray(jnp.array([1.0, 2.0, 3.0]))
    with pytest.warns(
        qax.MaterializationWarning,
        match="Primitive exp was not handled by class DiagonalArray",
    ):
        out = jax.jit(qax.use_implicit_args(jnp.exp))(d)
    assert_close(out, jnp.exp(jnp.diag(d.diagonal)))  # off-diagonal entries become 1

    def loss(d, x):
        return jnp.sum(jnp.sin(d) @ x)

    x = jnp.arange(6.0).reshape(3, 2)
    grad = jax.jit(jax.grad(qax.use_implicit_args(loss)))(d, x)
    expected = jax.grad(lambda v: loss(jnp.diag(v), x))(d.diagonal)
    assert_close(grad.diagonal, expected)
