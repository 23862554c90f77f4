"""How much faster is a GRPO step when each group's prompt is laid out once (``grpo.shared_prefix``)?

One GRPO step (`rl.rl_step`: the policy's and the reference's log-prob passes, then the training pass's
forward and backward and the optimizer step) on the README's embedded default model (a real Megatron
GPTModel on this CPU), with and without sharing, alternating in one run; each setting's median step time
and their ratio, beside the planner's predicted ratio (`planning.shared_prefix`'s cost of each layout under
the FLOP cost model of the model's shape). Rollouts: ``--groups`` groups of ``--generations`` responses of
about ``--response-tokens`` tokens; the prompt is ``ratio`` times that, for each ``--ratios`` value.

    python benchmarks/shared_prefix.py                 # ratios 4, 1 and 0.25; about a minute on 2 cores
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

from _report import run_config, write_results


def _rollouts(ratio: float, groups: int, generations: int, response_tokens: int, vocab: int, seed: int):
    import numpy as np

    from mcore_packing.losses.rollouts import Rollout

    rng = np.random.default_rng(seed)
    prompt_tokens = max(2, round(ratio * response_tokens))
    out = []
    for g in range(groups):
        prompt = rng.integers(0, vocab, prompt_tokens).tolist()
        for _ in range(generations):
            n = int(rng.integers(response_tokens // 2, response_tokens * 3 // 2 + 1))
            out.append(Rollout(prompt_tokens=prompt, response_tokens=rng.integers(0, vocab, n).tolist(),
                               reward=float(rng.normal()), group_id=g))  # fmt: skip
    return out


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", type=float, nargs="+", default=[4.0, 1.0, 0.25], help="prompt / response length")
    parser.add_argument("--groups", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="responses per prompt (G)")
    parser.add_argument("--response-tokens", type=int, default=96, help="mean response length")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps of each setting (after a warm-up each)")
    parser.add_argument("--out", default="benchmarks/results/shared_prefix.json")
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    from mcore_packing.app.model_setup import build_model, default_device, device_context, setup_training
    from mcore_packing.app.run_settings import plan_config
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.losses import ClippedPGConfig
    from mcore_packing.losses.rollouts import rollouts_shared_prefix
    from mcore_packing.planning import CostModel, shared_prefix_layout
    from mcore_packing.rl import GRPOConfig, rl_step

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    longest = round(max(args.ratios) * args.response_tokens) + args.response_tokens * 3 // 2 + 1
    budget = args.generations * longest  # a whole group of separate sequences fits one micro-batch
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = compose_config(None, [f"run_dir={run_dir}", "optimizer.lr_warmup_iters=0",
                                    f"sequence_packing.train_mb_tokens={budget}",
                                    f"sequence_packing.logprob_mb_tokens={budget}"])  # fmt: skip
        vocab = cfg.model.vocab_size or 512
        shape = cfg.model.shape(vocab)
        config = run_config(args, model_shape=shape.to_dict(), mb_tokens=budget)
        loss = ClippedPGConfig(reference_policy_kl_penalty=0.05)
        rows = []
        with device_context(default_device()):
            setup = setup_training(cfg, shape)
            layout = cfg.parallel.layout(setup.world_size)
            reference = build_model(cfg, shape, layout)
            step_config = plan_config(cfg, layout, vocab_size=vocab)
            cost = CostModel.from_shape(shape)
            for ratio in args.ratios:
                rollouts = _rollouts(ratio, args.groups, args.generations, args.response_tokens, vocab, seed=0)
                lengths = np.array([len(r.prompt_tokens) + len(r.response_tokens) for r in rollouts])
                plan = shared_prefix_layout(lengths, rollouts_shared_prefix(rollouts), step_config, cost)
                report = plan.report(lengths, cost.sequence_cost(step_config.padded_lengths(lengths)))
                predicted = report["separate_cost"] / report["shared_cost"]
                times = {False: [], True: []}
                for k in range(args.repeats + 1):
                    for shared in (False, True) if k % 2 == 0 else (True, False):
                        grpo = GRPOConfig(num_prompts_per_step=args.groups, keep_groups_together=True,
                                          shared_prefix=shared)  # fmt: skip
                        start = time.perf_counter()
                        rl_step(setup.policy, rollouts, step_config, loss=loss, grpo=grpo, reference=reference)
                        if k:  # the first of each is a warm-up
                            times[shared].append(time.perf_counter() - start)
                separate, shared = statistics.median(times[False]), statistics.median(times[True])
                saved = 1 - report["computed_tokens"] / report["separate_tokens"]
                row = {"prompt_over_response": ratio, "separate_s": separate, "shared_s": shared,
                       "measured_speedup": separate / shared, "predicted_speedup": predicted, "tokens_saved": saved,
                       "times": times}  # fmt: skip
                rows.append(row)
                print(f"prompt/response {ratio:g}: one GRPO step {separate:.2f} s separate, {shared:.2f} s shared: "
                      f"{separate / shared:.2f}x measured, {predicted:.2f}x predicted by the planner "
                      f"({row['tokens_saved']:.0%} fewer tokens)", flush=True)  # fmt: skip
    for row in rows:
        row["times"] = {str(k): v for k, v in row["times"].items()}
    write_results(args.out, config, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
