"""`qax.lora.DoraWeight`: DoRA whose products never form ``W + sAB``.

The oracle is a dense reference with PEFT's semantics: ``V = w + s·a⊗b``, its norm per
output unit over the input axes (a constant for gradients), the weight
``m · V / ‖V‖``. Implicitness: the "error" policy, and the jaxpr of a train step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax

K = jax.random.split(jax.random.key(0), 8)
S = 2.0  # alpha / rank: alpha 6, rank 3


def reference(w, a, b, m, a_axes):
    """PEFT's DoRA weight, formed densely."""
    lora = qax.lora.LoraWeight(w, a, b, alpha=S * a.shape[-1], a_axes=a_axes)
    v = qax.materialize_nested(lora, full=True)
    in_axes, out_axes = lora.axes()
    norm = jnp.sqrt(jnp.sum(v * v, axis=in_axes, keepdims=True))
    m = jnp.reshape(m, [v.shape[i] if i in out_axes else 1 for i in range(v.ndim)])
    return m * v / lax.stop_gradient(norm)


def _conv(x, w):
    return lax.conv_general_dilated(
        x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )


# layout: (weight shape, a_axes, the model, its input)
LAYOUTS = {
    "dense": (
        (16, 8),
        None,
        lambda x, w: x @ w,
        lambda: jax.random.normal(K[6], (4, 16)),
    ),
    "transposed": (
        (16, 8),
        None,
        lambda x, w: x @ w.T,
        lambda: jax.random.normal(K[6], (4, 8)),
    ),
    "einsum": (
        (2, 16, 4),
        (1,),
        lambda x, w: jnp.einsum("bd,hdk->bhk", x, w),
        lambda: jax.random.normal(K[6], (4, 16)),
    ),
    "conv": ((3, 8, 6), None, _conv, lambda: jax.random.normal(K[6], (2, 5, 8))),
    "embedding": (
        (10, 8),
        None,
        lambda ids, w: w[ids],
        lambda: jnp.array([3, 0, 9, 3]),
    ),
}


def _dora(shape, a_axes, fmt=None, stacked=0):
    w = jax.random.normal(K[0], shape)
    params = {"w": w}
    if fmt is not None:
        options = {"block_size": 2} if fmt == "nf4" else {}
        params = qax.quant.quantize(
            params, fmt, filter=lambda p, x: True, batch_ndim=stacked, **options
        )
    lora = qax.lora.loraify(
        params, 3, key=K[1], alpha=6.0, a_axes=a_axes, filter=lambda p, x: True,
        batch_ndim=stacked,
    )["w"]  # fmt: skip
    lora = qax.lora.LoraWeight(
        lora.w, lora.a, 0.3 * jax.random.normal(K[2], lora.b.shape), alpha=6.0,
        a_axes=lora.a_axes,
    )  # fmt: skip
    d = qax.lora.to_dora({"w": lora})["w"]
    m = d.m * (1.0 + 0.3 * jax.random.uniform(K[3], d.m.shape))  # a trained magnitude
    return qax.lora.DoraWeight(
        d.w, d.a, d.b, m=m, w_norm2=d.w_norm2, alpha=6.0, a_axes=d.a_axes
    )


def no_materialization():
    return qax.materialization_policy(qax.ImplicitArray, "error")


def _close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)
    cos = np.sum(got * want) / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cos >= 0.9999


@pytest.mark.parametrize("fmt", [None, "int8", "nf4"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_products_and_gradients_match_peft_semantics(layout, fmt):
    shape, a_axes, f, make_x = LAYOUTS[layout]
    d = _dora(shape, a_axes, fmt)
    x = make_x()
    w = qax.materialize_nested(d.w, full=True)
    _close(d.materialize(), reference(w, d.a, d.b, d.m, d.a_axes))

    def implicit(a, b, m):
        dw = qax.lora.DoraWeight(
            d.w, a, b, m=m, w_norm2=d.w_norm2, alpha=6.0, a_axes=d.a_axes
        )
        return qax.use_implicit_args(f)(x, dw)

    def dense(a, b, m):
        return f(x, reference(w, a, b, m, d.a_axes))

    with no_materialization():
        got = jax.jit(implicit)(d.a, d.b, d.m)
        grads = jax.jit(jax.grad(lambda *p: jnp.sum(jnp.sin(implicit(*p))), (0, 1, 2)))(
            d.a, d.b, d.m
        )
    _close(got, dense(d.a, d.b, d.m))
    want = jax.grad(lambda *p: jnp.sum(jnp.sin(dense(*p))), (0, 1, 2))(d.a, d.b, d.m)
    for g, gw in zip(grads, want, strict=True):
        _close(g, gw, tol=2e-5)


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_stacked_layers_under_scan_vmap_and_remat(fmt):
    d = _dora((2, 16, 16), None, fmt, stacked=1)
    assert d.shape == (2, 16, 16) and d.m.shape == (2, 16)
    x = jax.random.normal(K[6], (4, 16))
    dense_w = qax.lora.merge({"w": d})["w"]

    def model(x, stack):
        body = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        return lax.scan(body, x, stack)[0]

    with no_materialization():
        got = jax.jit(qax.use_implicit_args(model))(x, d)
        per_layer = jax.jit(qax.use_implicit_args(jax.vmap(lambda w: x @ w)))(d)
    _close(got, model(x, dense_w))
    _close(per_layer, jax.vmap(lambda w: x @ w)(dense_w))


def _is_identity(e) -> bool:
    """JAX's mark on a value `jax.checkpoint` keeps for the backward pass: a
    ``reduce_precision`` to the value's own precision (the same value, no new one)."""
    if e.primitive.name != "reduce_precision":
        return False
    dtype = e.invars[0].aval.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    finfo = jnp.finfo(dtype)
    return (e.params["exponent_bits"], e.params["mantissa_bits"]) == (
        finfo.nexp,
        finfo.nmant,
    )


def _step_eqn_shapes(loss, params) -> list:
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params)
    shapes = []

    def walk(j):
        for e in j.eqns:
            if not _is_identity(e):
                shapes.extend(tuple(v.aval.shape) for v in e.outvars)
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return shapes


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_a_train_step_forms_no_more_weight_sized_values_than_lora(fmt):
    d = _dora((64, 32), None, fmt)
    lora = qax.lora.LoraWeight(d.w, d.a, d.b, alpha=6.0)
    x = jax.random.normal(K[6], (8, 64))

    def step_shapes(weight):
        adapters, base = qax.lora.split({"w": weight})

        def loss(adapters):
            w = qax.lora.combine(adapters, base)["w"]
            return jnp.sum(qax.use_implicit_args(lambda x, w: x @ w)(x, w) ** 2)

        with no_materialization():
            return _step_eqn_shapes(loss, adapters)

    weight_sized = {(64, 32), (32, 64)}
    dora = sum(s in weight_sized for s in step_shapes(d))
    lora = sum(s in weight_sized for s in step_shapes(lora))
    assert dora <= lora, (dora, lora)


def _step_temp_bytes(params, x) -> int:
    """The compiled temporary memory of one adam step of the trainable part of
    ``params`` for a residual MLP (``h + tanh(h @ w1) @ w2``, three blocks): one
    product's output feeds ``tanh``, the other a residual sum that keeps nothing."""
    adapters, base = qax.lora.split(params)
    opt = optax.adam(1e-3)

    def model(p, x):
        h = x
        for i in range(3):
            h = h + jnp.tanh(h @ p[f"up{i}"]) @ p[f"down{i}"]
        return jnp.mean(h**2)

    def step(adapters, state, x):
        loss = lambda t: qax.use_implicit_args(model)(qax.lora.combine(t, base), x)  # noqa: E731
        grads = jax.grad(loss)(adapters)
        updates, state = opt.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state

    with no_materialization():
        compiled = jax.jit(step).lower(adapters, opt.init(adapters), x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.skipif(
    jax.__version_info__ < (0, 11),
    reason="JAX 0.10's XLA merges the recomputed products back into the forward ones "
    "(DoRA's step keeps its 1.27x temporary memory there)",
)
@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_a_train_step_needs_the_memory_of_a_lora_step(fmt):
    """DoRA's magnitude gradient needs each product before its scaling (an output-sized
    value per product that LoRA never keeps): it is recomputed in the backward pass,
    so the step's compiled temporary memory is LoRA's (within 5 %)."""
    d, t = 32, 512  # activations (t x d per product) well above the weights
    ws = {}
    for i in range(3):
        ws[f"up{i}"] = jax.random.normal(K[i], (d, 2 * d)) / d**0.5
        ws[f"down{i}"] = jax.random.normal(K[i + 3], (2 * d, d)) / d**0.5
    if fmt is not None:
        ws = qax.quant.quantize(ws, fmt, filter=lambda p, x: True, block_size=32)
    lora = qax.lora.loraify(ws, 4, key=K[6], alpha=8.0, filter=lambda p, x: True)
    adapters, base = qax.lora.split(lora)
    adapters = jax.tree_util.tree_map(lambda v: v + 0.01, adapters)  # a nonzero b
    lora = qax.lora.combine(adapters, base)
    x = jax.random.normal(K[7], (t, d))
    lora_bytes = _step_temp_bytes(lora, x)
    dora_bytes = _step_temp_bytes(qax.lora.to_dora(lora), x)
    assert dora_bytes <= 1.05 * lora_bytes, (dora_bytes, lora_bytes)


def test_split_combine_merge_and_training_the_magnitude():
    d = _dora((16, 8), None, "int8")
    params = {"w": d, "bias": jnp.zeros(8)}
    adapters, base = qax.lora.split(params)
    assert isinstance(adapters["w"], qax.lora.DoraAdapter) and adapters["bias"] is None
    assert isinstance(base["w"], qax.lora.DoraBase)
    back = qax.lora.combine(adapters, base)
    _close(back["w"].materialize(), d.materialize())
    assert qax.lora.trainable_count(params) == d.a.size + d.b.size + d.m.size
    np.testing.assert_allclose(qax.lora.merge(params)["w"], d.materialize(), rtol=1e-6)

    x = jax.random.normal(K[6], (4, 16))
    opt = optax.adam(1e-2)

    @jax.jit
    def step(adapters, state):
        def loss(adapters):
            p = qax.lora.combine(adapters, base)
            out = qax.use_implicit_args(lambda p, x: x @ p["w"] + p["bias"])(p, x)
            return jnp.mean((out - 1.0) ** 2)

        value, grads = jax.value_and_grad(loss)(adapters)
        updates, state = opt.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, value

    state = opt.init(adapters)
    with no_materialization():
        first = step(adapters, state)[2]
        for _ in range(5):
            adapters, state, value = step(adapters, state)
    assert value < first
    moved = jnp.abs(adapters["w"].m - d.m).max()
    assert moved > 1e-3  # the magnitude trains


def test_to_dora_starts_where_lora_is():
    w = jax.random.normal(K[0], (16, 8))
    lora = qax.lora.loraify({"w": w}, 4, key=K[1], alpha=8.0, filter=lambda p, x: True)
    dora = qax.lora.to_dora(lora)
    x = jax.random.normal(K[6], (3, 16))
    f = qax.use_implicit_args(lambda x, p: x @ p["w"])
    _close(f(x, dora), f(x, lora))  # b = 0: both are the base model
    with pytest.raises(ValueError, match="shape of the output axes"):
        qax.lora.DoraWeight(w, lora["w"].a, lora["w"].b, m=jnp.ones(16))


def test_dora_adapters_live_in_banks():
    """`bank` of DoRA adapters is a `DoraBank`: one base and its ‖w‖², a magnitude per
    adapter; `per_example` gives each example its adapter's DoRA weight (id -1: the
    base alone), `unbank` gives the adapters back. (Every transformation over every
    base: tests/test_composition.py.)"""
    one = [_dora((8, 6), None, "int8"), _dora((8, 6), None, "int8")]
    one[1] = qax.lora.DoraWeight(
        one[1].w, one[1].a * 2, one[1].b, m=one[1].m * 0.5, w_norm2=one[1].w_norm2,
        alpha=6.0,
    )  # fmt: skip
    split = [qax.lora.split({"w": d}) for d in one]
    served = qax.lora.bank(split[0][1], [a for a, _ in split])
    bank = served["w"]
    assert isinstance(bank, qax.lora.DoraBank) and bank.shape == (2, 8, 6)
    _close(bank.materialize()[1], one[1].materialize())
    _close(bank.adapter(0).materialize(), one[0].materialize())
    x = jax.random.normal(K[5], (3, 8))
    ids = jnp.array([1, -1, 0])
    with no_materialization():
        got = qax.lora.per_example(lambda p, x: x @ p["w"])(ids, served, x)
    base = qax.materialize_nested(one[0].w, full=True)
    want = [x[0] @ one[1].materialize(), x[1] @ base, x[2] @ one[0].materialize()]
    _close(got, jnp.stack(want))
    back, adapters = qax.lora.unbank(served)
    assert isinstance(back["w"], qax.lora.DoraBase)
    for (a, _), b in zip(split, adapters, strict=True):
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
            np.testing.assert_array_equal(u, v)
    lora_adapters, _ = qax.lora.split(
        {"w": qax.lora.LoraWeight(one[0].w, one[0].a, one[0].b, alpha=6.0)}
    )
    with pytest.raises(ValueError, match="LoRA and DoRA adapters"):
        qax.lora.bank(split[0][1], [split[0][0], lora_adapters])
