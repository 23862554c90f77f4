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
    assert {"modified_first_fit_decreasing-refine", "first_fit_decreasing+refine"} <= algorithms
    assert "speed-up" in proc.stdout


@pytest.mark.multirank
def test_step_throughput_quick():
    proc = run("benchmarks/step_throughput.py", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed/padded" in proc.stdout


@pytest.mark.multirank
def test_gpu_step_code_path_on_cpu(tmp_path):
    proc = run(
        "benchmarks/gpu_step.py",
        "--quick",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--layers",
        "1",
        "--hidden",
        "64",
        "--heads",
        "2",
        "--ffn",
        "128",
        "--vocab",
        "256",
        "--batch-size",
        "8",
        "--max-len",
        "128",
        "--mb-tokens",
        "512",
        "--attention-backends",
        "local",
        "te",
        "--out",
        str(tmp_path / "g.json"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed/padded" in proc.stdout
    assert "skipped, TransformerEngine is not installed" in proc.stdout or "te    ratios" in proc.stdout
    assert json.loads((tmp_path / "g.json").read_text())["results"]


def test_plan_quality_small(tmp_path):
    out = tmp_path / "q.json"
    proc = run(
        "benchmarks/plan_quality.py",
        "--distributions",
        "lognormal",
        "--budgets",
        "4096",
        "--dp",
        "2",
        "--num",
        "1024",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == {"packing", "dynamic"}
