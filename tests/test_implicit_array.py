"""ImplicitArray: dataclass machinery, pytree registration, shape/dtype resolution."""

import dataclasses
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

import qax
from tests.helpers import LoraMatrix, NeverMaterialize, Zeros, assert_close, make_lora


def test_fields_are_children_with_keys_and_aux_fields_are_static():
    @dataclass
    class Tagged(qax.ImplicitArray):
        x: qax.ArrayValue
        tag: str = qax.aux_field(default="hello")

        def materialize(self):
            return self.x

    t = Tagged(jnp.arange(3.0))
    paths = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(t)[0]
    ]
    assert paths[0] == ".x"
    treedef = jax.tree_util.tree_structure(t)
    other = Tagged(jnp.ones(3), tag="bye")
    assert treedef != jax.tree_util.tree_structure(other)
    rebuilt = jax.tree_util.tree_unflatten(treedef, jax.tree_util.tree_leaves(t))
    assert rebuilt.tag == "hello" and rebuilt.shape == (3,)
    # aux data is static under jit: the function sees the Python string
    seen = []

    @jax.jit
    def f(t):
        seen.append(t.tag)
        return t.x * 2

    assert_close(f(other), 2 * jnp.ones(3))
    assert seen == ["bye"]


def test_subclass_without_explicit_dataclass_gets_fields():
    class Scaled(qax.ImplicitArray):
        x: qax.ArrayValue
        scale: float = qax.aux_field(default=2.0)

        def materialize(self):
            return self.x * self.scale

    s = Scaled(jnp.ones(4), scale=3.0)
    assert dataclasses.is_dataclass(s)
    assert s.shape == (4,) and s.dtype == jnp.float32
    assert [f.name for f in dataclasses.fields(s)] == ["shape", "dtype", "x", "scale"]
    assert jax.tree_util.tree_structure(s).num_leaves == 1  # x: no hidden leaves
    with pytest.warns(
        qax.MaterializationWarning, match="add was not handled by class Scaled"
    ):
        assert_close(qax.use_implicit_args(lambda v: v + 0)(s), 3 * jnp.ones(4))


def test_aux_field_survives_an_explicit_dataclass_decorator():
    @dataclass
    class Twice(qax.ImplicitArray):
        x: qax.ArrayValue
        label: str = qax.aux_field(default="a")

        def materialize(self):
            return self.x

    t = Twice(jnp.ones(2))
    leaves = jax.tree_util.tree_leaves(t)
    assert all(hasattr(leaf, "shape") for leaf in leaves)
    assert not any(isinstance(leaf, str) for leaf in leaves)


def test_shape_and_dtype_are_keyword_only():
    with pytest.raises(TypeError):
        Zeros((2, 3))  # positional shape is not allowed
    z = Zeros(shape=(2, 3), dtype=jnp.int32)
    assert z.shape == (2, 3) and z.dtype == jnp.int32


def test_resolution_order_kwargs_then_compute_then_default_then_materialize():
    class WithAll(qax.ImplicitArray):
        default_shape = (1,)
        default_dtype = jnp.int32

        def compute_shape(self):
            return (2,)

        def materialize(self):
            return jnp.zeros(self.shape, self.dtype)

    assert WithAll(shape=(5,)).shape == (5,)  # keyword wins
    assert WithAll().shape == (2,)  # compute_shape next
    assert WithAll().dtype == jnp.int32  # then default_dtype

    class FromMaterialize(qax.ImplicitArray):
        x: qax.ArrayValue

        def materialize(self):
            return jnp.outer(self.x, self.x).astype(jnp.float16)

    m = FromMaterialize(jnp.ones(3))
    assert m.shape == (3, 3) and m.dtype == jnp.float16


def test_declared_value_disagreeing_with_materialize_warns():
    class Liar(qax.ImplicitArray):
        def materialize(self):
            return jnp.zeros((2, 2), jnp.float32)

    with pytest.warns(
        UserWarning, match=r"declares shape \(3, 3\).*produces shape \(2, 2\)"
    ):
        Liar(shape=(3, 3), dtype=jnp.float32)


def test_uninitialized_aval_lists_the_ways_to_fix_it():
    class NoShape(qax.ImplicitArray):
        def materialize(self):
            return jnp.zeros(self.shape)

    with pytest.raises(qax.UninitializedAval) as info:
        NoShape()
    message = str(info.value)
    assert "shape of this NoShape" in message
    for hint in (
        "NoShape(..., shape=...)",
        "compute_shape",
        "default_shape",
        "eval_shape",
    ):
        assert hint in message


def test_post_init_validation():
    @dataclass
    class Checked(qax.ImplicitArray):
        x: qax.ArrayValue

        def __post_init__(self):
            if jnp.ndim(self.x) != 1:
                raise ValueError("x must be a vector")
            super().__post_init__()

        def materialize(self):
            return self.x

    Checked(jnp.ones(3))
    with pytest.raises(ValueError, match="vector"):
        Checked(jnp.ones((3, 3)))


def test_class_keywords_and_inheritance():
    class Quiet(qax.ImplicitArray, commute_ops=False, warn_on_materialize=False):
        default_dtype = jnp.float32

        def materialize(self):
            return jnp.ones(self.shape, self.dtype)

    class Child(Quiet):
        pass

    assert Quiet.commute_ops is False and Quiet.warn_on_materialize is False
    assert Child.commute_ops is False and Child.warn_on_materialize is False
    assert Zeros.commute_ops is True and Zeros.warn_on_materialize is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(
            qax.use_implicit_args(jnp.sin)(Quiet(shape=(2,))), jnp.sin(jnp.ones(2))
        )


def test_aval_ndim_size_transpose_and_repr():
    lora = make_lora(jax.random.PRNGKey(0), rows=6, cols=5)
    assert lora.aval == jax.core.ShapedArray((6, 5), jnp.float32)
    assert lora.ndim == 2 and lora.size == 30 and len(lora) == 6
    with pytest.warns(qax.MaterializationWarning, match="transpose"):
        assert_close(lora.T, lora.materialize().T)
    text = repr(lora)
    assert text.startswith("LoraMatrix(w=float32[6,5], a=float32[6,2], b=float32[5,2]")
    assert "shape=(6, 5)" in text and "dtype=float32" in text
    assert repr(Zeros(shape=(2,))) == "Zeros(shape=(2,), dtype=float32)"


def test_operators_on_implicit_objects_dispatch():
    z = Zeros(shape=(3,))
    x = jnp.arange(3.0)
    out = z * x
    assert isinstance(out, Zeros) and out.shape == (3,)
    assert_close(z + x, x)
    assert_close(x + z, x)
    with pytest.warns(qax.MaterializationWarning):
        assert_close(z - x, -x)


def test_materialize_nested_one_layer_and_full():
    inner = Zeros(shape=(4, 2))
    lora = LoraMatrix(jnp.ones((4, 3)), inner, Zeros(shape=(3, 2)))
    with pytest.warns(qax.MaterializationWarning):
        dense = qax.materialize_nested(lora, full=True)
    assert isinstance(dense, jax.Array)
    assert_close(dense, jnp.ones((4, 3)))

    class Wrap(qax.ImplicitArray):
        z: qax.ArrayValue

        def materialize(self):
            return self.z  # returns another implicit array

    w = Wrap(Zeros(shape=(2,)))
    assert isinstance(qax.materialize_nested(w), Zeros)
    assert_close(qax.materialize_nested(w, full=True), jnp.zeros(2))


def test_tree_map_slicing_tracks_the_shape_of_declared_types():
    stacked = LoraMatrix(jnp.ones((3, 4, 5)), jnp.ones((3, 4, 2)), jnp.ones((3, 5, 2)))
    assert stacked.shape == (3, 4, 5)
    first = jax.tree_util.tree_map(lambda leaf: leaf[0], stacked)
    assert first.shape == (4, 5)
    x = jnp.ones(4)
    out = qax.use_implicit_args(lambda w: x @ w)(first)
    assert_close(out, x @ first.materialize())
    # a shape-only type stores nothing at all
    assert jax.tree_util.tree_leaves(Zeros(shape=(100, 100))) == []


def test_per_type_default_handler():
    x = NeverMaterialize(jnp.arange(4.0))
    out = qax.use_implicit_args(lambda t: jnp.sin(t) * 2 + 1)(x)
    assert isinstance(out, NeverMaterialize)
    assert_close(out.array, jnp.sin(jnp.arange(4.0)) * 2 + 1)


def test_original_tree_flatten_with_keys_and_tree_unflatten():
    lora = make_lora(jax.random.PRNGKey(0), 4, 3)
    children, aux = lora.tree_flatten_with_keys()
    assert [key.name for key, _ in children] == ["w", "a", "b"]
    assert all(isinstance(key, jax.tree_util.GetAttrKey) for key, _ in children)
    rebuilt = LoraMatrix.tree_unflatten(aux, [value for _, value in children])
    assert type(rebuilt) is LoraMatrix
    assert rebuilt.shape == lora.shape and rebuilt.dtype == lora.dtype
    assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(lora)
    for x, y in zip(
        jax.tree_util.tree_leaves(rebuilt), jax.tree_util.tree_leaves(lora)
    ):
        assert x is y


def test_tree_unflatten_merges_new_children():
    # How downstream code splits LoRA trees and merges trained factors back in.
    lora = make_lora(jax.random.PRNGKey(0), 4, 3)
    children, aux = lora.tree_flatten_with_keys()
    new = {"a": lora.a * 2, "b": lora.b}
    merged = type(lora).tree_unflatten(
        aux, [new.get(key.name, value) for key, value in children]
    )
    expected = lora.w + (2 * lora.a) @ lora.b.T
    assert_close(qax.materialize_nested(merged), expected)


def test_tree_methods_keep_aux_fields():
    @dataclass
    class Scaled(qax.ImplicitArray):
        x: qax.ArrayValue
        scale: float = qax.aux_field(default=2.0)

        def materialize(self):
            return self.x * self.scale

    s = Scaled(jnp.ones(3), scale=3.0)
    children, aux = s.tree_flatten_with_keys()
    assert [key.name for key, _ in children] == ["x"]
    back = Scaled.tree_unflatten(aux, [jnp.zeros(3)])
    assert back.scale == 3.0 and back.shape == (3,)


def test_shape_is_inferred_from_shape_dtype_struct_fields():
    sds = jax.ShapeDtypeStruct
    abstract = LoraMatrix(
        sds((4, 3), jnp.float32), sds((4, 2), jnp.float32), sds((3, 2), jnp.float32)
    )
    assert abstract.shape == (4, 3) and abstract.dtype == jnp.float32

    def f(w, x):
        return x @ w

    x = sds((2, 4), jnp.float32)
    out = jax.eval_shape(qax.use_implicit_args(f), abstract, x)
    assert out.shape == (2, 3) and out.dtype == jnp.float32
    # AOT: lower for the abstract value, run on a concrete one.
    compiled = jax.jit(qax.use_implicit_args(f)).lower(abstract, x).compile()
    concrete = make_lora(jax.random.PRNGKey(0), 4, 3)
    ones = jnp.ones((2, 4))
    assert_close(compiled(concrete, ones), ones @ concrete.materialize())


def test_mismatched_lora_factors_lead_with_the_cause():
    with pytest.raises(qax.UninitializedAval) as info:
        LoraMatrix(jnp.ones((4, 3)), jnp.ones((4, 2)), jnp.ones((3, 5)))
    headline, cause = str(info.value).splitlines()[:2]
    assert "materialize()" in headline and "shape=" not in headline
    assert "contracting dimensions" in cause
