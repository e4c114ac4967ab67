"""Implicit arrays under JAX's own sharding, on 8 simulated CPU devices.

The device count must be fixed before JAX starts, so the cases (`_sharding_cases.py`)
run in a child pytest process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`.
"""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_sharding_cases_on_eight_devices():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(HERE / "_sharding_cases.py"),
        ],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report
    assert " passed" in report and "skipped" not in report.split("\n")[-2], report
