"""Implicit arrays under JAX's own sharding, on 8 simulated CPU devices.

The device count must be fixed before JAX starts, so the cases (`_sharding_cases.py`:
single primitives; `_sharded_training_cases.py`: LoRA / QLoRA training and adapter
banks on a 2x4 mesh) run in child pytest processes with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`.
The `qax.sharding` spec derivation is tested here, in this process.
"""

import dataclasses
import pathlib
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qax
from tests.helpers import all_eqns, run_on_eight_devices

HERE = pathlib.Path(__file__).resolve().parent


@pytest.mark.parametrize("cases", ["_sharding_cases.py", "_sharded_training_cases.py"])
def test_cases_on_eight_devices(cases):
    run_on_eight_devices(str(HERE / cases))


# ----------------------------------------------------------------------------------------
# `qax.sharding`: leaf specs derived from the dense array's spec, as the types declare


@dataclass
class _Lora(qax.ImplicitArray):
    w: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
    a: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, None))
    b: qax.ArrayValue = qax.array_field(ndim=2, follows=(1, None))

    def materialize(self):
        return self.w + self.a @ jnp.swapaxes(self.b, -1, -2)


@dataclass
class _Int8(qax.ImplicitArray):
    q: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
    scale: qax.ArrayValue = qax.array_field(ndim=1, follows=(1,))

    def compute_shape(self):
        return self.q.shape

    def compute_dtype(self):
        return self.scale.dtype

    def materialize(self):
        return self.q.astype(self.scale.dtype) * self.scale


@dataclass
class _RankFree(qax.ImplicitArray):
    """`w + tensordot(a, b, 1)` for any split of `w`'s dims: declares by a method."""

    w: qax.ArrayValue
    a: qax.ArrayValue
    b: qax.ArrayValue

    def field_dims(self):
        k = self.a.ndim - 1
        n = self.w.ndim
        return {
            "w": tuple(range(n)),
            "a": (*range(k), None),
            "b": (None, *range(k, n)),
        }

    def materialize(self):
        return self.w + jnp.tensordot(self.a, self.b, 1)


@dataclass
class _Undeclared(qax.ImplicitArray):
    w: qax.ArrayValue
    default_dtype = jnp.float32

    def materialize(self):
        return self.w


def _lora(lead=()):
    return _Lora(
        jnp.zeros((*lead, 8, 6)), jnp.zeros((*lead, 8, 2)), jnp.zeros((*lead, 6, 2))
    )


def _fields(specs):
    return {
        k: v for k, v in vars(specs).items() if isinstance(v, (P, qax.ImplicitBase))
    }


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (P(None, "m"), {"w": P(None, "m"), "a": P(None, None), "b": P("m", None)}),
        (P("m", None), {"w": P("m", None), "a": P("m", None), "b": P(None, None)}),
        (P(("d", "m")), {"w": P(("d", "m"), None), "a": P(("d", "m"), None)}),
        (P(), {"w": P(None, None), "a": P(None, None), "b": P(None, None)}),
    ],
    ids=["column", "row", "fsdp", "replicated"],
)
def test_implicit_specs_follow_the_declared_dims(spec, want):
    got = _fields(qax.sharding.implicit_specs({"w": _lora()}, {"w": spec})["w"])
    assert {k: got[k] for k in want} == want


def test_implicit_specs_batch_dims_lead():
    got = qax.sharding.implicit_specs(_lora((3,)), P("d", None, "m"))
    assert (got.w, got.a, got.b) == (
        P("d", None, "m"),
        P("d", None, None),
        P("d", "m", None),
    )


def test_implicit_specs_of_adapters_along_any_axes():
    # A Gemma-style query kernel (heads, d_model, head_dim) with PEFT-style factors:
    # a (d_model, rank) follows the model axis, b (rank, heads, head_dim) the heads.
    lora = qax.lora.LoraWeight(
        jnp.zeros((4, 8, 2)), jnp.zeros((8, 3)), jnp.zeros((3, 4, 2)), a_axes=(1,)
    )
    got = qax.sharding.implicit_specs(lora, P("m", "d", None))
    assert (got.w, got.a, got.b) == (
        P("m", "d", None),
        P("d", None),
        P(None, "m", None),
    )


def test_implicit_specs_nested_quantized_base():
    q = _Int8(jnp.zeros((8, 6), jnp.int8), jnp.ones((6,)))
    lora = _Lora(q, jnp.zeros((8, 2)), jnp.zeros((6, 2)))
    got = qax.sharding.implicit_specs(lora, P(None, "m"))
    assert isinstance(got.w, _Int8)
    assert (got.w.q, got.w.scale, got.a, got.b) == (
        P(None, "m"),
        P("m"),
        P(None, None),
        P("m", None),
    )


def test_implicit_specs_by_method_and_prefix():
    w = _RankFree(jnp.zeros((4, 3, 6)), jnp.zeros((4, 3, 2)), jnp.zeros((2, 6)))
    tree = {"layer": {"w": w, "bias": jnp.zeros(6)}, "other": jnp.zeros(5)}
    got = qax.sharding.implicit_specs(
        tree, {"layer": {"w": P("d", None, "m"), "bias": P("m")}, "other": None}
    )
    assert (got["layer"]["w"].a, got["layer"]["w"].b) == (
        P("d", None, None),
        P(None, "m"),
    )
    assert got["layer"]["bias"] == P("m") and got["other"] == P()


def test_implicit_shardings_places_leaves():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("d", "m"))
    lora = _lora()
    shardings = qax.sharding.implicit_shardings([lora], [P(None, "m")], mesh)
    placed = jax.device_put([lora], shardings)[0]
    assert isinstance(placed, _Lora)
    assert placed.b.sharding == NamedSharding(mesh, P("m", None))


@pytest.mark.parametrize(
    ("value", "spec", "match"),
    [
        (_Undeclared(jnp.zeros((4, 4))), P("m"), "does not declare"),
        (_lora(), P("d", "m", None), "has 3 entries"),
    ],
    ids=["undeclared", "too-long"],
)
def test_implicit_specs_errors(value, spec, match):
    with pytest.raises(ValueError, match=match):
        qax.sharding.implicit_specs(value, spec)


def test_undeclared_type_may_be_replicated():
    got = qax.sharding.implicit_specs(_Undeclared(jnp.zeros((4, 4))), P())
    assert got.w == P()


def test_array_field_rejects_bad_follows():
    with pytest.raises(ValueError, match="one entry per dimension"):
        qax.array_field(ndim=2, follows=(0,))


def test_builtin_types_declare_how_their_fields_follow_the_weight():
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import qax

    w = jnp.ones((8, 128))
    lora = qax.lora.LoraWeight(w, jnp.ones((8, 2)), jnp.zeros((2, 128)))
    (got,) = qax.sharding.implicit_specs([lora], [P("data", "model")])
    assert (got.w, got.a, got.b) == (
        P("data", "model"),
        P("data", None),
        P(None, "model"),
    )
    int8 = qax.quant.Int8Weight.from_array(w)
    (got,) = qax.sharding.implicit_specs([int8], [P("data", "model")])
    assert (got.q, got.scale) == (P("data", "model"), P(None, "model"))
    stacked = qax.quant.NF4Weight.from_array(jnp.ones((3, 8, 128)), batch_ndim=1)
    qlora = qax.lora.LoraWeight(stacked, jnp.ones((3, 8, 2)), jnp.zeros((3, 2, 128)))
    (got,) = qax.sharding.implicit_specs([qlora], [P(None, None, "model")])
    assert got.w.packed == P(None, None, "model") and got.a == P(None, None, None)
    assert got.b == P(None, None, "model")


def _bank(base_w):
    """A bank of two adapters (ranks 2 and 3) over `base_w` [8, 6], beside a bias."""
    adapters = [
        {
            "w": qax.lora.LoraAdapter(jnp.ones((8, r)), jnp.ones((r, 6)), alpha=1.0),
            "bias": None,
        }
        for r in (2, 3)
    ]
    return qax.lora.bank({"w": base_w, "bias": jnp.zeros(6)}, adapters)


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "int8"])
def test_bank_specs_place_the_adapter_axis_before_the_weights_spec(quantized):
    w = jnp.ones((8, 6))
    served = _bank(qax.quant.Int8Weight.from_array(w) if quantized else w)
    dense_specs = {"w": P(None, "model"), "bias": P("model")}
    placed = qax.lora.bank_specs(served, dense_specs, adapter_axis="data")
    assert placed == {"w": P("data", None, "model"), "bias": P("model")}
    got = qax.sharding.implicit_specs(served, placed)["w"]
    base = got.w.q if quantized else got.w
    assert base == P(None, "model")  # the shared base: as the weight's spec says
    assert (got.a, got.b) == (P("data", None, None), P("data", None, "model"))
    # replicated adapters; a prefix spec covering the bank; FSDP over both mesh axes
    fsdp = qax.lora.bank_specs(served, P(("data", "model")), adapter_axis=None)
    assert fsdp == {"w": P(None, ("data", "model")), "bias": P(("data", "model"))}
    got = qax.sharding.implicit_specs(served, fsdp)["w"]
    assert (got.a, got.b) == (P(None, ("data", "model"), None), P(None, None, None))
    with pytest.raises(ValueError, match="mesh axis 'data'.*already uses"):
        qax.lora.bank_specs(served, fsdp, adapter_axis="data")


def test_jit_takes_the_shardings_of_a_bank_without_warnings():
    # Specs with several mesh axes per entry (FSDP), and JAX's unflattening of the
    # sharding tree with `None` layouts: both give a bank (whose type declares no
    # field ranks) leaves that are not arrays.
    served = _bank(qax.quant.Int8Weight.from_array(jnp.ones((8, 6))))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("d", "m"))
    specs = qax.lora.bank_specs(served, {"w": P(("d", "m")), "bias": None})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardings = qax.sharding.implicit_shardings(served, specs, mesh)
        assert shardings["w"].a.spec == P(None, ("d", "m"), None)
        f = jax.jit(
            lambda p: qax.lora.unbank(p)[1][1]["w"].b,
            in_shardings=(shardings,),
            out_shardings=NamedSharding(mesh, P()),
        )
        np.testing.assert_array_equal(f(served), jnp.ones((3, 6)))


# ----------------------------------------------------------------------------------------
# Stored fields: products move them as stored (the barrier `qax._arrival.arrive`)


@dataclass
class _StoredInt8(_Int8, warn_on_materialize=False):
    """`_Int8`, its fields declared stored."""

    q: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1), stored=True)
    scale: qax.ArrayValue = qax.array_field(ndim=1, follows=(1,), stored=True)


def _arrivals(jaxpr) -> list:
    return [
        eqn.invars[0].aval.dtype
        for eqn in all_eqns(jaxpr)
        if eqn.primitive.name == "qax_arrive"
    ]


def _int8_pair():
    q = jnp.arange(-24, 24, dtype=jnp.int8).reshape(8, 6)
    return q, jnp.linspace(0.5, 1.0, 6)


def test_products_of_stored_fields_arrive_before_decoding_and_nothing_else_does():
    q, scale = _int8_pair()
    x = jnp.ones((3, 8))
    stored, plain = _StoredInt8(q, scale), _Int8(q, scale)

    def f(w, x):
        return x @ w, w + 1.0  # a product (arrives), an elementwise op (does not)

    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(stored, x)
    assert _arrivals(jaxpr) == [jnp.int8, jnp.float32]  # the codes, the scales
    with qax.materialization_policy(_Int8, "allow"):
        assert not _arrivals(jax.make_jaxpr(qax.use_implicit_args(f))(plain, x))
    for out, want in zip(jax.jit(qax.use_implicit_args(f))(stored, x), f(q * scale, x)):
        np.testing.assert_allclose(out, want, rtol=1e-6)
    # eagerly there is nothing to place: the leaves go to the code as they are
    eager = qax.use_implicit_args(lambda w, x: x @ w)(stored, x)
    np.testing.assert_allclose(eager, x @ (q * scale), rtol=1e-6)


def test_stored_fields_change_nothing_on_one_device():
    w = qax.quant.Int8Weight.from_array(
        jax.random.normal(jax.random.PRNGKey(0), (8, 6))
    )
    x = jnp.ones((3, 8))
    f = jax.jit(qax.use_implicit_args(lambda w, x: jnp.tanh(x @ w)))
    assert "propagation_barrier" in f.lower(w, x).as_text()
    compiled = f.lower(w, x).compile().as_text()
    assert "propagation_barrier" not in compiled and "custom-call" not in compiled
    np.testing.assert_allclose(f(w, x), jnp.tanh(x @ w.dequantize()), rtol=1e-6)


def test_stored_fields_under_grad_vmap_and_export():
    key_w, key_x = jax.random.split(jax.random.PRNGKey(1))
    ws = jax.random.normal(key_w, (4, 8, 6))
    stacked = qax.quant.Int8Weight.from_array(ws, batch_ndim=1)
    xs = jax.random.normal(key_x, (4, 3, 8))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    batched = jax.jit(jax.vmap(qax.use_implicit_args(loss)))(stacked, xs)
    np.testing.assert_allclose(
        batched, jax.vmap(loss)(stacked.dequantize(), xs), rtol=1e-5
    )

    one = qax.quant.Int8Weight.from_array(ws[0])

    def of_scale(scale):  # gradients reach the (stored) scales through the barrier
        return qax.use_implicit_args(loss)(dataclasses.replace(one, scale=scale), xs[0])

    np.testing.assert_allclose(
        jax.jit(jax.grad(of_scale))(one.scale),
        jax.grad(lambda s: loss(one.q * s, xs[0]))(one.scale),
        rtol=1e-5,
        atol=1e-3,  # gradients of ~50: the int8 product sums them in its own order
    )

    exported = jax.export.export(jax.jit(qax.use_implicit_args(loss)))(one, xs[0])
    restored = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(
        restored.call(one, xs[0]), loss(one.dequantize(), xs[0]), rtol=1e-6
    )


def test_stored_fields_with_the_gspmd_partitioner_are_plain_values():
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        pytest.skip("this JAX has no GSPMD partitioner")
    w = qax.quant.Int8Weight.from_array(jnp.ones((8, 6)))
    f = jax.jit(qax.use_implicit_args(lambda w, x: x @ w))
    try:
        jax.config.update("jax_use_shardy_partitioner", False)
        text = f.lower(w, jnp.ones((3, 8))).as_text()
        out = f(w, jnp.ones((3, 8)))
    finally:
        jax.config.update("jax_use_shardy_partitioner", True)
    assert "propagation_barrier" not in text
    np.testing.assert_allclose(out, jnp.ones((3, 8)) @ w.dequantize(), rtol=1e-6)


def test_array_field_records_stored():
    assert qax._fields.fields_of(_StoredInt8).stored == ("q", "scale")
    assert qax._fields.fields_of(_Int8).stored == ()
    assert qax._fields.fields_of(qax.quant.NF4Weight).stored == ("packed", "absmax")
