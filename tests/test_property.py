"""Property-based check: random programs on random implicit inputs equal the dense ones.

Hypothesis draws an implicit input (declared or undeclared batching, with or without
handlers, nested, symbolic), a short program of array operations with transformations
wrapped around parts of it (jit, vmap, grad, jvp, scan, cond, fori_loop, while_loop,
checkpoint, custom_jvp; loop carries may change their implicit structure) and an outer
transformation (none, jit, gradients, `vmap` or `lax.scan` outside `use_implicit_args`
over a stack of inputs built by `vmap`); `qax.use_implicit_args(f)(x)` must equal `f` on the
materialized input: values, shapes, dtypes, weak types, and gradients with respect to
the implicit input's leaves and to the dense input.

The budget is bounded for CI; set ``QAX_PROPERTY_EXAMPLES=1000`` (for example) for a
longer, randomized search (``--hypothesis-seed=N`` picks the draw).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import hypothesis  # in the `test` extra
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import qax
from qax.symbols import SymbolicConstant

st = hypothesis.strategies

EXAMPLES = int(os.environ.get("QAX_PROPERTY_EXAMPLES", "20"))
N = 4


# ----------------------------------------------------------------------------------------
# Implicit types: declared with a handler, undeclared without, shape-only with handlers
# The fuzzer's own types, not tests/helpers.py's: the generator's inputs (which
# primitives have handlers, which types declare batch axes) are fixed here, beside it.


# Like helpers.PlainMatmulLora, but its handler also refuses a stacked (3-D) `w`.
@dataclass
class PropLora(qax.ImplicitArray):
    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.w + self.a @ self.b.T


@qax.primitive_handler("dot_general")
def _prop_lora_matmul(primitive, x: jax.Array, w: PropLora, *, dimension_numbers, **kw):
    (lc, rc), (lb, rb) = dimension_numbers
    if w.ndim != 2 or lb or rb or tuple(lc) != (x.ndim - 1,) or tuple(rc) != (0,):
        return NotImplemented
    out = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **kw
    )
    return out + (x @ w.a) @ w.b.T


@dataclass
class PropScaled(qax.ImplicitArray):
    """No batch declaration and no handlers: everything materializes."""

    x: qax.ArrayValue
    s: qax.ArrayValue

    def materialize(self):
        return self.x * self.s


@dataclass
class PropShift(qax.ImplicitArray):
    """No batch declaration, with handlers written for one example (a scalar `c`)."""

    x: qax.ArrayValue
    c: qax.ArrayValue

    def materialize(self):
        return self.x + self.c


@qax.primitive_handler("mul")
def _prop_shift_mul(primitive, a: PropShift, b: qax.ArrayValue):
    if jnp.ndim(b) != 0:
        return NotImplemented
    return PropShift(a.x * b, a.c * b)


@qax.primitive_handler("transpose")
def _prop_shift_transpose(primitive, a: PropShift, *, permutation):
    # Right only for one example: on a stack `c` would need its own transpose.
    return PropShift(jnp.transpose(a.x, permutation), a.c)


@qax.primitive_handler("sin")
def _prop_shift_sin(primitive, a: PropShift, **params):
    return jnp.sin(a.x + a.c)


@dataclass
class PropOuter(qax.ImplicitArray):
    """No batch declaration, around a declared implicit array."""

    inner: qax.ArrayValue
    bias: qax.ArrayValue

    def materialize(self):
        return qax.materialize_nested(self.inner) + self.bias


# Unlike helpers.Zeros, a `mul` handler only: `add` and broadcasts materialize.
class PropZeros(qax.ImplicitArray):
    default_dtype = jnp.float32

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


@qax.primitive_handler("mul")
def _prop_zeros_mul(primitive, z: PropZeros, other: qax.ArrayValue):
    shape = jnp.broadcast_shapes(z.shape, jnp.shape(other))
    return PropZeros(shape=shape, dtype=jnp.result_type(z.dtype, other.dtype))


@dataclass
class PropDiag(qax.ImplicitArray):
    """Declared, with a handler for ``x @ diag``: a broadcast multiply."""

    d: qax.ArrayValue = qax.array_field(ndim=1)

    def compute_shape(self):
        return (*self.d.shape[:-1], self.d.shape[-1], self.d.shape[-1])

    def compute_dtype(self):
        return self.d.dtype

    def materialize(self):
        return jnp.diag(self.d)


@dataclass
class PropULora(qax.ImplicitArray):
    """LoRA that declares no batch axes, with a handler written for one example: a
    stack of them built by `vmap` or by hand may share its base across examples."""

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue

    def materialize(self):
        return self.w + self.a @ jnp.swapaxes(self.b, -1, -2)


@qax.primitive_handler("dot_general")
def _prop_ulora_matmul(
    primitive, x: jax.Array, w: PropULora, *, dimension_numbers, **kw
):
    (lc, rc), (lb, rb) = dimension_numbers
    if w.ndim != 2 or lb or rb or tuple(lc) != (x.ndim - 1,) or tuple(rc) != (0,):
        return NotImplemented
    out = qax.default_handler(
        primitive, x, w.w, dimension_numbers=dimension_numbers, **kw
    )
    return out + (x @ w.a) @ w.b.T


@qax.primitive_handler("dot_general")
def _prop_diag_matmul(primitive, x: jax.Array, w: PropDiag, *, dimension_numbers, **kw):
    (lc, rc), (lb, rb) = dimension_numbers
    if w.ndim != 2 or lb or rb or tuple(lc) != (x.ndim - 1,) or tuple(rc) != (0,):
        return NotImplemented
    return (x * w.d).astype(kw.get("preferred_element_type") or x.dtype)


def make_input(kind: str, seed: int):
    k = jax.random.split(jax.random.PRNGKey(seed), 3)

    def normal(key, shape):
        return 0.5 * jax.random.normal(key, shape)

    if kind == "lora":
        return PropLora(
            normal(k[0], (N, N)), normal(k[1], (N, 2)), normal(k[2], (N, 2))
        )
    if kind == "scaled":
        return PropScaled(normal(k[0], (N, N)), jnp.asarray(1.5))
    if kind == "nested":
        inner = PropScaled(normal(k[0], (N, N)), jnp.asarray(0.5))
        return PropLora(inner, normal(k[1], (N, 2)), normal(k[2], (N, 2)))
    if kind == "shift":
        return PropShift(normal(k[0], (N, N)), 0.5 * jax.random.normal(k[1], ()))
    if kind == "outer":
        inner = PropLora(
            normal(k[0], (N, N)), normal(k[1], (N, 2)), normal(k[2], (N, 2))
        )
        return PropOuter(inner, normal(k[2], (N,)))
    if kind == "zeros":
        return PropZeros(shape=(N, N))
    if kind == "constant":
        return SymbolicConstant(0.75, shape=(N, N))  # weakly typed
    if kind == "lora_constant":  # a LoRA over a symbolic-constant base
        base = SymbolicConstant(0.75, shape=(N, N), dtype=jnp.float32)
        return PropLora(base, normal(k[1], (N, 2)), normal(k[2], (N, 2)))
    if kind == "ulora_constant":
        base = SymbolicConstant(0.75, shape=(N, N), dtype=jnp.float32)
        return PropULora(base, normal(k[1], (N, 2)), normal(k[2], (N, 2)))
    raise ValueError(kind)


KINDS = [
    "lora",
    "scaled",
    "nested",
    "shift",
    "outer",
    "zeros",
    "constant",
    "lora_constant",
    "ulora_constant",
]


# ----------------------------------------------------------------------------------------
# Programs


OPS = {
    "sin": lambda h, y: jnp.sin(h),
    "tanh": lambda h, y: jnp.tanh(h),
    "scale": lambda h, y: h * 0.5,
    "add_y": lambda h, y: h + y,
    "matmul_right": lambda h, y: h @ y,
    "matmul_left": lambda h, y: y @ h,
    "transpose": lambda h, y: h.T,
    "relu": lambda h, y: jax.nn.relu(h),
    "square": lambda h, y: h * h,
    "center": lambda h, y: h - h.mean(0),
    "add_one": lambda h, y: h + 1.0,  # a symbolic constant changes its value
}


# Implicit values built inside the wrapped function around the current value `h` (an
# implicit argument, a value derived from one, or one built earlier: nesting grows
# along the program), then used by operators and JAX functions (`jnp`, `lax`,
# `jax.nn`). The oracle runs the same program with each construction replaced by the
# dense array it stands for (`BUILD_DENSE`).
_FA = 0.5 * jax.random.normal(jax.random.PRNGKey(7), (N, 2))
_FB = 0.5 * jax.random.normal(jax.random.PRNGKey(8), (N, 2))
# Per-example factors of stacks that share their base (the current value) across
# examples: built inside `vmap` with the base closed over, or stacked by hand.
_SA = 0.5 * jax.random.normal(jax.random.PRNGKey(9), (2, N, 2))
_SB = 0.5 * jax.random.normal(jax.random.PRNGKey(10), (2, N, 2))
BUILD_DENSE = [False]


def _built(implicit, dense):
    if not BUILD_DENSE[0]:
        return implicit()
    # An implicit array's `aval` is never weakly typed: neither is the dense array it
    # stands for.
    out = dense()
    return jnp.asarray(out, dtype=out.dtype)


def _diag_of(h):  # (well conditioned: values grow along a program)
    return 0.5 + 0.5 * jnp.tanh(jnp.mean(h, axis=0) if jnp.ndim(h) == 2 else h)


def _diag_right(h, y):
    if jnp.ndim(h) not in (1, 2):
        return h
    d = _diag_of(h)
    return _built(lambda: h @ PropDiag(d), lambda: h @ jnp.diag(d))


def _shared_stack(cls, by_hand):
    """A stack of two `cls` LoRAs over the current value (one base, shared)."""

    def op(h, y):
        if jnp.ndim(h) != 2:
            return h

        def implicit():
            if by_hand:
                return cls(h, _SA, _SB)
            return jax.vmap(lambda a, b: cls(h, a, b))(_SA, _SB)

        return _built(implicit, lambda: h + _SA @ jnp.swapaxes(_SB, -1, -2))

    return op


def _lax_dot(h, y):
    if jnp.ndim(h) not in (1, 2):
        return h
    return lax.dot_general(y, h, (((1,), (0,)), ((), ())))


BUILD_OPS = {
    "build_scaled": lambda h, y: _built(
        lambda: PropScaled(h, jnp.asarray(1.5)), lambda: h * jnp.asarray(1.5)
    ),
    "build_shift": lambda h, y: _built(
        lambda: PropShift(h, jnp.asarray(0.25)), lambda: h + jnp.asarray(0.25)
    ),
    "build_lora": lambda h, y: (
        h
        if jnp.ndim(h) != 2
        else _built(lambda: PropLora(h, _FA, _FB), lambda: h + _FA @ _FB.T)
    ),
    "build_outer": lambda h, y: (
        h if jnp.ndim(h) < 1 else _built(lambda: PropOuter(h, y[0]), lambda: h + y[0])
    ),
    "diag_right": _diag_right,
    "stack_lora": _shared_stack(PropLora, by_hand=False),
    "stack_ulora": _shared_stack(PropULora, by_hand=False),
    "hand_stack_ulora": _shared_stack(PropULora, by_hand=True),
    "jnp_matmul": lambda h, y: h if jnp.ndim(h) < 1 else jnp.matmul(h, y),
    "lax_dot": _lax_dot,
    "einsum": lambda h, y: h if jnp.ndim(h) < 1 else jnp.einsum("...j,jk->...k", h, y),
    "add_mean": lambda h, y: h + jnp.mean(h),
    "nn_gelu": lambda h, y: jax.nn.gelu(h),
}


@jax.custom_jvp
def _soft(h):
    return h / (1.0 + jnp.abs(h))


@_soft.defjvp
def _soft_jvp(primals, tangents):
    (h,), (t,) = primals, tangents
    return _soft(h), t / (1.0 + jnp.abs(h)) ** 2


def apply_block(block, h, y):
    for item in block:
        if isinstance(item, str):
            h = OPS[item](h, y) if item in OPS else BUILD_OPS[item](h, y)
        else:
            transform, inner = item
            h = TRANSFORMS[transform](
                lambda h, inner=inner: apply_block(inner, h, y), h, y
            )
    return h


TRANSFORMS = {
    "jit": lambda g, h, y: jax.jit(g)(h),
    "checkpoint": lambda g, h, y: jax.checkpoint(g)(h),
    "cond": lambda g, h, y: lax.cond(jnp.sum(y) > 0, g, lambda h: g(h) * 0.5, h),
    "scan": lambda g, h, y: lax.scan(lambda c, _: (g(c), None), h, None, length=2)[0],
    "fori": lambda g, h, y: lax.fori_loop(0, 2, lambda i, c: g(c), h),
    "while": lambda g, h, y: lax.while_loop(
        lambda ic: ic[0] < 2, lambda ic: (ic[0] + 1, g(ic[1])), (0, h)
    )[1],
    "vmap": lambda g, h, y: jax.vmap(g)(h),
    "grad": lambda g, h, y: jax.grad(lambda h: jnp.sum(jnp.tanh(g(h))))(h),
    "custom_jvp": lambda g, h, y: _soft(g(h)),
    # The tangent: as weak as the primal `h`, whatever the (strong) tangent given.
    "jvp": lambda g, h, y: jax.jvp(g, (h,), (jnp.full(jnp.shape(h), 0.5, h.dtype),))[1],
}


_PLAIN_OPS = tuple(sorted(OPS))
_TRANSFORMS = tuple(sorted(TRANSFORMS))


def blocks(depth: int, ops=_PLAIN_OPS, transforms=_TRANSFORMS):
    op = st.sampled_from(ops)
    if depth == 0:
        return st.lists(op, min_size=1, max_size=3)
    inner = blocks(depth - 1, ops, transforms)
    wrapped = st.tuples(st.sampled_from(transforms), inner)
    return st.lists(st.one_of(op, wrapped), min_size=1, max_size=4)


# ----------------------------------------------------------------------------------------
# The oracle


def dense(x):
    """The dense array `x` stands for: its materialization, with its `aval`'s weak type
    (what JAX sees of it inside `use_implicit_args`; `materialize()` may give a weakly
    typed array for a type whose `aval` never is)."""
    if isinstance(x, qax.ImplicitArray):
        out = qax.materialize_nested(x, full=True)
        if jax.typeof(out).weak_type and not x.aval.weak_type:
            out = jnp.asarray(out, dtype=out.dtype)
        return out
    return x


def assert_same(got, want, what):
    got = dense(got)
    assert jnp.shape(got) == jnp.shape(want), what
    assert jnp.result_type(got) == jnp.result_type(want), what
    assert jax.typeof(got).weak_type == jax.typeof(want).weak_type, what
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=2e-3,
        atol=2e-4,
        equal_nan=True,
        err_msg=what,
    )


def dense_or_reject(fn, *args):
    """`fn(*args)` for the dense program; a program JAX rejects does not count (reverse
    differentiation of a `while_loop`)."""
    try:
        return fn(*args)
    except (TypeError, ValueError, IndexError):
        hypothesis.reject()


OUTER = ["none", "jit", "grad_y", "grad_leaves", "vmap_outside", "scan_outside"]


def _programs(ops, transforms=_TRANSFORMS):
    """The hypothesis settings and draws of a test of random programs over `ops`."""

    def decorate(test):
        given = hypothesis.given(
            kind=st.sampled_from(KINDS),
            seed=st.integers(0, 2**16),
            program=blocks(2, ops, transforms),
            outer=st.sampled_from(OUTER),
        )
        return hypothesis.settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            derandomize=os.environ.get("QAX_PROPERTY_EXAMPLES") is None,
        )(given(test))

    return decorate


@_programs(_PLAIN_OPS)
def test_random_programs_match_the_materialized_computation(kind, seed, program, outer):
    check_program(kind, seed, program, outer)


class _Dense:
    """Within it, the constructions of `BUILD_OPS` give the dense arrays."""

    def __enter__(self):
        BUILD_DENSE[0] = True

    def __exit__(self, *exc):
        BUILD_DENSE[0] = False


def check_program(kind, seed, program, outer):
    """`qax.use_implicit_args(f)(x, y)` against `f` on the materialized `x`, under
    `outer`, where `f` runs `program`."""
    x = make_input(kind, seed)
    y = 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1), (N, N))

    def f_implicit(x, y):
        return apply_block(program, x, y)

    def f(x, y):  # the dense program
        with _Dense():
            return apply_block(program, x, y)

    what = f"{kind} {program} {outer}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        try:  # programs that JAX rejects (a scan carry changing shape) don't count
            jax.eval_shape(f, dense(x), y)
        except (TypeError, ValueError, IndexError):
            hypothesis.reject()
        if outer == "vmap_outside":
            # A stack of inputs built by `vmap`, mapped again outside the wrapper:
            # each example is rebuilt from its leaves, whether or not its type
            # declares batch axes.
            stacked = jax.vmap(lambda s: make_input(kind, s))(jnp.arange(3) + seed)
            got = jax.vmap(qax.use_implicit_args(f_implicit), in_axes=(0, None))(
                stacked, y
            )
            want = jax.vmap(f, in_axes=(0, None))(dense(stacked), y)
            assert_same(got, want, what)
        elif outer == "scan_outside":
            # The same stack, scanned outside the wrapper: each row is rebuilt from
            # its sliced leaves (a shape-only part, a symbolic-constant base, has none).
            stacked = jax.vmap(lambda s: make_input(kind, s))(jnp.arange(3) + seed)
            if not jax.tree_util.tree_leaves(stacked):
                hypothesis.reject()  # (`lax.scan` cannot slice a value without leaves)
            g = qax.use_implicit_args(f_implicit)
            got = lax.scan(lambda c, x: (c, g(x, y)), 0, stacked)[1]
            want = lax.scan(lambda c, x: (c, f(x, y)), 0, dense(stacked))[1]
            assert_same(got, want, what)
        elif outer in ("none", "jit"):
            g, oracle = qax.use_implicit_args(f_implicit), f
            if outer == "jit":
                # (the dense program jitted too: JAX's `add_any` takes the weak type of
                # its first operand when traced and promotes eagerly)
                g, oracle = jax.jit(g), jax.jit(f)
            assert_same(g(x, y), oracle(dense(x), y), what)
        elif outer == "grad_y":

            def loss(fn):
                return lambda x, y: jnp.sum(jnp.cos(dense(fn(x, y))))

            want = dense_or_reject(jax.grad(loss(f), argnums=1), dense(x), y)
            got = jax.grad(loss(qax.use_implicit_args(f_implicit)), argnums=1)(x, y)
            assert_same(got, want, what)
        else:
            leaves, tree = jax.tree_util.tree_flatten(x)
            if not leaves:
                return

            def loss(fn, through_dense):
                def of_leaves(leaves):
                    value = jax.tree_util.tree_unflatten(tree, leaves)
                    if through_dense:
                        value = dense(value)
                    return jnp.sum(jnp.cos(dense(fn(value, y))))

                return of_leaves

            want = dense_or_reject(jax.grad(loss(f, True)), leaves)
            got = jax.grad(loss(qax.use_implicit_args(f_implicit), False))(leaves)
            for g_leaf, w_leaf in zip(got, want, strict=True):
                assert_same(g_leaf, w_leaf, what)


# Implicit values built inside the wrapped function (around arguments, values derived
# from them and each other), drawn often among the ordinary operations.
_WITH_BUILDS = tuple(sorted(OPS)) + tuple(sorted(BUILD_OPS)) * 2


@_programs(_WITH_BUILDS)
def test_random_programs_building_implicit_values_inside(kind, seed, program, outer):
    check_program(kind, seed, program, outer)


def test_grad_through_a_loop_carrying_the_tangent_of_a_value_built_inside_jvp():
    """The tangent of ``PropScaled(h + y, 1.5)`` built inside `jax.jvp` takes no term
    from the constant leaf (its tangent is a symbolic zero), so, as densely, it does not
    depend on the primal and `grad` can go through a `while_loop` that carries it (it
    was ``(h + y) * 0`` and JAX refused reverse mode through the loop)."""
    program = [
        ("checkpoint", [("jvp", ["add_y", "build_scaled"]), ("while", ["add_one"])])
    ]
    check_program("lora", 0, program, "grad_y")


@hypothesis.settings(
    max_examples=max(EXAMPLES // 3, 5),
    deadline=None,
    suppress_health_check=list(hypothesis.HealthCheck),
    derandomize=os.environ.get("QAX_PROPERTY_EXAMPLES") is None,
)
@hypothesis.given(
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
    program=blocks(1),
)
def test_vmap_over_stacked_inputs_matches_the_materialized_computation(
    kind, seed, program
):
    stacked = jax.vmap(lambda s: make_input(kind, s))(jnp.arange(3) + seed)
    y = 0.5 * jax.random.normal(jax.random.PRNGKey(seed + 1), (N, N))

    def f(x):
        return apply_block(program, x, y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        try:
            jax.eval_shape(jax.vmap(f), dense(stacked))
        except (TypeError, ValueError, IndexError):
            hypothesis.reject()
        want = jax.vmap(f)(dense(stacked))
        got = jax.vmap(qax.use_implicit_args(f))(stacked)
        assert_same(got, want, f"{kind} {program} vmap outside")
        inside = qax.use_implicit_args(jax.vmap(f))(stacked)
        assert_same(inside, want, f"{kind} {program} vmap inside")
