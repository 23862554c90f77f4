"""The benchmark scripts still run (tiny settings); their numbers come from full runs, not from here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def test_grpo_plan_small(tmp_path):
    out = tmp_path / "grpo.json"
    proc = run("benchmarks/grpo_plan.py", "--steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["pass"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["training packing"]["time_vs_packing"] == 1.0
    assert rows["training padded"]["computed_over_real"] > rows["training packing"]["computed_over_real"]


def test_shared_prefix_small(tmp_path):
    out = tmp_path / "shared.json"
    proc = run("benchmarks/shared_prefix.py", "--ratios", "4", "--groups", "1", "--repeats", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens_saved"] > 0.5 and row["predicted_speedup"] > 1.5 and "measured" in proc.stdout


@pytest.mark.multirank
def test_step_throughput_quick():
    proc = run("benchmarks/step_throughput.py", "--quick")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed/padded" in proc.stdout


@pytest.mark.multirank
def test_gpu_step_code_path_on_cpu_and_its_summary(tmp_path):
    """The GPU benchmark's real loop on a tiny fp32 model on the CPU, then the summary the check prints."""
    proc = run(
        "benchmarks/gpu_step.py",
        *("--device", "cpu", "--dtype", "float32", "--layers", "1", "--hidden", "64", "--heads", "2"),
        *("--kv-heads", "1", "--ffn", "128", "--vocab", "256", "--batch-size", "8", "--max-len", "128"),
        *("--mb-tokens", "512", "--distribution", "lognormal", "--steps", "4", "--attention-backends", "local", "te"),
        *("--out", str(tmp_path / "gpu_step.json")),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "packed/padded" in proc.stdout and "skipped, TransformerEngine is not installed" in proc.stdout
    (row,) = json.loads((tmp_path / "gpu_step.json").read_text())["results"]
    assert row["packing"]["largest_microbatch_tokens"] <= 512  # bounded by the budget, not the longest sample
    assert 0 < row["packing"]["prediction"]["mean_abs_rel_error"] < 10
    (tmp_path / "versions.json").write_text(run("benchmarks/gpu_summary.py", "--versions").stdout)
    summary = run("benchmarks/gpu_summary.py", str(tmp_path))
    assert summary.returncode == 0, summary.stderr[-2000:]
    assert "| packing |" in summary.stdout and "packed/padded" in summary.stdout


def test_gpu_check_dry_run_collects_every_step(tmp_path):
    """The prepared GPU check's CPU path: versions, the test selections (collected), the plans of the
    GPU benchmark, the summary; the GPU steps are printed, not run."""
    env = {**os.environ, "MCORE_PACKING_GPU_RESULTS": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: 0 failed step(s)" in proc.stdout
    for name in ("gpu_tests", "newest_megatron_cpu_tests", "gpu_step"):
        assert (tmp_path / f"{name}.status").read_text().strip() == f"{name}: dry run"
    collected = (tmp_path / "collected.txt").read_text()
    assert (
        "test_packed_gpt_matches_per_sequence_on_the_gpu" in collected and "test_two_ranks_match_reference" in collected
    )
    plans = json.loads((tmp_path / "gpu_step_plan.json").read_text())["plans"]
    packing = [p for p in plans if p["mode"] == "packing"]
    assert packing and all(p["largest_microbatch_tokens"] <= 16384 for p in packing)
    assert json.loads((tmp_path / "summary.json").read_text())["versions"]["python"]


def test_wheel_list_for_the_gpu_machine_matches_the_lock():
    proc = subprocess.run(
        ["bash", "benchmarks/fetch_gpu_wheels.sh", "--list"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    wanted = [line for line in proc.stdout.split("\n") if line and not line.startswith("#")]
    lock = (Path(ROOT) / "requirements" / "cpu.lock.txt").read_text().lower()
    assert wanted[0].startswith("megatron-core==0.19")
    assert all(w.lower() in lock for w in wanted[1:]), wanted  # the rest: the versions CPU CI tests


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


@pytest.mark.slow
def test_data_scale_at_ten_thousand_samples_checks_the_store_start_and_plan():
    """The 1M benchmark's assertions at 10,000 samples (correctness only: nothing timed here)."""
    proc = run("benchmarks/data_scale.py", "--samples", "10000", "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checked [10000] samples" in proc.stdout


def test_fp8_padding_aligns_every_rank_and_saves_tokens(tmp_path):
    out = tmp_path / "fp8.json"
    proc = run("benchmarks/fp8_padding.py", "--dp", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["per_row_aligned"] for r in rows)
    assert all(r["padding_none"] <= r["padding_per_row"] < r["padding_per_sequence"] for r in rows)
    assert not all(r["per_sequence_aligned"] for r in rows)  # the former rule misaligns under TP + SP


def test_dynamic_cp_small(tmp_path):
    out = tmp_path / "dcp.json"
    proc = run("benchmarks/dynamic_cp.py", "--ranks", "8", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["mode"] for r in rows} == {"packing", "dynamic"}
    for r in rows:  # both plans' shape: real shares of the computed tokens, micro-batches, the slowest rank
        assert 0 < r["static_utilization"] <= 1 and 0 < r["utilization"] <= 1, r
        assert r["micro_batches_per_rank_per_step"] >= 1 and r["static_micro_batches_per_rank_per_step"] >= 1, r
        assert r["worst_rank_finish_over_mean"] >= 1, r
    ratio = {(r["mode"], r["workload"], r["model"], r["link"]): r["static_over_dynamic"] for r in rows}
    for (mode, workload, model, link), value in ratio.items():
        if link == "flops only":  # the same FLOPs; BSHD rows may pad less than static dynamic batching
            assert 0.95 < value < (1.05 if mode == "packing" else 1.15), (mode, workload, model, value)
        else:  # the exchange avoided is the gain
            assert value > max(1.0, ratio[mode, workload, model, "flops only"]), (mode, workload, model, link, value)
