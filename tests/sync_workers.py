"""Worker for the sync budget (`test_sync_budget.py`): SFT, DPO, GRPO/PPO and log-prob passes, packed and
dynamic, at CP1 (DP2) and CP2, with `sync_counter.SyncCounter` active inside every forward step and its
loss function (Megatron's ``forward_step_func`` and what it hands back). Uses only the public step API, so
the same worker measures an older checkout too."""

from __future__ import annotations

import numpy as np

SHAPE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
             vocab_size=64, max_sequence_length=256)  # fmt: skip


def _samples(seed: int, n: int):
    from mcore_packing.thd import SequenceSample

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 40))
        prompt = int(rng.integers(1, length))
        out.append(SequenceSample(rng.integers(0, 64, length).tolist(), [0.0] * prompt + [1.0] * (length - prompt)))
    return out


def _rollouts(seed: int):
    from mcore_packing.losses.rollouts import Rollout

    rng = np.random.default_rng(seed)
    out = []
    for group in range(4):
        prompt = rng.integers(0, 64, int(rng.integers(3, 12))).tolist()
        for _ in range(3):
            response = rng.integers(0, 64, int(rng.integers(2, 25))).tolist()
            generation = (-4.0 + 0.1 * rng.normal(size=len(response))).tolist()
            out.append(Rollout(prompt_tokens=prompt, response_tokens=response, reward=float(rng.integers(0, 2)),
                               group_id=group, generation_logprobs=generation))  # fmt: skip
    return out


def _cases(policy, reference, layout):
    """(name, thunk) of every step kind; each thunk runs one step."""
    from mcore_packing.losses import ClippedPGConfig
    from mcore_packing.megatron import SequenceMeanNLL, TokenMeanNLL, compute_logprobs, forward_backward
    from mcore_packing.planning import StepPlanConfig, plan_step
    from mcore_packing.rl import DPOConfig, GRPOConfig, dpo_step, rl_step

    samples = _samples(1, 12)
    lengths = [len(s.tokens) for s in samples]
    pairs = _samples(2, 8)
    pgs, device = policy.process_groups, policy.device
    # #39's per-sample work in the hot path too: the sequence-masked correction, a constant-divisor
    # aggregation, the exact entropy bonus (vocabulary-parallel, chunked), the sampling temperature
    pg = ClippedPGConfig(reference_policy_kl_penalty=0.05, ratio_clip_c=3.0, use_importance_sampling_correction=True,
                         truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=2.0,
                         truncated_importance_sampling_ratio_min=0.5, loss_agg_mode="seq-mean-token-sum-norm",
                         loss_agg_norm_constant=32.0, entropy_coeff=0.01, entropy_chunk_size=16)  # fmt: skip
    cases = []
    for mode in ("packing", "dynamic"):
        config = StepPlanConfig(mode=mode, train_mb_tokens=96, logprob_mb_tokens=128, layout=layout)
        plan = plan_step(lengths, config)
        logprob_plan = plan_step(lengths, config, forward_only=True)
        cases += [
            (f"sft token_mean {mode}", lambda c=config, p=plan: forward_backward(policy.model, samples, p, pgs,
                                                                                 loss=TokenMeanNLL(), device=device)),
            (f"sft sequence_mean {mode}", lambda p=plan: forward_backward(policy.model, samples, p, pgs,
                                                                          loss=SequenceMeanNLL(), device=device)),
            (f"logprobs {mode}", lambda p=logprob_plan: compute_logprobs(policy.model, samples, p, pgs, device=device)),
            (f"grpo {mode}", lambda c=config: rl_step(policy, _rollouts(3), c, loss=pg, reference=reference,
                                                      grpo=GRPOConfig(keep_groups_together=True, temperature=0.8))),
            (f"dpo {mode}", lambda c=config: dpo_step(policy, reference, pairs, c, dpo=DPOConfig())),
        ]  # fmt: skip
    return cases


def sync_budget_worker(rank: int, world_size: int, cps=(1, 2)) -> list[dict]:
    """For each CP size: every case's counts (mcore_packing's and Megatron's, with where they come from),
    its forward steps, and the THD micro-batches among them."""
    import torch

    from mcore_packing.megatron import build_policy, cpu_device_adapter, initialize_parallel
    from mcore_packing.megatron.optimizer import build_optimizer, build_scheduler
    from mcore_packing.planning import ModelShape, ParallelLayout

    from .sync_counter import SyncCounter, inside_forward_steps

    shape = ModelShape(**SHAPE)
    results = []
    with cpu_device_adapter():
        for cp in cps:
            layout = ParallelLayout(cp=cp, dp=world_size // cp)
            initialize_parallel(layout, seed=1)
            def make(model):
                optimizer = build_optimizer(model, lr=1e-4)
                return optimizer, build_scheduler(optimizer, lr=1e-4, min_lr=0.0, lr_decay_iters=100)

            policy = build_policy(shape, layout, device=torch.device("cpu"), seed=3, optimizer=make)
            reference = build_policy(shape, layout, device=torch.device("cpu"), seed=3)
            for name, run in _cases(policy, reference, layout):
                counter = SyncCounter()
                with inside_forward_steps(lambda c=counter: c) as seen:
                    run()
                results.append({
                    "cp": cp, "case": name, "forward_steps": len(seen), "layers": shape.num_layers,
                    "ours": counter.total("mcore_packing"), "megatron": counter.total("megatron"),
                    "other": counter.total("other"), "ours_where": counter.report("mcore_packing"),
                    "megatron_where": counter.report("megatron"), "megatron_sites": counter.sites("megatron"),
                })  # fmt: skip
    return results


def main() -> None:
    """``python -m tests.sync_workers``: every case's counts on 2 gloo ranks, with where each call comes from."""
    from .distributed_harness import run_distributed

    for row in run_distributed("tests.sync_workers:sync_budget_worker", 2, timeout=900)[0]:
        print(f"cp={row['cp']} {row['case']:<26} forward steps {row['forward_steps']:>2}  mcore_packing "
              f"{row['ours']:>3}  megatron {row['megatron']:>3}")  # fmt: skip
        for where in row["ours_where"]:
            print(f"    mcore_packing: {where}")
        for where in row["megatron_where"]:
            print(f"    megatron:      {where}")


if __name__ == "__main__":
    main()
