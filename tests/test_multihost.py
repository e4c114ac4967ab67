"""Implicit arrays across processes: JAX's multi-controller runtime on localhost.

Two processes of 4 CPU devices each (gloo collectives, `jax.distributed.initialize`)
run `_multihost_worker.py` over one 2 x 4 mesh whose ``"data"`` axis runs across
them, so that every FSDP-sharded leaf is half in each process; one process of 8
devices runs the same worker as the reference. The launcher (`launch`) picks a free
port, and ends a run whose processes print nothing for `STALL` seconds (a hung
collective), or one of which fails, with every process's output in the error: the
suite never hangs. The two runs, launched side by side once (the module fixture
`runs`), serve every test; the tests compare their results.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import qax
from tests._multihost_model import TRAIN_CASES, checkpoint_tree

HERE = pathlib.Path(__file__).resolve().parent

WORKER = HERE / "_multihost_worker.py"
STALL = 60  # seconds without output from any process: a hung collective
TOTAL = 900  # seconds for a whole run
pytestmark = pytest.mark.no_leak_check  # the runs' own processes: no leak checks


class MultihostFailure(AssertionError):
    """A launched run failed, hung or timed out; the message holds its output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*runs: tuple, stall: float = STALL, total: float = TOTAL) -> list[dict]:
    """Start each run ``(out, processes, devices, *worker arguments)`` (the worker as
    `processes` processes of `devices` CPU devices each), all at once; return the
    results each run's process 0 wrote.

    Raises:
      MultihostFailure: a process exited with an error (every other is then ended:
        they would wait for it in a collective), no process printed anything for
        `stall` seconds, or the runs took longer than `total`; with every process's
        output.
    """
    procs, logs = [], []
    for out, processes, devices, *extra in runs:
        out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        for i in range(processes):
            logs.append(out / f"process{i}.log")
            with open(logs[-1], "wb") as sink:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(WORKER),
                            str(out),
                            f"--processes={processes}",
                            f"--process-id={i}",
                            f"--port={port}",
                            f"--devices={devices}",
                            *extra,
                        ],
                        cwd=HERE.parent,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                    )
                )
    start = last = time.monotonic()
    sizes: list[int] = []
    failure = None
    while failure is None:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            if any(codes):
                failure = f"exit codes {codes}"
            break
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes):
            failure = f"a process failed (exit codes {codes}); the others were ended"
        new = [log.stat().st_size for log in logs]
        if new != sizes:
            sizes, last = new, now
        elif now - last > stall:
            failure = (
                f"no output from any process for {stall:.0f} s (a hung collective?)"
            )
        if now - start > total:
            failure = f"the runs took over {total:.0f} s"
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    if failure:
        outputs = "\n".join(
            f"----- {log.parent.name}, {log.stem} -----\n"
            + log.read_text(errors="replace")[-6000:]
            for log in logs
        )
        raise MultihostFailure(f"{failure}\n{outputs}")
    return [json.loads((out / "results.json").read_text()) for out, *_ in runs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(one, two)``: the results and gathered arrays of the one-process 8-device
    run and of the 2 x 4 run (which restores the first's checkpoint)."""
    base = tmp_path_factory.mktemp("multihost")
    # side by side (the first saves its checkpoint first; the second restores it last)
    one, two = launch(
        (base / "one", 1, 8, "--cases=checkpoint,train,scan,build,entry_points"),
        (base / "two", 2, 4, f"--restore={base / 'one' / 'checkpoint'}"),
    )
    for run, name in ((one, "one"), (two, "two")):
        with np.load(base / name / "arrays.npz") as arrays:
            run["arrays"] = dict(arrays)
        run["dir"] = base / name
    return one, two


def _arrays(run: dict, prefix: str) -> dict:
    return {k: v for k, v in run["arrays"].items() if k.startswith(prefix)}


def _close(one: dict, two: dict, prefix: str, exact: bool = False) -> None:
    want, got = _arrays(one, prefix), _arrays(two, prefix)
    assert want and got.keys() == want.keys(), prefix
    for key, value in want.items():
        if exact:
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            # reductions split over other devices sum in another order (adam's first
            # step magnifies that where a gradient is tiny)
            np.testing.assert_allclose(
                got[key], value, rtol=1e-4, atol=1e-5, err_msg=key
            )


def test_the_runs_are_what_they_say(runs):
    one, two = runs
    assert (one["processes"], one["devices"], one["local_devices"]) == (1, 8, 8)
    assert (two["processes"], two["devices"], two["local_devices"]) == (2, 8, 4)


@pytest.mark.parametrize(("kind", "layout"), TRAIN_CASES)
def test_train_step_across_processes_matches_one_process(runs, kind, layout):
    one, two = runs
    name = f"{kind}-{layout}"
    got, want = two["train"][name], one["train"][name]
    assert got["spans_processes"] and not want["spans_processes"]
    for what in ("loss", "factors", "opt_state"):
        _close(one, two, f"train/{name}/{what}")
    # the codes (or the f32 base) did not move, and kept their global shardings
    before = _arrays(two, f"train/{name}/frozen_before")
    after = _arrays(two, f"train/{name}/frozen_after")
    assert before
    for key, value in before.items():
        np.testing.assert_array_equal(after[key.replace("before", "after")], value)
    _close(one, two, f"train/{name}/frozen_after", exact=True)
    assert got["frozen_kept"] and got["types"] == want["types"]
    # the same program: collectives of the same count and bytes, the same base leaves
    # gathered (codes as stored under FSDP)
    assert got["collectives"] == want["collectives"]
    assert got["gathered"] == want["gathered"]
    if layout == "fsdp" and kind != "lora":
        codes = {"int8": "s8", "nf4": "u8"}[kind]
        dtypes = {dtype for dtype, _, _ in got["gathered"]}
        assert codes in dtypes, got["gathered"]
        weights = {(32, 32), (32, 64), (64, 32), (32, 96)}
        assert not [
            g for g in got["gathered"] if g[0] == "f32" and tuple(g[1]) in weights
        ]


def test_scan_over_stacked_qlora_layers_across_processes(runs):
    one, two = runs
    _close(one, two, "scan/loss")
    _close(one, two, "scan/factors")
    assert two["scan"]["collectives"] == one["scan"]["collectives"]
    assert two["scan"]["gathered"] == one["scan"]["gathered"]
    assert "u8" in {dtype for dtype, _, _ in two["scan"]["gathered"]}


def test_building_qlora_from_global_weights(runs):
    one, two = runs
    for fmt in ("nf4", "int8"):
        got, want = two["build"][fmt], one["build"][fmt]
        # each process holds its rows of the codes: global arrays, not fully
        # addressable, one eighth of the rows per device
        assert not any(got["fully_addressable"]) and all(want["fully_addressable"])
        assert got["leaf_specs"] == want["leaf_specs"]
        assert got["local_rows"][0] == 32 // 8
        # quantizing a global weight gathers none of it (int8's per-column scales
        # take one all-reduce of a row of maxima)
        assert got["quantize_collectives"]["all-gather"] == [0, 0]
        assert got["quantize_collectives"] == want["quantize_collectives"]
        # loraify placed the new factors on the weight's mesh, as its spec asks
        assert got["factor_mesh"] and got["factor_specs"] == want["factor_specs"]
        assert got["factor_specs"][0].startswith("P(('data', 'model')")
        _close(one, two, f"build/{fmt}/params", exact=True)
    _close(one, two, "build/nf4/loss")
    _close(one, two, "build/nf4/factors")
    local = two["build"]["from_process_local"]
    assert (
        local["equal"] and local["type"] == "NF4Weight" and local["shape"] == [32, 96]
    )


def test_entry_points_on_arrays_split_over_processes(runs):
    one, two = runs
    got, want = two["entry_points"], one["entry_points"]
    assert got.keys() == want.keys() and all(r["ok"] for r in want.values()), want
    refused = {name for name, r in got.items() if not r["ok"]}
    # reading the value of a weight half in another process: a clear error naming
    # the process-local alternatives, never a hang; everything else works
    assert refused == {"np.asarray", "jax.device_get"}, got
    for name in refused:
        assert "process_allgather" in got[name]["message"], got[name]
        assert "addressable_shards" in got[name]["message"], got[name]
    assert "NF4Weight" in got["np.asarray"]["message"]
    for name in set(got) - refused:
        assert got[name]["got"] == want[name]["got"], name


def test_checkpoints_across_process_counts(runs):
    ocp = pytest.importorskip("orbax.checkpoint")
    one, two = runs
    # saved by 1 process, restored by 2 onto the global mesh
    restored = two["checkpoint"]["restored"]
    assert restored.pop("w1_types") == ["LoraWeight", "Int8Weight", "NF4Weight"]
    assert all(restored.values()), restored
    # saved by 2 processes, restored here (1 process, 1 device)
    one_device = np.array(jax.devices()[:1]).reshape(1, 1)
    tree, _ = checkpoint_tree(jax.sharding.Mesh(one_device, ("data", "model")))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree
    )
    path = two["dir"] / "checkpoint"
    with ocp.StandardCheckpointer() as ckpt:
        got = ckpt.restore(path, target)
        description = ckpt.metadata(path).custom_metadata["qax"]
        raw = ckpt.restore(path, jax.tree.map(np.asarray, tree))
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    assert isinstance(got["nf4"]["w1"].w, qax.quant.NF4Weight)
    assert got["int8"]["w1"].w.q.dtype == np.int8
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True):
        assert g.sharding == device
        np.testing.assert_array_equal(g, w)
    assert description == qax.checkpoint.describe(tree)
    for g, w in zip(jax.tree.leaves(raw), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_hung_collective_fails_fast_with_the_output(tmp_path):
    start = time.monotonic()
    with pytest.raises(MultihostFailure) as failure:
        launch((tmp_path, 2, 4, "--cases=hang"), stall=10)
    message = str(failure.value)
    assert message.startswith("no output from any process for 10 s")
    assert "waiting in a collective" in message and "not joining" in message
    assert time.monotonic() - start < 60
