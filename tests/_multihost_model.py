"""The model, sizes and parameters shared by `_multihost_worker.py` (in every process of
a run) and `test_multihost.py` (which restores the runs' checkpoints in its own
process). Importing it starts no JAX backend."""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np

import qax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_sharded as bs  # noqa: E402
from bench_lora import Config, init_params  # noqa: E402

# The sizes of `tests/_sharded_training_cases.py`: rank 3 and 96 tokens, so that the
# base weights' gathers are told apart by their shapes.
CFG = Config(
    n_layers=1, d_model=32, n_heads=4, d_ff=64, vocab=96, seq=8, batch=8, rank=3
)
BLOCK = 8
# Each layout with LoRA and QLoRA, each QLoRA format in FSDP (its codes gathered);
# `case_build` trains LoRA over NF4 under FSDP too.
TRAIN_CASES = [
    ("lora", "megatron"),
    ("int8", "fsdp"),
    ("int8", "megatron"),
    ("nf4", "fsdp"),
]


def dense_params(seed: int = 0, stacked: bool = False) -> dict:
    """Host-made parameters of `init_params`' structure (the same in every process)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: init_params(CFG, jax.random.PRNGKey(0), stacked))

    def init(path, x):
        name = getattr(path[-1], "key", None)
        if name == "scale":
            return np.ones(x.shape, x.dtype)
        if name in ("bias", "b1", "b2"):
            return np.zeros(x.shape, x.dtype)
        return (0.02 * rng.standard_normal(x.shape)).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(init, shapes)


def params(kind: str) -> tuple[dict, dict]:
    dense = dense_params()
    implicit = bs.with_lora(
        dense, kind, np.random.default_rng(1), CFG.rank, block=BLOCK
    )
    return dense, implicit


def checkpoint_tree(mesh):
    """A QLoRA int8 (Megatron) and an NF4 (FSDP) weight and a dense bias, placed."""
    out, shardings = {}, {}
    for kind, layout in (("int8", "megatron"), ("nf4", "fsdp")):
        dense, implicit = params(kind)
        specs, _ = bs.dense_specs(dense, layout)
        sh = qax.sharding.implicit_shardings(implicit, specs, mesh)
        mlp, mlp_sh = implicit["layers"][0]["mlp"], sh["layers"][0]["mlp"]
        out[kind] = {"w1": mlp["w1"], "w2": mlp["w2"], "b2": mlp["b2"]}
        shardings[kind] = {"w1": mlp_sh["w1"], "w2": mlp_sh["w2"], "b2": mlp_sh["b2"]}
    return out, shardings
