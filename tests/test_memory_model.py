"""The memory model (#41, `planning.memory`) against the real Megatron model on the CPU.

Two gloo ranks run a tiny GPTModel (fp32, the local spec with the built-in attention: its CPU kernel is
SDPA's math path, `sdpa-math`) at DP2 (each rank alone), TP2 + SP, CP2 and PP2, and with Megatron's
selective and full recomputation. Measured
(`tests.memory_workers`): the bytes autograd saves in each micro-batch's forward (a saved-tensor hook that
counts each storage once while the graph holds it, parameters excluded); under PP the peak of those live
bytes over the whole step through Megatron's 1F1B schedule; the parameters', the DDP gradient buffers' and
the optimizer state's bytes after one step. Predicted: `activation_bytes` per micro-batch from its
lengths, `stage_peak` over the planner's order, `static_bytes`. MoE (alone and at EP2): the formula with
the tokens the router sent to this rank's experts (counted by a hook on the experts) is bounded; the
planner's guess (balanced routing) is printed beside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from .distributed_harness import run_distributed

MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_shared_expert_size": 48,
       "moe_dense_layers": [0]}
LAYOUTS = [{}, {"tp": 2, "sequence_parallel": True}, {"cp": 2}, {"pp": 2},
           # Megatron's recomputation (recompute_granularity): the core attention, or every layer
           {"recompute": "selective"}, {"recompute": "full"}, {"tp": 2, "sequence_parallel": True, "recompute": "full"},
           {"cp": 2, "recompute": "selective"}, {"pp": 2, "recompute": "full"},
           # Mixture-of-Experts (4 experts, top-2, a shared expert, one dense layer), alone and at EP2
           {"shape": MOE}, {"ep": 2, "shape": MOE},
           {"pp": 2, "vpp": 2, "shape": {"num_layers": 4}},  # the interleaved schedule's stage peaks
           {"distributed_optimizer": True}]  # fmt: skip (the optimizer state sharded over DP2)


def _batches() -> list:
    """Zipf-like lengths, packed and dynamically batched."""
    rng = np.random.default_rng(41)
    batches = []
    for k in range(4):
        lengths = np.minimum(rng.zipf(1.6, 10) * 9 + rng.integers(2, 9, 10), 200).tolist()
        batches.append(("packing" if k % 2 == 0 else "dynamic", [int(n) for n in lengths]))
    return batches


@pytest.fixture(scope="module")
def rows():
    ranks = run_distributed("tests.memory_workers:memory_worker", 2, layouts=LAYOUTS, batches=_batches())
    return [row for per_rank in ranks for row in per_rank]


@pytest.mark.multirank
def test_predicted_memory_is_within_the_measured_bounds(rows):
    """Activations within 10% of the measurement (each micro-batch; each stage's peak), the static terms
    within 5%, over at least 20 micro-batches."""
    table = []
    worst = {"activations": 0.0, "static": 0.0, "balanced": 0.0}
    count = 0
    for layout, mode, what, measured, predicted in rows:
        error = abs(predicted - measured) / measured
        kind = "static" if mode == "-" else "balanced" if "balanced routing" in what else "activations"
        worst[kind] = max(worst[kind], error)
        count += kind == "activations"
        table.append(f"| {layout or 'DP2'} | {mode} | {what} | {measured:,} | {predicted:,.0f} | {error:.1%} |")
        if kind != "balanced":  # the planner's MoE guess is reported, not bounded: routing varies
            assert error <= (0.05 if kind == "static" else 0.10), table[-1]
    print("| layout | batching | term | measured B | predicted B | error |\n|---|---|---|---|---|---|")
    print("\n".join(table))
    print(f"{count} activation measurements: worst {worst['activations']:.1%}; static terms: worst "
          f"{worst['static']:.1%}; MoE with balanced routing assumed (the planner's guess): worst "
          f"{worst['balanced']:.1%}")  # fmt: skip
    assert count >= 20
