"""Shared-prefix packing (#40): a GRPO group's prompt laid out once for all its responses.

The layout (`thd.shared_prefix`): every token of every sequence comes back once, in its place, with its
label, loss mask and position; bad groups are refused naming the group. The model (one real gloo rank,
a tiny GPTModel in fp32, `tests.shared_prefix_workers`): each sequence's logits, log-probs and the
parameter gradients of a fixed functional of them equal one forward per sequence through Megatron's
stock attention and the ordinary packed row. Controls: the context's keys left unrotated (RoPE's
positions of the members wrong) and a member attending to another member instead of the prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch
from mcore_packing.thd.shared_prefix import build_shared_prefix_row, common_prefix_length

from .distributed_harness import run_distributed
from .megatron_workers import VOCAB

RTOL = 1e-5


def _group_case(rng, prompt: int, responses: list[int], plain: list[int], rule: dict, seed: int) -> dict:
    """Sequences: one group (a prompt and its responses) followed by plain sequences; prompt tokens are
    out of the loss, as in RL rollouts."""
    head = rng.integers(0, VOCAB, prompt).tolist()
    tokens = [head + rng.integers(0, VOCAB, r).tolist() for r in responses]
    tokens += [rng.integers(0, VOCAB, n).tolist() for n in plain]
    masks = [[0.0] * prompt + [1.0] * r for r in responses] + [None] * len(plain)
    groups = [list(range(len(responses)))] + [[len(responses) + k] for k in range(len(plain))]
    return {"tokens": tokens, "masks": masks, "groups": groups, "prompts": [prompt] + [0] * len(plain),
            "rule": rule, "seed": seed}  # fmt: skip


def _cases() -> list[dict]:
    rng = np.random.default_rng(40)
    return [
        _group_case(rng, 12, [5, 9, 1, 3], [7], {}, 1),  # a response of one token
        _group_case(rng, 6, [4, 11, 2], [3, 10], {"sequence_length_round": 4}, 2),  # padded segments
    ]


CASES = _cases()


def _samples(case):
    return [SequenceSample(torch.tensor(t), m) for t, m in zip(case["tokens"], case["masks"], strict=True)]


@pytest.mark.parametrize("case", CASES, ids=["four responses", "padded"])
def test_every_token_comes_back_once_in_its_place(case):
    samples = _samples(case)
    row = build_shared_prefix_row(samples, case["groups"], case["prompts"], PaddingRule(**case["rule"]))
    alone = build_packed_batch(samples)  # labels, loss masks and positions of each sequence alone
    starts = alone.cu_seqlens.tolist()
    fields = ("tokens", "labels", "loss_mask", "position_ids")
    # tokens and positions per row position; labels and loss masks per target (the row's, then the extra ones)
    sources = {"tokens": row.batch, "position_ids": row.batch, "labels": row, "loss_mask": row}
    rows = {name: row.sample_rows(getattr(sources[name], name)[0]) for name in fields}
    for k, sample_id in enumerate(row.sample_ids):
        n = len(case["tokens"][sample_id])
        for name in fields:
            want = getattr(alone, name)[0, starts[sample_id] : starts[sample_id] + n]
            got = rows[name][k]
            # the last token of a sequence has no target: its label slot holds whatever follows in the row
            if name in ("labels", "loss_mask"):
                got, want = got[: n - 1], want[: n - 1]
            assert torch.equal(got, want.to(got.dtype)), (name, sample_id)
    prompt = case["prompts"][0]
    responses = [len(t) - prompt for t in case["tokens"][: len(case["groups"][0])]]
    plain = sum(len(t) for t in case["tokens"][len(responses) :])
    assert row.computed_tokens == prompt + sum(responses) + plain  # the prompt once, each response once
    extras = len(responses) - 1  # the prompt's last token's targets past the first response's
    assert len(row.extra_rows) == extras and row.labels.shape[1] == row.batch.total_tokens + extras
    assert row.separate_tokens == sum(len(t) for t in case["tokens"])


def test_bad_groups_are_refused_naming_the_group():
    case = CASES[0]
    samples = _samples(case)
    other = list(case["tokens"][1])
    other[3] = (other[3] + 1) % VOCAB
    changed = [*samples[:1], SequenceSample(torch.tensor(other), case["masks"][1]), *samples[2:]]
    with pytest.raises(ValueError, match=r"group 0 \(samples \[0, 1, 2, 3\]\): its members share only their first 3"):
        build_shared_prefix_row(changed, case["groups"], case["prompts"])
    learned = [SequenceSample(s.tokens, None) if i == 2 else s for i, s in enumerate(samples)]
    with pytest.raises(ValueError, match=r"group 0: samples \[2\] have prompt tokens in the loss"):
        build_shared_prefix_row(learned, case["groups"], case["prompts"])
    with pytest.raises(ValueError, match=r"group 0 .* has no response after the prompt of 14"):
        build_shared_prefix_row(samples, case["groups"], [14, 0])
    with pytest.raises(ValueError, match="cover each of the 5 samples once"):
        build_shared_prefix_row(samples, [[0, 1, 2]], [12])
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2


@pytest.fixture(scope="module")
def model_results():
    return run_distributed("tests.shared_prefix_workers:shared_prefix_worker", 1, cases=CASES)[0]


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _grad_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(_rel(a[n], b[n]) for n in a)


@pytest.mark.multirank
def test_shared_prefix_logits_logprobs_and_grads_equal_each_sequence_alone(model_results):
    logits = max(_rel(s, r) for res in model_results for s, r in zip(res["shared"], res["reference"], strict=True))
    logprobs = max(_rel(s, r) for res in model_results
                   for s, r in zip(res["shared_logprobs"], res["reference_logprobs"], strict=True))  # fmt: skip
    grads = max(_grad_rel(res["shared_grads"], res["reference_grads"]) for res in model_results)
    packed = max(_grad_rel(res["shared_grads"], res["packed_grads"]) for res in model_results)
    unrotated = min(_rel(u, r) for res in model_results for u, r in zip(res["unrotated"], res["reference"], strict=True)
                    if u.shape[0] > 12)  # fmt: skip
    crossed = max(_rel(x, r) for res in model_results for x, r in zip(res["crossed"], res["reference"], strict=True))
    varlen = max(_rel(x, r) for res in model_results for x, r in zip(res["varlen"], res["reference"], strict=True))
    saved = [1 - res["computed_tokens"] / res["separate_tokens"] for res in model_results]
    print(f"shared prefix vs each sequence alone: logits {logits:.1e}, log-probs {logprobs:.1e}, gradients "
          f"{grads:.1e}; vs the packed row: gradients {packed:.1e}; the GPU path's one varlen call (a CPU stand-in "
          f"for the kernel): logits {varlen:.1e}; controls: keys unrotated {unrotated:.1e}, "
          f"a member seeing another {crossed:.1e}; tokens saved {', '.join(f'{s:.0%}' for s in saved)}")  # fmt: skip
    assert logits <= RTOL and logprobs <= RTOL and grads <= RTOL and packed <= RTOL and varlen <= RTOL
    assert unrotated > 1e-3 and crossed > 1e-3
    for res in model_results:
        assert res["row_tokens"] < res["packed_row_tokens"]


@pytest.mark.multirank
def test_the_step_refuses_what_cannot_read_a_shared_row(model_results):
    weighted, stock = model_results[0]["refusals"]
    assert "TokenMeanNLL weights the packed row's tokens" in weighted
    assert "needs the built-in attention (PackedCoreAttention)" in stock and "model.attention_backend=local" in stock
