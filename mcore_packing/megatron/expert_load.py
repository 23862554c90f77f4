"""`ExpertLoadMeter`: how evenly a Mixture-of-Experts model's routers spread the tokens of a step.

A forward hook on every MoE layer's router counts, per layer and expert, the tokens routed to it (each
token counts once for each of its top-k experts) in every forward of the step. `metrics` sums the counts
over all ranks (every rank routes its own tokens: DP, CP and sequence-parallel TP shards are disjoint, and
each pipeline stage fills its own layers) and reports, per MoE layer, the busiest expert's tokens over the
mean: 1.0 is perfectly even, E is one expert taking everything. Pad tokens are routed like the others
but not counted: the schedule gives the model each micro-batch's padding mask (`prepare`), which the
routers receive. Reading the counts is a collective: every rank calls `metrics`.
"""

from __future__ import annotations

import torch

__all__ = ["ExpertLoadMeter"]


class ExpertLoadMeter:
    """Hooks the routers of ``model`` (a Megatron GPTModel chunk, DDP-wrapped or not, or a stage's list
    of chunks under a virtual pipeline) of ``num_layers`` global layers with ``num_experts`` routed
    experts each."""

    def __init__(self, model, num_layers: int, num_experts: int):
        self.shape = (num_layers, num_experts)
        self.counts: torch.Tensor | None = None  # on the routers' device, made by the first forward
        self._hooks = []
        for chunk in model if isinstance(model, list) else [model]:
            for layer in getattr(chunk, "module", chunk).decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:  # Megatron's global, 1-based layer number
                    self._hooks.append(router.register_forward_hook(self._hook(layer.layer_number - 1)))

    def _hook(self, index: int):
        def count(module, args, output):
            routing_map = output[1].detach()  # [tokens, experts] bool: the top-k experts of each token
            pads = args[1] if len(args) > 1 else None  # the micro-batch's padding mask (True at pad tokens)
            if pads is not None:  # masked, not indexed: no device synchronization on the forward path
                routing_map = routing_map & ~pads.reshape(-1, 1)
            if self.counts is None:
                self.counts = torch.zeros(self.shape, dtype=torch.int64, device=routing_map.device)
            self.counts[index] += routing_map.sum(0)

        return count

    def reset(self) -> None:
        if self.counts is not None:
            self.counts.zero_()

    def metrics(self) -> dict:
        """``expert_load_max_over_mean`` (the worst MoE layer) and ``expert_load_mean_max_over_mean`` (the
        mean over MoE layers) of the counts since the last `reset`, summed over every rank."""
        from ..collectives import all_reduce

        counts = torch.zeros(self.shape, dtype=torch.int64) if self.counts is None else self.counts.clone()
        counts = all_reduce(counts, None).cpu().double()  # on the backend's device; one copy back
        layers = [i for i in range(counts.shape[0]) if counts[i].sum() > 0]
        if not layers:
            return {}
        ratios = [float(counts[i].max() / counts[i].mean()) for i in layers]
        return {
            "expert_load_max_over_mean": max(ratios),
            "expert_load_mean_max_over_mean": sum(ratios) / len(ratios),
            "routed_tokens": int(counts[layers[0]].sum()),
        }

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
