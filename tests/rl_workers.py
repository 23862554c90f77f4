"""Worker for the RL-step test: the trainer's setup, a reference model, two GRPO steps on rollouts."""

from __future__ import annotations

import numpy as np

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    "model.vocab_size=128",
    "data.num_samples=8",
    "training.global_batch_size=8",
    "optimizer.lr=0.001",
    "optimizer.lr_warmup_iters=0",
    "sequence_packing.train_mb_tokens=96",
    "sequence_packing.logprob_mb_tokens=160",  # the log-prob pass packs differently from the training pass
]


def make_rollouts(seed: int = 11, groups: int = 4, per_group: int = 4, vocab: int = 128):
    from mcore_packing.losses.rollouts import Rollout

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, int(rng.integers(4, 12))).tolist()
        for _ in range(per_group):
            response = rng.integers(0, vocab, int(rng.integers(3, 30))).tolist()
            out.append(Rollout(prompt_tokens=prompt, response_tokens=response, reward=float(rng.integers(0, 2)),
                               group_id=g))  # fmt: skip
    return out


def rl_step_worker(rank: int, world_size: int, *, root: str, kl: float, minibatches: int = 1, groups: int = 4,
                   steps: int = 2, loss_settings: dict | None = None, temperature: float = 1.0):  # fmt: skip
    """``steps`` GRPO steps on the rollouts of the first ``groups`` groups, from the seeded initial policy
    (``loss_settings``: more `ClippedPGConfig` keys; ``temperature``: the rollouts' sampling temperature)."""
    from mcore_packing.app.model_setup import build_model, default_device, device_context, setup_training
    from mcore_packing.app.run_settings import plan_config
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.losses import ClippedPGConfig
    from mcore_packing.rl import GRPOConfig, rl_step

    cfg = compose_config(None, [*SMALL, f"run_dir={root}"])
    shape = cfg.model.shape(128)
    rollouts = [r for r in make_rollouts() if r.group_id < groups]
    loss = ClippedPGConfig(reference_policy_kl_penalty=kl, **(loss_settings or {}))
    # each group in one micro-batch of the log-prob pass
    grouped = GRPOConfig(keep_groups_together=True, num_minibatches=minibatches, num_prompts_per_step=groups,
                         temperature=temperature)  # fmt: skip
    results = []
    with device_context(default_device()):
        setup = setup_training(cfg, shape)
        layout = cfg.parallel.layout(setup.world_size)
        reference = build_model(cfg, shape, layout)  # frozen: the policy's starting weights
        step_config = plan_config(cfg, layout, vocab_size=128)
        for _ in range(steps):
            r = rl_step(setup.policy, rollouts, step_config, loss=loss, grpo=grouped, reference=reference)
            results.append({"loss": r.loss, "metrics": r.metrics, "advantages": r.advantages,
                            "logprob_seconds": r.logprob_seconds, "train_seconds": r.train_seconds,
                            "minibatch_losses": r.minibatch_losses})  # fmt: skip
    return results


def grpo_example_worker(rank: int, world_size: int, *, root: str, steps: int, warmup_steps: int):
    """`python -m mcore_packing grpo`'s run, shortened; returns its per-step records."""
    from mcore_packing.app.grpo_command import run_grpo

    return run_grpo(run_dir=root, steps=steps, warmup_steps=warmup_steps, log=lambda *_: None)


def dpo_unpacked_worker(rank: int, world_size: int, *, root: str, overrides: list[str], steps: int):
    """The trainer's DPO steps (`app.algorithms.dpo`) on one rank, and before each one the same batch's DPO
    loss computed unpacked: one plain forward per sequence of the policy as it is, the reference from the
    starting weights (the same forwards before any update), DPO in plain torch. Also the loss with chosen
    and rejected swapped (a control the comparison must reject)."""
    from mcore_packing.app.algorithms import get_algorithm
    from mcore_packing.app.global_batches import GlobalBatchSampler
    from mcore_packing.app.model_setup import default_device, device_context, setup_training
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    cfg = compose_config(None, [*overrides, f"run_dir={root}"])
    inputs = prepare_run(cfg, world_size)
    sampler = GlobalBatchSampler(inputs.data.num_units, inputs.batch_units, cfg.training.seed)
    samples = inputs.data.samples
    results = []
    with device_context(default_device()):
        setup = setup_training(cfg, inputs.shape)
        model = setup.policy.model
        reference = _response_logprobs(model, samples, range(len(samples)))
        take_step = get_algorithm("dpo").make_step(cfg, inputs, setup)
        for _ in range(steps):
            ids = inputs.data.sample_ids(sampler.next_batch())
            policy = _response_logprobs(model, samples, ids)  # the policy as it is before this step
            expected = _unpacked_dpo(policy, ids, reference, cfg.dpo, swap=False)
            swapped = _unpacked_dpo(policy, ids, reference, cfg.dpo, swap=True)
            _, outcome, extra = take_step(ids)
            results.append({"reported": outcome.result.loss, "expected": expected, "swapped": swapped,
                            "accuracy": extra["accuracy"]})  # fmt: skip
    return results


def _response_logprobs(model, samples, ids) -> dict:
    """``{sample id: (summed log-prob of its learned tokens, their count)}``, one forward per sequence."""
    import torch
    import torch.nn.functional as F

    out = {}
    with torch.no_grad():
        for i in ids:
            tokens = torch.as_tensor(samples[i].tokens)
            n = tokens.numel()
            logits = model(tokens[None], torch.arange(n)[None], None)[0].float()
            logprobs = -F.cross_entropy(logits[:-1], tokens[1:], reduction="none")
            mask = torch.as_tensor(samples[i].loss_mask[1:], dtype=torch.float32)
            out[i] = (float((logprobs * mask).sum()), float(mask.sum()))
    return out


def _unpacked_dpo(logprobs: dict, ids, reference: dict, dpo, *, swap: bool) -> float:
    """Mean over the batch's pairs of the DPO loss (preference term + SFT term on the chosen response)
    from `_response_logprobs` of the policy and of the reference."""
    import math

    def reduced(values: dict, average: bool) -> dict:
        return {i: total / count if average else total for i, (total, count) in values.items()}

    average = dpo.preference_average_log_probs
    policy, ref = reduced(logprobs, average), reduced(reference, average)
    sft = reduced(logprobs, dpo.sft_average_log_probs)
    losses = []
    for chosen, rejected in zip(ids[0::2], ids[1::2], strict=True):
        if swap:
            chosen, rejected = rejected, chosen
        margin = (policy[chosen] - ref[chosen]) - (policy[rejected] - ref[rejected])
        z = dpo.reference_policy_kl_penalty * margin
        preference = math.log1p(math.exp(-z)) if z > -30 else -z  # -log sigmoid(z)
        losses.append(dpo.preference_loss_weight * preference - dpo.sft_loss_weight * sft[chosen])
    return sum(losses) / len(losses)
