"""The composition matrix: every adapter type over every base format under every
transformation, against the merged dense model, with nothing materialized.

Adapter types (`ADAPTERS`) and base formats (`BASES`) are written once each: a LoRA
adapter has one set of handlers, a format has one, and no handler is written for a pair.
Each cell runs the implicit model and the dense model merged from the same parameters
(`qax.lora.merge`) and compares outputs (or gradients of the adapters), under
``qax.materialization_policy(qax.ImplicitArray, "error")``. The documentation's table
(`docs/guides/lora-qlora.md`, written by `docs/hooks.py`) is generated from these
constants, so it can only list cells this file runs.

Cheap on purpose: one jitted program per pair runs the `jit`, `grad`, `vmap`, `scan` and
`remat` cells together; the `mesh` column runs every adapter over one format of each
family (`MESH_BASES`) in one child process with 8 simulated devices (a 2x4 mesh, the
base weights sharded over both axes). On the oldest supported JAX (the suite's slowest
leg) the cells run for `MESH_BASES` only and the mesh column for two formats.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax
from qax import lora, quant
from tests.helpers import run_on_eight_devices

ALL = lambda *_: True  # noqa: E731
D_IN, D_OUT, LAYERS = 32, 64, 2
IDS = (0, 1, -1, 1)  # the bank's adapter per example (-1: the base alone)
MESH = os.environ.get("QAX_COMPOSITION_MESH") == "1"

ADAPTERS = ("LoRA", "DoRA", "LoRA bank", "DoRA bank")
TRANSFORMS = ("jit", "grad", "vmap", "scan", "remat", "mesh")


def _format(name, **options):
    def build(w, nb):
        return quant.quantize(w, name, filter=ALL, batch_ndim=nb, **options)

    return build


BASES = {
    "float32": lambda w, nb: w,
    "bfloat16": lambda w, nb: w.astype(jnp.bfloat16),
    "int8": _format("int8"),
    # int2..int8 packed are one class (`IntKWeight`, any bits): its ends and an odd
    # width stand for all.
    **{f"int{k} packed": _format(f"int{k}", group_size=32) for k in (2, 3)},
    "int8 packed": _format(quant.IntKWeight, bits=8, group_size=32),
    "int4": _format("int4", group_size=32),
    "nf4": _format("nf4", block_size=32),
    "nf4_dq": _format("nf4_dq", block_size=32),
    "fp8_e4m3": _format("fp8_e4m3"),
    "fp8_e5m2": _format("fp8_e5m2", block_size=32),
    "mxfp4": _format("mxfp4"),
    "nvfp4": _format("nvfp4"),
    "FakeQuant (QAT)": lambda w, nb: qax.qat.fake_quantize(
        w, "int4", filter=ALL, group_size=32, batch_ndim=nb
    ),
}


def _trained(x):
    """The same weight type with nonzero ``b`` (as after training)."""
    fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x) if f.init}
    noise = jax.random.normal(jax.random.key(7), x.b.shape, jnp.float32)
    return type(x)(**{**fields, "b": x.b + (0.1 * noise).astype(x.b.dtype)})


def _adapters(kind, base, nb):
    """``(adapters, frozen)``: what an optimizer sees and the rest; `_params` puts
    them together."""
    leaf = lambda x: isinstance(x, (lora.LoraWeight, lora.DoraWeight))  # noqa: E731
    if kind.endswith("bank"):
        trees = []
        for seed, rank in ((1, 4), (2, 2)):
            one = lora.loraify(
                {"w": base},
                rank,
                key=jax.random.key(seed),
                alpha=8.0,
                batch_ndim=nb,
                dora=kind == "DoRA bank",
            )
            trees.append(
                lora.split(jax.tree_util.tree_map(_trained, one, is_leaf=leaf))
            )
        return [t for t, _ in trees], trees[0][1]
    p = lora.loraify(
        {"w": base},
        4,
        key=jax.random.key(1),
        alpha=8.0,
        dora=kind == "DoRA",
        batch_ndim=nb,
    )
    return lora.split(jax.tree_util.tree_map(_trained, p, is_leaf=leaf))


def _params(kind, adapters, frozen):
    if kind.endswith("bank"):
        return lora.bank(frozen, adapters)["w"]
    return lora.combine(adapters, frozen)["w"]


def _layer(w, x):
    return jnp.tanh(x @ w)


def _scanned(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w[:, :D_IN]), None  # an output slice of each layer

    return jax.lax.scan(body, x, ws)[0]


def _stacked(ws, x):
    return jax.vmap(_layer, in_axes=(0, None))(ws, x)


def _run(kind, model, w, x, out_axes=0):
    """``model(w, x)``: on implicit arrays, or per example over a bank."""
    if kind.endswith("bank"):
        ids = jnp.array(IDS)
        return lora.per_example(model, out_axes=out_axes)(ids, w, x)
    return qax.use_implicit_args(model)(w, x)


def _dense_run(kind, model, w, dense, x, out_axes=0):
    """The oracle: the model on the merged dense weight (for a bank, each example on
    its own adapter's merged weight, or on the base)."""
    if not kind.endswith("bank"):
        return model(dense, x)
    base = qax.materialize_nested(w.w, full=True).astype(dense.dtype)
    rows = [
        model(dense[i] if i >= 0 else base, jnp.take(x, jnp.array([j]), axis=0))
        for j, i in enumerate(IDS)
    ]
    return jnp.concatenate(rows, axis=out_axes)


def _programs(kind, fmt):
    """The implicit and the dense program of one pair: each returns every cell's
    outputs (and adapter gradients) from one call."""
    w1 = jax.random.normal(jax.random.key(0), (D_IN, D_OUT)) / 6
    wl = jax.random.normal(jax.random.key(3), (LAYERS, D_IN, D_OUT)) / 6
    x = jax.random.normal(jax.random.key(4), (len(IDS), D_IN))
    one = _adapters(kind, BASES[fmt](w1, 0), 0)
    stack = _adapters(kind, BASES[fmt](wl, 1), 1)

    def cells(run, one, stack):
        def loss(adapters, frozen, remat):
            model = jax.checkpoint(_layer) if remat else _layer
            return jnp.sum(run(model, _params(kind, adapters, frozen), x) ** 2)

        return {
            "jit": run(_layer, _params(kind, *one), x),
            "grad": jax.grad(loss)(*one, False),
            "vmap": run(_stacked, _params(kind, *stack), x, 1),
            "scan": run(_scanned, _params(kind, *stack), x),
            "remat": jax.grad(loss)(*one, True),
        }

    def implicit(one, stack):
        return cells(lambda m, w, x, ax=0: _run(kind, m, w, x, ax), one, stack)

    def dense(one, stack):
        def run(model, w, x, ax=0):
            return _dense_run(kind, model, w, lora.merge({"w": w})["w"], x, ax)

        return cells(run, one, stack)

    return implicit, dense, one, stack


def _check(kind, fmt, cell, got, want):
    """Every leaf of ``got`` against ``want`` (bfloat16 bases to bfloat16's precision)."""
    tol = 3e-2 if fmt == "bfloat16" else 2e-4
    g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(g) == len(w), (kind, fmt, cell)
    for a, b in zip(g, w, strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32),
            np.asarray(b, np.float32),
            rtol=tol,
            atol=tol,
            err_msg=f"{kind} over {fmt}: {cell}",
        )


# The mesh column (a child process, 8 devices): every adapter over one format of each
# family (dense, per-channel codes, packed blocks, 4-bit floats, QAT).
MESH_BASES = (
    "float32",
    "int8",
    "int3 packed",
    "nf4",
    "fp8_e4m3",
    "nvfp4",
    "FakeQuant (QAT)",
)
# On the oldest JAX the suite's slowest leg runs one format of each family (the
# handlers are the same code on every JAX; the newest runs every format).
OLDEST = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 11)
PAIRS = [
    (kind, fmt) for kind in ADAPTERS for fmt in BASES if fmt in MESH_BASES or not OLDEST
]
MESH_PAIRS = [
    (kind, fmt)
    for kind in ADAPTERS
    for fmt in (("float32", "nf4") if OLDEST else MESH_BASES)
]


@pytest.mark.parametrize("kind, fmt", PAIRS, ids=[f"{k}-{f}" for k, f in PAIRS])
def _cell(kind, fmt):
    implicit, dense, one, stack = _programs(kind, fmt)
    with qax.materialization_policy(qax.ImplicitArray, "error"):
        got = jax.jit(implicit)(one, stack)
    want = jax.jit(dense)(one, stack)
    for cell in TRANSFORMS[:-1]:
        _check(kind, fmt, cell, got[cell], want[cell])


def _on_mesh(kind, fmt):
    """The `jit` and `grad` cells on a 2x4 mesh: the base weight sharded over both
    axes (its codes and scales as `qax.sharding` derives them), the batch over
    "data", the adapters replicated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    implicit, dense, one, stack = _programs(kind, fmt)
    adapters, frozen = one
    spec = P("data", "model")
    base = frozen["w"]
    if isinstance(base, lora.DoraBase):  # DoRA's base keeps ‖w‖² per output unit
        shardings = lora.DoraBase(
            qax.sharding.implicit_shardings(base.w, spec, mesh),
            NamedSharding(mesh, P("model")),
        )
    else:
        shardings = qax.sharding.implicit_shardings(base, spec, mesh)
    frozen = {"w": jax.device_put(base, shardings)}
    # The adapters are small: replicated, as FSDP QLoRA recipes keep them.
    adapters = jax.device_put(adapters, NamedSharding(mesh, P()))
    x = jax.device_put(
        jax.random.normal(jax.random.key(4), (len(IDS), D_IN)),
        NamedSharding(mesh, P("data")),
    )

    def cells(run):
        def loss(adapters, frozen):
            return jnp.sum(run(_layer, _params(kind, adapters, frozen), x) ** 2)

        return {
            "jit": run(_layer, _params(kind, adapters, frozen), x),
            "grad": jax.grad(loss)(adapters, frozen),
        }

    with qax.materialization_policy(qax.ImplicitArray, "error"):
        got = jax.jit(lambda: cells(lambda m, w, x: _run(kind, m, w, x)))()
    want = jax.jit(
        lambda: cells(
            lambda m, w, x: _dense_run(kind, m, w, lora.merge({"w": w})["w"], x)
        )
    )()
    _check(kind, fmt, "mesh", got, want)


@pytest.mark.parametrize(
    "kind, fmt", MESH_PAIRS, ids=[f"{k}-{f}" for k, f in MESH_PAIRS]
)
def _mesh_cell(kind, fmt):
    assert jax.device_count() == 8
    _on_mesh(kind, fmt)


def _mesh_column():
    """The `mesh` column: `MESH_PAIRS` on a 2x4 mesh of simulated CPU devices."""
    out = run_on_eight_devices(
        "-x", "-k", "test_mesh_cell", __file__, env={"QAX_COMPOSITION_MESH": "1"}
    )
    assert f"{len(MESH_PAIRS)} passed" in out, out[-2000:]


# The parent collects the cells and the mesh column; the child (8 devices) only the
# mesh cells.
if MESH:
    test_mesh_cell = _mesh_cell
else:
    test_cell = _cell
    test_mesh_column = _mesh_column
