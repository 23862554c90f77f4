"""Megatron's optimizer and LR schedule, and distributed checkpoints that resume exactly, on any layout.

- Megatron's Adam with clipping equals Adam written out in plain torch on the same gradients.
- The LR schedule has the values of its formulas at chosen steps.
- 2 steps + resume + 2 steps equals 4 straight steps on the same layout, and after resharding from
  (TP, PP, DP) = (1, 1, 2) to (2, 1, 1) and (1, 2, 1), with the distributed optimizer off and on.
- Checkpoint folders: atomic saves (a SIGKILL during a save), keep_last, a truncated file, a checkpoint
  of another model or data set, the manifest is JSON and tensors load with ``weights_only``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from .distributed_harness import run_distributed
from .test_train import ROOT, metrics, train

LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP) resumed at, from a checkpoint written at TP1 PP1 DP2


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.multirank
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_megatron_adam_with_clipping_equals_a_plain_torch_reference(tmp_path, distributed_optimizer):
    (result, _) = run_distributed(
        "tests.checkpoint_workers:adam_reference_worker",
        2,
        distributed_optimizer=distributed_optimizer,
        clip=1.0,
        folder=str(tmp_path / "state"),
    )
    for megatron_norm, reference_norm in result["norms"]:
        assert _rel(megatron_norm, reference_norm) <= 1e-6
        assert reference_norm > 1.0  # clipping is active
    assert result["error"] <= 1e-6, result
    assert result["unclipped_error"] > 1e-4, result  # negative control: the comparison sees clipping
    assert result["reloaded_error"] == result["error"]  # a save + load round trip changes nothing
    pin_optimizer_call_sites({tuple(site) for site in result["call_sites"]}, distributed_optimizer)


_OPTIMIZER_SITES = {
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "preload_tensors", "cuda.synchronize"),
    ("megatron.core.dist_checkpointing.strategies.state_dict_saver", "save_state_dict_async_finalize",
     "cuda.current_device"),
    ("megatron.core.distributed.param_and_grad_buffer", "__init__", "cuda.current_device"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "Tensor.type"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", "zeros"),
    ("megatron.core.optimizer.clip_grads", "get_grad_norm_fp32", "zeros"),
    ("megatron.core.optimizer.optimizer", "__init__", "tensor"),
    ("megatron.core.utils", "local_multi_tensor_l2_norm", "tensor"),
}  # fmt: skip
_DISTRIBUTED_OPTIMIZER_SITES = {
    ("megatron.core.optimizer.distrib_optimizer", "__init__", "Tensor.type"),
    ("megatron.core.optimizer.distrib_optimizer", "_build_model_and_main_param_groups", "Tensor.type"),
    ("megatron.core.optimizer.distrib_optimizer", "get_parameter_state_dp_zero", "Tensor.cuda"),
    ("megatron.core.optimizer.distrib_optimizer", "get_parameter_state_dp_zero", "cuda.current_device"),
}
_NEW_IN_0_19 = {  # 0.19.2 adds these two to 0.16.1's (the test lane of scripts/setup_env_mcore019.sh)
    ("megatron.core.distributed.param_and_grad_buffer", "start_grad_sync", "cuda.current_stream"),
    ("megatron.core.optimizer.optimizer", "has_grad_norm_group", "tensor"),
}
PINNED_OPTIMIZER_SITES = {
    "0.16.1": {False: _OPTIMIZER_SITES, True: _OPTIMIZER_SITES | _DISTRIBUTED_OPTIMIZER_SITES},
    "0.19.2": {False: _OPTIMIZER_SITES | _NEW_IN_0_19,
               True: _OPTIMIZER_SITES | _DISTRIBUTED_OPTIMIZER_SITES | _NEW_IN_0_19},
}  # fmt: skip


def pin_optimizer_call_sites(sites: set, distributed_optimizer: bool) -> None:
    """The CPU adapter redirects exactly these sites on the optimizer + checkpoint path (an upgrade of
    megatron-core that moves one fails here instead of silently)."""
    from mcore_packing.compat import megatron_core_version

    version = megatron_core_version()
    if version not in PINNED_OPTIMIZER_SITES:
        pytest.fail(f"no pinned optimizer call sites for megatron-core {version}; recorded: {sorted(sites)}")
    assert sites == PINNED_OPTIMIZER_SITES[version][distributed_optimizer], sorted(sites)


def test_lr_schedule_values_at_chosen_steps():
    """Megatron's scheduler as `build_scheduler` sets it up, against the formulas (step k uses the
    schedule at k-1; warmup from lr_warmup_init, then decay to min_lr at lr_decay_iters)."""
    import torch

    from mcore_packing.megatron.optimizer import build_scheduler

    lr, min_lr, init, warmup, decay = 1e-3, 1e-4, 1e-5, 4, 20

    def expected(style: str, k: int) -> float:
        if k <= warmup:
            return init + (lr - init) * k / warmup
        if style == "constant":
            return lr
        frac = min(1.0, (k - warmup) / (decay - warmup))
        factor = 1 - frac if style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1)
        return min_lr + (lr - min_lr) * factor

    for style in ("constant", "linear", "cosine"):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        scheduler = build_scheduler(optimizer, lr=lr, min_lr=min_lr, lr_warmup_init=init, lr_warmup_iters=warmup,
                                    lr_decay_iters=decay, lr_decay_style=style)  # fmt: skip
        seen = {}
        for k in range(0, 26):
            seen[k] = optimizer.param_groups[0]["lr"]
            scheduler.step(increment=1)
        for k in (0, 1, 3, 4, 5, 8, 12, 19, 20, 25):
            assert seen[k] == pytest.approx(expected(style, k), rel=1e-12, abs=1e-15), (style, k)
    assert expected("cosine", 8) != pytest.approx(expected("linear", 8))  # the styles differ where checked


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_resume_on_another_layout_continues_the_same_run(tmp_path, distributed_optimizer):
    (result, _) = run_distributed(
        "tests.checkpoint_workers:resume_layouts_worker",
        2,
        root=str(tmp_path),
        distributed_optimizer=distributed_optimizer,
        layouts=LAYOUTS,
        control=True,
    )
    report = check_resumed_runs(result, LAYOUTS, same_layout_tolerance=1e-6)
    print(f"distributed_optimizer={distributed_optimizer}: max relative loss difference per layout {report}")


def check_resumed_runs(result: dict, layouts, *, same_layout_tolerance: float) -> dict:
    """Every resumed run continues the straight run (the same samples, the same losses), and the negative
    control (model loaded, optimizer state not) differs at step 4. Returns the largest error per layout."""
    straight = result["straight"]
    assert result["first"]["losses"] == straight["losses"][:2]
    report = {}
    for tp, pp in layouts:
        resumed = result[f"tp{tp}pp{pp}"]
        assert resumed["steps"] == [3, 4]
        assert resumed["sample_ids"] == straight["sample_ids"][2:]  # the same data order continues
        errors = [_rel(a, b) for a, b in zip(resumed["losses"], straight["losses"][2:], strict=True)]
        report[(tp, pp)] = max(errors)
        assert max(errors) <= (same_layout_tolerance if (tp, pp) == (1, 1) else 1e-5), (tp, pp, errors)
    control = result["control"]["losses"]
    assert _rel(control[0], straight["losses"][2]) <= same_layout_tolerance  # step 3 only needs the weights
    assert _rel(control[1], straight["losses"][3]) > 1e-3
    return report


def _installed_release() -> str:
    from mcore_packing.compat import megatron_core_version

    return megatron_core_version()


# A Python whose megatron-core is 0.16 (scripts/test_mcore019.sh points it at the main venv) writes the
# checkpoints that the release under test resumes.
WRITER_PYTHON = os.environ.get("MCORE_PACKING_016_PYTHON")
_WRITE_RUNS = (
    "import json, sys\n"
    "from tests.distributed_harness import run_distributed\n"
    "runs = run_distributed('tests.checkpoint_workers:write_runs_worker', 2, root=sys.argv[1],"
    " distributed_optimizer=sys.argv[2] == 'true')\n"
    "print(json.dumps(runs[0]))\n"
)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.skipif(WRITER_PYTHON is None or _installed_release().startswith("0.16."),
                    reason="runs in the megatron-core 0.19 lane (scripts/test_mcore019.sh), which sets "
                    "MCORE_PACKING_016_PYTHON to a Python with megatron-core 0.16")  # fmt: skip
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_checkpoint_written_with_megatron_core_0_16_resumes_on_this_release(tmp_path, distributed_optimizer):
    """2 steps on 0.16.1 (DP2), resumed here for steps 3-4 at DP2 and at TP2: the losses of the straight
    4-step run on 0.16.1."""
    from mcore_packing.compat import megatron_core_version

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flag = str(distributed_optimizer).lower()
    proc = subprocess.run([WRITER_PYTHON, "-c", _WRITE_RUNS, str(tmp_path), flag], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads(proc.stdout.strip().splitlines()[-1])
    assert written["megatron_core"].startswith("0.16."), written["megatron_core"]
    assert megatron_core_version() != written["megatron_core"]
    (result, _) = run_distributed(
        "tests.checkpoint_workers:resume_layouts_worker",
        2,
        root=str(tmp_path),
        distributed_optimizer=distributed_optimizer,
        layouts=[(1, 1), (2, 1)],
        control=True,
        written=written,
    )
    report = check_resumed_runs(result, [(1, 1), (2, 1)], same_layout_tolerance=1e-5)
    print(f"written with {written['megatron_core']}, resumed with {megatron_core_version()}: {report}")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Four steps, a checkpoint after each, the newest two kept, TensorBoard on."""
    run = tmp_path_factory.mktemp("saved") / "run"
    proc = train(
        run,
        "training.steps=4",
        "training.save_interval=1",
        "training.keep_last=2",
        "logging.tensorboard=true",
        "optimizer.lr_decay_iters=5",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


def test_keep_last_latest_pointer_and_json_manifest(saved_run):
    import torch

    from mcore_packing.app.checkpoint import MANIFEST, read_manifest
    from mcore_packing.compat import megatron_core_version

    folder = saved_run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_000003", "step_000004"]
    assert (folder / "latest").read_text() == "step_000004"
    manifest = json.loads((folder / "step_000004" / MANIFEST).read_text())
    assert manifest["step"] == 4 and manifest["layout"] == {"tp": 1, "pp": 1, "cp": 1, "dp": 1}
    assert manifest["scheduler"]["num_steps"] == 4 and manifest["config"]["optimizer"]["lr"] == 0.01
    assert read_manifest(folder / "step_000004") == manifest  # every listed file present at its size
    assert any(name.endswith(".distcp") for name in manifest["files"])
    common_file = folder / "step_000004" / "common.pt"  # megatron-core 0.19 keeps it inside the .distcp files
    if tuple(int(p) for p in megatron_core_version().split(".")[:2]) < (0, 19):
        common = torch.load(common_file, weights_only=True)  # no arbitrary objects
        assert "optimizer" in common
    else:
        assert not common_file.exists()


def test_metrics_and_tensorboard_hold_lr_grad_norm_and_throughput(saved_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = metrics(saved_run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["lr"] == 0.0 and rows[2]["lr"] == 0.01  # warmup over 2 steps (Megatron: step k uses k-1)
    assert all(r["grad_norm"] > 0 and r["update_applied"] for r in rows)
    events = EventAccumulator(str(saved_run / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
        values = events.Scalars(f"train/{key}")
        assert [v.step for v in values] == [1, 2, 3, 4], key
        assert [v.value for v in values] == pytest.approx([r[key] for r in rows], rel=1e-6), key


def test_a_truncated_checkpoint_is_skipped_by_name_then_refused_alone(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    newest = run / "checkpoints" / "step_000004"
    shard = next(newest.glob("*.distcp"))
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    proc = train(run, "training.steps=5", "resume=true", "optimizer.lr_decay_iters=5")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"skipping checkpoint {newest}: {shard} has {size // 2} bytes, the manifest says {size}" in proc.stderr
    assert "resumed from" in proc.stdout and "step_000003 at step 3" in proc.stdout
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]  # the first step 4 moved to the superseded file
    original = {r["step"]: r["loss"] for r in metrics(saved_run)}
    assert _rel(metrics(run)[3]["loss"], original[4]) <= 1e-6  # step 4 again, from step 3: the same loss
    # Alone, the truncated checkpoint is refused (before any Megatron work) and named.
    alone = tmp_path / "alone"
    (alone / "checkpoints").mkdir(parents=True)
    shutil.copytree(newest, alone / "checkpoints" / newest.name)
    refused = train(alone, "training.steps=5", "resume=true", timeout=120)
    assert refused.returncode == 2
    assert "holds no complete checkpoint" in refused.stderr and "truncated?" in refused.stderr


_KILL_DURING_SAVE = """
import os, signal, sys
import mcore_packing.megatron.dist_checkpoint as dc
real = dc.save_training_state
def save_then_die(directory, model, optimizer):
    real(directory, model, optimizer)  # every shard written, the manifest and the rename not yet
    if "step_000002" in str(directory):
        os.kill(os.getpid(), signal.SIGKILL)
dc.save_training_state = save_then_die
from mcore_packing.__main__ import main
sys.exit(main(["train", *sys.argv[1:]]))
"""


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    from .test_train import SMALL

    run = tmp_path / "run"
    args = [*SMALL, f"run_dir={run}", "training.steps=3", "training.save_interval=1", "optimizer.lr_decay_iters=3"]
    # Its own process group: the killed trainer's helper processes (dist_checkpointing's writer queue
    # manager) are orphaned by the SIGKILL and are removed with the group afterwards.
    log = tmp_path / "killed.log"
    with log.open("w") as out:
        killed = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILL_DURING_SAVE), *args], cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            returncode = killed.wait(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(killed.pid, signal.SIGKILL)
    assert returncode == -9, log.read_text()[-3000:]
    folder = run / "checkpoints"
    assert (folder / ".step_000002.partial").is_dir() and not (folder / "step_000002").exists()
    assert (folder / "latest").read_text() == "step_000001"
    resumed = train(run, "training.steps=3", "training.save_interval=1", "optimizer.lr_decay_iters=3", "resume=true")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert ".step_000002.partial: a save that did not finish" in resumed.stderr  # named on resume
    assert "Resuming from step_000001" in resumed.stderr
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]  # step 2 of the killed run (logged before its save) set aside
    (superseded,) = [json.loads(line) for line in (run / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded["step"] == 2 and _rel(rows[1]["loss"], superseded["loss"]) <= 1e-6
    assert not (folder / ".step_000002.partial").exists() and (folder / "latest").read_text() == "step_000003"


def _fake_setup(**shape_changes):
    from mcore_packing.planning import ModelShape

    fields = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512, **shape_changes}
    shape = ModelShape(**fields)
    return SimpleNamespace(shape=shape)


def test_a_checkpoint_of_another_model_or_data_set_is_refused_naming_the_difference(tmp_path):
    from mcore_packing.app.checkpoint import FORMAT_VERSION, MANIFEST, check_compatible
    from mcore_packing.app.config import ConfigError, TrainConfig
    from mcore_packing.app.global_batches import GlobalBatchSampler

    cfg = TrainConfig(run_dir=str(tmp_path))
    sampler = GlobalBatchSampler(48, 8, 1234)
    manifest = {
        "format_version": FORMAT_VERSION,
        "files": {},
        "model_shape": _fake_setup().shape.to_dict(),
        "data_fingerprint": "abc",
        "sampler": sampler.state_dict(),
        "distributed_optimizer": False,
    }

    def check(saved: dict, shape=None, fingerprint="abc", units=48):
        (tmp_path / MANIFEST).write_text(json.dumps(saved))
        check_compatible(tmp_path, cfg, shape or _fake_setup().shape, fingerprint, units)

    check(manifest)  # control: the same run passes
    with pytest.raises(ConfigError, match=r"model\.hidden_size: checkpoint 64, this run 128"):
        check(manifest, _fake_setup(hidden_size=128).shape)
    with pytest.raises(ConfigError, match=r"another data set .* 48 vs 40 samples"):
        check(manifest, fingerprint="def", units=40)
    with pytest.raises(ConfigError, match=r"optimizer\.use_distributed_optimizer: checkpoint True"):
        check({**manifest, "distributed_optimizer": True})
    moe = {"num_experts": 4, "gated_mlp": True, "linear_bias": False}
    moe_manifest = {**manifest, "model_shape": _fake_setup(**moe).shape.to_dict()}
    with pytest.raises(ConfigError, match=r"experts with the other parameters \(written by an earlier version"):
        check(moe_manifest, _fake_setup(**moe).shape)  # EP1, before the split
    check({**moe_manifest, "expert_optimizer": "own"}, _fake_setup(**moe).shape)


def test_nothing_in_the_package_unpickles_checkpoint_files():
    """torch.load only with its weights_only default (never weights_only=False), and no pickle module."""
    offenders = []
    for path in (ROOT / "mcore_packing").rglob("*.py"):
        text = path.read_text()
        if "weights_only=False" in text or "import pickle" in text or "pickle.load" in text:
            offenders.append(str(path))
    assert offenders == []
