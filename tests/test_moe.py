"""LoRA and quantized weights on mixture-of-experts layers (issue 38).

Stacked expert weights ``(experts, d_in, d_out)`` through `jax.lax.ragged_dot` (tokens
sorted by expert), through the einsum of a capacity-bucketed dispatch and through
`jax.vmap` over the experts: a `LoraWeight` with one pair of factors per expert and the
`qax.quant` formats with codes and scales per expert stay implicit (no fallback, under
``materialization_policy(..., "error")``; no ``w + s·a b`` nor a gradient of the frozen
experts in the jaxpr). The oracle is the same product on the merged dense experts,
written here. Then the Mixtral-style block of `qax.examples.moe`, unchanged: LoRA and
QLoRA (int8, nf4) against the merged dense block under `jit`, `grad` and `lax.scan`
over stacked layers, in both dispatch forms; and on a 2x4 mesh with the expert axis
sharded (`_moe_sharded_cases.py`, in a child process with 8 simulated devices).
"""

import dataclasses
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import qax
from qax.examples.moe import MoEConfig, init_moe, moe_block, moe_layers
from tests.helpers import all_eqns, run_on_eight_devices

HERE = pathlib.Path(__file__).resolve().parent
E, D, F, R, M = 3, 16, 32, 2, 9  # experts, d_in, d_out, rank, token copies
GROUPS = jnp.array([4, 0, 5], jnp.int32)  # expert 1 gets no token
FORMATS = {
    "int8": {},
    "fp8_e4m3": {},
    "nf4": {"block_size": 8},
    "int4": {"group_size": 8},
    "int3": {"group_size": 8},
}
LoraWeight = qax.lora.LoraWeight


def _rand(seed, shape, scale=1.0):
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape))


def _requantized(w, fmt):
    return qax.quant.quantize(
        {"w": w}, fmt, filter=lambda *_: True, batch_ndim=1, **FORMATS[fmt]
    )["w"]


def _base(kind, shape):
    w = _rand(0, shape, 0.3)
    return w if kind == "dense" else _requantized(w, kind)


def _dense(w):
    return w.dequantize() if isinstance(w, qax.quant.QuantizedWeight) else w


def _expert_shaped(jaxpr, shapes, primitives=None):
    """Equations that compute a float32 value of an expert stack's shape (``primitives``:
    only those), beside `stop_gradient` of the frozen experts."""
    return [
        e.primitive.name
        for e in all_eqns(jaxpr)
        if e.primitive.name != "stop_gradient"
        and (primitives is None or e.primitive.name in primitives)
        for v in e.outvars
        if tuple(v.aval.shape) in shapes and v.aval.dtype == jnp.float32
    ]


# ----------------------------------------------------------------------------------------
# The handlers: one grouped product


def _ragged(x, w, group_sizes, transposed):
    if not transposed:
        return lax.ragged_dot(x, w, group_sizes)
    # x @ W.T per expert: w (experts, d_out, d_in), contracted on its last axis.
    rdn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())),
        lhs_ragged_dimensions=(0,),
        rhs_group_dimensions=(0,),
    )
    return lax.ragged_dot_general(x, w, group_sizes, rdn)


@pytest.mark.parametrize("transposed", [False, True], ids=["x@w", "x@w.T"])
@pytest.mark.parametrize("kind", ["dense", "int8", "nf4"])
def test_ragged_dot_lora_is_the_grouped_product_of_base_and_factors(kind, transposed):
    shape = (E, F, D) if transposed else (E, D, F)
    w = _base(kind, shape)
    a = _rand(1, (E, shape[1], R))
    b = _rand(2, (E, R, shape[2]))
    x = _rand(3, (M, D))

    def implicit(ab, x):
        lora = LoraWeight(w, *ab, alpha=4.0)
        out = qax.use_implicit_args(_ragged)(x, lora, GROUPS, transposed)
        return jnp.sum(jnp.sin(out))

    def dense(ab, x):
        merged = _dense(w) + 2.0 * jnp.einsum("eir,erj->eij", *ab)
        return jnp.sum(jnp.sin(_ragged(x, merged, GROUPS, transposed)))

    with qax.materialization_policy(qax.ImplicitBase, "error"):
        step = jax.jit(jax.value_and_grad(implicit))
        (value, grads), (want, want_grads) = (
            step((a, b), x),
            jax.jit(jax.value_and_grad(dense))((a, b), x),
        )
        jaxpr = jax.make_jaxpr(jax.grad(implicit))((a, b), x)
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # Each expert's factors learn from its own tokens only: expert 1 has none, and
    # changing expert 0's tokens leaves experts 1 and 2's gradients as they were.
    assert not np.any(grads[0][1]) and not np.any(grads[1][1])
    x2 = x.at[: int(GROUPS[0])].set(_rand(4, (int(GROUPS[0]), D)))
    grads2 = step((a, b), x2)[1]
    for g, g2 in zip(grads, grads2, strict=True):
        np.testing.assert_array_equal(g[1:], g2[1:])
        assert not np.allclose(g[0], g2[0])
    # No merged experts (w + s·a b), no gradient for the frozen experts; over int8,
    # no float copy of the experts at all.
    banned = None if kind in ("dense", "int8") else ("add", "dot_general")
    assert not _expert_shaped(jaxpr, {shape}, banned)
    assert not _expert_shaped(jaxpr, {shape}, ("ragged_dot_general",))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_ragged_dot_of_quantized_experts(fmt):
    w = _requantized(_rand(0, (E, D, F), 0.3), fmt)
    x = _rand(3, (M, D))
    f = qax.use_implicit_args(lambda x, w: lax.ragged_dot(x, w, GROUPS))
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        got = jax.jit(f)(x, w)
        jaxpr = jax.make_jaxpr(f)(x, w)
    np.testing.assert_allclose(
        got, lax.ragged_dot(x, w.dequantize(), GROUPS), rtol=1e-5, atol=1e-5
    )
    if fmt in ("int8", "fp8_e4m3"):  # per channel: the product runs on the codes
        assert not _expert_shaped(jaxpr, {(E, D, F)})


@pytest.mark.parametrize("kind", ["dense", "int8", "nf4"])
def test_einsum_dispatch_and_vmap_over_experts(kind):
    w = _base(kind, (E, D, F))
    lora = LoraWeight(w, _rand(1, (E, D, R)), _rand(2, (E, R, F)), alpha=4.0)
    merged = _dense(w) + 2.0 * jnp.einsum("edr,erf->edf", lora.a, lora.b)
    buckets = _rand(3, (E, 5, D))  # (experts, capacity, d)
    forms = {
        "einsum": lambda x, w: jnp.einsum("ecd,edf->ecf", x, w),
        "vmap": lambda x, w: jax.vmap(lambda xe, we: xe @ we)(x, w),
        "vmap_out_axis": lambda x, w: jax.vmap(lambda xe, we: xe @ we, out_axes=1)(
            x, w
        ),
    }
    for name, form in forms.items():
        with qax.materialization_policy(qax.ImplicitBase, "error"):
            got = qax.use_implicit_args(form)(buckets, lora)
            jaxpr = jax.make_jaxpr(qax.use_implicit_args(form))(buckets, lora)
        np.testing.assert_allclose(
            got, form(buckets, merged), rtol=1e-5, atol=1e-5, err_msg=name
        )
        banned = None if kind == "dense" else ("add", "dot_general")
        assert not _expert_shaped(jaxpr, {(E, D, F)}, banned), name


def test_unstacked_lora_in_ragged_dot_is_refused_by_the_policy():
    # One LoraWeight spanning the whole stack (no expert batch axis) has no grouped
    # product of its own: it is materialized, which the policy turns into an error.
    w = _rand(0, (E, D, F))
    lora = LoraWeight(w, _rand(1, (E, D, R)), jnp.zeros((R, F)))
    f = qax.use_implicit_args(lambda x, w: lax.ragged_dot(x, w, GROUPS))
    with qax.materialization_policy(qax.ImplicitBase, "error"):
        with pytest.raises(qax.MaterializationError, match="ragged_dot_general"):
            f(_rand(3, (M, D)), lora)


# ----------------------------------------------------------------------------------------
# The Mixtral-style block of `qax.examples.moe`, unchanged

CFG = MoEConfig(d_model=16, d_ff=32, n_experts=4, top_k=2, n_layers=2)
EXPERT_SHAPES = {(4, 16, 32), (4, 32, 16), (2, 4, 16, 32), (2, 4, 32, 16)}


def _model(kind):
    # By path and shape: the experts get one more batch axis than the layers'
    # (factors, codes and scales per layer and expert); the router stays dense.
    params = init_moe(jax.random.PRNGKey(0), CFG)
    lora = qax.lora.loraify(params, R, key=jax.random.PRNGKey(1), batch_ndim=1)
    adapters, base = qax.lora.split(lora)
    # Non-zero b, so that the gradients of a are not zero.
    adapters = jax.tree.map(
        lambda ad: dataclasses.replace(ad, b=0.3 * _rand(5, ad.b.shape)),
        adapters,
        is_leaf=lambda v: isinstance(v, qax.lora.LoraAdapter),
    )
    if kind != "lora":
        opts = {"block_size": 16} if kind == "nf4" else {}
        base = qax.quant.quantize(base, kind, batch_ndim=1, **opts)
    return adapters, base


def _merged(adapters, dense):
    """The dense parameters: ``w + (alpha / r)·a b`` per layer and expert (``dense``:
    the base, dequantized)."""

    def one(ad, w):
        if ad is None:
            return w
        scale = 1.0 if ad.alpha is None else ad.alpha / ad.a.shape[-1]
        return w + scale * jnp.einsum("...ir,...rj->...ij", ad.a, ad.b)

    is_ad = lambda v: v is None or isinstance(v, qax.lora.LoraAdapter)  # noqa: E731
    return jax.tree.map(one, adapters, dense, is_leaf=is_ad)


X = _rand(7, (2, 6, CFG.d_model))


def _loss(params, x, dispatch):
    return jnp.mean(jnp.square(moe_layers(params, x, CFG, dispatch=dispatch) - 1.0))


@jax.jit
def _dense_step(adapters, dense, x):
    """The oracle: loss and factor gradients of the merged dense block, both forms
    (one compile, shared by every base: the dense base is an argument)."""

    def loss(adapters, dispatch):
        return _loss(_merged(adapters, dense), x, dispatch)

    return {d: jax.value_and_grad(loss)(adapters, d) for d in ("ragged", "einsum")}


@pytest.mark.parametrize(
    ("kind", "dispatch"),
    [
        ("lora", "ragged"),
        ("int8", "ragged"),
        ("nf4", "ragged"),
        ("lora", "einsum"),  # (a quantized base there: the einsum test above)
    ],
)
def test_moe_block_lora_and_qlora_match_the_merged_dense_block(kind, dispatch):
    adapters, base = _model(kind)

    def implicit(adapters, base, x):
        params = qax.lora.combine(adapters, base)
        return qax.use_implicit_args(_loss)(params, x, dispatch)

    with qax.materialization_policy(qax.ImplicitBase, "error"):
        jaxpr, shapes = jax.make_jaxpr(jax.value_and_grad(implicit), return_shape=True)(
            adapters, base, X
        )
    # The traced step, compiled as it is (one trace of the wrapper, not two).
    flat = jax.jit(jax.extend.core.jaxpr_as_fun(jaxpr))(
        *jax.tree.leaves((adapters, base, X))
    )
    value, grads = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    want, want_grads = _dense_step(adapters, qax.quant.dequantize(base), X)[dispatch]
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for got, expected in zip(
        jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert any(np.any(g) for g in jax.tree.leaves(grads))
    # No merged experts, no gradient for the frozen experts; over a dense or int8
    # base no float value of an expert stack's shape at all (no decoded experts, and
    # the scan's forward pass keeps no copy of the frozen experts for the backward
    # pass: it reads the scanned weights). nf4 decodes inside the product; the
    # einsum form's `dot_general` (qax/lora/_weight.py) still keeps the frozen
    # experts behind a stop_gradient, one copy per layer.
    banned = None
    if kind == "nf4" or dispatch == "einsum":
        banned = {"add", "dot_general", "ragged_dot_general"}
    assert not _expert_shaped(jaxpr, EXPERT_SHAPES, banned)
    names = {e.primitive.name for e in all_eqns(jaxpr)}
    assert "scan" in names
    if dispatch == "ragged":
        assert "ragged_dot_general" in names


def test_the_two_dispatch_forms_agree_and_capacity_drops():
    params = init_moe(jax.random.PRNGKey(0), CFG)
    layer = jax.tree.map(lambda v: v[0], params["layers"])
    x = X.reshape(-1, CFG.d_model)
    ragged = moe_block(layer, x, CFG)
    np.testing.assert_allclose(
        moe_block(layer, x, CFG, dispatch="einsum"), ragged, rtol=1e-5, atol=1e-6
    )
    # A capacity of one copy per expert: most tokens lose at least one expert.
    dropped = moe_block(layer, x, CFG, dispatch="einsum", capacity=1)
    assert not np.allclose(dropped, ragged)
    with pytest.raises(ValueError, match="dispatch='dense'"):
        moe_block(layer, x, CFG, dispatch="dense")


def test_quantized_experts_bytes_as_stored():
    cfg = MoEConfig(d_model=64, d_ff=128, n_experts=4, n_layers=1)
    params = init_moe(jax.random.PRNGKey(0), cfg)
    experts = params["layers"]["experts"]
    f32 = sum(w.nbytes for w in jax.tree.leaves(experts))
    for fmt, bound in (("nf4", 0.15), ("int8", 0.27)):
        opts = {"block_size": 64} if fmt == "nf4" else {}
        q = qax.quant.quantize(experts, fmt, batch_ndim=2, **opts)
        leaves = jax.tree.leaves(q, is_leaf=lambda v: isinstance(v, qax.ImplicitArray))
        assert all(isinstance(v, qax.quant.QuantizedWeight) for v in leaves)
        assert all(v.weight_ndim == 2 for v in leaves)  # codes and scales per expert
        stored = sum(v.nbytes for v in leaves)
        assert stored <= bound * f32, (fmt, stored / f32)


# ----------------------------------------------------------------------------------------
# Expert parallelism: the expert axis sharded over a 2x4 mesh


def test_expert_parallel_training_on_eight_devices():
    run_on_eight_devices(str(HERE / "_moe_sharded_cases.py"))


# ----------------------------------------------------------------------------------------
# Finding the experts and the router by path and shape


@pytest.mark.parametrize("scanned", [True, False], ids=["layers", "one_layer"])
def test_loraify_and_quantize_find_experts_and_keep_the_router_dense(scanned):
    params = init_moe(jax.random.PRNGKey(0), CFG)
    nb = 1 if scanned else 0
    if not scanned:
        params = jax.tree.map(lambda v: v[0], params)
    # Per-path rules choose the rank and the format per expert weight.
    lora = qax.lora.loraify(
        params, R, key=jax.random.PRNGKey(1), batch_ndim=nb,
        rules=[(".*/w_down", {"rank": 4})],
    )  # fmt: skip
    qlora = qax.quant.quantize(
        lora, "nf4", block_size=16, rules=[(".*/w_down", {"format": "int8"})]
    )
    layer = qlora["layers"]
    assert not isinstance(layer["router"]["kernel"], qax.ImplicitArray)
    assert not isinstance(layer["norm"]["scale"], qax.ImplicitArray)
    for name, rank, fmt in (
        ("w_gate", R, qax.quant.NF4Weight),
        ("w_up", R, qax.quant.NF4Weight),
        ("w_down", 4, qax.quant.Int8Weight),
    ):
        w = layer["experts"][name]
        assert isinstance(w, LoraWeight) and w.rank == rank
        assert w.a.ndim - w.a_ndim == nb + 1  # (layers,) experts
        assert isinstance(w.w, fmt) and w.w.weight_ndim == 2
    plain = qax.quant.quantize(params, "int8", batch_ndim=nb)
    assert plain["layers"]["experts"]["w_up"].weight_ndim == 2
    assert not isinstance(plain["layers"]["router"]["kernel"], qax.ImplicitArray)


@pytest.mark.parametrize(
    ("path", "router"),
    [
        ("model/layers_0/block_sparse_moe/gate/kernel", True),  # Mixtral
        ("MoeBlock_0/gate/kernel", True),
        ("moe/router/w", True),
        ("mlp/gate/kernel", False),  # a gated MLP's projection, not a router
        ("mlp/gate_proj/kernel", False),
    ],
)
def test_router_by_path(path, router):
    leaf = jnp.ones((8, 4))
    assert qax.lora.default_filter(path, leaf) is not router


# ----------------------------------------------------------------------------------------
# Adapter banks: one expert adapter per example


def test_per_example_expert_adapters_match_the_per_adapter_loop():
    # The einsum dispatch under `per_example` (its `vmap` over examples keeps the nf4
    # experts shared). The ragged form cannot be vmapped with shared experts: JAX's
    # batching rule of ragged_dot needs the weight batched too.
    adapters = [_model("lora")[0]]
    adapters.append(jax.tree.map(lambda v: -0.5 * v, adapters[0]))
    base = _model("nf4")[1]
    served = qax.lora.bank(base, adapters)
    ids = jnp.array([1, -1, 0])
    x = _rand(8, (3, 5, CFG.d_model))

    def f(params, x):
        return moe_layers(params, x, CFG, dispatch="einsum")

    with qax.materialization_policy(qax.ImplicitBase, "error"):
        got = jax.jit(qax.lora.per_example(f))(ids, served, x)
        one = jax.jit(qax.use_implicit_args(f))
        for i, k in enumerate(np.asarray(ids)):
            params = base if k < 0 else qax.lora.combine(adapters[k], base)
            np.testing.assert_allclose(
                got[i : i + 1], one(params, x[i : i + 1]), rtol=1e-5, atol=1e-5
            )
    assert not np.allclose(got[0], got[2])  # the two adapters differ


@pytest.mark.parametrize("fmt", [None, "nf4"], ids=["lora", "qlora-nf4"])
def test_experts_built_and_called_by_nnx_vmap(fmt):
    """Experts as Flax NNX builds them (`nnx.vmap` of an `nnx.Linear`: one stacked
    kernel) and calls them (`nnx.vmap` over experts and their token buckets): LoRA
    and QLoRA stay implicit, outputs and factor gradients as the merged dense experts'."""
    nnx = pytest.importorskip("flax.nnx")

    @nnx.split_rngs(splits=E)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return nnx.Linear(D, F, rngs=rngs)

    graphdef, state = nnx.split(create(nnx.Rngs(0)))

    @nnx.vmap(in_axes=(0, 0), out_axes=0)
    def apply(expert, xe):
        return expert(xe)

    def loss(state, x):
        return jnp.sum(jnp.tanh(apply(nnx.merge(graphdef, state), x)) ** 2)

    base = state
    if fmt is not None:
        base = qax.quant.quantize(state, fmt, batch_ndim=1, block_size=8)
    params = qax.lora.loraify(base, R, key=jax.random.key(1), batch_ndim=1, alpha=4.0)
    params = jax.tree_util.tree_map(
        lambda x: (
            dataclasses.replace(x, b=x.b + 0.3) if isinstance(x, LoraWeight) else x
        ),
        params,
        is_leaf=lambda x: isinstance(x, LoraWeight),
    )
    adapters, frozen = qax.lora.split(params)
    x = _rand(3, (E, 5, D))

    def implicit(adapters):
        return qax.use_implicit_args(loss)(qax.lora.combine(adapters, frozen), x)

    def dense(adapters):
        return loss(qax.lora.merge(qax.lora.combine(adapters, frozen)), x)

    with qax.materialization_policy(qax.ImplicitBase, "error"):
        value, grads = jax.jit(jax.value_and_grad(implicit))(adapters)
    want, want_grads = jax.value_and_grad(dense)(adapters)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for g, w in zip(
        jax.tree_util.tree_leaves(grads),
        jax.tree_util.tree_leaves(want_grads),
        strict=True,
    ):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
