"""Code that runs inside spawned gloo ranks: a tiny real GPTModel on the packed THD path.

Everything here uses the real megatron-core (GPTModel, RoPE, its parallel_state); the only stand-in is
`cpu_device_adapter`, which redirects Megatron's hard-coded CUDA allocations to the CPU.
"""

from __future__ import annotations

import torch

VOCAB = 128


def init_megatron(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234, ep: int = 1, etp: int | None = None) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
    )  # fmt: skip
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


def build_tiny_gpt(spec, *, cp: int = 1, seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,  # grouped-query attention
        ffn_hidden_size=128,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        context_parallel_size=cp,
    )
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=1024,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def position_weights(batch, seed: int, vocab: int) -> torch.Tensor:
    """A fixed random weight per (real token, vocab entry), laid out at the batch's real positions.

    Defined per real token, so layouts with different padding (CP=1 vs CP=4) get the same functional.
    """
    real = torch.randn((batch.num_real_tokens, vocab), generator=torch.Generator().manual_seed(seed))
    out = torch.zeros((1, batch.total_tokens, vocab))
    start, taken = 0, 0
    for span, n in zip(batch.padded_lengths, batch.seq_lengths, strict=True):
        out[0, start : start + n] = real[taken : taken + n]
        start += span
        taken += n
    return out


def _grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_reference_worker(rank, world_size, cases, weights_seed=0):
    """World of 1. For each case (a list of token lists):

    - ``packed``: logits of every sequence from ONE packed THD forward (our attention), unpacked;
    - ``reference``: logits of every sequence from its own forward through Megatron's stock
      DotProductAttention (local spec, BSHD, causal mask) with the same weights;
    - ``no_boundaries``: logits when the same packed row is declared one single sequence (attention
      crosses sequence boundaries): the negative control;
    - ``grads``: parameter gradients of a fixed random functional of the packed logits (for CP checks).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter, get_packed_gpt_layer_spec, to_packed_seq_params
    from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, unpack

    init_megatron()
    out = []
    with cpu_device_adapter() as adapter:
        packed_model = build_tiny_gpt(get_packed_gpt_layer_spec("local"), seed=weights_seed)
        ref_model = build_tiny_gpt(get_gpt_layer_local_spec(), seed=weights_seed + 1)
        ref_model.load_state_dict(packed_model.state_dict())
        for case in cases:
            seqs = [torch.tensor(t, dtype=torch.long) for t in case["tokens"]]
            batch = build_packed_batch([SequenceSample(s) for s in seqs], PaddingRule(**case["rule"]))
            params = to_packed_seq_params(batch)
            packed_model.zero_grad(set_to_none=True)
            logits = packed_model(batch.tokens, batch.position_ids, None, packed_seq_params=params)
            weights = position_weights(batch, case["seed"], logits.shape[-1])
            (logits * weights * batch.loss_mask[..., None]).sum().backward()
            with torch.no_grad():
                per_seq = unpack(logits[0].detach(), batch)
                reference = []
                for s in seqs:
                    n = s.numel()
                    causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
                    reference.append(ref_model(s[None], torch.arange(n)[None], causal)[0])
                # Negative control: the very same token row declared as ONE sequence, so attention
                # crosses the sequence boundaries.
                one = build_packed_batch([SequenceSample(batch.tokens[0])], PaddingRule())
                crossed = packed_model(one.tokens, one.position_ids, None, packed_seq_params=to_packed_seq_params(one))
            grads = _grads(packed_model)
            # Fixed shapes: cu_seqlens padded with zero-length sequences must change nothing; the control
            # moves a boundary instead (the last sequence split in two), which must change the logits.
            fixed = {}
            for name, params in (("zero_length", to_packed_seq_params(batch, cu_entries=batch.num_sequences + 4)),
                                 ("split_tail", _split_last_sequence(batch))):  # fmt: skip
                if params is None:
                    continue
                packed_model.zero_grad(set_to_none=True)
                again = packed_model(batch.tokens, batch.position_ids, None, packed_seq_params=params)
                (again * weights * batch.loss_mask[..., None]).sum().backward()
                fixed[name] = {"logits": again[0].detach(), "grads": _grads(packed_model)}
            out.append(
                {
                    "packed": [per_seq[i, : s.numel()] for i, s in enumerate(seqs)],
                    "reference": reference,
                    "no_boundaries": unpack(crossed[0], batch),
                    "full_logits": logits[0].detach(),
                    "grads": grads,
                    "fixed_shape": fixed,
                    "total_tokens": batch.total_tokens,
                }
            )
        call_sites = sorted(adapter.call_sites) if adapter is not None else []
    return {"cases": out, "call_sites": call_sites}


def _split_last_sequence(batch):
    """Params whose last sequence (when it has 2+ real tokens) is declared as two: a boundary moved."""
    from dataclasses import replace

    from mcore_packing.megatron import to_packed_seq_params

    n, span = batch.seq_lengths[-1], batch.padded_lengths[-1]
    if n < 2:
        return None
    head = n // 2
    cu, cu_padded = batch.cu_seqlens.tolist(), batch.cu_seqlens_padded.tolist()
    split = replace(
        batch,
        cu_seqlens=torch.tensor([*cu[:-1], cu[-2] + head, cu[-1]], dtype=torch.int32),
        cu_seqlens_padded=torch.tensor([*cu_padded[:-1], cu_padded[-2] + head, cu_padded[-1]], dtype=torch.int32),
        seq_lengths=(*batch.seq_lengths[:-1], head, n - head),
        padded_lengths=(*batch.padded_lengths[:-1], head, span - head),
    )
    return to_packed_seq_params(split)


def cp_worker(rank, world_size, cases, split="zigzag", weights_seed=0, extra_cu_entries=0):
    """World of CP ranks. Each rank runs its share of every packed case; rank results are gathered.

    ``split="contiguous"`` feeds each rank a contiguous quarter/half of the row instead of its two
    load-balanced chunks: the negative control. ``extra_cu_entries``: that many zero-length sequences
    after the row's own in cu_seqlens (fixed shapes).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_packing.megatron import cpu_device_adapter, get_packed_gpt_layer_spec, to_packed_seq_params
    from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, gather_from_cp, slice_for_cp

    cp = world_size
    init_megatron(cp=cp)
    group = parallel_state.get_context_parallel_group()
    results = []
    with cpu_device_adapter():
        model = build_tiny_gpt(get_packed_gpt_layer_spec("local"), cp=cp, seed=weights_seed)
        for case in cases:
            seqs = [torch.tensor(t, dtype=torch.long) for t in case["tokens"]]
            rule = PaddingRule(**{**case["rule"], "cp_size": cp})
            batch = build_packed_batch([SequenceSample(s) for s in seqs], rule)
            if split == "zigzag":
                local = slice_for_cp(batch, cp, rank)
            else:
                per_rank = batch.total_tokens // cp
                sl = slice(rank * per_rank, (rank + 1) * per_rank)
                from dataclasses import replace

                local = replace(
                    batch,
                    tokens=batch.tokens[:, sl],
                    labels=batch.labels[:, sl],
                    loss_mask=batch.loss_mask[:, sl],
                    position_ids=batch.position_ids[:, sl],
                    cp_size=cp,
                    cp_rank=rank,
                )
            entries = batch.num_sequences + 1 + extra_cu_entries if extra_cu_entries else None  # zero-length seqs
            params = to_packed_seq_params(local, cp_group=group, cu_entries=entries)
            model.zero_grad(set_to_none=True)
            logits = model(local.tokens, local.position_ids, None, packed_seq_params=params)
            full = gather_from_cp(logits[0], local, group)
            # The same functional as the reference, on this rank's tokens only; grads summed over CP.
            weights = position_weights(batch, case["seed"], logits.shape[-1])
            index = _local_index(batch, local, cp, rank, split)
            (logits * weights[:, index] * local.loss_mask[..., None]).sum().backward()
            grads = _grads(model)
            for g in grads.values():
                dist.all_reduce(g, group=group)
            results.append(
                {
                    "full_logits": full.detach(),
                    "grads": grads,
                    "padded_lengths": batch.padded_lengths,
                    "real_lengths": batch.seq_lengths,
                }
            )
    return results if rank == 0 else None


def _local_index(batch, local, cp, rank, split):
    from mcore_packing.thd import thd_partition_indices

    if split == "zigzag":
        return thd_partition_indices(batch.cu_seqlens_padded, batch.total_tokens, cp, rank)
    per_rank = batch.total_tokens // cp
    return torch.arange(rank * per_rank, (rank + 1) * per_rank)


def tiny_attention_config(cp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        context_parallel_size=cp,
        attention_dropout=0.0,
    )


def cp_roundtrip_worker(rank, world_size, cases):
    """World of CP ranks, no model: THD and BSHD split/gather round trips, and BSHD CP attention vs CP=1."""
    import types

    import torch.distributed as dist
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_packing.megatron.attention import PackedCoreAttention
    from mcore_packing.thd import (
        PaddingRule,
        SequenceSample,
        build_packed_batch,
        gather_bshd_from_cp,
        gather_from_cp,
        slice_bshd_for_cp,
        slice_for_cp,
        unpack,
    )

    cp, group = world_size, dist.group.WORLD
    report = {"thd_roundtrip": [], "bshd_roundtrip": None}
    for case in cases:
        seqs = [torch.tensor(t) for t in case]
        batch = build_packed_batch([SequenceSample(s) for s in seqs], PaddingRule(cp_size=cp))
        local = slice_for_cp(batch, cp, rank)
        gathered = gather_from_cp(local.tokens[0].float(), local, group)
        per_sample = unpack(gathered, batch)
        report["thd_roundtrip"].append(
            all(per_sample[i, : s.numel()].long().tolist() == s.tolist() for i, s in enumerate(seqs))
        )
    x = torch.arange(3 * 8 * cp).reshape(3, 8 * cp)
    report["bshd_roundtrip"] = torch.equal(gather_bshd_from_cp(slice_bshd_for_cp(x, cp, rank), group), x)

    # BSHD attention with CP vs the same module without CP, forward and input gradients.
    g = torch.Generator().manual_seed(7)
    s, b, h, d = 4 * cp, 2, 4, 8
    q, k, v = (torch.randn(s, b, h, d, generator=g, requires_grad=True) for _ in range(3))
    full = PackedCoreAttention(tiny_attention_config(), 1, AttnMaskType.causal, pg_collection=None)
    ref = full(q, k, v, None)
    ref_grads = torch.autograd.grad((ref * torch.arange(ref.numel()).reshape(ref.shape).sin()).sum(), (q, k, v))
    attn = PackedCoreAttention(
        tiny_attention_config(cp), 1, AttnMaskType.causal, pg_collection=types.SimpleNamespace(cp=group)
    )
    ql, kl, vl = (slice_bshd_for_cp(t.detach(), cp, rank, seq_dim=0).requires_grad_() for t in (q, k, v))
    out_local = attn(ql, kl, vl, None)
    out = gather_bshd_from_cp(out_local, group, seq_dim=0)
    weight = torch.arange(ref.numel()).reshape(ref.shape).sin()
    local_weight = slice_bshd_for_cp(weight, cp, rank, seq_dim=0)
    grads = torch.autograd.grad((out_local * local_weight).sum(), (ql, kl, vl))
    full_grads = [gather_bshd_from_cp(gr, group, seq_dim=0) for gr in grads]
    report["bshd_attention_err"] = float((out - ref).abs().max())
    report["bshd_grad_err"] = max(float((a - r).abs().max()) for a, r in zip(full_grads, ref_grads, strict=True))
    return report


def gpu_check_helper_on_cpu_worker(rank, world_size):
    """The GPU test's packed-vs-per-sequence helper (tests/test_gpu.py) on the CPU in fp32, so its own
    logic is verified where CI runs; on a GPU only the device changes."""
    from mcore_packing.megatron import cpu_device_adapter

    from .test_gpu import packed_vs_per_sequence

    init_megatron()
    with cpu_device_adapter():
        return packed_vs_per_sequence(torch.device("cpu"), torch.float32, "local")
