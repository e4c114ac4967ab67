"""use_implicit_args: argument handling and composition with JAX transformations."""

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

import qax
from qax._tree_util import implicit_depth
from tests.helpers import LoraMatrix, Zeros, assert_close, make_lora, primitive_names

KEY = jax.random.PRNGKey(0)


def model(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.sum(h @ params["w2"]["inner"])


def make_params(key):
    k1, k2 = jax.random.split(key)
    return {"w1": make_lora(k1, 6, 5), "w2": {"inner": make_lora(k2, 5, 3)}}


def dense(params):
    return jax.tree_util.tree_map(
        lambda p: p.materialize() if isinstance(p, qax.ImplicitArray) else p,
        params,
        is_leaf=lambda p: isinstance(p, qax.ImplicitArray),
    )


def test_pytree_args_and_kwargs_at_any_depth():
    params = make_params(KEY)
    x = jax.random.normal(KEY, (4, 6))
    expected = model(dense(params), x)
    assert_close(qax.use_implicit_args(model)(params, x), expected)
    assert_close(qax.use_implicit_args(model)(params=params, x=x), expected)


def test_zero_implicit_args_behaves_like_f():
    f = qax.use_implicit_args(lambda x, y=2.0: jnp.sin(x) * y)
    assert_close(f(jnp.arange(3.0)), jnp.sin(jnp.arange(3.0)) * 2)
    assert f.__name__ == "<lambda>"


def test_implicit_outputs_and_passthrough():
    z = Zeros(shape=(3,))
    out = qax.use_implicit_args(lambda a, b: (a, a * b, {"b": b}))(z, jnp.ones(3))
    assert isinstance(out[0], Zeros) and isinstance(out[1], Zeros)
    assert_close(out[2]["b"], jnp.ones(3))


@pytest.mark.parametrize(
    "where", ["outside", "inside"], ids=["jit-outside", "jit-inside"]
)
def test_jit(where):
    params = make_params(KEY)
    x = jax.random.normal(KEY, (4, 6))
    expected = model(dense(params), x)
    if where == "outside":
        f = jax.jit(qax.use_implicit_args(model))
    else:
        f = qax.use_implicit_args(jax.jit(model))
    assert_close(f(params, x), expected)


def test_grad_matches_materialized_gradient():
    params = make_params(KEY)
    x = jax.random.normal(KEY, (4, 6))
    grads = jax.grad(qax.use_implicit_args(model))(params, x)
    assert isinstance(grads["w1"], LoraMatrix)

    def through_materialize(p):
        return model(dense(p), x)

    expected = jax.grad(through_materialize)(params)
    for got, want in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(expected)
    ):
        assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_grad_inside_the_wrapped_function():
    lora = make_lora(KEY)
    x = jax.random.normal(KEY, (6,))

    def f(w, x):
        return jax.grad(lambda x: jnp.sum(jnp.sin(x @ w)))(x)

    assert_close(qax.use_implicit_args(f)(lora, x), f(lora.materialize(), x))


def test_vmap_outside_and_inside():
    lora = make_lora(KEY)
    xs = jax.random.normal(KEY, (7, 6))
    f = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    expected = jax.vmap(f, in_axes=(None, 0))(lora.materialize(), xs)
    assert_close(
        jax.vmap(qax.use_implicit_args(f), in_axes=(None, 0))(lora, xs), expected
    )
    inside = qax.use_implicit_args(lambda w, xs: jax.vmap(lambda x: f(w, x))(xs))
    assert_close(inside(lora, xs), expected)


def test_vmap_over_batched_implicit_array():
    stacked = jax.vmap(lambda k: make_lora(k))(jax.random.split(KEY, 3))
    assert stacked.shape == (3, 6, 5)
    x = jax.random.normal(KEY, (6,))
    out = jax.vmap(qax.use_implicit_args(lambda w: x @ w))(stacked)
    for i in range(3):
        one = jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], stacked)
        assert_close(out[i], x @ one.materialize())


def test_vmap_over_shape_only_implicit_array_regression():
    # Qax and Quax give [12, 12, 12] here: the shape lives only in metadata, so vmap
    # cannot slice it unless it travels as a leaf.
    z = Zeros(shape=(3, 4))
    a = jnp.ones((3, 4))
    f = lambda z, a: jnp.sum(z + a)  # noqa: E731
    out = jax.vmap(qax.use_implicit_args(f))(z, a)
    assert_close(out, jnp.array([4.0, 4.0, 4.0]))
    assert_close(out, jax.vmap(f)(z.materialize(), a))
    # the body really saw a (4,) symbolic zero and kept it symbolic
    seen = []
    jax.vmap(
        qax.use_implicit_args(lambda z, a: seen.append(z.shape) or jnp.sum(z + a))
    )(z, a)
    assert seen == [(4,)]


def test_implicit_arrays_nested_in_each_other():
    nested = LoraMatrix(jnp.ones((3, 5)), Zeros(shape=(3, 6)), Zeros(shape=(5, 6)))
    assert implicit_depth(nested) == 2
    x = jnp.arange(3.0)
    f = lambda w, x: jnp.sum(x @ w)  # noqa: E731
    with pytest.warns(qax.MaterializationWarning, match="class Zeros"):
        out = qax.use_implicit_args(f)(nested, x)
    assert_close(out, f(jnp.ones((3, 5)), x))


def test_implicit_arrays_created_inside_the_wrapped_function():
    def f(x):
        z = Zeros(shape=x.shape)
        return jnp.sum(z * x + x)

    assert_close(qax.use_implicit_args(f)(jnp.arange(4.0)), 6.0)
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(jnp.arange(4.0))
    assert "mul" not in primitive_names(
        jaxpr
    )  # the product with zeros was never formed


def test_jaxpr_never_forms_w_plus_ab():
    lora = make_lora(KEY, 8, 8, 2)
    x = jax.random.normal(KEY, (3, 8))
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda w, x: x @ w))(lora, x)
    shapes = [tuple(v.aval.shape) for e in jaxpr.jaxpr.eqns for v in e.outvars]
    assert (8, 8) not in shapes  # no dense (8, 8) weight was built
    assert primitive_names(jaxpr).count("dot_general") == 3


def test_tracer_of_another_trace_in_a_handler():
    # grad over an implicit argument: handler operands are JVP tracers
    lora = make_lora(KEY)
    x = jnp.ones((2, 6))
    g = jax.grad(qax.use_implicit_args(lambda x, w: jnp.sum(x @ w)))(x, lora)
    assert_close(g, jax.grad(lambda x: jnp.sum(x @ lora.materialize()))(x))


def test_output_of_one_call_feeds_another():
    z = Zeros(shape=(2, 2))
    double = qax.use_implicit_args(lambda a: a * 2.0)
    out = double(double(z))
    assert isinstance(out, Zeros)
    assert_close(
        qax.use_implicit_args(lambda a, b: a + b)(out, jnp.ones((2, 2))),
        jnp.ones((2, 2)),
    )


@dataclass
class _Pair(qax.ImplicitArray):
    left: qax.ArrayValue
    right: qax.ArrayValue

    def materialize(self):
        return jnp.concatenate([self.left, self.right])


def test_implicit_array_with_no_handlers_materializes_with_warning():
    pair = _Pair(jnp.ones(2), jnp.zeros(3))
    with pytest.warns(
        qax.MaterializationWarning, match="Primitive sin was not handled by class _Pair"
    ):
        out = qax.use_implicit_args(jnp.sin)(pair)
    assert_close(out, jnp.sin(pair.materialize()))


def test_eager_jnp_calls_bake_python_scalars_like_a_traced_program():
    # Eagerly, `z * 2.0` reaches qax as a compiled jnp function with the scalar as an
    # operand; it must see the literal as a traced program does (so the handler's
    # result is the same implicit type, not a dense array).
    z = Zeros(shape=(2, 3))
    eager = qax.use_implicit_args(lambda a: a * 2.0)(z)
    traced = jax.jit(qax.use_implicit_args(lambda a: a * 2.0))(z)
    assert type(eager) is type(traced) is Zeros
    # repeated eager calls reuse the compiled body (a different scalar is a new entry)
    for scale in (2.0, 2.0, 3.0):
        assert isinstance(qax.use_implicit_args(lambda a, s=scale: a * s)(z), Zeros)


@pytest.fixture
def without_leak_checks():
    previous = jax.config.jax_check_tracer_leaks
    jax.config.update("jax_check_tracer_leaks", False)
    try:
        yield
    finally:
        jax.config.update("jax_check_tracer_leaks", previous)


def test_eager_calls_reuse_jax_trace_caches(without_leak_checks):
    # `jnp` functions are jits whose cache is keyed on the current trace: a fresh trace
    # per eager call would add one entry per call (and slow every later call).
    x = jnp.ones((4, 3))
    lora = make_lora(KEY, 3, 5)
    f = qax.use_implicit_args(lambda x, w: jnp.exp(x @ w))
    for _ in range(3):
        f(x, lora)
    before = jnp.exp._cache_size()
    for _ in range(20):
        out = f(x, lora)
    assert jnp.exp._cache_size() - before < 3
    assert_close(out, jnp.exp(x @ lora.materialize()))


def test_eager_calls_nested_in_handlers_get_their_own_trace(without_leak_checks):
    # the outer call holds the shared eager trace; a handler running eagerly calls
    # use_implicit_args again (on the parent trace), which must not share it.
    nested = LoraMatrix(jnp.ones((3, 5)), Zeros(shape=(3, 2)), Zeros(shape=(5, 2)))
    inner = qax.use_implicit_args(lambda a, b: a + b)
    with pytest.warns(qax.MaterializationWarning):
        out = qax.use_implicit_args(
            lambda w, x: x @ w + inner(Zeros(shape=(5,)), x @ w)
        )(nested, jnp.arange(3.0))
    assert_close(out, 2 * (jnp.arange(3.0) @ jnp.ones((3, 5))))


def test_half_built_value_names_its_none_fields():
    # What `eqx.partition(params, eqx.is_array)` leaves in the static half.
    lora = make_lora(KEY, 6, 5)
    half = jax.tree_util.tree_map(lambda _: None, lora)
    assert half.w is None and half.shape == (6, 5)

    def f(p, x):
        return x @ p["w"]

    with pytest.raises(TypeError, match=r"`LoraMatrix\.w`, `LoraMatrix\.a`.* None"):
        qax.use_implicit_args(f)({"w": half}, jnp.ones((2, 6)))
    with pytest.raises(TypeError, match="eqx.combine"):
        jax.jit(qax.use_implicit_args(f))({"w": half}, jnp.ones((2, 6)))


def test_types_with_optional_none_fields_still_work():
    @dataclass
    class MaybeBias(qax.ImplicitArray):
        x: qax.ArrayValue
        bias: qax.ArrayValue | None = None

        def materialize(self):
            return self.x if self.bias is None else self.x + self.bias

    value = MaybeBias(jnp.ones(3))
    with pytest.warns(qax.MaterializationWarning):
        out = qax.use_implicit_args(lambda v: v * 2)(value)
    assert_close(out, 2 * jnp.ones(3))


@dataclass
class WrongShape(qax.ImplicitArray):
    x: qax.ArrayValue

    def materialize(self):
        return self.x


@qax.primitive_handler("sin")
def _wrong_shape_sin(primitive, x: WrongShape):
    return jnp.ones(7)


@pytest.mark.parametrize("outer", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_qax_errors_are_shown_once_without_qax_frames(outer):
    import traceback

    def user_function(x):
        return jnp.sin(x)  # the user's line

    with pytest.raises(qax.HandlerError) as info:
        outer(qax.use_implicit_args(user_function))(WrongShape(jnp.ones(3)))
    text = "".join(traceback.format_exception(info.value))
    assert text.count("returned float32[7]") == 1, text
    # (The package's own folder: a clone may itself sit in a folder named `qax`.)
    package = os.path.dirname(os.path.abspath(qax.__file__)) + os.sep
    assert package not in text, text
    assert "the user's line" in text
    assert "qax.HandlerError" in text


def test_reading_a_field_inside_the_wrapped_function_explains_where_it_can_be_read():
    lora = make_lora(KEY, 6, 5)
    with pytest.raises(AttributeError, match=r"field `a`.*handlers.*before the call"):
        qax.use_implicit_args(lambda w: w.a)(lora)
    with pytest.raises(AttributeError, match="no attribute"):
        qax.use_implicit_args(lambda w: w.not_a_field)(lora)
    assert qax.use_implicit_args(lambda w: w.shape)(lora) == (6, 5)


def test_use_implicit_args_docstring_names_no_private_function():
    doc = qax.use_implicit_args.__doc__
    assert "apply_primitive" not in doc and "`_" not in doc
    assert "handler" in doc
