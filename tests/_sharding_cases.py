"""Multi-device cases, run by `test_sharding.py` in a process with 8 CPU devices.

Run directly with `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/_sharding_cases.py`; without 8 devices every case is skipped.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qax
from tests.helpers import (
    ClosedZeros,
    PlainMatmulLora,
    all_eqns,
    assert_close,
    check_mode,
    dense,
    forms_full_lora,
    keys,
    scaled_lora,
)

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS)", allow_module_level=True)

MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("i",))
ROWS = NamedSharding(MESH, P("i"))
REPLICATED = NamedSharding(MESH, P())
X = jax.random.normal(keys(1, 5)[0], (8, 16))


def lora():
    return scaled_lora(16, 6)  # w (16, 6), a (16, 2), b (6, 2)


_inner = jax.jit(
    lambda w, x: jnp.tanh(x @ w), in_shardings=(ROWS, REPLICATED), out_shardings=ROWS
)


@pytest.mark.parametrize("mode", ["eager", "jit", "jit_grad"])
def test_jit_named_shardings_on_implicit_operands(mode):
    check_mode(mode, lambda w, x: _inner(w, x), lora(), X)


def _specs(shardings):
    """Specs with trailing `None`s dropped (``P("i", None)`` partitions as ``P("i")``)."""
    out = []
    for s in shardings:
        entries = list(getattr(s, "spec", s))
        while entries and entries[-1] is None:
            entries.pop()
        out.append(P(*entries))
    return out


def test_jit_named_sharding_goes_to_leaves_as_the_type_declares():
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(lambda w, x: _inner(w, x)))(lora(), X)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    # w (16, 6) and a (16, 2) run along the rows; b (6, 2) along the columns: whole
    assert _specs(eqn.params["in_shardings"]) == [P("i"), P("i"), P(), P()]
    out = qax.use_implicit_args(lambda w, x: _inner(w, x))(lora(), X)
    assert out.sharding == ROWS


def _square_lora(follows=True):
    """A LoRA whose rank equals its width: `a`, `b` and `w` all have shape (8, 8)."""
    w, a, b = jnp.zeros((8, 8)), jnp.ones((8, 8)), jnp.ones((8, 8))
    return (PlainMatmulLora if follows else LoraWithoutFollows)(w, a, b)


@dataclass
class LoraWithoutFollows(qax.ImplicitArray):
    """`PlainMatmulLora` without `follows` (nor handler): how its leaves run along w is unknown."""

    w: qax.ArrayValue = qax.array_field(ndim=2)
    a: qax.ArrayValue = qax.array_field(ndim=2)
    b: qax.ArrayValue = qax.array_field(ndim=2)

    def materialize(self):
        return self.w + self.a @ self.b.T


def _jit_shardings(w, spec):
    sharding = NamedSharding(MESH, spec)
    inner = jax.jit(lambda w: w, in_shardings=sharding, out_shardings=sharding)
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(inner))(w)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "jit"]
    return eqn.params["in_shardings"], eqn.params["out_shardings"]


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (P("i", None), [P("i"), P("i"), P()]),
        (P(None, "i"), [P(None, "i"), P(), P("i")]),
    ],
    ids=["rows", "columns"],
)
def test_jit_square_lora_gets_the_declared_partitioning(spec, want):
    # Every leaf has the weight's shape; only the declaration says that the second
    # dimension of `a` and `b` is the rank.
    ins, outs = _jit_shardings(_square_lora(), spec)
    assert _specs(ins) == want and _specs(outs) == want


@pytest.mark.parametrize("place", ["constraint", "device_put"])
def test_annotations_split_a_square_lora_as_declared(place):
    columns = NamedSharding(MESH, P(None, "i"))

    def f(w):
        if place == "constraint":
            return jax.lax.with_sharding_constraint(w, columns)
        return jax.device_put(w, columns)

    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(_square_lora())
    if place == "constraint":
        got = [e.params["sharding"] for e in jaxpr.jaxpr.eqns]
    else:
        (eqn,) = jaxpr.jaxpr.eqns
        got = eqn.params["devices"]
    # w by columns; a (rows, rank) whole; b (columns, rank) by its rows
    assert _specs(got) == [P(None, "i"), P(), P("i")]


def test_jit_sharding_of_an_undeclared_type_warns_and_is_left_to_jax():
    with pytest.warns(UserWarning, match=r"field `w` does not declare.*follows"):
        ins, outs = _jit_shardings(_square_lora(follows=False), P("i", None))
    assert not any(isinstance(s, NamedSharding) for s in (*ins, *outs))
    # replicated needs no declaration
    ins, _ = _jit_shardings(_square_lora(follows=False), P())
    assert _specs(ins) == [P(), P(), P()]


def test_jit_sharded_implicit_output():
    double = jax.jit(lambda z: z * 2.0, in_shardings=ROWS, out_shardings=ROWS)
    out = qax.use_implicit_args(double)(ClosedZeros(shape=(16, 6)))
    assert isinstance(out, ClosedZeros) and out.shape == (16, 6)


def test_outer_jit_shards_every_leaf():
    f = jax.jit(
        qax.use_implicit_args(lambda z, y: z * y + y),
        in_shardings=(ROWS, ROWS),
        out_shardings=ROWS,
    )
    out = f(ClosedZeros(shape=(16, 6)), jnp.ones((16, 6)))
    assert out.sharding == ROWS
    assert_close(out, jnp.ones((16, 6)))


def _replicated_weight_map(w, x):
    return jax.shard_map(
        lambda x, w: jnp.tanh(x @ w),
        mesh=MESH,
        in_specs=(P("i"), P()),
        out_specs=P("i"),
    )(x, w)


@pytest.mark.parametrize("mode", ["eager", "jit", "grad", "jit_grad"])
def test_shard_map_with_replicated_lora(mode):
    check_mode(mode, _replicated_weight_map, lora(), X)


def test_shard_map_keeps_lora_implicit_and_inserts_pvary_per_leaf():
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(_replicated_weight_map))(lora(), X)
    names = [e.primitive.name for e in all_eqns(jaxpr)]
    assert "shard_map" in names and "pvary" in names
    assert not forms_full_lora(jaxpr, 16, 6, 2)


def test_shard_map_splits_symbolic_zeros():
    seen = []

    def body(z, x):
        seen.append(z.shape)
        return z * 2.0, z + x

    def f(z, x):
        return jax.shard_map(
            body, mesh=MESH, in_specs=(P("i"), P("i")), out_specs=(P("i"), P("i"))
        )(z, x)

    zeros, total = qax.use_implicit_args(f)(
        ClosedZeros(shape=(16, 6)), jnp.ones((16, 6))
    )
    assert seen == [(2, 6)]
    assert isinstance(zeros, ClosedZeros) and zeros.shape == (16, 6)
    assert_close(total, jnp.ones((16, 6)))


def test_shard_map_pvary_on_invariant_implicit():
    def f(z, x):
        return jax.shard_map(
            lambda z, x: z + x * z, mesh=MESH, in_specs=(P(), P("i")), out_specs=P("i")
        )(z, x)

    out = qax.use_implicit_args(f)(ClosedZeros(shape=(2, 6)), jnp.ones((16, 6)))
    assert isinstance(out, ClosedZeros) and out.shape == (16, 6)


def _row_split_matmul(w, x):
    # rows of the weight split over "i", and the matching columns of x: partial sums
    return jax.shard_map(
        lambda w, x: jax.lax.psum(x @ w, "i"),
        mesh=MESH,
        in_specs=(P("i"), P(None, "i")),
        out_specs=P(),
    )(w, x)


def test_shard_map_splits_leaves_as_the_type_declares():
    x = jnp.ones((3, 16))
    out = qax.use_implicit_args(_row_split_matmul)(lora(), x)  # no materialization
    assert_close(out, x @ dense(lora()))
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(_row_split_matmul))(lora(), x)
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]
    # w (16, 6) and a (16, 2) split along the rows, b (6, 2) whole; x by its spec
    assert _specs(eqn.params["in_specs"]) == [P("i"), P("i"), P(), P(None, "i")]
    assert [v.aval.shape for v in eqn.params["jaxpr"].invars] == [
        (2, 6),
        (2, 2),
        (6, 2),
        (3, 2),
    ]
    assert not forms_full_lora(jaxpr, 16, 6, 2)


def test_shard_map_returns_a_split_lora_whole():
    def f(w, x):
        return jax.shard_map(
            lambda w, x: (w, x * 2.0),
            mesh=MESH,
            in_specs=(P("i"), P("i")),
            out_specs=(P("i"), P("i")),
        )(w, x)

    out, _ = jax.jit(qax.use_implicit_args(f))(lora(), jnp.ones((16, 3)))
    assert isinstance(out, PlainMatmulLora) and out.shape == (16, 6)
    assert (out.w.shape, out.a.shape, out.b.shape) == ((16, 6), (16, 2), (6, 2))
    assert_close(out.materialize(), dense(lora()))


def test_shard_map_materializes_a_type_that_does_not_declare_its_split():
    w = _square_lora(follows=False)
    x = jnp.ones((3, 8))
    with pytest.warns(qax.MaterializationWarning, match="shard_map.*follows"):
        out = qax.use_implicit_args(_row_split_matmul)(w, x)
    assert_close(out, x @ w.materialize())


@pytest.mark.parametrize("mode", ["eager", "jit", "jit_grad"])
@pytest.mark.parametrize("place", ["constraint", "device_put"])
def test_sharding_annotations_keep_implicit(mode, place):
    def annotate(w):
        if place == "constraint":
            return jax.lax.with_sharding_constraint(w, ROWS)
        return jax.device_put(w, ROWS)

    def f(w, x):
        return jnp.tanh(x @ annotate(w))

    check_mode(mode, f, lora(), X)
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(f))(lora(), X)
    assert not forms_full_lora(jaxpr, 16, 6, 2)


def test_shard_map_implicit_carry_that_varies():
    # `pcast` makes the implicit weight vary over "i" leaf by leaf; its type must say so
    # too (as the materialized array's would), or scan's carry check fails.
    seen = []

    def body(w, x):
        w = jax.lax.pcast(w, "i", to="varying")
        seen.append(jax.typeof(w))

        def step(carry, _):
            return carry, jnp.sum(x @ carry)

        _, ys = jax.lax.scan(step, w, None, length=3)
        return ys

    def f(w, x):
        return jax.shard_map(body, mesh=MESH, in_specs=(P(), P("i")), out_specs=P("i"))(
            w, x
        )

    w = lora()
    out = qax.use_implicit_args(f)(w, X)
    assert_close(out, f(w.materialize(), X))
    implicit_type, dense_type = seen
    assert implicit_type.manual_axis_type.varying == {"i"}
    assert implicit_type == dense_type


# ----------------------------------------------------------------------------------------
# all_gather inside shard_map: leaf by leaf, quantized leaves as stored


def _qlora(fmt: str, rows: int = 64, cols: int = 32):
    """A LoRA over a `qax.quant` weight (4-bit blocks of 8)."""
    kw, ka, kb = keys(3, seed=7)
    w = 0.1 * jax.random.normal(kw, (rows, cols))
    options = {"int4": {"group_size": 8}, "nf4": {"block_size": 8}}.get(fmt, {})
    base = qax.quant.quantize(w, fmt, filter=lambda *_: True, **options)
    a = 0.1 * jax.random.normal(ka, (rows, 3))
    b = 0.1 * jax.random.normal(kb, (3, cols))
    return qax.lora.LoraWeight(base, a, b)


def _fsdp_matmul(check_vma: bool = True, tiled: bool = True):
    """Rows of the weight split over "i"; each device gathers it whole, then `x @ w`."""

    def local(w, x):
        full = jax.lax.all_gather(w, "i", axis=0, tiled=tiled)
        if tiled:
            return x @ full
        # a stack of the devices' row blocks (a batch axis): `scan` runs one product
        # per block, slicing the stack leaf by leaf
        blocks = x.reshape(x.shape[0], full.shape[0], -1).swapaxes(0, 1)

        def add_block(total, block):
            xs, ws = block
            return total + xs @ ws, None

        zeros = jnp.zeros((x.shape[0], full.shape[-1]), x.dtype)
        zeros = zeros * x[:, :1]  # varying over "i", as the products are
        return jax.lax.scan(add_block, zeros, (blocks, full))[0]

    return jax.shard_map(
        local,
        mesh=MESH,
        in_specs=(P("i"), P("i")),
        out_specs=P("i"),
        check_vma=check_vma,
    )


def _gathers(jaxpr) -> list:
    return [
        (str(eqn.outvars[0].aval.dtype), eqn.outvars[0].aval.shape)
        for eqn in all_eqns(jaxpr)
        if eqn.primitive.name == "all_gather"
    ]


@pytest.mark.parametrize("fmt", ["int8", "int4", "nf4"])
def test_all_gather_in_shard_map_moves_codes_as_stored(fmt):
    w, x = _qlora(fmt), jax.random.normal(keys(1, seed=8)[0], (16, 64))
    f = qax.use_implicit_args(_fsdp_matmul())
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        out = jax.jit(f)(w, x)
        jaxpr = jax.make_jaxpr(f)(w, x)
    assert_close(out, x @ w.materialize())
    gathered = _gathers(jaxpr)
    codes = "int8" if fmt == "int8" else "uint8"
    # the codes (whole rows), the row scales of the 4-bit formats, and LoRA's `a`;
    # int8's per-column scales and `b` do not run along the rows: kept
    assert (codes, (64, 32 if fmt == "int8" else 16)) in gathered
    assert all(dtype in (codes, "float32") for dtype, _ in gathered), gathered
    assert ("float32", (64, 32)) not in gathered
    assert ("float32", (64, 3)) in gathered  # a


def test_all_gather_in_shard_map_differentiates_the_factors():
    w, x = _qlora("nf4"), jax.random.normal(keys(1, seed=8)[0], (16, 64))
    adapters, base = qax.lora.split({"w": w})

    def loss(f):
        return lambda ad: jnp.sum(jnp.tanh(f(qax.lora.combine(ad, base)["w"], x)))

    implicit = jax.grad(loss(qax.use_implicit_args(_fsdp_matmul())))(adapters)
    reference = jax.grad(loss(lambda w, x: x @ w.materialize()))(adapters)
    assert_close(implicit, reference, rtol=1e-4, atol=1e-5)


def test_all_gather_on_a_new_axis_stacks_the_leaves():
    w, x = _qlora("int8"), jax.random.normal(keys(1, seed=8)[0], (16, 64))
    f = qax.use_implicit_args(_fsdp_matmul(tiled=False))
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        out = jax.jit(f)(w, x)
    assert_close(out, x @ w.materialize())


def test_all_gather_materializes_where_a_kept_leaf_may_differ():
    # Without check_vma nothing says that int8's column scales (not split by the
    # rows' spec) are the same on every device: the weight is decoded, then gathered.
    w, x = _qlora("int8"), jax.random.normal(keys(1, seed=8)[0], (16, 64))
    with pytest.warns(qax.MaterializationWarning, match="check_vma"):
        out = qax.use_implicit_args(_fsdp_matmul(check_vma=False))(w, x)
    assert_close(out, x @ w.materialize())


# ----------------------------------------------------------------------------------------
# Block scales that a mesh axis cannot split (issue 42, item 5)


def test_implicit_shardings_replicate_block_scales_a_mesh_axis_cannot_split():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("d", "m"))
    w = jax.random.normal(keys(1, 9)[0], (64, 32))
    nf4 = qax.quant.NF4Weight.from_array(w, 32, block_axis=0)  # 2 blocks along rows
    assert nf4.absmax.shape == (2, 32)
    params = {"w": nf4, "v": jnp.ones((64, 32))}
    specs = {"w": P("m", None), "v": P("m", None)}
    with pytest.warns(UserWarning, match=r"absmax.*'w'.*\(2, 32\).*'m'") as seen:
        shardings = qax.sharding.implicit_shardings(params, specs, mesh)
    assert len(seen) == 1, [str(x.message) for x in seen]
    assert seen[0].filename == __file__  # points at the caller's line
    assert shardings["w"].packed.spec == P("m", None)  # 32 rows of codes: split 4 ways
    assert shardings["w"].absmax.spec == P(None, None)  # 2 blocks: replicated
    assert shardings["v"].spec == P("m", None)
    placed = jax.device_put(params, shardings)
    x = jax.random.normal(keys(1, 10)[0], (5, 64))
    got = jax.jit(qax.use_implicit_args(lambda p, x: x @ p["w"] + x @ p["v"]))(
        placed, x
    )
    want = x @ nf4.dequantize() + x @ params["v"]
    assert_close(got, want, rtol=1e-5, atol=1e-5)
