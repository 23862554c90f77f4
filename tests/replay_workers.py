"""Workers for the router-replay test (they run inside spawned gloo ranks).

Reference (`replay_reference_worker`, one process, no mcore_packing code on the routing or loss path):
Megatron's stock MoE GPTModel of `moe_workers` (4 experts, top-2, top-k then softmax). It first RECORDS each
sample's routes with an unpacked forward (the routers' top-k, read from their routing maps), then perturbs
every router's weight so fresh routing changes, and computes the REPLAY reference: one sequence per
forward, each router's ``routing`` replaced by plain torch (the recorded experts, combine weights the
softmax of the router's logits at them), the token-mean NLL plus the per-sequence balance loss counted on
the replayed experts and the z-loss. It also reports how many (token, layer) choices fresh routing makes
differently after the perturbation, and the expert counts the routes imply.

Under test (`replay_step_worker`): the perturbed weights sharded for (TP, PP, CP, EP, DP), the samples'
``routed_experts``, `install_router_replay`, `RouterLoss`, `ExpertLoadMeter`, the planner and the schedule
driver. ``negative="no_replay"`` trains without the routes: the fresh routing, which must differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .moe_workers import (
    BALANCE,
    NUM_EXPERTS,
    TOPK,
    Z_LOSS,
    _init,
    _offsets,
    collect_full_grads,
    load_sharded,
    moe_model_config,
)
from .step_workers import NUM_LAYERS, build_gpt, build_stage, gather_results, wrap_in_ddp


def _routes_of(routing_map: torch.Tensor) -> torch.Tensor:
    """[tokens, experts] bool with K per row -> [tokens, K] expert ids, ascending."""
    return routing_map.nonzero()[:, 1].reshape(routing_map.shape[0], TOPK)


def _record(model, tokens: list) -> list:
    """Each sample's routes [T, layers, K] from an unpacked forward with fresh routing."""
    captured: list = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: captured.append(_routes_of(out[1])))
             for layer in model.decoder.layers]  # fmt: skip
    routes = []
    with torch.no_grad():
        for t in tokens:
            captured.clear()
            n = t.numel()
            model(t[None], torch.arange(n)[None], torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None])
            routes.append(torch.stack(captured, dim=1))
    for hook in hooks:
        hook.remove()
    return routes


def _replaying_routing(router, layer: int, state: dict):
    """Plain-torch routing with the recorded experts of the current sample (``state["routes"]``)."""

    def routing(logits, padding_mask=None):
        logits = logits.reshape(-1, NUM_EXPERTS)
        chosen = state["routes"][:, layer]
        state["fresh_differs"] += int((torch.topk(logits, TOPK, dim=1).indices.sort(1).values != chosen).any(1).sum())
        probs = torch.softmax(logits.gather(1, chosen), dim=-1)
        state["captured"][layer].append((logits, chosen))
        dense = torch.zeros_like(logits).scatter(1, chosen, probs)
        return dense, torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)

    return routing


def _router_loss(captured: list, lengths: list[int]) -> torch.Tensor:
    """Balance (counts on the replayed experts) and z-loss, summed over layers."""
    total = torch.zeros(())
    for per_sequence in captured:
        balance = z = torch.zeros(())
        for logits, chosen in per_sequence:
            scores = torch.softmax(logits.float(), dim=-1)
            counts = torch.zeros(NUM_EXPERTS).index_add(0, chosen.reshape(-1), torch.ones(chosen.numel()))
            n = logits.shape[0]
            balance = balance + NUM_EXPERTS / (TOPK * n * n) * (counts * scores.sum(0)).sum()
            z = z + torch.logsumexp(logits.float(), dim=-1).square().sum()
        total = total + BALANCE * balance / len(lengths) + Z_LOSS * z / sum(lengths)
    return total


def replay_reference_worker(rank, world_size, samples):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter

    _init()
    with cpu_device_adapter():
        torch.manual_seed(0)
        model = build_gpt(moe_model_config(), get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False))
        tokens = [torch.tensor(s["tokens"]) for s in samples]
        routes = _record(model, tokens)
        torch.manual_seed(1)
        with torch.no_grad():
            for layer in model.decoder.layers:  # fresh routing now differs from the recorded routes
                layer.mlp.router.weight.add_(torch.randn_like(layer.mlp.router.weight) * 0.5)
        state_dict = {k: v.clone() for k, v in model.state_dict().items() if v is not None and "_extra" not in k}
        state = {"captured": [[] for _ in range(NUM_LAYERS)], "fresh_differs": 0}
        for i, layer in enumerate(model.decoder.layers):
            layer.mlp.router.routing = _replaying_routing(layer.mlp.router, i, state)
        masks = [torch.tensor(s["loss_mask"], dtype=torch.float32) for s in samples]
        total = sum(m[1:].sum() for m in masks)
        nll, logprobs = torch.zeros(()), []
        for t, m, r in zip(tokens, masks, routes, strict=True):
            state["routes"] = r
            n = t.numel()
            causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
            logits = model(t[None], torch.arange(n)[None], causal)
            per_token = F.cross_entropy(logits[0, :-1], t[1:], reduction="none")
            logprobs.append(-per_token.detach())
            nll = nll + (per_token * m[1:]).sum() / total
        router = _router_loss(state["captured"], [t.numel() for t in tokens])
        (nll + router).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    counts = torch.zeros(NUM_LAYERS, NUM_EXPERTS, dtype=torch.int64)
    for r in routes:
        for layer in range(NUM_LAYERS):
            counts[layer] += torch.bincount(r[:, layer].reshape(-1), minlength=NUM_EXPERTS)
    choices = sum(r.shape[0] for r in routes) * NUM_LAYERS
    return {"loss": nll.item(), "router_loss": router.item(), "grads": grads, "state_dict": state_dict,
            "routes": routes, "counts": counts, "logprobs": logprobs,
            "fresh_mismatch": state["fresh_differs"] / choices}  # fmt: skip


def _one_config(cfg, world_size, seq_samples, lengths, state_dict):
    from mcore_packing.megatron import ProcessGroups, compute_logprobs, forward_backward, nll_loss
    from mcore_packing.megatron.expert_load import ExpertLoadMeter
    from mcore_packing.megatron.router_loss import RouterLoss, RouterLossConfig
    from mcore_packing.megatron.router_replay import install_router_replay
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step

    tp, pp, cp, ep = cfg.get("tp", 1), cfg.get("pp", 1), cfg.get("cp", 1), cfg.get("ep", 1)
    _init(tp, pp, cp, ep)
    config = moe_model_config(tp=tp, pp=pp, cp=cp, ep=ep, sp=tp > 1)
    module = build_stage(config)
    offsets = _offsets(pp, ep)
    load_sharded(module, state_dict, offsets)
    ddp = wrap_in_ddp(config, module)
    pgs = ProcessGroups.from_megatron()
    replay = None if cfg.get("negative") == "no_replay" else install_router_replay(ddp)[0]
    router_loss = RouterLoss(ddp, RouterLossConfig(balance_coeff=BALANCE, z_coeff=Z_LOSS),
                             reduce_group=pgs.collection.tp_cp, num_moe_layers=NUM_LAYERS)  # fmt: skip
    meter = ExpertLoadMeter(ddp, NUM_LAYERS, NUM_EXPERTS)
    layout = ParallelLayout(dp=world_size // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep, sequence_parallel=tp > 1)
    plan = plan_step(lengths, StepPlanConfig(mode=cfg.get("mode", "packing"), train_mb_tokens=48, layout=layout))
    logprobs = None
    if cfg.get("logprobs"):
        logprob_plan = plan_step(lengths, StepPlanConfig(mode="packing", train_mb_tokens=48, layout=layout),
                                 forward_only=True)  # fmt: skip
        logprobs = compute_logprobs(ddp, seq_samples, logprob_plan, pgs, device="cpu")
        meter.reset()
    result = forward_backward(ddp, seq_samples, plan, pgs, loss=nll_loss("token_mean"), device="cpu")
    metrics = router_loss.metrics()
    counts = torch.zeros_like(meter.counts)
    torch.distributed.all_reduce(counts.copy_(meter.counts))
    out = {"config": cfg, "router_loss": NUM_LAYERS * (BALANCE * metrics["moe_balance_loss"] + Z_LOSS *
                                                         metrics["moe_z_loss"]),
           "counts": counts, "logprobs": logprobs, "num_microbatches": result.num_microbatches,
           "mismatch": replay.metrics().get("router_replay_mismatch") if replay else None}  # fmt: skip
    grads = collect_full_grads(ddp, offsets)
    router_loss.remove()
    meter.remove()
    return out, grads, result.loss


def replay_step_worker(rank, world_size, configs, samples, state_dict, routes):
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import cpu_device_adapter
    from mcore_packing.thd import SequenceSample

    lengths = [len(s["tokens"]) for s in samples]
    results = []
    for cfg in configs:
        with_routes = cfg.get("negative") != "no_replay"
        seq_samples = [SequenceSample(s["tokens"], s["loss_mask"], r.numpy() if with_routes else None)
                       for s, r in zip(samples, routes, strict=True)]  # fmt: skip
        with cpu_device_adapter():
            out, grads, loss = _one_config(cfg, world_size, seq_samples, lengths, state_dict)
        merged, losses, _ = gather_results(world_size, grads, loss)
        results.append({**out, "loss": losses[0], "all_losses_equal": len(set(losses)) == 1, "grads": merged})
        ps.destroy_model_parallel()
    return results if rank == 0 else None

