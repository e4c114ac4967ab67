"""Symbolic constants: arrays whose elements all equal one value known at trace time.

`SymbolicConstant(value, shape=..., dtype=...)` represents ``jnp.full(shape, value,
dtype)`` without storing any element. The value lives in the treedef (static under
`jax.jit`), so operations between symbolic constants are computed while tracing and the
compiled program contains no equation for them. The handlers in this module cover:

- every primitive of `qax.constants.ELEMENTWISE_UNOPS` and `ELEMENTWISE_BINOPS`,
  `convert_element_type` and `clamp` on constants: folded to a constant whose dtype and
  weak type are those JAX gives (computed by the primitive's own abstract rule; the value
  by running the primitive on one element);
- a constant with an ordinary array: identities (``x + 0``, ``0 + x``, ``x - 0``,
  ``x * 1``, ``x / 1``, ``x ** 1``, ``x | 0``, ``x & ~0``, ``max(x, -inf)``, shifts by 0)
  return ``x`` (broadcast, and cast as JAX would); absorbing values (``x * 0``,
  ``x & 0``, ``x | ~0``, ``x ** 0``, ``1 ** x``, ``0 << x``, integer ``max``/``min``
  with the extreme value)
  return a constant; any other elementwise op uses the value as a rank-0 literal, which
  is what ``x * 2.0`` costs in plain JAX. A rank-0 concrete operand counts as a
  constant;
- reductions (``reduce_sum``/``prod``/``max``/``min``/``and``/``or``/``xor``,
  ``argmax``, ``argmin``), ``dot_general`` with a zero operand (or two constants),
  ``select_n`` with a constant predicate (or equal constant cases), and the ops that only
  move elements: ``broadcast_in_dim``, ``reshape``, ``squeeze``, ``transpose``, ``rev``,
  ``slice``, ``dynamic_slice``, ``gather`` (clamped indices), ``concatenate``/``pad``/
  ``dynamic_update_slice`` of equal constants, ``cummax``/``cummin``, ``copy``, ``split``;
- control values: a ``cond``/``switch`` whose index is a constant runs only the chosen
  branch, and a rank-0 constant that no handler covers (a dynamic index ``x[i]``, a
  ``clamp`` bound) is passed as a literal, as a Python scalar would be.

Anything else falls back to the standard rule: the constant is materialized (a broadcast
of one scalar) with a `qax.MaterializationWarning`.

Floating-point caveats, by design: a zero constant absorbs in ``x * 0`` and
``dot_general`` even where ``x`` holds ``inf`` or ``nan`` (IEEE would give ``nan``), the
sign of a zero result is not tracked (``x + 0`` returns ``x`` also for ``x = -0.0``), and
``reduce_sum``/``reduce_prod`` of a constant are computed as ``v * n`` / ``v ** n``,
the correctly rounded result rather than XLA's summation order.

Examples:
    >>> zero = SymbolicConstant(0.0, shape=(3,), dtype=jnp.float32)
    >>> qax.use_implicit_args(lambda z, x: z * x + x)(zero, jnp.arange(3.0))
    Array([0., 1., 2.], dtype=float32)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax

__all__ = ["SymbolicConstant", "symbolic_full_like", "symbolic_zero_like"]

_NOT_SCALAR = (
    "SymbolicConstant holds one value repeated over `shape`; `value` must be a scalar, "
    "got an array of shape {shape}. Pass `shape=` for the array shape, or use "
    "`jnp.full` for arrays that are not constant."
)
_TRACED_VALUE = (
    "SymbolicConstant needs a value known at trace time, but got a traced value "
    "({aval}). Build the array with `jnp.full(shape, value)` instead, or create the "
    "constant outside the transformed function."
)


Aval = Any  # an abstract value: what `jax.typeof` returns

# Abstract values by (shape, dtype, weak type): tracing asks for them on every operation.
_avals: dict[tuple, Aval] = {}
_CACHE_LIMIT = 8192


class SymbolicConstant(qax.ImplicitArray):
    """An array of `shape` whose elements all equal `value`, known at trace time.

    `value` is static metadata (part of the treedef): `jax.jit` specializes on it and
    `jax.grad`/`jax.vmap` leave it alone. Operations on symbolic constants are folded
    while tracing (see the module docstring for the list).

    As with `jnp.full`, a Python scalar without `dtype=` gives a weakly typed array
    (``SymbolicConstant(2.0, shape=(3,)) * jnp.ones(3, jnp.bfloat16)`` is bfloat16);
    an explicit `dtype`, or a NumPy/JAX scalar, gives a strongly typed one.

    Examples:
        >>> c = SymbolicConstant(2.0, shape=(2, 3))
        >>> c
        SymbolicConstant(value=2.0, shape=(2, 3), dtype=float32, weak_type=True)
        >>> qax.use_implicit_args(lambda c: (c * c).sum())(c)
        SymbolicConstant(value=24.0, shape=(), dtype=float32)

    Attributes:
      value: the fill value: a Python, NumPy or concrete 0-d JAX scalar.
      shape: the array shape (default ``()``).
      dtype: the array dtype (default: that of `value`, as JAX would infer it).
      weak_type: override the inferred weak type.

    Raises:
      ValueError: `value` is not a scalar.
      TypeError: `value` is a tracer (not known at trace time).
    """

    value: Any = qax.aux_field()
    weak_type: bool | None = qax.aux_field(default=None, kw_only=True)
    # The value's bit pattern: tells 0.0 from -0.0 (equal as numbers) in treedefs, so
    # `jax.jit` does not reuse a trace made for one with the other.
    _bits: bytes = qax.aux_field(default=b"", init=False)

    def __post_init__(self) -> None:
        value = self.value
        known = qax.utils.known_constant(value)
        if known is None:
            raise TypeError(_TRACED_VALUE.format(aval=jax.typeof(value).str_short()))
        self.value = value = known
        if np.ndim(value) != 0:
            raise ValueError(_NOT_SCALAR.format(shape=np.shape(value)))
        if self.weak_type is None or self.dtype is None:
            aval = jax.typeof(value)
            if self.weak_type is None:
                self.weak_type = self.dtype is None and aval.weak_type
            if self.dtype is None:
                self.dtype = aval.dtype
        if self.shape is None:
            self.shape = ()
        self.weak_type = bool(self.weak_type)
        dtype = jax.dtypes.canonicalize_dtype(self.dtype)
        self.value = _canonical_value(value, dtype)
        self._bits = self.value.tobytes()
        super().__post_init__()

    @property
    def aval(self) -> Aval:
        key = (self.shape, self.dtype, self.weak_type)
        aval = _avals.get(key)
        if aval is None:
            if len(_avals) > _CACHE_LIMIT:
                _avals.clear()
            aval = _avals[key] = jax.typeof(
                jax.ShapeDtypeStruct(*key[:2], weak_type=key[2])
            )
        return aval

    def materialize(self) -> jax.Array:
        return _broadcast(self.value, self.weak_type, self.shape)

    def __repr__(self) -> str:
        weak = ", weak_type=True" if self.weak_type else ""
        return (
            f"SymbolicConstant(value={self.value!s}, shape={self.shape}, "
            f"dtype={np.dtype(self.dtype).name}{weak})"
        )

    def _same_value(self, other: SymbolicConstant) -> bool:
        return self.dtype == other.dtype and self._bits == other._bits

    @classmethod
    def default_handler(cls, primitive: Any, *args: Any, params: dict) -> Any:
        """Rank-0 constants where no handler applies are passed as literals.

        A known scalar (a dynamic index ``x[i]``, a ``clamp`` bound, a ``switch``
        index) is what a Python scalar is in plain JAX: a literal, which costs nothing
        to form, so it is not reported as a materialization. Other constants, and
        operations that involve other implicit types, get the standard rule.
        """
        implicit = [a for a in args if isinstance(a, qax.ImplicitArray)]
        if not all(isinstance(a, SymbolicConstant) and not a.shape for a in implicit):
            return NotImplemented
        args = [
            _scalar(a.value, a.weak_type) if isinstance(a, SymbolicConstant) else a
            for a in args
        ]
        return primitive.bind(*args, **primitive.get_bind_params(params))


def symbolic_full_like(
    x: Any, fill_value: Any, shape: Any = None, dtype: Any = None
) -> SymbolicConstant:
    """A `SymbolicConstant` like ``jnp.full_like(x, fill_value, dtype, shape)``.

    The dtype is `dtype` if given, else that of `x` (keeping its weak type); the shape
    is `shape` if given, else that of `x`. `x` may be an array, a tracer, an implicit
    array or anything with `shape` and `dtype`.

    Examples:
        >>> symbolic_full_like(jnp.ones((2, 2), jnp.int8), 3)
        SymbolicConstant(value=3, shape=(2, 2), dtype=int8)
    """
    aval = _aval_of(x)
    return SymbolicConstant(
        _scalar_value(fill_value),
        shape=aval.shape if shape is None else tuple(shape),
        dtype=aval.dtype if dtype is None else dtype,
        weak_type=dtype is None and aval.weak_type,
    )


def symbolic_zero_like(
    x: Any, shape: Any = None, dtype: Any = None
) -> SymbolicConstant:
    """A zero `SymbolicConstant` like ``jnp.zeros_like(x, dtype, shape)``.

    Examples:
        >>> symbolic_zero_like(jnp.ones(3))
        SymbolicConstant(value=0.0, shape=(3,), dtype=float32)
    """
    return symbolic_full_like(x, 0, shape=shape, dtype=dtype)


# ----------------------------------------------------------------------------------------
# Values


def _scalar_value(value: Any) -> Any:
    if isinstance(value, jax.Array) and qax.utils.known_constant(value) is value:
        return np.asarray(value)[()] if value.ndim == 0 else value
    return value


# Python scalar types, and the dtype kinds they convert to the same way in NumPy and JAX.
_LOSSLESS = {bool: "biufc", int: "iufc", float: "fc", complex: "c"}
_nans: dict[tuple, Any] = {}


def _canonical_value(value: Any, dtype: np.dtype) -> Any:
    """`value` as a NumPy scalar of `dtype`, converted exactly as JAX converts."""
    if isinstance(value, np.generic) and value.dtype == dtype:
        out = value
    elif dtype.kind in _LOSSLESS.get(type(value), ""):
        # NumPy rounds like JAX here and raises the same OverflowError for integers
        # out of range; other conversions (float -> int, ...) go through JAX.
        with np.errstate(over="ignore"):  # float overflow gives inf, as in JAX
            out = np.asarray(value, dtype)[()]
    else:
        with qax.utils.eval_context():
            out = np.asarray(jnp.asarray(_scalar_value(value), dtype=dtype))[()]
    if out != out:  # NaN: one object per bit pattern, so treedefs compare equal
        out = _nans.setdefault((dtype, out.tobytes()), out)
    return out


_scalar_arrays: dict[tuple, jax.Array] = {}


def _scalar(value: Any, weak_type: bool) -> Any:
    """`value` as an operand that staging turns into a literal, keeping its weak type:
    NumPy scalars (strong) and Python scalars (weak, default dtypes) become literals,
    other weak scalars concrete 0-d arrays (cached)."""
    if not weak_type:
        return value
    python = value.item()
    if jax.typeof(python).dtype == value.dtype:
        return python
    key = (value.dtype, value.tobytes())
    out = _scalar_arrays.get(key)
    if out is None:
        with qax.utils.eval_context():
            out = lax.convert_element_type_p.bind(
                jnp.asarray(value), new_dtype=value.dtype, weak_type=True, sharding=None
            )
        if len(_scalar_arrays) > 4096:
            _scalar_arrays.clear()
        _scalar_arrays[key] = out
    return out


def _broadcast(value: Any, weak_type: bool, shape: tuple[int, ...]) -> jax.Array:
    scalar = _scalar(value, weak_type)
    if not shape:
        return jnp.asarray(scalar)
    return lax.broadcast_in_dim(scalar, shape, ())


def _aval_of(x: Any) -> Aval:
    if isinstance(x, qax.ImplicitArray):
        return x.aval
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.typeof(x)
    return jax.typeof(x)


def _constant(value: Any, aval: Aval) -> SymbolicConstant:
    return SymbolicConstant(
        value, shape=aval.shape, dtype=aval.dtype, weak_type=aval.weak_type
    )


def _as_constant(x: Any) -> SymbolicConstant | None:
    """`x` as a constant if it is one: a `SymbolicConstant` or a concrete rank-0 array."""
    if isinstance(x, SymbolicConstant):
        return x
    if isinstance(x, qax.ImplicitArray) or np.ndim(x) != 0:
        return None
    aval = jax.typeof(x)
    x = qax.utils.known_constant(x)
    if x is None or np.ndim(x) != 0:
        return None
    return _constant(np.asarray(x, aval.dtype)[()], aval)


# ----------------------------------------------------------------------------------------
# Folding: abstract rule for dtype/shape/weak type, one-element evaluation for the value

_abstract_cache: dict[tuple, Any] = {}
_value_cache: dict[tuple, Any] = {}


def _params_key(params: dict) -> tuple | None:
    key = tuple(params.items())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _out_aval(primitive, avals: tuple, params: dict):
    """What `primitive` produces for operands of `avals` (cached)."""
    return _memoized(
        _abstract_cache,
        (primitive, avals),
        params,
        lambda: primitive.abstract_eval(*avals, **params)[0],
    )


def _evaluate(primitive, values: tuple, params: dict) -> Any:
    """Run `primitive` eagerly on NumPy scalars (also while a `jit` is tracing)."""

    def run():
        with qax.utils.eval_context():
            return np.asarray(primitive.bind(*values, **params))[()]

    key = (primitive, tuple((v.dtype, v.tobytes()) for v in values))
    return _memoized(_value_cache, key, params, run)


def _memoized(cache: dict, key: tuple, params: dict, compute: Callable) -> Any:
    """`compute()`, cached in `cache` under `key` and the params (when hashable)."""
    pkey = _params_key(params)
    if pkey is None:
        return compute()
    key = (*key, pkey)
    hit = cache.get(key)
    if hit is None:
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        hit = cache[key] = compute()
    return hit


def _fold(primitive, constants: tuple, params: dict) -> SymbolicConstant:
    aval = _out_aval(primitive, tuple(c.aval for c in constants), params)
    value = _evaluate(primitive, tuple(c.value for c in constants), params)
    return _constant(value, aval)


_FOLDED_UNARY = sorted(qax.constants.ELEMENTWISE_UNOPS | {"convert_element_type"})


@qax.primitive_handler(_FOLDED_UNARY)
def _fold_unary(primitive, x: SymbolicConstant, **params):
    return _fold(primitive, (x,), params)


@qax.primitive_handler(sorted(qax.constants.ELEMENTWISE_BINOPS))
def _fold_binary(primitive, x: SymbolicConstant, y: SymbolicConstant, **params):
    return _fold(primitive, (x, y), params)


@qax.primitive_handler("clamp")
def _fold_clamp(
    primitive, lo: SymbolicConstant, x: SymbolicConstant, hi: SymbolicConstant, **params
):
    return _fold(primitive, (lo, x, hi), params)


# ----------------------------------------------------------------------------------------
# A constant and an ordinary array


def _lowest(dtype: np.dtype) -> Any:
    if dtype.kind == "f":
        return dtype.type(-np.inf)
    return np.zeros((), dtype)[()] if dtype.kind == "b" else jnp.iinfo(dtype).min


def _highest(dtype: np.dtype) -> Any:
    if dtype.kind == "f":
        return dtype.type(np.inf)
    return np.ones((), dtype)[()] if dtype.kind == "b" else jnp.iinfo(dtype).max


def _all_ones(dtype: np.dtype) -> Any:
    return np.invert(np.zeros((), dtype))[()] if dtype.kind in "biu" else None


def _is_identity(name: str, c: SymbolicConstant, const_first: bool) -> bool:
    """Whether ``op(c, x)`` (or ``op(x, c)``) equals ``x`` for every ``x``."""
    v, dtype = c.value, np.dtype(c.dtype)
    if name in ("add", "or", "xor"):
        return v == 0
    if name == "mul":
        return v == 1
    if name in ("sub", "shift_left", "shift_right_arithmetic", "shift_right_logical"):
        return not const_first and v == 0
    if name in ("div", "pow"):
        return not const_first and v == 1
    if name == "and":
        return dtype.kind in "biu" and v == _all_ones(dtype)
    if name == "max":
        return dtype.kind in "biuf" and v == _lowest(dtype)
    if name == "min":
        return dtype.kind in "biuf" and v == _highest(dtype)
    return False


def _absorbed(name: str, c: SymbolicConstant, const_first: bool) -> Any:
    """The result value if ``op(c, x)`` (or ``op(x, c)``) ignores ``x``, else None."""
    v, dtype = c.value, np.dtype(c.dtype)
    if name == "mul" and v == 0:  # also for floats: documented NaN semantics
        return v
    if name == "and" and dtype.kind in "biu" and v == 0:
        return v
    if name == "or" and dtype.kind in "biu" and v == _all_ones(dtype):
        return v
    if name == "max" and dtype.kind in "biu" and v == _highest(dtype):
        return v
    if name == "min" and dtype.kind in "biu" and v == _lowest(dtype):
        return v
    if name == "pow" and (v == 0 if not const_first else v == 1):
        return 1  # x ** 0 and 1 ** x are 1, also for NaN
    if name.startswith("shift") and const_first and v == 0:
        return v
    return None


def _aval(x: Any) -> Aval:
    return x.aval if isinstance(x, qax.ImplicitArray) else jax.typeof(x)


def _fit(x: Any, aval: Aval) -> Any:
    """`x` broadcast to `aval.shape` and given its weak type, as JAX would produce it."""
    if isinstance(x, SymbolicConstant):
        return _constant(x.value, aval) if x.aval != aval else x
    if isinstance(x, qax.ImplicitArray):
        if tuple(x.shape) == tuple(aval.shape):
            return x
        return qax.use_implicit_args(jnp.broadcast_to)(x, aval.shape)
    x_aval = jax.typeof(x)
    if x_aval.shape != aval.shape:
        x = lax.broadcast_in_dim(
            x, aval.shape, tuple(range(len(aval.shape) - x.ndim, len(aval.shape)))
        )
    if x_aval.weak_type and not aval.weak_type:
        x = lax.convert_element_type(x, aval.dtype)
    return x


def _with_constant(primitive, c: SymbolicConstant, x: Any, const_first: bool, params):
    other = _as_constant(x)
    if other is not None:
        pair = (c, other) if const_first else (other, c)
        return _fold(primitive, pair, params)
    avals = (c.aval, _aval(x)) if const_first else (_aval(x), c.aval)
    out = _out_aval(primitive, avals, params)
    if _is_identity(primitive.name, c, const_first):
        return _fit(x, out)
    absorbed = _absorbed(primitive.name, c, const_first)
    if absorbed is not None:
        return _constant(_canonical_value(absorbed, np.dtype(out.dtype)), out)

    scalar = _scalar(c.value, c.weak_type)

    def run(x):
        args = (scalar, x) if const_first else (x, scalar)
        return primitive.bind(*args, **params)

    result = (
        qax.use_implicit_args(run)(x) if isinstance(x, qax.ImplicitArray) else run(x)
    )
    return _fit(result, out)


@qax.primitive_handler(sorted(qax.constants.ELEMENTWISE_BINOPS), precedence=-1)
def _constant_lhs(primitive, c: SymbolicConstant, x: qax.ArrayValue, **params):
    return _with_constant(primitive, c, x, True, params)


@qax.primitive_handler(sorted(qax.constants.ELEMENTWISE_BINOPS), precedence=-1)
def _constant_rhs(primitive, x: qax.ArrayValue, c: SymbolicConstant, **params):
    return _with_constant(primitive, c, x, False, params)


# ----------------------------------------------------------------------------------------
# Reductions


def _times(value: Any, n: int) -> Any:
    """The sum of `n` copies of `value`, in its dtype (wrapping for integers)."""
    dtype = value.dtype
    if dtype.kind in "iu":
        bits = 8 * dtype.itemsize
        total = (int(value) * n) % (1 << bits)
        if dtype.kind == "i" and total >= 1 << (bits - 1):
            total -= 1 << bits
        return dtype.type(total)
    exact = complex(value) * n if dtype.kind == "c" else float(value) * n
    return _canonical_value(exact, dtype)


def _reduced_value(name: str, value: Any, n: int) -> Any:
    dtype = value.dtype
    if name == "reduce_sum":
        return _times(value, n)
    if name == "reduce_prod":
        if n == 0:
            return dtype.type(1)
        return _evaluate(lax.integer_pow_p, (value,), {"y": n}) if n > 1 else value
    if name == "reduce_xor":
        return value if n % 2 else np.zeros((), dtype)[()]
    if n > 0:
        return value
    return {
        "reduce_max": _lowest,
        "reduce_min": _highest,
        "reduce_and": _all_ones,
        "reduce_or": lambda d: np.zeros((), d)[()],
    }[name](dtype)


@qax.primitive_handler(
    ["reduce_sum", "reduce_prod", "reduce_max", "reduce_min", "reduce_and", "reduce_or"]
    + ["reduce_xor"]
)
def _reduce(primitive, x: SymbolicConstant, *, axes, **params):
    out = _out_aval(primitive, (x.aval,), dict(params, axes=axes))
    n = math.prod(x.shape[a] for a in axes)
    value = _reduced_value(primitive.name, x.value, n)
    return _constant(_canonical_value(value, np.dtype(out.dtype)), out)


@qax.primitive_handler(["argmax", "argmin"])
def _arg_reduce(primitive, x: SymbolicConstant, *, axes, index_dtype):
    if any(x.shape[a] == 0 for a in axes):
        return NotImplemented
    out = _out_aval(primitive, (x.aval,), {"axes": axes, "index_dtype": index_dtype})
    return _constant(np.zeros((), out.dtype)[()], out)


# ----------------------------------------------------------------------------------------
# Ops that only move elements around


_MOVING = [
    "broadcast_in_dim",
    "copy",
    "cummax",
    "cummin",
    "dynamic_slice",
    "reshape",
    "rev",
    "slice",
    "split",
    "squeeze",
    "transpose",
]


@qax.primitive_handler(_MOVING, precedence=-1)
def _keep_value(primitive, x: SymbolicConstant, *rest: qax.ArrayValue, **params):
    out = _out_aval(primitive, (x.aval, *map(_aval, rest)), params)
    if primitive.multiple_results:
        return [_constant(x.value, o) for o in out]
    return _constant(x.value, out)


_CLAMPED = (lax.GatherScatterMode.CLIP, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@qax.primitive_handler("gather", precedence=-1)
def _gather(primitive, x: SymbolicConstant, indices: qax.ArrayValue, **params):
    if params.get("mode") not in _CLAMPED:  # out-of-bounds reads give the fill value
        return NotImplemented
    return _constant(x.value, _out_aval(primitive, (x.aval, _aval(indices)), params))


@qax.primitive_handler("concatenate")
def _concatenate(primitive, *xs: SymbolicConstant, **params):
    if not all(x._same_value(xs[0]) for x in xs):
        return NotImplemented
    return _constant(
        xs[0].value, _out_aval(primitive, tuple(x.aval for x in xs), params)
    )


@qax.primitive_handler("pad", precedence=-1)
def _pad(primitive, x: SymbolicConstant, padding_value: qax.ArrayValue, **params):
    fill = _as_constant(padding_value)
    if fill is None or not x._same_value(fill):
        return NotImplemented
    return _constant(x.value, _out_aval(primitive, (x.aval, fill.aval), params))


@qax.primitive_handler("dynamic_update_slice", precedence=-1)
def _update_slice(
    primitive,
    x: SymbolicConstant,
    update: SymbolicConstant,
    *idx: qax.ArrayValue,
    **params,
):
    if not x._same_value(update):
        return NotImplemented
    avals = (x.aval, update.aval, *map(_aval, idx))
    return _constant(x.value, _out_aval(primitive, avals, params))


@qax.primitive_handler("select_n", precedence=-1)
def _select_n(primitive, which: qax.ArrayValue, *cases: qax.ArrayValue):
    constants = [c for c in cases if isinstance(c, SymbolicConstant)]
    if not isinstance(which, SymbolicConstant) and not constants:
        return NotImplemented
    out = _out_aval(primitive, (_aval(which), *map(_aval, cases)), {})
    if isinstance(which, SymbolicConstant):
        index = int(which.value)
        return _fit(cases[index], out) if 0 <= index < len(cases) else NotImplemented
    if len(constants) == len(cases) and all(c._same_value(cases[0]) for c in cases):
        return _constant(cases[0].value, out)
    dense = [_dense_case(c, out) for c in cases]
    if any(isinstance(c, qax.ImplicitArray) for c in dense):
        return qax.use_implicit_args(lax.select_n)(which, *dense)
    return lax.select_n(which, *dense)


def _dense_case(case: Any, out: Aval) -> Any:
    if not isinstance(case, SymbolicConstant):
        return case
    return _broadcast(case.value, case.weak_type, out.shape)


# ----------------------------------------------------------------------------------------
# Control flow on a known index


@qax.primitive_handler("cond")
def _cond(
    primitive, index: SymbolicConstant, *operands: qax.ArrayValue, branches, **params
):
    """A `lax.cond`/`lax.switch` whose branch index is known: only that branch runs.

    As in XLA, an index outside the branches selects the last one.
    """
    i = int(index.value)
    branch = branches[i if 0 <= i < len(branches) else len(branches) - 1]
    run = qax.utils.jaxpr_as_function(branch)
    if any(isinstance(x, qax.ImplicitArray) for x in operands):
        return qax.use_implicit_args(run)(*operands)
    return run(*operands)


# ----------------------------------------------------------------------------------------
# dot_general


def _dot(primitive, lhs, rhs, params):
    out = _out_aval(primitive, (_aval(lhs), _aval(rhs)), params)
    constants = [x for x in (lhs, rhs) if isinstance(x, SymbolicConstant)]
    if any(c.value == 0 for c in constants):
        return _constant(np.zeros((), out.dtype)[()], out)
    if len(constants) < 2 or np.dtype(out.dtype).kind == "b":
        return NotImplemented
    (contract, _), _ = params["dimension_numbers"]
    k = math.prod(lhs.shape[d] for d in contract)
    convert = lax.convert_element_type_p
    cast = {"new_dtype": np.dtype(out.dtype), "weak_type": False, "sharding": None}
    a = _evaluate(convert, (lhs.value,), cast)
    b = _evaluate(convert, (rhs.value,), cast)
    product = _evaluate(lax.mul_p, (a, b), {})
    return _constant(_times(product, k), out)


@qax.primitive_handler("dot_general")
def _dot_constants(primitive, lhs: SymbolicConstant, rhs: SymbolicConstant, **params):
    return _dot(primitive, lhs, rhs, params)


@qax.primitive_handler("dot_general", precedence=-1)
def _dot_constant_lhs(primitive, lhs: SymbolicConstant, rhs: qax.ArrayValue, **params):
    return _dot(primitive, lhs, rhs, params)


@qax.primitive_handler("dot_general", precedence=-1)
def _dot_constant_rhs(primitive, lhs: qax.ArrayValue, rhs: SymbolicConstant, **params):
    return _dot(primitive, lhs, rhs, params)
