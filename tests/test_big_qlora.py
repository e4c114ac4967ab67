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

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_big_qlora.py"


def test_bench_big_qlora_runs_at_tiny_size():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("JAX_CHECK_TRACER_LEAKS", None)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "tiny", "--depth", "2"]
        + ["--steps", "3", "--layers", "1"],
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
    # The scaling table has a row per depth.
    assert re.search(r"^\| 1 +\|", text, re.M) and re.search(r"^\| 2 +\|", text, re.M)
