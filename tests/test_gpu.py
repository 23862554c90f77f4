"""GPU-only checks: the varlen FlashAttention backend in bf16 and agreement with TransformerEngine, the
packed model against one forward per sequence (TE's attention and ours), the step's syncs under CUDA's own
sync debug mode, and on 2+ GPUs the DP2 and CP2 steps over NCCL against the single GPU.

Skipped with a reason on CPU machines (see conftest.py). TransformerEngine's rows skip with the reason the
GPU check does not carry it (`benchmarks/gpu_wheels.py`) when it is not installed.
"""

from __future__ import annotations

import pytest
import torch

from mcore_packing import compat
from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, thd_partition_indices

pytestmark = pytest.mark.gpu

BF16_RTOL = 2e-2  # bf16 has 8 mantissa bits; per-sequence vs packed kernels differ in accumulation order
NO_TE = ("TransformerEngine is not installed (the GPU check does not carry it: its CUDA 13 core wheel is over "
         "the 64 MiB a device call carries; see benchmarks/gpu_wheels.py)")  # fmt: skip


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


def test_a_window_without_sinks_runs_in_the_varlen_kernel_and_matches_the_cpu_in_fp32():
    """Mistral's window (every layer, no sinks) on CUDA in bf16: FlashAttention's own ``window_size=(left, 0)``
    in the one varlen call, against the same module's explicit windowed path on the CPU in fp32."""
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType

    from mcore_packing.megatron import to_packed_seq_params
    from mcore_packing.megatron.attention import PackedCoreAttention

    from .megatron_workers import tiny_attention_config

    if not compat.varlen_attn_takes_window():
        pytest.skip("this torch build's varlen_attn takes no window_size (or there is no varlen_attn)")
    config = dataclasses.replace(tiny_attention_config(), window_size=(127, 0))
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in (1500, 1, 77, 300)], PaddingRule())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch.total_tokens, 4, 64, generator=g) for _ in range(3))
    cpu = PackedCoreAttention(config, 1, AttnMaskType.causal)
    want = cpu(q, k, v, None, packed_seq_params=to_packed_seq_params(batch))
    gpu = PackedCoreAttention(config, 1, AttnMaskType.causal, backend="varlen").cuda()
    cuda = [t.cuda().to(torch.bfloat16) for t in (q, k, v)]
    assert gpu._use_varlen(cuda[0])
    got = gpu(*cuda, None, packed_seq_params=to_packed_seq_params(batch, device="cuda")).float().cpu()
    for start, n in zip(batch.cu_seqlens_padded.tolist(), batch.seq_lengths, strict=False):
        part = slice(start, start + n)
        assert ((got[part] - want[part]).abs().max() / want[part].abs().max()) < BF16_RTOL


def test_windows_and_sinks_on_the_gpu_in_bf16_match_the_cpu_in_fp32():
    """The explicit path of windowed, sink-carrying layers (GPT-OSS's attention) on CUDA in bf16, with
    sequences longer than its 1024-query blocks, against the same module on the CPU in fp32."""
    import dataclasses

    from megatron.core.transformer.enums import AttnMaskType

    from mcore_packing.megatron import to_packed_seq_params
    from mcore_packing.megatron.attention import PackedCoreAttention

    from .megatron_workers import tiny_attention_config

    config = dataclasses.replace(tiny_attention_config(), window_size=(127, 0), softmax_type="learnable")
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in (1500, 1, 77, 300)], PaddingRule())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch.total_tokens, 4, 64, generator=g) for _ in range(3))
    cpu = PackedCoreAttention(config, 1, AttnMaskType.causal)
    with torch.no_grad():
        cpu.softmax_offset.normal_(0.0, 1.0, generator=g)
    gpu = PackedCoreAttention(config, 1, AttnMaskType.causal).cuda().to(torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    assert gpu.window == (127, 0)
    want = cpu(q, k, v, None, packed_seq_params=to_packed_seq_params(batch)).float()
    cuda = [t.cuda().to(torch.bfloat16) for t in (q, k, v)]
    got = gpu(*cuda, None, packed_seq_params=to_packed_seq_params(batch, device="cuda")).float().cpu()
    assert ((got - want).abs().max() / want.abs().max()) < BF16_RTOL


def test_partition_agrees_with_transformer_engine():
    fn = compat.te_thd_partitioned_indices()
    if fn is None:
        pytest.skip(NO_TE)
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
    import torch.distributed as dist

    from mcore_packing.megatron import initialize_parallel, start_world_of_one

    torch.cuda.set_device(0)
    start_world_of_one("nccl")
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


def test_log_probs_in_chunks_lower_the_peak_by_the_rows_fp32_logits(single_rank):
    """#41: a bf16 GPTModel's forward with labels and backward on a packed row of 4096 tokens and a 32k
    vocabulary, with whole logits and in chunks of 512 tokens (`chunk_logprobs`): the same per-token losses
    (bf16 tolerance), and the allocator's peak lower by at least the row's fp32 logits (T x V x 4 bytes;
    the whole path also holds the bf16 logits and the softmax's temporaries)."""
    from mcore_packing.megatron import build_gpt_model, chunk_logprobs, to_packed_seq_params
    from mcore_packing.planning import ModelShape

    shape = ModelShape(num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                       vocab_size=32768, max_sequence_length=4096, normalization="RMSNorm", gated_mlp=True)  # fmt: skip
    model, _ = build_gpt_model(shape, dtype="bfloat16", attention_backend="local", device="cuda")
    g = torch.Generator().manual_seed(41)
    batch = build_packed_batch([SequenceSample(torch.randint(0, shape.vocab_size, (n,), generator=g))
                                for n in (2048, 1024, 1024)], PaddingRule())  # fmt: skip
    params = to_packed_seq_params(batch, device="cuda")
    tokens, positions, labels = (t.cuda() for t in (batch.tokens, batch.position_ids, batch.labels))

    def run():
        model.zero_grad_buffer()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model.module(tokens, positions, None, labels=labels, packed_seq_params=params)
        loss.float().mean().backward()
        torch.cuda.synchronize()
        return loss.detach().float(), torch.cuda.max_memory_allocated() - base

    whole, whole_peak = run()
    with chunk_logprobs(model, 512):
        chunked, chunked_peak = run()
    predicted = batch.total_tokens * shape.vocab_size * 4
    mib = 2**20
    print(f"peak (forward, backward): whole {whole_peak / mib:.0f} MiB, in chunks of 512 {chunked_peak / mib:.0f} MiB, "
          f"lower by {(whole_peak - chunked_peak) / mib:.0f} MiB (at least {predicted / mib:.0f} MiB predicted)")
    assert float((chunked - whole).abs().max() / whole.abs().max()) < BF16_RTOL
    assert whole_peak - chunked_peak >= predicted


@pytest.mark.parametrize("backend, kernel", [("local", "flash"), ("te", "te-fused")])
def test_the_memory_models_attention_kernels_match_what_the_gpu_saves(single_rank, backend, kernel):
    """#41: what a bf16 packed micro-batch's forward saves for the backward on the GPU (the saved-tensor
    meter of `tests.memory_workers`) against `planning.memory.activation_bytes` with the GPU kernel's
    constants (flash: torch's varlen FlashAttention under the built-in backend; te-fused: TE's), within
    10%; the measured and predicted bytes are printed for benchmarks/README.md."""
    if backend == "te" and not compat.te_available():
        pytest.skip(NO_TE)
    from mcore_packing.megatron import build_gpt_model, to_packed_seq_params
    from mcore_packing.planning import ModelShape, ParallelLayout
    from mcore_packing.planning.memory import MemorySettings, MicroBatchTokens, activation_bytes

    from .memory_workers import SavedBytes

    shape = ModelShape(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                       vocab_size=1000, max_sequence_length=1024, normalization="RMSNorm", gated_mlp=True)  # fmt: skip
    model, _ = build_gpt_model(shape, dtype=torch.bfloat16, attention_backend=backend, device="cuda")
    batch = build_packed_batch([SequenceSample(list(range(n))) for n in LENGTHS], PaddingRule())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter = SavedBytes(params)
    with meter.hooks():
        model.module(batch.tokens.cuda(), batch.position_ids.cuda(), None, labels=batch.labels.cuda(),
                     packed_seq_params=to_packed_seq_params(batch, device="cuda"))  # fmt: skip
    mb = MicroBatchTokens(thd=True, lengths=tuple(batch.seq_lengths), rows=1, width=batch.total_tokens,
                          spans=tuple(batch.padded_lengths))  # fmt: skip
    terms = activation_bytes(shape, ParallelLayout(), MemorySettings(dtype_bytes=2, attention=kernel), mb)
    predicted = sum(terms.values())
    print(f"{kernel}: saved for the backward {meter.peak:,} B, predicted {predicted:,.0f} B "
          f"({(predicted - meter.peak) / meter.peak:+.1%}; attention term {terms['attention']:,.0f} B)")
    assert abs(predicted - meter.peak) <= 0.10 * meter.peak


@pytest.mark.parametrize("dtype, backend", [("float32", "local"), ("bfloat16", "local"), ("bfloat16", "te")])
def test_packed_gpt_matches_per_sequence_on_the_gpu(single_rank, dtype, backend):
    """fp32 runs SDPA per sequence (FlashAttention has no fp32), bf16 the varlen kernel or TE's."""
    if backend == "te" and not compat.te_available():
        pytest.skip(NO_TE)
    errors = packed_vs_per_sequence(torch.device("cuda"), getattr(torch, dtype), backend)
    rtol = FP32_RTOL if dtype == "float32" else BF16_RTOL
    grad_rtol = 1e-4 if dtype == "float32" else 5e-2
    assert errors["logits"] <= rtol and errors["grads"] <= grad_rtol, errors


@pytest.mark.parametrize("dtype, backend", [("float32", "local"), ("bfloat16", "te")])
def test_packed_moe_gpt_matches_per_sequence_on_the_gpu(single_rank, dtype, backend):
    """A Mixture-of-Experts model on the GPU: dropless routing sends every token to the same experts packed
    or alone, so packed THD rows give each sequence's own logits and gradients (TE's experts with te)."""
    if backend == "te" and not compat.te_available():
        pytest.skip(NO_TE)
    errors = packed_vs_per_sequence(torch.device("cuda"), getattr(torch, dtype), backend, moe=True)
    rtol = FP32_RTOL if dtype == "float32" else BF16_RTOL
    grad_rtol = 1e-4 if dtype == "float32" else 5e-2
    assert errors["logits"] <= rtol and errors["grads"] <= grad_rtol, errors


def test_the_step_makes_no_sync_of_ours_under_cuda_sync_debug_mode(single_rank):
    """CUDA's own sync debug mode ("warn") inside every forward step and loss call of an SFT step and a
    log-prob pass, packed and dynamic: each warning is charged to the Python frame that made the call.
    Ours must be none; Megatron's are printed (its unfused THD RoPE without TE's fusion)."""
    import contextlib
    import json
    import os
    import warnings

    from mcore_packing.megatron import ProcessGroups, TokenMeanNLL, build_gpt_model, compute_logprobs, forward_backward
    from mcore_packing.planning import ModelShape, StepPlanConfig, plan_step

    from .sync_counter import inside_forward_steps

    shape = ModelShape(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                       vocab_size=500, normalization="RMSNorm", gated_mlp=True, linear_bias=False)  # fmt: skip
    device = torch.device("cuda")
    model, _ = build_gpt_model(shape, dtype=torch.bfloat16, device=device)
    pgs = ProcessGroups.from_megatron()
    g = torch.Generator().manual_seed(1)
    samples = [SequenceSample(torch.randint(0, 500, (n,), generator=g).tolist()) for n in (300, 17, 77, 512, 129, 5)]
    lengths = [len(s.tokens) for s in samples]
    caught = []

    @contextlib.contextmanager
    def sync_debug_mode():  # CUDA's own detector, its warnings kept
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
                caught.extend(seen)

    with inside_forward_steps(sync_debug_mode):
        for mode in ("packing", "dynamic"):
            config = StepPlanConfig(mode=mode, train_mb_tokens=1024)
            model.zero_grad_buffer()
            forward_backward(model, samples, plan_step(lengths, config), pgs, loss=TokenMeanNLL(), device=device)
            compute_logprobs(model, samples, plan_step(lengths, config, forward_only=True), pgs, device=device)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    counts = {"mcore_packing": [], "megatron": [], "other": []}
    for w in syncs:
        path = w.filename
        owner = "mcore_packing" if "/mcore_packing/" in path else "megatron" if "/megatron/" in path else "other"
        counts[owner].append(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}")
    summary = {owner: len(where) for owner, where in counts.items()}
    print(f"sync debug mode: {summary} (TE fused RoPE {'on' if compat.te_available() else 'off'})")
    results = os.environ.get("MCORE_PACKING_GPU_RESULTS")
    if results:
        with open(os.path.join(results, "sync_debug.json"), "w") as f:
            json.dump({"counts": summary, "where": counts, "te_available": compat.te_available()}, f, indent=1)
    assert counts["mcore_packing"] == [], counts["mcore_packing"]


def test_two_rank_nccl_steps_match_the_single_rank():
    """DP2 and CP2 over NCCL (every collective of the step on the GPU) give the single GPU's SFT and GRPO
    losses and log-probs (fp32, TF32 off), with our attention and, when installed, TE's."""
    from .distributed_harness import run_distributed
    from .layout_workers import compare_layouts

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for DP2 and CP2 over NCCL; this machine has {torch.cuda.device_count()}")
    for backend in ("local", "te"):
        if backend == "te" and not compat.te_available():
            print(f"te: {NO_TE}")
            continue
        out = compare_layouts(run_distributed, device="cuda", attention=backend)
        print(f"{backend}: {out['errors']}")
        assert out["results"]["dp2"]["logprobs_device"] == "cuda"
        for name, errors in out["errors"].items():
            assert max(errors.values()) <= 1e-5, (backend, name, errors)


def test_one_transfer_per_micro_batch_does_not_sync():
    """`thd.transfer.to_device_once` (pinned buffer, non-blocking copy) under the sync debug mode's "error"."""
    from mcore_packing.thd.transfer import to_device_once

    host = {"tokens": torch.arange(1000), "mask": torch.ones(1000, dtype=torch.bool), "weights": torch.rand(7)}
    torch.cuda.set_sync_debug_mode("error")
    try:
        moved = to_device_once(host, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, tensor in host.items():
        assert moved[name].is_cuda and torch.equal(moved[name].cpu(), tensor), name
