"""Every policy-gradient objective and aggregation mode is exact under packing, dynamic batching and
every layout (issue #39): the loss aggregation modes (token-mean, seq-mean-token-mean,
seq-mean-token-sum, seq-mean-token-sum-norm, prompt-mean), the training/inference corrections (TIS, ICEPOP,
seq-TIS, seq-mask-TIS), GSPO, CISPO, dual clip and clip-higher, the exact entropy (bonus and metric, chunked
over 5 and 7 tokens), each at sampling temperature 1 and 0.7.

Reference: Megatron's stock model, one sequence per forward, the logits divided by the temperature, the
loss written out in plain torch (`step_workers.pg_reference_loss`: loops over samples and prompts, no code
shared with `mcore_packing.losses`). Under test: `forward_backward(loss=policy_step_loss(ClippedPGLoss))`
under `logits_temperature`, on gloo ranks. Negative controls, one per family: the mask-width divisor
(verl's seq-mean-token-sum-norm without a constant), importance weights left unmasked, token ratios
instead of GSPO's sequence ratio, and scoring at temperature 1 what was sampled at 0.7.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from .distributed_harness import run_distributed
from .test_pg_packed import make_rollouts
from .test_step_equivalence import grad_errors

pytestmark = pytest.mark.multirank

ROLLOUTS = make_rollouts(num_groups=4, per_group=3, seed=9)
CLIP = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28}  # clip-higher
IS = {"use_importance_sampling_correction": True}
CASES = {
    "token-mean, TIS, KL k3, entropy bonus": {
        **CLIP, **IS, "truncated_importance_sampling_ratio": 1.1, "reference_policy_kl_penalty": 0.05,
        "entropy_coeff": 0.01, "entropy_chunk_size": 7},
    "seq-mean-token-sum, ICEPOP": {
        **CLIP, **IS, "loss_agg_mode": "seq-mean-token-sum", "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio_min": 0.8, "truncated_importance_sampling_ratio": 1.25},
    "seq-mean-token-sum-norm, GSPO, seq-TIS, entropy metric": {
        "ratio_clip_min": 0.02, "ratio_clip_max": 0.03, **IS, "loss_agg_mode": "seq-mean-token-sum-norm",
        "loss_agg_norm_constant": 24.0, "sequence_level_importance_ratios": True,
        "truncated_importance_sampling_type": "seq-tis", "truncated_importance_sampling_ratio": 2.0,
        "calculate_entropy": True},
    "seq-mean-token-mean, CISPO, seq-mask-TIS, KL k1, entropy bonus": {
        **CLIP, **IS, "loss_agg_mode": "seq-mean-token-mean", "policy_loss_mode": "cispo",
        "truncated_importance_sampling_type": "seq-mask-tis", "truncated_importance_sampling_ratio_min": 0.9,
        "truncated_importance_sampling_ratio": 1.1, "reference_policy_kl_penalty": 0.05, "kl_estimator": "k1",
        "entropy_coeff": 0.005, "entropy_chunk_size": 5},
    "prompt-mean, dual clip, TIS": {
        **CLIP, **IS, "loss_agg_mode": "prompt-mean", "ratio_clip_c": 3.0, "truncated_importance_sampling_ratio": 1.5},
    "prompt-mean, GSPO (policy_loss_mode)": {
        "ratio_clip_min": 0.02, "ratio_clip_max": 0.03, "loss_agg_mode": "prompt-mean", "policy_loss_mode": "gspo"},
}  # fmt: skip
NAMES = list(CASES)
NO_ENTROPY_METRIC = {**CASES[NAMES[2]], "calculate_entropy": False}  # the metric changes no loss
TEMPERATURES = (1.0, 0.7)
# The reference's configs: every case at each temperature, then the controls' references.
REFERENCE = [(name, t) for name in NAMES for t in TEMPERATURES]
SAMPLE_PROMPTS = [([5, 17, 33], 0.7, 12), ([80, 2, 41, 9, 60], 0.7, 9), ([11, 12], 0.7, 15)]


@pytest.fixture(scope="module")
def reference():
    out = run_distributed("tests.step_workers:pg_reference_worker", 1, samples=ROLLOUTS,
                          pg_configs=[CASES[name] for name, _ in REFERENCE],
                          temperatures=[t for _, t in REFERENCE], sample_prompts=SAMPLE_PROMPTS)[0]  # fmt: skip
    out["by_case"] = dict(zip(REFERENCE, out["pg"], strict=True))
    return out


def _run(reference, world_size: int, configs: list[dict]) -> list[dict]:
    return run_distributed("tests.step_workers:step_worker", world_size, configs=configs, samples=ROLLOUTS,
                           state_dict=reference["state_dict"], logprob_samples=reference["sampled"],
                           timeout=max(900, 30 * len(configs)))[0]  # fmt: skip


def _config(name: str, temperature: float, **layout) -> dict:
    cfg = {"mode": "packing", "pg": CASES[name], "case": name, "temperature": temperature, "train_mb_tokens": 64,
           **layout}  # fmt: skip
    if CASES[name].get("loss_agg_mode") == "prompt-mean":  # a prompt's responses share a micro-batch (<= 68 tokens)
        if cfg.get("dynamic_cp"):  # CP4 packed: groups on 1, 2 and 4 ranks; dynamic: 3 rows of 28 need 2 ranks
            cfg["train_mb_tokens"] = 56 if cfg["mode"] == "packing" else 48
        else:
            cfg["train_mb_tokens"] = max(2 * cfg["train_mb_tokens"], 80)
    return cfg


def _errors(result: dict, ref: dict) -> tuple[float, float]:
    grads = grad_errors(result["grads"], ref["grads"])
    return abs(result["loss"] - ref["loss"]) / abs(ref["loss"]), max(grads.values())


def _check(result: dict, reference: dict, table: list) -> None:
    cfg = result["config"]
    ref = reference["by_case"][(cfg["case"], cfg["temperature"])]
    loss_error, grad_error = _errors(result, ref)
    layout = ", ".join(f"{k}={cfg[k]}" for k in ("tp", "sp", "pp", "vpp", "cp", "dynamic_cp") if k in cfg)
    layout = layout or cfg.get("label", "1 rank")
    table.append(f"| {cfg['case']} | T={cfg['temperature']} | {cfg['mode']} | {layout} | {loss_error:.1e} | "
                 f"{grad_error:.1e} |")  # fmt: skip
    assert loss_error <= 1e-5 and grad_error <= 1e-5, table[-1]
    if cfg["pg"].get("entropy_coeff") or cfg["pg"].get("calculate_entropy"):  # the exact entropy, chunked
        assert abs(result["entropy"] - ref["entropy"]) <= 1e-5 * ref["entropy"], (result["entropy"], ref["entropy"])


def _sampled_ratio_error(result: dict, reference: dict) -> float:
    """The largest |exp(trainer log-prob - sampling log-prob) - 1| over the sampled responses' tokens."""
    worst = 0.0
    for row, sample in zip(result["logprobs"], reference["sampled"], strict=True):
        start = len(sample["tokens"]) - len(sample["sampled_logp"]) - 1  # position j scores token j + 1
        got = row[start : start + len(sample["sampled_logp"])].double().numpy()
        worst = max(worst, float(np.abs(np.exp(got - np.array(sample["sampled_logp"])) - 1).max()))
    return worst


def test_the_fixture_exercises_every_correction(reference):
    """Not a trivial batch: importance weights fall on both sides of each bound the cases use, GSPO's
    sequence ratios leave its clip range, and every reference loss is nonzero."""
    rho = np.concatenate([np.exp(np.array(s["old_logp"]) - np.array(s["gen_logp"]))[np.array(s["loss_mask"][1:]) > 0]
                          for s in ROLLOUTS])  # fmt: skip
    for bound in (0.8, 0.9, 1.1, 1.25, 1.5):
        assert 0.02 < (rho > bound).mean() < 0.98, bound
    logps = reference["by_case"][(NAMES[2], 1.0)]["logps"]
    seq = [float(np.exp(((lp.numpy() - np.array(s["old_logp"])) * np.array(s["loss_mask"][1:])).sum()
                        / np.sum(s["loss_mask"][1:]))) for lp, s in zip(logps, ROLLOUTS, strict=True)]  # fmt: skip
    assert any(r < 0.98 or r > 1.03 for r in seq) and any(0.98 < r < 1.03 for r in seq), seq
    assert all(abs(ref["loss"]) > 1e-4 for ref in reference["pg"])


CONTROLS = [
    ("aggregation: the mask-width divisor", {**_config(NAMES[2], 1.0), "negative_pg": "mask_width",
                                             "pg": NO_ENTROPY_METRIC}),
    ("aggregation: the mask-width divisor, half budget",
     {**_config(NAMES[2], 1.0, train_mb_tokens=32), "negative_pg": "mask_width", "pg": NO_ENTROPY_METRIC}),
    ("off-policy: ICEPOP's weights unmasked", {**_config(NAMES[1], 1.0), "pg": {
        **CASES[NAMES[1]], "truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": None,
        "truncated_importance_sampling_ratio_min": None}}),
    ("GSPO: token ratios", {**_config(NAMES[2], 1.0), "pg": {**CASES[NAMES[2]],
                                                               "sequence_level_importance_ratios": False}}),
    ("temperature: scored at 1", {**_config(NAMES[0], 1.0), "case_temperature": 0.7}),
    ("entropy: the bonus left out", {**_config(NAMES[0], 1.0), "pg": {**CASES[NAMES[0]], "entropy_coeff": 0.0}}),
]  # fmt: skip
ONE_RANK = [_config(name, t, mode=mode) for name in NAMES for t in TEMPERATURES for mode in ("packing", "dynamic")]
HALF_BUDGET = [_config(name, t, train_mb_tokens=32) for name in NAMES for t in TEMPERATURES]
LOGPROBS = [{"mode": mode, "logprobs": True, "temperature": t, "train_mb_tokens": 64, "pg": None}
            for mode, t in (("packing", 0.7), ("dynamic", 0.7), ("packing", 1.0))]  # fmt: skip
# #40: every case with each group's prompt laid out once, and two controls: the prompt's keys at the wrong
# RoPE distance from the responses, and a response attending to the response before it instead of the prompt.
SHARED = [{**_config(name, 0.7), "shared_prefix": True} for name in NAMES]
# dynamic batching: at this budget some groups share a THD row, the rest fall back to BSHD rows of their own
SHARED_DYNAMIC = [{**_config(NAMES[1], 1.0, mode="dynamic", train_mb_tokens=40), "shared_prefix": True}]
SHARED_CONTROLS = [{**SHARED[0], "negative": kind} for kind in ("shared_prefix_unrotated", "shared_prefix_crossed")]
# #41: the output layer and the loss a few tokens at a time (model.logprob_chunk_size), each beside the same
# step computed whole: packed (temperature, entropy bonus), dynamic (BSHD rows), a shared prompt (extra targets)
CHUNKED = [(_config(NAMES[0], 0.7), 7), (_config(NAMES[3], 0.7, mode="dynamic"), 16), (SHARED[2], 5),
           (LOGPROBS[0], 6)]  # fmt: skip


@pytest.fixture(scope="module")
def one_rank(reference):
    """Every 1-rank step of the module in one spawn: the cases, the smaller budget, the controls, the
    sampled responses' log-probs, the shared prompts (#40) and their controls."""
    chunked = [{**cfg, "logprob_chunk_size": size} for cfg, size in CHUNKED]
    configs = (ONE_RANK + HALF_BUDGET + [c for _, c in CONTROLS] + LOGPROBS + SHARED + SHARED_DYNAMIC + SHARED_CONTROLS
               + chunked)  # fmt: skip
    results = _run(reference, 1, configs)
    parts, start = {}, 0
    for name, configs in (("main", ONE_RANK), ("half", HALF_BUDGET), ("controls", CONTROLS), ("sampled", LOGPROBS),
                          ("shared", SHARED), ("shared_dynamic", SHARED_DYNAMIC),
                          ("shared_controls", SHARED_CONTROLS), ("chunked", chunked)):  # fmt: skip
        parts[name], start = results[start : start + len(configs)], start + len(configs)
    return parts


def test_every_objective_at_one_rank_packed_dynamic_and_half_budget(reference, one_rank):
    """Every case at T=1 and T=0.7, packed and dynamically batched, equal to the reference (<= 1e-5); the
    same step at half the token budget equals the full budget's (<= 1e-6); the negative controls fail;
    responses sampled at T=0.7 score a training/inference ratio of 1 within 1e-6 (and not at T=1)."""
    main, half = one_rank["main"], one_rank["half"]
    table = []
    for result in main + half:
        _check(result, reference, table)
    full = main[::2]  # the packed ones, in HALF_BUDGET's order
    worst = [0.0, 0.0]
    for a, b in zip(full, half, strict=True):
        loss_change = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        grad_change = max(grad_errors(b["grads"], a["grads"]).values())
        assert loss_change <= 1e-6 and grad_change <= 1e-6, (a["config"]["case"], loss_change, grad_change)
        worst = [max(worst[0], loss_change), max(worst[1], grad_change)]
    print("\n".join(table))
    print(f"a smaller token budget changes the loss by <= {worst[0]:.1e}, the gradients by <= {worst[1]:.1e}")
    control_results, sampled = one_rank["controls"], one_rank["sampled"]
    for (label, cfg), result in zip(CONTROLS, control_results, strict=True):
        ref = reference["by_case"][(cfg["case"], cfg.get("case_temperature", cfg["temperature"]))]
        loss_error, _ = _errors(result, ref)
        print(f"control {label}: loss {loss_error:.1e}")
        assert loss_error > 1e-3, label
    widths = [r["loss"] for r in control_results[:2]]  # the mask-width divisor moves with the budget
    assert abs(widths[0] - widths[1]) > 1e-3 * abs(widths[0]), widths
    on_temperature = [_sampled_ratio_error(r, reference) for r in sampled[:2]]
    off_temperature = _sampled_ratio_error(sampled[2], reference)
    print(f"sampled at T=0.7: |ratio - 1| <= {max(on_temperature):.1e} (packed, dynamic); scored at T=1: "
          f"{off_temperature:.1e}")  # fmt: skip
    assert max(on_temperature) <= 1e-6 and off_temperature > 1e-2


def _computed_tokens(samples) -> int:
    """Tokens of the shared-prefix layout, counted from the rollouts: per group its prompt and its responses."""
    groups: dict = {}
    for s in samples:
        groups.setdefault(s["group"], []).append(s)
    total = 0
    for members in groups.values():
        prompt = members[0]["loss_mask"].index(1.0)
        total += prompt + sum(len(m["tokens"]) - prompt for m in members)
    return total


def test_every_objective_with_a_shared_prompt_at_one_rank(reference, one_rank):
    """#40: each group's prompt laid out once gives every case's loss, gradients and entropy (<= 1e-5) from
    P + sum(R) tokens per group, packed, and dynamically batched with THD rows for the groups that
    fit beside BSHD rows for the rest; the controls (the prompt's keys unrotated for the responses' RoPE
    positions, a response seeing another) move the gradients."""
    table = []
    separate = sum(len(s["tokens"]) for s in ROLLOUTS)
    for result in one_rank["shared"]:
        _check(result, reference, table)
        assert result["real_tokens"] == _computed_tokens(ROLLOUTS) < separate
    for result in one_rank["shared_dynamic"]:  # THD rows of shared groups beside BSHD rows of the others
        _check(result, reference, table)
        assert _computed_tokens(ROLLOUTS) < result["real_tokens"] < separate
    print("\n".join(table))
    ref = reference["by_case"][(NAMES[0], 0.7)]
    for result in one_rank["shared_controls"]:
        loss_error, grad_error = _errors(result, ref)
        print(f"control {result['config']['negative']}: loss {loss_error:.1e}, gradients {grad_error:.1e}")
        assert grad_error > 1e-2


def _largest_change(a, b) -> float:
    return float((a - b).abs().max())


def test_log_probs_in_chunks_equal_them_computed_whole(reference, one_rank):
    """model.logprob_chunk_size (#41): the loss, gradients and entropy of a step, and a log-prob pass, with
    the output layer and the cross-entropy a few tokens at a time equal the same step with whole logits
    (<= 1e-6): packed at T=0.7 with the entropy bonus, dynamically batched (BSHD rows), a shared prompt's
    extra targets, the log-prob pass."""
    done = one_rank["main"] + one_rank["sampled"] + one_rank["shared"]
    worst = [0.0, 0.0, 0.0]
    for (whole_cfg, size), result in zip(CHUNKED, one_rank["chunked"], strict=True):
        whole = next(r for r in done if r["config"] == whole_cfg)
        if whole_cfg.get("logprobs"):
            change = _largest_change(result["logprobs"], whole["logprobs"])
            worst[2] = max(worst[2], change)
            assert change <= 1e-6, (size, change)
            continue
        loss_change = abs(result["loss"] - whole["loss"]) / abs(whole["loss"])
        grad_change = max(grad_errors(result["grads"], whole["grads"]).values())
        entropy_change = abs(result["entropy"] - whole["entropy"]) / whole["entropy"]
        assert loss_change <= 1e-6 and grad_change <= 1e-6 and entropy_change <= 1e-6, (size, loss_change, grad_change)
        worst = [max(worst[0], loss_change), max(worst[1], grad_change), worst[2]]
    print(f"log-probs in chunks vs whole: loss {worst[0]:.1e}, gradients {worst[1]:.1e}, log-prob pass {worst[2]:.1e}")


@pytest.mark.slow
def test_every_objective_on_dp_cp_tp_sp_pp_and_dynamic_cp(reference, one_rank):
    """Each case on one of: DP2 x CP2, TP2 + SP (DP2), PP2 (DP2) packed, PP2 dynamic, TP2 x PP2, dynamic CP
    (CP4 packed, CP2 dynamic), every layout used, alternating T=1 and 0.7; two cases also at DP4 against the 1-rank step
    (<= 1e-6); the T=0.7 samples' ratio is 1 within 1e-6 at CP2 and TP2; a shared prompt per group (#40) at
    TP2 + SP, PP2 (dynamic batching) and PP2 x VPP2, each with DP2, equals the reference; log-probs in chunks
    (#41) at TP2 + SP equal the reference and the whole log-prob pass (<= 1e-6); the control: each
    micro-batch divided by its own token count fails. ``MCORE_PACKING_PG_FULL_CROSS=1``: every case on every layout at
    both temperatures (84 steps instead of 7; not in CI's time budget), ``MCORE_PACKING_PG_LAYOUTS=0,3`` runs
    those layouts (indices into the list below) only."""
    layouts = [
        {"cp": 2},
        {"tp": 2, "sp": True},
        {"pp": 2},
        {"pp": 2, "mode": "dynamic", "variable_seq_lengths": True},
        {"cp": 4, "dynamic_cp": True, "train_mb_tokens": 16},
        {"cp": 2, "dynamic_cp": True, "mode": "dynamic", "train_mb_tokens": 24},
        {"tp": 2, "pp": 2},
    ]  # fmt: skip
    # each case on one layout, every layout at least once, temperatures alternating
    configs = [_config(NAMES[k % len(NAMES)], TEMPERATURES[k % 2], **layouts[k % len(layouts)])
               for k in range(max(len(NAMES), len(layouts)))]  # fmt: skip
    if os.environ.get("MCORE_PACKING_PG_FULL_CROSS") == "1":  # every case on every layout at both temperatures
        picked = os.environ.get("MCORE_PACKING_PG_LAYOUTS")  # e.g. "0,1": those layouts only (runs in parts)
        if picked:
            layouts = [layouts[int(i)] for i in picked.split(",")]
        configs = [_config(name, t, **layout) for name in NAMES for layout in layouts for t in TEMPERATURES]
    count = len(configs)
    configs += [{**_config(NAMES[0], 0.7), "label": "DP4"}, {**_config(NAMES[4], 1.0), "label": "DP4"}]
    configs += [{"mode": "packing", "logprobs": True, "temperature": 0.7, "train_mb_tokens": 64, "pg": None, **lay}
                for lay in ({"cp": 2}, {"tp": 2, "sp": True})]  # fmt: skip
    shared = [{**_config(NAMES[0], 0.7, tp=2, sp=True), "shared_prefix": True},  # #40: a shared prompt per group
              # dynamic batching: THD rows of shared groups and BSHD rows of the rest, through the pipeline
              {**_config(NAMES[1], 1.0, pp=2, mode="dynamic", variable_seq_lengths=True, train_mb_tokens=40),
               "shared_prefix": True},
              {**_config(NAMES[4], 1.0, pp=2, vpp=2), "shared_prefix": True}]  # fmt: skip (the interleaved schedule)
    configs += shared
    # #41 at TP2 + SP: the loss's chunks through the sequence-parallel gather, the log-prob pass beside its whole one
    chunked = [{**_config(NAMES[0], 0.7, tp=2, sp=True), "logprob_chunk_size": 7},
               {**configs[count + 3], "logprob_chunk_size": 6}]  # fmt: skip
    configs += chunked
    # Negative control: each micro-batch normalized by its own tokens, then micro-batches averaged.
    configs.append({**_config(NAMES[1], 1.0, cp=2), "negative_pg": "per_microbatch_normalization"})
    results = _run(reference, 4, configs)
    table = []
    for result in results[: count + 2]:
        _check(result, reference, table)
        cfg = result["config"]
        if cfg.get("dynamic_cp") and not (cfg["mode"] == "dynamic" and cfg["pg"].get("loss_agg_mode") == "prompt-mean"):
            assert len({k for k, n in result["cp_sizes"].items() if n}) > 1, result["cp_sizes"]  # mixed CP sizes
    print("\n".join(table))
    single = [one_rank["main"][ONE_RANK.index(_config(NAMES[0], 0.7))],
              one_rank["main"][ONE_RANK.index(_config(NAMES[4], 1.0))]]  # fmt: skip
    for dp4, one in zip(results[count : count + 2], single, strict=True):
        loss_change = abs(dp4["loss"] - one["loss"]) / abs(one["loss"])
        grad_change = max(grad_errors(dp4["grads"], one["grads"]).values())
        print(f"DP4 vs 1 rank, {one['config']['case']}: loss {loss_change:.1e}, gradients {grad_change:.1e}")
        assert loss_change <= 1e-6 and grad_change <= 1e-6
    ratios = [_sampled_ratio_error(r, reference) for r in results[count + 2 : count + 4]]
    print(f"sampled at T=0.7, CP2 and TP2: |ratio - 1| <= {max(ratios):.1e}")
    assert max(ratios) <= 1e-6
    table = []
    for result in results[count + 4 : count + 4 + len(shared)]:
        _check(result, reference, table)
    print("shared prompt:\n" + "\n".join(table))
    start = count + 4 + len(shared)
    table = []
    _check(results[start], reference, table)
    change = _largest_change(results[start + 1]["logprobs"], results[count + 3]["logprobs"])
    print(f"log-probs in chunks at TP2 + SP:\n{table[0]}\nthe log-prob pass vs whole logits: {change:.1e}")
    assert change <= 1e-6
    wrong = results[-1]
    ref = reference["by_case"][(NAMES[1], 1.0)]
    print(f"per-micro-batch normalization (control): loss {_errors(wrong, ref)[0]:.1e}")
    assert _errors(wrong, ref)[0] > 1e-3
