"""The prepared GPU check can run on a bare, offline GPU machine from what it carries: the wheels it
installs (`benchmarks/gpu_wheels.py`) and their runtime requirements are closed over what the image has
(`benchmarks/gpu_image_packages.txt`), the recorded requirements are the packages' own (read from the
installed metadata wherever this environment has that version: megatron-core 0.19.2 in the 0.19 lane),
CHAMP lengths come without importing the champ-dataset package (its natsort import), and the CPU adapter
follows the run's device, not whether a GPU exists."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_wheels  # noqa: E402


def test_the_carried_wheels_close_over_the_image():
    assert gpu_wheels.missing() == []
    image = gpu_wheels.image_packages()
    assert {"torch", "numpy", "pytest", "packaging", "pyyaml"} <= image and "megatron-core" not in image
    assert not {gpu_wheels.normalize(n) for n in gpu_wheels.WHEELS} & image  # carried only what it lacks


def test_negative_control_a_dropped_wheel_breaks_the_closure():
    wheels = {name: value for name, value in gpu_wheels.WHEELS.items() if name != "natsort"}
    assert gpu_wheels.missing(wheels) == ["champ-dataset -> natsort"]


def test_recorded_requirements_are_the_packages_own():
    """Each pin installed here at the same version: its metadata's runtime requirements (Python 3.12,
    Linux, no extras) are the recorded ones. The pins that follow the lock are all installed here."""
    pins, checked = gpu_wheels.pins(), []
    for name in gpu_wheels.WHEELS:
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if installed != pins[name]:
            continue
        assert gpu_wheels.runtime_requirements(importlib.metadata.requires(name)) == gpu_wheels.recorded(name), name
        checked.append(name)
    locked = [name for name, (version, _) in gpu_wheels.WHEELS.items() if version == "lock"]
    assert set(locked) <= set(checked), (locked, checked)


def test_champ_lengths_need_no_champ_dataset_import():
    code = ("import sys; from mcore_packing.data import sample_lengths; sample_lengths('real:champ', 4, 512, seed=0); "
            "print('natsort' in sys.modules, 'champ_dataset' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr[-2000:]


def test_the_cpu_adapter_follows_the_runs_device(monkeypatch):
    from mcore_packing.megatron import cpu_device_adapter

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    with cpu_device_adapter(device="cpu") as adapter:
        assert adapter is not None  # a CPU run there still gets Megatron's CUDA call sites redirected
    with cpu_device_adapter(device="cuda") as adapter:
        assert adapter is None
    with cpu_device_adapter() as adapter:
        assert adapter is None  # no device given: a GPU exists


@pytest.mark.parametrize("argv", [["--list"]])
def test_the_wheel_list_names_the_pins_and_why_te_stays_behind(argv):
    out = subprocess.run([sys.executable, "benchmarks/gpu_wheels.py", *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "megatron-core==0.19.2" in out.stdout and "natsort==8.4.0" in out.stdout
    assert "264 MiB, over the 64 MiB a device call may carry" in out.stdout
