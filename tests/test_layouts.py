"""The same seeded model and batch on one rank, at DP2 and at CP2, over gloo: the SFT step, the log-prob
pass and the GRPO step agree (`layout_workers`). The GPU check runs the same worker over NCCL
(`test_gpu.py::test_two_rank_nccl_steps_match_the_single_rank`)."""

from __future__ import annotations

import pytest

from .distributed_harness import run_distributed
from .layout_workers import compare_layouts

pytestmark = pytest.mark.multirank


def test_dp2_and_cp2_match_the_single_rank_over_gloo():
    out = compare_layouts(run_distributed)
    print({name: r["grpo_loss"] for name, r in out["results"].items()}, out["errors"])
    for name, errors in out["errors"].items():
        assert max(errors.values()) <= 1e-5, (name, errors)
    assert out["results"]["single"]["grpo_loss"] != 0.0
