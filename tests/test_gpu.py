"""GPU-only checks: the varlen FlashAttention backend in bf16 and agreement with TransformerEngine.

Skipped with a reason on CPU machines (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from mcore_packing import compat
from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, thd_partition_indices

pytestmark = pytest.mark.gpu

BF16_RTOL = 2e-2  # bf16 has 8 mantissa bits; per-sequence vs packed kernels differ in accumulation order


def test_varlen_backend_matches_sdpa_per_sequence_in_bf16():
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_packing.megatron import to_packed_seq_params
    from mcore_packing.megatron.attention import PackedCoreAttention

    from .megatron_workers import tiny_attention_config

    if not compat.varlen_attn_available():
        pytest.skip("this torch build has no torch.nn.attention.varlen.varlen_attn")
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in (300, 1, 77, 512)], PaddingRule())
    params = to_packed_seq_params(batch, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(batch.total_tokens, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )
    config = tiny_attention_config()
    varlen = PackedCoreAttention(config, 1, AttnMaskType.causal, backend="varlen").cuda()
    sdpa = PackedCoreAttention(config, 1, AttnMaskType.causal, backend="sdpa").cuda()
    a = varlen(q, k, v, None, packed_seq_params=params).float()
    b = sdpa(q, k, v, None, packed_seq_params=params).float()
    for start, n in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lengths, strict=False):
        err = (a[start : start + n] - b[start : start + n]).abs().max() / b[start : start + n].abs().max()
        assert err < BF16_RTOL, float(err)


def test_partition_agrees_with_transformer_engine():
    fn = compat.te_thd_partitioned_indices()
    if fn is None:
        pytest.skip("TransformerEngine is not installed")
    cu = [0, 8, 24, 32, 96]
    for cp in (2, 4):
        for rank in range(cp):
            theirs = fn(torch.tensor(cu, dtype=torch.int32, device="cuda"), cu[-1], cp, rank).cpu().long()
            assert torch.equal(theirs, thd_partition_indices(cu, cu[-1], cp, rank))
