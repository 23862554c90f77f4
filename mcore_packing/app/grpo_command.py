"""``python -m mcore_packing grpo``: GRPO on a verifiable task that ships with the code, on a CPU.

    python -m mcore_packing grpo                       # SFT warm-up, then GRPO; mean reward per step
    python -m mcore_packing grpo --steps 60 --plot reward.png

The task: addition of digits 0..``--max-digit`` (4: 25 sums), the prompt ``a+b=`` and the answer ``a + b``
followed by an end token;
the reward is 1 for an exact answer, else 0. A tiny Megatron GPTModel (the trainer's own setup: Megatron's
optimizer, the packed path) first learns the answer format in a short SFT warm-up (stopped long before it
knows the table: the reward starts near 0), then samples ``--samples`` responses per prompt from itself
(temperature 1, a plain sampling loop, BSHD forwards without a KV cache) and takes GRPO steps
(`rl.rl_step`) on them. No download. The mean reward per step goes to the log and
``<run_dir>/metrics.jsonl``.

Sampling from Megatron here runs on one rank (TP = PP = 1); at scale, generation is the user's inference
engine's job and `rl_step` takes its rollouts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["VOCAB", "build_parser", "encode_prompt", "main", "reward", "run_grpo"]

DIGITS = "0123456789"
PLUS, EQUALS, END = 10, 11, 12
VOCAB = 13


def encode_prompt(a: int, b: int) -> list[int]:
    return [a, PLUS, b, EQUALS]


def answer_tokens(a: int, b: int) -> list[int]:
    return [int(c) for c in str(a + b)] + [END]


def reward(a: int, b: int, response: list[int]) -> float:
    """1 for exactly the digits of a + b followed by the end token."""
    return 1.0 if response == answer_tokens(a, b) else 0.0


def _config(run_dir: str, lr: float, seed: int):
    from .config import ModelConfig, OptimizerConfig, TrainConfig, TrainingConfig

    return TrainConfig(
        model=ModelConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=256,
            vocab_size=VOCAB,
            max_sequence_length=16,
        ),
        optimizer=OptimizerConfig(lr=lr, lr_decay_style="constant", lr_warmup_iters=0, clip_grad=1.0),
        training=TrainingConfig(seed=seed),
        run_dir=run_dir,
    )


def _sample(model, prompts: list[list[int]], rng: np.random.Generator, max_new: int = 3) -> list[list[int]]:
    """Responses sampled at temperature 1 from the model (prompts of equal length; stops at the end token)."""
    import torch

    tokens = torch.tensor(prompts)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out = [[] for _ in prompts]
    with torch.no_grad():
        for _ in range(max_new):
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            logits = model(tokens, positions, None)[:, -1, :VOCAB].float()
            probs = torch.softmax(logits, dim=-1).numpy().astype(np.float64)
            nxt = [int(rng.choice(VOCAB, p=p / p.sum())) for p in probs]
            for i, t in enumerate(nxt):
                if not done[i]:
                    out[i].append(t)
                    done[i] = t == END
            tokens = torch.cat([tokens, torch.tensor(nxt)[:, None]], dim=1)
            if bool(done.all()):
                break
    return out


def _sft_sample(a: int, b: int):
    from ..data.sample import SequenceSample

    answer = answer_tokens(a, b)
    return SequenceSample(np.array(encode_prompt(a, b) + answer), np.array([0.0] * 4 + [1.0] * len(answer)))


def _warm_up(setup, steps: int, pairs: list[tuple[int, int]], rng, plan_config) -> list[float]:
    """A short SFT on correct answers: the answer format, and a start on the table (far from learned)."""
    from ..megatron import TokenMeanNLL, train_step
    from ..planning import plan_step

    losses = []
    for _ in range(steps):
        batch = [pairs[i] for i in rng.integers(0, len(pairs), 64)]
        samples = [_sft_sample(a, b) for a, b in batch]
        plan = plan_step([len(s.tokens) for s in samples], plan_config)
        losses.append(train_step(setup.policy, samples, plan, loss=TokenMeanNLL()).result.loss)
    return losses


def run_grpo(*, run_dir: str, steps: int = 60, warmup_steps: int = 10, prompts: int = 16, samples: int = 8,
             lr: float = 2e-3, max_digit: int = 4, seed: int = 0, log=print) -> list[dict]:  # fmt: skip
    """SFT warm-up, then ``steps`` GRPO steps; returns one record per GRPO step (mean reward first)."""
    from ..losses import ClippedPGConfig
    from ..losses.rollouts import Rollout
    from ..planning import ModelShape, StepPlanConfig
    from ..rl import rl_step
    from .model_setup import default_device, device_context, setup_training

    cfg = _config(run_dir, lr, seed)
    shape: ModelShape = cfg.model.shape(VOCAB)
    rng = np.random.default_rng(seed)
    sums = [(a, b) for a in range(max_digit + 1) for b in range(max_digit + 1)]
    plan_config = StepPlanConfig(mode="packing", train_mb_tokens=256, logprob_mb_tokens=512)
    loss_config = ClippedPGConfig()  # no KL penalty: no reference model needed
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    records = []
    with device_context(default_device()):
        setup = setup_training(cfg, shape)
        warm = _warm_up(setup, warmup_steps, sums, rng, plan_config)
        log(f"SFT warm-up: {warmup_steps} steps, loss {warm[0]:.3f} -> {warm[-1]:.3f}")
        with (Path(run_dir) / "metrics.jsonl").open("w") as f:
            for step in range(1, steps + 1):
                chosen = [sums[i] for i in rng.integers(0, len(sums), prompts)]
                asked = [p for p in chosen for _ in range(samples)]
                responses = _sample(setup.policy.model, [encode_prompt(a, b) for a, b in asked], rng)
                rollouts = [
                    Rollout(
                        prompt_tokens=encode_prompt(a, b),
                        response_tokens=r,
                        reward=reward(a, b, r),
                        group_id=i // samples,
                    )
                    for i, ((a, b), r) in enumerate(zip(asked, responses, strict=True))
                ]
                result = rl_step(setup.policy, rollouts, plan_config, loss=loss_config)
                record = {"step": step, **result.metrics, "loss": result.loss,
                          "logprob_seconds": result.logprob_seconds, "train_seconds": result.train_seconds}  # fmt: skip
                f.write(json.dumps(record) + "\n")
                records.append(record)
                log(f"grpo step {step}/{steps} mean reward {record['mean_reward']:.3f} | clip fraction "
                    f"{record['clip_fraction']:.3f} | log-prob pass {result.logprob_seconds:.2f}s, training pass "
                    f"{result.train_seconds:.2f}s")  # fmt: skip
    return records


def _plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    rewards = [r["mean_reward"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.plot(steps, rewards, marker="o", ms=3)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean reward (exact answer)")
    ax.set_ylim(0, 1)
    ax.set_title("python -m mcore_packing grpo (digit addition, CPU)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_packing grpo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="GRPO steps")
    parser.add_argument("--warmup-steps", type=int, default=10, help="SFT warm-up steps")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--samples", type=int, default=8, help="responses per prompt (a GRPO group)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--max-digit",
        type=int,
        default=4,
        choices=range(1, 10),
        metavar="{1..9}",
        help="a and b range over 0..max-digit (4: 25 sums, one-digit answers)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="outputs/local/grpo")
    parser.add_argument("--plot", help="write the reward curve to this PNG")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "warmup_steps", "prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.samples < 2:
        parser.error("--samples must be >= 2: GRPO compares the responses to one prompt")
    from .trainer import quiet_megatron_on_cpu

    quiet_megatron_on_cpu()
    records = run_grpo(run_dir=args.run_dir, steps=args.steps, warmup_steps=args.warmup_steps, prompts=args.prompts,
                       samples=args.samples, lr=args.lr, max_digit=args.max_digit, seed=args.seed)  # fmt: skip
    first = np.mean([r["mean_reward"] for r in records[: max(1, len(records) // 4)]])
    last = np.mean([r["mean_reward"] for r in records[-max(1, len(records) // 4) :]])
    print(f"mean reward: first quarter {first:.3f} -> last quarter {last:.3f}", flush=True)
    if args.plot:
        _plot(records, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
