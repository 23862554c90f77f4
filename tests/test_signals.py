"""Real signals to real runs (`app.stop_request`): SIGTERM to a plain run and SIGUSR1 to a 2-rank run under
``python -m mcore_packing launch`` (torchrun) each save after the current step and exit 0 with one line
naming the checkpoint; a signal repeated at once counts once, a second one later exits at once.
The Slurm forms (the batch shell's ``--signal=B:USR1`` and a signal to the job step) are in test_slurm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_HANDLER_ONLY = """
import sys, time
from mcore_packing.app.stop_request import StopRequest
stop = StopRequest().install()
print("ready", flush=True)
while not stop.requested(world_size=1, rank=0):
    time.sleep(0.02)
print("asked", stop.reason, flush=True)
time.sleep(4)  # a step still running
print("done", flush=True)
"""


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen, log: Path, text: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before {text!r}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


def test_a_repeated_signal_counts_once_and_a_second_one_exits_at_once(tmp_path):
    code = [sys.executable, "-c", textwrap.dedent(_HANDLER_ONLY)]
    twice = _start(code, tmp_path / "twice.log")
    _wait_for(twice, tmp_path / "twice.log", "ready", 60)
    twice.send_signal(signal.SIGINT)
    twice.send_signal(signal.SIGINT)  # the same request delivered twice (a launcher and the cluster)
    assert twice.wait(timeout=60) == 0
    text = (tmp_path / "twice.log").read_text()
    assert "asked SIGINT" in text and "done" in text and "SIGINT again" not in text, text
    later = _start(code, tmp_path / "later.log")
    _wait_for(later, tmp_path / "later.log", "ready", 60)
    later.send_signal(signal.SIGTERM)
    _wait_for(later, tmp_path / "later.log", "asked SIGTERM", 60)
    time.sleep(2.5)  # past the repeat window
    later.send_signal(signal.SIGTERM)
    assert later.wait(timeout=60) == 128 + signal.SIGTERM
    text = (tmp_path / "later.log").read_text()
    assert "SIGTERM again: exiting now, without saving" in text and "done" not in text, text


TINY = ["model.hidden_size=64", "model.num_attention_heads=2", "model.num_query_groups=1", "data.num_samples=48",
        "data.max_sample_tokens=1024", "data.long_samples=truncate", "data.vocab_size=1024",
        "training.global_batch_size=8", "sequence_packing.train_mb_tokens=1024", "logging.progress_bar=false",
        "training.steps=60"]  # fmt: skip


def _check_stopped(log: Path, run: Path, name: str) -> int:
    text = log.read_text()
    line = next((x for x in text.splitlines() if x.startswith(f"stopped by {name} after step ")), None)
    assert line is not None, text[-3000:]
    step = int(line.split("after step ")[1].split()[0])
    assert 2 <= step < 60 and f"saved {run}/checkpoints/step_{step:06d};" in line, line
    assert f"continue with resume=true run_dir={run}" in line
    assert (run / "checkpoints" / "latest").read_text() == f"step_{step:06d}"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    return step


@pytest.mark.slow
def test_sigterm_to_a_plain_run_saves_after_the_step_and_exits_0(tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    proc = _start([sys.executable, "-m", "mcore_packing", "train", *TINY, f"run_dir={run}"], log)
    _wait_for(proc, log, "step 2/60")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    _check_stopped(log, run, "SIGTERM")


@pytest.mark.slow
@pytest.mark.multirank
def test_sigusr1_to_launch_reaches_both_ranks_which_save_and_exit_0(tmp_path):
    run, log = tmp_path / "run", tmp_path / "launch.log"
    cmd = [sys.executable, "-m", "mcore_packing", "launch", "--standalone", "--nproc-per-node", "2", "train", *TINY,
           f"run_dir={run}"]  # fmt: skip
    proc = _start(cmd, log)
    _wait_for(proc, log, "step 2/60")
    proc.send_signal(signal.SIGUSR1)  # plain torchrun would die of it: launch forwards it
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "[rank 0] SIGUSR1: saving" in text and "[rank 1] SIGUSR1: saving" in text, text[-3000:]
    assert "SignalException" not in text and "Traceback" not in text, text[-3000:]
    _check_stopped(log, run, "SIGUSR1")
