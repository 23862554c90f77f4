"""`GlobalBatchSampler`: which samples form each global batch, identical on every rank, resumable exactly."""

from __future__ import annotations

import numpy as np

from .config import ConfigError

__all__ = ["GlobalBatchSampler"]


class GlobalBatchSampler:
    """Deterministic epochs of shuffled sample indices, cut into global batches; resumable exactly.

    Every rank draws the same global batch (the planner then gives each rank its share), so nothing
    needs to be communicated. The state is ``(epoch, offset)``: resuming continues at the next sample.
    """

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        if global_batch_size > num_samples:
            raise ConfigError(
                f"training.global_batch_size={global_batch_size} is larger than the data set ({num_samples} "
                "samples). Lower it or load more samples (data.num_samples)."
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_batch(self) -> list[int]:
        """The next global batch; an epoch's tail shorter than a batch is carried into the next epoch."""
        out: list[int] = []
        while len(out) < self.global_batch_size:
            order = self._order(self.epoch)
            take = order[self.offset : self.offset + self.global_batch_size - len(out)]
            out.extend(int(i) for i in take)
            self.offset += len(take)
            if self.offset >= self.num_samples:
                self.epoch += 1
                self.offset = 0
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["seed"] != self.seed:
            raise ConfigError(
                "The checkpoint was written for a different data set or seed (num_samples/seed differ); resume with "
                "the same data.* and training.seed, or start a new run_dir."
            )
        self.epoch, self.offset = state["epoch"], state["offset"]
