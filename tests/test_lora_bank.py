"""Adapter banks: many LoRA adapters over one base, one adapter per example.

The oracle is the per-adapter loop: each example run alone through the dense model with
its own adapter merged (``-1``: the base alone). Implicitness is checked with the
"error" materialization policy and on the jaxpr (the base is never mapped per example).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import qax
from tests.helpers import dense

H, K, D, V, T = 2, 16, 32, 32, 6
RANKS = (2, 4, 3)
IDS = np.array([0, 2, -1, 1, 2], np.int32)

# ----------------------------------------------------------------------------------------
# A model with every layout a LoraWeight has: an embedding lookup, an einsum kernel whose
# adapter runs along its middle axis (a_axes), a Flax-layout convolution, a dense kernel.


def _init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": jax.random.normal(k[0], (V, D)),
        "q": jax.random.normal(k[1], (H, D, K)) / math.sqrt(D),
        "out": jax.random.normal(k[2], (H * K, D)) / math.sqrt(H * K),
        "conv": jax.random.normal(k[3], (3, D, D)) / math.sqrt(3 * D),
        "scale": jnp.ones((D,)),
    }


def _block(p: dict, h: jax.Array) -> jax.Array:
    b, t, _ = h.shape
    q = jnp.einsum("btd,hdk->bthk", h, p["q"]).reshape(b, t, H * K)
    h = h + jnp.tanh(q) @ p["out"]
    c = lax.conv_general_dilated(
        h, p["conv"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )
    return (h + jnp.tanh(c)) * p["scale"]


def model(p: dict, tokens: jax.Array) -> jax.Array:
    return _block(p, p["embed"][tokens])


def _a_axes(path: str, leaf) -> tuple[int, ...]:
    """The einsum kernel's adapter runs along its middle axis (as PEFT and qwix put
    it); every other weight's along all axes but the last."""
    n = jnp.ndim(leaf) - (1 if path.startswith("blocks") else 0)
    return (1,) if path.endswith("q") else tuple(range(n - 1))


def _quantized(params: dict, fmt: str | None, batch_ndim: int = 0) -> dict:
    if fmt is None:
        return params
    options = {"block_size": 16} if fmt == "nf4" else {}
    return qax.quant.quantize(
        params,
        fmt,
        filter=lambda path, leaf: path.split("/")[-1] in ("q", "out", "conv"),
        batch_ndim=batch_ndim,
        **options,
    )


def _adapters(params: dict, ranks=RANKS, batch_ndim: int = 0, seed: int = 1):
    """One trained-looking adapter tree per rank (random, non-zero factors), and the
    base they share."""
    found, base = [], None
    for i, r in enumerate(ranks):
        lora = qax.lora.loraify(
            params,
            r,
            key=jax.random.key(seed + i),
            alpha=2.0 * (i + 1),
            filter=lambda path, leaf: not path.endswith("scale"),
            a_axes=_a_axes,
            batch_ndim=batch_ndim,
        )
        adapters, base = qax.lora.split(lora)
        noise = jax.random.key(100 + i)

        def perturb(x, noise=noise):
            return x + 0.3 * jax.random.normal(noise, jnp.shape(x), x.dtype)

        adapters = jax.tree_util.tree_map(perturb, adapters)
        found.append(adapters)
    return found, base


def _loop(f, ids, adapters, base, *batched, shared=()):
    """The oracle: each example alone, through the dense model with its adapter
    merged."""
    outs = []
    for i, j in enumerate(np.asarray(ids)):
        p = base if j < 0 else qax.lora.combine(adapters[j], base)
        args = [jax.tree_util.tree_map(lambda v, i=i: v[i : i + 1], x) for x in batched]
        outs.append(f(dense(p), *args, *shared))
    return jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *outs)


def _tokens(n: int = len(IDS), t: int = T, seed: int = 7) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (n, t), 0, V)


def no_materialization():
    return qax.materialization_policy(qax.ImplicitArray, "error")


def assert_close(got, want, tol=1e-5):
    for g, w in zip(
        jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True
    ):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------
# Building banks


def test_a_bank_stands_for_the_stack_of_merged_weights_and_splits_back():
    adapters, base = _adapters(_init())
    served = qax.lora.bank(base, adapters)
    q = served["q"]
    assert isinstance(q, qax.lora.LoraBank)
    assert q.shape == (3, H, D, K) and q.ranks == RANKS and q.rank == max(RANKS)
    assert q.a_axes == (1,) and q.a.shape == (3, D, 4) and q.b.shape == (3, 4, H, K)
    # Entry i of the dense stack is adapter i merged into the base.
    for name in ("embed", "q", "out", "conv"):
        stack = served[name].materialize()
        for i in range(3):
            want = qax.lora.combine(adapters[i], base)[name].materialize()
            np.testing.assert_allclose(stack[i], want, rtol=1e-6, atol=1e-6)
    assert served["scale"] is base["scale"]
    # unbank gives back each adapter tree exactly (ranks unpadded, alphas kept).
    base2, back = qax.lora.unbank(served)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(adapters)
    for got, want in zip(back, adapters, strict=True):
        for g, w in zip(
            jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
        ):
            np.testing.assert_array_equal(g, w)
        assert got["q"].alpha == want["q"].alpha and got["q"].a_axes == (1,)
    np.testing.assert_array_equal(base2["q"], base["q"])


def test_padding_cost_is_reported_per_bank():
    adapters, base = _adapters(_init())
    report = qax.lora.bank_padding(qax.lora.bank(base, adapters))
    rows = {r.path: r for r in report.rows}
    assert set(rows) == {"embed", "q", "out", "conv"}
    # out: a (32, r), b (r, 32); stored at rank 4 for each of 3 adapters.
    per_rank = 32 + 32
    assert rows["out"].stored == 3 * 4 * per_rank
    assert rows["out"].used == sum(RANKS) * per_rank
    assert rows["out"].wasted_bytes == (12 - 9) * per_rank * 4
    assert report.fraction == pytest.approx(3 / 12)
    assert "25.0%" in str(report) and "out" in str(report)
    same = qax.lora.bank(base, [adapters[1], adapters[1]])
    assert qax.lora.bank_padding(same).wasted_bytes == 0


def test_weights_that_some_adapters_leave_alone_get_an_empty_slot():
    params = _init()
    adapters, base = _adapters(params)
    only_out = jax.tree_util.tree_map(
        lambda x: x, adapters[0], is_leaf=lambda x: isinstance(x, qax.lora.LoraAdapter)
    )
    only_out = {k: (v if k == "out" else None) for k, v in only_out.items()}
    served = qax.lora.bank(base, [only_out, adapters[1]])
    assert served["q"].ranks == (0, RANKS[1])
    np.testing.assert_allclose(served["q"].materialize()[0], base["q"])
    _, back = qax.lora.unbank(served)
    assert back[0]["q"] is None and back[0]["out"] is not None
    ids = jnp.array([0, 1, 0])
    tokens = _tokens(3)
    with no_materialization():
        got = qax.lora.per_example(model)(ids, served, tokens)
    assert_close(got, _loop(model, ids, [only_out, adapters[1]], base, tokens))


def test_bad_banks_are_refused_with_the_cause():
    adapters, base = _adapters(_init())
    with pytest.raises(ValueError, match="no adapters"):
        qax.lora.bank(base, [])
    combined = qax.lora.combine(adapters[0], base)
    with pytest.raises(ValueError, match="not the combined"):
        qax.lora.bank(base, [qax.lora.split(combined)[0], combined])
    with pytest.raises(ValueError, match="structure of `base`"):
        qax.lora.bank(base, [{"out": adapters[0]["out"]}])
    # An adapter trained on another layout (default a_axes on the einsum kernel).
    other = qax.lora.split(
        qax.lora.loraify(
            _init(), 2, key=jax.random.key(0), filter=lambda p, x: p == "q"
        )
    )[0]
    with pytest.raises(ValueError, match="adapter 1 does not fit the base at q"):
        qax.lora.bank(base, [adapters[0], other])
    with pytest.raises(ValueError, match="no LoraBank"):
        qax.lora.unbank(base)


# ----------------------------------------------------------------------------------------
# One adapter per example


@pytest.mark.parametrize("fmt", [None, "int8", "nf4", "fp8_e4m3"])
def test_each_example_gets_what_it_gets_alone_with_its_adapter(fmt):
    adapters, base = _adapters(_quantized(_init(), fmt))
    served = qax.lora.bank(base, adapters)
    tokens = _tokens()
    want = _loop(model, IDS, adapters, base, tokens)
    step = jax.jit(qax.lora.per_example(model))
    with no_materialization(), qax.materialization_audit() as audit:
        got = step(IDS, served, tokens)
        eager = qax.lora.per_example(model)(IDS, served, tokens)
    assert not audit, audit
    assert_close(got, want)
    assert_close(eager, want)
    # The adapters matter: the base alone (id -1 everywhere) computes something else.
    base_only = step(np.full_like(IDS, -1), served, tokens)
    assert np.abs(np.asarray(base_only - want)).max() > 1e-2
    assert_close(base_only[2], want[2])


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_the_base_is_never_copied_per_example(fmt):
    adapters, base = _adapters(_quantized(_init(), fmt))
    served = qax.lora.bank(base, adapters)
    tokens = _tokens()
    jaxpr = jax.make_jaxpr(qax.lora.per_example(model))(IDS, served, tokens).jaxpr
    n = len(IDS)
    weights = [(V, D), (H, D, K), (H * K, D), (3, D, D)]
    for eqn in _eqns(jaxpr):
        for v in eqn.outvars:
            shape = tuple(getattr(v.aval, "shape", ()))
            assert shape[1:] not in weights or shape[0] != n, (eqn.primitive, shape)
    # Each product with a base weight takes it whole, for the whole batch.
    dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    shared = [e for e in dots if tuple(e.invars[1].aval.shape) == (H * K, D)]
    assert shared and all(not e.params["dimension_numbers"][1][0] for e in shared)


def test_ids_are_checked():
    adapters, base = _adapters(_init())
    served = qax.lora.bank(base, adapters)
    tokens = _tokens(2)
    run = qax.lora.per_example(model)
    with pytest.raises(ValueError, match="adapter id 3 is not in the bank"):
        run(np.array([0, 3]), served, tokens)
    with pytest.raises(ValueError, match="1-D integer array"):
        run(np.array([0.0, 1.0]), served, tokens)
    with pytest.raises(ValueError, match="has 2 example"):
        run(np.array([0, 1, 2]), served, tokens)
    with pytest.raises(ValueError, match="no argument holds a LoraBank"):
        run(np.array([0, 1]), base, tokens)
    # Traced ids outside the bank give NaN for that example, never another adapter.
    out = jax.jit(run)(jnp.array([1, 7]), served, tokens)
    assert np.isfinite(np.asarray(out[0])).all() and np.isnan(np.asarray(out[1])).all()


def test_gradients_reach_each_adapter_from_its_own_examples():
    adapters, base = _adapters(_quantized(_init(), "int8"))
    tokens = _tokens()
    target = jax.random.normal(jax.random.key(3), (len(IDS), T, D))

    def bank_loss(adapters):
        out = qax.lora.per_example(model)(IDS, qax.lora.bank(base, adapters), tokens)
        return jnp.sum((out - target) ** 2)

    def one_loss(adapter, i):
        p = qax.lora.combine(adapter, base)
        out = qax.use_implicit_args(model)(p, tokens[i : i + 1])
        return jnp.sum((out - target[i : i + 1]) ** 2)

    with no_materialization():
        got = jax.jit(jax.grad(bank_loss))(adapters)
        for j in range(len(adapters)):
            want = jax.tree_util.tree_map(jnp.zeros_like, adapters[j])
            for i in np.flatnonzero(IDS == j):
                g = jax.grad(one_loss)(adapters[j], i)
                want = jax.tree_util.tree_map(jnp.add, want, g)
            assert_close(got[j], want, tol=1e-4)


def _stacked_init(layers: int = 2) -> dict:
    blocks = [_init(seed) for seed in range(layers)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)
    stacked.pop("embed")
    return {"embed": blocks[0]["embed"], "blocks": stacked}


def scanned(p: dict, tokens: jax.Array, remat: bool = False) -> jax.Array:
    def body(h, layer):
        return _block(layer, h), None

    body = jax.checkpoint(body) if remat else body
    h, _ = lax.scan(body, p["embed"][tokens], p["blocks"])
    return h


@pytest.mark.parametrize("fmt", [None, "nf4"])
def test_banks_of_stacked_layers_under_scan_remat_and_grad(fmt):
    params = _stacked_init()
    base_q = (
        qax.quant.quantize(
            params,
            fmt,
            filter=lambda path, leaf: path.split("/")[-1] in ("q", "out", "conv"),
            batch_ndim=lambda path, leaf: 1 if path.startswith("blocks") else 0,
            block_size=16,
        )
        if fmt
        else params
    )
    adapters, base = _adapters(
        base_q, batch_ndim=lambda path, leaf: 1 if path.startswith("blocks") else 0
    )
    served = qax.lora.bank(base, adapters)
    assert served["blocks"]["out"].shape == (3, 2, H * K, D)
    tokens = _tokens()
    for remat in (False, True):
        f = lambda p, t, remat=remat: scanned(p, t, remat)  # noqa: E731
        with no_materialization():
            got = jax.jit(qax.lora.per_example(f))(IDS, served, tokens)
        assert_close(got, _loop(f, IDS, adapters, base, tokens))

    def loss(adapters):
        out = qax.lora.per_example(scanned)(IDS, qax.lora.bank(base, adapters), tokens)
        return jnp.sum(jnp.sin(out))

    def loop_loss(adapters):
        total = 0.0
        for i, j in enumerate(IDS):
            p = base if j < 0 else qax.lora.combine(adapters[j], base)
            total += jnp.sum(
                jnp.sin(qax.use_implicit_args(scanned)(p, tokens[i : i + 1]))
            )
        return total

    with no_materialization():
        got = jax.jit(jax.grad(loss))(adapters)
        want = jax.grad(loop_loss)(adapters)
    assert_close(got, want, tol=1e-4)


# ----------------------------------------------------------------------------------------
# Serving: a prefill batch, then one-token decode steps from a KV cache


def _lm_init(seed: int = 5) -> dict:
    k = jax.random.split(jax.random.key(seed), 6)
    s = 1 / math.sqrt(D)
    return {
        "embed": s * jax.random.normal(k[0], (V, D)),
        **{n: s * jax.random.normal(k[i + 1], (D, D)) for i, n in enumerate("qkvo")},
        "head": s * jax.random.normal(k[5], (D, V)),
    }


def lm_step(p: dict, tokens: jax.Array, cache: dict, pos: jax.Array):
    """Causal attention over a KV cache: ``tokens`` (B, t) at positions ``pos..``."""
    x = p["embed"][tokens]
    q, k, v = (x @ p[n] for n in "qkv")
    keys = lax.dynamic_update_slice(cache["k"], k, (0, pos, 0))
    values = lax.dynamic_update_slice(cache["v"], v, (0, pos, 0))
    scores = jnp.einsum("btd,bsd->bts", q, keys) / math.sqrt(D)
    here = pos + jnp.arange(tokens.shape[1])[:, None]
    scores = jnp.where(jnp.arange(keys.shape[1])[None] <= here, scores, -1e30)
    h = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), values) @ p["o"]
    return h @ p["head"], {"k": keys, "v": values}


def test_prefill_then_decode_from_a_kv_cache_per_example():
    adapters, base = _adapters(_quantized(_lm_init(), None))
    served = qax.lora.bank(base, adapters)
    n, prompt, steps = len(IDS), 32, 3
    cache = {
        "k": jnp.zeros((n, prompt + steps, D)),
        "v": jnp.zeros((n, prompt + steps, D)),
    }
    tokens = _tokens(n, prompt)
    step = jax.jit(qax.lora.per_example(lm_step, in_axes=(None, 0, 0, None)))
    dense_step = jax.jit(lm_step)

    def alone(i, tokens_i, cache_i, pos):
        j = IDS[i]
        p = base if j < 0 else qax.lora.combine(adapters[j], base)
        return dense_step(dense(p), tokens_i, cache_i, pos)

    caches = [
        jax.tree_util.tree_map(lambda c, i=i: c[i : i + 1], cache) for i in range(n)
    ]
    pos, inputs = 0, tokens
    with no_materialization():
        for _ in range(1 + steps):
            logits, cache = step(IDS, served, inputs, cache, jnp.int32(pos))
            for i in range(n):
                want, caches[i] = alone(i, inputs[i : i + 1], caches[i], jnp.int32(pos))
                assert_close(logits[i : i + 1], want)
            pos += inputs.shape[1]
            inputs = jnp.argmax(logits[:, -1:], axis=-1)
    assert_close(cache, jax.tree_util.tree_map(lambda *c: jnp.concatenate(c), *caches))


# ----------------------------------------------------------------------------------------
# Training many adapters in one step


def _per_example_loss(out, target):
    return jnp.sum((out - target) ** 2)


def test_one_step_trains_every_adapter_as_its_own_step_would():
    adapters, base = _adapters(_quantized(_init(), "nf4"))
    tokens = _tokens()
    target = jax.random.normal(jax.random.key(4), (len(IDS), T, D))
    opt = optax.adam(1e-2)

    @jax.jit
    def bank_step(adapters, opt_state):
        def loss(adapters):
            served = qax.lora.bank(base, adapters)
            return _per_example_loss(
                qax.lora.per_example(model)(IDS, served, tokens), target
            )

        grads = jax.grad(loss)(adapters)
        updates, opt_state = opt.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state

    @jax.jit
    def one_step(adapter, opt_state, rows):
        def loss(adapter):
            out = qax.use_implicit_args(model)(
                qax.lora.combine(adapter, base), tokens[rows]
            )
            return _per_example_loss(out, target[rows])

        updates, opt_state = opt.update(jax.grad(loss)(adapter), opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state

    state = opt.init(adapters)  # one optimizer state for the whole bank
    trained = adapters
    with no_materialization():
        for _ in range(2):
            trained, state = bank_step(trained, state)
    for j, adapter in enumerate(adapters):
        rows = np.flatnonzero(IDS == j)
        single, single_state = adapter, opt.init(adapter)
        for _ in range(2):
            single, single_state = one_step(single, single_state, rows)
        assert_close(trained[j], single, tol=2e-5)
        moved = jax.tree_util.tree_map(
            lambda u, v: float(jnp.abs(u - v).max()), single, adapter
        )
        assert max(jax.tree_util.tree_leaves(moved)) > 1e-3


def test_split_merge_and_counts_know_banks():
    adapters, base = _adapters(_init())
    served = qax.lora.bank(base, adapters)
    with pytest.raises(ValueError, match=r"LoraBank at conv .*unbank"):
        qax.lora.split(served)
    merged = qax.lora.merge(served)
    np.testing.assert_allclose(merged["out"], served["out"].materialize())
    assert merged["out"].shape == (3, H * K, D)
    stored = sum(
        x.a.size + x.b.size for x in (served[n] for n in ("embed", "q", "out", "conv"))
    )
    assert qax.lora.trainable_count(served) == stored
