"""The wheels the GPU check carries to a bare GPU machine (no network there), and their closure.

The lent machines' image (`gpu_image_packages.txt`: Python 3.12, a CUDA torch, numpy, pytest, ...) lacks
megatron-core, Hydra and the real-text packages. `WHEELS` pins each missing one with the runtime
requirements its wheel declares (for Python 3.12 on Linux, extras left out), so `missing` can tell, with
no network, whether every requirement is either in the image or carried; `tests/test_gpu_check.py` runs it
and checks the recorded requirements against the installed packages' own metadata wherever the test's
environment has that version (megatron-core 0.19.2 in the 0.19 lane).

    python benchmarks/gpu_wheels.py --list        # the pins
    python benchmarks/gpu_wheels.py --fetch .whl  # download them (where PyPI is reachable), then check
                                                  # the downloaded wheels' METADATA against the image

TransformerEngine is not carried: its CUDA 13 core wheel (transformer_engine_cu13 2.20.2) is 264 MiB, over
the 64 MiB a device call may carry, and its torch extension (transformer_engine_torch) is published as a
source archive only, compiled against the local torch. The GPU check's TE rows say so and skip.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE.parent / "requirements" / "cpu.lock.txt"

MEGATRON_CORE = "0.19.2"  # the newest release; 0.17+ need Python 3.12, which the GPU image has
WHEELS = {
    "megatron-core": (MEGATRON_CORE, ("torch", "numpy", "packaging")),
    "hydra-core": ("lock", ("omegaconf", "antlr4-python3-runtime", "packaging")),
    "omegaconf": ("lock", ("antlr4-python3-runtime", "pyyaml")),
    "antlr4-python3-runtime": ("lock", ()),
    "quicktok-v1": ("lock", ("numpy",)),
    "champ-dataset": ("lock", ("natsort",)),
    "natsort": ("lock", ()),
}
"""name -> (version, or "lock" for requirements/cpu.lock.txt's pin; the runtime requirements' names)."""
SOURCE_ONLY = ("antlr4-python3-runtime",)  # an sdist only: built into a pure-Python wheel where fetched

TE_SKIP_REASON = (
    "TransformerEngine is not carried: its CUDA 13 core wheel (transformer_engine_cu13 2.20.2) is 264 MiB, over "
    "the 64 MiB a device call may carry, and transformer_engine_torch is a source archive compiled on install"
)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = HERE / "gpu_image_packages.txt") -> set[str]:
    """The normalized package names the GPU image has."""
    names = set()
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            names |= {normalize(n) for n in line.split()}
    return names


def lock_versions(path: Path = LOCK) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            out[normalize(name)] = version.split(";")[0].strip()
    return out


def pins(wheels: dict = WHEELS) -> dict[str, str]:
    """name -> version of every carried wheel."""
    locked = lock_versions()
    return {name: locked[normalize(name)] if version == "lock" else version for name, (version, _) in wheels.items()}


def missing(wheels: dict = WHEELS, image: set[str] | None = None) -> list[str]:
    """``"wheel -> requirement"`` for every requirement neither in the image nor carried (empty: closed)."""
    image = image_packages() if image is None else image
    carried = {normalize(n) for n in wheels}
    return [f"{name} -> {req}" for name, (_, requires) in wheels.items() for req in requires
            if normalize(req) not in image | carried]  # fmt: skip


def runtime_requirements(requires: list[str] | None) -> tuple[str, ...]:
    """The names of a distribution's ``Requires-Dist`` entries that apply on Python 3.12 / Linux without
    extras (the markers evaluated with ``packaging``)."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
           "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}  # fmt: skip
    names = []
    for text in requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(env):
            names.append(normalize(req.name))
    return tuple(sorted(set(names)))


def _wheel_requirements(path: Path) -> tuple[str, ...]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return runtime_requirements([line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")])


def fetch(dest: Path) -> int:
    """Download every pin (binary wheels for CPython 3.12 on manylinux x86-64; sdists built here), then
    check the downloaded wheels' own requirements against the image and the carried set."""
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                               "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
                 for arg in ("--platform", p)]  # fmt: skip
    versions = pins()
    binary = [f"{n}=={v}" for n, v in versions.items() if n not in SOURCE_ONLY]
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", *platforms, "-d", str(dest), *binary], check=True)  # fmt: skip
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(dest),
                    *[f"{n}=={versions[n]}" for n in SOURCE_ONLY]], check=True)  # fmt: skip
    found = {normalize(p.name.split("-")[0]): _wheel_requirements(p) for p in dest.glob("*.whl")}
    actual = {name: ("", found.get(normalize(name), ())) for name in WHEELS}
    print("\n".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in sorted(dest.glob("*.whl"))))
    problems = [f"{name}'s wheel requires {actual[name][1]}, WHEELS records {recorded(name)}" for name in WHEELS
                if actual[name][1] != recorded(name)] + missing(actual)  # fmt: skip
    for problem in problems:
        print(f"gpu_wheels: {problem}", file=sys.stderr)
    return 1 if problems else 0


def recorded(name: str) -> tuple[str, ...]:
    """The requirement names `WHEELS` records for ``name``, normalized and sorted."""
    return tuple(sorted(normalize(r) for r in WHEELS[name][1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print NAME==VERSION of every carried wheel")
    parser.add_argument("--fetch", metavar="DIR", help="download the wheels into DIR and check their closure")
    args = parser.parse_args(argv)
    if args.fetch:
        return fetch(Path(args.fetch))
    for name, version in pins().items():
        print(f"{name}=={version}")
    gaps = missing()
    if gaps:
        print("requirements neither in the GPU image nor carried: " + ", ".join(gaps), file=sys.stderr)
    print(f"# {TE_SKIP_REASON}")
    return 1 if gaps else 0


if __name__ == "__main__":
    sys.exit(main())
