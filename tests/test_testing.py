"""`qax.testing.check_handler` catches wrong handlers and passes right ones."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

import qax
from qax.testing import HandlerCheckError, check_handler
from tests.helpers import PlainMatmulLora, Zeros, is_plain_matmul, make_lora

KEYS = jax.random.split(jax.random.PRNGKey(1), 3)
X = jax.random.normal(KEYS[0], (3, 5))
MATMUL = dict(
    dimension_numbers=(((1,), (0,)), ((), ())),
    precision=None,
    preferred_element_type=jnp.float32,
    out_sharding=None,
)


class ForgetsLowRank(PlainMatmulLora):
    pass


class DropsAColumn(PlainMatmulLora):
    pass


class WrongDtype(PlainMatmulLora):
    pass


class BlocksGradient(PlainMatmulLora):
    pass


class AlwaysPasses(PlainMatmulLora):
    pass


class NoMatmulHandler(PlainMatmulLora):
    pass


def matmul_parts(x, w, dimension_numbers, params):
    dense = qax.default_handler(
        "dot_general", x, w.w, dimension_numbers=dimension_numbers, **params
    )
    return dense, (x @ w.a) @ w.b.T


@qax.primitive_handler("dot_general")
def forgets_low_rank(
    primitive, x: jax.Array, w: ForgetsLowRank, *, dimension_numbers, **params
):
    dense, _ = matmul_parts(x, w, dimension_numbers, params)
    return dense


@qax.primitive_handler("dot_general")
def drops_a_column(
    primitive, x: jax.Array, w: DropsAColumn, *, dimension_numbers, **params
):
    dense, low_rank = matmul_parts(x, w, dimension_numbers, params)
    return (dense + low_rank)[:, :-1]


@qax.primitive_handler("dot_general")
def wrong_dtype(primitive, x: jax.Array, w: WrongDtype, *, dimension_numbers, **params):
    dense, low_rank = matmul_parts(x, w, dimension_numbers, params)
    return (dense + low_rank).astype(jnp.float16)


@qax.primitive_handler("dot_general")
def blocks_gradient(
    primitive, x: jax.Array, w: BlocksGradient, *, dimension_numbers, **params
):
    """Right values, but no gradient reaches `w.a`."""
    dense, _ = matmul_parts(x, w, dimension_numbers, params)
    return dense + (x @ jax.lax.stop_gradient(w.a)) @ w.b.T


@qax.primitive_handler("dot_general")
def always_passes(primitive, x: jax.Array, w: AlwaysPasses, **params):
    return NotImplemented


def test_right_handler_passes_under_every_transformation():
    result = check_handler(
        "dot_general", X, make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora), **MATMUL
    )
    assert result.checks == (
        ("eager", "passed"),
        ("jit", "passed"),
        ("vmap", "passed"),
        ("grad", "passed"),
    )
    assert result.primitive == "dot_general" and "lora_matmul" in result.handler
    assert result.materializations == ()
    assert (
        str(result)
        .splitlines()[0]
        .startswith("check_handler('dot_general'): plain_matmul_lora_matmul")
    )


def test_wrong_values_are_caught():
    w = make_lora(KEYS[1], 5, 7, cls=ForgetsLowRank)
    with pytest.raises(
        HandlerCheckError,
        match=r"forgets_low_rank .* under eager: the result values differ",
    ):
        check_handler("dot_general", X, w, **MATMUL)


def test_wrong_shape_is_caught():
    w = make_lora(KEYS[1], 5, 7, cls=DropsAColumn)
    with pytest.raises(HandlerCheckError, match="wrong shape") as info:
        check_handler("dot_general", X, w, **MATMUL)
    assert "returned float32[3, 6]" in str(info.value)


def test_wrong_dtype_is_caught():
    w = make_lora(KEYS[1], 5, 7, cls=WrongDtype)
    with pytest.raises(HandlerCheckError, match="wrong shape, dtype") as info:
        check_handler("dot_general", X, w, **MATMUL)
    assert "returned float16[3, 7]" in str(info.value)


def test_wrong_gradient_is_caught_although_values_are_right():
    w = make_lora(KEYS[1], 5, 7, cls=BlocksGradient)
    with pytest.raises(
        HandlerCheckError, match="under grad: the gradient 2 values differ"
    ):
        check_handler("dot_general", X, w, **MATMUL)


def test_a_handler_that_passes_is_not_a_pass():
    w = make_lora(KEYS[1], 5, 7, cls=AlwaysPasses)
    with pytest.raises(HandlerCheckError, match="did not handle the example inputs"):
        check_handler("dot_general", X, w, **MATMUL)


def test_unsupported_dimension_numbers_fall_back_and_are_reported():
    w = make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora)
    y = jax.random.normal(KEYS[2], (3, 7))
    params = dict(MATMUL, dimension_numbers=(((1,), (1,)), ((), ())))
    assert not is_plain_matmul(y, params["dimension_numbers"])
    with pytest.raises(HandlerCheckError, match="returned NotImplemented"):
        check_handler("dot_general", y, w, **params)


def test_no_handler():
    with pytest.raises(HandlerCheckError, match="no handler applies") as info:
        check_handler("cos", make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora))
    assert "qax.explain('cos', PlainMatmulLora)" in str(info.value)


def test_missing_params_say_how_to_find_them():
    with pytest.raises(ValueError, match="jax.make_jaxpr"):
        check_handler("dot_general", X, make_lora(KEYS[1], 5, 7, cls=PlainMatmulLora))


def test_needs_an_implicit_argument():
    with pytest.raises(ValueError, match="at least one implicit array"):
        check_handler("mul", jnp.ones(2), jnp.ones(2), out_dtype=None)


@pytest.mark.parametrize(
    "dtype, grad",
    [(jnp.float32, "passed"), (jnp.int32, "skipped: no floating-point input")],
    ids=["float", "int"],
)
def test_elementwise_handler_either_operand_order(dtype, grad):
    z = Zeros(shape=(2, 3), dtype=dtype)
    x = jnp.arange(6, dtype=dtype).reshape(2, 3)
    for args in [(z, x), (x, z)]:
        result = check_handler("mul", *args, out_dtype=None)
        assert dict(result.checks)["grad"] == grad
        assert dict(result.checks)["vmap"] == "passed"


def test_tolerances_can_be_set():
    w = make_lora(KEYS[1], 5, 7, cls=ForgetsLowRank)
    with pytest.raises(HandlerCheckError, match="rtol=1e-09"):
        check_handler("dot_general", X, w, rtol=1e-9, atol=0.0, **MATMUL)


@dataclass
class PlainShift(qax.ImplicitArray):
    """No batch declaration: `vmap` hands its handlers one example at a time."""

    x: qax.ArrayValue
    c: qax.ArrayValue

    def materialize(self):
        return self.x + self.c


@qax.primitive_handler("mul")
def plain_shift_mul(primitive, a: PlainShift, b: jax.Array):
    return a.x * b + a.c * b


def test_types_that_declare_nothing_are_checked_under_vmap_too():
    value = PlainShift(jax.random.normal(KEYS[0], (3, 4)), jnp.asarray(0.5))
    result = check_handler("mul", value, jax.random.normal(KEYS[1], (3, 4)))
    assert dict(result.checks)["vmap"] == "passed"
