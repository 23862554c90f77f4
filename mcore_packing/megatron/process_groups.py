"""The process groups of the step path: Megatron's own ``ProcessGroupCollection``, with the ranks and
sizes the step driver reads derived from its groups, and the check that every rank planned the same step.

`ProcessGroups.from_megatron` is the one reader of Megatron's global ``parallel_state`` on the step path;
everything below it takes the groups as an argument: the model builder hands the same collection to
GPTModel and DDP (``pg_collection``), and the schedule receives it too. A framework with its own groups
passes its own collection (`ProcessGroups(collection)`). "Process groups" always means torch.distributed
groups here; groups of samples (DPO pairs, GRPO responses) are the plan's ``groups``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..planning.step_plan import StepPlan

__all__ = ["STEP_GROUPS", "ProcessGroups", "group_rank", "group_size", "verify_plan_across_ranks"]

STEP_GROUPS = ("tp", "pp", "cp", "dp", "dp_cp", "embd", "pos_embd")
"""The ``ProcessGroupCollection`` fields the step path and Megatron's schedules read (GPTModel and DDP
read more: the expert groups among them)."""


@dataclass(frozen=True)
class ProcessGroups:
    """A Megatron ``ProcessGroupCollection`` (``collection``) with at least `STEP_GROUPS` set."""

    collection: object

    @classmethod
    def from_megatron(cls) -> ProcessGroups:
        """Every group of Megatron's initialized ``parallel_state`` (the model, DDP and the schedule)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return cls(ProcessGroupCollection.use_mpu_process_groups())

    @property
    def dp(self):
        return self.collection.dp

    @property
    def cp(self):
        return self.collection.cp

    @property
    def dp_cp(self):
        return self.collection.dp_cp

    @property
    def pp(self):
        return self.collection.pp

    @property
    def tp(self):
        return self.collection.tp

    @property
    def ep(self):
        """The expert-parallel group (Mixture-of-Experts; size 1 for dense models)."""
        return self.collection.ep

    @property
    def dp_rank(self) -> int:
        return group_rank(self.dp)

    @property
    def dp_size(self) -> int:
        return group_size(self.dp)

    @property
    def cp_rank(self) -> int:
        return group_rank(self.cp)

    @property
    def cp_size(self) -> int:
        return group_size(self.cp)

    @property
    def tp_size(self) -> int:
        return group_size(self.tp)

    @property
    def pp_rank(self) -> int:
        return group_rank(self.pp)

    @property
    def pp_size(self) -> int:
        return group_size(self.pp)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def group_size(group) -> int:
    """Ranks in ``group``; 1 for None (a world of one)."""
    return dist.get_world_size(group) if group is not None else 1


def group_rank(group) -> int:
    """This rank's index in ``group``; 0 for None."""
    return dist.get_rank(group) if group is not None else 0


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
