"""`Checkpointer`: when to save, where, and how to resume a run at the exact next sample.

Format: one ``torch.save`` file per rank under ``<checkpoint_dir>/step_NNNNNN/`` with the model shard,
the optimizer, the sampler position and the RNG state, plus what export needs (the rank's place in the
TP/PP/DP layout, its layers' global numbers, the model shape and ``model.hf_path``), and a ``latest``
pointer. It resumes on the same parallel layout only; the loop talks to this class alone, so the format
can change without touching it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .config import ConfigError, TrainConfig
from .global_batches import GlobalBatchSampler
from .model_setup import TrainingSetup

__all__ = ["Checkpointer"]


def _layout(model) -> dict:
    """This rank's place in the parallel layout and the global number of each of its layers."""
    from megatron.core import parallel_state as ps

    module = getattr(model, "module", model)
    return {
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "cp_rank": ps.get_context_parallel_rank(),
        "layer_numbers": [layer.layer_number - 1 for layer in module.decoder.layers],
    }


class Checkpointer:
    """Saves every ``training.save_interval`` steps and at the end; `load_latest` resumes."""

    def __init__(self, cfg: TrainConfig, rank: int):
        self.folder = Path(cfg.training.checkpoint_dir or os.path.join(cfg.run_dir, "checkpoints"))
        self.interval = cfg.training.save_interval
        self.rank = rank
        self.hf_path = cfg.model.hf_path

    def due(self, step: int, last_step: int) -> bool:
        """Save after ``step``: on the interval, and after the last step."""
        return (self.interval > 0 and step % self.interval == 0) or step == last_step

    def save(self, step: int, setup: TrainingSetup, sampler: GlobalBatchSampler) -> None:
        import torch
        import torch.distributed as dist

        folder = self.folder / f"step_{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        state = {
            "step": step,
            "model": setup.model.module.state_dict(),
            "optimizer": setup.optimizer.state_dict(),
            "sampler": sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "layout": _layout(setup.model),
            "model_shape": setup.shape.to_dict(),
            "hf_path": self.hf_path,
        }
        torch.save(state, folder / f"rank{self.rank:05d}.pt")
        dist.barrier()
        if self.rank == 0:
            (self.folder / "latest").write_text(folder.name)
        dist.barrier()

    def latest(self) -> Path:
        """The newest checkpoint's folder; a `ConfigError` when there is none."""
        pointer = self.folder / "latest"
        if not pointer.exists():
            raise ConfigError(f"resume=true but {pointer} does not exist; there is no checkpoint in this run_dir yet.")
        return self.folder / pointer.read_text().strip()

    def load_latest(self, setup: TrainingSetup, sampler: GlobalBatchSampler) -> int:
        """Restore the newest checkpoint; returns its step."""
        import torch

        state = torch.load(self.latest() / f"rank{self.rank:05d}.pt", weights_only=False)
        setup.model.module.load_state_dict(state["model"])
        setup.optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        return int(state["step"])
