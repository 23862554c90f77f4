"""Mixture-of-Experts: the loss, the router losses (per-sequence balance loss and z-loss) and every
gradient of a training step equal an unpacked reference, on real Megatron schedules and real gloo ranks.

Reference: `moe_workers.reference_worker` (stock Megatron MoE model, one sequence per forward, the router
losses in plain torch). Under test: `router_loss.RouterLoss` with the planner, builder and schedule driver
at EP1, EP2, TP2 x EP2 (sequence parallel), EP2 x CP2 and PP2 x EP2, packed and dynamically batched, with
several micro-batches per rank; the interleaved pipeline (PP2 x VPP2) and dynamic CP (rows of CP 1, 2 and 4
on their sub-groups, with TP2 too). The negative control computes the balance loss over each packed row as one
sequence (what Megatron 0.16's ``seq_aux_loss`` does with THD rows) and must fail.
"""

from __future__ import annotations

import pytest

from . import test_step_equivalence as step_equivalence
from .distributed_harness import run_distributed
from .test_step_equivalence import SAMPLES, grad_errors

pytestmark = pytest.mark.multirank

RTOL = 1e-5


@pytest.fixture(scope="module")
def reference():
    return run_distributed("tests.moe_workers:reference_worker", 1, samples=SAMPLES)[0]


def run_configs(world_size: int, configs: list[dict], reference: dict) -> list[dict]:
    return step_equivalence.run_configs(world_size, configs, reference, worker="moe_workers:moe_step_worker")


def errors(result: dict, reference: dict) -> tuple[float, float, float]:
    """Relative errors of the main loss, the router loss and the worst gradient tensor."""
    loss = abs(result["loss"] - reference["loss"]) / abs(reference["loss"])
    router = abs(result["router_loss"] - reference["router_loss"]) / abs(reference["router_loss"])
    return loss, router, max(grad_errors(result["grads"], reference["grads"]).values())


def check(result: dict, reference: dict) -> None:
    assert result["all_losses_equal"], result["config"]
    errs = errors(result, reference)
    assert max(errs) <= RTOL, (result["config"], errs)


def test_the_reference_router_loss_matters(reference):
    """The balance and z-losses are a visible part of the step (else the grid could not see them)."""
    assert reference["router_loss"] > 0.05 * reference["loss"]


ONE_RANK = [{"mode": "packing"}, {"mode": "dynamic"}, {"mode": "packing", "per_token_loss": True}]
NEGATIVE = [{"mode": "packing", "negative": "whole_row_balance"}]
TWO_RANKS = [{"ep": 2, "mode": "packing", "train_mb_tokens": 48}, {"ep": 2, "mode": "dynamic"}]
FOUR_RANKS = [
    {"tp": 2, "ep": 2, "mode": "packing", "train_mb_tokens": 48},
    {"cp": 2, "ep": 2, "mode": "packing", "train_mb_tokens": 48},
    {"cp": 2, "ep": 2, "mode": "dynamic"},
    {"pp": 2, "ep": 2, "mode": "packing", "train_mb_tokens": 48},
    {"ep": 2, "mode": "dynamic", "per_token_loss": True},
    {"cp": 2, "ep": 2, "mode": "packing", "negative": "counts_per_cp_shard"},
]
"""The grid: (TP, PP, CP, EP) layouts on 1, 2 and 4 gloo ranks (DP fills the rest), both modes, both of
Megatron's loss conventions, one or several micro-batches per rank (48- or 96-token budgets). The last
is a second negative control: each CP rank counts the expert choices of its own chunks only."""


def test_one_rank_packed_and_dynamic_and_the_negative_control(reference):
    results = run_configs(1, ONE_RANK + NEGATIVE, reference)
    for result in results[: len(ONE_RANK)]:
        assert result["num_microbatches"] > 1
        check(result, reference)
    _, router_err, grad_err = errors(results[-1], reference)
    assert router_err > 1e-3 and grad_err > 1e-3, (router_err, grad_err)


def test_expert_parallel_two_ranks(reference):
    for result in run_configs(2, TWO_RANKS, reference):
        check(result, reference)


VPP_AND_DYNAMIC_CP = [
    {"pp": 2, "vpp": 2, "ep": 2, "mode": "packing", "train_mb_tokens": 48},
    {"pp": 2, "vpp": 2, "ep": 2, "mode": "dynamic"},
    {"cp": 4, "ep": 2, "dynamic_cp": True, "mode": "packing", "train_mb_tokens": 16},
    {"cp": 2, "tp": 2, "ep": 2, "dynamic_cp": True, "mode": "packing", "train_mb_tokens": 24},
    {"cp": 2, "ep": 2, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 24},
    {"cp": 4, "ep": 2, "dynamic_cp": True, "mode": "packing", "train_mb_tokens": 16,
     "negative": "row_counts_per_shard"},
]
"""Each chunk of the interleaved pipeline has its own router loss (summed); dynamic CP's rows of CP 1, 2 and
4 sum their counts over TP and the row's CP sub-group. The negative control counts each shard of a row alone."""


@pytest.mark.slow
def test_expert_parallel_with_tp_cp_pp_vpp_and_dynamic_cp(reference):
    """One 4-rank spawn for both grids (FOUR_RANKS, then VPP_AND_DYNAMIC_CP), each ending in its negative control."""
    results = run_configs(4, FOUR_RANKS + VPP_AND_DYNAMIC_CP, reference)
    static, rest = results[: len(FOUR_RANKS)], results[len(FOUR_RANKS) :]
    for result in static[:-1] + rest[:-1]:
        check(result, reference)
    assert any(r["num_microbatches"] > 1 for r in static if r["config"].get("pp") == 2)  # 1F1B interleaves
    sizes = [r["cp_sizes"] for r in rest if r["cp_sizes"]]
    assert all(any(k > 1 and n for k, n in s.items()) for s in sizes), sizes  # rows on CP sub-groups
    assert any(r["num_microbatches"] > 1 for r in rest if r["config"].get("vpp") == 2)
    for negative in (static[-1], rest[-1]):
        _, router_err, grad_err = errors(negative, reference)
        assert router_err > 1e-3 and grad_err > 1e-3, (negative["config"], router_err, grad_err)
