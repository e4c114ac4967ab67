"""jax.export and flax.serialization of pytrees that hold implicit arrays."""

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax.symbols import SymbolicConstant
from tests.helpers import assert_close, make_lora

flatbuffers = pytest.importorskip("flatbuffers")
serialization = pytest.importorskip("flax.serialization")

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Tagged(qax.ImplicitArray, warn_on_materialize=False):
    """A user type with metadata of every kind the export codec handles."""

    x: qax.ArrayValue
    scale: float = qax.aux_field(default=2.0)
    meta: tuple = qax.aux_field(default=("a", 1, None, b"\x00\xff", 1 + 2j))
    kind: object = qax.aux_field(default=np.dtype("bfloat16"))
    big: int = qax.aux_field(default=2**70)

    def materialize(self):
        return self.x * self.scale


def _params():
    return {
        "lora": make_lora(jax.random.key(0)),
        "zero": SymbolicConstant(0.0, shape=(5,), dtype=jnp.float32),
        "two": SymbolicConstant(np.float32(-0.0), shape=(5,)),
        "tagged": Tagged(jnp.arange(5.0), scale=3.0),
        "dense": jnp.ones(5),
    }


def _model(p, x):
    h = x @ p["lora"] + p["zero"] + p["two"] + p["dense"]
    return {"y": h * p["tagged"], "z": p["zero"]}


def _same_tree(a, b):
    leaf = qax.utils.tree_leaves_with_implicit
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for u, v in zip(leaf(a), leaf(b)):
        if isinstance(u, qax.ImplicitArray) or isinstance(v, qax.ImplicitArray):
            assert type(u) is type(v)
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_export_roundtrip_with_builtin_and_user_types():
    params, x = _params(), jnp.ones((3, 6))
    f = jax.jit(qax.use_implicit_args(_model))
    exported = jax.export.export(f)(params, x)
    restored = jax.export.deserialize(exported.serialize())
    assert restored.in_tree == exported.in_tree
    assert restored.out_tree == exported.out_tree
    got = restored.call(params, x)
    want = f(params, x)
    assert isinstance(got["z"], SymbolicConstant) and got["z"].value == 0.0
    assert_close(got["y"], want["y"])
    oracle = jax.tree_util.tree_map(
        qax.materialize_nested,
        params,
        is_leaf=lambda v: isinstance(v, qax.ImplicitArray),
    )
    assert_close(
        got["y"],
        _model({k: qax.materialize_nested(v, full=True) for k, v in oracle.items()}, x)[
            "y"
        ],
    )


def _rebuild_args(exported):
    leaves = [jnp.zeros(a.shape, a.dtype) for a in exported.in_avals]
    return jax.tree_util.tree_unflatten(exported.in_tree, leaves)


def test_export_keeps_metadata_exactly():
    t = Tagged(jnp.ones(3), scale=0.5)
    exported = jax.export.export(jax.jit(lambda t: t))(t)
    restored = jax.export.deserialize(exported.serialize())
    (back,), _ = _rebuild_args(restored)
    assert (back.scale, back.meta, back.kind, back.big) == (
        t.scale,
        t.meta,
        t.kind,
        t.big,
    )
    zero = SymbolicConstant(np.float32(-0.0), shape=(2,))
    exported = jax.export.export(jax.jit(lambda z: z))(zero)
    restored = jax.export.deserialize(exported.serialize())
    (back,), _ = _rebuild_args(restored)
    assert np.signbit(back.value) and back.dtype == zero.dtype


def test_export_reports_unserializable_metadata():
    @dataclasses.dataclass
    class Odd(qax.ImplicitArray, warn_on_materialize=False):
        x: qax.ArrayValue
        fn: object = qax.aux_field(default=len)

        def materialize(self):
            return self.x

    exported = jax.export.export(jax.jit(lambda o: o.x))(Odd(jnp.ones(2)))
    with pytest.raises(TypeError, match=r"Odd: aux\[0\]\[0\] holds a builtin_function"):
        exported.serialize()


def test_redefined_class_replaces_the_export_registration():
    def define():
        @dataclasses.dataclass
        class Again(qax.ImplicitArray):
            x: qax.ArrayValue

            def materialize(self):
                return self.x

        return Again

    first, second = define(), define()
    exported = jax.export.export(jax.jit(lambda v: v))(second(jnp.ones(2)))
    restored = jax.export.deserialize(exported.serialize())
    out = restored.call(second(jnp.ones(2)))
    assert type(out) is second and first is not second


def test_flax_bytes_roundtrip():
    params = _params()
    data = serialization.to_bytes(params)
    template = jax.tree_util.tree_map(jnp.zeros_like, params)
    back = serialization.from_bytes(template, data)
    _same_tree(back, params)
    state = serialization.to_state_dict(params)
    assert set(state["lora"]) == {"w", "a", "b"} and state["zero"] == {}


def test_flax_restore_reports_a_wrong_template():
    data = serialization.to_bytes({"p": make_lora(jax.random.key(0))})
    with pytest.raises(ValueError, match="lacks the field"):
        serialization.from_bytes({"p": Tagged(jnp.zeros(5))}, data)


def test_flax_registration_waits_for_flax_import():
    """Types defined before Flax is imported are registered when it is."""
    code = textwrap.dedent(
        """
        import sys
        import dataclasses
        import jax.numpy as jnp
        import qax
        assert "flax" not in sys.modules

        @dataclasses.dataclass
        class Early(qax.ImplicitArray):
            x: qax.ArrayValue
            def materialize(self):
                return self.x

        import flax.serialization as fs
        from qax.symbols import SymbolicConstant
        p = {"e": Early(jnp.arange(3.0)), "c": SymbolicConstant(1.0, shape=(2,))}
        back = fs.from_bytes({"e": Early(jnp.zeros(3)), "c": p["c"]}, fs.to_bytes(p))
        assert type(back["e"]) is Early and back["e"].x.tolist() == [0.0, 1.0, 2.0]
        assert fs.is_serializable(SymbolicConstant)
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


# ----------------------------------------------------------------------------------------
# LoRA adapters (`qax.lora.split`) through every serializer (issue 42, item 6)


def _adapters():
    keys = jax.random.split(jax.random.key(3), 3)
    params = {
        "q": jax.random.normal(keys[0], (6, 4, 5)),
        "o": jax.random.normal(keys[1], (5, 6)),
        "bias": jnp.ones(6),
    }
    lora = qax.lora.loraify(
        params, 2, key=keys[2], alpha=3.0, rules=[("q", {"a_axes": (1,)})]
    )
    for name in ("q", "o"):  # non-zero `b`, so that the adapters count
        lora[name] = dataclasses.replace(lora[name], b=lora[name].b + 0.5)
    return qax.lora.split(lora)


def _adapter_model(adapters, base, x):
    p = qax.lora.combine(adapters, base)
    h = jnp.einsum("hd,dhe->he", x, p["q"]).sum(0)
    return h @ p["o"] + p["bias"]


def _same_adapters(got, want):
    is_adapter = lambda x: isinstance(x, qax.lora.LoraAdapter)  # noqa: E731
    assert jax.tree.structure(got, is_leaf=is_adapter) == jax.tree.structure(
        want, is_leaf=is_adapter
    )
    for u, v in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_flax_bytes_roundtrip_of_lora_adapters():
    adapters, _ = _adapters()
    state = serialization.to_state_dict(adapters)
    assert set(state["q"]) == {"a", "b"}
    data = serialization.to_bytes(adapters)
    back = serialization.from_bytes(jax.tree.map(jnp.zeros_like, adapters), data)
    _same_adapters(back, adapters)
    assert back["q"].a_axes == (1,) and back["q"].alpha == 3.0


def test_export_of_a_function_over_lora_adapters_serializes():
    adapters, base = _adapters()
    x = jnp.ones((4, 6))
    f = jax.jit(qax.use_implicit_args(_adapter_model))
    exported = jax.export.export(f)(adapters, base, x)
    restored = jax.export.deserialize(exported.serialize())
    assert restored.in_tree == exported.in_tree
    dense = qax.lora.merge(qax.lora.combine(adapters, base))
    want = jnp.einsum("hd,dhe->he", x, dense["q"]).sum(0) @ dense["o"] + dense["bias"]
    assert_close(restored.call(adapters, base, x), want, rtol=1e-5, atol=1e-5)
