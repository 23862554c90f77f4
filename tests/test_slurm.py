"""The sbatch scripts on a real Slurm: two emulated nodes on this machine, gloo on CPU.

`tests/slurm/local_slurm.sh` installs (if missing) and starts munge, slurmctld and two slurmd nodes
with fake GPU devices. Locally, MCORE_PACKING_SKIP_SLURM=1 skips these tests; in CI they always run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "training.steps=2",
    "data.num_samples=48",
    "data.max_sample_tokens=1024",
    "data.long_samples=truncate",
    "data.vocab_size=1024",
    "training.global_batch_size=8",
    "sequence_packing.train_mb_tokens=1024",
    "model.hidden_size=64",
    "logging.progress_bar=false",
]

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def _skip_or_fail(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"the real-Slurm tests must run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_env():
    if os.environ.get("MCORE_PACKING_SKIP_SLURM") == "1" and not os.environ.get("CI"):
        pytest.skip("MCORE_PACKING_SKIP_SLURM=1")
    if os.geteuid() != 0:
        _skip_or_fail("starting a local Slurm needs root")
    proc = subprocess.run(
        [str(ROOT / "tests/slurm/local_slurm.sh"), "start"], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        _skip_or_fail(f"local Slurm did not start:\n{proc.stdout}\n{proc.stderr}")
    conf = next(line.split("=", 1)[1] for line in proc.stdout.splitlines() if line.startswith("SLURM_CONF="))
    env = {**os.environ, "SLURM_CONF": conf}
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):  # the nodes n1, n2 do not resolve: NodeAddr must be used
        env.pop(name, None)
    yield env
    subprocess.run([str(ROOT / "tests/slurm/local_slurm.sh"), "stop"], capture_output=True, timeout=60)


def sbatch(env, tmp_path: Path, script: str, *args: str, extra_env: dict | None = None):
    log = tmp_path / "job-%j.log"
    proc = subprocess.run(
        ["sbatch", "--wait", "--gpus-per-node=1", f"--output={log}", f"--chdir={ROOT}", script, *args],
        cwd=ROOT,
        env={**env, **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    logs = list(tmp_path.glob("job-*.log"))
    return proc, (logs[0].read_text() if logs else "")


def test_multi_node_script_runs_one_torchrun_per_node(slurm_env, tmp_path):
    proc, log = sbatch(
        slurm_env,
        tmp_path,
        "slurm/train_multi_node.sbatch",
        *TINY,
        f"run_dir={tmp_path}/run",
        extra_env={"GPUS_PER_NODE": "1"},
    )
    assert proc.returncode == 0, proc.stderr + log[-4000:]
    assert "nodes=2 ranks/node=1 world=2 rendezvous=127.0.0.1:" in log  # n1's NodeAddr, not its name
    rank_lines = [line for line in log.splitlines() if line.startswith("[rank ")]
    assert sorted(line.split("]")[0] for line in rank_lines) == ["[rank 0/2", "[rank 1/2"]  # not multiplied
    assert "dp=0/2" in log and "dp=1/2" in log
    assert log.count("final loss") == 1 and (tmp_path / "run" / "metrics.jsonl").exists()


def test_single_node_script_starts_one_rank_per_gpu_and_a_signal_to_the_step_saves(slurm_env, tmp_path):
    """Two ranks on one node (CP2). Mid-run, ``scancel --signal=USR1 <job>`` (what ``--signal=USR1@<s>``
    without ``B:`` sends: the job step, not the batch shell) reaches ``python -m mcore_packing launch``,
    which forwards it to both ranks: they save after their step and exit 0, so ``sbatch --wait`` returns
    0 and the job is not requeued (no stop file: the batch shell was not asked)."""
    import time

    run, log = tmp_path / "run", tmp_path / "job.log"
    submitted = subprocess.Popen(
        ["sbatch", "--wait", "--parsable", "--gpus-per-node=1", f"--output={log}", f"--chdir={ROOT}",
         "slurm/train_single_node.sbatch", *TINY, "training.steps=60", "parallel.cp=2", f"run_dir={run}"],
        cwd=ROOT, env={**slurm_env, "GPUS_PER_NODE": "2"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    job = submitted.stdout.readline().strip().split(";")[0]
    metrics_file, deadline = run / "metrics.jsonl", time.monotonic() + 300
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and submitted.poll() is None, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm_env, check=True, timeout=30)
    assert submitted.wait(timeout=300) == 0, submitted.stderr.read() + log.read_text()[-4000:]
    text = log.read_text()
    assert "nodes=1 ranks/node=2 world=2" in text
    assert "cp=0/2" in text and "cp=1/2" in text
    assert "[rank 0] SIGUSR1: saving" in text and "[rank 1] SIGUSR1: saving" in text, text[-4000:]
    stopped = next(line for line in text.splitlines() if line.startswith("stopped by SIGUSR1 after step "))
    step = int(stopped.split("after step ")[1].split()[0])
    assert step < 60 and (run / "checkpoints" / "latest").read_text() == f"step_{step:06d}", text[-4000:]
    assert "requeueing" not in text and "Traceback" not in text, text[-4000:]


def test_a_signalled_job_saves_requeues_and_matches_an_uninterrupted_run(slurm_env, tmp_path):
    """The time-limit path: SIGUSR1 to the batch shell (what ``--signal=B:USR1@300`` sends) mid-run; the
    ranks save after their step and exit, the script requeues the job, which resumes (resume=auto) and
    finishes. Its losses equal a run that was never interrupted."""
    import json
    import sys
    import time

    run = tmp_path / "run"
    overrides = [*TINY, "training.steps=8", "optimizer.lr_decay_iters=8"]
    log = tmp_path / "job.log"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=1", f"--output={log}", f"--chdir={ROOT}",
         "slurm/train_single_node.sbatch", *overrides, f"run_dir={run}"],
        cwd=ROOT, env={**slurm_env, "GPUS_PER_NODE": "1"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    metrics_file = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm_env, check=True, timeout=30)
    while subprocess.run(["squeue", "-h", "-j", job], env=slurm_env, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline + 600, log.read_text()
        time.sleep(1)
    text = log.read_text()
    assert "USR1 received" in text and f"requeueing job {job}" in text, text[-4000:]
    assert "restart=1" in text and "resumed from" in text and text.count("final loss") == 2, text[-4000:]
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))  # stopped after a step, saved it, nothing repeated
    stopped_at = int(text.split("exists after step ")[1].split()[0])  # "stopped by <stop file> exists after step N"
    assert 2 <= stopped_at < 8
    straight = subprocess.run(
        [sys.executable, "-m", "mcore_packing", "train", *overrides, f"run_dir={tmp_path / 'straight'}"],
        cwd=ROOT, env={**slurm_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    for got, want in zip(rows, expected, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-6 * abs(want["loss"]), (got["step"], got["loss"], want["loss"])


def test_a_failing_job_fails_sbatch_wait(slurm_env, tmp_path):
    proc, log = sbatch(
        slurm_env, tmp_path, "slurm/train_single_node.sbatch", *TINY, "+not.a.key=1", extra_env={"GPUS_PER_NODE": "1"}
    )
    assert proc.returncode != 0
    assert "Unknown config key 'not'" in log


def test_shell_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        _skip_or_fail("shellcheck is not installed (scripts/setup_system.sh installs it as root)")
    scripts = [
        *map(str, ROOT.glob("slurm/*.sh")),
        *map(str, ROOT.glob("slurm/*.sbatch")),
        *map(str, ROOT.glob("scripts/*.sh")),
        *map(str, ROOT.glob("benchmarks/*.sh")),
        str(ROOT / ".ci/run"),
        str(ROOT / "tests/slurm/local_slurm.sh"),
    ]
    proc = subprocess.run(["shellcheck", "--shell=bash", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
