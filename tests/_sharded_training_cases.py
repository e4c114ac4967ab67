"""LoRA / QLoRA training sharded over a 2x4 mesh, run by `test_sharding.py` on 8 devices.

The model is the GPT-style one of `benchmarks/bench_lora.py` (small sizes here), with
the built-in types: every matmul weight a `qax.lora.LoraWeight`, over a `qax.quant`
weight for QLoRA (``int8``, ``int4``, ``nf4``), trained with `qax.lora.split` /
`combine`; and a bank of four adapters over one base (`qax.lora.bank`), served and
trained one adapter per example (`qax.lora.per_example`). The sharded setup (the dense
specs, the activation layouts, the mesh, the collectives count, the hand-written
variant with the same leaves) is that of `benchmarks/bench_sharded.py`. The oracle is the same step on one device, and a
hand-written step with the same leaves and shardings.

Run directly with `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/_sharded_training_cases.py`; without 8 devices every case is skipped.
"""

import dataclasses
import functools
import gc
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qax
from tests.helpers import all_eqns, forms_full_lora

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS)", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_sharded as bs  # noqa: E402
from bench_lora import MATMUL_WEIGHTS, Config, dense_linear, init_params  # noqa: E402
from bench_lora import make_loss as model_loss  # noqa: E402

# Rank 3 and 96 tokens: no LoRA factor or other array has the shape of a base weight,
# its codes or its block scales ([m, n / 8]), so the base weights' all-gathers are told
# apart by their shapes (`bs.base_shapes`).
CFG = Config(
    n_layers=1, d_model=32, n_heads=4, d_ff=64, vocab=96, seq=8, batch=8, rank=3
)
BLOCK = 8  # numbers per scale of the 4-bit formats (columns split four ways stay whole)
MESH = bs.make_mesh()
LoraWeight, Int8Weight = qax.lora.LoraWeight, qax.quant.Int8Weight
# Each kind once per layout would be 4 sharded compiles per variant; the two
# diagonal cases cover both kinds and both layouts (the benchmark runs all of them).
CASES = [("lora", "fsdp"), ("int8", "megatron")]
# Shapes of the weight matrices: no float array of these shapes may be computed.
WEIGHT_SHAPES = {(32, 32), (32, 64), (64, 32), (32, 96)}


def close(got, want):
    # Reductions split over devices sum in another order; adam's first step divides
    # the gradient by its own magnitude, which magnifies that where it is tiny.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Parameters and setups (the benchmark's, at the sizes above)


def dense_params(seed: int = 0, stacked: bool = False) -> dict:
    """Parameters of `init_params`' structure (numpy's generator is cheaper here than
    compiling JAX's)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.PRNGKey(0), stacked))

    def init(path, x):
        name = getattr(path[-1], "key", None)
        if name == "scale":  # layer norms
            return jnp.ones(x.shape, x.dtype)
        if name in ("bias", "b1", "b2"):
            return jnp.zeros(x.shape, x.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype)

    return jax.tree_util.tree_map_with_path(init, shapes)


TOKENS = bs.make_tokens(CFG)
DENSE_LOSS = model_loss(CFG, dense_linear, scan=False)
Setup = bs.Setup


@functools.cache
def params(kind: str) -> tuple[dict, dict]:
    """The dense parameters, and every matmul weight a `LoraWeight` (over `kind`)."""
    dense = dense_params()
    rng = np.random.default_rng(1)
    return dense, bs.with_lora(dense, kind, rng, CFG.rank, block=BLOCK)


@functools.cache
def setups(kind: str, layout: str) -> dict:
    """``{"qax": Setup, "hand": Setup}`` for one kind and layout, same leaves/shardings."""
    return bs.build(CFG, params(kind), layout, MESH, TOKENS)


@functools.cache
def compiled_text(kind: str, layout: str, variant: str) -> str:
    setup = setups(kind, layout)[variant]
    return setup.jitted().lower(*setup.placed()).compile().as_text()


@functools.cache
def single_device(kind: str):
    """The qax step on one device (no shardings, no activation layouts)."""
    implicit, opt_state, tokens = setups(kind, "fsdp")["qax"].args
    step = bs.make_step(qax.use_implicit_args(DENSE_LOSS), *bs.QAX)
    return jax.jit(step)(implicit, opt_state, tokens)


_BASE_FIELDS = {"w", "q", "scale", "packed", "absmax"}


def _frozen_leaves(tree):
    """The base-weight leaves (`w`, codes and scales) of every LoRA, by path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        fields = {getattr(k, "name", None) for k in path}  # attributes, not dict keys
        if fields & _BASE_FIELDS:
            out[jax.tree_util.keystr(path)] = leaf
    return out


def _factors(tree):
    return qax.lora.split(tree)[0]


# ----------------------------------------------------------------------------------------
# Placement


def test_device_put_places_each_leaf_as_its_type_declares():
    dense, implicit = params("int8")
    specs, _ = bs.dense_specs(dense, "megatron")
    placed = jax.device_put(
        implicit, qax.sharding.implicit_shardings(implicit, specs, MESH)
    )
    w1, w2 = placed["layers"][0]["mlp"]["w1"], placed["layers"][0]["mlp"]["w2"]
    assert isinstance(w1, LoraWeight) and isinstance(w1.w, Int8Weight)

    def shard(x):
        return x.addressable_shards[0].data.shape

    # column-parallel w1 [32, 64]: columns over "model"; a [32, r] whole, b [r, 64]
    # and the scales [1, 64] split along the columns
    assert w1.w.q.sharding.spec == P(None, "model")
    assert (shard(w1.w.q), shard(w1.w.scale)) == ((32, 16), (1, 16))
    assert (shard(w1.a), shard(w1.b)) == ((32, 3), (3, 16))
    # row-parallel w2 [64, 32]: rows over "model"; a [64, r] split, b and scales whole
    assert (shard(w2.a), shard(w2.b), shard(w2.w.scale)) == ((16, 3), (3, 32), (1, 32))
    close(placed, implicit)


# ----------------------------------------------------------------------------------------
# FSDP and tensor parallelism


@pytest.mark.parametrize(("kind", "layout"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_sharded_step_matches_one_device_without_extra_communication(kind, layout):
    both = setups(kind, layout)
    compiled = {}
    outs = {}
    for name, setup in both.items():
        args = setup.placed()
        compiled[name] = setup.jitted().lower(*args).compile()
        outs[name] = (args, compiled[name](*args))
    args, (new, opt_state, loss) = outs["qax"]
    ref_params, ref_opt_state, ref_loss = single_device(kind)
    close(loss, ref_loss)
    close(_factors(new), _factors(ref_params))
    close(opt_state, ref_opt_state)
    # the factors moved; the base weights did not, and stay sharded as they came in
    assert isinstance(new["head"], LoraWeight)
    assert not np.allclose(new["head"].b, args[0]["head"].b)
    before, after = _frozen_leaves(args[0]), _frozen_leaves(new)
    assert before.keys() == after.keys() and len(after) == 7 * (
        1 if kind == "lora" else 2
    )
    for path, leaf in after.items():
        assert leaf.sharding == before[path].sharding, path
        np.testing.assert_array_equal(leaf, before[path])
    got = [x.sharding for x in jax.tree.leaves(new)]
    assert got == jax.tree.leaves(both["qax"].out_shardings[0])
    # hand-written LoRA with the same leaves and shardings: same numbers, no fewer bytes
    close(outs["hand"][1], (bs.to_hand(new), opt_state, loss))
    comm = {n: bs.collectives(c.as_text()) for n, c in compiled.items()}
    assert sum(b for _, b in comm["hand"].values()) > 0
    for op in bs.COLLECTIVES:
        assert comm["qax"][op][1] <= comm["hand"][op][1], (op, comm)


def _not_formed(eqns) -> set:
    """Weight-shaped variables that hold no newly formed weight: the frozen base weight
    behind `stop_gradient` (`LoraWeight`'s ``freeze_w``), and an int8 weight decoded
    inside a `qax.quant` handler (the codes converted to float, times the scales)."""
    ok = set()  # of ids: literals are not hashable
    for eqn in eqns:
        name = eqn.primitive.name
        source = getattr(eqn.invars[0], "aval", None) if eqn.invars else None
        if name == "stop_gradient":
            ok.update(map(id, eqn.outvars))
        elif name == "convert_element_type" and source.dtype == jnp.int8:
            ok.update(map(id, eqn.outvars))
        elif name == "mul" and any(id(v) in ok for v in eqn.invars):
            ok.update(map(id, eqn.outvars))
    return ok


@pytest.mark.parametrize(("kind", "layout"), CASES, ids=[f"{k}-{m}" for k, m in CASES])
def test_step_never_forms_the_dense_weight(kind, layout):
    setup = setups(kind, layout)["qax"]
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        jaxpr = jax.make_jaxpr(setup.jitted())(*setup.args)
    eqns = list(all_eqns(jaxpr))
    not_formed = _not_formed(eqns)
    formed = []
    for eqn in eqns:
        if eqn.primitive.name in ("jit", "pjit"):  # passes its body's results through
            continue
        for out in eqn.outvars:
            aval = out.aval
            if tuple(getattr(aval, "shape", ())) not in WEIGHT_SHAPES:
                continue
            if jnp.issubdtype(aval.dtype, jnp.floating) and id(out) not in not_formed:
                formed.append(eqn)
    assert not formed, formed
    assert not forms_full_lora(jaxpr, CFG.d_model, CFG.d_ff, CFG.rank)


# ----------------------------------------------------------------------------------------
# Quantized weights move as stored (`qax.array_field(stored=True)`)

QUANTIZED = ("int8", "int4", "nf4")


@functools.cache
def compiled(kind: str, layout: str, variant: str):
    setup = setups(kind, layout)[variant]
    args = setup.placed()
    return setup.jitted().lower(*args).compile(), args


def _gathered(kind: str, layout: str, variant: str) -> dict:
    text = compiled(kind, layout, variant)[0].as_text()
    return bs.gathered_arrays(text, bs.base_shapes(params(kind)[1]))


@pytest.mark.parametrize("kind", QUANTIZED)
def test_fsdp_qlora_gathers_codes_and_scales_as_stored(kind):
    step, args = compiled(kind, "fsdp", "qax")
    new, opt_state, loss = step(*args)
    ref_params, ref_opt_state, ref_loss = single_device(kind)
    close(loss, ref_loss)
    close(_factors(new), _factors(ref_params))
    close(opt_state, ref_opt_state)
    close(_frozen_leaves(new), _frozen_leaves(args[0]))

    got = _gathered(kind, "fsdp", "qax")
    codes = "s8" if kind == "int8" else "u8"
    scales = {
        tuple(leaf.shape)
        for lora in jax.tree.leaves(params(kind)[1], is_leaf=_is_lora)
        if _is_lora(lora)
        for leaf in jax.tree.leaves(lora.w)[1:]
    }
    assert {dtype for dtype, _ in got} >= {codes}
    # every base leaf gathered is a code, or a scale (of its stored float type); no
    # weight is gathered after decoding, as hand-written code gathers it
    assert all(dtype == codes or shape in scales for dtype, shape in got), got
    hand = _gathered(kind, "fsdp", "hand")
    assert any(dtype == "f32" and shape in WEIGHT_SHAPES for dtype, shape in hand)
    lora_f32 = sum(_gathered("lora", "fsdp", "hand").values())
    # 1 byte per number (int8), or 1/2 + 4/BLOCK (4-bit codes and f32 scales), of 4
    assert 3.9 * sum(got.values()) <= lora_f32, (got, lora_f32)


def _is_lora(x) -> bool:
    return isinstance(x, LoraWeight)


@pytest.mark.parametrize("kind", ["nf4"])
def test_megatron_qlora_moves_no_more_bytes_than_hand_written(kind):
    comm = {
        n: bs.collectives(compiled(kind, "megatron", n)[0].as_text())
        for n in ("qax", "hand")
    }
    for op in bs.COLLECTIVES:
        assert comm["qax"][op][1] <= comm["hand"][op][1], (op, comm)
    assert not _gathered(kind, "megatron", "qax")


def test_stacked_qlora_scan_step_gathers_stored_codes_layer_by_layer():
    # Layers stacked on a leading axis and run by `lax.scan`: every matmul weight a
    # LoRA over NF4 codes, both with one batch axis; FSDP splits each layer's rows.
    dense = dense_params(stacked=True)
    rng = np.random.default_rng(2)

    def convert(path, w):
        if getattr(path[-1], "key", None) not in MATMUL_WEIGHTS:
            return w
        lead = w.shape[:-2]
        a = 0.02 * rng.standard_normal((*lead, w.shape[-2], CFG.rank))
        b = 0.02 * rng.standard_normal((*lead, CFG.rank, w.shape[-1]))
        base = qax.quant.NF4Weight.from_array(w, BLOCK, batch_ndim=len(lead))
        return LoraWeight(base, jnp.asarray(a, w.dtype), jnp.asarray(b, w.dtype))

    implicit = jax.tree_util.tree_map_with_path(convert, dense)

    def spec(path, x):
        name = getattr(path[-1], "key", None)
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        if name in MATMUL_WEIGHTS or name == "wte":
            return P(*([None] * stacked), bs.AXES)
        return P()

    specs = jax.tree_util.tree_map_with_path(spec, dense)
    shardings = qax.sharding.implicit_shardings(implicit, specs, MESH)
    layer = shardings["layers"]["mlp"]["w1"]
    assert layer.w.packed.spec == P(None, bs.AXES, None)
    assert layer.w.absmax.spec == P(None, bs.AXES, None)
    assert (layer.a.spec, layer.b.spec) == (P(None, bs.AXES, None), P(None, None, None))

    activations = NamedSharding(MESH, P(bs.AXES, None, None))
    loss = qax.use_implicit_args(
        model_loss(
            CFG,
            dense_linear,
            scan=True,
            layout=lambda x, _: jax.lax.with_sharding_constraint(x, activations),
        )
    )
    step = bs.make_step(loss, *bs.QAX)
    opt_state = bs.OPTIMIZER.init(qax.lora.split(implicit)[0])
    replicated = NamedSharding(MESH, P())
    opt_sh = jax.tree.map(lambda _: replicated, opt_state)
    in_sh = (shardings, opt_sh, NamedSharding(MESH, P(bs.AXES)))
    args = jax.device_put((implicit, opt_state, TOKENS), in_sh)
    program = jax.jit(step, in_shardings=in_sh).lower(*args).compile()
    new, _, value = program(*args)
    plain = model_loss(CFG, dense_linear, scan=True)
    ref, _, ref_value = jax.jit(bs.make_step(qax.use_implicit_args(plain), *bs.QAX))(
        implicit, opt_state, TOKENS
    )
    close(value, ref_value)
    close(_factors(new), _factors(ref))

    # what a gather of the codes, scales or decoded weights, of one layer or all of
    # them, would produce
    stacked = {tuple(x.shape) for x in jax.tree.leaves(implicit["layers"])}
    weights = WEIGHT_SHAPES | {(CFG.n_layers, *shape) for shape in WEIGHT_SHAPES}
    shapes = stacked | {shape[1:] for shape in stacked} | weights
    got = bs.gathered_arrays(program.as_text(), shapes)
    assert "u8" in {dtype for dtype, _ in got}, got
    assert not [key for key in got if key == ("f32", key[1]) and key[1] in weights], got


# ----------------------------------------------------------------------------------------
# shard_map: a data-parallel step over implicit parameters


def _data_parallel_step(loss):
    """Each device: the loss and factor gradients of its slice of the batch; then the
    gradients are averaged (`pmean`, a `psum` over the devices) and every device
    applies the same update to its replica of the implicit parameters.

    ``check_vma=False``: the gradients are per device until the explicit `pmean` (with
    JAX's default varying-axes checks, the gradient of a replicated input comes out
    already summed over the devices, and a `pmean` would then be wrong by 8x).
    """

    def local(params, opt_state, tokens):
        adapters, base = qax.lora.split(params)
        value, grads = jax.value_and_grad(
            lambda ad: loss(qax.lora.combine(ad, base), tokens)
        )(adapters)
        grads = jax.lax.pmean(grads, bs.AXES)
        updates, opt_state = bs.OPTIMIZER.update(grads, opt_state, adapters)
        new = qax.lora.combine(optax.apply_updates(adapters, updates), base)
        return new, opt_state, jax.lax.pmean(value, bs.AXES)

    return jax.shard_map(
        local,
        mesh=MESH,
        in_specs=(P(), P(), P(bs.AXES)),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )


def test_shard_map_data_parallel_step_on_implicit_params():
    kind = "int8"
    setup = setups(kind, "fsdp")["qax"]
    implicit, opt_state, tokens = setup.args
    seen = []
    implicit_loss = qax.use_implicit_args(DENSE_LOSS)

    def loss(p, t):
        seen.append((type(p["head"]), type(p["head"].w), t.shape))
        return implicit_loss(p, t)

    # implicit values go into shard_map and come out of it
    new, new_opt_state, value = jax.jit(_data_parallel_step(loss))(
        implicit, opt_state, tokens
    )
    ((lora_type, base_type, local_tokens),) = seen
    assert issubclass(lora_type, LoraWeight) and issubclass(base_type, Int8Weight)
    assert local_tokens == (1, CFG.seq + 1)
    assert isinstance(new["head"], LoraWeight) and isinstance(new["head"].w, Int8Weight)
    ref_params, ref_opt_state, ref_loss = single_device(kind)
    close(value, ref_loss)
    close(_factors(new), _factors(ref_params))
    close(new_opt_state, ref_opt_state)
    close(_frozen_leaves(new), _frozen_leaves(implicit))


def _live_tracers() -> set[int]:
    gc.collect()
    return {id(x) for x in gc.get_objects() if isinstance(x, jax.core.Tracer)}


def _jax_leaks_under_jit_grad_of_shard_map() -> bool:
    """Whether JAX itself (no qax) leaks tracers under ``jit(grad(shard_map))``.

    JAX 0.10.2 does: `ad.linearize_subtrace_2` (shard_map's linearize rule) never
    invalidates its tangent `DynamicJaxprTrace`. Residuals lifted into that trace as
    constants register ``weakref.finalize(tracer, trace.finalize_const, ...)``: the
    finalizer registry holds the trace, whose frame's ``tracing_eqns`` hold the
    constant tracers, so neither is ever freed, and the leak checker reports the
    shard_map body's tracers. Invalidating that trace after ``to_jaxpr`` (as
    `ad.linearize` does) removes the leak, with or without qax.

    Counted with the leak checker off: its report walks the whole heap (slow here).
    """
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("i",))

    def loss(w, x):
        return jax.shard_map(
            lambda w, x: jax.lax.pmean(jnp.sum(jnp.tanh(x @ w)), "i"),
            mesh=mesh,
            in_specs=(P(), P("i")),
            out_specs=P(),
        )(w, x)

    before = _live_tracers()
    with jax.check_tracer_leaks(False):
        jax.jit(jax.grad(loss))(jnp.ones((16, 6)), jnp.ones((8, 16)))
    return bool(_live_tracers() - before)


def test_shard_map_inside_use_implicit_args_differentiates_the_factors():
    # Here the implicit parameters enter `shard_map` under qax's interpreter (its
    # shard_map rule splits them by their specs and keeps them implicit).
    implicit, _, tokens = setups("lora", "fsdp")["qax"].args
    adapters, base = qax.lora.split(implicit)

    def sharded_loss(p, t):
        return jax.shard_map(
            lambda p, t: jax.lax.pmean(DENSE_LOSS(p, t), bs.AXES),
            mesh=MESH,
            in_specs=(P(), P(bs.AXES)),
            out_specs=P(),
        )(p, t)

    def grads(loss):
        return jax.jit(
            jax.value_and_grad(lambda ad: loss(qax.lora.combine(ad, base), tokens))
        )(adapters)

    # The leak under `jit(grad(shard_map))` is JAX's own (see the function above), and
    # the leak checker's report of it walks the heap for minutes; qax adds no leak of
    # its own: once JAX no longer leaks, the check runs here again.
    leaks = _jax_leaks_under_jit_grad_of_shard_map()
    with jax.check_tracer_leaks(not leaks):
        got = grads(qax.use_implicit_args(sharded_loss))
    close(got, grads(qax.use_implicit_args(DENSE_LOSS)))
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(sharded_loss))(implicit, tokens)
    assert not forms_full_lora(jaxpr, CFG.d_model, CFG.d_ff, CFG.rank)


# ----------------------------------------------------------------------------------------
# Sharded checkpoints


def test_orbax_restores_sharded_implicit_params_onto_the_mesh(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    setup = setups("int8", "megatron")["qax"]
    # one column- and one row-parallel QLoRA weight, and a replicated dense array
    full = jax.device_put(setup.args[0], setup.in_shardings[0])
    mlp, sh = full["layers"][0]["mlp"], setup.in_shardings[0]["layers"][0]["mlp"]
    tree = {"w1": mlp["w1"], "w2": mlp["w2"], "b2": mlp["b2"]}
    shardings = {"w1": sh["w1"], "w2": sh["w2"], "b2": sh["b2"]}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "params", tree)
        ckpt.wait_until_finished()
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            tree,
            shardings,
        )
        restored = ckpt.restore(tmp_path / "params", target)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    w1 = restored["w1"]
    assert isinstance(w1, LoraWeight) and isinstance(w1.w, Int8Weight)
    assert w1.w.q.dtype == jnp.int8
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), strict=True):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(got, want)
    assert w1.b.sharding.spec == P(None, "model")
    assert restored["w2"].a.sharding.spec == P("model", None)

    # onto another mesh (4 x 2) and another layout (FSDP: rows over all devices), with
    # the shardings derived from the dense specs for that mesh
    other = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), bs.AXES)
    specs = {"w1": P(bs.AXES), "w2": P(bs.AXES), "b2": P()}
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree,
        qax.sharding.implicit_shardings(tree, specs, other),
    )
    with ocp.StandardCheckpointer() as ckpt:
        moved = ckpt.restore(tmp_path / "params", target)
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(got, want)
    w1 = moved["w1"]
    assert isinstance(w1.w, Int8Weight) and w1.w.q.sharding.mesh.shape == other.shape
    assert w1.w.q.sharding.spec == P(bs.AXES, None)  # codes: rows split 8 ways
    assert w1.w.q.addressable_shards[0].data.shape == (4, 64)
    assert (w1.a.sharding.spec, w1.b.sharding.spec) == (P(bs.AXES, None), P(None, None))


# ----------------------------------------------------------------------------------------
# Adapter banks: one adapter per example over one sharded base (`qax.lora.bank`)

BANK_RANKS = (3, 2, 3, 1)  # padded to 3: no factor has the shape of a base leaf
BANK_IDS = np.array([0, 3, -1, 1, 2, 2, 0, 3], np.int32)  # one per example, -1: base
# FSDP splits every weight over both mesh axes: the adapter axis stays whole there;
# Megatron splits the weights over "model": the adapters are split over "data".
BANK_CASES = [("lora", "fsdp", None), ("int8", "megatron", "data")]


def _is_bank(x) -> bool:
    return isinstance(x, qax.lora.LoraBank)


@functools.cache
def bank_params(kind: str):
    """A bank of four adapters of ranks `BANK_RANKS` at every matmul weight, over the
    base of `params(kind)`."""
    lora, base = qax.lora.split(params(kind)[1])  # lora: a LoraAdapter where LoRA'd
    rng = np.random.default_rng(3)

    def adapter(rank, alpha):
        def one(ad, w):
            if ad is None:
                return None
            a = 0.05 * rng.standard_normal((w.shape[0], rank))
            b = 0.05 * rng.standard_normal((rank, w.shape[1]))
            return qax.lora.LoraAdapter(
                jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), alpha=alpha
            )

        return jax.tree_util.tree_map(
            one,
            lora,
            base,
            is_leaf=lambda x: x is None or isinstance(x, qax.lora.LoraAdapter),
        )

    adapters = [adapter(r, 2.0 * (i + 1)) for i, r in enumerate(BANK_RANKS)]
    return qax.lora.bank(base, adapters)


def bank_factors(tree):
    """The trainable part of a tree holding banks (parameters, or their shardings):
    ``{"a", "b"}`` at each bank, None elsewhere."""
    return jax.tree_util.tree_map(
        lambda x: {"a": x.a, "b": x.b} if _is_bank(x) else None, tree, is_leaf=_is_bank
    )


def with_factors(factors, served):
    return jax.tree_util.tree_map(
        lambda f, x: x if f is None else dataclasses.replace(x, a=f["a"], b=f["b"]),
        factors,
        served,
        is_leaf=lambda f: f is None or (isinstance(f, dict) and set(f) == {"a", "b"}),
    )


# Serving: each example's loss with its own adapter (the model's loss of one example).
SERVE = qax.lora.per_example(lambda p, t: DENSE_LOSS(p, t)[None])


def bank_step(served, opt_state, ids, tokens):
    """One adam step of every adapter's factors, each from its own examples; also the
    per-example losses."""
    factors = bank_factors(served)

    def loss(factors):
        losses = SERVE(ids, with_factors(factors, served), tokens)
        return jnp.mean(losses), losses

    (_, losses), grads = jax.value_and_grad(loss, has_aux=True)(factors)
    updates, opt_state = bs.OPTIMIZER.update(grads, opt_state, factors)
    new = with_factors(optax.apply_updates(factors, updates), served)
    return new, opt_state, losses


@functools.cache
def bank_single_device(kind: str):
    served = bank_params(kind)
    opt_state = bs.OPTIMIZER.init(bank_factors(served))
    return jax.jit(bank_step)(served, opt_state, jnp.asarray(BANK_IDS), TOKENS)


def _base_shapes(served) -> set:
    """The shapes of every bank's base weight and of its leaves (codes, scales)."""
    shapes = set()
    for x in jax.tree.leaves(served, is_leaf=_is_bank):
        if _is_bank(x):
            shapes.add(tuple(x.w.shape))
            shapes.update(tuple(leaf.shape) for leaf in jax.tree.leaves(x.w))
    return shapes


@pytest.mark.parametrize(
    ("kind", "layout", "adapter_axis"),
    BANK_CASES,
    ids=[f"{k}-{m}-adapters-{a or 'replicated'}" for k, m, a in BANK_CASES],
)
def test_bank_serves_and_trains_sharded_as_on_one_device(kind, layout, adapter_axis):
    dense, _ = params(kind)
    served = bank_params(kind)
    specs, token_spec = bs.dense_specs(dense, layout)
    placed_specs = qax.lora.bank_specs(served, specs, adapter_axis)
    shardings = qax.sharding.implicit_shardings(served, placed_specs, MESH)
    batch = NamedSharding(MESH, token_spec)
    replicated = NamedSharding(MESH, P())
    opt_state = bs.OPTIMIZER.init(bank_factors(served))
    opt_sh = optax.tree_map_params(
        bs.OPTIMIZER,
        lambda _p, s: s,
        opt_state,
        bank_factors(shardings),
        transform_non_params=lambda _: replicated,
    )
    ids = jnp.asarray(BANK_IDS)
    args = jax.device_put(
        (served, opt_state, ids, TOKENS), (shardings, opt_sh, batch, batch)
    )

    # the base as the dense weight's spec says, the adapter axis as asked
    head = args[0]["head"]  # w [32, 96]: column-parallel in Megatron
    base_leaf = jax.tree.leaves(head.w)[0]  # the weight, or its int8 codes
    want = {"fsdp": P(bs.AXES, None), "megatron": P(None, "model")}[layout]
    assert base_leaf.sharding.spec == want
    assert head.a.sharding.spec[0] == adapter_axis
    assert head.b.sharding.spec[0] == adapter_axis
    n_local = len(BANK_RANKS) // (
        1 if adapter_axis is None else MESH.shape[adapter_axis]
    )
    assert head.a.addressable_shards[0].data.shape[0] == n_local

    # serving a mixed batch
    serve = jax.jit(SERVE, in_shardings=(batch, shardings, batch), out_shardings=batch)
    placed, _, placed_ids, tokens = args
    losses = serve(placed_ids, placed, tokens)
    ref_params, ref_opt_state, ref_losses = bank_single_device(kind)
    close(losses, ref_losses)
    # the adapters matter: each example's loss differs from the base model's
    base_losses = serve(jnp.full_like(ids, -1), placed, tokens)
    assert np.all(np.abs(np.asarray(losses - base_losses))[BANK_IDS >= 0] > 1e-6)
    close(base_losses[BANK_IDS < 0], losses[BANK_IDS < 0])

    # one training step of the bank's factors
    step = jax.jit(
        bank_step,
        in_shardings=(shardings, opt_sh, batch, batch),
        out_shardings=(shardings, opt_sh, batch),
    )
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        compiled_step = step.lower(*args).compile()
    new, new_opt_state, step_losses = compiled_step(*args)
    close(step_losses, ref_losses)
    close(bank_factors(new), bank_factors(ref_params))
    close(new_opt_state, ref_opt_state)
    assert not np.allclose(new["head"].b, served["head"].b)
    # the base did not move, and stays where it was
    for path, leaf in _frozen_leaves(new).items():
        before = _frozen_leaves(placed)[path]
        assert leaf.sharding == before.sharding, path
        np.testing.assert_array_equal(leaf, before)
    assert [x.sharding for x in jax.tree.leaves(new)] == jax.tree.leaves(shardings)

    # no example gets its own copy of the base (nor is the bank's stack formed)
    jaxpr = jax.make_jaxpr(step)(*args)
    bases = _base_shapes(served)
    if layout == "megatron":  # and each device keeps its slice of the base (codes)
        assert not bs.gathered_arrays(compiled_step.as_text(), bases)
    for eqn in all_eqns(jaxpr):
        for out in eqn.outvars:
            shape = tuple(getattr(out.aval, "shape", ()))
            assert not (
                shape[1:] in bases and shape[0] in (len(BANK_IDS), len(BANK_RANKS))
            ), (eqn.primitive, shape)
