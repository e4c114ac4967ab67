"""LoRA / QLoRA training sharded over a 2x4 mesh, run by `test_sharding.py` on 8 devices.

The model, the types and the sharded setup are those of `benchmarks/bench_sharded.py`
(small sizes here). The oracle is the same step on one device, and the hand-written
LoRA step with the same leaves and shardings.

Run directly with `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/_sharded_training_cases.py`; without 8 devices every case is skipped.
"""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _ho_types import all_eqns, forms_full_lora
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qax

if jax.device_count() < 8:
    pytest.skip("needs 8 devices (XLA_FLAGS)", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_sharded as bs  # noqa: E402
from bench_lora import Config, LoraMatrix, lora_factors, with_factors  # noqa: E402

CFG = Config(
    n_layers=1, d_model=32, n_heads=4, d_ff=64, vocab=64, seq=8, batch=8, rank=4
)
MESH = bs.make_mesh()
CASES = [(k, layout) for k in bs.KINDS for layout in bs.LAYOUTS]
# Shapes of the weight matrices: no float array of these shapes may be computed.
WEIGHT_SHAPES = {(32, 32), (32, 64), (64, 32)}


def close(got, want):
    # Reductions split over devices sum in another order; adam's first step divides
    # the gradient by its own magnitude, which magnifies that where it is tiny.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@functools.cache
def setups(kind, layout):
    return bs.build(CFG, kind, layout, MESH)


@functools.cache
def single_device(kind):
    setup = setups(kind, "fsdp")["qax"]
    return jax.jit(setup.step)(*setup.args)


def _frozen_leaves(params):
    """The base-weight leaves (`w`, int8 `q`/`scale`) of every LoRA, by path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        fields = {getattr(k, "name", None) for k in path}  # attributes, not dict keys
        if fields & {"w", "q", "scale"}:
            out[jax.tree_util.keystr(path)] = leaf
    return out


# ----------------------------------------------------------------------------------------
# Placement


def test_device_put_places_each_leaf_as_its_type_declares():
    dense, params = jax.jit(bs.implicit_params, static_argnums=(0, 1))(
        CFG, "qlora", jax.random.PRNGKey(0)
    )
    specs, _ = bs.dense_specs(dense, "megatron")
    placed = jax.device_put(
        params, qax.sharding.implicit_shardings(params, specs, MESH)
    )
    w1, w2 = placed["layers"][0]["mlp"]["w1"], placed["layers"][0]["mlp"]["w2"]
    assert isinstance(w1, LoraMatrix) and isinstance(w1.w, bs.Int8Matrix)
    # column-parallel w1 [32, 64]: columns over "model"; a [32, r] whole, b [64, r] split
    assert w1.w.q.sharding.spec == P(None, "model")
    assert w1.w.q.addressable_shards[0].data.shape == (32, 16)
    assert w1.w.scale.addressable_shards[0].data.shape == (16,)
    assert w1.a.addressable_shards[0].data.shape == (32, 4)
    assert w1.b.addressable_shards[0].data.shape == (16, 4)
    # row-parallel w2 [64, 32]: rows over "model"; a [64, r] split, b and scales whole
    assert w2.a.addressable_shards[0].data.shape == (16, 4)
    assert w2.b.addressable_shards[0].data.shape == (32, 4)
    assert w2.w.scale.addressable_shards[0].data.shape == (32,)
    close(placed, params)


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
    args, (params, opt_state, loss) = outs["qax"]
    ref_params, ref_opt_state, ref_loss = single_device(kind)
    close(loss, ref_loss)
    close(lora_factors(params), lora_factors(ref_params))
    close(opt_state, ref_opt_state)
    # the factors moved; the base weights did not, and stay sharded as they came in
    assert not np.allclose(params["head"].b, args[0]["head"].b)
    before, after = _frozen_leaves(args[0]), _frozen_leaves(params)
    assert before.keys() == after.keys() and len(after) == 7 * (
        2 if kind == "qlora" else 1
    )
    for path, leaf in after.items():
        assert leaf.sharding == before[path].sharding, path
        np.testing.assert_array_equal(leaf, before[path])
    got = [x.sharding for x in jax.tree.leaves(params)]
    assert got == jax.tree.leaves(both["qax"].out_shardings[0])
    # hand-written LoRA with the same leaves and shardings: same numbers, no fewer bytes
    close(outs["hand"][1], (bs.to_hand(params), opt_state, loss))
    comm = {n: bs.collectives(c.as_text()) for n, c in compiled.items()}
    assert sum(b for _, b in comm["hand"].values()) > 0
    for op in bs.COLLECTIVES:
        assert comm["qax"][op][1] <= comm["hand"][op][1], (op, comm)


@pytest.mark.parametrize("kind", bs.KINDS)
def test_step_never_forms_the_dense_weight(kind):
    setup = setups(kind, "megatron")["qax"]
    jaxpr = jax.make_jaxpr(setup.jitted())(*setup.args)
    formed = []
    for eqn in all_eqns(jaxpr):
        if eqn.primitive.name == "jit":  # passes its body's results through
            continue
        for out in eqn.outvars:
            aval = out.aval
            if tuple(getattr(aval, "shape", ())) not in WEIGHT_SHAPES:
                continue
            if not jnp.issubdtype(aval.dtype, jnp.floating):
                continue
            # the int8 handler converts the codes to feed one matmul; nothing else
            source = eqn.invars[0].aval.dtype if eqn.invars else None
            if eqn.primitive.name == "convert_element_type" and source == jnp.int8:
                continue
            formed.append(eqn)
    assert not formed, formed


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
        trainable = lora_factors(params)
        value, grads = jax.value_and_grad(
            lambda t: loss(with_factors(params, t), tokens)
        )(trainable)
        grads = jax.lax.pmean(grads, bs.AXES)
        updates, opt_state = bs.OPTIMIZER.update(grads, opt_state, trainable)
        new = with_factors(params, optax.apply_updates(trainable, updates))
        return new, opt_state, jax.lax.pmean(value, bs.AXES)

    return jax.shard_map(
        local,
        mesh=MESH,
        in_specs=(P(), P(), P(bs.AXES)),
        out_specs=(P(), P(), P()),
        check_vma=False,
    )


@pytest.mark.parametrize("kind", bs.KINDS)
def test_shard_map_data_parallel_step_on_implicit_params(kind):
    setup = setups(kind, "fsdp")["qax"]
    params, opt_state, tokens = setup.args
    seen = []
    implicit_loss = qax.use_implicit_args(bs.make_loss(CFG, bs.dense_linear, False))

    def loss(p, t):
        seen.append((type(p["head"]), t.shape))
        return implicit_loss(p, t)

    # implicit values go into shard_map and come out of it
    new, new_opt_state, value = jax.jit(_data_parallel_step(loss))(
        params, opt_state, tokens
    )
    assert seen == [(LoraMatrix, (1, CFG.seq + 1))]
    assert isinstance(new["head"], LoraMatrix)
    assert isinstance(new["head"].w, bs.Int8Matrix if kind == "qlora" else jax.Array)
    ref_params, ref_opt_state, ref_loss = single_device(kind)
    close(value, ref_loss)
    close(lora_factors(new), lora_factors(ref_params))
    close(new_opt_state, ref_opt_state)
    close(_frozen_leaves(new), _frozen_leaves(params))


def test_shard_map_inside_use_implicit_args_differentiates_the_factors():
    # Here the implicit parameters enter `shard_map` under qax's interpreter (its
    # shard_map rule splits them by their specs and keeps them implicit).
    setup = setups("lora", "fsdp")["qax"]
    params, _, tokens = setup.args
    dense_loss = bs.make_loss(CFG, bs.dense_linear, False)

    def sharded_loss(p, t):
        return jax.shard_map(
            lambda p, t: jax.lax.pmean(dense_loss(p, t), bs.AXES),
            mesh=MESH,
            in_specs=(P(), P(bs.AXES)),
            out_specs=P(),
        )(p, t)

    def grads(loss):
        return jax.jit(
            jax.value_and_grad(lambda f: loss(with_factors(params, f), tokens))
        )(lora_factors(params))

    # Known issue: under `jit(grad(...))` the shard_map rule leaks a tracer of the
    # body JAX re-traces while linearizing (`jit` without `grad` and `grad` without
    # `jit` do not), and JAX's leak report then walks the whole heap for minutes. The
    # numbers are right; the leak check is off for this one call until it is fixed.
    with jax.check_tracer_leaks(False):
        got = grads(qax.use_implicit_args(sharded_loss))
    close(got, grads(qax.use_implicit_args(dense_loss)))
    jaxpr = jax.make_jaxpr(qax.use_implicit_args(sharded_loss))(params, tokens)
    assert not forms_full_lora(jaxpr, CFG.d_model, CFG.d_ff, CFG.rank)


# ----------------------------------------------------------------------------------------
# Sharded checkpoints


def test_orbax_restores_sharded_implicit_params_onto_the_mesh(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    setup = setups("qlora", "megatron")["qax"]
    params = jax.device_put(setup.args[0], setup.in_shardings[0])
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "params", params)
        ckpt.wait_until_finished()
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            params,
            setup.in_shardings[0],
        )
        restored = ckpt.restore(tmp_path / "params", target)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    head = restored["head"]
    assert isinstance(head, LoraMatrix) and isinstance(head.w, bs.Int8Matrix)
    assert head.w.q.dtype == jnp.int8
    for got, want in zip(
        jax.tree.leaves(restored), jax.tree.leaves(params), strict=True
    ):
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(got, want)
    assert head.b.sharding.spec == P("model", None)
    assert head.w.scale.sharding == NamedSharding(MESH, P("model"))
