"""The benchmark scripts still run (tiny settings); their numbers come from full runs, not from here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_packing_speed_small(tmp_path):
    out = tmp_path / "speed.json"
    proc = run(
        "benchmarks/packing_speed.py",
        "--sizes",
        "2000",
        "--repeats",
        "1",
        "--distributions",
        "lognormal",
        "uniform",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    algorithms = {r["algorithm"] for r in doc["rows"]}
    assert {"first_fit_decreasing", "modified_first_fit_decreasing", "naive_ffd_baseline"} <= algorithms
    assert "speed-up" in proc.stdout


@pytest.mark.multirank
def test_step_throughput_quick():
    proc = run("benchmarks/step_throughput.py", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed/padded" in proc.stdout
