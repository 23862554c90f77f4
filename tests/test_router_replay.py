"""Router replay (R3): a Mixture-of-Experts model trained on packed micro-batches routes every real token
to the experts recorded for it, and its loss, router loss and gradients equal an unpacked replay reference.

Reference: `replay_workers.replay_reference_worker` (records routes with an unpacked forward, perturbs the
routers so fresh routing changes, then replays in plain torch, one sequence per forward). Under test: the
samples' ``routed_experts`` through the planner, `prepare`, the schedule driver and `install_router_replay`
at EP2 (DP4), TP2 + SP x EP2, CP2 x EP2 and PP2 x EP2. Every (layer, expert) count of routed real tokens
equals the recorded routes' (pads counted nowhere); the negative control trains on fresh routing and must
differ.
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


def test_one_rank_replay_logprobs_and_the_negative_control(reference):
    replayed, fresh = run(1, [{"mode": "packing", "logprobs": True}, {"mode": "packing", "negative": "no_replay"}],
                          reference)  # fmt: skip
    check(replayed, reference)
    for i, ref in enumerate(reference["logprobs"]):  # the log-prob pass replays too
        torch.testing.assert_close(replayed["logprobs"][i, : ref.numel()], ref, rtol=1e-5, atol=1e-5)
    assert abs(replayed["mismatch"] - reference["fresh_mismatch"]) < 0.02, (replayed["mismatch"], reference)
    loss_err, _, grad_err = errors(fresh, reference)
    assert loss_err > 10 * RTOL and grad_err > 1e-3 and not torch.equal(fresh["counts"], reference["counts"])


FOUR_RANKS = [
    {"ep": 2},
    {"tp": 2, "ep": 2},
    {"cp": 2, "ep": 2},
    {"pp": 2, "ep": 2},
]


def test_replay_at_ep_tp_sp_cp_pp(reference):
    results = run(4, FOUR_RANKS, reference)
    for result in results:
        check(result, reference)
    assert any(r["num_microbatches"] > 1 for r in results)
