"""benchmarks/bench_big_qlora.py keeps working: run it at its tiny size in a subprocess.

The full size (3e9 parameters) takes minutes and several GB; the tiny one takes seconds
and goes through the same code: the layer-by-layer NF4 build, the stacked LoRA factors
under `lax.scan` + `jax.checkpoint`, the dense step's compiled memory analysis, the QLoRA
train steps and both tables.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_big_qlora.py"


def test_bench_big_qlora_runs_at_tiny_size():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_CHECK_TRACER_LEAKS", None)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "tiny", "--depth", "2"]
        + ["--steps", "3", "--layers", "1", "--quantize-layers", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    # Three losses, going down (the script also checks this and exits non-zero).
    losses = re.search(r"loss over 3 QLoRA steps: (.*)", text).group(1)
    values = [float(x) for x in losses.split(", ")]
    assert len(values) == 3 and values[-1] < values[0]
    assert "- loss went down: True" in text
    # The main table: dense f32 vs QLoRA, with the compiled memory of both.
    for row in (
        "parameters",
        "optimizer state (adam)",
        "compiled step: temps",
        "peak resident memory of the process",
        "seconds per train step",
    ):
        assert re.search(rf"^\| {re.escape(row)} ", text, re.M), row
    needs = re.search(r"dense fine-tuning needs ([\d.]+) MB", text)
    assert needs and float(needs.group(1)) > 0
    # quantize(dense) measured in child processes, without and with donate.
    for row in ("quantize(dense, 'nf4')", "quantize(dense, 'nf4', donate=True)"):
        assert re.search(rf"^\| {re.escape(row)} +\| ", text, re.M), row
    # The scaling table has a row per depth.
    assert re.search(r"^\| 1 +\|", text, re.M) and re.search(r"^\| 2 +\|", text, re.M)


def _bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_big_qlora
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return bench_big_qlora


def test_layer_by_layer_build_is_the_quantized_dense_model():
    """Layer i of the stacks holds exactly the codes of the dense model's layer i, and
    the QLoRA model (b = 0) computes the dequantized dense model's loss."""
    import dataclasses

    import jax
    import numpy as np

    import qax

    bench = _bench()
    cfg = dataclasses.replace(bench.SIZES["tiny"], n_layers=3)
    key = jax.random.key(0)
    built = bench.nf4_params(cfg, key)
    dense = bench.dense_params(cfg, key)
    want = qax.quant.quantize(
        dense,
        "nf4",
        block_size=bench.BLOCK_SIZE,
        filter=lambda path, leaf: path.split("/")[-1] in bench.LAYER_MATRICES,
        batch_ndim=1,
    )
    want = {
        **want,
        "wte": qax.quant.NF4Weight.from_array(dense["wte"], block_size=64),
        "head": qax.quant.NF4Weight.from_array(dense["head"], block_size=64),
    }
    got_leaves, got_def = jax.tree_util.tree_flatten(built)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves, strict=True):
        # Codes exactly; scales up to rounding (0.02 * normal may fuse differently).
        if np.issubdtype(g.dtype, np.integer):
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-6)

    tokens = jax.random.randint(jax.random.key(2), (2, cfg.seq + 1), 0, cfg.vocab)
    params = bench.add_lora(cfg, built, jax.random.key(1))
    loss = bench.make_loss(cfg, bench.dense_linear, scan=True)
    got = jax.jit(qax.use_implicit_args(loss))(params, tokens)
    np.testing.assert_allclose(
        got, loss(qax.quant.dequantize(built), tokens), rtol=1e-5
    )
