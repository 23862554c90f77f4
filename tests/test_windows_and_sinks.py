"""Sliding windows and attention sinks (GPT-OSS's attention) in the built-in packed attention: a packed
step's loss and every gradient equal Megatron's own attention run one sequence per forward, with windows
shorter and longer than the sequences, at DP2, CP2 (the window over the sequence's global positions) and
TP2 + SP (the sinks split over the heads); a window that reaches across the packed boundary (the row
attended as one sequence) is the negative control.

Reference: `window_workers.window_reference_worker` (stock ``DotProductAttention`` with Megatron's window
mask and ``SoftmaxOne`` sinks, layers 1 and 3 windowed). Under test: `PackedCoreAttention`'s explicit path.
"""

from __future__ import annotations

import pytest

from .distributed_harness import run_distributed
from .test_step_equivalence import SAMPLES, grad_errors

pytestmark = pytest.mark.multirank

SHORT, LONG = 6, 64  # the samples are 1-40 tokens: a window inside most of them, and one past all of them


@pytest.fixture(scope="module")
def references():
    return run_distributed("tests.window_workers:window_reference_worker", 1, samples=SAMPLES,
                           windows=[SHORT, LONG])[0]  # fmt: skip


def errors(result, references):
    ref = references[result["config"]["window"]]
    grads = grad_errors(result["grads"], ref["grads"])
    return abs(result["loss"] - ref["loss"]) / abs(ref["loss"]), max(grads.values())


CONFIGS = [
    {"window": SHORT},
    {"window": LONG},
    {"window": SHORT, "cp": 2},
    {"window": SHORT, "tp": 2},
    {"window": SHORT, "negative": "one_span"},
]


def test_packed_windows_and_sinks_equal_megatrons_attention_per_sequence(references):
    results = run_distributed("tests.window_workers:window_step_worker", 2, configs=CONFIGS, samples=SAMPLES,
                              references=references, timeout=900)[0]  # fmt: skip
    for result in results[:-1]:
        assert result["all_losses_equal"], result["config"]
        assert max(errors(result, references)) <= 1e-5, (result["config"], errors(result, references))
        assert result["windows"] == [(result["config"]["window"] - 1, 0), None] * 2  # layers 1, 3 windowed
    loss_err, grad_err = errors(results[-1], references)
    assert loss_err > 1e-4 and grad_err > 1e-2, (loss_err, grad_err)  # the tolerance is 1e-5
    assert max(grad_errors(references[SHORT]["grads"], references[LONG]["grads"]).values()) > 1e-2  # it matters
    sinks = [g for name, g in references[SHORT]["grads"].items() if name.endswith("softmax_offset")]
    assert len(sinks) == 4 and all(g.abs().max() > 0 for g in sinks)  # the sinks learn
