"""A run folder belongs to one run (`app.run_folder`, `app.run_names`): another run's folder is refused
before anything is written, ``overwrite=true`` moves it aside without deleting, default folders of two
runs differ, a resume finds its run, and a continued run's metrics hold each step once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from mcore_packing.__main__ import main as cli
from mcore_packing.app.config import ConfigError, TrainConfig, TrainingConfig
from mcore_packing.app.run_folder import RUN_FILE, RunFolder
from mcore_packing.app.run_names import default_run_dir, job_identity


def _tree(root: Path) -> dict:
    """Every file under ``root`` with its bytes (what a refused run must leave as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _earlier_run(folder: Path, *, job: str = "elsewhere-1-2.00") -> Path:
    """A folder as a finished run leaves it: its record, checkpoints 3 and 6, metrics."""
    for step in (3, 6):
        (folder / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (folder / "checkpoints" / f"step_{step:06d}" / "mcore_packing.json").write_text("{}")
    (folder / "checkpoints" / "latest").write_text("step_000006")
    (folder / RUN_FILE).write_text(json.dumps({"job": job, "started": "2026-12-01T00:00:00+0000", "attempts": []}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 7)))
    return folder


def _claim(folder: RunFolder) -> None:
    """`RunFolder.claim` as rank 0 runs it, its log handler removed again (the trainer does that at the end)."""
    handler = folder.claim(data_fingerprint="abc", resume_from=None, from_step=0)
    handler.close()
    logging.getLogger("mcore_packing").removeHandler(handler)


def _folder(run_dir: Path, **keys) -> RunFolder:
    cfg = TrainConfig(run_dir=str(run_dir), **keys)
    return RunFolder(cfg, run_dir / "checkpoints")


def test_a_fresh_run_into_another_runs_folder_is_refused_naming_the_three_ways_out(tmp_path):
    run = _earlier_run(tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        _folder(run).check(resume_from=None)
    message = str(refused.value)
    assert f"run_dir={run} holds another run" in message and "step_000006" in message
    assert "resume=true" in message and "another run_dir" in message and "overwrite=true" in message
    for evidence in ("checkpoints/step_000001", "checkpoints/.step_000001.partial", RUN_FILE, "metrics.jsonl"):
        only = tmp_path / f"only-{evidence.replace('/', '-')}"  # each alone marks another run
        (only / evidence).parent.mkdir(parents=True, exist_ok=True)
        if evidence.startswith("checkpoints"):
            (only / evidence).mkdir()
        else:
            (only / evidence).write_bytes((run / evidence).read_bytes())
        with pytest.raises(ConfigError, match="holds another run"):
            _folder(only).check(resume_from=None)
    # controls: a folder that does not exist, an empty one, a resume, and this job's own folder (a requeue)
    _folder(tmp_path / "new").check(resume_from=None)
    (tmp_path / "empty").mkdir()
    _folder(tmp_path / "empty").check(resume_from=None)
    _folder(run).check(resume_from=run / "checkpoints" / "step_000006")
    _earlier_run(tmp_path / "mine", job=job_identity())
    _folder(tmp_path / "mine").check(resume_from=None)


def test_files_where_folders_belong_and_overwrite_with_resume_true_are_refused(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ConfigError, match=r"run_dir=.*a_file is a file"):
        _folder(tmp_path / "a_file").check(resume_from=None)
    cfg = TrainConfig(run_dir=str(tmp_path / "run"), training=TrainingConfig(checkpoint_dir=str(tmp_path / "a_file")))
    with pytest.raises(ConfigError, match=r"training\.checkpoint_dir=.*a_file is a file"):
        RunFolder(cfg, tmp_path / "a_file").check(resume_from=None)
    with pytest.raises(ConfigError, match=r"overwrite=true starts afresh .* resume=true continues it"):
        _folder(tmp_path / "run", overwrite=True, resume=True).check(resume_from=None)


def test_overwrite_moves_the_old_run_aside_and_deletes_nothing(tmp_path):
    run = _earlier_run(tmp_path / "run")
    before = _tree(run)
    folder = _folder(run, overwrite=True)
    folder.check(resume_from=None)
    _claim(folder)
    (aside,) = tmp_path.glob("run.replaced-*")
    assert _tree(aside) == before  # every byte of the old run kept
    record = json.loads((run / RUN_FILE).read_text())
    assert record["job"] == job_identity() and record["data_fingerprint"] == "abc" and record["attempts"] == []
    assert (run / "config.yaml").is_file() and not (run / "checkpoints").exists()


def test_a_refused_train_command_writes_nothing(tmp_path, capsys):
    """Through the command: the folder of another run stays byte for byte, exit 2, no traceback."""
    run = _earlier_run(tmp_path / "run")
    before = _tree(run)
    assert cli(["train", f"run_dir={run}", "data.num_samples=48", "training.global_batch_size=8"]) == 2
    assert "holds another run" in capsys.readouterr().err
    assert _tree(run) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_default_run_folders_never_collide_and_a_resume_finds_the_latest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    first = default_run_dir("sft", False)
    assert first.startswith("outputs/sft/") and f"-p{os.getpid()}" in first
    monkeypatch.setenv("LOCAL_RANK", "0")  # a torchrun worker: named after its launcher (the parent)
    second = default_run_dir("sft", False)
    assert second != first and f"-p{os.getppid()}" in second
    # the newest run is what resume=true continues; resume=auto only once that run saved
    folder = RunFolder(TrainConfig(run_dir=second, run_name="sft"), Path(second) / "checkpoints")
    _claim(folder)
    assert os.readlink("outputs/sft/latest") == Path(second).name
    assert default_run_dir("sft", True) == second
    os.replace("outputs/sft/latest", "outputs/sft/was-latest")
    os.symlink("older", "outputs/sft/latest")  # a run of another launcher, which saved nothing
    Path("outputs/sft/older").mkdir()
    assert default_run_dir("sft", True) == "outputs/sft/older"
    assert default_run_dir("sft", "auto") == second  # nothing saved there: this launcher's new folder
    Path("outputs/sft/older/checkpoints").mkdir()
    Path("outputs/sft/older/checkpoints/latest").write_text("step_000001")
    assert default_run_dir("sft", "auto") == "outputs/sft/older"
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # a Slurm job's folder: the same for every attempt of the job
    assert default_run_dir("sft", "auto") == "outputs/sft/job77" == default_run_dir("sft", False)
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ConfigError, match=r"spans several nodes outside Slurm.*set run_dir="):
        TrainConfig(run_name="other")


def test_a_continued_run_sets_aside_the_metrics_of_steps_it_runs_again(tmp_path):
    from mcore_packing.app.metrics import MetricsLogger

    run = _earlier_run(tmp_path / "run")
    cfg = TrainConfig(run_dir=str(run))
    MetricsLogger(cfg, rank=0, start_step=3)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    aside = [json.loads(line)["step"] for line in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert aside == [4, 5, 6]
    MetricsLogger(cfg, rank=1, start_step=0)  # control: only rank 0 touches the file
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
