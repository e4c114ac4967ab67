"""GPTQ and AWQ (`qax.quant.gptq` / `awq`) beside round-to-nearest and qwix's GPTQ/AWQ.

The model is the trained NNX transformer of the calibration tests
(`tests/_calibration_model.py`: `qax.examples.nnx_transformer`, 2 layers, width 64,
trained with Adam on the walk-through's corpus, characters as tokens). Calibration:
4 batches of 16 windows of 32 tokens of the training text (`qax.quant.calibrate`, the
model unchanged). Measured on 64 evenly spaced windows of the whole corpus: the
logits' relative error against the float model (``|Δlogits| / |logits|``) and the
loss increase, with every einsum and MLP kernel quantized (the tied embedding and
the norms stay float), groups of 32 along the input axis (``block_axis=-2``, the
layout qwix's GPTQ uses: ``tiled_axes`` on the contraction axis).

qwix (when installed) gets the very same weights and the very statistics qax
collected, through its own algorithms (`qwix.contrib.gptq_core.quantize_weight`,
`qwix.contrib.awq_core.quantize_weight`); its AWQ keeps its per-input-channel factors
beside the weight (they divide the activations in qwix's AWQ model), which here are
folded into the weight it stands for, dequantized. Times: quantizing all the weights
(first call: tracing and compiling included; then the same call again).

Run from the repository root (``--quick``: fewer training steps):

    PYTHONPATH=. python benchmarks/bench_calibrate.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _timing import markdown_table  # noqa: E402

import qax  # noqa: E402
from qax.quant import _gptq_awq as C  # noqa: E402
from tests import _calibration_model as M  # noqa: E402

GROUP = 32


def load_qwix() -> Any:
    try:
        from qwix._src.core import qarray
        from qwix.contrib import awq_core, gptq_core
    except Exception as e:  # noqa: BLE001  (any failure: qwix is optional)
        print(f"\nnote: qwix's GPTQ/AWQ are not importable ({e}); qax alone\n")
        return None
    return qarray, gptq_core, awq_core


def qwix_qtype(fmt: str) -> Any:
    return {"int4": jnp.int4, "int3": "int3", "int8": jnp.int8}.get(fmt)


def qwix_method(qwix: Any, method: str, fmt: str, params: Any, stats: dict) -> Any:
    """``params`` with every weight in ``stats`` replaced by the dense weight qwix's
    GPTQ or AWQ gives for it (with qax's statistics)."""
    qarray, gptq_core, awq_core = qwix
    how = qarray.HowToQuantize(
        qtype=qwix_qtype(fmt), channelwise_axes=(0,), tiled_axes={1: GROUP}
    )

    def one(path, leaf):
        name = qax.utils.path_string(path)
        st = stats.get(name)
        if st is None or leaf.shape[st.axes[0]] % GROUP:
            return leaf
        w = C._to_matrix(jnp.asarray(leaf), 0, st.axes).T  # (out, in)
        if method == "gptq":
            h = jnp.asarray(st.hessian, jnp.float32)
            qw, _ = gptq_core.quantize_weight(w, h, how, blocksize=128)
            dense = qarray.dequantize(qw)
        else:
            scale_in = jnp.asarray(st.mean_abs, jnp.float32)
            qw, s = awq_core.quantize_weight(w, scale_in, how)
            dense = qarray.dequantize(qw) / s
        return C._from_matrix(dense.T, leaf.shape, 0, st.axes)

    return jax.tree_util.tree_map_with_path(one, params)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 training steps")
    args = parser.parse_args(argv)
    steps = 100 if args.quick else 300
    qwix = load_qwix()
    graphdef, params, rest = M.trained(steps)
    f = M.logits_fn(graphdef, rest)
    train, held = M.tokens()
    calib = [jnp.asarray(M.windows(train, 16, seed=1000 + i)[:, :-1]) for i in range(4)]
    start = time.perf_counter()
    stats = qax.quant.calibrate(f, params, calib)
    calib_time = time.perf_counter() - start
    tokens = jnp.asarray(M.windows(np.concatenate([train, held]), 64))
    run = jax.jit(qax.use_implicit_args(f))
    reference = run(params, tokens[:, :-1])

    def loss(logits):
        logp = jax.nn.log_softmax(logits, -1)
        return float(-jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1)))

    f32 = loss(reference)
    rows = []
    options = {"group_size": GROUP, "block_axis": -2}
    for fmt in ("int4", "int3"):
        methods = {
            "round to nearest": lambda fmt=fmt: qax.quant.quantize(
                params, fmt, **options
            ),
            "qax GPTQ": lambda fmt=fmt: qax.quant.gptq(params, stats, fmt, **options),
            "qax AWQ": lambda fmt=fmt: qax.quant.awq(params, stats, fmt, **options),
        }
        if qwix is not None and qwix_qtype(fmt) is not None:
            methods["qwix GPTQ"] = lambda fmt=fmt: qwix_method(
                qwix, "gptq", fmt, params, stats
            )
            methods["qwix AWQ"] = lambda fmt=fmt: qwix_method(
                qwix, "awq", fmt, params, stats
            )
        for name, make in methods.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a kernel left float
                try:
                    times = []
                    for _ in range(2):
                        t0 = time.perf_counter()
                        out = jax.block_until_ready(make())
                        times.append(time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:90]
                    rows.append([fmt, name, f"failed ({why})", "", "", ""])
                    continue
            logits = run(out, tokens[:, :-1])
            err = float(
                jnp.linalg.norm(logits - reference) / jnp.linalg.norm(reference)
            )
            rows.append(
                [
                    fmt,
                    name,
                    f"{err:.4f}",
                    f"{loss(logits) - f32:+.4f}",
                    f"{times[0]:.2f} s",
                    f"{times[1]:.2f} s",
                ]
            )
    print(
        f"\nJAX {jax.__version__}, {steps} training steps, float loss {f32:.4f}, "
        f"calibration {calib_time:.2f} s (4 batches, {len(stats)} weights)\n"
    )
    header = ["format", "method", "logits error", "loss increase", "first", "again"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
