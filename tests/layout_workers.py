"""Worker for the layout check that the GPU check also runs over NCCL: the same seeded model (weights that
are a function of the seed only, `megatron.seeded_init`) and the same global batch on one rank, at DP2 and
at CP2; an SFT step, a log-prob pass and a GRPO step give the same loss and log-probs on every layout.
On CPU it runs over gloo (`test_layouts.py`), on 2+ GPUs over NCCL (`test_gpu.py`), where every
collective of the step meets NCCL's device rule."""

from __future__ import annotations

import numpy as np

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
             vocab_size=97, max_sequence_length=512, normalization="RMSNorm", gated_mlp=True,
             linear_bias=False)  # fmt: skip


def _samples():
    from mcore_packing.thd import SequenceSample

    rng = np.random.default_rng(4)
    out = []
    for _ in range(10):
        n = int(rng.integers(4, 60))
        prompt = int(rng.integers(1, n))
        out.append(SequenceSample(rng.integers(0, 97, n).tolist(), [0.0] * prompt + [1.0] * (n - prompt)))
    return out


def _rollouts():
    from mcore_packing.losses.rollouts import Rollout

    rng = np.random.default_rng(6)
    return [Rollout(prompt_tokens=rng.integers(0, 97, 6 + g).tolist(),
                    response_tokens=rng.integers(0, 97, 5 + 3 * i).tolist(), reward=float((g + i) % 2), group_id=g)
            for g in range(4) for i in range(2)]  # fmt: skip


def layout_worker(rank: int, world_size: int, *, layout: dict, device: str = "cpu", attention: str = "local") -> dict:
    """One layout: the SFT step's loss, the log-probs (rank 0's copy) and the GRPO step's loss."""
    import torch

    from mcore_packing.losses import ClippedPGConfig
    from mcore_packing.megatron import (
        TokenMeanNLL,
        build_policy,
        compute_logprobs,
        cpu_device_adapter,
        initialize_parallel,
        train_step,
    )
    from mcore_packing.megatron.optimizer import build_optimizer, build_scheduler
    from mcore_packing.planning import ModelShape, ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.rl import GRPOConfig, rl_step

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    run_device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    shape, parallel = ModelShape(**SHAPE), ParallelLayout(**layout)
    samples = _samples()
    config = StepPlanConfig(mode="packing", train_mb_tokens=128, logprob_mb_tokens=160, layout=parallel)

    def optimizer(model):
        built = build_optimizer(model, lr=1e-3)
        return built, build_scheduler(built, lr=1e-3, min_lr=0.0, lr_decay_iters=10)

    with cpu_device_adapter(device=run_device):
        initialize_parallel(parallel, seed=1)
        policy = build_policy(shape, parallel, device=run_device, seed=9, optimizer=optimizer,
                              attention_backend=attention)  # fmt: skip
        reference = build_policy(shape, parallel, device=run_device, seed=9, attention_backend=attention,
                                 process_groups=policy.process_groups)  # fmt: skip
        lengths = [len(s.tokens) for s in samples]
        logprobs = compute_logprobs(policy.model, samples, plan_step(lengths, config, forward_only=True),
                                    policy.process_groups, device=run_device)  # fmt: skip
        sft = train_step(policy, samples, plan_step(lengths, config), loss=TokenMeanNLL())
        grpo = rl_step(policy, _rollouts(), config, loss=ClippedPGConfig(reference_policy_kl_penalty=0.1),
                       grpo=GRPOConfig(keep_groups_together=True), reference=reference)  # fmt: skip
    return {"sft_loss": sft.result.loss, "grpo_loss": grpo.loss, "logprobs": logprobs.cpu(),
            "logprobs_device": logprobs.device.type}  # fmt: skip


LAYOUTS = {"single": {}, "dp2": {"dp": 2}, "cp2": {"cp": 2}}


def compare_layouts(run, *, device: str = "cpu", attention: str = "local") -> dict:
    """Each layout's results (``run``: `distributed_harness.run_distributed`; gloo on the CPU, NCCL on GPUs)
    and the largest relative differences of the DP2 and CP2 runs against the single rank."""
    backend = "nccl" if device == "cuda" else "gloo"
    results = {name: run("tests.layout_workers:layout_worker", max(1, sum(layout.values())), backend=backend,
                         layout=layout, device=device, attention=attention)[0]
               for name, layout in LAYOUTS.items()}  # fmt: skip
    single = results["single"]
    errors = {}
    for name in ("dp2", "cp2"):
        r = results[name]
        scale = float(single["logprobs"].abs().max())
        errors[name] = {
            "sft": abs(r["sft_loss"] - single["sft_loss"]) / abs(single["sft_loss"]),
            # GRPO's loss is near 0 (advantages sum to 0 in a group, ratios near 1): against a unit scale
            "grpo": abs(r["grpo_loss"] - single["grpo_loss"]) / max(abs(single["grpo_loss"]), 1.0),
            "logprobs": float((r["logprobs"] - single["logprobs"]).abs().max()) / scale,
        }
    return {"results": results, "errors": errors}
