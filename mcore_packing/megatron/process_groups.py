"""The process groups of the step path: Megatron's own ``ProcessGroupCollection``, with the ranks and
sizes the step driver reads derived from its groups, and the check that every rank planned the same step.

`ProcessGroups.from_megatron` is the one reader of Megatron's global ``parallel_state`` on the step path;
everything below it takes the groups as an argument: the model builder hands the same collection to
GPTModel and DDP (``pg_collection``), and the schedule receives it too. A framework with its own groups
passes its own collection (`ProcessGroups(collection)`). "Process groups" always means torch.distributed
groups here; groups of samples (DPO pairs, GRPO responses) are the plan's ``groups``.

Dynamic context parallelism runs each micro-batch on a CP sub-group of the DP x CP ranks:
`ProcessGroups.with_dynamic_cp(max_cp)` adds those sub-groups (`DynamicCPGroups`, created once, a
collective over the whole world) to the handle the step receives.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from ..collectives import all_gather_object, all_gather_tensors
from ..planning.step_plan import StepPlan

__all__ = ["STEP_GROUPS", "DynamicCPGroups", "ProcessGroups", "group_rank", "group_size", "verify_plan_across_ranks"]

STEP_GROUPS = ("tp", "pp", "cp", "dp", "dp_cp", "embd", "pos_embd")
"""The ``ProcessGroupCollection`` fields the step path and Megatron's schedules read (GPTModel and DDP
read more: the expert groups among them)."""


@dataclass(frozen=True)
class DynamicCPGroups:
    """For dynamic context parallelism: a process group for every aligned group of ``k`` consecutive ranks
    of this rank's DP x CP domain (in the order of Megatron's ``dp_cp`` group), for every power of two
    ``k`` up to ``max_cp`` (singletons for ``k = 1``); ``rank`` is this rank's place in the domain, ``size``
    the domain's ranks. ``groups[k, first]`` is the group of ranks ``first .. first + k - 1``."""

    groups: dict
    rank: int
    size: int
    max_cp: int

    @classmethod
    def create(cls, process_groups: ProcessGroups, *, max_cp: int) -> DynamicCPGroups:
        """Collective over the whole world: ``torch.distributed.new_group`` must be called by every rank
        for every group in one order, so every rank creates the sub-groups of every DP x CP domain (one per
        TP rank, learned with one all-gather) and keeps its own domain's."""
        if max_cp < 1 or max_cp & (max_cp - 1):
            raise ValueError(f"max_cp={max_cp} must be a power of two (the largest CP size of dynamic CP).")
        domain = process_groups.dp_cp
        mine = tuple(dist.get_process_group_ranks(domain)) if domain is not None else (dist.get_rank(),)
        if len(mine) % max_cp:
            raise ValueError(f"the DP x CP domain has {len(mine)} ranks, not a multiple of max_cp={max_cp}.")
        domains = all_gather_object(mine)
        groups = {}
        for ranks in sorted(set(domains)):
            k = 1
            while k <= max_cp:
                for first in range(0, len(ranks), k):
                    group = dist.new_group(list(ranks[first : first + k]))
                    if ranks == mine:
                        groups[k, first] = group
                k *= 2
        return cls(groups=groups, rank=mine.index(dist.get_rank()), size=len(mine), max_cp=max_cp)

    def group(self, cp_size: int, first_rank: int):
        """The sub-group of a row of CP size ``cp_size`` on ranks ``first_rank ..`` of the domain."""
        if (cp_size, first_rank) not in self.groups:
            raise ValueError(
                f"no dynamic-CP group of {cp_size} ranks at domain rank {first_rank}: the plan is for a larger CP "
                f"size than these groups (max_cp={self.max_cp}) or another domain; plan with the run's layout."
            )
        return self.groups[cp_size, first_rank]


@dataclass(frozen=True)
class ProcessGroups:
    """A Megatron ``ProcessGroupCollection`` (``collection``) with at least `STEP_GROUPS` set, and under
    dynamic context parallelism its CP sub-groups (``dynamic_cp``, see `with_dynamic_cp`)."""

    collection: object
    dynamic_cp: DynamicCPGroups | None = None

    @classmethod
    def from_megatron(cls) -> ProcessGroups:
        """Every group of Megatron's initialized ``parallel_state`` (the model, DDP and the schedule)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        return cls(ProcessGroupCollection.use_mpu_process_groups())

    def with_dynamic_cp(self, max_cp: int | None = None) -> ProcessGroups:
        """These groups plus the CP sub-groups dynamic CP runs its rows on (sizes up to ``max_cp``, default
        this run's CP size). Collective over the whole world: every rank calls it, once per run."""
        return replace(self, dynamic_cp=DynamicCPGroups.create(self, max_cp=max_cp or self.cp_size))

    def for_cp_group(self, cp_group) -> ProcessGroups:
        """A copy whose ``cp`` is ``cp_group`` (a dynamic-CP row's sub-group): a micro-batch is built, cut
        and gathered by it."""
        import copy

        collection = copy.copy(self.collection)
        collection.cp = cp_group
        return ProcessGroups(collection)

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
    def expert_tp(self):
        """The expert tensor-parallel group (the TP group unless ``parallel.etp=1``)."""
        return getattr(self.collection, "expt_tp", None)

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
    gathered = all_gather_tensors(torch.from_numpy(digest), group)  # on the device the backend takes
    differing = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
    if differing:
        raise ValueError(
            f"Step plans differ across ranks (ranks {differing} disagree with rank 0 of the group). Every rank "
            "must plan the same global batch with the same config: check the data loader's seed and sharding, "
            f"the batch size and train_mb_tokens. This rank planned {len(plan.lengths)} samples, "
            f"{plan.num_microbatches} micro-batches per rank."
        )
