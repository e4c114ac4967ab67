"""Sets of primitive names, grouped by how the primitives behave.

Every name ``n`` in these sets exists as ``jax.lax.<n>_p`` in the installed JAX (the test
suite checks this), so they can be passed straight to `qax.primitive_handler`.

Examples:
    >>> import qax
    >>> "add" in qax.constants.COMMUTATIVE_OPS
    True
"""

from __future__ import annotations

# Binary primitives whose two operands may be swapped without changing the result.
COMMUTATIVE_OPS: frozenset[str] = frozenset(
    {"add", "mul", "max", "min", "and", "or", "xor", "eq", "ne"}
)

# Unary elementwise primitives: output shape equals input shape.
ELEMENTWISE_UNOPS: frozenset[str] = frozenset(
    {
        "abs",
        "acos",
        "acosh",
        "asin",
        "asinh",
        "atan",
        "atanh",
        "bessel_i0e",
        "bessel_i1e",
        "cbrt",
        "ceil",
        "clz",
        "conj",
        "cos",
        "cosh",
        "digamma",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "imag",
        "integer_pow",
        "is_finite",
        "lgamma",
        "log",
        "log1p",
        "logistic",
        "neg",
        "not",
        "population_count",
        "real",
        "reduce_precision",
        "round",
        "rsqrt",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "tan",
        "tanh",
    }
)

# Binary elementwise primitives: operands (after broadcasting) share one shape.
ELEMENTWISE_BINOPS: frozenset[str] = frozenset(
    {
        "add",
        "and",
        "atan2",
        "complex",
        "div",
        "eq",
        "ge",
        "gt",
        "igamma",
        "igamma_grad_a",
        "igammac",
        "le",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "nextafter",
        "or",
        "polygamma",
        "pow",
        "rem",
        "shift_left",
        "shift_right_arithmetic",
        "shift_right_logical",
        "sub",
        "xor",
        "zeta",
    }
)

# Reductions over `axes`.
REDUCTION_OPS: frozenset[str] = frozenset(
    {
        "argmax",
        "argmin",
        "reduce_and",
        "reduce_max",
        "reduce_min",
        "reduce_or",
        "reduce_prod",
        "reduce_sum",
        "reduce_xor",
    }
)

# Cumulative reductions along one `axis`.
CUMULATIVE_REDUCTION_OPS: frozenset[str] = frozenset(
    {"cumlogsumexp", "cummax", "cummin", "cumprod", "cumsum"}
)

__all__ = [
    "COMMUTATIVE_OPS",
    "CUMULATIVE_REDUCTION_OPS",
    "ELEMENTWISE_BINOPS",
    "ELEMENTWISE_UNOPS",
    "REDUCTION_OPS",
]
