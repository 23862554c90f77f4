"""Router replay (R3): a Mixture-of-Experts model trained on packed micro-batches routes every real token
to the experts recorded for it, and its loss, router loss and gradients equal an unpacked replay reference.

Reference: `replay_workers.replay_reference_worker` (records routes with an unpacked forward, perturbs the
routers so fresh routing changes, then replays in plain torch, one sequence per forward). Under test: the
samples' ``routed_experts`` through the planner, `prepare`, the schedule driver and `install_router_replay`
at EP2 (DP4, with the log-prob pass), TP2 + SP x EP2, CP2 x EP2 and PP2 x EP2. Every (layer, expert)
count of routed real tokens equals the recorded routes' (pads counted nowhere); the negative control trains
on fresh routing and must differ.
"""

from __future__ import annotations

import pytest
import torch

from .distributed_harness import run_distributed
from .moe_workers import NUM_EXPERTS
from .test_moe_equivalence import errors
from .test_step_equivalence import SAMPLES

pytestmark = pytest.mark.multirank

RTOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return run_distributed("tests.replay_workers:replay_reference_worker", 1, samples=SAMPLES)[0]


def run(world_size: int, configs: list[dict], reference: dict) -> list[dict]:
    return run_distributed("tests.replay_workers:replay_step_worker", world_size, configs=configs, samples=SAMPLES,
                           state_dict=reference["state_dict"], routes=reference["routes"], timeout=900)[0]  # fmt: skip


def check(result: dict, reference: dict) -> None:
    assert result["all_losses_equal"], result["config"]
    assert max(errors(result, reference)) <= RTOL, (result["config"], errors(result, reference))
    assert torch.equal(result["counts"], reference["counts"]), result["config"]  # every real token, as recorded
    router = [g for name, g in result["grads"].items() if "router.weight" in name]
    assert router and all(g.abs().max() > 0 for g in router)  # the router still learns through its weights


def test_the_perturbed_routers_route_differently(reference):
    """The negative-control premise: after the perturbation fresh routing changes many choices."""
    assert reference["fresh_mismatch"] > 0.1
    assert all(r.shape[1:] == (4, 2) and int(r.max()) < NUM_EXPERTS for r in reference["routes"])


LAYOUTS = [
    {"ep": 2, "logprobs": True},
    {"tp": 2, "ep": 2},
    {"cp": 2, "ep": 2},
    {"pp": 2, "ep": 2},
    {"ep": 2, "negative": "no_replay"},
]
"""One 4-rank spawn: EP2 (DP4) with the log-prob pass, TP2 + SP x EP2, CP2 x EP2, PP2 x EP2, and the negative
control (EP2 without the routes: fresh routing)."""


def test_replay_at_ep_tp_sp_cp_pp_and_the_negative_control(reference):
    results = run(4, LAYOUTS, reference)
    for result in results[:-1]:
        check(result, reference)
        assert abs(result["mismatch"] - reference["fresh_mismatch"]) < 0.02, (result["mismatch"], reference)
    for i, ref in enumerate(reference["logprobs"]):  # the log-prob pass replays too
        torch.testing.assert_close(results[0]["logprobs"][i, : ref.numel()], ref, rtol=1e-5, atol=1e-5)
    assert any(r["num_microbatches"] > 1 for r in results)
    loss_err, _, grad_err = errors(results[-1], reference)
    assert loss_err > 10 * RTOL and grad_err > 1e-3 and not torch.equal(results[-1]["counts"], reference["counts"])
