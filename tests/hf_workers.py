"""Worker functions for the Hugging Face conversion tests (they run inside real gloo ranks)."""

from __future__ import annotations

import torch

from .megatron_workers import init_megatron

# Negative controls that change the model's shape: each drops one part of a family (GPT-OSS: the window,
# the sinks, YaRN's scaling, the clamp) or flips the routing normalization.
_SHAPE_PATCHES = {
    "flip_topk_norm": lambda s: {"moe_router_topk_norm": not s.moe_router_topk_norm},
    "no_window": lambda s: {"window_size": None, "window_layers": ()},
    "no_sinks": lambda s: {"attention_sinks": False},
    "no_yarn": lambda s: {"yarn_factor": None},
    "no_clamp": lambda s: {"swiglu_limit": None},
}


def _build(folder, tp, pp, patch=None, ep=1, sp=False, cp=1, etp=None):
    import dataclasses

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import build_gpt_model, cpu_device_adapter, hf_weights
    from mcore_packing.planning import ParallelLayout
    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    init_megatron(tp=tp, pp=pp, ep=ep, cp=cp, etp=etp)
    shape = shape_from_hf_config(read_hf_config(folder))
    if patch in _SHAPE_PATCHES:
        shape = dataclasses.replace(shape, **_SHAPE_PATCHES[patch](shape))
    layout = ParallelLayout.for_world(dist.get_world_size(), tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sp, etp=etp)
    with cpu_device_adapter():
        model, _ = build_gpt_model(shape, layout, attention_backend="local")
    if patch == "swap_gate_up":  # negative control: [up; gate] instead of [gate; up]
        kind, names = hf_weights._PER_LAYER["mlp.linear_fc1.weight"]
        hf_weights._PER_LAYER["mlp.linear_fc1.weight"] = (kind, names[::-1])
    if patch == "gate_up_halves":  # negative control: GPT-OSS's gate/up read as halves, not interleaved
        hf_weights._read_expert = _halves(hf_weights._read_expert)
    import resource
    import time

    start = time.perf_counter()
    stats = hf_weights.load_hf_weights(model, shape, folder, tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
                                       ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep,
                                       etp_rank=ps.get_expert_tensor_parallel_rank(),
                                       etp_size=layout.expert_tp)  # fmt: skip
    stats["seconds"] = time.perf_counter() - start
    stats["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return model, shape, stats


def _halves(read_expert):
    def read(hf, kind, name, cut):
        if kind != "stacked_gate_up":
            return read_expert(hf, kind, name, cut)
        value = read_expert(hf, kind, name, cut)  # [gate; up] de-interleaved -> the same values re-cut as halves
        return torch.stack(value.chunk(2), dim=1).reshape(value.shape)

    return read


def variants_worker(rank, world_size, folder, sequences, patches):
    """Per patch in ``patches`` (negative controls), each sequence's logits, one forward each (TP=PP=1)."""
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import cpu_device_adapter

    out = {}
    for patch in patches:
        model, shape, _ = _build(folder, 1, 1, patch)
        with cpu_device_adapter(), torch.no_grad():
            out[patch] = [model.module(torch.tensor([s]), torch.arange(len(s))[None], None)[0][:, : shape.vocab_size]
                          for s in sequences]  # fmt: skip
        ps.destroy_model_parallel()
    return out


def logits_worker(rank, world_size, folder, sequences, tp=1, pp=1, patch=None, ep=1, sp=False, cp=1, etp=None,
                  bias_grads=False):  # fmt: skip
    """Full-vocabulary logits per sequence (one forward each, and one packed THD forward; PP=1, CP=1), and
    next-token log-probs of every sequence through Megatron's schedule from packed micro-batches;
    ``bias_grads``: also `_bias_grads`."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import ProcessGroups, compute_logprobs, cpu_device_adapter, to_packed_seq_params
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch

    model, shape, stats = _build(folder, tp, pp, patch, ep, sp, cp, etp)
    module = model.module
    out = {"stats": stats}

    def full_vocab(logits):  # [s, V/tp] on each TP rank -> [s, V]
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts, dim=-1)[:, : shape.vocab_size]

    with cpu_device_adapter(), torch.no_grad():
        if pp == 1 and cp == 1:
            if not sp:  # (sequence parallelism needs rows padded to a TP multiple: the packed forward below)
                out["alone"] = [
                    full_vocab(module(torch.tensor([s]), torch.arange(len(s))[None], None)[0]) for s in sequences
                ]
            rule = PaddingRule(tp_size=tp, sequence_parallel=sp)
            batch = build_packed_batch([SequenceSample(s) for s in sequences], rule)
            params = to_packed_seq_params(batch)
            packed = module(batch.tokens, batch.position_ids, None, packed_seq_params=params)[0]
            if sp:  # the output layer gathers the sequence-parallel shards: [t, 1, V/tp] -> [t, V/tp]
                packed = packed.reshape(-1, packed.shape[-1])
            packed = full_vocab(packed)
            starts = batch.cu_seqlens_padded.tolist()
            out["packed"] = [packed[a : a + len(s)] for a, s in zip(starts, sequences, strict=False)]
        lengths = [len(s) for s in sequences]
        layout = ParallelLayout.for_world(world_size, tp=tp, pp=pp, ep=ep, cp=cp, sequence_parallel=sp, etp=etp)
        config = StepPlanConfig(train_mb_tokens=64, layout=layout)
        plan = plan_step(lengths, config, forward_only=True)
        samples = [SequenceSample(s) for s in sequences]
        out["logprobs"] = compute_logprobs(model, samples, plan, ProcessGroups.from_megatron())
    if bias_grads:
        out["bias_grads"] = _bias_grads(model, samples, layout)
    if rank != 0:
        return {"stats": stats}
    return out


def _bias_grads(model, samples, layout):
    """Layer 0's expert fc2 biases' gradients (whole experts: every rank holds them) after one token-mean
    SFT step, with the library's repair of their ``sequence_parallel`` mark, and (``"unrepaired"``) with
    the mark Megatron sets put back (a negative control: the TP ranks' sum counted twice)."""
    from mcore_packing.megatron import ProcessGroups, cpu_device_adapter, forward_backward
    from mcore_packing.planning import StepPlanConfig, plan_step

    plan = plan_step([len(s.tokens) for s in samples], StepPlanConfig(train_mb_tokens=64, layout=layout))
    biases = {n: p for n, p in model.module.named_parameters()
              if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith("linear_fc2.bias")}  # fmt: skip
    out = {}
    for case in ("repaired", "unrepaired"):
        for p in biases.values():
            p.sequence_parallel = case == "unrepaired"
        model.zero_grad_buffer()
        with cpu_device_adapter():
            forward_backward(model, samples, plan, ProcessGroups.from_megatron())
        out[case] = {n: p.main_grad.detach().clone() for n, p in biases.items()}
    return out


def round_trip_worker(rank, world_size, folder, tp=1, pp=1, sft_step=False, sequences=None, etp=None, sp=False):
    """Import, optionally take one packed SFT step (AdamW), and return this rank's state dict and layout
    (and, when a step ran, the logits of ``sequences`` after it, PP=1 only)."""
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import ProcessGroups, cpu_device_adapter, forward_backward
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample

    model, shape, _ = _build(folder, tp, pp, etp=etp, sp=sp)
    out = {}
    if sft_step:
        samples = [SequenceSample(s) for s in sequences]
        plan = plan_step(
            [len(s) for s in sequences], StepPlanConfig(train_mb_tokens=32, layout=ParallelLayout(tp=tp, pp=pp))
        )
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        with cpu_device_adapter():
            model.zero_grad_buffer()
            out["loss"] = forward_backward(model, samples, plan, ProcessGroups.from_megatron()).loss
            for p in params:
                p.grad = p.main_grad.to(p.dtype)
            optimizer.step()
            if pp == 1 and tp == 1:
                with torch.no_grad():
                    out["logits"] = [
                        model.module(torch.tensor([s]), torch.arange(len(s))[None], None)[0][:, : shape.vocab_size]
                        for s in sequences
                    ]
    out.update(
        state={k: v for k, v in model.module.state_dict().items() if isinstance(v, torch.Tensor)},
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        layer_numbers=[layer.layer_number - 1 for layer in model.module.decoder.layers],
    )
    return out


def load_error_worker(rank, world_size, folder):
    """The error (its message) that importing ``folder`` raises, or None."""
    try:
        _build(folder, 1, 1)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    return None


_WORKERS = {"logits": "logits_worker", "round_trip": "round_trip_worker", "variants": "variants_worker",
            "load_error": "load_error_worker"}  # fmt: skip


def cases_worker(rank, world_size, cases):
    """Every case of ``cases`` in this one spawn, in order (each a dict: ``worker``, a key of `_WORKERS`, and
    that worker's keyword arguments); Megatron's parallel state is destroyed after each and the converter's
    tables restored (a negative control patches them). Returns per case ``{"ok": result}`` or ``{"error":
    traceback}``. Every rank runs the same cases, so the collectives of one case meet their peers."""
    import traceback

    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import hf_weights

    out = []
    for case in cases:
        kwargs = dict(case)
        worker = globals()[_WORKERS[kwargs.pop("worker")]]
        saved = dict(hf_weights._PER_LAYER), hf_weights._read_expert
        try:
            out.append({"ok": worker(rank, world_size, **kwargs)})
        except Exception:  # reported per case; the test that reads it fails with the traceback
            out.append({"error": traceback.format_exc()})
        finally:
            hf_weights._PER_LAYER.clear()
            hf_weights._PER_LAYER.update(saved[0])
            hf_weights._read_expert = saved[1]
            if ps.model_parallel_is_initialized():
                ps.destroy_model_parallel()
    return out
