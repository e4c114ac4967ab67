"""Leaves are exactly the declared fields; batch axes are declared, never guessed.

Regression tests for issue 9: scan/map/vmap over implicit arrays give the dense array's
numbers, stay implicit where the type declares its batch axes, and real training code
(donation, orbax, optax.masked) works on trees of implicit arrays.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax
from qax.symbols import SymbolicConstant
from tests.helpers import LoraMatrix, UndeclaredLora, Zeros, assert_close, make_lora

KEY = jax.random.PRNGKey(0)


@dataclass
class Diagonal(qax.ImplicitArray):
    """A diagonal matrix stored as its diagonal: a field of rank 1, an array of rank 2."""

    d: qax.ArrayValue = qax.array_field(ndim=1)

    def compute_shape(self):
        return (*self.d.shape, self.d.shape[-1])

    def compute_dtype(self):
        return self.d.dtype

    def materialize(self):
        return jnp.diag(self.d)


@dataclass
class PlainDiagonal(qax.ImplicitArray):
    d: qax.ArrayValue

    def materialize(self):
        return jnp.diag(self.d)


def lora(cls, key, m=6, n=6, r=2, stack=()):
    return make_lora(key, m, n, r, cls=cls, lead=stack)


def dense(x):
    return (
        qax.materialize_nested(x, full=True) if isinstance(x, qax.ImplicitArray) else x
    )


def quietly(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", qax.MaterializationWarning)
        return fn(*args)


# ----------------------------------------------------------------------------------------
# Leaves are the declared fields


def test_leaves_are_exactly_the_declared_fields():
    w = lora(LoraMatrix, KEY)
    assert [x is y for x, y in zip(jax.tree_util.tree_leaves(w), (w.w, w.a, w.b))] == [
        True
    ] * 3
    assert jax.tree_util.tree_leaves(Zeros(shape=(3, 4))) == []
    assert jax.tree_util.tree_leaves(SymbolicConstant(1.0, shape=(3,))) == []
    keys = [k for k, _ in jax.tree_util.tree_flatten_with_path(w)[0]]
    assert [jax.tree_util.keystr(k) for k in keys] == [".w", ".a", ".b"]


def test_declared_fields_must_agree_on_batch_dims():
    with pytest.raises(ValueError, match="disagree on their batch dimensions"):
        LoraMatrix(jnp.ones((3, 6, 5)), jnp.ones((6, 2)), jnp.ones((5, 2)))
    with pytest.raises(ValueError, match="integer >= 0"):
        qax.array_field(ndim=-1)


def test_stacked_value_shape_and_materialize_per_element():
    stacked = lora(LoraMatrix, KEY, 6, 5, stack=(4,))
    assert stacked.shape == (4, 6, 5)
    want = jnp.stack([lora_row(stacked, i).materialize() for i in range(4)])
    assert_close(stacked.materialize(), want)
    nested = lora(LoraMatrix, KEY, 6, 5, stack=(2, 3))
    assert nested.shape == (2, 3, 6, 5)
    assert nested.materialize().shape == (2, 3, 6, 5)


def lora_row(x, i):
    return jax.tree_util.tree_map(lambda leaf: leaf[i], x)


def test_tree_map_slicing_updates_the_shape_of_declared_types():
    stacked = lora(LoraMatrix, KEY, 6, 5, stack=(4,))
    row = lora_row(stacked, 1)
    assert row.shape == (6, 5)
    assert_close(row.materialize(), stacked.materialize()[1])


# ----------------------------------------------------------------------------------------
# scan / map over implicit xs


def scan_rows(w):
    def body(c, row):
        return c + row.sum(), row * 2.0

    return lax.scan(body, 0.0, w)


@pytest.mark.parametrize(
    "cls", [UndeclaredLora, LoraMatrix], ids=["undeclared", "declared"]
)
def test_scan_over_an_unbatched_square_lora_gives_its_rows(cls):
    # w, a and b all have leading dimension 6 = the scan length: slicing leaves would
    # give w[i] + a[i] @ b[i].T instead of row i.
    w = lora(cls, KEY)
    advice = "array_field" if cls is UndeclaredLora else "stack fields of the declared"
    with pytest.warns(qax.MaterializationWarning, match=advice):
        c, ys = qax.use_implicit_args(scan_rows)(w)
    c_want, ys_want = scan_rows(w.materialize())
    assert_close(c, c_want, rtol=1e-4)
    assert_close(ys, ys_want)


@pytest.mark.parametrize(
    "cls", [PlainDiagonal, Diagonal], ids=["undeclared", "declared"]
)
def test_scan_over_a_diagonal_type(cls):
    d = cls(jnp.arange(1.0, 5.0))
    with pytest.warns(qax.MaterializationWarning, match="lax.scan"):
        out = qax.use_implicit_args(lambda d: lax.map(lambda row: row * 3.0, d))(d)
    assert_close(out, jnp.diag(jnp.arange(1.0, 5.0)) * 3.0)


class AdvisedDiagonal(Diagonal):
    batch_axes_advice = "build stacks with `make_diagonals(..., layers=n)`."


class AdvisedPlainDiagonal(PlainDiagonal):
    batch_axes_advice = "build stacks with `make_diagonals(..., layers=n)`."


@pytest.mark.parametrize(
    "cls",
    [AdvisedPlainDiagonal, AdvisedDiagonal, Diagonal],
    ids=["undeclared", "declared", "no advice"],
)
def test_warnings_about_batch_axes_give_the_types_own_advice(cls):
    d = cls(jnp.arange(1.0, 5.0))
    f = qax.use_implicit_args(lambda d: lax.map(lambda row: row * 3.0, d))
    declared = cls is not AdvisedPlainDiagonal
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", qax.MaterializationWarning)
        out = f(d)
        if declared:  # (`vmap` outside maps an undeclared type's leaves)
            summed = jax.vmap(qax.use_implicit_args(jnp.sum), in_axes=1)(d)
            assert_close(summed, jnp.diag(jnp.arange(1.0, 5.0)).sum(0))
    assert_close(out, jnp.diag(jnp.arange(1.0, 5.0)) * 3.0)
    messages = [str(w.message) for w in seen]
    assert len(messages) == (2 if declared else 1), messages
    for text in messages:
        assert f"{cls.__name__} along axis" in text, text
        if cls is Diagonal:
            assert "make_diagonals" not in text and "declared ranks" in text, text
        else:
            # The advice ends the reason (then which argument it was, issue 36, 1).
            advice = "To keep it implicit: build stacks with `make_diagonals(...)`."
            advice = advice.replace("...", "..., layers=n")
            assert advice + " The" in text or text.endswith(advice), text
            assert "array_field" not in text, text
    if cls is AdvisedDiagonal:
        assert "axis 0 is not one of them" in messages[0]


def test_scan_over_stacked_declared_layers_stays_implicit():
    stacked = lora(LoraMatrix, KEY, 6, 6, stack=(3,))
    x = jax.random.normal(KEY, (2, 6))

    def layers(ws, x):
        def body(h, w):
            return jnp.tanh(h @ w), w

        return lax.scan(body, x, ws)

    with qax.materialization_policy(LoraMatrix, "error"):
        h, ws = jax.jit(qax.use_implicit_args(layers))(stacked, x)
        jaxpr = jax.make_jaxpr(qax.use_implicit_args(layers))(stacked, x)
    h_want, _ = layers(stacked.materialize(), x)
    assert_close(h, h_want, rtol=1e-4, atol=1e-5)
    assert isinstance(ws, LoraMatrix) and ws.shape == (3, 6, 6)
    assert_close(ws.materialize(), stacked.materialize())
    # nothing of the weight's (6, 6) shape is ever formed by an add
    assert "f32[6,6] = add" not in str(jaxpr)


def test_scan_slices_and_stacks_nested_declared_values():
    stacked = LoraMatrix(
        jax.random.normal(KEY, (3, 6, 5)),
        Zeros(shape=(3, 6, 2)),
        Zeros(shape=(3, 5, 2)),
    )
    seen = []

    def f(ws):
        def body(c, w):
            seen.append(w.shape)
            return c, w

        return lax.scan(body, 0.0, ws)

    with qax.materialization_policy(LoraMatrix, "error"):
        _, ys = qax.use_implicit_args(f)(stacked)
    assert seen == [(6, 5)]
    assert isinstance(ys, LoraMatrix) and ys.shape == (3, 6, 5)
    assert isinstance(ys.a, Zeros) and ys.a.shape == (3, 6, 2)
    assert_close(quietly(ys.materialize), stacked.w)


def test_scan_stacks_declared_outputs_and_materializes_undeclared_ones():
    declared, plain = lora(LoraMatrix, KEY, 6, 5), lora(UndeclaredLora, KEY, 6, 5)

    def f(declared, plain, xs):
        return lax.scan(lambda c, x: (c, (declared, plain)), 0.0, xs)

    with pytest.warns(qax.MaterializationWarning, match="UndeclaredLora"):
        _, (ys_declared, ys_plain) = qax.use_implicit_args(f)(
            declared, plain, jnp.ones(3)
        )
    assert isinstance(ys_declared, LoraMatrix) and ys_declared.shape == (3, 6, 5)
    assert_close(ys_declared.materialize(), jnp.stack([declared.materialize()] * 3))
    assert not isinstance(ys_plain, qax.ImplicitArray)
    assert_close(ys_plain, jnp.stack([plain.materialize()] * 3))


def test_scan_outside_the_wrapper_through_unbatched_dims_is_refused():
    w = lora(LoraMatrix, KEY)
    f = qax.use_implicit_args(lambda row: row.sum())
    with pytest.raises(ValueError, match="sliced through an unbatched dimension"):
        lax.map(f, w)


def test_scan_outside_the_wrapper_over_stacked_layers():
    stacked = lora(LoraMatrix, KEY, 6, 5, stack=(3,))
    x = jnp.ones(6)
    out = lax.map(qax.use_implicit_args(lambda w: x @ w), stacked)
    assert_close(out, jnp.einsum("i,lij->lj", x, stacked.materialize()), rtol=1e-4)


# ----------------------------------------------------------------------------------------
# vmap


def test_vmap_inside_over_a_stacked_value_materializes_per_element():
    stacked = lora(LoraMatrix, KEY, 6, 5, stack=(3,))
    x = jax.random.normal(KEY, (6,))

    def f(ws):
        return jax.vmap(lambda w: jnp.sin(w).sum(0) + x @ w)(ws)

    out = quietly(qax.use_implicit_args(f), stacked)
    assert_close(out, f(stacked.materialize()), rtol=1e-4, atol=1e-5)


def test_vmap_outside_keeps_declared_types_implicit():
    stacked = lora(LoraMatrix, KEY, 6, 5, stack=(3,))
    x = jax.random.normal(KEY, (6,))
    seen = []

    def f(w):
        seen.append(w.shape)
        return x @ w

    with qax.materialization_policy(LoraMatrix, "error"):
        out = jax.vmap(qax.use_implicit_args(f))(stacked)
    assert seen == [(6, 5)]
    assert_close(out, jnp.einsum("i,lij->lj", x, stacked.materialize()), rtol=1e-4)


def test_vmap_over_a_core_axis_materializes_with_the_dense_numbers():
    w = lora(LoraMatrix, KEY, 6, 5)
    f = qax.use_implicit_args(lambda w: w.sum())
    with pytest.warns(qax.MaterializationWarning, match="axis 1 is not one of them"):
        out = jax.vmap(f, in_axes=1)(w)
    assert_close(out, w.materialize().sum(0), rtol=1e-4)


def test_vmap_outputs_stack_declared_and_undeclared_types():
    keys = jax.random.split(KEY, 3)
    stacked = jax.vmap(lambda k: lora(LoraMatrix, k, 6, 5))(keys)
    assert isinstance(stacked, LoraMatrix) and stacked.shape == (3, 6, 5)
    assert stacked.w.shape == (3, 6, 5)
    for i in range(3):
        assert_close(
            stacked.materialize()[i], lora(LoraMatrix, keys[i], 6, 5).materialize()
        )
    plain = jax.vmap(lambda k: lora(UndeclaredLora, k, 6, 5))(
        keys
    )  # a stack of examples
    assert isinstance(plain, UndeclaredLora) and plain.shape == (3, 6, 5)
    assert_close(plain.materialize(), stacked.materialize(), rtol=1e-5)
    moved = jax.vmap(lambda k: lora(LoraMatrix, k, 6, 5), out_axes=None)
    with pytest.raises(ValueError):
        moved(keys)


def test_vmap_shape_only_types_along_any_axis():
    z = Zeros(shape=(3, 4))
    out = jax.vmap(qax.use_implicit_args(lambda z: z * 2.0), in_axes=1, out_axes=1)(z)
    assert isinstance(out, Zeros) and out.shape == (3, 4)
    c = SymbolicConstant(2.0, shape=(5, 3))
    got = jax.vmap(qax.use_implicit_args(lambda c: c * 2.0))(c)
    assert isinstance(got, SymbolicConstant) and got.shape == (5, 3)


# ----------------------------------------------------------------------------------------
# Real training code: donation, optax.masked, orbax


def _params(n=12):
    keys = jax.random.split(KEY, n)
    return {f"layer{i}": lora(LoraMatrix, k, 8, 8) for i, k in enumerate(keys)}


def _loss(params, x):
    h = x
    for i in range(len(params)):
        h = jnp.tanh(h @ params[f"layer{i}"])
    return jnp.sum(h**2)


def test_donated_train_step_over_twelve_same_shaped_implicit_arrays():
    params = _params()
    opt = qax.freeze_keys(optax.adam(1e-2), LoraMatrix, ["w"])
    state = opt.init(params)
    x = jnp.ones((2, 8))

    def train_step(params, state):
        grads = jax.grad(qax.use_implicit_args(_loss))(params, x)
        updates, state = opt.update(grads, state, params)
        return qax.utils.apply_updates(params, updates), state

    step = jax.jit(train_step, donate_argnums=(0, 1))
    want_params, _ = jax.jit(train_step)(params, state)
    w0 = np.array(params["layer0"].w, copy=True)
    new_params, new_state = step(params, state)
    assert params["layer0"].w.is_deleted()  # the buffers really were donated
    for name, got in new_params.items():
        assert_close(got.a, want_params[name].a)
    np.testing.assert_array_equal(np.asarray(new_params["layer0"].w), w0)
    new_params, new_state = step(new_params, new_state)  # and again, on donated outputs


def test_optax_masked_with_a_mask_built_from_the_type():
    params = {"w": lora(LoraMatrix, KEY, 6, 5), "bias": jnp.ones(5)}
    mask = {
        "w": LoraMatrix(False, True, True, shape=(6, 5), dtype=jnp.float32),
        "bias": False,
    }
    opt = optax.masked(optax.sgd(1.0), mask)
    state = opt.init(params)
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = opt.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    # optax.masked passes masked-out updates through untouched; masked-in ones get sgd
    assert_close(new["w"].w, params["w"].w + 1.0)
    assert_close(new["bias"], params["bias"] + 1.0)
    assert_close(new["w"].a, params["w"].a - 1.0)
    assert_close(new["w"].b, params["w"].b - 1.0)


def test_orbax_round_trip_of_implicit_params(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {
        "w": lora(LoraMatrix, KEY, 6, 5),
        "stacked": lora(LoraMatrix, KEY, 4, 4, stack=(3,)),
        "zero": SymbolicConstant(0.0, shape=(5,), dtype=jnp.float32),
        "bias": jnp.arange(5.0),
    }
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "params", params)
    ckpt.wait_until_finished()
    template = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )
    restored = ckpt.restore(tmp_path / "params", template)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(
        params
    )
    assert isinstance(restored["stacked"], LoraMatrix)
    assert restored["stacked"].shape == (3, 4, 4)
    assert isinstance(restored["zero"], SymbolicConstant)
    for got, want in zip(
        jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(params)
    ):
        np.testing.assert_array_equal(got, want)


@dataclass
class Kernel(qax.ImplicitArray):
    """A scaled weight of any rank: the rank is per instance, held by an aux field."""

    x: qax.ArrayValue = qax.array_field(ndim="x_ndim")
    s: qax.ArrayValue = qax.array_field(ndim=0)
    x_ndim: int | None = qax.aux_field(default=None)

    def materialize(self):
        return self.x * self.s


def test_ranks_held_by_an_aux_field():
    conv = Kernel(jnp.ones((3, 3, 2, 4)), jnp.asarray(2.0))
    assert conv.x_ndim == 4 and conv.shape == (3, 3, 2, 4)
    matrix = Kernel(jnp.ones((2, 4)), jnp.asarray(2.0))
    assert matrix.x_ndim == 2
    stacked = jax.vmap(lambda s: Kernel(jnp.ones((2, 4)) * s, s))(jnp.arange(3.0))
    assert isinstance(stacked, Kernel) and stacked.shape == (3, 2, 4)
    assert stacked.x_ndim == 2 and stacked.s.shape == (3,)
    scales = jnp.arange(3.0)
    built = Kernel(jnp.ones((3, 2, 4)) * scales[:, None, None], scales, x_ndim=2)
    assert built.shape == (3, 2, 4)
    assert_close(built.materialize(), stacked.materialize())
    with qax.materialization_policy(Kernel, "error"):
        rows = qax.use_implicit_args(lambda k: lax.map(lambda r: r.shape[0] * 1.0, k))
        rows(stacked)
    with pytest.raises(TypeError, match="no aux_field named"):

        @dataclass
        class Broken(qax.ImplicitArray):
            x: qax.ArrayValue = qax.array_field(ndim="missing")

            def materialize(self):
                return self.x


# ----------------------------------------------------------------------------------------
# Nested batch declarations that do not line up


@dataclass
class Offset(qax.ImplicitArray):
    """A declared type whose `base` may be implicit (a quantized stack)."""

    base: qax.ArrayValue = qax.array_field(ndim=2)
    bias: qax.ArrayValue = qax.array_field(ndim=1)

    def materialize(self):
        return qax.materialize_nested(self.base) + self.bias[..., None, :]


def test_scan_materializes_a_nested_part_that_is_not_stacked_like_its_parent():
    stack = jax.random.normal(KEY, (3, 64, 64))
    # quantized as one 3-d weight (no batch_ndim): its leaves do not lead with layers
    base = qax.quant.quantize(stack, "int8")
    assert qax.utils.batch_ndim(base) == 0
    value = Offset(base, jnp.ones((3, 64)))
    assert qax.utils.batch_ndim(value) == 1
    x = jax.random.normal(KEY, (5, 64))

    def f(p):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p)[0]

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", qax.MaterializationWarning)
        got = qax.use_implicit_args(f)(value)
    assert any("Int8Weight" in str(w.message) for w in seen), [str(w) for w in seen]
    want = f(qax.materialize_nested(value, full=True))
    assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_loraify_refuses_a_stacked_lora_around_a_weight_quantized_as_one():
    params = {"w": jax.random.normal(KEY, (3, 64, 64))}
    whole = qax.quant.quantize(params, "nf4")
    with pytest.raises(ValueError, match=r"quantize\(params, \.\.\., batch_ndim=1\)"):
        qax.lora.loraify(whole, rank=2, key=KEY, batch_ndim=1)
    # quantized per layer, it stacks and scans, implicitly
    per_layer = qax.quant.quantize(params, "nf4", batch_ndim=1)
    lora_params = qax.lora.loraify(per_layer, rank=2, key=KEY, batch_ndim=1)
    x = jax.random.normal(KEY, (5, 64))

    def f(p):
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]

    got = qax.use_implicit_args(f)(lora_params)
    assert_close(
        got, f(qax.materialize_nested(lora_params, full=True)), rtol=1e-4, atol=1e-4
    )
