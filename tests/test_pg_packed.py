"""The clipped policy-gradient loss (PPO/GRPO) on packed micro-batches equals the unpacked reference.

Rollouts: a prompt (masked out) and a response, a GRPO-style scalar advantage per sample, and per-token
old, reference and generation log-probs near the model's own (so some ratios fall outside the clip range).
Reference: Megatron's stock model, one sequence per forward, the loss written out in plain torch
(`step_workers.pg_reference_loss`, sharing no code with `mcore_packing.losses`), normalized over the whole
batch. Under test: `forward_backward(loss=PerSample(ClippedPGLoss(...)))` through Megatron's schedule, packed
(THD) and dynamically batched (BSHD rows of similar length), with NeMo-RL's ``token_level_loss`` switch.
The multi-rank layouts (CP, TP + SP, PP, TP x PP, dynamic CP, DP) and every other objective are in
`test_pg_objectives.py`.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from .distributed_harness import run_distributed
from .step_workers import VOCAB
from .test_step_equivalence import grad_errors

pytestmark = pytest.mark.multirank

UNIFORM = math.log(1.0 / VOCAB)  # a fresh model's log-probs are near this


def make_rollouts(num_groups: int = 4, per_group: int = 3, seed: int = 5) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 10))).tolist()
        rewards = rng.normal(0, 1, per_group)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO
        for advantage in advantages:
            response = rng.integers(0, VOCAB, int(rng.integers(2, 22))).tolist()
            n = len(prompt) + len(response)
            samples.append({
                "tokens": prompt + response,
                "loss_mask": [0.0] * len(prompt) + [1.0] * len(response),
                "advantage": float(advantage),
                "old_logp": (UNIFORM + rng.normal(0, 0.15, n - 1)).tolist(),
                "ref_logp_tokens": (UNIFORM + rng.normal(0, 0.2, n - 1)).tolist(),
                "gen_logp": (UNIFORM + rng.normal(0, 0.05, n - 1)).tolist(),
                "group": group,
            })  # fmt: skip
    return samples


ROLLOUTS = make_rollouts()
PG_CONFIGS = [
    {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, "reference_policy_kl_penalty": 0.05, "token_level_loss": True},
    {"ratio_clip_min": 0.2, "ratio_clip_max": 0.2, "ratio_clip_c": 3.0, "reference_policy_kl_penalty": 0.05,
     "kl_estimator": "k1", "token_level_loss": False, "use_importance_sampling_correction": True},
]  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return run_distributed("tests.step_workers:pg_reference_worker", 1, samples=ROLLOUTS, pg_configs=PG_CONFIGS)[0]


def _check(result, ref):
    assert abs(result["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (result["config"], result["loss"], ref["loss"])
    errors = grad_errors(result["grads"], ref["grads"])
    assert max(errors.values()) <= 1e-5, (result["config"], max(errors.values()))
    layout = {"mode": result["config"]["mode"], **{k: result["config"].get(k, 1) for k in ("tp", "pp", "cp")},
              "dynamic_cp": result["config"].get("dynamic_cp", False)}  # fmt: skip
    token_level = result["config"]["pg"]["token_level_loss"]
    loss_error = abs(result["loss"] - ref["loss"]) / abs(ref["loss"])
    print(f"{layout} token_level={token_level}: loss {loss_error:.1e}, grads {max(errors.values()):.1e}")


def test_reference_rollouts_exercise_clipping(reference):
    """The fixture is not trivial: some ratios are clipped and the loss is not zero."""
    logps = reference["pg"][0]["logps"]
    ratios = np.concatenate([
        np.exp(lp.numpy() - np.array(s["old_logp"]))[np.array(s["loss_mask"][1:]) > 0]
        for lp, s in zip(logps, ROLLOUTS, strict=True)
    ])  # fmt: skip
    assert ((ratios < 0.8) | (ratios > 1.28)).mean() > 0.05 and ((ratios > 0.8) & (ratios < 1.2)).mean() > 0.3
    assert abs(reference["pg"][0]["loss"]) > 1e-3


def test_single_rank_packed_and_dynamic_pg_equal_unpacked(reference):
    configs = [{"mode": mode, "pg": pg, "train_mb_tokens": 64} for mode in ("packing", "dynamic") for pg in PG_CONFIGS]
    results = run_distributed(
        "tests.step_workers:step_worker", 1, configs=configs, samples=ROLLOUTS, state_dict=reference["state_dict"]
    )[0]
    for result, ref in zip(results, reference["pg"] * 2, strict=True):
        _check(result, ref)


def test_bad_pg_settings_name_the_key():
    from mcore_packing.losses import ClippedPGConfig, ClippedPGLoss

    with pytest.raises(ValueError, match=r"ratio_clip_c=0\.5 must be > 1"):
        ClippedPGConfig(ratio_clip_c=0.5)
    with pytest.raises(ValueError, match="kl_estimator must be one of k1, k3"):
        ClippedPGConfig(kl_estimator="k2")
    with pytest.raises(ValueError, match="needs reference_logprobs"):
        ClippedPGLoss(ClippedPGConfig(reference_policy_kl_penalty=0.1), advantages=[1.0], old_logprobs=[[0.0]])
    IS = {"use_importance_sampling_correction": True}
    bad = [
        ({"ratio_clip_min": -0.1}, r"ratio_clip_min=-0\.1 must be a finite number >= 0"),
        ({"ratio_clip_min": 0, "ratio_clip_max": 0}, r"\(low = high\)"),
        ({"loss_agg_mode": "seq-sum"}, "loss_agg_mode must be one of token-mean, seq-mean-token-mean"),
        ({"token_level_loss": False, "loss_agg_mode": "token-mean"}, "token_level_loss=False means"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "needs loss_agg_norm_constant"),
        ({"loss_agg_mode": "seq-mean-token-sum-norm", "loss_agg_norm_constant": 0}, "must be a finite number > 0"),
        ({"loss_agg_norm_constant": 512}, "is only read by loss_agg_mode=seq-mean-token-sum-norm"),
        ({"policy_loss_mode": "grpo"}, "policy_loss_mode must be one of vanilla, gspo, cispo"),
        ({"policy_loss_mode": "cispo", "sequence_level_importance_ratios": True}, "choose one"),
        ({"policy_loss_mode": "cispo", "ratio_clip_c": 3.0}, "Set ratio_clip_c=null"),
        ({"truncated_importance_sampling_ratio": 2.0}, "set use_importance_sampling_correction=true"),
        ({"truncated_importance_sampling_type": "icepop"}, "set use_importance_sampling_correction=true"),
        ({**IS, "truncated_importance_sampling_type": "tish"}, "truncated_importance_sampling_type must be one of"),
        ({**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 2.0},
         "set both truncated_importance_sampling_ratio_min and"),
        ({**IS, "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio": 1.0,
          "truncated_importance_sampling_ratio_min": 1.0}, r"must be below truncated_importance_sampling_ratio=1\.0"),
        ({**IS, "truncated_importance_sampling_type": "seq-tis"}, "seq-tis truncates"),
        ({**IS, "truncated_importance_sampling_ratio_min": 0.5}, "is read by the icepop and seq-mask-tis types only"),
        ({**IS, "truncated_importance_sampling_ratio": -1.0}, "must be a finite number > 0"),
        ({"entropy_coeff": -0.01}, r"entropy_coeff=-0\.01 must be a finite number >= 0"),
        ({"entropy_chunk_size": 0}, "entropy_chunk_size must be an integer >= 1, got 0"),
    ]  # fmt: skip
    for settings, message in bad:
        with pytest.raises(ValueError, match=message):
            ClippedPGConfig(**settings)
    for good in ({"loss_agg_mode": "prompt-mean", "token_level_loss": None}, {"token_level_loss": False},
                 {**IS, "truncated_importance_sampling_type": "icepop", "truncated_importance_sampling_ratio": 5.0,
                  "truncated_importance_sampling_ratio_min": 0.5}, {"sequence_level_importance_ratios": True}):
        ClippedPGConfig(**good)  # the controls: accepted
    assert ClippedPGConfig(token_level_loss=False).aggregation == "seq-mean-token-mean"
    assert ClippedPGConfig(sequence_level_importance_ratios=True).objective == "gspo"
