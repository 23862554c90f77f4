"""A DPO-style pairwise loss on packed (chosen, rejected) pairs equals the unpacked reference.

Pairs share a prompt (masked out of the loss) and carry a group id, so the planner keeps each pair in
one micro-batch: a packed THD row, or (dynamic batching) a BSHD micro-batch of similar lengths. The loss
runs on the unpacked per-sequence log-probs (`forward_backward(loss=PerGroup(...))`).
Reference: Megatron's stock model, one sequence per forward, DPO in plain torch.
"""

from __future__ import annotations

import numpy as np
import pytest

from .distributed_harness import run_distributed
from .step_workers import VOCAB
from .test_step_equivalence import grad_errors

pytestmark = pytest.mark.multirank


def make_pairs(num_pairs: int = 6, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(num_pairs):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 12))).tolist()
        for _ in ("chosen", "rejected"):
            response = rng.integers(0, VOCAB, int(rng.integers(2, 25))).tolist()
            mask = [0.0] * len(prompt) + [1.0] * len(response)
            samples.append(
                {"tokens": prompt + response, "loss_mask": mask, "group": g, "ref_logp": float(rng.normal(-80, 5))}
            )
    return samples


PAIRS = make_pairs()


@pytest.fixture(scope="module")
def reference():
    return run_distributed("tests.step_workers:dpo_reference_worker", 1, samples=PAIRS)[0]


def test_packed_pairs_on_two_ranks_match_unpacked_dpo(reference):
    configs = [
        {"mode": "packing", "dpo": True, "train_mb_tokens": 64},  # DP=2
        {"mode": "packing", "dpo": True, "cp": 2, "train_mb_tokens": 64},
        {"mode": "packing", "dpo": True, "train_mb_tokens": 64, "balance": "round_robin"},
        {"mode": "dynamic", "dpo": True, "train_mb_tokens": 64},  # pairs whole in BSHD micro-batches, DP=2
        {"mode": "dynamic", "dpo": True, "cp": 2, "train_mb_tokens": 64},
        {"mode": "dynamic", "dpo": True, "pp": 2, "variable_seq_lengths": True, "train_mb_tokens": 64},
        # dynamic CP: each pair in one row, the pair's CP size the one its two sequences need together
        {"mode": "packing", "dpo": True, "cp": 2, "dynamic_cp": True, "train_mb_tokens": 40},
        {"mode": "dynamic", "dpo": True, "cp": 2, "dynamic_cp": True, "train_mb_tokens": 40},  # BSHD rows
        {"mode": "packing", "dpo": True, "train_mb_tokens": 64, "wrong_pairs": True},  # negative control
    ]
    results = run_distributed(
        "tests.step_workers:step_worker",
        2,
        configs=configs,
        samples=PAIRS,
        state_dict=reference["state_dict"],
        timeout=600,
    )[0]
    *good, wrong = results
    assert abs(wrong["loss"] - reference["dpo"]["loss"]) > 1e-3 * abs(reference["dpo"]["loss"])
    for result in good:
        ref = reference["dpo"]
        assert abs(result["loss"] - ref["loss"]) <= 1e-6 * abs(ref["loss"]), (result["loss"], ref["loss"])
        errors = grad_errors(result["grads"], ref["grads"])
        assert max(errors.values()) <= 1e-5, (result["config"], max(errors.values()))
        layout = {k: result["config"].get(k, 1) for k in ("cp", "pp")}
        layout["dynamic_cp"] = result["config"].get("dynamic_cp", False)
        if result["config"].get("dynamic_cp"):
            assert {k for k, n in result["cp_sizes"].items() if n} == {1, 2}, result["cp_sizes"]
        loss_error = abs(result["loss"] - ref["loss"]) / abs(ref["loss"])
        print(f"{result['config']['mode']} {layout}: loss {loss_error:.1e}, grads {max(errors.values()):.1e}")
