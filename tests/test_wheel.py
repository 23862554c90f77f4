"""An installed wheel runs the main job: the Hydra configs are package data, every package is in the wheel.

The wheel is built from this checkout (``pip wheel --no-build-isolation``: the build backend of the
project's own environment, no download) and installed with ``--no-deps`` into a fresh virtual environment
whose only other import path is the project environment's site-packages (torch, megatron-core, Hydra);
the project's editable install is not visible there (its finder is a ``.pth`` file of that environment,
which a plain path entry does not run). Then ``python -m mcore_packing train training.steps=2`` runs from
an empty folder outside the checkout, as after ``pip install mcore-packing``.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _source_packages() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mcore_packing").rglob("__init__.py")}
    return found | {"mcore_packing.hydra_configs"}


def test_pyproject_lists_every_package():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == _source_packages()


@pytest.mark.slow
def test_an_installed_wheel_runs_the_main_job_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels)]
    subprocess.run([*build, str(ROOT)], check=True, timeout=300)
    (wheel,) = wheels.glob("mcore_packing-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mcore_packing/hydra_configs/config.yaml" in names and "mcore_packing/hydra_configs/model/tiny.yaml" in names

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    target = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", target]
    subprocess.run([*install, str(wheel)], check=True, timeout=300)
    # The project environment's third-party packages, after the wheel's own (appended by a .pth line).
    project_site = sysconfig.get_paths()["purelib"]
    (Path(target) / "project_env.pth").write_text("\n".join([project_site, *site.getsitepackages()]) + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    where = subprocess.run(
        [str(python), "-c", "import mcore_packing, sys; print(mcore_packing.__file__)"],
        cwd=work, env=env, check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(target), where  # the wheel's copy, not the checkout
    run = subprocess.run(
        [str(python), "-m", "mcore_packing", "train", "training.steps=2", "logging.progress_bar=false"],
        cwd=work, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "step 2/2 loss" in run.stdout and "final loss" in run.stdout, run.stdout[-2000:]
    assert (work / "outputs" / "sft-tiny" / "latest" / "metrics.jsonl").is_file()  # the default run folder
