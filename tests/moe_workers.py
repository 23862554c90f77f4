"""Workers for the Mixture-of-Experts equivalence grid (they run inside spawned gloo ranks).

Reference (`reference_worker`, one process): Megatron's stock GPTModel with its stock MoE layer (local
spec, 4 experts, top-2, SwiGLU experts) at TP=PP=EP=CP=1, ONE SEQUENCE PER FORWARD, Megatron's own router
losses off. The loss is computed here in plain torch from the routers' inputs (captured with forward hooks,
logits recomputed with ``F.linear`` on the router weight): the token-mean NLL of the global batch, plus
BALANCE x sum over MoE layers of the mean over sequences of E / (K T_s^2) sum_i c_si S_si, plus Z x sum
over layers of the token mean of logsumexp^2. It shares no code with mcore_packing.

Under test (`moe_step_worker`): the same weights sharded for (TP, PP, CP, EP, DP), the packed/dynamic
planner, builder, schedule driver and `router_loss.RouterLoss`, through Megatron's real schedules and DDP.
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.nn.functional as F

from .step_workers import NUM_LAYERS, build_gpt, build_stage, gather_results, wrap_in_ddp

NUM_EXPERTS = 4
TOPK = 2
BALANCE = 0.1
Z_LOSS = 0.01


def moe_model_config(*, tp=1, pp=1, cp=1, ep=1, sp=False, variable_seq_lengths=False, per_token_loss=False, vpp=1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {}
    if vpp > 1:  # the interleaved schedule's settings (as mcore_packing.megatron.model sets them)
        extra = dict(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    return TransformerConfig(
        **extra,
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=32,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        variable_seq_lengths=variable_seq_lengths,
        calculate_per_token_loss=per_token_loss,
    )


def _init(tp=1, pp=1, cp=1, ep=1, vpp=1):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from mcore_packing.megatron._patches.moe_without_te import define_missing_te_gemm

    define_missing_te_gemm()  # the name moe_utils reads without TransformerEngine (CPU stand-in)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )  # fmt: skip
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)


def reference_router_loss(router_inputs: list, lengths: list[int]) -> torch.Tensor:
    """``router_inputs[layer][seq]``: the [T_s, hidden] inputs and the router weight of each sequence."""
    total = torch.zeros(())
    num_tokens = sum(lengths)
    for per_sequence in router_inputs:
        balance = torch.zeros(())
        z = torch.zeros(())
        for hidden, weight in per_sequence:
            logits = F.linear(hidden.float(), weight.float())
            scores = torch.softmax(logits, dim=-1)
            top = torch.topk(scores, TOPK, dim=-1).indices
            counts = torch.zeros(NUM_EXPERTS).index_add(0, top.reshape(-1), torch.ones(top.numel()))
            n = logits.shape[0]
            balance = balance + NUM_EXPERTS / (TOPK * n * n) * (counts * scores.sum(0)).sum()
            z = z + torch.logsumexp(logits, dim=-1).square().sum()
        total = total + BALANCE * balance / len(lengths) + Z_LOSS * z / num_tokens
    return total


def reference_worker(rank, world_size, samples):
    """Full MoE model, one sequence per forward; loss, router loss, grads and the weights."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter

    _init()
    with cpu_device_adapter():
        torch.manual_seed(0)
        spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
        model = build_gpt(moe_model_config(), spec)
        state_dict = {k: v.clone() for k, v in model.state_dict().items() if v is not None and "_extra" not in k}
        captured: list[list] = [[] for _ in model.decoder.layers]
        def keep(i, module, args, out):
            captured[i].append((args[0].reshape(-1, args[0].shape[-1]), module.weight))

        for i, layer in enumerate(model.decoder.layers):
            layer.mlp.router.register_forward_hook(partial(keep, i))
        tokens = [torch.tensor(s["tokens"]) for s in samples]
        masks = [torch.tensor(s["loss_mask"], dtype=torch.float32) for s in samples]
        total_tokens = sum(m[1:].sum() for m in masks)
        nll = torch.zeros(())
        for t, m in zip(tokens, masks, strict=True):
            n = t.numel()
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
            logits = model(t[None], torch.arange(n)[None], causal)[0]
            nll = nll + (F.cross_entropy(logits[:-1], t[1:], reduction="none") * m[1:]).sum() / total_tokens
        router = reference_router_loss(captured, [t.numel() for t in tokens])
        (nll + router).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"loss": nll.item(), "router_loss": router.item(), "grads": grads, "state_dict": state_dict}


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def _global_name(name: str, layer_offset: int, expert_offset: int) -> str:
    name = name.removeprefix("module.")
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f"local_experts.{int(m.group(1)) + expert_offset}.", name)


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _tp_of(name: str):
    """(rank, size, group) of the tensor-parallel split a parameter has: expert TP for experts."""
    from megatron.core import parallel_state as ps

    if _is_expert(name):
        return (ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group())  # fmt: skip
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group())  # fmt: skip


def _shard(full: torch.Tensor, name: str, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    if _is_expert(name) and name.endswith("linear_fc1.weight"):  # [gate; up]: each half split over TP
        return torch.cat([half.chunk(tp_size, dim=0)[tp_rank] for half in full.chunk(2, dim=0)])
    return full.chunk(tp_size, dim=param.partition_dim)[tp_rank]


def _unshard(parts: list, name: str, param) -> torch.Tensor:
    if _is_expert(name) and name.endswith("linear_fc1.weight"):
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim=param.partition_dim)


def _offsets(pp: int, ep: int, layer_offset: int | None = None):
    from megatron.core import parallel_state as ps

    if layer_offset is None:
        layer_offset = ps.get_pipeline_model_parallel_rank() * (NUM_LAYERS // pp)
    expert_offset = ps.get_expert_model_parallel_rank() * (NUM_EXPERTS // ep)
    return layer_offset, expert_offset


def load_sharded(model, state_dict, offsets) -> None:
    for name, param in model.named_parameters():
        full = state_dict[_global_name(name, *offsets)]
        tp_rank, tp_size, _ = _tp_of(name)
        full = _shard(full, name, param, tp_rank, tp_size)
        assert full.shape == param.shape, (name, full.shape, param.shape)
        with torch.no_grad():
            param.copy_(full)


def collect_full_grads(model, offsets) -> dict:
    """This rank's grads, TP-gathered, keyed by global name (layers and experts)."""
    import torch.distributed as dist

    grads = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        grad = grad.detach().clone().float()
        _, tp_size, group = _tp_of(name)
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            parts = [torch.empty_like(grad) for _ in range(tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=group)
            grad = _unshard(parts, name, param)
        grads[_global_name(name, *offsets)] = grad
    return grads


def _whole_row_balance():
    """Negative control: the balance loss of each micro-batch's row as one sequence (Megatron 0.16's
    seq_aux_loss on a packed row)."""
    from mcore_packing.megatron.router_loss import RouterLoss

    original = RouterLoss.begin_micro_batch

    def whole_row(self, segments, lengths, **kwargs):
        return original(self, torch.where(segments >= 0, 0, -1), lengths.sum().reshape(1), **kwargs)

    RouterLoss.begin_micro_batch = whole_row
    return lambda: setattr(RouterLoss, "begin_micro_batch", original)


def _build(cfg, tp, pp, cp, ep, vpp, state_dict):
    """This rank's DDP-wrapped chunks (one without a virtual pipeline) with the reference's weights, and
    each chunk's (layer, expert) offsets."""
    from .step_workers import build_chunks, wrap_chunks_in_ddp

    vsl = cfg.get("mode") == "dynamic" and pp > 1
    config = moe_model_config(tp=tp, pp=pp, cp=cp, ep=ep, sp=tp > 1, variable_seq_lengths=vsl, vpp=vpp,
                              per_token_loss=cfg.get("per_token_loss", False))  # fmt: skip
    chunks = build_chunks(config, vpp) if vpp > 1 else [(build_stage(config), None)]
    offsets = [_offsets(pp, ep, layer_offset) for _, layer_offset in chunks]
    for (module, _), offset in zip(chunks, offsets, strict=True):
        load_sharded(module, state_dict, offset)
    modules = [module for module, _ in chunks]
    ddp = wrap_chunks_in_ddp(config, modules) if vpp > 1 else [wrap_in_ddp(config, modules[0])]
    return ddp, offsets, vsl


def _row_counts_per_shard():
    """Negative control for dynamic CP: each rank counts the expert choices of its own share of a row (the
    counts are summed over no group)."""
    from mcore_packing.megatron.router_loss import RouterLoss

    original = RouterLoss.begin_micro_batch

    def per_shard(self, segments, lengths, *, reduce_groups=None):
        return original(self, segments, lengths, reduce_groups=[])

    RouterLoss.begin_micro_batch = per_shard
    return lambda: setattr(RouterLoss, "begin_micro_batch", original)


_NEGATIVE = {"whole_row_balance": _whole_row_balance, "row_counts_per_shard": _row_counts_per_shard}


def moe_step_worker(rank, world_size, configs, samples, state_dict):
    """Run every config (tp, pp, cp, ep, vpp, dynamic_cp, mode, ...) on this world; rank 0 returns the results."""
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import ProcessGroups, cpu_device_adapter, forward_backward, nll_loss
    from mcore_packing.megatron.router_loss import RouterLoss, RouterLossConfig
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample

    seq_samples = [SequenceSample(s["tokens"], s["loss_mask"]) for s in samples]
    lengths = [len(s["tokens"]) for s in samples]
    results = []
    for cfg in configs:
        undo = _NEGATIVE[cfg["negative"]]() if cfg.get("negative") in _NEGATIVE else (lambda: None)
        tp, pp, cp, ep, vpp = (cfg.get(k, 1) for k in ("tp", "pp", "cp", "ep", "vpp"))
        _init(tp, pp, cp, ep, vpp)
        dp = world_size // (tp * pp * cp)
        with cpu_device_adapter():
            ddp, offsets, vsl = _build(cfg, tp, pp, cp, ep, vpp, state_dict)
            pgs = ProcessGroups.from_megatron()
            if cfg.get("dynamic_cp"):
                pgs = pgs.with_dynamic_cp()
            reduce_group = None if cfg.get("negative") == "counts_per_cp_shard" else pgs.collection.tp_cp
            losses_config = RouterLossConfig(balance_coeff=BALANCE, z_coeff=Z_LOSS)
            router_losses = [RouterLoss(chunk, losses_config, reduce_group=reduce_group, num_moe_layers=NUM_LAYERS)
                             for chunk in ddp]  # fmt: skip
            plan_config = StepPlanConfig(
                mode=cfg.get("mode", "packing"),
                train_mb_tokens=cfg.get("train_mb_tokens", 96),
                layout=ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=tp > 1, vpp=vpp),
                fixed_length=None if not vsl else False,
                dynamic_cp=cfg.get("dynamic_cp", False),
            )
            plan = plan_step(lengths, plan_config)
            model = ddp if vpp > 1 else ddp[0]
            result = forward_backward(model, seq_samples, plan, pgs, loss=nll_loss("token_mean"), device="cpu")
            metrics = [router_loss.metrics() for router_loss in router_losses]  # a sum over the chunks
            balance, z = (sum(m[key] for m in metrics) for key in ("moe_balance_loss", "moe_z_loss"))
            grads = {}
            for chunk, offset in zip(ddp, offsets, strict=True):
                grads.update(collect_full_grads(chunk, offset))
            for router_loss in router_losses:
                router_loss.remove()
        undo()
        merged, losses, _ = gather_results(world_size, grads, result.loss)
        results.append({
            "config": cfg,
            "loss": losses[0],
            "all_losses_equal": len(set(losses)) == 1,
            "router_loss": NUM_LAYERS * (BALANCE * balance + Z_LOSS * z),
            "grads": merged,
            "num_microbatches": result.num_microbatches,
            "cp_sizes": plan.cp_size_counts() if cfg.get("dynamic_cp") else None,
        })  # fmt: skip
        ps.destroy_model_parallel()
    return results if rank == 0 else None
