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


FP32_RTOL = 1e-5  # fp32 logits, packed THD vs each sequence alone
LENGTHS = (300, 1, 77, 512, 129)


@pytest.fixture(scope="module")
def single_rank():
    """A world of one (NCCL) with Megatron's parallel state, for GPTModel on the GPU."""
    import os
    import socket

    import torch.distributed as dist

    from mcore_packing.megatron import initialize_parallel

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    initialize_parallel()
    yield
    dist.destroy_process_group()


def packed_vs_per_sequence(device, dtype, backend: str, moe: bool = False) -> dict:
    """Relative errors of packed THD logits and parameter gradients against one forward per sequence.

    The model is a real Megatron GPTModel (RMSNorm, SwiGLU, GQA, RoPE; with ``moe`` Megatron's MoE layer,
    4 experts, top-2, TE's experts with the te backend). Backward runs a fixed random projection of the real
    positions' logits, so both sides differentiate the same function.
    """
    from mcore_packing.megatron import build_gpt_model, to_packed_seq_params
    from mcore_packing.planning import ModelShape

    shape = ModelShape(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=512,
        vocab_size=1000,
        max_sequence_length=1024,
        normalization="RMSNorm",
        gated_mlp=True,
        **({"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 128, "linear_bias": False} if moe else {}),
    )
    model, _ = build_gpt_model(shape, dtype=dtype, attention_backend=backend, device=device)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, shape.vocab_size, (n,), generator=g) for n in LENGTHS]
    weights = [torch.randn(n, shape.vocab_size, generator=g).to(device) for n in LENGTHS]
    batch = build_packed_batch([SequenceSample(s) for s in seqs], PaddingRule())
    params = to_packed_seq_params(batch, device=device)

    def grads():
        out = {name: p.main_grad.float().clone() for name, p in model.module.named_parameters()}
        model.zero_grad_buffer()
        return out

    model.zero_grad_buffer()
    logits = model.module(batch.tokens.to(device), batch.position_ids.to(device), None, packed_seq_params=params)[0]
    starts = batch.cu_seqlens_padded.tolist()
    packed = [logits[a : a + n] for a, n in zip(starts, LENGTHS, strict=False)]
    sum(((x.float() * w).sum() for x, w in zip(packed, weights, strict=True))).backward()
    packed_grads = grads()
    alone = []
    for s, w in zip(seqs, weights, strict=True):
        out = model.module(s[None].to(device), torch.arange(s.numel(), device=device)[None], None)[0]
        (out.float() * w).sum().backward()
        alone.append(out.detach())
    alone_grads = grads()

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))

    return {
        "logits": max(rel(p.detach(), a) for p, a in zip(packed, alone, strict=True)),
        "grads": max(rel(packed_grads[k], alone_grads[k]) for k in alone_grads),
    }


@pytest.mark.parametrize("dtype, backend", [("float32", "local"), ("bfloat16", "local"), ("bfloat16", "te")])
def test_packed_gpt_matches_per_sequence_on_the_gpu(single_rank, dtype, backend):
    """fp32 runs SDPA per sequence (FlashAttention has no fp32), bf16 the varlen kernel or TE's."""
    if backend == "te" and not compat.te_available():
        pytest.skip("TransformerEngine is not installed")
    errors = packed_vs_per_sequence(torch.device("cuda"), getattr(torch, dtype), backend)
    rtol = FP32_RTOL if dtype == "float32" else BF16_RTOL
    grad_rtol = 1e-4 if dtype == "float32" else 5e-2
    assert errors["logits"] <= rtol and errors["grads"] <= grad_rtol, errors


@pytest.mark.parametrize("dtype, backend", [("float32", "local"), ("bfloat16", "te")])
def test_packed_moe_gpt_matches_per_sequence_on_the_gpu(single_rank, dtype, backend):
    """A Mixture-of-Experts model on the GPU: dropless routing sends every token to the same experts packed
    or alone, so packed THD rows give each sequence's own logits and gradients (TE's experts with te)."""
    if backend == "te" and not compat.te_available():
        pytest.skip("TransformerEngine is not installed")
    errors = packed_vs_per_sequence(torch.device("cuda"), getattr(torch, dtype), backend, moe=True)
    rtol = FP32_RTOL if dtype == "float32" else BF16_RTOL
    grad_rtol = 1e-4 if dtype == "float32" else 5e-2
    assert errors["logits"] <= rtol and errors["grads"] <= grad_rtol, errors
