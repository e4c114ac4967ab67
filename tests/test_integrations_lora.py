"""The built-in `qax.lora` / `qax.quant` types in NNX, linen, Equinox and orbax."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
import qax.checkpoint
import qax.lora as lora  # noqa: E402
import qax.quant as quant  # noqa: E402
from qax.symbols import SymbolicConstant
from tests.helpers import assert_close

nnx = pytest.importorskip("flax.nnx")
nn = pytest.importorskip("flax.linen")
eqx = pytest.importorskip("equinox")
ocp = pytest.importorskip("orbax.checkpoint")
qnnx = pytest.importorskip("qax.nnx")

KEY = jax.random.key(0)
TOKENS = jnp.array([[1, 5, 7, 2, 9, 3], [4, 4, 0, 19, 8, 6]])
TARGET = jax.random.normal(jax.random.key(3), (2, 6, 4))


def _is(types):
    return lambda x: isinstance(x, types)


def _implicit(tree, types):
    return [
        x for x in qax.utils.tree_leaves_with_implicit(tree) if isinstance(x, types)
    ]


def _bump_b(params):
    """Nonzero `b` factors (loraify starts them at zero), so the LoRA path matters."""
    return jax.tree_util.tree_map(
        lambda x: (
            dataclasses.replace(x, b=x.b + 0.05)
            if isinstance(x, lora.LoraWeight)
            else x
        ),
        params,
        is_leaf=_is(lora.LoraWeight),
    )


# ---------------------------------------------------------------------------------------
# NNX


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(20, 64, rngs=rngs)
        self.norm = nnx.LayerNorm(64, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=64, qkv_features=64, decode=False, rngs=rngs
        )
        self.fc1 = nnx.Linear(64, 64, rngs=rngs)
        self.fc2 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, tokens):
        h = self.norm(self.embed(tokens))
        h = h + self.attn(h)
        return self.fc2(jax.nn.gelu(self.fc1(h)))


def _nnx_call(model, tokens):
    return model(tokens)


def test_nnx_loraify_state_and_train():
    """LoRA everywhere, over an NF4 base for fc1 (QLoRA) and dense ones elsewhere."""
    model = NnxNet(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    state = quant.quantize(
        state, "nf4", block_size=64, filter=lambda p, x: "fc1" in p and x.ndim == 2
    )
    state = _bump_b(lora.loraify(state, 4, key=KEY))
    model = nnx.merge(graphdef, state)
    weights = _implicit(nnx.state(model), lora.LoraWeight)
    assert len(weights) >= 6
    want = _nnx_call(nnx.merge(graphdef, lora.merge(state)), TOKENS)
    got = nnx.jit(qax.use_implicit_args(_nnx_call))(model, TOKENS)
    assert_close(got, want, rtol=1e-4, atol=1e-4)

    trainable = qnnx.holds(lora.LoraWeight)
    opt = qnnx.Optimizer(
        model, qax.freeze_keys(optax.adam(1e-2), lora.LoraWeight, ["w"]), wrt=trainable
    )

    def loss_fn(model):
        out = qax.use_implicit_args(_nnx_call)(model, TOKENS)
        return jnp.mean((out - TARGET) ** 2)

    @nnx.jit
    def step(model, opt):
        # NNX differentiates whole Variables: with a quantized base their `w` holds
        # integer codes, which need allow_int (freeze_keys leaves them untouched).
        loss, grads = nnx.value_and_grad(
            loss_fn, argnums=nnx.DiffState(0, trainable), allow_int=True
        )(model)
        opt.update(model, grads)
        return loss

    before = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    losses = [float(step(model, opt)) for _ in range(3)]
    assert losses[-1] < losses[0], losses
    after = jax.tree_util.tree_map(np.asarray, nnx.state(model))
    moved = [
        jax.tree_util.keystr(p)
        for (p, x), y in zip(
            jax.tree_util.tree_leaves_with_path(before),
            jax.tree_util.tree_leaves(after),
        )
        if not np.array_equal(x, y)
    ]
    assert moved and all(p.endswith((".a", ".b")) for p in moved), moved


# ---------------------------------------------------------------------------------------
# linen with an nn.scan + nn.remat stack


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(64)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h)))), None


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        # (Convolutions and attention are loraified in test_lora and the NNX test.)
        h = nn.LayerNorm()(nn.Embed(20, 64)(tokens))
        stack = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=2,
        )
        h, _ = stack(name="blocks")(h, None)
        return nn.Dense(4)(h)


def test_linen_scan_remat_stack_trains_only_factors():
    model = LinenNet()
    params = model.init(KEY, TOKENS)["params"]
    params = lora.loraify(
        params,
        4,
        key=KEY,
        filter=lambda p, x: "blocks" in p and x.ndim == 3,
        batch_ndim=1,
    )
    params = _bump_b(lora.loraify(params, 4, key=jax.random.key(1)))
    assert any(w.ndim == 3 for w in _implicit(params, lora.LoraWeight))

    def apply(params, tokens):
        return model.apply({"params": params}, tokens)

    want = apply(lora.merge(params), TOKENS)
    assert_close(
        jax.jit(qax.use_implicit_args(apply))(params, TOKENS), want, 1e-4, 1e-4
    )

    adapters, base = lora.split(params)
    tx = optax.adam(1e-2)
    opt_state = tx.init(adapters)

    @jax.jit
    def step(adapters, opt_state):
        def loss_fn(adapters):
            out = qax.use_implicit_args(apply)(lora.combine(adapters, base), TOKENS)
            return jnp.mean((out - TARGET) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(adapters)
        updates, opt_state = tx.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    losses = []
    for _ in range(3):
        adapters, opt_state, loss = step(adapters, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    _, base_after = lora.split(lora.combine(adapters, base))
    jax.tree_util.tree_map(np.testing.assert_array_equal, base, base_after)


# ---------------------------------------------------------------------------------------
# Equinox


def test_equinox_loraify_module():
    k = jax.random.split(KEY, 3)
    model = eqx.nn.MLP(8, 4, width_size=16, depth=2, key=k[0])
    model = _bump_b(lora.loraify(model, 2, key=k[1], split_at=1))
    assert len(_implicit(model, lora.LoraWeight)) == 3
    x = jax.random.normal(k[2], (5, 8))

    def call(m, x):
        return jax.vmap(m)(x)

    want = call(lora.merge(model), x)
    got = eqx.filter_jit(qax.use_implicit_args(call))(model, x)
    assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------
# orbax with every built-in type


def _all_types_state():
    w = jax.random.normal(KEY, (64, 128))
    params = {
        "lora": _bump_b(lora.loraify({"k": w}, 4, key=KEY))["k"],
        "int8": quant.quantize({"k": w}, "int8")["k"],
        "int4": quant.quantize({"k": w}, "int4", group_size=64)["k"],
        "nf4": quant.quantize({"k": w}, "nf4", block_size=64)["k"],
        "qlora": lora.loraify(
            quant.quantize({"k": w}, "nf4", block_size=64), 4, key=KEY
        )["k"],
        "zero": SymbolicConstant(0.0, shape=(128,), dtype=jnp.float32),
        "qdora": lora.loraify(
            quant.quantize({"k": w}, "int8"), 4, key=KEY, dora=True, alpha=8.0
        )["k"],
        "bank": lora.bank(
            {"k": w},
            [
                lora.split(_bump_b(lora.loraify({"k": w}, r, key=KEY)))[0]
                for r in (2, 4)
            ],
        )["k"],
    }
    kinds = {type(v).__name__ for v in params.values()}
    tx = qax.freeze_keys(optax.adam(1e-2), lora.LoraWeight, ["w"])
    return {"params": params, "opt": tx.init(params)}, kinds


def _same(a, b):
    ia, ib = (
        qax.utils.tree_leaves_with_implicit(a),
        qax.utils.tree_leaves_with_implicit(b),
    )
    assert [type(x) for x in ia] == [type(x) for x in ib]
    for x, y in zip(ia, ib, strict=True):
        if isinstance(x, qax.ImplicitArray):
            assert jax.tree_util.tree_structure(x) == jax.tree_util.tree_structure(y)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_orbax_every_builtin_type(tmp_path):
    state, kinds = _all_types_state()
    assert kinds == {
        "LoraWeight",
        "Int8Weight",
        "Int4Weight",
        "NF4Weight",
        "SymbolicConstant",
        "DoraWeight",
        "LoraBank",
    }
    assert isinstance(state["params"]["qlora"].w, quant.NF4Weight)
    assert isinstance(state["params"]["qdora"].w, quant.Int8Weight)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(
        tmp_path / "c", state, custom_metadata={"qax": qax.checkpoint.describe(state)}
    )
    ckpt.wait_until_finished()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
    _same(ckpt.restore(tmp_path / "c", abstract), state)
    raw = ckpt.restore(tmp_path / "c")
    rebuilt = qax.checkpoint.rebuild(
        raw, ckpt.metadata(tmp_path / "c").custom_metadata["qax"]
    )
    # Without a template too: the same types with the same metadata (ranks included).
    _same(rebuilt["params"], state["params"])


def test_orbax_template_less_stacked_lora_scans_implicitly(tmp_path):
    """A stack of (Q)LoRA layers restored without a template keeps its declared batch
    axis: `lax.scan` slices it leaf by leaf, nothing is materialized."""
    up = {"w": jax.random.normal(KEY, (3, 8, 16)) * 0.3}
    down = {"w": jax.random.normal(jax.random.key(2), (3, 16, 8)) * 0.3}
    down = quant.quantize(down, "nf4", block_size=8, batch_ndim=1)
    params = {
        "lora": _bump_b(lora.loraify(up, 2, key=KEY, batch_ndim=1))["w"],
        "qlora": _bump_b(lora.loraify(down, 2, key=KEY, batch_ndim=1))["w"],
    }
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(
        tmp_path / "s", params, custom_metadata={"qax": qax.checkpoint.describe(params)}
    )
    ckpt.wait_until_finished()
    restored = qax.checkpoint.rebuild(
        ckpt.restore(tmp_path / "s"),
        ckpt.metadata(tmp_path / "s").custom_metadata["qax"],
    )
    _same(restored, params)
    assert restored["qlora"].w_ndim == 2 and restored["qlora"].w.weight_ndim == 2
    # A description saved when the class had other aux fields is refused, clearly.
    old = json.loads(json.dumps(qax.checkpoint.describe(params)))
    aux = json.loads(old["implicit"][0]["aux"])
    aux["tuple"][0]["tuple"] = aux["tuple"][0]["tuple"][:2]  # alpha, freeze_w only
    old["implicit"][0]["aux"] = json.dumps(aux)
    with pytest.raises(ValueError, match="LoraWeight now has 6 aux field"):
        qax.checkpoint.rebuild(ckpt.restore(tmp_path / "s"), old)
    # A description saved before LoraWeight had `a_axes` (its last aux field) rebuilds
    # with the default layout.
    old = json.loads(json.dumps(qax.checkpoint.describe(params)))
    aux = json.loads(old["implicit"][0]["aux"])
    assert len(aux["tuple"][0]["tuple"]) == 6
    aux["tuple"][0]["tuple"] = aux["tuple"][0]["tuple"][:5]
    old["implicit"][0]["aux"] = json.dumps(aux)
    again = qax.checkpoint.rebuild(ckpt.restore(tmp_path / "s"), old)
    _same(again, params)
    assert again["lora"].a_axes is None

    def model(params, x):
        def body(h, p):
            return jnp.tanh(h @ p["lora"]) @ p["qlora"], None

        return jax.lax.scan(body, x, params)[0]

    x = jax.random.normal(jax.random.key(1), (2, 8))
    with qax.materialization_policy(lora.LoraWeight, "error"):
        with qax.materialization_policy(quant.NF4Weight, "error"):
            got = jax.jit(qax.use_implicit_args(model))(restored, x)
    assert_close(got, model(lora.merge(params), x), rtol=1e-5, atol=1e-5)


def test_orbax_adapters_only_is_small(tmp_path, capsys):
    w = {
        f"layer{i}": jax.random.normal(jax.random.fold_in(KEY, i), (512, 512))
        for i in range(4)
    }
    params = lora.loraify(w, 8, key=KEY)
    adapters, _ = lora.split(params)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "full", params)
    ckpt.save(tmp_path / "adapters", adapters)
    ckpt.wait_until_finished()

    def size(p):
        return sum(
            os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs
        )

    full, small = size(tmp_path / "full"), size(tmp_path / "adapters")
    with capsys.disabled():
        print(
            f"\nqax.lora.split adapters: {small} bytes, full checkpoint: {full} bytes"
        )
    assert small < full / 10
    restored = ckpt.restore(
        tmp_path / "adapters",
        jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, adapters),
    )
    _same(lora.combine(restored, lora.split(params)[1]), params)
