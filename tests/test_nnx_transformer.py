"""LoRA and QLoRA on a Gemma-style NNX transformer (`qax.examples.nnx_transformer`).

The whole flow on a model written without qax: `nnx.Einsum` kernels of rank 3 and 4
(a fused QKV kernel, or a query kernel and a grouped key/value kernel), a tied
embedding, a gated MLP, and layers stacked with `nnx.vmap` and run with `nnx.scan`.
The adapters are PEFT's and qwix's (``a_axes``: ``a`` runs along the axes the input
contracts with). The oracle is always the merged dense model (`qax.lora.merge`, which
also decodes a quantized base) run without qax.

Programs are compiled once per model structure (the jitted functions are module-level)
and models once per variant, so that the file stays quick.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
from tests.helpers import assert_close

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

nnx = pytest.importorskip("flax.nnx")
qnnx = pytest.importorskip("qax.nnx")
T = pytest.importorskip("qax.examples.nnx_transformer")

LoraWeight = qax.lora.LoraWeight
LORA = qnnx.holds(LoraWeight)

VARIANTS = {
    "gqa": T.TransformerConfig(num_heads=4, num_kv_heads=2),
    "fused": T.TransformerConfig(num_heads=4, num_kv_heads=4),
    "scan": T.TransformerConfig(num_heads=4, num_kv_heads=2, scan_layers=True),
}
FORMATS = {None: None, "nf4": qax.quant.NF4Weight, "int8": qax.quant.Int8Weight}
RANK, ALPHA = 2, 4.0
TOKENS = jax.random.randint(jax.random.key(0), (2, 9), 0, 64)

# PEFT-style adapters, one rule per kernel kind: `a` runs along the axes that the
# einsum contracts with the input, `b` along the others. The MLP kernels (in, out)
# and the output kernel (heads, head_dim, embed) get that from the default layout.
PEFT_RULES = [
    (r".*/q_einsum/kernel/value", {"a_axes": (1,)}),  # (N, D, H): a (D, r)
    (r".*/(kv|qkv)_einsum/kernel/value", {"a_axes": (2,)}),  # (2|3, K, D, H): a (D, r)
]


def _peft_rules(variant: str) -> list:
    """`PEFT_RULES` for the kernels a variant has (a rule that matches no weight is
    reported: the fused variant has no separate query kernel)."""
    if variant != "fused":  # GQA: a query kernel and a key/value kernel
        return PEFT_RULES
    return [rule for rule in PEFT_RULES if "/q_einsum/" not in rule[0]]


# The LoRA kernels of one block, by variant: every einsum and MLP kernel; never the
# (tied) embedding or a norm scale.
ATTN = {
    "gqa": ("q_einsum", "kv_einsum", "attn_vec_einsum"),
    "fused": ("qkv_einsum", "attn_vec_einsum"),
}
MLP = ("gate_proj", "up_proj", "down_proj")


def kernel_paths(variant: str) -> set[str]:
    attn = ATTN["fused" if variant == "fused" else "gqa"]
    names = [f"attn/{n}/kernel" for n in attn] + [f"mlp/{n}/kernel" for n in MLP]
    if variant == "scan":
        return {f"layers/{n}" for n in names}
    return {f"layers/{i}/{n}" for i in range(2) for n in names}


@functools.cache
def _plain_state(variant: str):
    config = VARIANTS[variant]
    if not config.scan_layers:
        return nnx.split(T.Transformer(config))
    # The stacked model with the weights of the unstacked one of the same sizes, its
    # layers stacked along a leading axis (`test_the_scanned_stack_runs_every_layer`
    # checks that both compute the same logits).
    assert dataclasses.replace(config, scan_layers=False) == VARIANTS["gqa"]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: T.Transformer(config)))
    pure = nnx.to_pure_dict(nnx.state(plain_model("gqa")))
    layers = [pure["layers"][i] for i in range(config.num_layers)]
    pure["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state


@functools.cache
def _lora_state(variant: str, fmt: str | None, layout: str):
    model = plain_model(variant)
    params = nnx.state(model, nnx.Param)
    stacked = int(VARIANTS[variant].scan_layers)
    if fmt is not None:
        options = {"block_size": 8} if fmt == "nf4" else {}
        quantize = functools.partial(
            qax.quant.quantize, fmt=fmt, batch_ndim=stacked, **options
        )
        params = jax.jit(quantize)(params)  # one program, not one per operation
    params = qax.lora.loraify(
        params,
        RANK,
        key=jax.random.key(1),
        alpha=ALPHA,
        batch_ndim=stacked,
        rules=_peft_rules(variant) if layout == "peft" else None,
    )
    # Non-zero `b`, so that the factors change the outputs and both get gradients
    # (numpy's generator: no programs to compile).
    adapters, base = qax.lora.split(params)
    rng = np.random.default_rng(2)

    def nonzero_b(adapter):
        if adapter is None:
            return None
        b = 0.3 * rng.standard_normal(adapter.b.shape, np.float32)
        return dataclasses.replace(adapter, b=jnp.asarray(b))

    adapters = jax.tree.map(
        nonzero_b, adapters, is_leaf=lambda x: isinstance(x, qax.lora.LoraAdapter)
    )
    nnx.update(model, qax.lora.combine(adapters, base))
    return nnx.split(model)


def _fresh(graphdef, state):
    # New Variables around the same (immutable) arrays: the cached state stays intact
    # when a test trains the model in place.
    return nnx.merge(graphdef, jax.tree.map(lambda x: x, state))


def plain_model(variant: str):
    """The model as initialised (the pretrained base)."""
    return _fresh(*_plain_state(variant))


def lora_model(variant: str, fmt: str | None, layout: str = "peft"):
    """The model with LoRA weights over an `fmt` base (float when None), ``b``
    non-zero. ``layout``: "peft" (`PEFT_RULES`) or "default" (`loraify`'s default)."""
    return _fresh(*_lora_state(variant, fmt, layout))


def lora_weights(model) -> dict[str, LoraWeight]:
    found, _ = qax.utils.tree_flatten_with_path_with_implicit(nnx.state(model, LORA))
    return {
        qax.utils.path_string(path).removesuffix("/value"): w
        for path, w in found
        if isinstance(w, LoraWeight)
    }


def merged(model):
    """The oracle: a plain NNX model with every `LoraWeight` merged (and decoded)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, qax.lora.merge(state))


def call(model, tokens):
    return model(tokens)


# One jitted function each, so that models of one structure share their programs.
implicit_logits = nnx.jit(qax.use_implicit_args(call))
dense_logits = nnx.jit(call)


def dense_loss(model, tokens=TOKENS) -> float:
    """`next_token_loss` of the merged dense model (from its logits, in float64)."""
    logits = np.asarray(dense_logits(merged(model), tokens[:, :-1]), np.float64)
    logp = logits - np.log(np.sum(np.exp(logits), -1, keepdims=True))
    return float(-np.mean(np.take_along_axis(logp, tokens[:, 1:, None], -1)))


def no_materialization():
    """Any densification of an implicit array (LoRA or quantized) raises."""
    return qax.materialization_policy(qax.ImplicitArray, "error")


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


# ----------------------------------------------------------------------------------------
# The model and its adapters


def test_the_scanned_stack_runs_every_layer():
    config = VARIANTS["scan"]
    # Created stacked, every block weight has a leading layer axis.
    abstract = nnx.state(nnx.eval_shape(lambda: T.Transformer(config)), nnx.Param)
    assert abstract["layers"]["attn"]["kv_einsum"]["kernel"].shape == (2, 2, 2, 32, 8)
    assert abstract["embedder"]["embedding"].shape == (64, 32)
    # With the weights of the unstacked model, it computes the same logits.
    assert_close(
        dense_logits(plain_model("scan"), TOKENS),
        dense_logits(plain_model("gqa"), TOKENS),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_adapters_are_peft_and_qwix_shaped(variant):
    config = VARIANTS[variant]
    D, N, K, H = (
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    F, r = config.hidden_dim, RANK
    # (contracted size, other size) of each kernel, as PEFT and qwix count them.
    sizes = {
        "q_einsum": (D, N * H),
        "kv_einsum": (D, 2 * K * H),
        "qkv_einsum": (D, 3 * N * H),
        "attn_vec_einsum": (N * H, D),
        "gate_proj": (D, F),
        "up_proj": (D, F),
        "down_proj": (F, D),
    }
    found = lora_weights(lora_model(variant, None))
    assert set(found) == kernel_paths(variant)
    layers = config.num_layers if variant == "scan" else 1
    for path, w in found.items():
        contracted, other = sizes[path.split("/")[-2]]
        stack = (layers,) if variant == "scan" else ()
        assert math.prod(w.a.shape) == layers * contracted * r, path
        assert math.prod(w.b.shape) == layers * r * other, path
        assert w.a.shape[: len(stack)] == stack and w.a.shape[-1] == r
        assert math.prod(w.a.shape[len(stack) : -1]) == contracted, path
    want = config.num_layers * sum(
        r * sum(sizes[n]) for n in ATTN["fused" if variant == "fused" else "gqa"] + MLP
    )
    assert qax.lora.trainable_count(nnx.state(lora_model(variant, None))) == want
    # The default layout puts every axis but the last into `a`: more numbers.
    default = qax.lora.trainable_count(nnx.state(lora_model(variant, None, "default")))
    assert default > want


# ----------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("fmt", list(FORMATS), ids=["lora", "nf4", "int8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_the_merged_dense_model(variant, fmt):
    model = lora_model(variant, fmt)
    found = lora_weights(model)
    assert set(found) == kernel_paths(variant)
    for w in found.values():
        assert isinstance(w.w, FORMATS[fmt] or jax.Array)
    assert isinstance(model.embedder.embedding.get_value(), jax.Array)

    want = dense_logits(merged(model), TOKENS)
    with no_materialization(), qax.materialization_audit() as audit:
        got = implicit_logits(model, TOKENS)
    assert not audit, audit
    assert_close(got, want, rtol=2e-5, atol=2e-5)
    if fmt is None:  # the factors matter: the base model computes something else
        base = dense_logits(plain_model(variant), TOKENS)
        assert np.abs(np.asarray(base - want)).max() > 1e-2


@pytest.mark.parametrize(
    "variant, fmt, layout",
    # (fused, LoRA) runs eagerly in `test_lora_training_with_the_qax_optimizer`.
    [("fused", "nf4", "peft"), ("scan", "int8", "default")],
)
def test_eager_forward_matches_the_merged_dense_model(variant, fmt, layout):
    model = lora_model(variant, fmt, layout)
    with no_materialization():
        got = qax.use_implicit_args(call)(model, TOKENS)
    assert_close(got, dense_logits(merged(model), TOKENS), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("layout", ["peft", "default"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_dense_kernel_is_never_formed(variant, layout):
    model = lora_model(variant, None, layout)
    shapes = {
        tuple(w.shape[1:] if variant == "scan" else w.shape)  # one layer's kernel
        for w in lora_weights(model).values()
    }
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(
        qax.use_implicit_args(lambda s, t: nnx.merge(graphdef, s)(t))
    )(state, TOKENS)
    # W + s·a⊗b would be an `add` (and a⊗b a `dot_general`) of a kernel's shape.
    formed = [
        eqn
        for eqn in _eqns(jaxpr.jaxpr)
        if eqn.primitive.name in ("add", "dot_general")
        and any(tuple(v.aval.shape) in shapes for v in eqn.outvars)
    ]
    assert not formed, formed


# ----------------------------------------------------------------------------------------
# LoRA: training the factors with qax.nnx.Optimizer


def _snapshot(model):
    flat = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


def _changed(before, model):
    after = _snapshot(model)
    assert set(after) == set(before)
    return {p for p, x in after.items() if not np.array_equal(x, before[p])}


def _factor_paths(snapshot):
    return {p for p in snapshot if p.endswith((".value.a", ".value.b"))}


def _lora_loss(model, tokens):
    return qax.use_implicit_args(T.next_token_loss)(model, tokens)


def _optimizer_step(model, opt, tokens):
    grad_fn = nnx.value_and_grad(_lora_loss, argnums=nnx.DiffState(0, LORA))
    loss, grads = grad_fn(model, tokens)
    opt.update(model, grads)
    return loss


_jitted_optimizer_step = nnx.jit(_optimizer_step)


@pytest.mark.parametrize("variant, mode", [("fused", "eager"), ("scan", "nnx.jit")])
def test_lora_training_with_the_qax_optimizer(variant, mode):
    model = lora_model(variant, None)
    before = _snapshot(model)
    tx = qax.freeze_keys(optax.adam(1e-2), LoraWeight, ["w"])
    opt = qnnx.Optimizer(model, tx, wrt=LORA)
    step = _optimizer_step if mode == "eager" else _jitted_optimizer_step
    steps = 1 if mode == "eager" else 3  # eager: every operation runs on its own
    losses = []
    for _ in range(steps):
        want = dense_loss(model)  # the merged dense model's loss before the step
        with no_materialization():
            losses.append(float(step(model, opt, TOKENS)))
        np.testing.assert_allclose(losses[-1], want, rtol=1e-5)
    assert dense_loss(model) < losses[0], losses  # after the last step
    assert int(opt.step[...]) == steps
    # Only the factors moved, both of every LoRA weight; the base kernels, the
    # embedding and the norm scales are bitwise unchanged.
    assert _changed(before, model) == _factor_paths(before)
    assert len(_factor_paths(before)) == 2 * len(kernel_paths(variant))

    with no_materialization():
        got = implicit_logits(model, TOKENS)
    assert_close(got, dense_logits(merged(model), TOKENS), rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------
# QLoRA: the documented NNX recipe (`nnx.split(model, holds(LoraWeight), ...)`, then
# `qax.lora.split`): only the factors are differentiated, the codes never are


def _qlora_loss(graphdef, adapters, base, rest, tokens):
    model = nnx.merge(graphdef, qax.lora.combine(adapters, base), rest)
    return _lora_loss(model, tokens)


def _dense_qlora_loss(graphdef, adapters, base, rest, tokens):
    """The oracle: the merged dense model (base decoded, factors merged), no qax."""
    dense = qax.lora.merge(qax.lora.combine(adapters, base))
    return T.next_token_loss(nnx.merge(graphdef, dense, rest), tokens)


def test_qlora_split_recipe_under_jax_jit_matches_the_dense_gradients():
    model = lora_model("fused", "int8")
    before = _snapshot(model)
    graphdef, lora_state, rest = nnx.split(model, LORA, ...)
    adapters, base = qax.lora.split(lora_state)
    tx = optax.adam(1e-2)

    @jax.jit
    def step(adapters, opt_state, base, rest, tokens):
        loss = functools.partial(_qlora_loss, graphdef)
        value, grads = jax.value_and_grad(loss)(adapters, base, rest, tokens)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, value, grads

    opt_state = tx.init(adapters)
    oracle = jax.jit(jax.value_and_grad(functools.partial(_dense_qlora_loss, graphdef)))
    losses = []
    for i in range(3):
        with no_materialization():
            new, opt_state, value, grads = step(adapters, opt_state, base, rest, TOKENS)
        if i == 0:
            want, want_grads = oracle(adapters, base, rest, TOKENS)
            assert_close(value, want, rtol=1e-5, atol=1e-6)
            assert_close(grads, want_grads, rtol=1e-4, atol=1e-6)
            # Only the factors are differentiated: a and b of each LoRA weight.
            leaves = jax.tree.leaves(grads)
            assert len(leaves) == 2 * len(kernel_paths("fused"))
        adapters = new
        losses.append(float(value))
    assert losses[-1] < losses[0], losses

    nnx.update(model, qax.lora.combine(adapters, base))
    assert _changed(before, model) == _factor_paths(before)  # codes bitwise unchanged
    with no_materialization():
        got = implicit_logits(model, TOKENS)
    assert_close(got, dense_logits(merged(model), TOKENS), rtol=2e-5, atol=2e-5)


QLORA_TX = optax.adam(1e-2)


def _in_place_step(model, opt_state, tokens):
    tx = QLORA_TX
    graphdef, lora_state, rest = nnx.split(model, LORA, ...)
    adapters, base = qax.lora.split(lora_state)
    loss = functools.partial(_qlora_loss, graphdef)
    value, grads = jax.value_and_grad(loss)(adapters, base, rest, tokens)
    updates, opt_state = tx.update(grads, opt_state, adapters)
    nnx.update(model, qax.lora.combine(optax.apply_updates(adapters, updates), base))
    return value, opt_state


_jitted_in_place_step = nnx.jit(_in_place_step)


def test_qlora_trains_in_place_under_nnx_jit():
    variant, fmt = "scan", "nf4"
    model = lora_model(variant, fmt)
    before = _snapshot(model)
    opt_state = QLORA_TX.init(qax.lora.split(nnx.state(model, LORA))[0])
    losses = []
    for _ in range(3):
        want = dense_loss(model)
        with no_materialization():
            value, opt_state = _jitted_in_place_step(model, opt_state, TOKENS)
        np.testing.assert_allclose(float(value), want, rtol=1e-5)
        losses.append(float(value))
    assert losses[-1] < losses[0], losses
    for w in lora_weights(model).values():
        assert isinstance(w.w, FORMATS[fmt])
    # The factors moved; the codes and scales of the base, the embedding and the
    # norm scales are bitwise unchanged.
    assert _changed(before, model) == _factor_paths(before)

    # Merged for serving: a plain model that computes the same logits.
    serving = merged(model)
    kernels = nnx.state(serving, nnx.Param)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(kernels))
    with no_materialization():
        got = implicit_logits(model, TOKENS)
    assert_close(dense_logits(serving, TOKENS), got, rtol=2e-5, atol=2e-5)
