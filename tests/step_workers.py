"""Workers for the step-equivalence tests (they run inside spawned gloo ranks).

Reference (`reference_worker`, one process): Megatron's stock GPTModel at TP=PP=CP=1 (local spec,
DotProductAttention, BSHD), ONE SEQUENCE PER FORWARD, loss computed with plain torch cross entropy and
normalized over the whole global batch. It shares no code with mcore_packing.

Under test (`step_worker`): the same weights, sharded for (TP, PP, CP, DP), the packed/dynamic planner,
batch builder, attention, loss and driver, through Megatron's real schedules and DDP.
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.nn.functional as F

VOCAB = 96
NUM_LAYERS = 4


def model_config(*, tp=1, pp=1, cp=1, sp=False, variable_seq_lengths=False, per_token_loss=False, vpp=1,
                 batched_p2p=False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = {"moe_token_dispatcher_type": "alltoall"} if variable_seq_lengths else {}
    if vpp > 1:  # Megatron-LM's settings for the interleaved schedule (mcore_packing.megatron.model sets them too)
        extra.update(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=not batched_p2p,
                     batch_p2p_comm=batched_p2p)  # fmt: skip
    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
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
        **extra,
    )


def build_gpt(config, spec, *, pre_process=True, post_process=True, **extra):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        **extra,
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=512,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        pre_process=pre_process,
        post_process=post_process,
    )


def build_stage(config):
    """This pipeline stage's GPTModel with the packed local spec, built from seed 0 (the weights are then
    loaded from the reference)."""
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import get_packed_gpt_block_spec

    torch.manual_seed(0)
    return build_gpt(config, get_packed_gpt_block_spec(config, "local"), pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())  # fmt: skip


def build_chunks(config, vpp: int) -> list[tuple]:
    """This stage's ``vpp`` model chunks of Megatron's virtual pipeline, each with the global index of
    its first layer: ``[(module, layer_offset)]`` (built from seed 0; the weights are then loaded)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from mcore_packing.megatron import get_packed_gpt_block_spec

    torch.manual_seed(0)
    chunks = []
    for v in range(vpp):
        spec = get_packed_gpt_block_spec(config, "local", vp_stage=v)
        first = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
        last = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        module = build_gpt(config, spec, pre_process=first, post_process=last, vp_stage=v)
        chunks.append((module, get_transformer_layer_offset(config, vp_stage=v)))
    return chunks


def wrap_chunks_in_ddp(config, modules) -> list:
    """Megatron DDP around every chunk, Megatron's finalize, one no_sync per chunk (as Megatron's trainer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    chunks = [DistributedDataParallel(config, ddp_config, m, disable_bucketing=i > 0) for i, m in enumerate(modules)]
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [chunk.no_sync for chunk in chunks]
    for chunk in chunks:
        chunk.zero_grad_buffer()
    return chunks


def gather_results(world_size: int, grads: dict, loss: float, **extra) -> tuple[dict, list[float], list[dict]]:
    """Every rank's grads merged (each rank reports its own parameters under global names), every rank's
    loss, and every rank's whole record (with ``extra``)."""
    import torch.distributed as dist

    gathered = [None] * world_size
    dist.all_gather_object(gathered, {"grads": grads, "loss": loss, **extra})
    merged = {}
    for item in gathered:
        merged.update(item["grads"])
    return merged, [item["loss"] for item in gathered], gathered


def wrap_in_ddp(config, module):
    """Megatron DDP around ``module`` with Megatron's finalize (the schedule's gradient reduction), zeroed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False), module
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    ddp.zero_grad_buffer()
    return ddp


def _attention_cost_model():
    from mcore_packing.planning import CostModel, ModelShape

    return CostModel.from_shape(
        ModelShape(
            num_layers=NUM_LAYERS,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=128,
            vocab_size=VOCAB,
            gated_mlp=False,
        )
    )


def _init(tp=1, pp=1, cp=1, vpp=1):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
    )
    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)


def sequence_logprobs(model, token_rows, temperature: float = 1.0, entropies: list | None = None) -> list:
    """Next-token log-probs of each sequence, one causal forward per sequence (the reference path), of
    the logits divided by ``temperature``; ``entropies`` (a list) gets each position's full-vocabulary
    entropy -sum p log p, the whole [n, V] softmax at once."""
    out = []
    for tokens in token_rows:
        t = torch.as_tensor(tokens)
        n = t.numel()
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        logits = model(t[None], torch.arange(n)[None], causal)[0] / temperature
        out.append(-F.cross_entropy(logits[:-1], t[1:], reduction="none"))
        if entropies is not None:
            log_p = torch.log_softmax(logits[:-1].double(), dim=-1)
            entropies.append(-(log_p.exp() * log_p).sum(-1).float())
    return out


def reference_worker(rank, world_size, samples, normalizations=("token_mean", "sequence_mean")):
    """Full model; loss per normalization over unpacked sequences; grads, loss and log-probs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter

    _init()
    out = {}
    with cpu_device_adapter():
        torch.manual_seed(0)
        model = build_gpt(model_config(), get_gpt_layer_local_spec())
        out["state_dict"] = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
        tokens = [torch.tensor(s["tokens"]) for s in samples]
        masks = [torch.tensor(s["loss_mask"], dtype=torch.float32) for s in samples]
        valid = [m[1:].sum() for m in masks]
        total_tokens = sum(valid)
        total_sequences = sum(int(v > 0) for v in valid)
        logprobs = []
        for norm in normalizations:
            model.zero_grad(set_to_none=True)
            loss = torch.zeros(())
            for logp, m, v in zip(sequence_logprobs(model, tokens), masks, valid, strict=True):
                nll = -logp
                if norm == "token_mean":
                    loss = loss + (nll * m[1:]).sum() / total_tokens
                elif v > 0:
                    loss = loss + (nll * m[1:]).sum() / v / total_sequences
                if norm == normalizations[0]:
                    logprobs.append((-nll).detach())
            loss.backward()
            out[norm] = {
                "loss": float(loss),
                "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
            }
        out["logprobs"] = logprobs
    return out


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")


def _global_name(name: str, layer_offset: int) -> str:
    name = name.removeprefix("module.")
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)


def load_sharded(model, state_dict, tp_rank: int, tp_size: int, layer_offset: int) -> None:
    """Copy the full reference weights into this rank's TP shard / PP stage."""
    for name, param in model.named_parameters():
        full = state_dict[_global_name(name, layer_offset)]
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            full = full.chunk(tp_size, dim=param.partition_dim)[tp_rank]
        assert full.shape == param.shape, (name, full.shape, param.shape)
        with torch.no_grad():
            param.copy_(full)


def collect_full_grads(model, layer_offset: int) -> dict:
    """Full (TP-gathered) grads of this stage, keyed by global name; the same on every TP rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = ps.get_tensor_model_parallel_world_size()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.main_grad if getattr(param, "main_grad", None) is not None else param.grad
        grad = grad.detach().clone().float()
        if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
            parts = [torch.empty_like(grad) for _ in range(tp_size)]
            dist.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = torch.cat(parts, dim=param.partition_dim)
        grads[_global_name(name, layer_offset)] = grad
    return grads


_PATCHED: list = []  # (object, attribute, original) of the negative controls that patch a class or module


def _patch(obj, name: str, value) -> None:
    _PATCHED.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


def _apply_negative_control(kind: str | None):
    """Break one thing on purpose; the equivalence check must then fail. Undoes the previous config's
    class and module patches first (the reloaded modules undo themselves)."""
    import mcore_packing.megatron.schedule as schedule
    from mcore_packing.thd import loss_weights as loss_module

    while _PATCHED:
        obj, name, original = _PATCHED.pop()
        setattr(obj, name, original)
    if kind in (None, "batched_p2p"):  # batched_p2p: set in model_config
        return
    if kind == "no_global_normalization":
        # Normalize by this rank's own token count instead of the all-reduced global count.
        class LocalTotals(loss_module.StepTotals):
            @classmethod
            def all_reduce(cls, tokens, sequences, groups, group):
                return loss_module.StepTotals.all_reduce.__func__(cls, tokens, sequences, groups, None)

        schedule.StepTotals = LocalTotals
    elif kind == "no_cp_factor":
        original = schedule.megatron_loss_output

        def without_cp(weighted_sum, **kwargs):
            from megatron.core import parallel_state as ps

            return original(weighted_sum / ps.get_context_parallel_world_size(), **kwargs)

        schedule.megatron_loss_output = without_cp
    elif kind == "shared_prefix_unrotated":  # a response's queries see the prompt's keys at the wrong distances
        from mcore_packing.megatron.shared_prefix import SharedPrefixAttention

        _patch(SharedPrefixAttention, "rotate_keys", lambda self, keys, shift, config, cp_group=None: keys)
    elif kind == "shared_prefix_crossed":  # a later response attends to the one before it instead of the prompt
        from mcore_packing.megatron.shared_prefix import SharedPrefixAttention

        real_context = SharedPrefixAttention.context

        def previous_member(self, segment):
            context = real_context(self, segment)
            if context >= 0 and segment - 1 != context:
                return segment - 1
            return context

        _patch(SharedPrefixAttention, "context", previous_member)
    elif kind == "rope_rank_reversed":  # dynamic CP: RoPE places rank p's chunks as rank k-1-p's
        import mcore_packing.megatron.dynamic_cp as dynamic

        dynamic.rope_cp_group = partial(_reversed_rope, dynamic.rope_cp_group)
    elif kind == "gather_over_own_rank":  # dynamic CP: each row split over its sub-group, but the
        import mcore_packing.megatron.dynamic_cp as dynamic  # attention gathers keys/values over this rank only

        _own_group(0)  # every rank creates the singleton groups now, in one order
        dynamic.prepare_micro_batch = partial(_own_rank_attention, dynamic.prepare_micro_batch)
    elif kind == "bshd_rope_rank_reversed":  # dynamic CP, BSHD rows: Megatron slices the rotary table as
        from megatron.core.models.common.embeddings import rotary_pos_embedding as rotary  # the mirrored rank

        real = rotary.get_pos_emb_on_this_cp_rank
        _patch(rotary, "get_pos_emb_on_this_cp_rank", lambda emb, dim, group: real(emb, dim, _ReversedRank(group)))
    elif kind == "bshd_gather_over_own_rank":  # dynamic CP, BSHD rows split over the sub-group (RoPE right),
        import torch.distributed as dist  # attention over this rank's part alone

        from mcore_packing.megatron.attention import PackedCoreAttention

        _own_group(0)  # every rank creates the singleton groups now, in one order
        real_group = PackedCoreAttention._micro_batch_group

        def own_group(self, params):
            group = real_group(self, params)
            return _own_group(dist.get_rank()) if group is not None and group.size() > 1 else group

        _patch(PackedCoreAttention, "_micro_batch_group", own_group)
    elif kind == "contiguous_cp_split":
        # CP rank r keeps the r-th contiguous slice of the row instead of chunks r and 2*cp-1-r.
        import mcore_packing.megatron.prepare as prepare

        def contiguous_index(cu, total, cp_size, cp_rank):
            per = int(total) // cp_size
            return torch.arange(cp_rank * per, (cp_rank + 1) * per)

        prepare.thd_partition_indices = contiguous_index
    else:
        raise ValueError(kind)


def _record_cu_lengths(prepare) -> tuple[list[int], list[tuple]]:
    """Record the cu_seqlens length of every ``PackedSeqParams`` the builder makes (fixed-shape checks),
    and its TransformerEngine CP fields as ``(local_cp_size, cp_group's size or None)``."""
    lengths, cp_fields, build = [], [], prepare.host_packed_seq_params

    def recording(*args, **kwargs):
        params, host = build(*args, **kwargs)
        lengths.append(params.cu_seqlens_q.numel())
        group = getattr(params, "cp_group", None)
        cp_fields.append((getattr(params, "local_cp_size", None), None if group is None else group.size()))
        return params, host

    prepare.host_packed_seq_params = recording
    return lengths, cp_fields


def _record_bshd_cp_fields(dynamic, cp_fields: list) -> None:
    """Also record the CP fields of the params dynamic CP gives its BSHD rows (`bshd_cp_params`)."""
    build = dynamic.bshd_cp_params

    def recording(group):
        params = build(group)
        cp_fields.append((params.local_cp_size, None if params.cp_group is None else params.cp_group.size()))
        return params

    dynamic.bshd_cp_params = recording


def step_worker(rank, world_size, configs, samples, state_dict, logprob_samples=None):
    """Run every config (dicts with tp, pp, cp, mode, ...) on this world; rank 0 returns the results.
    ``temperature`` in a config scores at that sampling temperature; ``logprobs`` computes the log-probs
    of ``logprob_samples`` (default: ``samples``)."""
    import importlib

    from megatron.core import parallel_state as ps

    import mcore_packing.megatron.dynamic_cp as dynamic
    import mcore_packing.megatron.prepare as prepare
    import mcore_packing.megatron.schedule as schedule
    from mcore_packing.megatron import (
        PerGroup,
        ProcessGroups,
        chunk_logprobs,
        compute_logprobs,
        cpu_device_adapter,
        forward_backward,
        logits_temperature,
        nll_loss,
        policy_step_loss,
    )
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample

    seq_samples = [SequenceSample(s["tokens"], s["loss_mask"]) for s in samples]
    lengths = [len(s["tokens"]) for s in samples]
    results = []
    for cfg in configs:
        importlib.reload(prepare)  # undo any negative-control patch of the previous config
        importlib.reload(schedule)
        importlib.reload(dynamic)
        _apply_negative_control(cfg.get("negative"))
        cu_lengths, cp_fields = _record_cu_lengths(prepare)
        _record_bshd_cp_fields(dynamic, cp_fields)
        tp, pp, cp, vpp = cfg.get("tp", 1), cfg.get("pp", 1), cfg.get("cp", 1), cfg.get("vpp", 1)
        _init(tp, pp, cp, vpp)
        dp = world_size // (tp * pp * cp)
        sp = cfg.get("sp", False)
        vsl = cfg.get("variable_seq_lengths", False)
        with cpu_device_adapter() as adapter:
            config = model_config(tp=tp, pp=pp, cp=cp, sp=sp, variable_seq_lengths=vsl, vpp=vpp,
                                  per_token_loss=cfg.get("per_token_loss", False),
                                  batched_p2p=cfg.get("negative") == "batched_p2p")  # fmt: skip
            chunks = build_chunks(config, vpp) if vpp > 1 else [(build_stage(config), None)]
            if chunks[0][1] is None:
                chunks = [(chunks[0][0], ps.get_pipeline_model_parallel_rank() * (NUM_LAYERS // pp))]
            for module, layer_offset in chunks:
                load_sharded(module, state_dict, ps.get_tensor_model_parallel_rank(), tp, layer_offset)
            if vpp > 1:
                ddp = wrap_chunks_in_ddp(config, [module for module, _ in chunks])
            else:
                ddp = wrap_in_ddp(config, chunks[0][0])
            if cfg.get("logprob_chunk_size"):  # the output layer and the loss a chunk of tokens at a time
                chunk_logprobs(ddp, cfg["logprob_chunk_size"])
            plan_config = StepPlanConfig(
                mode=cfg.get("mode", "packing"),
                train_mb_tokens=cfg.get("train_mb_tokens", 96),
                layout=ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp, sequence_parallel=sp, vpp=vpp),
                fixed_length=None if not vsl else False,
                fixed_shape=cfg.get("fixed_shape", False),
                microbatch_order=cfg.get("microbatch_order", "packer"),
                balance=cfg.get("balance", "cost"),
                cost_model=_attention_cost_model() if cfg.get("attention_cost") else None,
                dynamic_cp=cfg.get("dynamic_cp", False),
            )
            pgs = ProcessGroups.from_megatron()
            if cfg.get("dynamic_cp"):
                pgs = pgs.with_dynamic_cp()
            from mcore_packing.losses import dpo_pair_loss

            temperature = logits_temperature(ddp, cfg.get("temperature", 1.0))
            if cfg.get("pg"):
                loss = _pg_loss(cfg, samples)
                per_prompt = loss.normalization == "group_mean"
                plan = plan_step(lengths, plan_config, groups=[s["group"] for s in samples] if per_prompt else None,
                                 shared_prefix=_shared_prefix(samples) if cfg.get("shared_prefix") else None)
                step_loss = policy_step_loss(loss)
                if cfg.get("negative_pg") == "per_microbatch_normalization":
                    step_loss = _per_microbatch_loss(loss, sum(len(r) for r in plan.micro_batches))
                if cfg.get("negative_pg") == "mask_width":
                    step_loss = _mask_width_loss(loss)
                with temperature:
                    result = forward_backward(ddp, seq_samples, plan, pgs, device="cpu", loss=step_loss)
                from mcore_packing.rl.metrics import sum_over_ranks

                entropy_sum, tokens = sum_over_ranks([loss.metrics["entropy"], loss.metrics["tokens"]])
                pg_entropy = entropy_sum / tokens
            elif cfg.get("dpo"):
                group_ids = [s["group"] for s in samples]
                if cfg.get("wrong_pairs"):  # negative control: pair each rejected with the next chosen
                    group_ids = [((i + 1) // 2) % (len(samples) // 2) for i in range(len(samples))]
                ref_logps = {i: s["ref_logp"] for i, s in enumerate(samples)}
                plan = plan_step(lengths, plan_config, groups=group_ids)
                dpo = PerGroup(partial(dpo_pair_loss, reference_logps=ref_logps, beta=DPO_BETA))
                result = forward_backward(ddp, seq_samples, plan, pgs, device="cpu", loss=dpo)
            else:
                plan = plan_step(lengths, plan_config)
                nll = nll_loss(cfg.get("normalization", "token_mean"))
                result = forward_backward(ddp, seq_samples, plan, pgs, loss=nll, device="cpu")
            grads = {}
            for chunk, (_, layer_offset) in zip(ddp if vpp > 1 else [ddp], chunks, strict=True):
                grads.update(collect_full_grads(chunk, layer_offset))
            logprobs = None
            if cfg.get("logprobs"):
                scored = seq_samples
                if logprob_samples is not None:
                    scored = [SequenceSample(s["tokens"], s["loss_mask"]) for s in logprob_samples]
                logprob_plan = plan_step([len(s.tokens) for s in scored], plan_config, forward_only=True)
                with logits_temperature(ddp, cfg.get("temperature", 1.0)):
                    logprobs = compute_logprobs(ddp, scored, logprob_plan, pgs, device="cpu")
        # Stage grads from (dp, cp, tp) rank 0 of every stage, merged on global rank 0.
        mine = grads if (ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0) else {}
        if ps.get_tensor_model_parallel_rank() != 0:
            mine = {}
        sites = sorted(adapter.call_sites) if adapter is not None else []
        stage_layers = _stage_layers(world_size, chunks)
        merged, losses, gathered = gather_results(world_size, mine, result.loss, call_sites=sites)
        results.append(
            {
                "config": cfg,
                "loss": losses[0],
                "all_losses_equal": len(set(losses)) == 1,
                "grads": merged,
                "num_microbatches": result.num_microbatches,
                "stage_layers": stage_layers,
                "logprobs": logprobs,
                "call_sites": sorted({tuple(site) for item in gathered for site in item["call_sites"]}),
                # rank 0's cu_seqlens lengths and CP fields, every micro-batch
                "cu_lengths": sorted(set(cu_lengths)),
                "cp_fields": sorted(set(cp_fields), key=str),
                "cp_sizes": plan.cp_size_counts() if cfg.get("dynamic_cp") else None,
                "entropy": pg_entropy if cfg.get("pg") else None,
                "real_tokens": result.real_tokens,
                "shared_report": getattr(plan, "shared_report", None),
            }
        )
        ps.destroy_model_parallel()
    return results if rank == 0 else None


def _stage_layers(world_size: int, chunks) -> dict:
    """Which global layers, and whether the embedding / the head, every pipeline rank's chunks hold:
    ``{pp_rank: [(first_layer, num_layers, has_embedding, has_head), ...]}`` (from rank 0 of each stage)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = [(offset, len(m.decoder.layers), m.pre_process, m.post_process) for m, offset in chunks]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (ps.get_pipeline_model_parallel_rank(), mine))
    return dict(gathered)


def plan_mismatch_worker(rank, world_size):
    """Rank 1 plans a different global batch; both ranks must raise, not hang."""
    import torch.distributed as dist

    from mcore_packing.megatron import verify_plan_across_ranks
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step

    lengths = [10, 20, 30, 40] + ([5] if rank == 1 else [])
    plan = plan_step(lengths, StepPlanConfig(train_mb_tokens=64, layout=ParallelLayout(dp=world_size)))
    try:
        verify_plan_across_ranks(plan, dist.group.WORLD)
    except ValueError as exc:
        message = str(exc)
    else:
        message = None
    same = plan_step([10, 20, 30, 40], StepPlanConfig(train_mb_tokens=64, layout=ParallelLayout(dp=world_size)))
    verify_plan_across_ranks(same, dist.group.WORLD)  # agreeing ranks pass
    # Same lengths, different group ids on rank 1 (e.g. a loader that paired samples differently).
    groups = [0, 0, 1, 1] if rank == 0 else [0, 1, 0, 1]
    grouped = plan_step(
        [10, 20, 30, 40], StepPlanConfig(train_mb_tokens=128, layout=ParallelLayout(dp=world_size)), groups=groups
    )
    try:
        verify_plan_across_ranks(grouped, dist.group.WORLD)
    except ValueError as exc:
        group_message = str(exc)
    else:
        group_message = None
    return message, group_message


def _shared_prefix(samples):
    """Each rollout's group and prompt length (its loss mask's leading zeros), for a shared-prefix plan."""
    from mcore_packing.planning import SharedPrefix

    return SharedPrefix(group_ids=[s["group"] for s in samples],
                        prompt_lengths=[s["loss_mask"].index(1.0) for s in samples])  # fmt: skip


def _pg_loss(cfg, samples):
    from mcore_packing.losses import ClippedPGConfig, ClippedPGLoss

    return ClippedPGLoss(
        ClippedPGConfig(**cfg["pg"]),
        advantages=[s["advantage"] for s in samples],
        old_logprobs=[s["old_logp"] for s in samples],
        reference_logprobs=[s["ref_logp_tokens"] for s in samples],
        generation_logprobs=[s["gen_logp"] for s in samples],
    )


def _per_microbatch_loss(fn, num_microbatches: int):
    """Negative control: each micro-batch divided by its own token count, then micro-batches averaged
    (instead of one global token count)."""
    from mcore_packing.megatron import PerSample
    from mcore_packing.megatron.prepare import per_sample_logprobs

    class PerMicroBatch(PerSample):
        def micro_batch_sum(self, prep, output, process_groups, totals):
            total, tokens = output.new_zeros((), dtype=torch.float32), 0.0
            for sample_id, logprobs, mask in per_sample_logprobs(prep, output, process_groups):
                if mask.sum() > 0:
                    total = total + self.fn(sample_id, logprobs, mask)
                    tokens += float(mask.sum())
            return total / (max(tokens, 1.0) * process_groups.cp_size * num_microbatches)

    return PerMicroBatch(fn)


def _mask_width_loss(fn):
    """Negative control (verl's seq-mean-token-sum-norm without a constant): each sample's token sum divided
    by its micro-batch's width (the longest sample in it) instead of the constant, so the loss changes
    with how the batch was packed."""
    from mcore_packing.megatron import PerSample
    from mcore_packing.megatron.prepare import per_sample_logprobs

    class PerWidth(PerSample):
        def micro_batch_sum(self, prep, output, process_groups, totals):
            rows = per_sample_logprobs(prep, output, process_groups)
            width = max(len(lp) for _, lp, _ in rows)
            total = output.new_zeros((), dtype=torch.float32)
            for sample_id, logprobs, mask in rows:
                total = total + fn.token_sum(sample_id, logprobs, mask.float()) / width
            return total / (totals.num_sequences * process_groups.cp_size)

    return PerWidth(fn, normalization="sequence_mean")


def pg_reference_loss(logps, samples, *, ratio_clip_min, ratio_clip_max, ratio_clip_c=None,
                      reference_policy_kl_penalty=0.0, kl_estimator="k3", token_level_loss=None,
                      use_importance_sampling_correction=False, loss_agg_mode=None, loss_agg_norm_constant=None,
                      policy_loss_mode="vanilla", sequence_level_importance_ratios=False,
                      truncated_importance_sampling_ratio=None, truncated_importance_sampling_ratio_min=None,
                      truncated_importance_sampling_type="tis", entropy_coeff=0.0, calculate_entropy=False,
                      entropy_chunk_size=None, entropies=None):  # fmt: skip
    """The policy-gradient loss over the whole batch in plain torch, written independently of
    mcore_packing: ``logps[i]`` are sample i's next-token log-probs (a tensor), the rest are the samples'
    fields (``group`` is the prompt of prompt-mean); ``entropies[i]``: sample i's per-position entropy
    (needed with ``entropy_coeff``)."""
    if sequence_level_importance_ratios:
        policy_loss_mode = "gspo"
    mode = loss_agg_mode or ("seq-mean-token-mean" if token_level_loss is False else "token-mean")
    sums, counts, groups = [], [], []
    for i, (lp, s) in enumerate(zip(logps, samples, strict=True)):
        mask = torch.tensor(s["loss_mask"][1:])
        old, ref, gen = (torch.tensor(s[k]) for k in ("old_logp", "ref_logp_tokens", "gen_logp"))
        a = torch.tensor(float(s["advantage"]))
        n = mask.sum()
        if policy_loss_mode == "gspo":  # one ratio per response: exp of the mean log ratio
            ratio = ((lp - old) * mask).sum().div(n).exp() * torch.ones_like(lp)
        else:
            ratio = (lp - old).exp()
        bounded = ratio.clamp(1 - ratio_clip_min, 1 + ratio_clip_max)
        if policy_loss_mode == "cispo":  # REINFORCE weighted by the clipped, stopped ratio
            token = -a * bounded.detach() * (lp - lp.detach()).exp()
        else:
            unclipped, clipped = -a * ratio, -a * bounded
            token = torch.where(unclipped > clipped, unclipped, clipped)
            if ratio_clip_c is not None and float(a) < 0:
                token = torch.where(token < -a * ratio_clip_c, token, -a * ratio_clip_c)
        if reference_policy_kl_penalty:
            d = ref - lp
            token = token + reference_policy_kl_penalty * ((d.exp() - d - 1) if kl_estimator == "k3" else -d)
        if use_importance_sampling_correction:
            rho = (old - gen).exp()
            hi, lo = truncated_importance_sampling_ratio, truncated_importance_sampling_ratio_min
            kind = truncated_importance_sampling_type
            if kind == "tis":
                w = rho if hi is None else torch.minimum(rho, torch.tensor(hi))
            elif kind == "icepop":
                w = rho * ((rho >= lo) & (rho <= hi)).float()
            elif kind == "seq-tis":
                w = torch.minimum(((old - gen) * mask).sum().exp(), torch.tensor(hi)) * torch.ones_like(rho)
            else:  # seq-mask-tis
                geometric = ((old - gen) * mask).sum().div(n).exp()
                w = torch.minimum(rho, torch.tensor(hi)) * float(lo <= float(geometric) <= hi)
            token = token * w
        if entropy_coeff:
            token = token - entropy_coeff * entropies[i]
        sums.append((token * mask).sum())
        counts.append(n)
        groups.append(s.get("group"))
    sums, counts = torch.stack(sums), torch.stack(counts)
    if mode == "token-mean":
        return sums.sum() / counts.sum()
    if mode == "seq-mean-token-mean":
        return (sums / counts).mean()
    if mode == "seq-mean-token-sum":
        return sums.mean()
    if mode == "seq-mean-token-sum-norm":
        return sums.mean() / loss_agg_norm_constant
    per_prompt = []  # prompt-mean
    for g in dict.fromkeys(groups):
        members = [i for i, h in enumerate(groups) if h == g]
        per_prompt.append(sums[members].sum() / counts[members].sum())
    return torch.stack(per_prompt).mean()


def pg_reference_worker(rank, world_size, samples, pg_configs, temperatures=None, sample_prompts=None):
    """Stock model, one sequence per forward; the PG loss of each config in plain torch, scored at
    ``temperatures[k]`` (default 1). ``sample_prompts``: also responses sampled from the model at each
    prompt's temperature (``[(tokens, temperature, length), ...]``), with their sampling log-probs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter

    _init()
    out = []
    with cpu_device_adapter():
        torch.manual_seed(0)
        model = build_gpt(model_config(), get_gpt_layer_local_spec())
        state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
        for pg, temperature in zip(pg_configs, temperatures or [1.0] * len(pg_configs), strict=True):
            model.zero_grad()
            entropies = []
            logps = sequence_logprobs(model, [s["tokens"] for s in samples], temperature=temperature,
                                      entropies=entropies)  # fmt: skip
            loss = pg_reference_loss(logps, samples, **pg, entropies=entropies)
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            masked = [float((h.detach() * torch.tensor(s["loss_mask"][1:])).sum())
                      for h, s in zip(entropies, samples, strict=True)]  # fmt: skip
            mean_entropy = sum(masked) / sum(sum(s["loss_mask"][1:]) for s in samples)  # per response token
            out.append({"loss": float(loss), "grads": grads, "logps": [lp.detach() for lp in logps],
                        "entropy": mean_entropy})  # fmt: skip
        sampled = [_sample(model, *prompt) for prompt in sample_prompts or []]
    return {"state_dict": state, "pg": out, "sampled": sampled}


def _sample(model, prompt, temperature: float, length: int, seed: int = 0) -> dict:
    """A response of ``length`` tokens drawn from ``model`` at ``temperature`` (one forward per token, as an
    inference engine decodes), and the log-prob of each drawn token under the distribution it came from."""
    generator = torch.Generator().manual_seed(seed + len(prompt))
    tokens, drawn = list(prompt), []
    with torch.no_grad():
        for _ in range(length):
            t = torch.tensor(tokens)
            n = t.numel()
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
            logits = model(t[None], torch.arange(n)[None], causal)[0, -1].double() / temperature
            probs = torch.softmax(logits, -1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            drawn.append(float(torch.log(probs[token])))
            tokens.append(token)
    return {"tokens": tokens, "loss_mask": [0.0] * len(prompt) + [1.0] * length, "sampled_logp": drawn,
            "temperature": temperature}


DPO_BETA = 0.5


def dpo_reference_worker(rank, world_size, samples):
    """Stock model, one sequence per forward, DPO loss averaged over pairs in plain torch."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter

    _init()
    with cpu_device_adapter():
        torch.manual_seed(0)
        model = build_gpt(model_config(), get_gpt_layer_local_spec())
        state = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
        logps = sequence_logprobs(model, [s["tokens"] for s in samples])
        masks = [torch.tensor(s["loss_mask"][1:]) for s in samples]
        sums = {i: (lp * m).sum() for i, (lp, m) in enumerate(zip(logps, masks, strict=True))}
        pairs = sorted({s["group"] for s in samples})
        loss = torch.zeros(())
        for g in pairs:
            c, r = [i for i, s in enumerate(samples) if s["group"] == g]
            margin = (sums[c] - samples[c]["ref_logp"]) - (sums[r] - samples[r]["ref_logp"])
            loss = loss - F.logsigmoid(DPO_BETA * margin) / len(pairs)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"state_dict": state, "dpo": {"loss": float(loss), "grads": grads}}


def lazy_store_worker(rank, world_size, store):
    """One packed step at DP=``world_size`` on a prepared store's samples read on access, then on the same
    samples as a list: which samples this rank read, which its micro-batches hold, both losses."""
    from mcore_packing.app.algorithms import StoreSamples
    from mcore_packing.data.store import PreparedStore
    from mcore_packing.megatron import ProcessGroups, cpu_device_adapter, forward_backward, nll_loss
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step

    read: set[int] = set()

    class Counting(StoreSamples):
        def __getitem__(self, i):
            read.add(int(i))
            return super().__getitem__(i)

    _init()
    opened = PreparedStore(store)
    lazy = Counting(opened, range(len(opened)))
    plan = plan_step(lazy.lengths.tolist(), StepPlanConfig(mode="packing", train_mb_tokens=96,
                                                           layout=ParallelLayout(dp=world_size)))  # fmt: skip
    pgs = ProcessGroups.from_megatron()
    with cpu_device_adapter():
        config = model_config()
        ddp = wrap_in_ddp(config, build_stage(config))
        from_store = forward_backward(ddp, lazy, plan, pgs, loss=nll_loss("token_mean"), device="cpu").loss
        ddp.zero_grad_buffer()
        listed = [opened[i] for i in range(len(opened))]
        from_list = forward_backward(ddp, listed, plan, pgs, loss=nll_loss("token_mean"), device="cpu").loss
    own = sorted(i for mb in plan.for_rank(pgs.dp_rank) for i in mb.sample_indices)
    return {"read": sorted(read), "own": own, "store_loss": from_store, "list_loss": from_list, "n": len(opened)}


class _ReversedRank:
    """A CP group's size with the rank mirrored (k - 1 - p): a negative control for RoPE's positions."""

    def __init__(self, group):
        self.group = group

    def size(self):
        return self.group.size()

    def rank(self):
        return self.group.size() - 1 - self.group.rank()


def _reversed_rope(real_rope, chunk, group, **kwargs):
    return real_rope(chunk, _ReversedRank(group), **kwargs)


def _own_rank_attention(real_prepare, mb, samples, plan, row_groups, **kwargs):
    """A row prepared for its sub-group whose attention gathers keys and values over a group of this rank
    alone (a negative control: the split is right, the gather's group is wrong)."""
    import torch.distributed as dist

    prep = real_prepare(mb, samples, plan, row_groups, **kwargs)
    if prep.packed_seq_params is not None and row_groups.cp_size > 1:
        prep.packed_seq_params.cp_group = _own_group(dist.get_rank())
    return prep


_OWN_GROUPS: dict = {}


def _own_group(rank: int):
    """A process group of ``rank`` alone, made collectively once per world (every rank creates every one)."""
    import torch.distributed as dist

    if not _OWN_GROUPS:
        for r in range(dist.get_world_size()):
            _OWN_GROUPS[r] = dist.new_group([r])
    return _OWN_GROUPS[rank]
