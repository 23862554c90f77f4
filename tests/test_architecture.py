"""The package's shape, checked: layers import only downwards, no two modules import each other (directly
or around a circle, lazy imports included), the planner never loads torch, and no function is long enough
to hide two jobs. Each check also runs on a broken input (a negative control)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mcore_packing"

# The data flow, bottom up. A module may import from its own layer or any layer below it.
LAYERS = {
    "validators": 0,
    "compat": 0,
    "collectives": 0,
    "data": 1,
    "packing": 1,
    "planning": 2,
    "thd": 3,
    "losses": 3,
    "megatron": 4,
    "rl": 5,
    "app": 6,
    "__main__": 7,
    "__init__": 7,
}
TORCH_FREE = ("validators", "data", "packing", "planning")

# Documented numeric kernels (see docs/architecture.md, "The packing kernels"): long on purpose, one
# algorithm each, tested against naive references.
LONG_KERNELS = {
    ("packing/_kernels.py", "decreasing_fit"),
    ("packing/_kernels.py", "modified_first_fit_decreasing"),
}
MAX_FUNCTION_LINES = 60


def _layer_of(module: str) -> str:
    """``mcore_packing.planning.step_plan`` -> ``planning``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _imports(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``mcore_packing`` module that ``source`` imports, at top level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mcore_packing")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("mcore_packing"):
                found.add(target)
    return found


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """``module -> target`` for every import of a higher layer."""
    mine = LAYERS[_layer_of(module)]
    bad = []
    for target in sorted(_imports(source, module, is_package)):
        if LAYERS[_layer_of(target)] > mine:
            bad.append(f"{module} -> {target}")
    return bad


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, _module_name(path), path.name == "__init__.py"


def test_layers_import_only_downwards():
    bad = [b for path, module, pkg in _sources() for b in upward_imports(path.read_text(), module, pkg)]
    assert bad == [], "imports against the data flow:\n" + "\n".join(bad)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules it imports (top level or inside functions), from ``{module: (source,
    is_package)}``. ``from pkg import name`` points at ``pkg.name`` when that is a module, at the module a
    package re-exports ``name`` from (its ``from .sub import name``), else at the package itself."""
    reexports = {}
    for module, (source, is_package) in sources.items():
        for node in ast.parse(source).body if is_package else ():
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                reexports.update({(module, a.asname or a.name): f"{module}.{node.module}" for a in node.names})
    graph = {}
    for module, (source, is_package) in sources.items():
        edges = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in sources}
            elif isinstance(node, ast.ImportFrom):
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                for a in node.names if target in sources else ():
                    sub = f"{target}.{a.name}"
                    edges.add(sub if sub in sources else reexports.get((target, a.name), target))
        graph[module] = edges - {module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, circles = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    circles.append(sorted(group))
    return circles


def test_no_import_circles():
    graph = import_graph({module: (path.read_text(), pkg) for path, module, pkg in _sources()})
    assert import_circles(graph) == [], "modules that import each other (move what both need to a third):\n" + str(
        import_circles(graph))  # fmt: skip


def test_negative_control_an_import_circle_is_flagged():
    sources = {
        "mcore_packing.p": ("from .a import f\n", True),
        "mcore_packing.p.a": ("def f():\n    from .b import g\n", False),  # lazy imports count
        "mcore_packing.p.b": ("from mcore_packing.p.c import h\n", False),
        "mcore_packing.p.c": ("from . import f\n", False),  # the package's re-export of a.f: an edge to a
        "mcore_packing.p.d": ("from .a import f\n", False),
    }
    assert import_circles(import_graph(sources)) == [["mcore_packing.p.a", "mcore_packing.p.b", "mcore_packing.p.c"]]
    sources["mcore_packing.p.c"] = ("x = 1\n", False)
    assert import_circles(import_graph(sources)) == []


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert packages | modules == set(LAYERS), (packages | modules) ^ set(LAYERS)


def test_negative_control_an_upward_import_is_flagged():
    source = "from ..megatron import forward_backward\n\ndef f():\n    from mcore_packing.thd import unpack\n"
    assert upward_imports(source, "mcore_packing.planning.step_plan") == [
        "mcore_packing.planning.step_plan -> mcore_packing.megatron",
        "mcore_packing.planning.step_plan -> mcore_packing.thd",
    ]
    assert upward_imports("from ..planning import plan_step\n", "mcore_packing.thd.packed_batch") == []


def test_no_module_names_that_differ_only_in_suffix():
    stems = sorted(
        {p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__"} | {p.name for p in PACKAGE.iterdir()}
    )
    clashes = [(a, b) for a in stems for b in stems if a != b and b.startswith(a) and b[len(a) :].isalpha()]
    assert clashes == [], clashes


def _run_fresh(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_planner_and_lower_layers_never_import_torch(tmp_path):
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 3000, 20, 4000, 700, 650, 90, 10]))
    loaded = _run_fresh(
        f"""
        import io, json, sys, contextlib
        import mcore_packing, mcore_packing.data, mcore_packing.packing, mcore_packing.planning
        import mcore_packing.data.sft, mcore_packing.app.config, mcore_packing.app.recipes
        from mcore_packing.__main__ import main
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(["plan", "--lengths", {str(lengths)!r}, "--no-png", "--global-batch-size", "4", "--dp", "2"])
            code += main(["train", "--recipe", "llama3_8b_sft_packed", "--dry-run", "data.num_samples=200"])
            code += main(["train", "--recipe", "qwen2_7b_grpo_cp", "--dry-run"])  # loss_fn / grpo groups
        print(json.dumps({{"code": code, "heavy": sorted(m for m in ("torch", "megatron") if m in sys.modules)}}))
        """
    )
    assert loaded == {"code": 0, "heavy": []}  # the planner and a recipe's dry run, on a login node


def test_negative_control_the_torch_probe_sees_torch():
    loaded = _run_fresh(
        """
        import json, sys
        import mcore_packing.thd
        print(json.dumps({"heavy": sorted(m for m in ("torch", "megatron") if m in sys.modules)}))
        """
    )
    assert loaded == {"heavy": ["torch"]}


@pytest.mark.parametrize("layer", TORCH_FREE)
def test_torch_free_layers_have_no_torch_import_anywhere(layer):
    paths = [PACKAGE / f"{layer}.py"] if (PACKAGE / f"{layer}.py").exists() else sorted((PACKAGE / layer).rglob("*.py"))
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not any(n.split(".")[0] in ("torch", "megatron") for n in names), (path, names)


def long_functions(source: str, path: str) -> list[str]:
    """Functions whose body (docstring excluded) is longer than `MAX_FUNCTION_LINES`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        length = node.end_lineno - body[0].lineno + 1
        if length > MAX_FUNCTION_LINES and (path, node.name) not in LONG_KERNELS:
            out.append(f"{path}:{node.name} ({length} lines)")
    return out


def test_no_function_is_longer_than_60_lines():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        bad += long_functions(path.read_text(), str(path.relative_to(PACKAGE)))
    assert bad == [], bad


def test_negative_control_a_long_function_is_flagged():
    source = "def f():\n    '''doc'''\n" + "    x = 1\n" * 61
    assert long_functions(source, "x.py") == ["x.py:f (61 lines)"]
    assert long_functions("def g():\n" + "    x = 1\n" * 60, "x.py") == []


def undocumented_modules(text: str) -> list[str]:
    """Modules of the package that docs/architecture.md does not name: neither the dotted path
    (``planning.step_plan``) nor, inside its package's row, the module's name in backticks or before
    its description (``cpu_device`` (...))."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            continue
        dotted, name = ".".join(parts), parts[-1]
        if not re.search(rf"\b{re.escape(dotted)}\b", text) and f"`{name}`" not in text and f"{name} (" not in text:
            missing.append(dotted)
    return missing


def test_every_module_is_named_in_the_architecture_notes():
    assert undocumented_modules((ROOT / "docs" / "architecture.md").read_text()) == []


def test_negative_control_an_unnamed_module_is_flagged():
    text = (ROOT / "docs" / "architecture.md").read_text().replace("planning.step_plan", "planning.STEP_PLAN")
    text = text.replace("`step_plan`", "`STEP_PLAN`").replace("step_plan (", "STEP_PLAN (")
    assert undocumented_modules(text) == ["planning.step_plan"]
