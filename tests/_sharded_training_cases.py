"""LoRA / QLoRA training sharded over a 2x4 mesh, run by `test_sharding.py` on 8 devices.

The model is the GPT-style one of `benchmarks/bench_lora.py` (small sizes here), with
the built-in types: every matmul weight a `qax.lora.LoraWeight`, over a
`qax.quant.Int8Weight` for QLoRA, trained with `qax.lora.split` / `combine`. The
sharded setup (the dense specs, the mesh, the collectives count) is that of
`benchmarks/bench_sharded.py`. The oracle is the same step on one device, and a
hand-written LoRA step with the same leaves and shardings.

Run directly with `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest
tests/_sharded_training_cases.py`; without 8 devices every case is skipped.
"""

import functools
import gc
import pathlib
import sys
from collections.abc import Callable

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

CFG = Config(
    n_layers=1, d_model=32, n_heads=4, d_ff=64, vocab=64, seq=8, batch=8, rank=4
)
MESH = bs.make_mesh()
LoraWeight, Int8Weight = qax.lora.LoraWeight, qax.quant.Int8Weight
# Each kind once per layout would be 4 sharded compiles per variant; the two
# diagonal cases cover both kinds and both layouts (the benchmark runs all four).
CASES = [("lora", "fsdp"), ("qlora", "megatron")]
# Shapes of the weight matrices: no float array of these shapes may be computed.
WEIGHT_SHAPES = {(32, 32), (32, 64), (64, 32)}


def close(got, want):
    # Reductions split over devices sum in another order; adam's first step divides
    # the gradient by its own magnitude, which magnifies that where it is tiny.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------
# Parameters: built-in implicit types, and the same leaves as plain dicts


_quantize = jax.jit(Int8Weight.from_array)  # one compile per shape, not per op


def implicit_params(kind: str, seed: int = 0) -> tuple[dict, dict]:
    """The dense parameters (of `init_params`' structure; numpy's generator is
    cheaper here than compiling JAX's), and the same with every matmul weight a
    `LoraWeight` (over an `Int8Weight` for ``qlora``); ``b`` is random so that the
    factors' gradients are not trivially zero."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.PRNGKey(0), False))

    def init(path, x):
        name = getattr(path[-1], "key", None)
        if name == "scale":  # layer norms
            return jnp.ones(x.shape, x.dtype)
        if name in ("bias", "b1", "b2"):
            return jnp.zeros(x.shape, x.dtype)
        return jnp.asarray(0.02 * rng.standard_normal(x.shape), x.dtype)

    def convert(path, w):
        if getattr(path[-1], "key", None) not in MATMUL_WEIGHTS:
            return w
        a = jnp.asarray(0.02 * rng.standard_normal((w.shape[0], CFG.rank)), w.dtype)
        b = jnp.asarray(0.02 * rng.standard_normal((CFG.rank, w.shape[1])), w.dtype)
        return LoraWeight(_quantize(w) if kind == "qlora" else w, a, b)

    dense = jax.tree_util.tree_map_with_path(init, shapes)
    return dense, jax.tree_util.tree_map_with_path(convert, dense)


def _implicit(x) -> bool:
    return isinstance(x, qax.ImplicitBase)


def to_hand(tree):
    """The same leaves in plain dicts: ``{"w", "a", "b"}``, int8 as ``{"q", "scale"}``.

    Works on parameters and on trees of shardings shaped like them."""

    def convert(x):
        if isinstance(x, LoraWeight):
            return {"w": convert(x.w), "a": x.a, "b": x.b}
        if isinstance(x, Int8Weight):
            return {"q": x.q, "scale": x.scale}
        return x

    return jax.tree_util.tree_map(convert, tree, is_leaf=_implicit)


def hand_linear(x, p):
    """Hand-written (Q)LoRA as the built-in handlers compute it: the int8 weight
    decoded inside the product, then ``x @ w + (x @ a) @ b``."""
    w = p["w"]
    if isinstance(w, dict):
        w = w["q"].astype(x.dtype) * w["scale"]
    return x @ w + (x @ p["a"]) @ p["b"]


def _is_hand_lora(x) -> bool:
    return isinstance(x, dict) and set(x) == {"w", "a", "b"}


def hand_split(params):
    """`qax.lora.split` for the hand-written dicts."""
    adapters = jax.tree_util.tree_map(
        lambda x: {"a": x["a"], "b": x["b"]} if _is_hand_lora(x) else None,
        params,
        is_leaf=_is_hand_lora,
    )
    return adapters, params


def hand_combine(adapters, params):
    return jax.tree_util.tree_map(
        lambda ad, x: x if ad is None else {"w": x["w"], **ad},
        adapters,
        params,
        is_leaf=lambda x: x is None or (isinstance(x, dict) and set(x) == {"a", "b"}),
    )


QAX = (qax.lora.split, qax.lora.combine)
HAND = (hand_split, hand_combine)


def make_step(loss: Callable, split: Callable, combine: Callable) -> Callable:
    """(params, opt_state, tokens) -> (params, opt_state, loss); only the factors move."""

    def step(params, opt_state, tokens):
        adapters, base = split(params)
        value, grads = jax.value_and_grad(lambda ad: loss(combine(ad, base), tokens))(
            adapters
        )
        updates, opt_state = bs.OPTIMIZER.update(grads, opt_state, adapters)
        return combine(optax.apply_updates(adapters, updates), base), opt_state, value

    return step


# ----------------------------------------------------------------------------------------
# Setups


# One variant's step, arguments and shardings: the benchmark's own record.
Setup = bs.Setup


TOKENS = jax.random.randint(
    jax.random.PRNGKey(1), (CFG.batch, CFG.seq + 1), 0, CFG.vocab
)
DENSE_LOSS = model_loss(CFG, dense_linear, scan=False)


@functools.cache
def params(kind: str) -> tuple[dict, dict]:
    return implicit_params(kind)


@functools.cache
def setups(kind: str, layout: str) -> dict:
    """``{"qax": Setup, "hand": Setup}`` for one kind and layout, same leaves/shardings."""
    dense, implicit = params(kind)
    specs, token_spec = bs.dense_specs(dense, layout)
    shardings = qax.sharding.implicit_shardings(implicit, specs, MESH)
    replicated = NamedSharding(MESH, P())
    token_sharding = NamedSharding(MESH, token_spec)
    out = {}
    for name, tree, sh, loss, (split, combine) in (
        ("qax", implicit, shardings, qax.use_implicit_args(DENSE_LOSS), QAX),
        ("hand", to_hand(implicit), to_hand(shardings), _hand_loss(), HAND),
    ):
        opt_state = bs.OPTIMIZER.init(split(tree)[0])
        opt_sh = optax.tree_map_params(
            bs.OPTIMIZER,
            lambda _p, s: s,
            opt_state,
            split(sh)[0],
            transform_non_params=lambda _: replicated,
        )
        out[name] = Setup(
            make_step(loss, split, combine),
            (tree, opt_state, TOKENS),
            (sh, opt_sh, token_sharding),
            (sh, opt_sh, replicated),
        )
    return out


@functools.cache
def _hand_loss():
    return model_loss(CFG, hand_linear, scan=False)


@functools.cache
def single_device(kind: str):
    setup = setups(kind, "fsdp")["qax"]
    return jax.jit(setup.step)(*setup.args)


def _frozen_leaves(tree):
    """The base-weight leaves (`w`, int8 `q`/`scale`) of every LoRA, by path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        fields = {getattr(k, "name", None) for k in path}  # attributes, not dict keys
        if fields & {"w", "q", "scale"}:
            out[jax.tree_util.keystr(path)] = leaf
    return out


def _factors(tree):
    return qax.lora.split(tree)[0]


# ----------------------------------------------------------------------------------------
# Placement


def test_device_put_places_each_leaf_as_its_type_declares():
    dense, implicit = params("qlora")
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
    assert (shard(w1.a), shard(w1.b)) == ((32, 4), (4, 16))
    # row-parallel w2 [64, 32]: rows over "model"; a [64, r] split, b and scales whole
    assert (shard(w2.a), shard(w2.b), shard(w2.w.scale)) == ((16, 4), (4, 32), (1, 32))
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
        2 if kind == "qlora" else 1
    )
    for path, leaf in after.items():
        assert leaf.sharding == before[path].sharding, path
        np.testing.assert_array_equal(leaf, before[path])
    got = [x.sharding for x in jax.tree.leaves(new)]
    assert got == jax.tree.leaves(both["qax"].out_shardings[0])
    # hand-written LoRA with the same leaves and shardings: same numbers, no fewer bytes
    close(outs["hand"][1], (to_hand(new), opt_state, loss))
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
    kind = "qlora"
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
    setup = setups("qlora", "megatron")["qax"]
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
