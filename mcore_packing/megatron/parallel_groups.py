"""The process groups the step driver needs, and the check that every rank planned the same step.

`ParallelGroups.from_megatron` is the one reader of Megatron's global ``parallel_state`` on the step
path; everything below it takes groups as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..planning.step_plan import StepPlan

__all__ = ["ParallelGroups", "verify_plan_across_ranks"]


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """Process groups and ranks the driver needs; build with `from_megatron` or pass your own."""

    dp: object
    cp: object
    dp_cp: object
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    tp_size: int
    pp_size: int
    is_first_stage: bool
    is_last_stage: bool
    pp: object = None

    @classmethod
    def from_megatron(cls) -> ParallelGroups:
        """The groups of Megatron's initialized ``parallel_state``."""
        from megatron.core import parallel_state as ps

        return cls(
            dp=ps.get_data_parallel_group(),
            cp=ps.get_context_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            pp=ps.get_pipeline_model_parallel_group(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            is_first_stage=ps.is_pipeline_first_stage(ignore_virtual=True),
            is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True),
        )


def group_size(group) -> int:
    """Ranks in ``group``; 1 for None (a world of one)."""
    return dist.get_world_size(group) if group is not None else 1


def verify_plan_across_ranks(plan: StepPlan, group) -> None:
    """Raise a clear error (not a hang) when the ranks of ``group`` planned different steps.

    One small all-gather of the plan's fingerprint; every rank of the group must call this.
    """
    digest = np.frombuffer(bytes.fromhex(plan.fingerprint())[:16], dtype=np.int64).copy()
    mine = torch.from_numpy(digest)
    gathered = [torch.empty_like(mine) for _ in range(group_size(group))]
    dist.all_gather(gathered, mine, group=group)
    differing = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
    if differing:
        raise ValueError(
            f"Step plans differ across ranks (ranks {differing} disagree with rank 0 of the group). Every rank "
            "must plan the same global batch with the same config: check the data loader's seed and sharding, "
            f"the batch size and train_mb_tokens. This rank planned {len(plan.lengths)} samples, "
            f"{plan.num_microbatches} micro-batches per rank."
        )
