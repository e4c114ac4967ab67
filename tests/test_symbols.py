"""Symbolic constants: folding at trace time, checked against the dense computation;
the weak type of tangents at them, and symbolic scalars used as control values."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax.symbols import SymbolicConstant, symbolic_full_like, symbolic_zero_like
from tests.helpers import ClosedZeros, assert_close, materializations

SHAPE = (2, 3)
C64 = jnp.complex64
F32, I32 = jnp.float32, jnp.int32


def const(value, dtype=None, shape=SHAPE, weak_type=None):
    return SymbolicConstant(value, shape=shape, dtype=dtype, weak_type=weak_type)


def fold(fn, *args):
    """Trace ``use_implicit_args(fn)`` under `make_jaxpr`: (output, jaxpr).

    In the output, symbolic constants are rebuilt from their static data (so that no
    tracer leaves the trace) and any other leaf is replaced by the string "dense".
    """
    box = []

    def traced(*a):
        out = qax.use_implicit_args(fn)(*a)
        leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=is_constant)
        kept = [rebuild(x) if is_constant(x) else "dense" for x in leaves]
        box.append(jax.tree_util.tree_unflatten(treedef, kept))
        return out

    jaxpr = jax.make_jaxpr(traced)(*args)
    return box[0], jaxpr


def rebuild(c):
    return SymbolicConstant(
        c.value, shape=c.shape, dtype=c.dtype, weak_type=c.weak_type
    )


def is_constant(x):
    return isinstance(x, SymbolicConstant)


def dense(x):
    return x.materialize() if isinstance(x, SymbolicConstant) else x


def assert_same(out, ref):
    """`out` equals `ref` in shape, dtype, weak type and value.

    `out` is a SymbolicConstant or an array; `ref` an array or an ``(aval, value)`` pair.
    """
    ref_aval, ref = ref if isinstance(ref, tuple) else (jax.typeof(ref), ref)
    out_aval = out.aval if isinstance(out, SymbolicConstant) else jax.typeof(out)
    got = (out_aval.shape, out_aval.dtype, out_aval.weak_type)
    assert got == (ref_aval.shape, ref_aval.dtype, ref_aval.weak_type)
    if isinstance(out, SymbolicConstant):  # its value, without compiling a broadcast
        value = np.full(out.shape, out.value, out.dtype)
    else:
        value = np.asarray(out)
    ref = np.asarray(ref)
    if jnp.issubdtype(ref.dtype, jnp.inexact):
        np.testing.assert_allclose(value, ref, rtol=2e-6, equal_nan=True)
    else:
        np.testing.assert_array_equal(value, ref)


def references(cases, values=None):
    """``(aval, value)`` of ``fn(*dense args)`` for each ``key: (fn, args)``.

    The values come from one compiled program for the whole table (one compilation
    keeps the suite fast), or from `values` when the cases differ from those only in
    weak types (which never change values); avals come from `jax.eval_shape`.
    """
    keys = list(cases)

    def run():
        return [cases[k][0](*map(dense, cases[k][1])) for k in keys]

    avals = jax.eval_shape(run)
    if values is None:
        values = dict(zip(keys, jax.jit(run)(), strict=True))
    else:
        values = {k: values[k][1] for k in keys}
    return {k: (aval, values[k]) for k, aval in zip(keys, avals, strict=True)}


def check_folds(fn, *args, ref=None):
    """``use_implicit_args(fn)(*args)`` folds to constants equal to `ref` (or f(dense))."""
    out, jaxpr = fold(fn, *args)
    assert not jaxpr.eqns, f"folded ops left equations:\n{jaxpr}"
    if ref is None:
        ref = fn(*map(dense, args))
    outs = jax.tree_util.tree_leaves(out, is_leaf=is_constant)
    for o, r in zip(outs, jax.tree_util.tree_leaves(ref), strict=True):
        assert is_constant(o), f"not folded to a SymbolicConstant: {jaxpr}"
        assert_same(o, r)
    return out


def check_cases(cases, refs):
    """`check_folds` for every ``key: (fn, args)`` of `cases`, in one trace."""
    keys = list(cases)

    def run(all_args):
        return [cases[k][0](*a) for k, a in zip(keys, all_args, strict=True)]

    outs, jaxpr = fold(run, [list(cases[k][1]) for k in keys])
    assert not jaxpr.eqns, f"folded ops left equations:\n{jaxpr}"
    for key, out in zip(keys, outs, strict=True):
        aval, value = refs[key]
        outs = jax.tree_util.tree_leaves(out, is_leaf=is_constant)
        avals, values = (
            jax.tree_util.tree_leaves(aval),
            jax.tree_util.tree_leaves(value),
        )
        for o, a, v in zip(outs, avals, values, strict=True):
            assert is_constant(o), f"{key}: not folded to a SymbolicConstant"
            try:
                assert_same(o, (a, v))
            except AssertionError as e:
                raise AssertionError(f"{key}: {e}") from None


def primitive_names(jaxpr):
    """Names of the primitives in `jaxpr` and in the jaxprs of its equations' params."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for param in eqn.params.values():
            if hasattr(param, "eqns") or hasattr(param, "jaxpr"):
                names |= primitive_names(param)
    return names


# ----------------------------------------------------------------------------------------
# Construction


def test_python_scalar_is_weak_and_explicit_dtype_is_not():
    assert const(2.0).aval == jax.typeof(jnp.full(SHAPE, 2.0))
    assert const(2.0).weak_type and not const(2.0, F32).weak_type
    assert not const(np.float32(2.0)).weak_type
    assert not const(True).weak_type  # Python bools are not weak in JAX
    for c, ref in [
        (const(2.0), jnp.full(SHAPE, 2.0)),
        (const(3), jnp.full(SHAPE, 3)),
        (const(2.5, jnp.bfloat16), jnp.full(SHAPE, 2.5, jnp.bfloat16)),
        (const(1 + 2j), jnp.full(SHAPE, 1 + 2j)),
    ]:
        assert_same(c.materialize(), ref)


def test_value_is_converted_like_jax():
    assert const(2.7, I32).value == 2
    assert const(1e40, F32).value == np.inf
    assert const(jnp.asarray(3.0)).dtype == F32
    with pytest.raises(OverflowError):
        const(300, jnp.int8)


def test_bad_values_are_rejected_with_a_clear_message():
    with pytest.raises(ValueError, match="must be a scalar"):
        SymbolicConstant(np.ones(3), shape=(3,))
    with pytest.raises(TypeError, match="known at trace time"):
        jax.jit(lambda v: SymbolicConstant(v, shape=(3,)))(1.0)


def test_repr_and_default_shape():
    assert repr(const(2.0)) == (
        "SymbolicConstant(value=2.0, shape=(2, 3), dtype=float32, weak_type=True)"
    )
    assert SymbolicConstant(1).shape == ()


@pytest.mark.parametrize(
    "x",
    [jnp.ones((2, 2), jnp.int8), jnp.full((3,), 2.0), np.ones(2), const(1.0)],
    ids=["int8", "weak", "numpy", "symbolic"],
)
def test_like_constructors_follow_jnp(x):
    assert_same(symbolic_zero_like(x), jnp.zeros_like(dense(x)))
    assert_same(symbolic_full_like(x, 3), jnp.full_like(dense(x), 3))
    assert_same(
        symbolic_full_like(x, 2, shape=(4,), dtype=F32),
        jnp.full_like(dense(x), 2, shape=(4,), dtype=F32),
    )


# ----------------------------------------------------------------------------------------
# Elementwise folding: every primitive of the two sets

UNARY = {
    "abs": (lax.abs, F32, -1.5),
    "acos": (lax.acos, F32, 0.3),
    "acosh": (lax.acosh, F32, 1.7),
    "asin": (lax.asin, F32, 0.3),
    "asinh": (lax.asinh, F32, 0.7),
    "atan": (lax.atan, F32, 0.7),
    "atanh": (lax.atanh, F32, 0.3),
    "bessel_i0e": (lax.bessel_i0e, F32, 0.7),
    "bessel_i1e": (lax.bessel_i1e, F32, 0.7),
    "cbrt": (lax.cbrt, F32, 2.0),
    "ceil": (lax.ceil, F32, 1.3),
    "clz": (lax.clz, I32, 5),
    "conj": (lax.conj, C64, 1 + 2j),
    "cos": (lax.cos, F32, 0.7),
    "cosh": (lax.cosh, F32, 0.7),
    "digamma": (lax.digamma, F32, 1.7),
    "erf": (lax.erf, F32, 0.3),
    "erf_inv": (lax.erf_inv, F32, 0.3),
    "erfc": (lax.erfc, F32, 0.3),
    "exp": (lax.exp, F32, 0.7),
    "exp2": (lax.exp2, F32, 0.7),
    "expm1": (lax.expm1, F32, 0.7),
    "floor": (lax.floor, F32, 1.3),
    "imag": (lax.imag, C64, 1 + 2j),
    "integer_pow": (lambda x: lax.integer_pow(x, 3), I32, -3),
    "is_finite": (lax.is_finite, F32, np.nan),
    "lgamma": (lax.lgamma, F32, 2.5),
    "log": (lax.log, F32, 2.0),
    "log1p": (lax.log1p, F32, 0.5),
    "logistic": (lax.logistic, F32, 0.5),
    "neg": (lax.neg, I32, 7),
    "not": (lax.bitwise_not, I32, 5),
    "population_count": (lax.population_count, I32, 7),
    "real": (lax.real, C64, 1 + 2j),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 5, 2), F32, 1.2345),
    "round": (lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), F32, 2.5),
    "rsqrt": (lax.rsqrt, F32, 2.0),
    "sign": (lax.sign, F32, -2.0),
    "sin": (lax.sin, F32, 0.7),
    "sinh": (lax.sinh, F32, 0.7),
    "sqrt": (lax.sqrt, F32, 2.0),
    "square": (lax.square, F32, 1.5),
    "tan": (lax.tan, F32, 0.7),
    "tanh": (lax.tanh, F32, 0.7),
}

BINARY = {
    "add": (lax.add, F32, 1.5, 2.25),
    "and": (lax.bitwise_and, I32, 6, 3),
    "atan2": (lax.atan2, F32, 0.5, 1.5),
    "complex": (lax.complex, F32, 1.0, 2.0),
    "div": (lax.div, I32, -7, 2),
    "eq": (lax.eq, F32, 1.0, 1.0),
    "ge": (lax.ge, F32, 1.0, 2.0),
    "gt": (lax.gt, I32, 3, 2),
    "igamma": (lax.igamma, F32, 1.5, 0.5),
    "igamma_grad_a": (lax.igamma_grad_a, F32, 1.5, 0.5),
    "igammac": (lax.igammac, F32, 1.5, 0.5),
    "le": (lax.le, F32, 1.0, 2.0),
    "lt": (lax.lt, F32, 2.0, 1.0),
    "max": (lax.max, F32, 1.0, 2.0),
    "min": (lax.min, I32, 1, 2),
    "mul": (lax.mul, F32, 1.5, -2.0),
    "ne": (lax.ne, F32, 1.0, 2.0),
    "nextafter": (lax.nextafter, F32, 1.0, 2.0),
    "or": (lax.bitwise_or, I32, 5, 2),
    "polygamma": (lax.polygamma, F32, 1.0, 2.5),
    "pow": (lax.pow, F32, 1.5, 2.5),
    "rem": (lax.rem, I32, -7, 3),
    "shift_left": (lax.shift_left, I32, 3, 2),
    "shift_right_arithmetic": (lax.shift_right_arithmetic, I32, -16, 2),
    "shift_right_logical": (lax.shift_right_logical, I32, -16, 2),
    "sub": (lax.sub, F32, 1.5, 4.0),
    "xor": (lax.bitwise_xor, I32, 6, 3),
    "zeta": (lax.zeta, F32, 2.0, 1.5),
}


def test_tables_cover_every_elementwise_primitive():
    assert set(UNARY) == qax.constants.ELEMENTWISE_UNOPS
    assert set(BINARY) == qax.constants.ELEMENTWISE_BINOPS


def unary_cases(weak):
    return {
        n: (fn, (const(v, dtype, weak_type=weak),))
        for n, (fn, dtype, v) in UNARY.items()
    }


@functools.cache
def unary_references(weak):
    values = unary_references(False) if weak else None
    return references(unary_cases(weak), values)


@pytest.mark.parametrize("weak", [False, True], ids=["strong", "weak"])
def test_unary_folds(weak):
    """Every unary elementwise primitive, against the dense result."""
    check_cases(unary_cases(weak), unary_references(weak))


WEAK_PAIRS = [(False, False), (True, False), (True, True)]


def binary_cases(weak):
    return {
        name: (
            fn,
            (const(a, dtype, weak_type=weak[0]), const(b, dtype, weak_type=weak[1])),
        )
        for name, (fn, dtype, a, b) in BINARY.items()
    }


@functools.cache
def binary_references(weak):
    values = binary_references((False, False)) if any(weak) else None
    return references(binary_cases(weak), values)


@pytest.mark.parametrize("weak", WEAK_PAIRS, ids=["strong", "mixed", "weak"])
def test_binary_folds(weak):
    """Every binary elementwise primitive, against the dense result."""
    check_cases(binary_cases(weak), binary_references(weak))


def test_binary_fold_broadcasts_rank_zero_constant():
    check_folds(lax.mul, const(2.0, F32, shape=()), const(3.0, F32))


KINDS = {
    "py_float": lambda: const(2.0),
    "py_int": lambda: const(3),
    "f32": lambda: const(np.float32(1.5)),
    "bf16": lambda: const(1.5, jnp.bfloat16),
    "int8": lambda: const(-3, jnp.int8),
    "bool": lambda: const(True),
}
OP_KINDS = {"add": list(KINDS), "true_divide": ["py_float", "py_int", "bf16", "int8"]}


OPS = {"add": jnp.add, "true_divide": jnp.true_divide}


def promotion_cases(op):
    pairs = itertools.product(OP_KINDS[op], repeat=2)
    return {pair: (OPS[op], (KINDS[pair[0]](), KINDS[pair[1]]())) for pair in pairs}


@functools.cache
def promotion_references(op):
    return references(promotion_cases(op))


@pytest.mark.parametrize("op", sorted(OPS))
def test_jnp_promotion_between_constants(op):
    """Dtypes and weak types follow JAX's promotion rules exactly (all kind pairs)."""
    check_cases(promotion_cases(op), promotion_references(op))


def test_python_scalars_in_jitted_code_fold():
    c = const(3.0, F32)
    out = check_folds(lambda c: (c / 2, 2 * c, c.mean(), c - np.float32(1), -c), c)
    assert [float(x.value) for x in out] == [1.5, 6.0, 3.0, 2.0, -3.0]


# ----------------------------------------------------------------------------------------
# A constant and an ordinary array

X = jnp.arange(1.0, 7.0).reshape(SHAPE)
XI = jnp.arange(-3, 3, dtype=I32).reshape(SHAPE)

IDENTITIES = [
    ("x+0", lambda x, c: x + c, X, 0.0),
    ("0+x", lambda x, c: c + x, X, 0.0),
    ("x-0", lambda x, c: x - c, X, 0.0),
    ("x*1", lambda x, c: x * c, X, 1.0),
    ("1*x", lambda x, c: c * x, X, 1.0),
    ("x/1", lambda x, c: x / c, X, 1.0),
    ("x**1", lambda x, c: x**c, X, 1.0),
    ("max(x,-inf)", jnp.maximum, X, -np.inf),
    ("min(x,inf)", jnp.minimum, X, np.inf),
    ("x|0", lambda x, c: x | c, XI, 0),
    ("x^0", lambda x, c: x ^ c, XI, 0),
    ("x&-1", lambda x, c: x & c, XI, -1),
    ("x<<0", lambda x, c: x << c, XI, 0),
]


@pytest.mark.parametrize("case", IDENTITIES, ids=[c[0] for c in IDENTITIES])
@pytest.mark.parametrize("shape", [SHAPE, (3,), ()], ids=["same", "bcast", "scalar"])
def test_identity_returns_the_other_operand(case, shape):
    _, fn, x, value = case
    c = const(value, x.dtype, shape=shape)
    out, jaxpr = fold(lambda x, c: fn(x, c) * 1, x, c)  # `* 1` of a dense value
    names = {e.primitive.name for e in jaxpr.eqns}
    assert names <= {"mul", "broadcast_in_dim"}, jaxpr
    assert_same(qax.use_implicit_args(fn)(x, c), fn(x, c.materialize()))


def test_identity_broadcasts_and_casts_as_jax_would():
    x = jnp.full((3,), 2.0)  # weakly typed
    zero = const(0.0, F32, shape=SHAPE)
    fn = jnp.add
    assert_same(qax.use_implicit_args(fn)(x, zero), fn(x, zero.materialize()))


ABSORBING = [
    ("x*0 int", lambda x, c: x * c, XI, 0, 0),
    ("0*x float", lambda x, c: c * x, X, 0.0, 0.0),
    ("x&0", lambda x, c: x & c, XI, 0, 0),
    ("x|-1", lambda x, c: x | c, XI, -1, -1),
    ("x**0", lambda x, c: x**c, X, 0.0, 1.0),
    ("1**x", lambda x, c: c**x, X, 1.0, 1.0),
    ("0<<x", lambda x, c: c << x, XI, 0, 0),
    ("max(x,INT_MAX)", jnp.maximum, XI, 2**31 - 1, 2**31 - 1),
]


@pytest.mark.parametrize("case", ABSORBING, ids=[c[0] for c in ABSORBING])
def test_absorbing_value_gives_a_constant(case):
    _, fn, x, value, expected = case
    out = check_folds(lambda c: fn(x, c), const(value, x.dtype))
    assert out.value == expected


def test_other_ops_with_an_array_use_a_scalar_literal():
    x = X
    out, jaxpr = fold(lambda x, c: jnp.sin(x) * c + c, x, const(2.0, F32))
    assert out == "dense"
    assert "broadcast_in_dim" not in primitive_names(jaxpr)
    c = const(2.0, F32)
    ref = jnp.sin(x) * c.materialize() + c.materialize()
    assert_same(qax.use_implicit_args(lambda x, c: jnp.sin(x) * c + c)(x, c), ref)


def test_constant_with_a_smaller_array_broadcasts():
    c = const(2.0, F32)
    y = jnp.float32(3.0)
    for fn in (lax.sub, lambda c, y: lax.sub(y, c), lax.atan2):
        assert_same(qax.use_implicit_args(fn)(c, y), fn(c.materialize(), y))


# ----------------------------------------------------------------------------------------
# Reductions and structural ops


def argmax(x, axes):
    return lax.argmax(x, axes[0], I32)


def argmin(x, axes):
    return lax.argmin(x, axes[0], jnp.int8)


REDUCTIONS = {
    "reduce_sum": (lax.reduce_sum, I32, 3),
    "reduce_sum_float": (lax.reduce_sum, F32, 0.1),
    "reduce_sum_overflow": (lax.reduce_sum, jnp.int8, 100),
    "reduce_prod": (lax.reduce_prod, F32, 1.5),
    "reduce_prod_int": (lax.reduce_prod, jnp.int8, 3),
    "reduce_max": (lax.reduce_max, F32, -2.0),
    "reduce_min": (lax.reduce_min, jnp.uint8, 4),
    "reduce_and": (lax.reduce_and, jnp.bool_, True),
    "reduce_or": (lax.reduce_or, jnp.bool_, False),
    "reduce_xor": (lax.reduce_xor, I32, 5),
    "argmax": (argmax, F32, 1.0),
    "argmin": (argmin, I32, 1),
}
AXES = [(0,), (1,), (0, 2)]
EMPTY = ["reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and"]
EMPTY += ["reduce_or", "reduce_xor"]


def reduction_cases(axes):
    shape = (2, 0, 3) if axes == "empty" else (4, 3, 5)
    axes = (1,) if axes == "empty" else axes
    names = EMPTY if shape == (2, 0, 3) else REDUCTIONS
    return {
        n: (
            functools.partial(REDUCTIONS[n][0], axes=axes),
            (const(v, dt, shape=shape),),
        )
        for n in names
        for _, dt, v in [REDUCTIONS[n]]
    }


@functools.cache
def reduction_references(axes):
    return references(reduction_cases(axes))


@pytest.mark.parametrize("axes", [*AXES, "empty"], ids=str)
def test_reductions_fold(axes):
    """Reductions of constants (an empty axis gives the reduction's identity)."""
    check_cases(reduction_cases(axes), reduction_references(axes))


STRUCTURAL = {
    "broadcast_in_dim": lambda c: jnp.broadcast_to(c, (4, 2, 3)),
    "reshape": lambda c: c.reshape(3, 2),
    "squeeze": lambda c: jnp.squeeze(c[None], 0),
    "expand_dims": lambda c: jnp.expand_dims(c, (0, 2)),
    "transpose": lambda c: c.T,
    "convert_element_type": lambda c: c.astype(jnp.int8),
    "slice": lambda c: c[1:, ::2],
    "rev": lambda c: c[::-1],
    "dynamic_slice": lambda c: lax.dynamic_slice(c, (1, 1), (1, 2)),
    "concatenate": lambda c: jnp.concatenate([c, c, c], axis=1),
    "pad": lambda c: lax.pad(c, c[0, 0], [(1, 0, 0), (0, 2, 1)]),
    "cummax": lambda c: lax.cummax(c, axis=1),
    "split": lambda c: jnp.split(c, 3, axis=1),
    "select_n": lambda c: lax.select_n(c > 0, c * 2, c * 2),
    "dot_general_zero": lambda c: (c * 0) @ c.T,
    "dot_general_constants": lambda c: c @ c.T,
    "dynamic_update_slice": lambda c: lax.dynamic_update_slice(c, c[:1], (1, 0)),
}


@functools.cache
def structural_references():
    return references(structural_cases())


def structural_cases():
    return {k: (fn, (const(1.5, F32),)) for k, fn in STRUCTURAL.items()}


def test_structural_ops_fold():
    check_cases(structural_cases(), structural_references())


@pytest.mark.parametrize(
    "mode", ["clip", "promise_in_bounds", "fill"], ids=["clip", "promise", "fill"]
)
def test_gather_keeps_the_value_unless_out_of_bounds_reads_fill(mode):
    def fn(c, i):
        return c.at[i].get(mode=mode)

    c, i = const(1.5, F32), jnp.array([1, 0, 5])
    if mode == "fill":  # out-of-bounds reads give NaN: not a constant
        with pytest.warns(qax.MaterializationWarning):
            out = qax.use_implicit_args(fn)(c, i)
    else:
        out, jaxpr = fold(fn, c, i)
        assert isinstance(out, SymbolicConstant)
        assert "gather" not in primitive_names(jaxpr)
    assert_same(out, fn(c.materialize(), i))


@pytest.mark.parametrize("side", ["lhs", "rhs"])
def test_dot_general_with_a_zero_operand_is_a_zero(side):
    zero = const(0.0, F32, shape=(3, 3))
    x = jnp.ones((3, 3))
    fn = (lambda z, x: z @ x) if side == "lhs" else (lambda z, x: x @ z)
    out, jaxpr = fold(fn, zero, x)
    assert isinstance(out, SymbolicConstant) and not jaxpr.eqns
    assert_same(out, fn(zero.materialize(), x))


@pytest.mark.parametrize("pred", [True, False])
def test_select_n_with_a_constant_predicate_returns_the_chosen_case(pred):
    def fn(p, x, y):
        return jnp.where(p, x, y)

    p, x, y = const(pred), jnp.ones(SHAPE), jnp.zeros(SHAPE)
    out, jaxpr = fold(fn, p, x, y)
    assert "select_n" not in primitive_names(jaxpr)
    assert_same(qax.use_implicit_args(fn)(p, x, y), fn(p.materialize(), x, y))


def test_select_n_with_equal_constant_cases_is_a_constant():
    def fn(p, c):
        return jnp.where(p, c, c + 0)

    p, c = jnp.arange(3) > 1, const(2.0, F32)
    out, jaxpr = fold(fn, p, c)
    assert is_constant(out) and "select_n" not in primitive_names(jaxpr)
    assert_same(out, fn(p, c.materialize()))


# ----------------------------------------------------------------------------------------
# Fallbacks, transformations and jit


@pytest.mark.parametrize(
    "fn",
    [
        lambda c, x: jnp.cumsum(c, axis=1) + x,
        lambda c, x: c @ x.T,
        lambda c, x: jnp.concatenate([c, x]),
        lambda c, x: jnp.concatenate([c, c * 2]),
    ],
    ids=["cumsum", "matmul-nonzero", "concat-dense", "concat-unequal"],
)
def test_unsupported_ops_fall_back_correctly(fn):
    c, x = const(2.0, F32), X
    with pytest.warns(qax.MaterializationWarning):
        out = qax.use_implicit_args(fn)(c, x)
    assert_same(out, fn(c.materialize(), x))


def test_jitted_function_over_constants_has_no_equations():
    def f(a, b):
        s = jnp.sin(a) * b + 1.0
        return jnp.sum(s.reshape(3, 2).T, axis=0), jnp.argmax(b), (a > b).any()

    a, b = const(0.5, F32), const(2.0, F32)
    jitted = jax.jit(qax.use_implicit_args(f))
    assert not jitted.trace(a, b).jaxpr.eqns
    out = jitted(a, b)
    assert all(isinstance(o, SymbolicConstant) for o in out)
    for o, r in zip(out, f(a.materialize(), b.materialize()), strict=True):
        assert_same(o, r)


def test_jit_specializes_on_the_value_bits():
    traces = []

    @jax.jit
    @qax.use_implicit_args
    def inverse(c):
        traces.append(None)
        return 1.0 / c

    assert inverse(const(0.0, F32)).value == np.inf
    assert inverse(const(-0.0, F32)).value == -np.inf
    inverse(const(np.nan, F32))
    inverse(const(np.nan, F32))  # the same NaN: no new trace
    assert len(traces) == 3


def test_vmap_and_grad_through_constants():
    c = const(3.0, F32, shape=(4, 3))
    out = jax.vmap(qax.use_implicit_args(lambda c: c.sum()))(c)
    assert isinstance(out, SymbolicConstant) and out.shape == (4,)
    assert_same(out, jnp.full((4,), 9.0, F32))

    def loss(x, c):
        return jnp.sum(jnp.sin(x) * c + c)

    grad = jax.grad(qax.use_implicit_args(loss))(X, const(3.0, F32))
    np.testing.assert_allclose(grad, jax.grad(loss)(X, jnp.full(SHAPE, 3.0)))


# ----------------------------------------------------------------------------------------
# Weak types of tangents at symbolic constants


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


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jvp_tangent_given_as_a_numpy_scalar_keeps_the_primal_weak_type(jit):
    # A concrete scalar tangent of a `jnp` function (`-t`, inline) is baked into the
    # re-traced body: it takes the weak type the body declares for it, as under the
    # dense program (it was strong, and so was everything after it: the reshape, the
    # cond, the product with bf16).
    bf16 = jnp.ones(1, jnp.bfloat16)

    def f(w):
        _, tangent = jax.jvp(lambda t: -t, (w,), (np.array(0.75, np.float32),))
        out = lax.cond(True, lambda a: a, lambda a: a * 2, tangent.reshape((1,)))
        return out, out * bf16

    w = SymbolicConstant(0.0, shape=())
    assert w.aval.weak_type
    run = qax.use_implicit_args(f)
    if jit:
        run = jax.jit(run)
    (got, got_bf16), (want, want_bf16) = run(w), f(dense(w))
    assert jax.typeof(want).weak_type and want_bf16.dtype == jnp.bfloat16
    assert jax.typeof(got) == jax.typeof(want)
    assert got_bf16.dtype == want_bf16.dtype
    assert_close(got, want)


def _jvp_scan(t):
    return lax.scan(lambda c, _: (jnp.sin(c), None), t, None, length=2)[0]


def _jvp_scan_xs(t):
    xs = jnp.broadcast_to(t, (2, *jnp.shape(t)))
    return lax.scan(lambda c, x: (c + x, 2 * x), jnp.zeros_like(t), xs)


def _jvp_fori(t):
    return lax.fori_loop(0, 2, lambda i, c: jnp.sin(c), t)


def _jvp_while(t):
    body = lambda c: (c[0] + 1, jnp.sin(c[1]))  # noqa: E731
    return lax.while_loop(lambda c: c[0] < 2, body, (0, t))[1]


# (a carry's constant changes its value: materialized before the loop, with a warning)
@pytest.mark.filterwarnings("ignore::qax.MaterializationWarning")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape", [(), (3,)], ids=["scalar", "vector"])
@pytest.mark.parametrize(
    "loop", [_jvp_scan, _jvp_scan_xs, _jvp_fori, _jvp_while], ids=lambda f: f.__name__
)
def test_jvp_of_a_loop_at_weak_implicit_keeps_the_tangent_weak(loop, shape, jit):
    # The differentiated loop's tangent operands (a strong tangent) are bound to a body
    # that declares them as weak as the primal ones: its outputs are weak, as under
    # the dense program (qax traced the body with the strong operands).
    bf16 = jnp.ones(shape, jnp.bfloat16)

    def f(w):
        t = jnp.full(jnp.shape(w), 0.75, jnp.float32)
        _, tangent = jax.jvp(loop, (w,), (t,))
        return tangent, jax.tree_util.tree_map(lambda x: x * bf16, tangent)

    w = SymbolicConstant(0.5, shape=shape)
    assert w.aval.weak_type
    run = qax.use_implicit_args(f)
    if jit:
        run = jax.jit(run)
    got, want = run(w), f(dense(w))
    for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert jax.typeof(g) == jax.typeof(e)
        assert_close(g, e)
    assert all(jax.typeof(e).weak_type for e in jax.tree_util.tree_leaves(want[0]))


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

    z, x = ClosedZeros(shape=(3,)), jnp.arange(3.0)
    out = qax.use_implicit_args(f)(SymbolicConstant(True, shape=()), z, x)
    assert isinstance(out, ClosedZeros)
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
