"""The LoRA fine-tuning walk-through (`notebooks/lora_finetune.py`) at a tiny size."""

import importlib
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qax

# Whole models and documents on qax's machinery: no leak checking (tests/conftest.py).
pytestmark = pytest.mark.no_leak_check

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "notebooks" / "lora_finetune.py"
TINY = [
    "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
    "--batch-size", "8", "--rank", "2", "--lr", "2e-2",
]  # fmt: skip


@pytest.fixture
def walkthrough(monkeypatch):
    """The script, imported the way `python notebooks/...` sees it, and its models."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    sys.modules.pop("lora_finetune", None)
    yield (
        importlib.import_module("lora_finetune"),
        importlib.import_module("qax.examples.models"),
    )
    sys.modules.pop("lora_finetune", None)


def test_loss_falls_and_frozen_weights_are_bitwise_unchanged(walkthrough):
    lora_finetune, models = walkthrough
    result = lora_finetune.main([*TINY, "--steps", "60", "--seed", "3", "--quiet"])

    losses = np.asarray(result.losses)
    assert len(losses) == 60 and np.all(np.isfinite(losses))
    assert losses[-10:].mean() < losses[:10].mean() - 0.3, losses
    assert result.val_after < result.val_before - 0.3

    # Rebuild the base model from the seed, independently of the script's own check.
    model = models.GPT(result.config)
    ids = jnp.zeros((1, result.config.max_len), jnp.int32)
    base = models.random_variables(model, ids, seed=3)["params"]
    final = result.params
    kernels = 0
    for path, before in jax.tree_util.tree_flatten_with_path(base)[0]:
        after = final
        for key in path:
            after = after[key.key]
        if isinstance(after, qax.lora.LoraWeight):
            kernels += 1
            assert np.any(np.asarray(after.b) != 0), (
                f"LoRA factor b never trained at {path}"
            )
            after = after.w
        after = np.asarray(after)
        assert (
            after.dtype == before.dtype
            and after.tobytes() == np.asarray(before).tobytes()
        )
    assert kernels == 4  # c_attn, attn c_proj, c_fc, mlp c_proj of the single block
    assert result.frozen_unchanged

    lora = [x for x in jax.tree_util.tree_leaves(final, is_leaf=lora_finetune.is_lora)]
    factors = sum(x.a.size + x.b.size for x in lora if lora_finetune.is_lora(x))
    assert result.trainable == factors
    assert result.total == factors + sum(
        x.size for x in jax.tree_util.tree_leaves(base)
    )
    # Adam keeps two moments per trainable number, and nothing for the frozen ones.
    assert 2 * 4 * factors <= result.opt_state_bytes < 2 * 4 * factors + 64
    assert result.merge_error < 1e-4


def test_command_line_prints_progress_and_summary():
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--steps", "4", "--log-every", "2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout + run.stderr
    assert "LoRA fine-tuning" in out and "4/4" in out  # the progress bar
    assert "step     2  loss" in out
    for line in ("trainable params", "optimizer state", "step time", "frozen weights"):
        assert line in run.stdout
    assert "bitwise unchanged" in run.stdout


def test_qlora_on_a_4_bit_base(walkthrough):
    lora_finetune, _ = walkthrough
    result = lora_finetune.main(
        [*TINY, "--steps", "30", "--seed", "1", "--quiet", "--quantize", "nf4"]
    )
    losses = np.asarray(result.losses)
    assert np.all(np.isfinite(losses))
    assert losses[-5:].mean() < losses[:5].mean() - 0.2, losses
    kernels = [
        x.w
        for x in jax.tree_util.tree_leaves(result.params, is_leaf=lora_finetune.is_lora)
        if lora_finetune.is_lora(x)
    ]
    assert len(kernels) == 4
    assert all(isinstance(k, qax.quant.NF4Weight) for k in kernels)
    assert result.base_bytes < 0.5 * result.dense_bytes
    assert result.frozen_unchanged
    assert result.merge_error < 1e-4


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--d-model", "30", "--heads", "4"],
            "--d-model (30) must be a multiple of --heads (4)",
        ),
        (["--rank", "0"], "argument --rank: must be at least 1, got 0"),
        (["--corpus", "no/such/file.txt"], "--corpus: no file at no/such/file.txt"),
    ],
    ids=["width-not-divisible", "zero-rank", "missing-corpus"],
)
def test_bad_flags_are_rejected_with_a_reason(walkthrough, capsys, flags, message):
    lora_finetune, _ = walkthrough
    with pytest.raises(SystemExit):
        lora_finetune.parse_args(flags)
    assert message in capsys.readouterr().err
