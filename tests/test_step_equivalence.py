"""Gradient and loss equivalence of a full training step, on real Megatron schedules and real gloo ranks.

Reference: `step_workers.reference_worker` (stock Megatron model, one sequence per forward, plain torch
cross entropy, global normalization). Under test: the planner, builder, attention, loss and driver on
(TP, PP, CP, DP) layouts in both modes. Negative controls break one piece each and must be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .distributed_harness import run_distributed
from .step_workers import VOCAB

pytestmark = pytest.mark.multirank

GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-6


def make_samples(num: int = 12, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        n = int(rng.choice([1, 2, 5, 13, 24, 31, 40])) if i < 7 else int(rng.integers(1, 41))
        mask = np.ones(n)
        if i % 3 == 1 and n > 3:  # a prompt that is not learned
            mask[: n // 2] = 0
        samples.append({"tokens": rng.integers(0, VOCAB, n).tolist(), "loss_mask": mask.tolist()})
    return samples


SAMPLES = make_samples()


@pytest.fixture(scope="module")
def reference():
    return run_distributed("tests.step_workers:reference_worker", 1, samples=SAMPLES)[0]


def grad_errors(got: dict, ref: dict) -> dict:
    assert set(got) == set(ref), set(got) ^ set(ref)
    return {name: float((got[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for name, g in ref.items()}


def errors(result: dict, reference: dict) -> tuple[float, float]:
    """Relative error of the loss and the worst per-tensor relative gradient error against the reference."""
    ref = reference[result["config"].get("normalization", "token_mean")]
    grads = grad_errors(result["grads"], ref["grads"])
    return abs(result["loss"] - ref["loss"]) / abs(ref["loss"]), max(grads.values())


def check(result: dict, reference: dict) -> None:
    assert result["all_losses_equal"]
    cfg = result["config"]
    if cfg.get("fixed_shape"):  # one cu_seqlens length: the most sequences a full row holds, plus two (the
        cp = cfg.get("cp", 1)  # boundary and a spare zero-length entry: `te_contract`)
        assert result["cu_lengths"] == [cfg.get("train_mb_tokens", 96) * cp // (2 * cp if cp > 1 else 1) + 2]
    loss_err, grad_err = errors(result, reference)
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_RTOL, (result["config"], loss_err, grad_err)


def run_configs(world_size: int, configs: list[dict], reference: dict, worker: str = "step_workers:step_worker"):
    """Every config on ``world_size`` gloo ranks with the reference's weights; rank 0's results."""
    return run_distributed(
        f"tests.{worker}",
        world_size,
        configs=configs,
        samples=SAMPLES,
        state_dict=reference["state_dict"],
        timeout=900,
    )[0]


def check_logprobs(result: dict, reference: dict) -> None:
    got = result["logprobs"]
    assert got.shape == (len(SAMPLES), max(len(s["tokens"]) for s in SAMPLES) - 1)
    for i, ref in enumerate(reference["logprobs"]):
        n = ref.numel()
        torch.testing.assert_close(got[i, :n], ref, rtol=1e-5, atol=1e-5)
        assert got[i, n:].abs().sum() == 0


SINGLE = [
    {"mode": "packing", "logprobs": True},
    {"mode": "dynamic", "logprobs": True},
    {"mode": "packing", "normalization": "sequence_mean"},
    {"mode": "dynamic", "normalization": "sequence_mean"},
    {"mode": "packing", "per_token_loss": True},
    {"mode": "packing", "microbatch_order": "largest_first", "train_mb_tokens": 48},
    {"mode": "packing", "fixed_shape": True, "logprobs": True},  # full rows, cu_seqlens of fixed length
]


def test_single_rank_matches_reference(reference):
    for result in run_configs(1, SINGLE, reference):
        check(result, reference)
        if result["config"].get("logprobs"):
            check_logprobs(result, reference)


TWO_RANKS = [
    {"mode": "packing"},  # DP=2
    {"mode": "dynamic", "logprobs": True},  # DP=2
    {"mode": "packing", "tp": 2},
    {"mode": "packing", "tp": 2, "sp": True},
    {"mode": "packing", "pp": 2, "logprobs": True},  # fixed-length rows
    {"mode": "packing", "pp": 2, "variable_seq_lengths": True},
    {"mode": "dynamic", "pp": 2, "variable_seq_lengths": True},
    {"mode": "packing", "cp": 2, "logprobs": True},
    {"mode": "packing", "cp": 2, "per_token_loss": True, "normalization": "sequence_mean"},
    {"mode": "dynamic", "cp": 2, "logprobs": True},
    {"mode": "packing", "cp": 2, "fixed_shape": True},  # zero-length sequences under the CP split
    # Balancing only moves samples: attention-aware balance with the bubble order, and round-robin.
    {"mode": "packing", "attention_cost": True, "microbatch_order": "bubble", "train_mb_tokens": 48},
    {"mode": "packing", "balance": "round_robin", "train_mb_tokens": 48},
]


def test_two_ranks_match_reference(reference):
    sites = set()
    for result in run_configs(2, TWO_RANKS, reference):
        check(result, reference)
        if result["config"].get("logprobs"):
            check_logprobs(result, reference)
        sites |= set(result["call_sites"])
    pin_call_sites(sites)


# Every CUDA call site the CPU adapter redirected over the 2-rank layouts (DP, TP, SP, PP fixed and
# variable, CP, dynamic), per megatron-core release. A new release that adds or moves one fails here.
PINNED_CALL_SITES = {
    "0.16.1": {
        ("megatron.core.distributed.param_and_grad_buffer", "__init__", "cuda.current_device"),
        ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank", "tensor(pin_memory)"),
        ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_emb", "cuda.current_device"),
        ("megatron.core.pipeline_parallel.p2p_communication", "_communicate", "cuda.synchronize"),
        ("megatron.core.pipeline_parallel.p2p_communication", "_communicate_shapes", "cuda.current_device"),
        ("megatron.core.pipeline_parallel.p2p_communication", "_communicate_shapes", "cuda.synchronize"),
        ("megatron.core.pipeline_parallel.p2p_communication", "create_tensor_recv_next", "cuda.current_device"),
        ("megatron.core.pipeline_parallel.p2p_communication", "create_tensor_recv_prev", "cuda.current_device"),
        ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining", "zeros"),
        ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_without_interleaving", "zeros"),
        ("megatron.core.tensor_parallel.layers", "backward", "cuda.current_device"),
        ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", "cuda.current_device"),
        ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim", "cuda.current_device"),
        ("megatron.core.utils", "get_tensor", "cuda.current_device"),
    },
}
PINNED_CALL_SITES["0.19.2"] = PINNED_CALL_SITES["0.16.1"] | {  # the test lane of scripts/setup_env_mcore019.sh
    ("megatron.core.distributed.param_and_grad_buffer", "start_grad_sync", "cuda.current_stream"),
}


def pin_call_sites(sites: set) -> None:
    from mcore_packing.compat import megatron_core_version

    version = megatron_core_version()
    if version not in PINNED_CALL_SITES:
        pytest.fail(f"no pinned CUDA call sites for megatron-core {version}; recorded: {sorted(sites)}")
    assert sites == PINNED_CALL_SITES[version], sorted(sites)


NEGATIVE = [
    {"mode": "packing", "negative": "no_global_normalization"},  # DP=2
    {"mode": "packing", "cp": 2, "negative": "no_cp_factor"},
    {"mode": "packing", "cp": 2, "negative": "contiguous_cp_split"},
]


def test_negative_controls_are_caught(reference):
    """Each broken piece moves the gradients by the amount it should, far above the tolerance."""
    found = {r["config"]["negative"]: errors(r, reference) for r in run_configs(2, NEGATIVE, reference)}
    # Each DP rank divides by its own token count instead of the global one: loss and gradients off by O(1).
    assert min(found["no_global_normalization"]) > 0.5, found
    # An extra 1/CP in what the loss function returns: loss and gradients exactly half the true ones (CP=2).
    assert all(abs(err - 0.5) < 1e-4 for err in found["no_cp_factor"]), found
    # Contiguous chunks under zigzag attention: queries see the wrong keys. The loss (a mean over tokens)
    # moves little but far above the tolerance; the gradients are off by O(1).
    assert found["contiguous_cp_split"][0] > 100 * LOSS_RTOL and found["contiguous_cp_split"][1] > 0.5, found


EIGHT_RANKS = [
    {"mode": "packing", "tp": 2, "pp": 2, "cp": 2},
    {"mode": "packing", "pp": 2, "cp": 2, "logprobs": True},  # DP=2
]


@pytest.mark.slow
def test_eight_ranks_match_reference(reference):
    for result in run_configs(8, EIGHT_RANKS, reference):
        check(result, reference)
        if result["config"].get("logprobs"):
            check_logprobs(result, reference)
