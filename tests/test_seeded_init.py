"""Without a checkpoint, a model's initial weights are a function of the seed and the shape only
(`megatron.seeded_init`): TP1, TP2 and PP2 gathered give the same Hugging Face tensors, so does Megatron's
GPU initialization branch (parameters made "on the GPU", driven on the CPU through the device adapter),
and a reference built after its policy holds the policy's weights. Negative control: Megatron's own init
gives other weights at TP2 on its GPU branch than at TP1. (That a second build on a real GPU draws other
weights than the first, from the RNG tracker's CUDA states that ``torch.manual_seed`` does not reset,
cannot be shown here: on a CPU the tracker keeps no CUDA state. `seeded_init` draws from neither.)"""

from __future__ import annotations

import pytest
import torch

from .distributed_harness import run_distributed

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def built():
    return run_distributed("tests.init_workers:init_worker", 2)[0]


def _differing(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [name for name in a if not torch.equal(a[name], b[name])]


def test_the_same_weights_on_every_layout_and_branch(built):
    builds = built["builds"]
    tp1 = builds["tp1"]
    assert len(tp1) == 3 + 4 * 11  # embedding, final norm, head; per layer: 2 norms, q/k norms, q, k, v, o, gate,
    # up, down
    for name in ("tp2", "pp2", "tp2 gpu branch"):
        assert _differing(builds[name], tp1) == [], name
    down, up = tp1["model.layers.0.mlp.down_proj.weight"], tp1["model.layers.0.mlp.up_proj.weight"]
    assert float(down.std()) < float(up.std())  # the output projections' scaled std
    assert torch.equal(tp1["model.norm.weight"], torch.ones(32))


def test_policy_and_reference_start_from_the_same_weights(built):
    assert built["policy_equals_reference"] and built["build_policy_equal"]


def test_a_reference_under_dynamic_cp_reuses_the_policys_communicators(built):
    """One set of dynamic-CP sub-groups per run: 2 ranks at CP2 make 3 (two of one rank, one of both),
    the reference given the policy's groups makes none."""
    assert built["groups_by_policy"] == 3 and built["groups_by_reference"] == 0
    assert built["reference_shares_groups"]


def test_negative_control_megatrons_own_init_depends_on_the_layout_and_the_branch(built):
    builds = built["builds"]
    assert _differing(builds["tp2 gpu branch, Megatron's init"], builds["tp1, Megatron's init"])
