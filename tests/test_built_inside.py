"""Implicit arrays built inside the wrapped function, around implicit arguments too.

Such a value is what an implicit argument is there: operators, `jnp`/`lax`/`jax.nn`
functions, Flax layers, loop carries and every transformation take it as one array,
its handlers apply, and an implicit argument held in one of its fields is the implicit
value it carries (no tracer escapes). Oracle: the same program with each construction
replaced by the dense array it stands for, or on materialized arguments; the "error"
policy and the jaxpr show that what a handler covers stays implicit.
"""

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax
from qax.lora import LoraWeight
from tests.helpers import assert_close, dense, materializations


@dataclass
class Scaled2(qax.ImplicitArray):
    """`v * s`, declared: `v` has two dimensions in one example."""

    v: qax.ArrayValue = qax.array_field(ndim=2)
    s: float = qax.aux_field(default=2.0)

    def materialize(self):
        return self.v * self.s


@qax.primitive_handler("dot_general")
def _scaled2_matmul(primitive, x: jax.Array, w: Scaled2, **params):
    return qax.default_handler(primitive, x, w.v, **params) * w.s


@dataclass
class Wrap(qax.ImplicitArray):
    """Stands for its `inner` array; a `dot_general` handler passes it through."""

    inner: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.inner


@qax.primitive_handler("dot_general")
def _wrap_matmul(primitive, x: jax.Array, w: Wrap, **params):
    return qax.default_handler(primitive, x, w.inner, **params)


def _policy(*types):
    """Materializing any of `types` is an error."""
    stack = contextlib.ExitStack()
    for t in types:
        stack.enter_context(qax.materialization_policy(t, "error"))
    return stack


def _check(mode, f, *args):
    """`check_mode` with the implicit run under the "error" policy for `Scaled2` and
    `Wrap`, the dense one outside it (JAX may reuse for the dense program a branch or
    body it traced inside the wrapper, where the value built there is materialized as
    a value created inside and used outside: right, but reported)."""
    implicit = qax.use_implicit_args(f)
    if mode in ("eager", "jit"):
        want = f(*dense(args))
        run = jax.jit(implicit) if mode == "jit" else implicit
    else:

        def loss(*a):
            return jnp.sum(jnp.sin(dense(implicit(*a))))

        want = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*dense(a)))), argnums=(0, 1))(
            *args
        )
        run = jax.grad(loss, argnums=(0, 1))
        run = jax.jit(run) if mode == "jit_grad" else run
    with _policy(Scaled2, Wrap):
        got = run(*args)
    assert_close(got, want, rtol=1e-4, atol=1e-4)


KEY = jax.random.PRNGKey(0)
X = jax.random.normal(KEY, (3, 4))
V = jax.random.normal(jax.random.PRNGKey(1), (4, 4))


# ----------------------------------------------------------------------------------------
# Around an implicit argument (the first program)


def _around_argument(base, x):
    return jnp.sum(x @ Wrap(base))


@pytest.mark.parametrize("mode", ["eager", "jit", "grad", "jit_grad"])
def test_a_value_built_around_an_implicit_argument(mode):
    base = Scaled2(V)
    _check(mode, _around_argument, base, X)
    # the dense program on the materialized argument
    want = jnp.sum(X @ (2.0 * V))
    assert_close(qax.use_implicit_args(_around_argument)(base, X), want)


def test_a_value_built_around_an_argument_is_returned_with_the_argument_inside():
    out = qax.use_implicit_args(lambda b: Wrap(Wrap(b)))(Scaled2(V))
    assert type(out) is Wrap and type(out.inner) is Wrap
    assert type(out.inner.inner) is Scaled2  # the argument's value, not a tracer
    assert_close(out, 2.0 * V)


def _transformed(name):
    """`name` applied around a block that builds `Wrap(Wrap(base))` and uses it."""

    def block(base, x):
        return jnp.tanh(x @ Wrap(Wrap(base)))

    if name == "vjp":
        return lambda base, x: jax.vjp(lambda x: block(base, x), x)[1](
            jnp.ones((3, 4))
        )[0]
    if name == "jvp":
        return lambda base, x: jax.jvp(lambda x: block(base, x), (x,), (x,))[1]
    if name == "vmap":
        return lambda base, x: jax.vmap(lambda row: block(base, row[None])[0])(x)
    if name == "scan":
        return lambda base, x: lax.scan(
            lambda c, _: (block(base, c), None), x, None, length=2
        )[0]
    if name == "while_loop":
        return lambda base, x: lax.while_loop(
            lambda ic: ic[0] < 2, lambda ic: (ic[0] + 1, block(base, ic[1])), (0, x)
        )[1]
    if name == "cond":
        return lambda base, x: lax.cond(
            jnp.sum(x) > 0, block, lambda b, x: -block(b, x), base, x
        )
    if name == "remat":
        return lambda base, x: jax.checkpoint(block)(base, x)
    if name == "jit_inside":
        return lambda base, x: jax.jit(block)(base, x)
    raise ValueError(name)


TRANSFORMS = ["vjp", "jvp", "vmap", "scan", "while_loop", "cond", "remat", "jit_inside"]


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("mode", ["eager", "jit", "jit_grad"])
def test_built_around_an_argument_under_transformations(name, mode):
    if mode == "jit_grad" and name == "while_loop":
        pytest.skip("JAX cannot reverse-differentiate a while_loop, densely either")
    _check(mode, _transformed(name), Scaled2(V), X)


def test_built_around_an_argument_inside_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))
    spec = jax.sharding.PartitionSpec

    def passed(base, x):
        def body(x, base):
            return x @ Wrap(base)

        return jax.shard_map(
            body, mesh=mesh, in_specs=(spec("i"), spec()), out_specs=spec("i")
        )(x, base)

    def closed_over(base, x):  # (JAX's own shard_map trace cannot hold `base`)
        return jax.shard_map(
            lambda x: x @ Wrap(base), mesh=mesh, in_specs=spec("i"), out_specs=spec("i")
        )(x)

    for f in (passed, closed_over):
        for run in (qax.use_implicit_args(f), jax.jit(qax.use_implicit_args(f))):
            with _policy(Scaled2, Wrap):
                got = run(Scaled2(V), X)
            assert_close(got, X @ (2.0 * V))


# ----------------------------------------------------------------------------------------
# JAX functions on values built inside (from plain arrays too)

W = jax.random.normal(KEY, (4, 5))
A = jax.random.normal(jax.random.PRNGKey(2), (4, 2))
B = jax.random.normal(jax.random.PRNGKey(3), (2, 5))
DENSE_W = W + A @ B


def _lora():
    return LoraWeight(W, A, B, alpha=2.0)


FUNCTIONS = {
    "jnp.matmul": lambda x, w: jnp.matmul(x, w),
    "jnp.dot": lambda x, w: jnp.dot(x, w),
    "jnp.einsum": lambda x, w: jnp.einsum("bi,io->bo", x, w),
    "lax.dot_general": lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ()))),
    "operator": lambda x, w: x @ w,
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("outer", ["eager", "jit", "grad"])
def test_jax_functions_take_a_value_built_inside_through_its_handlers(name, outer):
    fn = FUNCTIONS[name]

    def f(x):
        return jnp.sum(jnp.sin(fn(x, _lora())))

    def dense(x):
        return jnp.sum(jnp.sin(fn(x, W + (2.0 / 2) * A @ B)))

    run = qax.use_implicit_args(f)
    if outer == "jit":
        run = jax.jit(run)
    elif outer == "grad":
        run, dense = jax.grad(run), jax.grad(dense)
    with _policy(LoraWeight):
        got = run(X)
    assert_close(got, dense(X), rtol=1e-5, atol=1e-5)
    # the LoRA product, not the merged weight: no [4, 5] sum in the program
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(X)
    assert not any(
        e.primitive.name == "add" and e.outvars[0].aval.shape == (4, 5)
        for e in jaxpr.jaxpr.eqns
    )


@pytest.mark.parametrize(
    "fn",
    [jnp.sum, jax.nn.relu, jnp.tanh, lambda w: jnp.max(w, axis=0)],
    ids=["sum", "relu", "tanh", "max"],
)
def test_jax_functions_without_a_handler_materialize_a_value_built_inside(fn):
    # As for an implicit argument: materialized with the usual warning, not refused.
    def f():
        return fn(_lora())

    with materializations() as seen:
        got = qax.use_implicit_args(f)()
    assert seen and "outside" not in " ".join(seen)
    assert_close(got, fn(DENSE_W))


def test_a_flax_linen_layer_takes_a_kernel_built_inside():
    nn = pytest.importorskip("flax.linen")
    layer = nn.Dense(5)
    bias = jax.random.normal(KEY, (5,))

    def f(x):
        return layer.apply({"params": {"kernel": _lora(), "bias": bias}}, x)

    with _policy(LoraWeight):
        got = jax.jit(qax.use_implicit_args(f))(X)
    assert_close(got, X @ DENSE_W + bias)


def test_an_equinox_layer_takes_a_weight_built_inside():
    eqx = pytest.importorskip("equinox")
    layer = eqx.nn.Linear(4, 5, key=KEY)

    def f(x):
        built = eqx.tree_at(lambda m: m.weight, layer, LoraWeight(W.T, B.T, A.T))
        return jax.vmap(built)(x)

    with _policy(LoraWeight):
        got = qax.use_implicit_args(f)(X)
    assert_close(got, X @ DENSE_W + layer.bias)


def test_fields_of_a_value_built_inside_stay_readable_there():
    def f(x):
        w = _lora()
        return x @ w + jnp.sum(w.a)  # `w.a`: the user built it

    assert_close(qax.use_implicit_args(f)(X), X @ DENSE_W + jnp.sum(A))
    # an argument's fields are not readable inside: the error says where they are
    with pytest.raises(AttributeError, match="cannot be read"):
        qax.use_implicit_args(lambda w: w.a)(_lora())


def test_lax_functions_outside_the_wrapper_name_it():
    with pytest.raises(TypeError) as info:
        lax.dot_general(X, _lora(), (((1,), (0,)), ((), ())))
    assert "qax.use_implicit_args" in str(info.value.__cause__ or info.value)


# ----------------------------------------------------------------------------------------
# QLoRA with `combine` inside the loss function


@pytest.mark.parametrize("fmt", qax.quant.FORMATS)
def test_qlora_step_combining_inside_the_loss_function(fmt):
    k = jax.random.split(KEY, 3)
    params = {
        "l0": {"kernel": 0.1 * jax.random.normal(k[0], (64, 64))},
        "l1": {"kernel": 0.1 * jax.random.normal(k[1], (64, 64))},
    }

    def model(p, x):
        return jax.nn.relu(x @ p["l0"]["kernel"]) @ p["l1"]["kernel"]

    quantized = qax.quant.quantize(params, fmt)
    adapters, base = qax.lora.split(qax.lora.loraify(quantized, 4, key=k[2]))
    adapters = jax.tree.map(lambda a: a + 0.01, adapters)  # b starts at zero
    x = jax.random.normal(k[0], (8, 64))
    y = jnp.ones((8, 64))

    def loss_inside(adapters, base, x, y):  # the model's own loss combines
        return jnp.mean((model(qax.lora.combine(adapters, base), x) - y) ** 2)

    def loss_outside(adapters):  # the documented recipe: combine outside
        params = qax.lora.combine(adapters, base)
        return qax.use_implicit_args(lambda p: jnp.mean((model(p, x) - y) ** 2))(params)

    inside = qax.use_implicit_args(loss_inside)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(adapters, opt_state, base):
        value, grads = jax.value_and_grad(inside)(adapters, base, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value

    with _policy(LoraWeight, qax.quant.QuantizedWeight):
        want_value, want_grads = jax.value_and_grad(loss_outside)(adapters)
        assert_close(inside(adapters, base, x, y), want_value)
        assert_close(jax.jit(inside)(adapters, base, x, y), want_value)
        for grad in (jax.grad(inside), jax.jit(jax.grad(inside))):
            assert_close(grad(adapters, base, x, y), want_grads, rtol=1e-4, atol=1e-6)
        state = optimizer.init(adapters)
        trained, state, first = step(adapters, state, base)
        for _ in range(3):
            trained, state, value = step(trained, state, base)
    assert float(value) < float(first)


def test_split_puts_none_at_a_quantized_weight_without_an_adapter():
    # (It put a copy of the quantized type with None fields there, which `combine`
    # inside the wrapped function then took for an adapter.)
    q = qax.quant.quantize({"a": W, "b": W}, "int8")
    params = {"a": LoraWeight(q["a"], A, B), "b": q["b"]}
    adapters, base = qax.lora.split(params)
    assert adapters["b"] is None and base["b"] is q["b"]

    def f(adapters, base, x):
        params = qax.lora.combine(adapters, base)
        return x @ params["a"] + x @ params["b"]

    with _policy(LoraWeight):
        got = qax.use_implicit_args(f)(adapters, base, X)
    assert_close(got, qax.use_implicit_args(f)(adapters, base, X))
    want = X @ (qax.materialize_nested(q["a"], full=True) + A @ B)
    assert_close(got, want + X @ qax.materialize_nested(q["b"], full=True), rtol=1e-4)


def test_an_nnx_module_that_assembles_its_weights_in_call():
    nnx = pytest.importorskip("flax.nnx")

    class LoraLinear(nnx.Module):
        def __init__(self, d_in, d_out, rngs):
            self.w = nnx.Param(0.1 * jax.random.normal(rngs.params(), (d_in, d_out)))
            self.a = nnx.Param(0.1 * jax.random.normal(rngs.params(), (d_in, 2)))
            self.b = nnx.Param(0.1 * jax.random.normal(rngs.params(), (2, d_out)))

        def __call__(self, x, implicit=True):
            if implicit:  # built at each call, inside the wrapper
                return x @ LoraWeight(
                    self.w[...], self.a[...], self.b[...], freeze_w=False
                )
            return x @ (self.w[...] + self.a[...] @ self.b[...])

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = LoraLinear(4, 8, rngs), LoraLinear(8, 3, rngs)

        def __call__(self, x, implicit=True):
            return self.l2(jax.nn.relu(self.l1(x, implicit)), implicit)

    model = Model(nnx.Rngs(0))

    def loss(model, x, implicit=True):
        return jnp.sum(jnp.sin(model(x, implicit)))

    with _policy(LoraWeight):
        got = nnx.jit(qax.use_implicit_args(loss))(model, X)
        grads = nnx.grad(qax.use_implicit_args(loss))(model, X)
    assert_close(got, loss(model, X, implicit=False))
    want = nnx.grad(lambda m, x: loss(m, x, implicit=False))(model, X)
    assert_close(nnx.state(grads), nnx.state(want), rtol=1e-5, atol=1e-6)


def test_a_carry_built_outside_and_closed_over_gets_the_cause_and_the_fix():
    # Built outside the wrapper, the value is a plain pytree to JAX's loops, which
    # refuse a structure change before qax sees the loop: the error says so.
    init = qax.symbols.SymbolicConstant(0.0, shape=(3,), dtype=jnp.float32)

    def f(x):
        return lax.fori_loop(0, 2, lambda i, c: c + x, init)

    with pytest.raises(TypeError, match="pytree structure") as info:
        with materializations():
            qax.use_implicit_args(f)(jnp.arange(3.0))
    assert any("Build it inside" in note for note in info.value.__notes__)
