"""The shared test types and helpers: every implicit type used by more than one test file.

Import as ``from tests.helpers import ...`` (never ``import helpers``): the handlers
below register in qax's global tables when this module is imported, so it must be
imported under one name only (`test_suite_layout.py` checks that). Written with the
public API only. A type that one test file needs for one purpose lives in that file.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

import qax

# ----------------------------------------------------------------------------------------
# Values and oracles


def keys(n: int, seed: int = 0) -> list:
    return list(jax.random.split(jax.random.PRNGKey(seed), n))


def dense(x):
    """Fully materialized version of every implicit array in `x`."""
    return jax.tree_util.tree_map(
        lambda v: (
            qax.materialize_nested(v, full=True)
            if isinstance(v, qax.ImplicitArray)
            else v
        ),
        x,
        is_leaf=lambda v: isinstance(v, qax.ImplicitArray),
    )


def assert_close(got, expected, rtol=1e-5, atol=1e-5):
    """Same tree structure, and leaves close once every implicit array is materialized."""
    got, expected = dense(got), dense(expected)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(expected)
    leaves = jax.tree_util.tree_leaves
    for g, e in zip(leaves(got), leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol)


def _total(out) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(dense(out))
    return sum(
        jnp.sum(jnp.sin(x)) for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)
    )


def implicit_loss(f):
    def loss(*args):
        return _total(qax.use_implicit_args(f)(*args))

    return loss


def dense_loss(f):
    def loss(*args):
        return _total(f(*dense(args)))

    return loss


# "grad" (eager, op by op) is slow: most tests use MODES, a few ALL_MODES.
MODES = ["eager", "jit", "jit_grad"]
ALL_MODES = ["eager", "jit", "grad", "jit_grad"]


def check_mode(mode: str, f, *args, argnums=0) -> None:
    """`use_implicit_args(f)` agrees with `f` on the materialized arguments in `mode`.

    For the gradient modes, the loss is differentiated with respect to the leaves of
    the implicit arguments; the oracle differentiates through `materialize()`.
    """
    if mode in ("eager", "jit"):
        run = qax.use_implicit_args(f)
        if mode == "jit":
            run = jax.jit(run)
        assert_close(run(*args), f(*dense(args)))
        return
    got = jax.grad(implicit_loss(f), argnums=argnums)
    expected = jax.grad(dense_loss(f), argnums=argnums)
    if mode == "jit_grad":
        got = jax.jit(got)
    assert_close(got(*args), expected(*args), rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def materializations():
    """Collect the primitive names of MaterializationWarnings (not raised as errors)."""
    found: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", qax.MaterializationWarning)
        yield found
    for w in caught:
        if issubclass(w.category, qax.MaterializationWarning):
            found.append(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


# ----------------------------------------------------------------------------------------
# Jaxpr inspection


def all_eqns(jaxpr):
    """Every equation of a (Closed)Jaxpr, including those of sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from all_eqns(sub)


def find_eqn(jaxpr, name):
    """The first equation of primitive `name` in a jaxpr (sub-jaxprs included)."""
    return next((e for e in all_eqns(jaxpr) if e.primitive.name == name), None)


def check_equation(fn, name, *args, **tol):
    """`qax.testing.check_handler` on the `name` equation that `fn` binds on the
    materialized `args`, with its exact params; no materialization allowed."""
    dense = [a.materialize() if isinstance(a, qax.ImplicitArray) else a for a in args]
    eqn = find_eqn(jax.make_jaxpr(fn)(*dense).jaxpr, name)
    shapes = [tuple(v.aval.shape) for v in eqn.invars]
    if shapes == [tuple(jnp.shape(a)) for a in args[::-1]]:
        args = args[::-1]
    assert shapes == [tuple(jnp.shape(a)) for a in args], (shapes, eqn)
    report = qax.testing.check_handler(name, *args, **eqn.params, **tol)
    assert not report.materializations
    return report


def primitive_names(jaxpr) -> list[str]:
    """Names of every primitive in a (closed) jaxpr, sub-jaxprs included."""
    return [eqn.primitive.name for eqn in all_eqns(jaxpr)]


def weight_shaped_sums(jaxpr, shapes) -> list:
    """The `add`/`add_any` equations whose result has one of `shapes`."""
    return [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name in ("add", "add_any")
        and tuple(e.outvars[0].aval.shape) in shapes
    ]


def forms_full_lora(jaxpr, d_in: int, d_out: int, rank: int) -> bool:
    """Whether the jaxpr forms `a @ b.T` (a contraction over the rank) of weight size."""
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        out = eqn.outvars[0].aval
        contracted = [lhs.shape[d] for d in lc]
        if contracted == [rank] and tuple(out.shape[-2:]) in (
            (d_in, d_out),
            (d_out, d_in),
        ):
            return True
    return False


# ----------------------------------------------------------------------------------------
# Symbolic zeros


class Zeros(qax.ImplicitArray):
    """A symbolic all-zeros array with add/mul/broadcast handlers (as in the how-to)."""

    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


def _shape_dtype(*xs):
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in xs))
    return shape, jnp.result_type(*(x.dtype for x in xs))


@qax.primitive_handler("add")
def _zeros_add(primitive, z: Zeros, other: qax.ArrayValue):
    shape, dtype = _shape_dtype(z, other)
    if isinstance(other, Zeros):
        return type(z)(shape=shape, dtype=dtype)
    return jnp.broadcast_to(other, shape).astype(dtype)


@qax.primitive_handler("mul")
def _zeros_mul(primitive, z: Zeros, other: qax.ArrayValue):
    shape, dtype = _shape_dtype(z, other)
    return type(z)(shape=shape, dtype=dtype)


@qax.primitive_handler("broadcast_in_dim")
def _zeros_broadcast(primitive, z: Zeros, *, shape, **params):
    return type(z)(shape=shape, dtype=z.dtype)


class ClosedZeros(Zeros):
    """`Zeros` that also stays symbolic under neg/sin/stop_gradient, `max` with a
    non-positive constant, convert_element_type, reduce_sum and ``x @ Z``: whole
    programs (the higher-order tests') run on it without materializing."""


@qax.primitive_handler(["neg", "sin", "stop_gradient"])
def _closed_zeros_unary(primitive, z: ClosedZeros, **params):
    return ClosedZeros(shape=z.shape, dtype=z.dtype)


@qax.primitive_handler("max")
def _closed_zeros_max(primitive, z: ClosedZeros, other: qax.ArrayValue):
    # max(0, c) is symbolic when c is a known non-positive constant (e.g. relu's 0).
    if isinstance(other, jax.core.Tracer) or isinstance(other, qax.ImplicitArray):
        return NotImplemented
    if np.any(np.asarray(other) > 0):
        return NotImplemented
    shape, dtype = _shape_dtype(z, other)
    return ClosedZeros(shape=shape, dtype=dtype)


@qax.primitive_handler("convert_element_type")
def _closed_zeros_convert(primitive, z: ClosedZeros, *, new_dtype, **params):
    return ClosedZeros(shape=z.shape, dtype=new_dtype)


@qax.primitive_handler("reduce_sum")
def _closed_zeros_sum(primitive, z: ClosedZeros, *, axes, **params):
    shape = tuple(d for i, d in enumerate(z.shape) if i not in axes)
    return ClosedZeros(shape=shape, dtype=z.dtype)


@qax.primitive_handler("dot_general")
def _closed_zeros_matmul(
    primitive, x: jax.Array, z: ClosedZeros, *, dimension_numbers, **params
):
    out = jax.eval_shape(
        lambda a, b: jax.lax.dot_general(a, b, dimension_numbers, **params),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct(z.shape, z.dtype),
    )
    return ClosedZeros(shape=out.shape, dtype=out.dtype)


# ----------------------------------------------------------------------------------------
# LoRA weights `w + a @ b.T` (w [m, n], a [m, r], b [n, r])


def is_plain_matmul(x, dimension_numbers) -> bool:
    """Whether `dot_general(x, w, dimension_numbers)` is ``x @ w``."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    return (
        tuple(lhs_contract) == (x.ndim - 1,)
        and tuple(rhs_contract) == (0,)
        and tuple(lhs_batch) == ()
        and tuple(rhs_batch) == ()
    )


@dataclass
class LoraMatrix(qax.ImplicitArray):
    """W + A Bᵀ, never formed by ``x @ W`` nor by the contraction ``x @ W.T``."""

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.w + self.a @ self.b.T


def _matmul_side(x, w, dimension_numbers):
    """0 for `x @ w`, 1 for `x @ w.T`, None for any other contraction."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if w.ndim != 2 or lhs_batch or rhs_batch or tuple(lhs_contract) != (x.ndim - 1,):
        return None
    return {(0,): 0, (1,): 1}.get(tuple(rhs_contract))


@qax.primitive_handler("dot_general")
def _lora_matmul(
    primitive, x: jax.Array, w: LoraMatrix, *, dimension_numbers, **params
):
    side = _matmul_side(x, w, dimension_numbers)
    if side is None:
        return NotImplemented
    out = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **params
    )
    first, second = (w.a, w.b) if side == 0 else (w.b, w.a)
    return out + (x @ first) @ second.T


@dataclass
class PlainMatmulLora(qax.ImplicitArray):
    """W + A Bᵀ with one handler, for ``x @ W`` only: any other contraction, ``W.T``
    and the cotangent ``g @ W.T`` of a gradient with respect to ``x`` materialize.

    `follows`: `a` runs along the rows of `w`, `b` along its columns (how shardings of
    the weight split them).
    """

    w: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
    a: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, None))
    b: qax.ArrayValue = qax.array_field(ndim=2, follows=(1, None))

    def materialize(self):
        return self.w + self.a @ jnp.swapaxes(self.b, -1, -2)

    def compute_shape(self):
        return self.w.shape

    def compute_dtype(self):
        return self.w.dtype


@qax.primitive_handler("dot_general")
def plain_matmul_lora_matmul(
    primitive, x: jax.Array, w: PlainMatmulLora, *, dimension_numbers, **params
):
    """``x @ W + (x @ A) @ B.T``, never forming ``W + A @ B.T``."""
    if not is_plain_matmul(x, dimension_numbers):
        return NotImplemented
    out = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **params
    )
    return out + (x @ w.a) @ w.b.T


class TransposableLora(PlainMatmulLora):
    """A `PlainMatmulLora` with a `transpose` handler too."""


@qax.primitive_handler("transpose")
def _transposable_lora_transpose(primitive, w: TransposableLora, *, permutation):
    return TransposableLora(w.w.T, w.b, w.a)


class QuietLora(PlainMatmulLora, warn_on_materialize=False):
    """A `PlainMatmulLora` that materializes without a warning."""


@dataclass
class UndeclaredLora(qax.ImplicitArray):
    """W + A Bᵀ that declares nothing (no field ranks) and has no handler."""

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue

    def materialize(self):
        return self.w + self.a @ self.b.T


@dataclass
class TaggedLora(qax.ImplicitArray):
    """W + A Bᵀ with undeclared field ranks, a static `tag` aux field (which optax
    helpers must refuse to freeze) and a handler for ``x @ W`` only."""

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue
    tag: str = qax.aux_field(default="lora")

    def materialize(self):
        return self.w + self.a @ self.b.T


@qax.primitive_handler("dot_general")
def _tagged_lora_matmul(
    primitive, x: jax.Array, w: TaggedLora, *, dimension_numbers, **params
):
    if not is_plain_matmul(x, dimension_numbers):
        return NotImplemented
    return x @ w.w + (x @ w.a) @ w.b.T


def make_lora(
    key, rows=6, cols=5, rank=2, dtype=jnp.float32, *, cls=LoraMatrix, lead=()
):
    """A `cls` (W [rows, cols] + A Bᵀ) with standard-normal leaves; `lead`: a stack."""
    k_w, k_a, k_b = jax.random.split(key, 3)
    return cls(
        jax.random.normal(k_w, (*lead, rows, cols), dtype),
        jax.random.normal(k_a, (*lead, rows, rank), dtype),
        jax.random.normal(k_b, (*lead, cols, rank), dtype),
    )


def scaled_lora(d_in=5, d_out=6, rank=2, seed=0, lead=()):
    """A `PlainMatmulLora` whose ``x @ W`` stays of order one (the higher-order tests').

    `w` and `a` are scaled by 1/sqrt(d_in), `b` by 0.5; `lead` dims make a stack.
    """
    lora = make_lora(
        jax.random.PRNGKey(seed), d_in, d_out, rank, cls=PlainMatmulLora, lead=lead
    )
    scale = 1.0 / np.sqrt(d_in)
    return PlainMatmulLora(lora.w * scale, lora.a * scale, lora.b * 0.5)


# ----------------------------------------------------------------------------------------
# LoRA kernels of any rank, for the library integrations (Flax, Equinox, Orbax)


@dataclass
class LoraKernel(qax.ImplicitArray):
    """``w + (a @ b.T).reshape(w.shape)``: ``a`` has ``prod(w.shape[:split])`` rows,
    ``b`` has ``prod(w.shape[split:])`` rows.

    ``x @ W`` layouts (Flax: kernel ``(in..., out...)``, ``split`` = number of input
    dims) and ``W @ x`` layouts (Equinox: weight ``(out, in)``, ``split=1``) both stay
    implicit. Its `materialize()` raises, so a passing test proves that every use went
    through a handler.
    """

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue
    split: int = qax.aux_field(default=1)

    def compute_shape(self):
        return jnp.shape(self.w)

    def compute_dtype(self):
        return jnp.result_type(self.w)

    def materialize(self):
        raise ValueError("LoraKernel must stay implicit in these tests")

    def dense(self):
        """The represented array, for oracles outside `use_implicit_args`."""
        delta = self.a @ jnp.swapaxes(self.b, -1, -2)
        return self.w + delta.reshape(self.w.shape).astype(self.w.dtype)


@dataclass
class LoraKernel2(LoraKernel):
    """A `LoraKernel` over a 2-D kernel, with declared ranks (scanned stacks slice it)."""

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)


@dataclass
class LoraKernel3(LoraKernel):
    """A `LoraKernel` over a 3-D kernel (attention projections)."""

    w: qax.ArrayValue = qax.array_field(ndim=3)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)


def lora_kernel(w, rank, key, split=1, scale=0.1, batch=0):
    """A `LoraKernel` over `w` whose product is nonzero (so the factors matter).

    `batch` leading dims of `w` are a stack of kernels (scanned layers).
    """
    stack, core = w.shape[:batch], w.shape[batch:]
    lead = math.prod(core[:split])
    trail = math.prod(core[split:])
    ka, kb = jax.random.split(key)
    a = scale * jax.random.normal(ka, (*stack, lead, rank), w.dtype)
    b = scale * jax.random.normal(kb, (*stack, trail, rank), w.dtype)
    cls = {2: LoraKernel2, 3: LoraKernel3}.get(len(core), LoraKernel)
    return cls(w, a, b, split=split)


def _move_flat(x, dims, front):
    """`x` with `dims` moved to the front (or back) and flattened into one axis."""
    rest = [d for d in range(x.ndim) if d not in dims]
    free = [x.shape[d] for d in rest]
    size = math.prod(x.shape[d] for d in dims)
    if front:
        return jnp.transpose(x, [*dims, *rest]).reshape(size, -1), free
    return jnp.transpose(x, [*rest, *dims]).reshape(-1, size), free


@qax.primitive_handler("dot_general")
def _x_at_kernel(
    primitive, x: jax.Array, k: LoraKernel, *, dimension_numbers, **params
):
    (x_c, k_c), (x_b, k_b) = dimension_numbers
    if x_b or k_b or tuple(k_c) != tuple(range(k.split)):
        return NotImplemented
    out = qax.default_handler(
        primitive, x, k.w, dimension_numbers=dimension_numbers, **params
    )
    flat, free = _move_flat(x, tuple(x_c), front=False)
    delta = ((flat @ k.a) @ k.b.T).reshape(*free, *k.shape[k.split :])
    return out + delta.astype(out.dtype)


@qax.primitive_handler("dot_general")
def _kernel_at_x(
    primitive, k: LoraKernel, x: jax.Array, *, dimension_numbers, **params
):
    (k_c, x_c), (k_b, x_b) = dimension_numbers
    if k_b or x_b or tuple(k_c) != tuple(range(k.split, k.ndim)):
        return NotImplemented
    out = qax.default_handler(
        primitive, k.w, x, dimension_numbers=dimension_numbers, **params
    )
    flat, free = _move_flat(x, tuple(x_c), front=True)
    delta = (k.a @ (k.b.T @ flat)).reshape(*k.shape[: k.split], *free)
    return out + delta.astype(out.dtype)


@qax.primitive_handler("convert_element_type")
def _kernel_convert(primitive, k: LoraKernel, *, new_dtype, **params):
    if np.dtype(new_dtype) == np.dtype(k.dtype):
        return k
    return NotImplemented


# ----------------------------------------------------------------------------------------
# Other shared types


@dataclass
class NeverMaterialize(qax.ImplicitArray):
    """Wraps an array; materializing it raises, and a per-type default rule wraps every
    result, so a result of this type proves that a computation stayed implicit."""

    array: qax.ArrayValue

    def compute_shape(self):
        return jnp.shape(self.array)

    def compute_dtype(self):
        return jnp.result_type(self.array)

    def materialize(self):
        raise ValueError("Refusing to materialize NeverMaterialize")

    @classmethod
    def default_handler(cls, primitive, *args, params):
        raw = [a.array if isinstance(a, NeverMaterialize) else a for a in args]
        out = primitive.bind(*raw, **params)
        if primitive.multiple_results:
            return [NeverMaterialize(o) for o in out]
        return NeverMaterialize(out)


@dataclass
class Scaled(qax.ImplicitArray):
    """`x * s` for a scalar `s` (which may be a Python float: a weak-typed leaf)."""

    x: qax.ArrayValue
    s: qax.ArrayValue

    def materialize(self):
        return self.x * self.s

    def compute_shape(self):
        return jnp.shape(self.x)

    def compute_dtype(self):
        return jnp.result_type(self.x)


@qax.primitive_handler("mul")
def _scaled_mul(primitive, a: Scaled, b: jax.Array):
    if jnp.ndim(b) != 0:
        return NotImplemented
    return Scaled(a.x, a.s * b)


# ----------------------------------------------------------------------------------------
# The optax tests' problem: a two-layer model of `TaggedLora` weights

OPTAX_RANK = 2


def tagged_lora(key, n, m):
    """A `TaggedLora` [n, m] with a zero `b` (the usual LoRA initialization)."""
    kw, ka = jax.random.split(key)
    w = jax.random.normal(kw, (n, m)) / np.sqrt(n)
    a = jax.random.normal(ka, (n, OPTAX_RANK)) / np.sqrt(n)
    return TaggedLora(w, a, jnp.zeros((m, OPTAX_RANK)))


def lora_problem(seed=0):
    """A two-layer LoRA model and data that a rank-2 update of its weights fits."""
    k = jax.random.split(jax.random.PRNGKey(seed), 7)
    params = {
        "l1": tagged_lora(k[0], 8, 16),
        "l2": tagged_lora(k[1], 16, 4),
        "bias": jnp.zeros(4),
    }

    def shifted(key, w):
        ka, kb = jax.random.split(key)
        a = jax.random.normal(ka, (w.shape[0], OPTAX_RANK))
        b = jax.random.normal(kb, (w.shape[1], OPTAX_RANK))
        return w + a @ b.T / np.sqrt(w.shape[0])

    x = jax.random.normal(k[2], (64, 8))
    w1, w2 = shifted(k[3], params["l1"].w), shifted(k[4], params["l2"].w)
    y = jnp.tanh(x @ w1) @ w2
    return params, x, y


def state_size(opt_state):
    """The number of array elements in an optimizer state."""
    return sum(np.size(x) for x in jax.tree_util.tree_leaves(opt_state))


def sizes(params, fields):
    """The number of elements of `fields` of the `lora_problem` weights."""
    return sum(getattr(params[k], f).size for k in ("l1", "l2") for f in fields)


# ----------------------------------------------------------------------------------------
# The eager lanes' types (tests/test_eager.py)


class Doubled(qax.ImplicitArray):
    """``2 * x``, never formed; ``lax.mul`` by an array gives a new `Doubled`."""

    x: qax.ArrayValue

    def materialize(self):
        return 2 * self.x


@qax.primitive_handler("mul")
def _doubled_mul(primitive, a: Doubled, b: jax.Array):
    return type(a)(jax.lax.mul(a.x, b))


class PeekingDoubled(Doubled):
    """`Doubled` whose ``mul`` handler reads its other operand's values: it stays
    implicit only for non-negative operands, and cannot be traced."""


@qax.primitive_handler("mul")
def _peeking_mul(primitive, a: PeekingDoubled, b: jax.Array):
    if not bool(jnp.all(b >= 0)):  # a concrete value (fails on a tracer)
        return NotImplemented
    return PeekingDoubled(jax.lax.mul(a.x, b))


def run_on_eight_devices(*pytest_args: str, env: dict | None = None, timeout=600):
    """``python -m pytest -q *pytest_args`` in a child process with 8 simulated CPU
    devices (the count must be set before JAX starts); fails with its output. Returns
    the child's stdout."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, **(env or {}), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-8000:]
    assert " passed" in report and "skipped" not in report.split("\n")[-2], report
    return proc.stdout
