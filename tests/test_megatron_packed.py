"""The packed THD path on a tiny real GPTModel (megatron-core, CPU, fp32, real gloo ranks).

Reference: every sequence run on its own through Megatron's stock DotProductAttention (local spec,
BSHD, explicit causal mask), with the same weights. It shares no code with the packed path beyond the
model's linear layers and RoPE.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .distributed_harness import run_distributed
from .megatron_workers import VOCAB

pytestmark = pytest.mark.multirank

RTOL = 1e-5


def random_cases(num_cases: int, seed: int) -> list[dict]:
    """Random length mixes including length-1 sequences, one sequence exactly at capacity, and padding."""
    rng = np.random.default_rng(seed)
    capacity = 96
    cases = []
    for c in range(num_cases):
        if c == 0:
            lengths = [capacity]  # a single sequence exactly at capacity
        elif c == 1:
            lengths = [1, 1, 7, 1]  # length-1 sequences
        else:
            lengths = []
            while sum(lengths) < capacity - 8 and len(lengths) < 6:
                lengths.append(int(min(rng.integers(1, 40), capacity - sum(lengths))))
        tokens = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
        rule = {"sequence_length_round": int(rng.choice([1, 4, 8]))} if c >= 2 else {}
        cases.append({"tokens": tokens, "rule": rule, "seed": 1000 + c})
    return cases


CASES = random_cases(8, seed=0)


@pytest.fixture(scope="module")
def cp1_results():
    return run_distributed("tests.megatron_workers:packed_reference_worker", 1, cases=CASES)[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_packed_logits_equal_each_sequence_alone(cp1_results):
    worst = 0.0
    for case, res in zip(CASES, cp1_results["cases"], strict=True):
        for tokens, packed, ref in zip(case["tokens"], res["packed"], res["reference"], strict=True):
            assert packed.shape == ref.shape == (len(tokens), VOCAB)
            worst = max(worst, rel_err(packed, ref))
    assert worst <= RTOL, worst


def test_negative_control_attention_across_boundaries_differs(cp1_results):
    # Declaring the packed row one sequence lets later sequences attend to earlier ones: must differ.
    diffs = []
    for res in cp1_results["cases"][1:]:
        for i in range(1, len(res["packed"])):
            n = res["packed"][i].shape[0]
            diffs.append(rel_err(res["no_boundaries"][i, :n], res["packed"][i]))
    assert diffs and min(diffs) > 1e-3, diffs


def test_cpu_adapter_redirected_only_the_known_call_sites(cp1_results):
    sites = {(m.rsplit(".", 1)[-1], call) for m, _, call in cp1_results["call_sites"]}
    assert sites == {("rotary_pos_embedding", "cuda.current_device"), ("utils", "cuda.current_device")}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_gathered_outputs_and_grads_equal_cp1(cp1_results, cp):
    results = run_distributed("tests.megatron_workers:cp_worker", cp, cases=CASES)[0]
    for ref, got in zip(cp1_results["cases"], results, strict=True):
        # CP pads every sequence to a multiple of 2*cp; compare the real positions of each sequence.
        assert rel_err(_real_rows(got), _real_rows_ref(ref, got)) <= RTOL
        for name, g in ref["grads"].items():
            assert rel_err(got["grads"][name], g) <= 1e-4, name


def test_context_parallel_negative_control_contiguous_split_differs(cp1_results):
    results = run_distributed("tests.megatron_workers:cp_worker", 2, cases=CASES[:3], split="contiguous")[0]
    pairs = zip(cp1_results["cases"][:3], results, strict=True)
    errors = [rel_err(_real_rows(got), _real_rows_ref(ref, got)) for ref, got in pairs]
    assert max(errors) > 1e-2, errors


def test_zero_length_sequences_change_no_output_or_gradient(cp1_results):
    """Fixed shapes (CUDA graphs): cu_seqlens padded with four zero-length sequences give the same logits
    and gradients; moving a boundary instead (the control) changes the logits."""
    moved = []
    for res in cp1_results["cases"]:
        fixed = res["fixed_shape"]
        assert rel_err(fixed["zero_length"]["logits"], res["full_logits"]) <= 1e-6
        for name, g in res["grads"].items():
            assert rel_err(fixed["zero_length"]["grads"][name], g) <= 1e-6, name
        if "split_tail" in fixed:
            moved.append(rel_err(fixed["split_tail"]["logits"], res["full_logits"]))
    assert moved and min(moved) > 1e-3, moved


def test_zero_length_sequences_under_context_parallelism(cp1_results):
    results = run_distributed("tests.megatron_workers:cp_worker", 2, cases=CASES, extra_cu_entries=5)[0]
    for ref, got in zip(cp1_results["cases"], results, strict=True):
        assert rel_err(_real_rows(got), _real_rows_ref(ref, got)) <= RTOL
        for name, g in ref["grads"].items():
            assert rel_err(got["grads"][name], g) <= 1e-4, name


def _real_rows(got) -> torch.Tensor:
    logits, rows, start = got["full_logits"], [], 0
    for span, n in zip(got["padded_lengths"], got["real_lengths"], strict=True):
        rows.append(logits[start : start + n])
        start += span
    return torch.cat(rows)


def _real_rows_ref(ref, got) -> torch.Tensor:
    return torch.cat(ref["packed"])
