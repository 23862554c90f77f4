"""`RouterLoss`: a Mixture-of-Experts model's balance loss and router z-loss, exact under packing.

Megatron-core 0.16 computes its sequence-level balance loss (``seq_aux_loss``) by reshaping the router's
tokens into ``[seq_length, batch]``: a packed THD row is one "sequence" of all its samples (Megatron-LM
#6108), and each loss is averaged over the micro-batch, so its value depends on how the batch was split.
This module replaces it (Megatron's own router losses are switched off, `model.moe_config`) with the loss
of the unpacked batch:

    balance = coeff * sum_layers (1/N) sum_s  E / (K * T_s^2) * sum_i c_si * S_si
    z_loss  = z_coeff * sum_layers (1/T) sum_t logsumexp(logits_t)^2

for the N sequences of the global batch (every sample, learned tokens or not), T_s the tokens of sequence
s, T = sum_s T_s, E experts, top-k K, ``c_si`` the tokens of s whose top-k (without expert bias) holds
expert i, ``S_si`` the sum of their normalized scores for i (softmax, or sigmoid over its sum). This is
Megatron's per-sequence formula applied to each sequence on its own, averaged over the global batch.

How it is computed. `prepare` gives every micro-batch a per-token sequence index (``segments``, -1 at
pads); the schedule hands this stage's share of it to `begin_micro_batch` before each forward. A forward
hook on every router recomputes the logits of its tokens (the router's own ``gating``), counts ``c_si``
per sequence and all-reduces the counts over the tensor x context parallel group (sequence-parallel and
CP shards of a sequence live there), and sums ``S_si`` over its own tokens only: the loss is linear in S,
so each rank's share is a sum of its tokens' terms and the shares of all ranks and micro-batches add up to
the loss above. Pads never enter (segment -1). Under router replay (`router_replay`) ``c_si`` counts the
experts the layer dispatched to, the replayed ones.

The gradient. Each share is attached to the router's output with Megatron's ``MoEAuxLossAutoScaler``, the
same path Megatron's own aux loss takes (so pipeline stages and fp16 loss scaling need nothing more),
multiplied by what the schedule's normalization divides it by: ``dp x micro-batches`` without
``calculate_per_token_loss`` (Megatron scales by cp / micro-batches, DDP averages over DP x CP), the
step's valid-token count G with it (``finalize_model_grads`` divides by G) -- the factors
`thd.loss_weights.megatron_loss_output` applies to the main loss. The gradient is therefore that of the
whole-batch loss above, whatever the packing, the number of micro-batches, the DP x CP split or the mode.

Which balance losses can be split-invariant. ``seq_aux_loss`` (this module) and a global-batch loss (one
count over the whole step) are functions of the global batch alone. Megatron's ``aux_loss`` is defined per
micro-batch: its value depends on which sequences share a micro-batch, so packing, the token budget and
DP change it; it is refused (`planning.model_shape.check_balance_loss`). A global-batch loss needs every
token's routing before the first backward (a second forward pass); Megatron's ``global_aux_loss``
approximates it with a running average over the micro-batches seen so far, which again depends on the
split; it is refused too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..collectives import all_reduce, all_reduce_values
from ..planning.model_shape import MOE_LOAD_BALANCING, check_balance_loss
from .router_replay import is_replaying

__all__ = ["RouterLoss", "RouterLossConfig", "attached_router_loss"]

_ATTR = "_mcore_packing_router_loss"


@dataclass(frozen=True, kw_only=True)
class RouterLossConfig:
    """The router losses of an MoE model: the balance loss type and coefficient, the z-loss coefficient."""

    balance: str = "seq_aux_loss"
    balance_coeff: float = 0.0
    z_coeff: float = 0.0

    def __post_init__(self):
        for name in ("balance_coeff", "z_coeff"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0 or value != value:
                raise ValueError(f"{name}={value!r}: a router loss coefficient is a number >= 0.")
        if self.balance not in MOE_LOAD_BALANCING:
            raise ValueError(f"balance={self.balance!r}: use seq_aux_loss or none.")
        check_balance_loss(self.balance, self.balance_coeff, prefix="")

    @property
    def balance_on(self) -> bool:
        return self.balance == "seq_aux_loss" and self.balance_coeff > 0

    @property
    def enabled(self) -> bool:
        return self.balance_on or self.z_coeff > 0

    @classmethod
    def from_shape(cls, shape) -> RouterLossConfig:
        """The losses a `planning.ModelShape` asks for."""
        return cls(balance=shape.moe_load_balancing, balance_coeff=float(shape.moe_aux_loss_coeff),
                   z_coeff=float(shape.moe_z_loss_coeff))  # fmt: skip


@dataclass(frozen=True)
class _Step:
    num_sequences: int  # N
    num_tokens: int  # T: the tokens the routers see (every sample's tokens)
    output_scale: float  # what the schedule's normalization divides an attached loss by


class RouterLoss:
    """The router losses of one model chunk (``model``: a Megatron GPTModel chunk, DDP-wrapped or not);
    ``reduce_group``: the tensor x context parallel group (``ProcessGroupCollection.tp_cp``);
    ``num_moe_layers``: the MoE layers of the whole model (all pipeline stages; default this chunk's).
    Install with `install`; the schedule drives it (`begin_step`, `begin_micro_batch`, `end_step`)."""

    def __init__(self, model, config: RouterLossConfig, *, reduce_group=None, num_moe_layers: int | None = None):
        module = getattr(model, "module", model)
        self.config = config
        self.reduce_group = reduce_group
        self._step: _Step | None = None
        self._segments: torch.Tensor | None = None
        self._groups: list = [reduce_group]
        self._lengths: torch.Tensor | None = None
        self.values: torch.Tensor | None = None  # [balance, z] of this rank since the last reset (detached)
        self.steps = 0  # optimizer steps (begin_step calls) since the last reset
        self._hooks = []
        for layer in module.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self._hooks.append(router.register_forward_hook(self._hook))
        self.num_moe_layers = max(num_moe_layers or len(self._hooks), 1)
        setattr(module, _ATTR, self)

    @classmethod
    def install(cls, model, config: RouterLossConfig, *, reduce_group=None,
                num_moe_layers: int | None = None) -> RouterLoss | None:  # fmt: skip
        """Hook ``model``'s routers when ``config`` asks for a loss; None otherwise."""
        if not config.enabled:
            return None
        return cls(model, config, reduce_group=reduce_group, num_moe_layers=num_moe_layers)

    def begin_step(self, *, num_sequences: int, num_tokens: int, output_scale: float) -> None:
        """A training pass over ``num_sequences`` samples of ``num_tokens`` tokens in all."""
        self._step = _Step(num_sequences, num_tokens, float(output_scale))
        self.steps += 1

    def begin_micro_batch(self, segments: torch.Tensor, lengths: torch.Tensor, *, reduce_groups=None) -> None:
        """``segments``: the sequence index of each token this chunk's routers see, in their order (-1 at
        pads); ``lengths``: the tokens of each sequence of the micro-batch (the whole sequence, all ranks);
        ``reduce_groups``: the groups the counts are summed over in turn for this micro-batch (dynamic CP:
        TP, then the row's CP sub-group), instead of ``reduce_group``."""
        self._segments, self._lengths = segments.reshape(-1), lengths
        self._groups = [self.reduce_group] if reduce_groups is None else list(reduce_groups)

    def end_step(self) -> None:
        self._step = self._segments = self._lengths = None

    def reset(self) -> None:
        self.steps = 0
        if self.values is not None:
            self.values.zero_()

    def metrics(self) -> dict:
        """The balance and z-loss since the last `reset` (each the mean over MoE layers and training
        passes, without its coefficient), summed over every rank: a collective, every rank calls it."""
        values = torch.zeros(2, dtype=torch.float64) if self.values is None else self.values.double()
        balance, z = all_reduce_values(values.unbind(), None)  # one transfer each way
        layers = self.num_moe_layers * max(self.steps, 1)
        out = {}
        if self.config.balance_on:
            out["moe_balance_loss"] = balance / layers
        if self.config.z_coeff > 0:
            out["moe_z_loss"] = z / layers
        return out

    def _hook(self, router, args, output):
        step, segments = self._step, self._segments
        if step is None or segments is None or not (router.training and torch.is_grad_enabled()):
            return None
        probs, routing_map = output
        num_experts = routing_map.shape[-1]
        logits = router.gating(args[0]).reshape(-1, num_experts).float()
        if logits.shape[0] != segments.numel():
            raise RuntimeError(
                f"the router sees {logits.shape[0]} tokens but the micro-batch's segment map has "
                f"{segments.numel()}; the schedule must hand this stage's share (begin_micro_batch)."
            )
        pads = segments < 0
        real = (~pads).unsqueeze(-1)
        share = logits.new_zeros(())
        values = []
        if self.config.balance_on:
            used = routing_map.reshape(-1, num_experts) if is_replaying(router) else None  # the replayed map
            balance = self._balance_share(router, logits, segments.clamp_min(0), pads, num_experts, used)
            share = share + self.config.balance_coeff * balance / step.num_sequences
            values.append(balance.detach() / step.num_sequences)
        else:
            values.append(logits.new_zeros(()))
        if self.config.z_coeff > 0:
            z = (torch.logsumexp(logits, dim=-1).square() * real.squeeze(-1)).sum()
            share = share + self.config.z_coeff * z / step.num_tokens
            values.append(z.detach() / step.num_tokens)
        else:
            values.append(logits.new_zeros(()))
        if self.values is None:
            self.values = torch.zeros(2, dtype=torch.float64, device=logits.device)
        self.values += torch.stack(values).double()
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        return MoEAuxLossAutoScaler.apply(probs, share * step.output_scale), routing_map

    def _balance_share(self, router, logits, index, pads, num_experts, used=None) -> torch.Tensor:
        """This rank's share of sum_s E / (K T_s^2) sum_i c_si S_si over the micro-batch's sequences. The
        scores and the (bias-free) top-k are Megatron's own for its aux losses; under router replay
        (``used``: the routing map the layer dispatched) c_si counts the replayed experts. Pads choose no
        expert."""
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        topk = router.topk
        chosen, scores = compute_routing_scores_for_aux_loss(logits, topk, router.score_function, padding_mask=pads)
        real = (~pads).unsqueeze(-1)
        if used is not None:
            chosen = used & real
        num_sequences = self._lengths.numel()
        counts = scores.new_zeros(num_sequences, num_experts).index_add(0, index, chosen.to(scores.dtype))
        for group in self._groups:  # the sequence's tokens on every TP/CP shard
            if group is not None:
                all_reduce(counts, group)
        sums = scores.new_zeros(num_sequences, num_experts).index_add(0, index, scores * real)
        lengths = self._lengths.to(scores.dtype)  # on the device: prepared with the micro-batch
        per_sequence = (counts * sums).sum(-1) * num_experts / (topk * lengths.square())
        return per_sequence.sum()

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def attached_router_loss(model) -> RouterLoss | None:
    """The `RouterLoss` installed on a model chunk (DDP-wrapped or not), or None."""
    return getattr(getattr(model, "module", model), _ATTR, None)
