"""qax.constants: names exist, and a handler per primitive matches the materialized oracle."""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax import constants

SETS = [
    "COMMUTATIVE_OPS",
    "ELEMENTWISE_UNOPS",
    "ELEMENTWISE_BINOPS",
    "REDUCTION_OPS",
    "CUMULATIVE_REDUCTION_OPS",
]


@pytest.mark.parametrize("name", SETS)
def test_every_name_is_a_lax_primitive(name):
    missing = [n for n in getattr(constants, name) if not hasattr(jax.lax, f"{n}_p")]
    assert not missing
    if name == "COMMUTATIVE_OPS":
        assert constants.COMMUTATIVE_OPS <= constants.ELEMENTWISE_BINOPS


@dataclass
class Stacked(qax.ImplicitArray):
    """`jnp.stack(parts)`, kept as separate parts; handlers apply a primitive per part."""

    parts: list

    def materialize(self):
        return jnp.stack(self.parts)


def _split(value, k):
    if isinstance(value, Stacked):
        return value.parts
    if jnp.ndim(value) == 0:  # scalars broadcast against every part
        return [value] * k
    return [value[i] for i in range(k)]


@qax.primitive_handler(
    sorted(constants.ELEMENTWISE_UNOPS | constants.ELEMENTWISE_BINOPS)
)
def _per_part(primitive, x: Stacked, *rest: qax.ArrayValue, **params):
    k = len(x.parts)
    columns = zip(*(_split(v, k) for v in (x, *rest)))
    return Stacked([primitive.bind(*col, **params) for col in columns])


@qax.primitive_handler(sorted(constants.ELEMENTWISE_BINOPS))
def _per_part_right(primitive, x: jax.Array, y: Stacked, **params):
    parts = zip(_split(x, len(y.parts)), y.parts)
    return Stacked([primitive.bind(a, b, **params) for a, b in parts])


def _shift(axes):
    return tuple(a - 1 for a in axes)


@qax.primitive_handler(sorted(constants.REDUCTION_OPS))
def _reduce_per_part(primitive, x: Stacked, *, axes, **params):
    if 0 in axes:
        return NotImplemented
    return Stacked([primitive.bind(p, axes=_shift(axes), **params) for p in x.parts])


@qax.primitive_handler(sorted(constants.CUMULATIVE_REDUCTION_OPS))
def _cumulative_per_part(primitive, x: Stacked, *, axis, **params):
    if axis == 0:
        return NotImplemented
    return Stacked([primitive.bind(p, axis=axis - 1, **params) for p in x.parts])


RNG = np.random.default_rng(0)
FLOAT = RNG.uniform(0.2, 0.9, (2, 3, 4)).astype(np.float32)
FLOAT2 = RNG.uniform(0.2, 0.9, (2, 3, 4)).astype(np.float32)
INT = RNG.integers(1, 7, (2, 3, 4)).astype(np.int32)
INT2 = RNG.integers(0, 3, (2, 3, 4)).astype(np.int32)
BOOL = RNG.integers(0, 2, (2, 3, 4)).astype(bool)
COMPLEX = (FLOAT + 1j * FLOAT2).astype(np.complex64)

UNARY = {
    "clz": (lax.clz, INT),
    "population_count": (lax.population_count, INT),
    "not": (lax.bitwise_not, INT),
    "imag": (lax.imag, COMPLEX),
    "real": (lax.real, COMPLEX),
    "conj": (lax.conj, COMPLEX),
    "integer_pow": (lambda x: lax.integer_pow(x, 3), FLOAT),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 5, 10), FLOAT),
    "acosh": (lambda x: lax.acosh(x + 1), FLOAT),
}
BINARY = {
    "and": (lax.bitwise_and, INT, INT2),
    "or": (lax.bitwise_or, INT, INT2),
    "xor": (lax.bitwise_xor, INT, INT2),
    "shift_left": (lax.shift_left, INT, INT2),
    "shift_right_arithmetic": (lax.shift_right_arithmetic, INT, INT2),
    "shift_right_logical": (lax.shift_right_logical, INT, INT2),
    "polygamma": (lax.polygamma, np.ones_like(FLOAT), FLOAT),
}


def _unary_case(name):
    fn, x = UNARY.get(name, (getattr(lax, name, None), FLOAT))
    return fn, (x,)


def _binary_case(name):
    if name in BINARY:
        fn, x, y = BINARY[name]
    else:
        fn, x, y = getattr(lax, name), FLOAT, FLOAT2
    return fn, (x, y)


def _check_all(cases):
    """Run every (name, fn, args, stacked_mask) case in one traced and compiled program.

    (One program per primitive would spend most of the test compiling.)
    """

    def implicit_results(values):
        return {name: fn(*args) for (name, fn, _, _), args in zip(cases, values)}

    def oracle(dense):
        return {name: fn(*args) for (name, fn, _, _), args in zip(cases, dense)}

    @jax.jit
    def both(dense):
        values = [
            [Stacked(list(d)) if s else d for d, s in zip(args, mask)]
            for (_, _, _, mask), args in zip(cases, dense)
        ]
        implicit = qax.use_implicit_args(implicit_results)(values)
        return (
            implicit,
            {k: qax.materialize_nested(v) for k, v in implicit.items()},
            oracle(dense),
        )

    dense = [[jnp.asarray(a) for a in args] for _, _, args, _ in cases]
    implicit, got, expected = both(dense)
    failures = []
    for name, _, _, _ in cases:
        if not isinstance(implicit[name], Stacked):
            failures.append(f"{name}: result was not kept implicit")
        elif implicit[name].dtype != expected[name].dtype:
            failures.append(
                f"{name}: dtype {implicit[name].dtype} != {expected[name].dtype}"
            )
        elif not np.allclose(
            got[name], expected[name], rtol=1e-5, atol=1e-6, equal_nan=True
        ):
            failures.append(f"{name}: values differ")
    assert not failures, failures


def test_unary_handlers_match_materialized():
    _check_all(
        [(n, *_unary_case(n), [True]) for n in sorted(constants.ELEMENTWISE_UNOPS)]
    )


# Special functions take seconds each to compile on CPU: the operand-order variants use
# the others (order handling does not depend on the primitive's math).
SLOW_TO_COMPILE = {
    "igamma",
    "igammac",
    "igamma_grad_a",
    "polygamma",
    "zeta",
    "nextafter",
}


@pytest.mark.parametrize(
    "mask", [(True, True), (True, False), (False, True)], ids=["both", "left", "right"]
)
def test_binary_handlers_match_materialized(mask):
    names = sorted(constants.ELEMENTWISE_BINOPS)
    if mask != (True, True):
        names = [n for n in names if n not in SLOW_TO_COMPILE]
    _check_all([(n, *_binary_case(n), list(mask)) for n in names])


REDUCERS = {
    "reduce_sum": (lambda x: jnp.sum(x, axis=2), FLOAT),
    "reduce_prod": (lambda x: jnp.prod(x, axis=(1, 2)), FLOAT),
    "reduce_max": (lambda x: jnp.max(x, axis=1), FLOAT),
    "reduce_min": (lambda x: jnp.min(x, axis=2), FLOAT),
    "reduce_and": (lambda x: jnp.all(x, axis=1), BOOL),
    "reduce_or": (lambda x: jnp.any(x, axis=2), BOOL),
    "reduce_xor": (lambda x: lax.reduce_xor_p.bind(x, axes=(1,)), INT),
    "argmax": (lambda x: jnp.argmax(x, axis=2), FLOAT),
    "argmin": (lambda x: jnp.argmin(x, axis=1), FLOAT),
    "cumsum": (lambda x: jnp.cumsum(x, axis=2), FLOAT),
    "cumprod": (lambda x: lax.cumprod(x, axis=1, reverse=True), FLOAT),
    "cummax": (lambda x: lax.cummax(x, axis=2), FLOAT),
    "cummin": (lambda x: lax.cummin(x, axis=1), FLOAT),
    "cumlogsumexp": (lambda x: lax.cumlogsumexp(x, axis=2), FLOAT),
}


def test_reduction_handlers_match_materialized():
    names = sorted(constants.REDUCTION_OPS | constants.CUMULATIVE_REDUCTION_OPS)
    _check_all([(n, REDUCERS[n][0], (REDUCERS[n][1],), [True]) for n in names])


def test_reduction_over_the_stacked_axis_falls_back_with_a_warning():
    x = Stacked(list(jnp.asarray(FLOAT)))
    with pytest.warns(qax.MaterializationWarning, match="reduce_sum"):
        out = qax.use_implicit_args(lambda v: jnp.sum(v, axis=0))(x)
    np.testing.assert_allclose(out, FLOAT.sum(0), rtol=1e-6)
