"""Every ``>>>`` example in qax's docstrings runs (issue 40, item 5).

The examples of one docstring run in order, in one namespace: the globals of the module
that holds them, JAX and NumPy, and the names the examples use without defining them
(`LoraMatrix`, `lora`, `params`, `loss_fn`, ...), built afresh for each docstring, so
that a handler or a policy an example registers stays with its own throwaway types.
Examples that need what a test cannot give (several devices, a checkpoint directory)
are plain code blocks that say so. Printed and expected output is not compared: an
example fails its test when it raises.
"""

import ast
import dataclasses
import importlib
import pathlib
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import qax
from qax import _audit

PACKAGE = pathlib.Path(qax.__file__).parent


def _docstrings() -> list[tuple[str, str, int, str]]:
    """(module, object name, line, docstring) for every docstring with ``>>>``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            ):
                doc = ast.get_docstring(node, clean=True)
                if doc and ">>>" in doc:
                    line = node.body[0].lineno
                    found.append((module, getattr(node, "name", "<module>"), line, doc))
    return found


def _source(doc: str) -> str:
    """The code of a docstring's ``>>>`` and ``...`` lines, in order."""
    lines = []
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.startswith((">>> ", "... ")) or stripped in (">>>", "..."):
            lines.append(stripped[4:])
    return "\n".join(lines)


def _names() -> dict:
    """The names the examples use without defining them (fresh types each time)."""

    @dataclass
    class LoraMatrix(qax.ImplicitArray):
        w: qax.ArrayValue = qax.array_field(ndim=2)
        a: qax.ArrayValue = qax.array_field(ndim=2)
        b: qax.ArrayValue = qax.array_field(ndim=2)

        def materialize(self):
            return self.w + self.a @ self.b.T

    @qax.primitive_handler("dot_general")
    def _lora_matmul(primitive, x: jax.Array, w: LoraMatrix, **params):
        if params["dimension_numbers"] != (((x.ndim - 1,), (0,)), ((), ())):
            return NotImplemented
        return x @ w.w + (x @ w.a) @ w.b.T

    class Zeros(qax.ImplicitArray):
        default_dtype = jnp.float32

        def materialize(self):
            return jnp.zeros(self.shape, self.dtype)

    @dataclass
    class Blocked(qax.ImplicitArray):
        x: qax.ArrayValue
        block_size: int = qax.aux_field(default=4)

        def materialize(self):
            return self.x

    keys = jax.random.split(jax.random.key(0), 4)
    w, a, b = jnp.ones((6, 5)), jnp.ones((6, 2)), jnp.zeros((5, 2))
    x = jnp.ones((3, 6))
    lora = LoraMatrix(w, a, b)
    params = {
        "layers": [{"attn": {"kernel": jax.random.normal(keys[0], (64, 128))}}],
        "out": {"head": {"kernel": jax.random.normal(keys[1], (128, 64))}},
    }

    def loss_fn(params, batch):
        h = batch @ params["layers"][0]["attn"]["kernel"]
        return jnp.mean((h @ params["out"]["head"]["kernel"]) ** 2)

    def model(x, w):
        return x @ w

    names = dict(
        jax=jax,
        jnp=jnp,
        np=np,
        lax=lax,
        qax=qax,
        optax=optax,
        dataclass=dataclass,
        dataclasses=dataclasses,
        P=P,
        LoraMatrix=LoraMatrix,
        Zeros=Zeros,
        Blocked=Blocked,
        w=w,
        a=a,
        b=b,
        a2=2 * a,
        b2=2 * b,
        x=x,
        lora=lora,
        key=keys[2],
        k=keys[3],
        f=qax.use_implicit_args(model),
        model=model,
        params=params,
        loss_fn=loss_fn,
        batch=jnp.ones((2, 64)),
        db=jnp.ones((5, 2)),
        SymbolicConstant=qax.symbols.SymbolicConstant,
    )
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    names.update(grads=grads, updates=grads)
    adapters, base = qax.lora.split(qax.lora.loraify(params, 4, key=keys[2]))
    names.update(adapters=adapters, base=base)
    names["trained"] = qax.qat.fake_quantize(params, "int4", group_size=32)
    return names


def _flax_names(names: dict, tmp_path) -> dict:
    """A Flax NNX linear layer with LoRA factors, and a loss of it."""
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    kernel = model.kernel.get_value()
    model.kernel.set_value(
        qax.lora.LoraWeight(kernel, jnp.ones((4, 2)), jnp.zeros((2, 3)))
    )

    def loss_fn(model, x, y):
        return jnp.mean((qax.use_implicit_args(model)(x) - y) ** 2)

    lora = qax.nnx.holds(qax.lora.LoraWeight)
    return names | dict(
        nnx=nnx,
        model=model,
        loss_fn=loss_fn,
        loss=lambda model: loss_fn(model, jnp.ones((2, 4)), jnp.zeros((2, 3))),
        x=jnp.ones((2, 4)),
        y=jnp.zeros((2, 3)),
        lora=lora,
        LoraWeight=qax.lora.LoraWeight,
        a=jnp.ones((4, 2)),
        b=jnp.zeros((3, 2)),
    )


def _checkpoint_names(names: dict, tmp_path) -> dict:
    ocp = pytest.importorskip("orbax.checkpoint")
    state = {"w": names["lora"], "z": qax.symbols.SymbolicConstant(0.0, shape=(2,))}
    return names | dict(ocp=ocp, path=tmp_path / "ckpt", state=state)


def _qat_names(names: dict, tmp_path) -> dict:
    qat = qax.qat.fake_quantize(names["params"], "int4", group_size=32)

    def model(params, x):
        h = x @ params["layers"][0]["attn"]["kernel"]
        return h @ params["out"]["head"]["kernel"]

    updates = jax.tree_util.tree_map(jnp.zeros_like, qat)
    return names | dict(model=model, x=jnp.ones((2, 64)), updates=updates)


def _quant_names(names: dict, tmp_path) -> dict:
    nn = pytest.importorskip("flax.linen")
    model = nn.Dense(64)
    x = jnp.ones((2, 128))
    params = model.init(jax.random.key(0), x)["params"]
    return names | dict(model=model, x=x, params=params)


def _sharding_names(names: dict, tmp_path) -> dict:
    @dataclass
    class LoraMatrix(qax.ImplicitArray):
        w: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, 1))
        a: qax.ArrayValue = qax.array_field(ndim=2, follows=(0, None))
        b: qax.ArrayValue = qax.array_field(ndim=2, follows=(1, None))

        def materialize(self):
            return self.w + self.a @ self.b.T

    return names | dict(LoraMatrix=LoraMatrix, lora=LoraMatrix(*map(names.get, "wab")))


def _optax_names(names: dict, tmp_path) -> dict:
    params = {"w": names["lora"], "b": jnp.ones(5)}
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    return names | dict(params=params, grads=grads)


def _bank_names(names: dict, tmp_path) -> dict:
    """Two fine-tunes of `params` (ranks 4 and 2), a model with an ``apply``, and a
    decode step with a cache."""
    import types

    params = names["params"]
    found = []
    for r, seed in ((4, 1), (2, 2)):
        lora = qax.lora.loraify(params, r, key=jax.random.key(seed), alpha=8.0)
        found.append(qax.lora.split(lora))
    (adapters_a, base), (adapters_b, _) = found

    def apply(params, x):
        h = x @ params["layers"][0]["attn"]["kernel"]
        return h @ params["out"]["head"]["kernel"]

    def decode(params, token, cache, position):
        out = apply(params, token)
        return out, cache.at[:, position].set(out[:, 0])

    served = qax.lora.bank(base, [adapters_a, adapters_b])
    return names | dict(
        model=types.SimpleNamespace(apply=apply),
        base=base,
        adapters=adapters_a,
        adapters_a=adapters_a,
        adapters_b=adapters_b,
        other_adapters=adapters_b,
        served=served,
        x=jnp.ones((3, 64)),
        tokens=jnp.ones((4, 64)),
        decode=decode,
        token=jnp.ones((4, 1, 64)),
        cache=jnp.zeros((4, 8, 64)),
        position=3,
    )


# Names that one module's examples use differently.
MODULE_NAMES = {
    "qax.lora._bank": _bank_names,
    "qax.lora._per_example": _bank_names,
    "qax.lora._params": _bank_names,
    "qax._optax": _optax_names,
    "qax.checkpoint": _checkpoint_names,
    "qax.nnx": _flax_names,
    "qax.qat._params": _qat_names,
    "qax.quant._params": _quant_names,
    "qax.sharding": _sharding_names,
}
DOCSTRINGS = _docstrings()


@pytest.mark.parametrize(
    ("module", "name", "line", "doc"),
    DOCSTRINGS,
    ids=[f"{m}.{n}" for m, n, _, _ in DOCSTRINGS],
)
def test_docstring_examples_run(module, name, line, doc, tmp_path):
    namespace = dict(vars(importlib.import_module(module)))
    namespace |= _names()
    if module in MODULE_NAMES:
        namespace = MODULE_NAMES[module](namespace, tmp_path)
    rules = dict(_audit._global_rules)  # a policy set as a statement is undone below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # qax's own warnings
            warnings.simplefilter("ignore", qax.MaterializationWarning)
            code = compile(_source(doc), f"{module}.{name} (line {line})", "exec")
            exec(code, namespace)
    finally:
        _audit._global_rules.clear()
        _audit._global_rules.update(rules)


def test_every_example_is_collected():
    # The collection finds the examples of public and private modules alike.
    modules = {m for m, *_ in DOCSTRINGS}
    assert {"qax._dispatch", "qax.symbols", "qax.quant._types"} <= modules
