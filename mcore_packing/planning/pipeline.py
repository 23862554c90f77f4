"""A small simulator of Megatron's 1F1B pipeline schedule, and the micro-batch order that minimises it.

With pipeline parallelism a step's time is not the sum of its micro-batches: stage ``s`` starts after the
first micro-batch's forwards on stages ``0..s-1`` and the last backwards drain the same way, so the
micro-batches at both ends of a rank's list set the pipeline bubble. Each micro-batch ``i`` has a forward
time ``f_i`` (the same on every stage: layers are split evenly) and a backward time ``backward_ratio *
f_i``. Stage ``s`` runs ``min(pp - s - 1, m)`` warm-up forwards, then alternates one forward and one
backward, then the remaining backwards (Megatron's non-interleaved 1F1B); an operation starts when its
stage is free and its input has arrived (forward from stage ``s-1``, backward from stage ``s+1``);
communication is free.

Lower bound of any order: every stage runs all its work, plus the unavoidable fill and drain of the
cheapest micro-batch, ``sum(f + b) + (pp - 1) * min(f + b)``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["best_pipeline_order", "pipeline_lower_bound", "simulate_1f1b"]


def _stage_ops(stage: int, pp: int, m: int) -> list[tuple[str, int]]:
    warmup = min(pp - stage - 1, m)
    ops = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i), ("B", i)]
    return ops + [("B", i) for i in range(m - warmup, m)]


def simulate_1f1b(forward, pp: int, *, backward_ratio: float = 2.0) -> float:
    """Step time of one rank's micro-batches (forward times in execution order) under 1F1B on ``pp`` stages."""
    f = np.asarray(forward, dtype=np.float64)
    m = f.size
    if m == 0:
        return 0.0
    if pp == 1:
        return float(f.sum() * (1 + backward_ratio))
    done = {}  # (kind, stage, i) -> end time
    queues = [_stage_ops(s, pp, m) for s in range(pp)]
    position, clock = [0] * pp, [0.0] * pp
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(queues[s]):
                kind, i = queues[s][position[s]]
                ready = _input_ready(done, kind, s, i, pp)
                if ready is None:
                    break
                start = max(clock[s], ready)
                clock[s] = start + (f[i] if kind == "F" else backward_ratio * f[i])
                done[(kind, s, i)] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B simulation deadlocked"
    return max(clock)


def _input_ready(done: dict, kind: str, s: int, i: int, pp: int) -> float | None:
    if kind == "F":
        return 0.0 if s == 0 else done.get(("F", s - 1, i))
    if s == pp - 1:
        return done.get(("F", s, i))
    return done.get(("B", s + 1, i))


def pipeline_lower_bound(forward, pp: int, *, backward_ratio: float = 2.0) -> float:
    """``sum(f + b) + (pp - 1) * min(f + b)``: no order of these micro-batches runs faster."""
    work = np.asarray(forward, dtype=np.float64) * (1 + backward_ratio)
    return float(work.sum() + (pp - 1) * work.min()) if work.size else 0.0


def best_pipeline_order(forward, pp: int, *, backward_ratio: float = 2.0) -> list[int]:
    """Positions in the execution order with the smallest simulated 1F1B time among the candidate orders:
    as given, largest first, smallest first, and the cheapest at both ends (and its mirror)."""
    f = np.asarray(forward, dtype=np.float64)
    ascending = np.argsort(f, kind="stable").tolist()
    bubble = ascending[0::2] + ascending[1::2][::-1]
    candidates = [list(range(f.size)), ascending[::-1], ascending, bubble, bubble[::-1], _ends_first(ascending)]
    return min(candidates, key=lambda order: simulate_1f1b(f[order], pp, backward_ratio=backward_ratio))


def _ends_first(ascending: list[int]) -> list[int]:
    """The cheapest first, the second cheapest last, the rest largest first in between (the first sets
    the fill, the last the drain, the middle runs back to back)."""
    if len(ascending) < 3:
        return ascending
    return [ascending[0], *ascending[2:][::-1], ascending[1]]
