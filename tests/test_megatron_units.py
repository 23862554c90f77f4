"""PackedSeqParams construction, the attention module's backends, the layer spec, CP round trips."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from mcore_packing import compat
from mcore_packing.megatron import (
    get_packed_gpt_layer_spec,
    resolve_attention_backend,
    thd_layout,
    to_packed_seq_params,
)
from mcore_packing.megatron.attention import PackedCoreAttention
from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, slice_for_cp

from .distributed_harness import run_distributed
from .megatron_workers import tiny_attention_config


def make_batch(rule=None):
    return build_packed_batch([SequenceSample([1, 2, 3, 4, 5]), SequenceSample([6, 7])], rule or PaddingRule(cp_size=2))


def test_packed_seq_params_fields_dtypes_and_layout():
    from megatron.core.packed_seq_params import PackedSeqParams

    batch = make_batch()
    p = to_packed_seq_params(batch)
    assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd"
    assert p.cu_seqlens_q.dtype == torch.int32 and p.cu_seqlens_q.tolist() == [0, 5, 7]
    assert p.cu_seqlens_kv_padded.tolist() == [0, 8, 12] and p.cu_seqlens_q_padded.dtype == torch.int32
    assert p.max_seqlen_q == p.max_seqlen_kv == 8 and isinstance(p.max_seqlen_q, int)
    layout = thd_layout(p)
    assert layout.padded_starts == (0, 8) and layout.padded_lengths == (8, 4) and layout.real_lengths == (5, 2)


def test_fixed_entries_repeat_the_last_boundary_as_zero_length_sequences():
    p = to_packed_seq_params(make_batch(), cu_entries=5)
    assert p.cu_seqlens_q.tolist() == [0, 5, 7, 7, 7] and p.cu_seqlens_kv_padded.tolist() == [0, 8, 12, 12, 12]
    assert p.max_seqlen_q == 8  # the longest span, not a static bound (see packed_seq's docstring)
    layout = thd_layout(p)
    assert layout.padded_lengths == (8, 4, 0, 0) and layout.real_lengths == (5, 2, 0, 0) and layout.total == 12
    assert to_packed_seq_params(make_batch(), cu_entries=3).cu_seqlens_q.tolist() == [0, 5, 7]
    with pytest.raises(ValueError, match=r"cu_entries=2 cannot describe this row of 2 sequences: it needs at least 3"):
        to_packed_seq_params(make_batch(), cu_entries=2)


def test_layout_is_read_back_when_params_come_from_elsewhere():
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=6, max_seqlen_kv=6)
    assert thd_layout(p).padded_lengths == (3, 6) and thd_layout(p).real_lengths == (3, 6)


def test_newer_fields_are_passed_only_when_the_installed_release_has_them(monkeypatch):
    import megatron.core.packed_seq_params as psp

    @dataclasses.dataclass
    class NewerParams(psp.PackedSeqParams):
        total_tokens: int = None
        pad_between_seqs: bool = None

    monkeypatch.setattr(psp, "PackedSeqParams", NewerParams)
    monkeypatch.setattr(
        compat, "packed_seq_params_fields", lambda: frozenset(f.name for f in dataclasses.fields(NewerParams))
    )
    import mcore_packing.megatron.packed_seq as packed_seq

    monkeypatch.setattr(packed_seq, "packed_seq_params_fields", compat.packed_seq_params_fields)
    p = to_packed_seq_params(make_batch())
    assert p.total_tokens == 12 and p.pad_between_seqs is True
    shard = slice_for_cp(make_batch(), 2, 1)  # a CP rank's share still names the whole row
    assert to_packed_seq_params(shard).total_tokens == 12
    unpadded = build_packed_batch([SequenceSample([1, 2, 3, 4]), SequenceSample([6, 7])])
    assert to_packed_seq_params(unpadded).pad_between_seqs is False
    # The installed release (0.16.x) lacks them: nothing extra is passed, or its constructor would raise.
    monkeypatch.undo()
    fields = compat.packed_seq_params_fields()
    p = to_packed_seq_params(make_batch())
    assert ("total_tokens" in fields) == hasattr(p, "total_tokens")


def _sequence_index(padded_lengths):
    """Each token's sequence in the whole packed row, written out from the padded lengths."""
    return [i for i, n in enumerate(padded_lengths) for _ in range(n)]


@pytest.mark.skipif(
    "total_tokens" not in compat.packed_seq_params_fields(),
    reason=f"megatron-core {compat.megatron_core_version()} has no PackedSeqParams.total_tokens (0.17+)",
)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_newer_releases_index_the_whole_row_on_every_cp_rank(cp):
    """On megatron-core 0.19: ``seq_idx`` (Mamba's sequence index, computed by PackedSeqParams itself) covers
    the gathered row on every CP rank, pads included in their own sequence, and 0.19's MoE un-flattening
    sees one sample."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    lengths = (5, 1, 9, 3)
    rule = PaddingRule(cp_size=cp, sequence_length_round=4)
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in lengths], rule)
    expected = _sequence_index(batch.padded_lengths)
    for rank in range(cp):
        local = slice_for_cp(batch, cp, rank)
        p = to_packed_seq_params(local)
        assert p.seq_idx.tolist() == [expected], (cp, rank)
        assert p.pad_between_seqs is (batch.padded_lengths != batch.seq_lengths)
        hidden = torch.zeros(local.tokens.shape[1], 1, 4)
        layer = type("MoELayer", (), {"is_moe_layer": True})()
        assert TransformerLayer._maybe_unflatten_for_moe(layer, hidden, None, p)[2] is None  # left as one row
    # Negative control: params without the padded cu_seqlens index each pad with the next sequence.
    wrong = dataclasses.replace(to_packed_seq_params(batch), cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
    assert wrong.seq_idx.tolist() != [expected]


def naive_causal_attention(q, k, v, left: int | None = None):
    """q/k/v [L, H, D] -> [L, H, D], written out with an explicit softmax; ``left``: a sliding window (query
    i sees keys i - left .. i)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    n = q.shape[0]
    hidden = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    if left is not None:
        hidden |= torch.tril(torch.ones(n, n, dtype=torch.bool), -left - 1)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_thd_attention_matches_naive_per_sequence_with_gqa_and_zeroes_padding():
    from megatron.core.transformer.enums import AttnMaskType

    attn = PackedCoreAttention(tiny_attention_config(), 1, AttnMaskType.causal, backend="sdpa")
    batch = build_packed_batch(
        [SequenceSample(list(range(n))) for n in (5, 1, 9)], PaddingRule(sequence_length_round=4)
    )
    p = to_packed_seq_params(batch)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch.total_tokens, 4, 8, generator=g)
    k, v = (torch.randn(batch.total_tokens, 2, 8, generator=g) for _ in range(2))  # 2 KV groups
    out = attn(q, k, v, None, packed_seq_params=p).reshape(batch.total_tokens, 4, 8)
    for start, span, n in zip(batch.cu_seqlens_padded.tolist(), batch.padded_lengths, batch.seq_lengths, strict=False):
        ref = naive_causal_attention(q[start : start + n], k[start : start + n], v[start : start + n])
        torch.testing.assert_close(out[start : start + n], ref, rtol=1e-5, atol=1e-6)
        assert out[start + n : start + span].abs().sum() == 0


def test_bshd_attention_is_causal_per_row():
    from megatron.core.transformer.enums import AttnMaskType

    attn = PackedCoreAttention(tiny_attention_config(), 1, AttnMaskType.causal)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 3, 4, 8, generator=g) for _ in range(3))
    out = attn(q, k, v, None).reshape(6, 3, 4, 8)
    for b in range(3):
        torch.testing.assert_close(out[:, b], naive_causal_attention(q[:, b], k[:, b], v[:, b]), rtol=1e-5, atol=1e-6)


def test_attention_rejects_what_it_does_not_implement():
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match="causal attention only"):
        attn = PackedCoreAttention(tiny_attention_config(), 1, AttnMaskType.no_mask)
        attn(torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8), None)
    with pytest.raises(ValueError, match="backend must be one of"):
        PackedCoreAttention(tiny_attention_config(), 1, AttnMaskType.causal, backend="flash9")
    if not compat.varlen_attn_available():
        attn = PackedCoreAttention(tiny_attention_config(), 1, AttnMaskType.causal, backend="varlen")
        batch = make_batch(PaddingRule())
        with pytest.raises(RuntimeError, match="varlen_attn and a CUDA device"):
            attn(
                torch.zeros(7, 4, 8),
                torch.zeros(7, 4, 8),
                torch.zeros(7, 4, 8),
                None,
                packed_seq_params=to_packed_seq_params(batch),
            )


def test_layer_spec_uses_packed_attention_without_te():
    spec = get_packed_gpt_layer_spec("auto")
    core = spec.submodules.self_attention.submodules.core_attention
    if compat.te_available():
        pytest.skip("TransformerEngine is installed: 'auto' picks TE's spec")
    assert core.module is PackedCoreAttention
    assert resolve_attention_backend("auto") == "local"
    with pytest.raises(ImportError, match="needs TransformerEngine"):
        get_packed_gpt_layer_spec("te")
    with pytest.raises(ValueError, match="'auto', 'te' or 'local'"):
        resolve_attention_backend("cudnn")


@pytest.mark.multirank
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_round_trips_and_bshd_cp_attention(cp):
    cases = [[[1, 2, 3], [4], list(range(10, 27))], [list(range(1, 40))], [[5] * 8, [6] * 3]]
    report = run_distributed("tests.megatron_workers:cp_roundtrip_worker", cp, cases=cases)[0]
    assert all(report["thd_roundtrip"]) and report["bshd_roundtrip"]
    assert report["bshd_attention_err"] < 1e-5 and report["bshd_grad_err"] < 1e-5, report


def _varlen_semantics(q, k, v, cu, causal, scale, left=-1):
    """What torch documents varlen_attn to compute, written with per-sequence SDPA on CPU: a stand-in for
    the CUDA-only kernel, so the version shim's argument mapping can be checked here. ``left`` >= 0: the
    causal window ``window_size=(left, 0)`` (query i sees keys i - left .. i)."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        if ks.shape[0] != qs.shape[0]:
            ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], dim=0) for t in (ks, vs))
        mask = None
        if left >= 0:
            i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None]
            mask = (j <= i) & (j >= i - left)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal and mask is None,
                                                             attn_mask=mask, scale=scale)  # fmt: skip
        out[a:b] = o.transpose(0, 1)
    return out


def _new_varlen_api(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                    enable_gqa=False):  # fmt: skip
    assert enable_gqa or k.shape[1] == q.shape[1]
    causal = window_size[1] == 0
    return _varlen_semantics(q, k, v, cu_q, causal, scale, left=window_size[0] if causal else -1)


def _old_varlen_api(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
    assert k.shape[1] == q.shape[1], "the old API has no grouped-query attention"
    return _varlen_semantics(q, k, v, cu_q, is_causal, None)


@pytest.mark.parametrize("api", [_new_varlen_api, _old_varlen_api])
def test_varlen_shim_calls_either_torch_signature_like_sdpa_per_sequence(api):
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in (5, 1, 9)], PaddingRule())
    cu = batch.cu_seqlens_padded
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch.total_tokens, 4, 8, generator=g)
    k, v = (torch.randn(batch.total_tokens, 2, 8, generator=g) for _ in range(2))  # GQA: 2 K/V heads
    got = compat.varlen_attention(q, k, v, cu, 9, scale=8**-0.5, fn=api)
    for a, n in zip(cu.tolist(), batch.seq_lengths, strict=False):
        want = naive_causal_attention(q[a : a + n], k[a : a + n], v[a : a + n])
        torch.testing.assert_close(got[a : a + n], want, rtol=1e-5, atol=1e-6)
    # Negative control: non-causal attention differs (later tokens leak into earlier ones).
    leaky = compat.varlen_attention(q, k, v, cu, 9, scale=8**-0.5, causal=False, fn=api)
    assert (leaky[:4] - got[:4]).abs().max() > 1e-3
    if api is _old_varlen_api:
        with pytest.raises(RuntimeError, match="has no scale argument"):
            compat.varlen_attention(q, k, v, cu, 9, scale=0.5, fn=api)


def test_varlen_shim_passes_a_sliding_window_and_old_torch_refuses_it():
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in (9, 1, 5)], PaddingRule())
    cu = batch.cu_seqlens_padded
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch.total_tokens, 2, 8, generator=g) for _ in range(3))
    got = compat.varlen_attention(q, k, v, cu, 9, scale=8**-0.5, fn=_new_varlen_api, left=2)
    for a, n in zip(cu.tolist(), batch.seq_lengths, strict=False):
        want = naive_causal_attention(q[a : a + n], k[a : a + n], v[a : a + n], left=2)
        torch.testing.assert_close(got[a : a + n], want, rtol=1e-5, atol=1e-6)
    full = compat.varlen_attention(q, k, v, cu, 9, scale=8**-0.5, fn=_new_varlen_api)  # control: no window
    assert (full[:9] - got[:9]).abs().max() > 1e-3
    with pytest.raises(RuntimeError, match="has no window_size"):
        compat.varlen_attention(q, k, v, cu, 9, scale=8**-0.5, fn=_old_varlen_api, left=2)


def test_a_windowed_layer_without_sinks_takes_the_varlen_kernels_window(monkeypatch):
    """`PackedCoreAttention`'s GPU path for a windowed layer (Mistral's): one varlen call with
    ``window_size=(left, 0)``, the kernel replaced by the CPU stand-in; equal to the CPU path (the explicit
    windowed softmax per sequence). Sink layers never take the varlen call, nor windows on a torch whose
    varlen_attn has no window_size."""
    from functools import partial

    from megatron.core.transformer.enums import AttnMaskType

    import mcore_packing.megatron.attention as attention
    from mcore_packing.megatron import to_packed_seq_params

    config = dataclasses.replace(tiny_attention_config(), window_size=(3, 0))
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in (13, 1, 6, 9)], PaddingRule())
    params = to_packed_seq_params(batch)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(batch.total_tokens, 4, 16, generator=g) for _ in range(3))
    attn = PackedCoreAttention(config, 1, AttnMaskType.causal)
    want = attn(q, k, v, None, packed_seq_params=params)
    monkeypatch.setattr(attention, "varlen_attention", partial(compat.varlen_attention, fn=_new_varlen_api))
    monkeypatch.setattr(PackedCoreAttention, "_use_varlen", lambda self, query: True)
    got = attn(q, k, v, None, packed_seq_params=params)
    for a, n in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lengths, strict=False):
        torch.testing.assert_close(got[a : a + n], want[a : a + n], rtol=1e-5, atol=1e-6)
    attn.window = None  # control: the same call without the window
    assert (attn(q, k, v, None, packed_seq_params=params)[:13] - want[:13]).abs().max() > 1e-3
    monkeypatch.undo()
    monkeypatch.setattr(attention, "varlen_attn_takes_window", lambda: False)
    windowed = PackedCoreAttention(config, 1, AttnMaskType.causal, backend="varlen")
    assert not windowed._use_varlen(q)  # no window in this torch's kernel: the explicit path, no error
    sinks = PackedCoreAttention(dataclasses.replace(config, softmax_type="learnable"), 1, AttnMaskType.causal,
                                backend="varlen")  # fmt: skip
    monkeypatch.setattr(attention, "varlen_attn_takes_window", lambda: True)
    assert not sinks._use_varlen(q)


@pytest.mark.multirank
def test_the_gpu_checks_own_comparison_holds_on_cpu():
    errors = run_distributed("tests.megatron_workers:gpu_check_helper_on_cpu_worker", 1)[0]
    assert errors["logits"] <= 1e-5 and errors["grads"] <= 1e-4, errors
