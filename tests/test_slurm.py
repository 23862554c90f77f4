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
    env = {**os.environ, "SLURM_CONF": conf, "MASTER_ADDR": "127.0.0.1"}  # node names do not resolve here
    env.pop("RANK", None)
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
    assert "nodes=2 ranks/node=1 world=2" in log
    rank_lines = [line for line in log.splitlines() if line.startswith("[rank ")]
    assert sorted(line.split("]")[0] for line in rank_lines) == ["[rank 0/2", "[rank 1/2"]  # not multiplied
    assert "dp=0/2" in log and "dp=1/2" in log
    assert log.count("final loss") == 1 and (tmp_path / "run" / "metrics.jsonl").exists()


def test_single_node_script_starts_one_rank_per_gpu(slurm_env, tmp_path):
    proc, log = sbatch(
        slurm_env,
        tmp_path,
        "slurm/train_single_node.sbatch",
        *TINY,
        "parallel.cp=2",
        f"run_dir={tmp_path}/run",
        extra_env={"GPUS_PER_NODE": "2"},
    )
    assert proc.returncode == 0, proc.stderr + log[-4000:]
    assert "nodes=1 ranks/node=2 world=2" in log
    assert "cp=0/2" in log and "cp=1/2" in log


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
