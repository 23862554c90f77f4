"""A small simulator of Megatron's 1F1B pipeline schedules, plain and interleaved, and the micro-batch
order that minimises it.

With pipeline parallelism a step's time is not the sum of its micro-batches: stage ``s`` starts after the
first micro-batch's forwards on stages ``0..s-1`` and the last backwards drain the same way, so the
micro-batches at both ends of a rank's list set the pipeline bubble. Each micro-batch ``i`` has a forward
time ``f_i`` (the same on every stage: layers are split evenly) and a backward time ``backward_ratio *
f_i``; an operation starts when its stage is free and its input has arrived; communication is free.

Plain 1F1B (``vpp=1``, Megatron's non-interleaved schedule): stage ``s`` runs ``min(pp - s - 1, m)``
warm-up forwards, then alternates one forward and one backward, then the remaining backwards; a forward
waits for stage ``s-1``'s, a backward for stage ``s+1``'s.

Interleaved 1F1B (``vpp > 1`` model chunks per stage, Megatron's virtual pipeline): every stage holds
``vpp`` chunks of ``1/vpp`` of its layers, so an operation costs ``f_i / vpp`` (or ``b_i / vpp``). A stage
walks the ``m * vpp`` (micro-batch, chunk) pairs in Megatron's table order: micro-batches in groups of
``group`` (``microbatch_group_size_per_vp_stage``, default ``pp``), each group through chunk 0, then
chunk 1, ...; the last group takes the rest. Backwards walk the same table with the chunks reversed.
Warm-up is ``2 (pp - s - 1) + (vpp - 1) group`` forwards (all of them if that is more), then one forward
and one backward alternate, then the remaining backwards. Chunk ``v``'s forward on stage 0 waits for
chunk ``v-1``'s on the last stage; chunk ``v``'s backward on the last stage waits for chunk ``v+1``'s on
stage 0 (the last chunk's, for its own forward).

Lower bound of any order: the last stage cannot start before the cheapest micro-batch's first chunk has
passed the stages before it, and stage 0 cannot end before a backward has come back through them, so
``sum(f + b) + (pp - 1) * min(f + b) / vpp``.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "best_pipeline_order",
    "check_interleaved_count",
    "interleaved_table",
    "pipeline_lower_bound",
    "simulate_1f1b",
    "stage_operations",
]


def check_interleaved_count(num_microbatches: int, pp: int, group: int) -> None:
    """Megatron's rules for the interleaved schedule's micro-batch count ``m`` on a rank: ``pp <= group <=
    m``, and the last group (``m % group``) either empty or at least ``pp`` micro-batches long."""
    if group < pp:
        raise ValueError(f"microbatch_group_size_per_vp_stage={group} must be at least pp={pp}.")
    rest = num_microbatches % group
    if num_microbatches < group or 0 < rest < pp:
        raise ValueError(
            f"{num_microbatches} micro-batches per rank cannot run the interleaved schedule at pp={pp} with "
            f"microbatch_group_size_per_vp_stage={group}: it needs at least {group}, and a count that is a "
            f"multiple of {group} or leaves at least {pp} over. Put more samples in the global batch or lower "
            "the micro-batch budget."
        )


def interleaved_table(num_microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """The (micro-batch, chunk) pairs in the order a stage runs their forwards: groups of ``group``
    micro-batches, each group through every chunk in turn, the last group holding the rest."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(i, v) for v in range(vpp) for i in range(first, last)]
    return table


def stage_operations(stage: int, pp: int, m: int, *, vpp: int = 1, group: int | None = None):
    """The operations pipeline stage ``stage`` runs for ``m`` micro-batches, in order: ``(kind, i, v)``
    with ``kind`` "F" (forward) or "B" (backward) of micro-batch ``i`` (its index in the rank's list)
    through model chunk ``v``, as Megatron's plain (``vpp=1``) or interleaved schedule runs them."""
    if vpp == 1:
        return _plain_ops(stage, pp, m)
    return _interleaved_ops(stage, pp, m, vpp, group or pp)


def _plain_ops(stage: int, pp: int, m: int) -> list[tuple[str, int, int]]:
    warmup = min(pp - stage - 1, m)
    ops = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [("F", warmup + i, 0), ("B", i, 0)]
    return ops + [("B", i, 0) for i in range(m - warmup, m)]


def _interleaved_ops(stage: int, pp: int, m: int, vpp: int, group: int) -> list[tuple[str, int, int]]:
    table = interleaved_table(m, vpp, group)
    total = len(table)
    warmup = min(2 * (pp - stage - 1) + (vpp - 1) * group, total)

    def forward(k):
        return ("F", *table[k])

    def backward(k):
        i, v = table[k]
        return ("B", i, vpp - 1 - v)

    ops = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [forward(warmup + k), backward(k)]
    return ops + [backward(k) for k in range(total - warmup, total)]


def simulate_1f1b(forward, pp: int, *, backward_ratio: float = 2.0, vpp: int = 1, group: int | None = None) -> float:
    """Step time of one rank's micro-batches (forward times in execution order) under 1F1B on ``pp``
    stages, interleaved over ``vpp`` model chunks per stage when ``vpp > 1`` (``group``: Megatron's
    ``microbatch_group_size_per_vp_stage``, default ``pp``)."""
    f = np.asarray(forward, dtype=np.float64)
    m = f.size
    if m == 0:
        return 0.0
    if pp == 1:
        return float(f.sum() * (1 + backward_ratio))
    group = pp if group is None else group
    if vpp > 1:
        check_interleaved_count(m, pp, group)
        queues = [_interleaved_ops(s, pp, m, vpp, group) for s in range(pp)]
    else:
        queues = [_plain_ops(s, pp, m) for s in range(pp)]
    return _run(queues, f / vpp, pp, vpp, backward_ratio)


def _run(queues, work, pp: int, vpp: int, backward_ratio: float) -> float:
    """Every stage runs its queue in order, each operation as soon as the stage is free and its input is
    there; the time the last stage finishes."""
    done = {}  # (kind, stage, micro-batch, chunk) -> end time
    position, clock = [0] * pp, [0.0] * pp
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(queues[s]):
                kind, i, v = queues[s][position[s]]
                ready = _input_ready(done, kind, s, i, v, pp, vpp)
                if ready is None:
                    break
                start = max(clock[s], ready)
                clock[s] = start + (work[i] if kind == "F" else backward_ratio * work[i])
                done[(kind, s, i, v)] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B simulation deadlocked"
    return max(clock)


def _input_ready(done: dict, kind: str, s: int, i: int, v: int, pp: int, vpp: int) -> float | None:
    """When the input of an operation is there (None: not yet): a forward's from the stage before (chunk
    ``v-1`` on the last stage, for stage 0), a backward's from the stage after (chunk ``v+1`` on stage 0,
    for the last stage; the last chunk's own forward)."""
    if kind == "F":
        if s > 0:
            return done.get(("F", s - 1, i, v))
        return 0.0 if v == 0 else done.get(("F", pp - 1, i, v - 1))
    if s < pp - 1:
        return done.get(("B", s + 1, i, v))
    return done.get(("F", s, i, v)) if v == vpp - 1 else done.get(("B", 0, i, v + 1))


def pipeline_lower_bound(forward, pp: int, *, backward_ratio: float = 2.0, vpp: int = 1) -> float:
    """``sum(f + b) + (pp - 1) * min(f + b) / vpp``: no order of these micro-batches runs faster."""
    work = np.asarray(forward, dtype=np.float64) * (1 + backward_ratio)
    return float(work.sum() + (pp - 1) * work.min() / vpp) if work.size else 0.0


def best_pipeline_order(
    forward, pp: int, *, backward_ratio: float = 2.0, vpp: int = 1, group: int | None = None
) -> list[int]:
    """Positions in the execution order with the smallest simulated 1F1B time (plain or interleaved) among
    the candidate orders: as given, largest first, smallest first, and the cheapest at both ends (and its
    mirror)."""
    f = np.asarray(forward, dtype=np.float64)
    ascending = np.argsort(f, kind="stable").tolist()
    bubble = ascending[0::2] + ascending[1::2][::-1]
    candidates = [list(range(f.size)), ascending[::-1], ascending, bubble, bubble[::-1], _ends_first(ascending)]

    def step_time(order):
        return simulate_1f1b(f[order], pp, backward_ratio=backward_ratio, vpp=vpp, group=group)

    return min(candidates, key=step_time)


def _ends_first(ascending: list[int]) -> list[int]:
    """The cheapest first, the second cheapest last, the rest largest first in between (the first sets
    the fill, the last the drain, the middle runs back to back)."""
    if len(ascending) < 3:
        return ascending
    return [ascending[0], *ascending[2:][::-1], ascending[1]]
