"""One home for collectives: every ``torch.distributed`` collective mcore_packing issues goes through
`mcore_packing.collectives`, and there every tensor handed to torch is on the device the group's backend
takes. The second part reports the backend as NCCL (mocked: no GPU here) with ``meta`` standing in for the
current CUDA device, replaces torch's collectives with recorders, and runs the helpers and the step's call
sites on host tensors, as the code on a GPU would hand them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mcore_packing import collectives

ROOT = Path(__file__).resolve().parent.parent / "mcore_packing"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "broadcast",
    "reduce", "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "send",
    "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list",
}  # fmt: skip


def collective_calls(source: str) -> list[str]:
    """``line: name`` of every torch.distributed collective that ``source`` calls or names: ``dist.x``,
    ``torch.distributed.x``, ``getattr(dist, "x")`` and ``from torch.distributed import x``."""
    tree = ast.parse(source)
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{node.lineno}: {a.name}" for a in node.names if a.name in COLLECTIVES]
        elif isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) in aliases:
            found.append(f"{node.lineno}: {node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and ast.unparse(node.args[0]) in aliases
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES):  # fmt: skip
            found.append(f"{node.lineno}: getattr {node.args[1].value}")
    return found


def test_no_collective_outside_the_collectives_module():
    bad = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "collectives.py" and path.parent == ROOT:
            continue
        calls = collective_calls(path.read_text())
        if calls:
            bad[str(path.relative_to(ROOT))] = calls
    assert bad == {}, f"collectives outside mcore_packing/collectives.py: {bad}"


def test_negative_control_the_scan_finds_each_form():
    source = (
        "import torch.distributed as dist\nimport torch\nfrom torch.distributed import broadcast\n"
        "def f(t):\n    dist.all_reduce(t)\n    torch.distributed.all_gather([t], t)\n"
        "    getattr(dist, 'all_gather_single')(t, t)\n    dist.get_rank()\n"
    )
    expected = ["3: broadcast", "5: all_reduce", "6: all_gather", "7: getattr all_gather_single"]
    assert collective_calls(source) == expected
    assert collective_calls("x.all_reduce(t)\nStepTotals.all_reduce(1, 2, 3, g)\n") == []


def test_backend_device_types_read_the_backend():
    cases = {"nccl": ("cuda",), "gloo": ("cpu",), "cpu:gloo,cuda:nccl": ("cpu", "cuda"), "mpi": ("cpu",)}
    for backend, types in cases.items():
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dist, "get_backend", lambda group=None, b=backend: b)
            assert collectives.backend_device_types(object()) == types
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "get_backend", lambda group=None: "fancy")
        with pytest.raises(ValueError, match="'fancy' backend"):
            collectives.backend_device_types(object())


class _Reached(Exception):
    """Raised by the recording collectives: the call's tensors were checked (a meta tensor holds no data,
    so nothing after the collective could run)."""


@pytest.fixture
def nccl(monkeypatch):
    """torch.distributed as a 2-rank NCCL world would look, ``meta`` as the current CUDA device; every
    tensor collective records its tensors' devices and stops the caller."""
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(collectives, "_accelerator_device", lambda device_type: torch.device("meta"))

    def recorder(name):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            seen.append((name, {t.device.type for t in tensors}))
            raise _Reached(name)

        return collective

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast"):
        monkeypatch.setattr(dist, name, recorder(name), raising=False)
    return seen


def _run(fn, *args, **kwargs):
    with pytest.raises(_Reached):
        fn(*args, **kwargs)


def test_helpers_hand_nccl_device_tensors(nccl):
    group = object()
    host = torch.ones(3)
    _run(collectives.all_reduce, host, group)
    _run(collectives.all_reduce_values, [1, 2, 3], group, dtype=torch.int64)
    _run(collectives.all_gather_into, torch.empty(6), host, group)
    _run(collectives.all_gather_tensors, host, group)
    _run(collectives.broadcast, host, 1, group)
    names = [name for name, _ in nccl]
    assert names[0] == "all_reduce" and names[-1] == "broadcast" and len(nccl) == 5
    assert all(devices == {"meta"} for _, devices in nccl), nccl


def test_the_steps_call_sites_hand_nccl_device_tensors(nccl):
    """The sites the review found: the plan check, the step totals, the step's loss (and its pipeline
    broadcast), the log-prob buffer's DP sum, the metrics' sum, the stop flag."""
    from mcore_packing.app.stop_request import StopRequest
    from mcore_packing.megatron.process_groups import verify_plan_across_ranks
    from mcore_packing.megatron.step_result import broadcast_from_last_stage, step_loss
    from mcore_packing.planning import StepPlanConfig, plan_step
    from mcore_packing.rl.metrics import sum_over_ranks
    from mcore_packing.thd.loss_weights import StepTotals

    class Groups:  # a ProcessGroups' surface: last stage of 2, DP x CP of 2
        dp_cp = dp = pp = object()
        is_last_stage, pp_size = True, 2

    plan = plan_step([5, 9, 3], StepPlanConfig(train_mb_tokens=16))
    _run(verify_plan_across_ranks, plan, object())
    _run(StepTotals.all_reduce, 3, 2, 0, object())
    _run(step_loss, [{"weighted_loss": torch.ones(1)}], Groups(), torch.device("cpu"))
    _run(broadcast_from_last_stage, torch.zeros(2, 3), Groups())  # compute_logprobs' result
    _run(sum_over_ranks, [1.0, 2.0])  # the RL metrics
    _run(StopRequest(path="/nonexistent/stop").requested, world_size=2, rank=0)
    assert len(nccl) == 6 and all(devices == {"meta"} for _, devices in nccl), nccl


def test_negative_control_a_raw_collective_hands_nccl_a_host_tensor(nccl):
    """What the sites did before: ``dist.all_reduce`` on a host tensor reaches NCCL as a CPU tensor."""
    _run(dist.all_reduce, torch.ones(2))
    assert nccl == [("all_reduce", {"cpu"})]
