"""orbax: parameters and optimizer state holding implicit arrays, saved and restored."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import qax
import qax.checkpoint
from qax.symbols import SymbolicConstant
from tests.helpers import LoraKernel, lora_kernel

ocp = pytest.importorskip("orbax.checkpoint")


@dataclasses.dataclass
class Scaled(qax.ImplicitArray):
    """A user type with metadata, nesting another implicit array."""

    inner: qax.ArrayValue = qax.array_field(ndim=2)
    scale: float = qax.aux_field(default=2.0)

    def compute_shape(self):
        return self.inner.shape

    def compute_dtype(self):
        return self.inner.dtype

    def materialize(self):
        return self.inner * self.scale


def _state():
    lora = lora_kernel(
        jax.random.normal(jax.random.key(0), (6, 5)), 2, jax.random.key(1)
    )
    params = {
        "lora": lora,
        "zero": SymbolicConstant(0.0, shape=(5,), dtype=jnp.float32),
        "nested": Scaled(
            lora_kernel(jnp.ones((4, 3)), 1, jax.random.key(2)), scale=0.5
        ),
        "dense": jnp.arange(3.0),
    }
    tx = qax.freeze_keys(optax.adam(1e-2), LoraKernel, ["w"])
    opt_state = tx.init(params)
    # One real step so the moments are not all zero.
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)
    return {"params": params, "opt_state": opt_state}


def _assert_same(a, b):
    types = qax.utils.tree_leaves_with_implicit
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert [type(x) for x in types(a)] == [type(x) for x in types(b)]
    for x, y in zip(types(a), types(b)):
        if isinstance(x, qax.ImplicitArray):
            assert (x.shape, x.dtype) == (y.shape, y.dtype)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _abstract(tree):
    return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)


def test_standard_checkpointer_with_template(tmp_path):
    state = _state()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "ckpt", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "ckpt", _abstract(state))
    _assert_same(restored, state)
    assert restored["params"]["zero"].value == 0.0
    assert restored["params"]["nested"].scale == 0.5


def test_checkpoint_manager_keeps_steps(tmp_path):
    state = _state()
    later = jax.tree_util.tree_map(lambda x: x + 1, state)
    with ocp.CheckpointManager(
        tmp_path / "run", options=ocp.CheckpointManagerOptions(max_to_keep=2)
    ) as manager:
        manager.save(1, args=ocp.args.StandardSave(state))
        manager.save(2, args=ocp.args.StandardSave(later))
        manager.wait_until_finished()
        assert manager.latest_step() == 2
        first = manager.restore(1, args=ocp.args.StandardRestore(_abstract(state)))
        second = manager.restore(2, args=ocp.args.StandardRestore(_abstract(state)))
    _assert_same(first, state)
    _assert_same(second, later)


def test_restore_without_template_rebuilds_from_the_description(tmp_path):
    state = _state()
    ckpt = ocp.StandardCheckpointer()
    description = qax.checkpoint.describe(state)
    ckpt.save(tmp_path / "ckpt", state, custom_metadata={"qax": description})
    ckpt.wait_until_finished()
    raw = ckpt.restore(tmp_path / "ckpt")
    # orbax alone gives plain containers: fields as dicts, field-less constants as None.
    assert isinstance(raw["params"]["lora"], dict) and raw["params"]["zero"] is None
    saved = ckpt.metadata(tmp_path / "ckpt").custom_metadata["qax"]
    rebuilt = qax.checkpoint.rebuild(raw, saved)
    _assert_same(rebuilt["params"], state["params"])
    # The optimizer state's containers stay as orbax gives them (lists and dicts);
    # its implicit arrays (LoRA-shaped moments) are rebuilt.
    got = qax.utils.tree_leaves_with_implicit(rebuilt["opt_state"])
    want = qax.utils.tree_leaves_with_implicit(state["opt_state"])
    assert sorted(type(x).__name__ for x in got) == sorted(
        type(x).__name__ for x in want
    )


def test_rebuild_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="custom_metadata"):
        qax.checkpoint.rebuild({"a": 1}, None)
    description = qax.checkpoint.describe({"p": _state()["params"]["lora"]})
    with pytest.raises(ValueError, match=r"no field 'a' at \['p'\]"):
        qax.checkpoint.rebuild({"p": {"w": jnp.ones((6, 5))}}, description)
    description["implicit"][0]["type"] = "qax:nowhere.Missing"
    with pytest.raises(TypeError, match="not defined in this process"):
        qax.checkpoint.rebuild({"p": {}}, description)


def _directory_bytes(path):
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )


def test_adapter_only_checkpoint_is_small(tmp_path, capsys):
    key = jax.random.key(0)
    params = {
        f"layer{i}": lora_kernel(
            jax.random.normal(jax.random.fold_in(key, i), (512, 512)),
            8,
            jax.random.fold_in(key, 100 + i),
        )
        for i in range(4)
    }
    adapters = jax.tree_util.tree_map(
        lambda x: {"a": x.a, "b": x.b},
        params,
        is_leaf=lambda x: isinstance(x, LoraKernel),
    )
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "full", params)
    ckpt.save(tmp_path / "adapters", adapters)
    ckpt.wait_until_finished()
    full, small = (_directory_bytes(tmp_path / n) for n in ("full", "adapters"))
    with capsys.disabled():
        print(f"\norbax bytes: full {full}, adapters only {small}")
    array_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(adapters))
    assert array_bytes == 4 * 2 * 512 * 8 * 4
    assert small < full / 10
    restored = ckpt.restore(tmp_path / "adapters", _abstract(adapters))
    merged = jax.tree_util.tree_map(
        lambda p, ad: dataclasses.replace(p, a=ad["a"], b=ad["b"]),
        params,
        restored,
        is_leaf=lambda x: isinstance(x, LoraKernel),
    )
    _assert_same(merged, params)


def test_adapters_restored_without_template_rebuild_and_combine(tmp_path):
    """Issue 42, item 6: `describe`/`rebuild` know `qax.lora.LoraAdapter`s."""
    params = {
        "w": jax.random.normal(jax.random.key(0), (6, 5)),
        "v": jax.random.normal(jax.random.key(1), (5, 4, 3)),
    }
    lora = qax.lora.loraify(params, 2, key=jax.random.key(2), alpha=4.0, split_at=1)
    adapters, base = qax.lora.split(lora)
    path = os.path.join(tmp_path, "adapters")
    ckpt = ocp.StandardCheckpointer()
    description = qax.checkpoint.describe(adapters)
    ckpt.save(path, adapters, custom_metadata={"qax": description})
    ckpt.wait_until_finished()
    raw = ckpt.restore(path)
    saved = ckpt.metadata(path).custom_metadata["qax"]
    back = qax.checkpoint.rebuild(raw, saved)
    assert isinstance(back["w"], qax.lora.LoraAdapter) and back["w"].alpha == 4.0
    got = qax.lora.combine(back, base)
    want = qax.lora.merge(lora)
    for name in params:
        np.testing.assert_array_equal(qax.lora.merge(got)[name], want[name])
