"""Length distributions for benchmarks and demos: synthetic shapes and real corpora, all seeded.

Every distribution returns integer lengths in ``[1, capacity]``. Synthetic draws above the capacity are
clipped to it (these are generated lengths, not user data). Real documents longer than the capacity are
split into capacity-sized pieces plus a remainder, the way long documents are chunked for training, so
no token of the corpus is lost.
"""

from __future__ import annotations

import numpy as np

from .real_text import REAL_CORPORA, real_corpus_lengths

__all__ = ["DISTRIBUTIONS", "sample_lengths", "split_to_capacity"]

DISTRIBUTIONS = ("lognormal", "power_law", "uniform", *(f"real:{c}" for c in REAL_CORPORA))


def split_to_capacity(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Split each length into ``capacity``-sized pieces plus a remainder; short ones are unchanged."""
    lengths = np.asarray(lengths, dtype=np.int64)
    full, rest = np.divmod(lengths, capacity)
    pieces = np.repeat(np.full(lengths.size, capacity, dtype=np.int64), full)
    return np.concatenate([lengths[full == 0], pieces, rest[(full > 0) & (rest > 0)]])


def sample_lengths(distribution: str, num: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Draw ``num`` lengths in ``[1, capacity]`` from a named distribution (see ``DISTRIBUTIONS``).

    - ``lognormal``: median ``capacity/16``, sigma 1.0 (SFT-like: most short, some long).
    - ``power_law``: Pareto tail with exponent 1.2 starting at ``capacity/512`` tokens (RL responses:
      median about ``capacity/290``, a few at the cap). ``power_law:<min>`` starts the tail at ``<min>`` tokens;
      a larger minimum leaves gaps no sequence can fill, so bins stay further from ceil(sum/C).
    - ``uniform``: uniform in ``[1, capacity]`` (the hard case for packers).
    - ``real:champ`` / ``real:stdlib``: resampled with replacement from a real corpus's token lengths.
    """
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}.")
    rng = np.random.default_rng(seed)
    if distribution == "lognormal":
        raw = rng.lognormal(mean=np.log(capacity / 16), sigma=1.0, size=num)
    elif distribution == "power_law" or distribution.startswith("power_law:"):
        minimum = float(distribution.split(":", 1)[1]) if ":" in distribution else capacity / 512
        if not minimum >= 1:
            raise ValueError(f"{distribution!r}: the power-law minimum must be >= 1 token.")
        raw = (rng.pareto(1.2, size=num) + 1.0) * minimum
    elif distribution == "uniform":
        return rng.integers(1, capacity + 1, size=num, dtype=np.int64)
    elif distribution.startswith("real:"):
        corpus = distribution.split(":", 1)[1]
        population = split_to_capacity(real_corpus_lengths(corpus), capacity)
        return rng.choice(population, size=num, replace=True).astype(np.int64)
    else:
        raise ValueError(f"Unknown distribution {distribution!r}. Valid names: {', '.join(DISTRIBUTIONS)}.")
    return np.clip(np.rint(raw), 1, capacity).astype(np.int64)
