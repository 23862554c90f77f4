"""GRPO steps from your own trainer, with the library layers only (nothing from ``mcore_packing.app``).

    python examples/own_trainer.py                                   # one process, on the CPU here
    torchrun --nproc_per_node 2 examples/own_trainer.py --cp 2       # two ranks, context parallel

Your framework owns the rollouts (here `examples/rollouts.jsonl`), the model's shape (here a tiny GPT;
``build_policy(..., hf_path=...)`` loads a Hugging Face checkpoint instead) and the optimizer factory;
mcore_packing plans each step, packs it into THD micro-batches, runs Megatron's schedule and returns
the loss and the metrics. On a GPU the same code runs with ``device="cuda"`` and the NCCL backend.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from mcore_packing.losses import ClippedPGConfig
from mcore_packing.losses.rollouts import read_rollouts_jsonl
from mcore_packing.megatron import build_policy, cpu_device_adapter, initialize_parallel, start_world_of_one
from mcore_packing.megatron.optimizer import build_optimizer, build_scheduler
from mcore_packing.planning import ModelShape, ParallelLayout, StepPlanConfig
from mcore_packing.rl import GRPOConfig, rl_step

ROLLOUTS = Path(__file__).with_name("rollouts.jsonl")


def make_optimizer(model):
    """Yours to choose: here Megatron's Adam and a constant schedule (`megatron.optimizer` wraps both)."""
    optimizer = build_optimizer(model, lr=1e-3, clip_grad=1.0)
    return optimizer, build_scheduler(optimizer, lr=1e-3, min_lr=1e-3, lr_decay_iters=10, lr_decay_style="constant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size (the world size must be a multiple)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    else:
        start_world_of_one("gloo")
    device = torch.device("cpu")
    rollouts = read_rollouts_jsonl(str(ROLLOUTS))
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, max_sequence_length=64)
    layout = ParallelLayout(cp=args.cp, dp=dist.get_world_size() // args.cp)
    with cpu_device_adapter(device=device):  # Megatron's CUDA call sites on the CPU; a no-op on a GPU
        initialize_parallel(layout, seed=1234)
        policy = build_policy(shape, layout, device=device, optimizer=make_optimizer)
        reference = build_policy(shape, layout, device=device, process_groups=policy.process_groups)  # frozen
        plan_config = StepPlanConfig(train_mb_tokens=128, logprob_mb_tokens=256, layout=layout)
        for step in range(1, args.steps + 1):
            result = rl_step(policy, rollouts, plan_config, loss=ClippedPGConfig(reference_policy_kl_penalty=0.01),
                             grpo=GRPOConfig(num_prompts_per_step=4), reference=reference)  # fmt: skip
            if dist.get_rank() == 0:
                shown = ("mean_reward", "reference_kl", "grad_norm")
                metrics = {k: round(v, 4) for k, v in result.metrics.items() if k in shown}
                print(f"step {step}: loss {result.loss:.4f} {metrics}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
