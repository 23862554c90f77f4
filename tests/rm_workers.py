"""Workers for the reward-model tests (inside spawned gloo ranks): the trainer's setup with ``algorithm=rm``,
one packed step against an unpacked computation, and a short training run scored on held-out pairs."""

from __future__ import annotations

import numpy as np

VOCAB = 64
SMALL = [
    "algorithm=rm",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=128",
    f"model.vocab_size={VOCAB}",
    "optimizer.lr_warmup_iters=0",
    "optimizer.lr_decay_style=constant",
]


def hidden_rule_pairs(num_pairs: int, seed: int) -> list[dict]:
    """Token-id pairs with a hidden rule: the chosen response draws 3 of 4 tokens from ids below 32, the
    rejected one 1 of 4 (prompts and lengths random, either response may be the longer)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_pairs):
        prompt = rng.integers(0, VOCAB, int(rng.integers(3, 9))).tolist()
        row = {"prompt_tokens": prompt}
        for key, good in (("chosen_tokens", 0.75), ("rejected_tokens", 0.25)):
            n = int(rng.integers(4, 13))
            low = rng.random(n) < good
            row[key] = np.where(low, rng.integers(0, 32, n), rng.integers(32, VOCAB, n)).tolist()
        rows.append(row)
    return rows


def pair_samples(rows: list[dict]) -> list:
    """Samples in pair order (chosen, rejected), only the responses learned (as the pairs reader makes them)."""
    from mcore_packing.thd import SequenceSample

    out = []
    for row in rows:
        prompt = row["prompt_tokens"]
        for key in ("chosen_tokens", "rejected_tokens"):
            out.append(SequenceSample(prompt + row[key], [0.0] * len(prompt) + [1.0] * len(row[key])))
    return out


def _setup(root: str, overrides: list[str]):
    from mcore_packing.app.model_setup import setup_training
    from mcore_packing.app.train_command import compose_config

    cfg = compose_config(None, [*SMALL, f"run_dir={root}", *overrides])
    return cfg, setup_training(cfg, cfg.model.shape(VOCAB))


def rm_exact_worker(rank: int, world_size: int, *, root: str, rows: list[dict], overrides: list[str], modes: list[str],
                    margin: float = 0.0, center: float = 0.0, reference: bool = False,
                    control_rows: list[dict] | None = None) -> dict:  # fmt: skip
    """The first step's loss, accuracy and head gradient per planning mode (packed through Megatron's
    schedule), with ``reference`` the same from one plain forward per sequence (1 rank), and with
    ``control_rows`` the packed step on those pairs (``control``)."""
    import torch

    from mcore_packing.app.model_setup import default_device, device_context
    from mcore_packing.data.preference import pair_ids
    from mcore_packing.losses.reward import RewardPairLoss
    from mcore_packing.megatron import PerSequenceValues, forward_backward
    from mcore_packing.planning import StepPlanConfig, plan_step
    from mcore_packing.rl.metrics import sum_over_ranks

    samples = pair_samples(rows)
    out = {}
    with device_context(default_device()):
        cfg, setup = _setup(root, overrides)
        policy = setup.policy
        layout = cfg.parallel.layout(setup.world_size)
        head = _reward_weight(policy.model)
        norm = (policy.model.module if hasattr(policy.model, "module") else policy.model).decoder.final_layernorm.weight
        if reference:
            rewards = []
            for s in samples:  # the reward of each sequence alone: no packing, no schedule, no CP
                tokens = torch.as_tensor(s.tokens)[None]
                scores = policy.model(tokens, torch.arange(tokens.shape[1])[None], None, labels=None)
                rewards.append(scores[0, -1, 0])
            chosen, rejected = torch.stack(rewards[0::2]), torch.stack(rewards[1::2])
            loss = (-torch.nn.functional.logsigmoid(chosen - rejected - margin) + center * (chosen + rejected) ** 2)
            loss = loss.mean()
            loss.backward()
            out["reference"] = {"loss": float(loss), "accuracy": float((chosen > rejected).float().mean().detach()),
                                "head_grad": head.main_grad.detach().clone(),
                                "norm_grad": norm.main_grad.detach().clone()}  # fmt: skip
            policy.model.zero_grad_buffer()
        runs = [(mode, mode, samples) for mode in modes]
        if control_rows is not None:
            runs.append(("control", "packing", pair_samples(control_rows)))
        for name, mode, samples in runs:
            plan_config = StepPlanConfig(mode=mode, train_mb_tokens=64, layout=layout)
            plan = plan_step([len(s.tokens) for s in samples], plan_config, groups=pair_ids(len(samples)))
            pair_loss = RewardPairLoss(margin=margin, center_rewards_coefficient=center)
            result = forward_backward(policy.model, samples, plan, policy.process_groups,
                                      loss=PerSequenceValues(pair_loss), device=policy.device)  # fmt: skip
            pairs, correct = sum_over_ranks([pair_loss.metrics["pairs"], pair_loss.metrics["accuracy"]])
            out[name] = {"loss": result.loss, "accuracy": correct / pairs, "micro_batches": result.num_microbatches,
                         "head_grad": head.main_grad.detach().clone(), "norm_grad": norm.main_grad.detach().clone()}
            policy.model.zero_grad_buffer()
    return out


def _reward_weight(model):
    module = model.module if hasattr(model, "module") else model
    return module.output_layer.reward_weight


def rm_train_worker(rank: int, world_size: int, *, root: str, train_rows: list[dict], eval_rows: list[dict],
                    steps: int, batch_pairs: int, eval_every: int) -> list[dict]:  # fmt: skip
    """``steps`` reward-model steps on ``batch_pairs`` training pairs each (in order, cycling), the held-out
    pairs scored before the first and after every ``eval_every`` steps."""
    from mcore_packing.app.model_setup import default_device, device_context
    from mcore_packing.app.run_settings import plan_config
    from mcore_packing.rl import pair_rewards, rm_step

    train, held_out = pair_samples(train_rows), pair_samples(eval_rows)
    curve = []
    with device_context(default_device()):
        cfg, setup = _setup(root, ["optimizer.lr=0.003", "sequence_packing.train_mb_tokens=256",
                                   "sequence_packing.logprob_mb_tokens=512"])  # fmt: skip
        step_config = plan_config(cfg, cfg.parallel.layout(setup.world_size), vocab_size=VOCAB)
        scored = pair_rewards(setup.policy, held_out, step_config)
        curve.append({"step": 0, "eval_accuracy": scored["accuracy"], "eval_loss": scored["loss"]})
        per_step = 2 * batch_pairs
        for step in range(1, steps + 1):
            start = ((step - 1) * per_step) % len(train)
            result = rm_step(setup.policy, train[start : start + per_step], step_config, rm=cfg.rm)
            if step % eval_every == 0:
                scored = pair_rewards(setup.policy, held_out, step_config)
                curve.append({"step": step, "train_accuracy": result.metrics["accuracy"], "loss": result.loss,
                              "eval_accuracy": scored["accuracy"], "eval_loss": scored["loss"]})  # fmt: skip
    return curve
