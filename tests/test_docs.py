"""The guides cannot rot: every command they show parses, every relative link resolves, every import exists.

What is read: the README, the guides (`docs/guides/`), `examples/README.md`. Each ``bash`` code block's
commands (continuation lines joined, comments dropped) and each inline code span that starts like a
command (`python -m mcore_packing ...`, `torchrun ...`, `python benchmarks/...`, ...) go through the
parser that would run them, in this process and without running them:

- ``train``: its argparse flags, then the real Hydra composition of the defaults or the ``--recipe`` with
  the overrides (unknown keys, bad values and wrong config groups fail as they fail the user); a command
  that stands alone (one process, every path it reads in the checkout, no ``resume=true``) is also
  dry-run, as ``--dry-run`` would: its data loaded and checked, its first step planned (a recipe on 1,500
  of CHAMP's conversations; `test_recipes.py` dry-runs every recipe);
- ``plan``: its flags, and the same composition of the flags' keys with the overrides;
- ``prepare``, ``export``, ``grpo``: their argparse parsers; ``launch`` and ``torchrun``: torchrun's own
  parser, then the command or script they start;
- ``sbatch slurm/X`` and ``bash scripts/run.sh``: the script exists, its arguments are ``train``'s overrides;
  a Python script (benchmarks, examples): it exists and defines every ``--flag`` given;
  ``pip install .[extra]``: the extra is in pyproject.toml.

A command of any other kind fails the test, so a new kind has to be taught here. Paths to user data
(``/models/...``) are not opened: the guides show them as placeholders. ``...`` stands for "more
arguments" and is dropped. Links: every ``[text](target)`` of the project's Markdown files outside code
blocks, target relative to the file, and its ``#anchor`` must be a heading of that file (GitHub's slug).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md")), ROOT / "examples" / "README.md"]
LINKED = [*GUIDES, ROOT / "CHANGELOG.md", ROOT / "docs" / "architecture.md", ROOT / "hydra_configs" / "README.md",
          ROOT / "slurm" / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "tests" / "README.md"]  # fmt: skip
COMMAND_START = re.compile(r"^(python3? |\.venv/bin/python |torchrun |mcore-packing |sbatch "
                           r"|bash (scripts|benchmarks)/)")
MCORE = "mcore_packing"


def _strip_fences(text: str) -> str:
    """The text with every fenced code block blanked (line numbers kept)."""
    parts = re.split(r"(^```.*?^```)", text, flags=re.S | re.M)
    return "".join("\n" * p.count("\n") if p.startswith("```") else p for p in parts)


def commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every bash block line (``\\`` continuations joined) and command-like inline code."""
    found = []
    for match in re.finditer(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        first = text[: match.start()].count("\n") + 2
        joined, start = "", None
        for offset, line in enumerate(match.group(1).splitlines()):
            body = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            start = first + offset if start is None else start
            if body.endswith("\\"):
                joined += body[:-1] + " "
                continue
            joined += body
            if joined.strip():
                found.append((start, " ".join(joined.split())))
            joined, start = "", None
    prose = _strip_fences(text)
    for match in re.finditer(r"`([^`\n]+)`", prose):
        span = match.group(1).strip()
        words = span.split()
        named_only = len(words) == 4 and words[1:3] == ["-m", MCORE]  # a command's name in prose, no arguments
        if COMMAND_START.match(span) and (" -m " in span or "/" in words[1]) and not named_only:
            found.append((prose[: match.start()].count("\n") + 1, span))
    return found


def _argparse(parser: argparse.ArgumentParser, argv: list[str], known: bool = False):
    """Parse as the command would; argparse's own message becomes the assertion's."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_known_args(argv) if known else parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{parser.prog} {' '.join(argv)}: {err.getvalue().strip()}") from exc


def _runs_here(overrides: list[str]) -> bool:
    """Whether the command stands alone: it continues no earlier run (``resume=true``) and every path it
    reads exists in the checkout (else it shows a user's placeholder or an earlier command's output)."""
    pairs = [o.split("=", 1) for o in overrides if "=" in o]
    if ["resume", "true"] in pairs:
        return False
    return all((ROOT / value).exists() for key, value in pairs if "/" in value and key != "run_dir")


def check_mcore_command(argv: list[str], one_process: bool = False) -> None:
    """``python -m mcore_packing <argv>`` parses and (train, plan) its config composes; a ``train`` command
    run as one process whose paths all exist here is dry-run too (its data loaded and its first step planned,
    as the user's run would before it starts)."""
    from mcore_packing.__main__ import COMMANDS
    from mcore_packing.app import export_command, grpo_command, plan_command, prepare_command, train_command
    from mcore_packing.app.trainer import dry_run

    assert argv and argv[0] in COMMANDS, f"unknown command {argv[:1]}"
    name, rest = argv[0], [a for a in argv[1:] if a != "..."]
    if name == "train":
        args, overrides = _argparse(train_command.build_parser(), rest, known=True)
        train_command._check_flags(args)
        sizes = {"num_nodes": args.num_nodes, "gpus_per_node": args.gpus_per_node}
        cfg = train_command.compose_config(args.recipe, overrides, **sizes)
        if one_process and _runs_here(overrides):
            if args.recipe is not None and not any(o.startswith("data.") for o in overrides):
                # a recipe's data is all of CHAMP: 1,500 of its conversations plan the same first step's layout
                cfg = train_command.compose_config(args.recipe, [*overrides, "data.num_samples=1500"], **sizes)
            dry_run(cfg)
    elif name == "plan":
        args, overrides = _argparse(plan_command.build_parser(), rest, known=True)
        assert not [o for o in overrides if o.startswith("-")], f"plan: unknown flags in {overrides}"
        plan_command._compose(args, overrides, {})
    elif name == "launch":
        check_torchrun(rest, launcher="launch")
    else:
        module = {"prepare": prepare_command, "export": export_command, "grpo": grpo_command}[name]
        _argparse(module.build_parser(), rest)


def check_torchrun(argv: list[str], launcher: str = "torchrun") -> None:
    from torch.distributed.run import get_args_parser

    args = _argparse(get_args_parser(), argv)
    if launcher == "launch":  # mcore_packing's launch takes the command where torchrun takes a script
        check_mcore_command([args.training_script, *args.training_script_args])
    elif args.module:
        assert args.training_script == MCORE, f"torchrun -m {args.training_script}: not this project's module"
        check_mcore_command(args.training_script_args)
    else:
        check_script(args.training_script, args.training_script_args)


def check_script(path: str, argv: list[str]) -> None:
    """A Python script of the repository exists and defines every ``--flag`` given to it."""
    script = ROOT / path
    assert script.is_file(), f"{path} does not exist"
    source = script.read_text()
    for flag in (a.split("=")[0] for a in argv if a.startswith("--")):
        assert f'"{flag}"' in source, f"{path} has no {flag} option"


def check_command(command: str) -> None:
    argv = shlex.split(command)
    while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if argv[:1] == ["timeout"]:  # timeout [-s SIGNAL] DURATION COMMAND...
        argv = argv[4:] if argv[1] == "-s" else argv[2:]
    head, rest = argv[0], argv[1:]
    if head in ("python", "python3", ".venv/bin/python"):
        if rest[:2] == ["-m", MCORE]:
            check_mcore_command(rest[2:], one_process=True)
        else:
            check_script(rest[0], rest[1:])
    elif head == "mcore-packing":
        check_mcore_command(rest)
    elif head == "torchrun":
        check_torchrun(rest)
    elif head == "sbatch":
        script = next(a for a in rest if a.startswith("slurm/"))
        assert (ROOT / script).is_file(), f"{script} does not exist"
        check_mcore_command(["train", *rest[rest.index(script) + 1 :]])
    elif head in ("bash", "scripts/run.sh"):
        script = rest[0] if head == "bash" else head
        assert (ROOT / script).is_file(), f"{script} does not exist"
        args = rest[1:] if head == "bash" else rest
        if script == "scripts/run.sh":
            check_mcore_command(["train", *args], one_process=True)
        else:
            source = (ROOT / script).read_text()
            assert all(a in source for a in args), f"{script} does not take {args}"
    elif head == "pip" and rest[:1] == ["install"]:
        extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for spec in rest[1:]:
            for extra in re.findall(r"\[([^\]]+)\]", spec):
                assert set(extra.split(",")) <= set(extras), f"pip install {spec}: no extra {extra} in {sorted(extras)}"
    elif head in ("kill", "scancel"):
        pass  # the shell's and Slurm's, shown as what a user types
    else:
        raise AssertionError(f"a command this test does not know how to check: {command!r}")


def _guide_commands() -> list[tuple[str, str]]:
    return [(f"{path.relative_to(ROOT)}:{line}", command) for path in GUIDES
            for line, command in commands(path.read_text())]  # fmt: skip


def test_every_command_in_the_guides_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # the guides' commands run from the repository root
    cases = _guide_commands()
    assert len(cases) > 60, len(cases)  # the README's and every guide's commands were found
    failures = []
    for where, command in cases:
        try:
            check_command(command)
        except Exception as exc:  # every failure is reported with its place
            failures.append(f"{where}: {command}\n    {type(exc).__name__}: {exc}")
    assert not failures, "\n".join(failures)


def test_negative_controls_a_broken_command_is_caught(monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = [
        # parses, but its dry run finds 12 samples for a global batch of 32
        "python -m mcore_packing train data.source=jsonl data.path=examples/chat.jsonl data.text_field=messages",
        "python -m mcore_packing train sequence_packing.train_mb_tokns=4096",  # a misspelled key
        "python -m mcore_packing train data=jsonll",  # no such config group option
        "python -m mcore_packing train --recipe llama4_sft",  # no such recipe
        "python -m mcore_packing plan --mb-tokenz 4096",  # no such flag
        "python -m mcore_packing prepare --out x",  # --input is required
        "torchrun --nproc_per_node 2 -m mcore_packing train parallel.cp=two",  # not an int
        "python benchmarks/dynamic_cp.py --no-such-flag",
        "pip install '.[gpu]'",
        "curl https://example.com",
    ]
    for command in bad:
        with pytest.raises(Exception):  # noqa: B017 - each kind fails in its own way
            check_command(command)
    check_command("python -m mcore_packing train sequence_packing.train_mb_tokens=4096")  # the controls' control
    check_command("timeout 40 python -m mcore_packing train training.steps=2")  # both forms of timeout's prefix
    check_command("timeout -s TERM 40 python -m mcore_packing train training.steps=2")


def test_commands_are_found_in_blocks_and_inline_code():
    text = "run `python -m mcore_packing plan --tp 2` or\n```bash\ntorchrun -m mcore_packing train \\\n" \
           "    training.steps=2   # two steps\n# a comment\n```\n`--tp` alone is not a command\n"  # fmt: skip
    assert commands(text) == [(3, "torchrun -m mcore_packing train training.steps=2"),
                              (1, "python -m mcore_packing plan --tp 2")]  # fmt: skip


def github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = _strip_fences(path.read_text())
    bad = []
    for match in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", text):
        target = match.group(1)
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        where = f"{path.relative_to(root)}:{text[: match.start()].count(chr(10)) + 1}"
        if not resolved.exists():
            bad.append(f"{where}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", _strip_fences(resolved.read_text()), flags=re.M)
            if anchor not in {github_slug(h) for h in headings}:
                bad.append(f"{where}: {target} (no heading #{anchor})")
    return bad


def test_every_relative_link_resolves():
    assert [p for p in LINKED if not p.exists()] == []
    bad = [b for path in LINKED for b in broken_links(path)]
    assert bad == [], "\n".join(bad)


def test_negative_control_a_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# A title: here\n[ok](#a-title-here) [x](b.md) [y](#nope)\n```\n[z](c.md)\n```\n")
    found = broken_links(tmp_path / "a.md", root=tmp_path)
    assert found == ["a.md:2: b.md (no such file)", "a.md:2: #nope (no heading #nope)"]
    assert github_slug("GPU: gpu_check.sh (prepared, not yet run on a GPU)") == \
        "gpu-gpu_checksh-prepared-not-yet-run-on-a-gpu"  # fmt: skip


def doc_imports() -> list[str]:
    """Every ``from mcore_packing... import ...`` line of the Python examples in the README and the guides."""
    lines = []
    for path in GUIDES:
        for block in re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M):
            # line by line: the examples abbreviate calls with "...", so they are not all valid Python
            lines += [line.strip() for line in block.splitlines() if line.startswith("from mcore_packing")]
    return lines


def test_every_name_the_guides_import_exists():
    statements = doc_imports()
    layers = {s.split()[1].split(".")[1] for s in statements}
    assert layers >= {"packing", "planning", "thd", "megatron", "losses", "rl", "app"}, statements
    for statement in statements:
        exec(statement, {})


def framework_example_imports(text: str) -> list[str]:
    block = text.split("## GRPO and DPO steps from your own framework", 1)[1].split("```python", 1)[1]
    return [line for line in block.split("```", 1)[0].splitlines() if line.startswith("from mcore_packing")]


def _example_imports() -> list[str]:
    source = (ROOT / "examples" / "own_trainer.py").read_text()
    return [line for line in source.splitlines() if line.startswith("from mcore_packing")]


def test_the_framework_examples_use_only_the_library_layers():
    for imports in (framework_example_imports((ROOT / "docs/guides/library.md").read_text()), _example_imports()):
        assert {line.split()[1].split(".")[1] for line in imports} >= {"rl", "megatron"}, imports
        assert not [line for line in imports if line.split()[1].startswith("mcore_packing.app")], imports
    control = "## GRPO and DPO steps from your own framework\n```python\nfrom mcore_packing.app.x import y\n```"
    assert framework_example_imports(control) == ["from mcore_packing.app.x import y"]


@pytest.mark.multirank
def test_the_example_trainer_runs_alone_and_at_cp2():
    """`examples/own_trainer.py` as the library guide runs it: one process, then two torchrun ranks at CP2,
    which print the same losses (the exactness itself is tested in test_pg_packed and test_pg_objectives)."""
    env = {"OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    runs = [[sys.executable, "examples/own_trainer.py", "--steps", "2"],
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             "examples/own_trainer.py", "--steps", "2", "--cp", "2"]]  # fmt: skip
    losses = []
    for argv in runs:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        losses.append(re.findall(r"^step \d+: loss (\S+)", done.stdout, flags=re.M))
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
