"""Router replay: a Mixture-of-Experts model routes each token to the experts the inference engine chose.

In RL the engine (vLLM, SGLang) and the trainer route some tokens differently (other kernels, other
precision), so the trainer's log-probs belong to a slightly different policy than the one that sampled.
Replay ("R3") makes the trainer use the engine's choices. The routes come with the data
(``SequenceSample.routed_experts``, ``[tokens, moe_layers, top_k]``); `prepare` lays them out like the tokens
of each micro-batch (packing, the 2 x CP split) with -1 at pads, and the schedule hands each stage's routers
their share (the sequence-parallel slice, the router's ``[seq, batch]`` order) before every forward.

Where it acts. Megatron-core's top-k routing (``topk_routing_with_score_function``) takes the router's
``router_replay`` object and asks it for the top-k (``get_replay_topk``); this module puts its own object
there (Megatron's ``RouterReplay`` keeps a process-wide list of instances and one target per layer, and
replays pads too). Ours computes the fresh top-k, then keeps, per token that has a route, the replayed
experts instead; tokens without one (pads, a response's last token the engine did not return) keep the
fresh choice. The combine weights are the router's own scores gathered at the chosen experts (softmax over
the chosen logits, or the pre-softmax / sigmoid scores), so the router's gradient flows through the
weights of the replayed experts: the definition of Megatron's replay, which verl and NeMo-RL use.
Dispatch (EP), the expert computation and its gradient follow the replayed map; pads are routed afresh and
kept out of the expert counts and the balance loss by the padding mask, as without replay.

The metric. Each layer counts, over the tokens that have a route, those whose fresh top-k set differs from
the replayed one: ``router_replay_mismatch`` is that share of (token, layer) choices since the last reset,
summed over every rank (on the device; read once per logging step).

Refused: Megatron's fused router (TransformerEngine's kernel skips the replay hook) and full activation
recompute (the recomputed forward of a micro-batch would meet a later micro-batch's routes under PP).
"""

from __future__ import annotations

import torch

from ..collectives import all_reduce

__all__ = ["RouterReplay", "attached_router_replay", "install_router_replay", "is_replaying"]

_ATTR = "_mcore_packing_router_replay"


class _LayerReplay:
    """What one router's top-k routing asks for (``get_replay_topk``, Megatron's hook)."""

    def __init__(self, owner: RouterReplay, moe_index: int):
        self.owner, self.moe_index = owner, moe_index
        self.target: torch.Tensor | None = None  # [tokens, k] expert ids, -1 rows where the token has no route

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, fresh = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target
        if target is None:
            return values, fresh
        if target.shape != fresh.shape:
            raise RuntimeError(
                f"MoE layer {self.moe_index}: the router sees {fresh.shape[0]} tokens with top-{fresh.shape[1]} but "
                f"the micro-batch's routes are {list(target.shape)}; the schedule hands each stage its share."
            )
        routed = target[:, :1] >= 0
        chosen = torch.where(routed, target, fresh)
        self.owner.count(fresh, chosen, routed)
        return scores.gather(1, chosen), chosen


class _Counts:
    """[differ, routed] since the last reset, on the device; shared by the chunks of one model."""

    def __init__(self):
        self.value: torch.Tensor | None = None


class RouterReplay:
    """Replays routes on the routers of one model chunk (a Megatron GPTModel chunk, DDP-wrapped or not).
    ``moe_layers``: the global layer number (1-based) of every MoE layer of the whole model, in order, so
    a chunk's routers read their column of the routes; ``counts``: the mismatch counts, shared with the
    model's other chunks (a virtual pipeline), so any chunk's `metrics` covers the whole model. Install
    with `install_router_replay`; the schedule drives it (`begin_micro_batch`)."""

    def __init__(self, model, moe_layers: list[int], counts: _Counts | None = None):
        module = getattr(model, "module", model)
        _check_config(module.config)
        self.layers: list[_LayerReplay] = []
        self._counts = counts or _Counts()
        ordinal = {number: i for i, number in enumerate(moe_layers)}
        for layer in module.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                replay = _LayerReplay(self, ordinal[layer.layer_number])
                router.router_replay = replay  # Megatron's top-k routing asks it
                self.layers.append(replay)
        setattr(module, _ATTR, self)

    def begin_micro_batch(self, routes: torch.Tensor | None) -> None:
        """``routes``: ``[tokens, moe_layers, k]`` in the order this chunk's routers see the tokens (-1 rows:
        no route); None routes every token afresh."""
        for layer in self.layers:
            layer.target = None if routes is None else routes[:, layer.moe_index]

    def end_step(self) -> None:
        self.begin_micro_batch(None)

    def count(self, fresh: torch.Tensor, chosen: torch.Tensor, routed: torch.Tensor) -> None:
        differ = (fresh.sort(dim=1).values != chosen.sort(dim=1).values).any(dim=1, keepdim=True) & routed
        step = torch.stack([differ.sum(), routed.sum()])
        if self._counts.value is None:
            self._counts.value = torch.zeros(2, dtype=torch.int64, device=step.device)
        self._counts.value += step

    def reset(self) -> None:
        if self._counts.value is not None:
            self._counts.value.zero_()

    def metrics(self) -> dict:
        """``router_replay_mismatch``: the share of replayed (token, layer) choices that fresh routing would
        have made differently, since the last `reset`, over every rank (a collective: every rank calls it)."""
        counts = torch.zeros(2, dtype=torch.int64) if self._counts.value is None else self._counts.value.clone()
        differ, routed = (int(v) for v in all_reduce(counts, None).cpu())
        return {"router_replay_mismatch": differ / routed} if routed else {}



def _check_config(config) -> None:
    if getattr(config, "moe_router_fusion", False):
        raise ValueError("router replay needs Megatron's unfused top-k routing; moe_router_fusion=True (TE's fused "
                         "kernel) never asks for the replayed experts. Build the model with moe_router_fusion=False.")
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError("router replay with recompute_granularity='full' is not supported: the recomputed forward "
                         "could meet another micro-batch's routes. Use model.recompute_granularity=none or selective.")
    if "moe" in (getattr(config, "recompute_modules", None) or []) and config.recompute_granularity == "selective":
        raise ValueError("router replay with the 'moe' recompute module is not supported: recompute 'core_attn' only.")


def install_router_replay(model, moe_layers: list[int] | None = None) -> list[RouterReplay]:
    """A `RouterReplay` on every chunk of ``model`` (a chunk list or one chunk). ``moe_layers``: the global
    (1-based) numbers of the model's MoE layers; by default read from the config's ``moe_layer_freq``."""
    chunks = model if isinstance(model, list) else [model]
    if moe_layers is None:
        config = getattr(chunks[0], "module", chunks[0]).config
        moe_layers = _moe_layer_numbers(config)
    counts = _Counts()
    return [RouterReplay(chunk, moe_layers, counts) for chunk in chunks]


def _moe_layer_numbers(config) -> list[int]:
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def is_replaying(router) -> bool:
    """Whether ``router`` (a Megatron router) routes the current micro-batch by replayed routes."""
    replay = getattr(router, "router_replay", None)
    return isinstance(replay, _LayerReplay) and replay.target is not None


def attached_router_replay(model) -> RouterReplay | None:
    """The `RouterReplay` installed on a model chunk (DDP-wrapped or not), or None."""
    return getattr(getattr(model, "module", model), _ATTR, None)
