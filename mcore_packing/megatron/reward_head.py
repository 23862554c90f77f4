"""The reward model's head: one score per token from the final hidden state, in place of the vocabulary
projection (`algorithm=rm`; Hugging Face's ``*ForSequenceClassification`` with one label).

`RewardHead` replaces a GPTModel's ``output_layer`` before the model is wrapped in DDP: Megatron's
``_postprocess`` calls it as it calls the output layer, and with no labels the model returns its output,
``[b, s, 1]``, one score per position. The weight ``reward_weight`` ``[1, hidden]`` is replicated on every
TP rank (one number per token is not worth sharding). Under sequence parallelism the hidden states are
first gathered over TP with a backward that splits instead of summing, since every TP rank then computes
the same scores (a sum would count the gradient TP times). The reward of a sequence is the score at its
last token (`rl.rm`), as Hugging Face's sequence classifier reads its last non-padding token.

Its distributed-checkpoint state is the submodules' own (`_sharded_state_dict`: Megatron's
`LanguageModule` would look for the vocabulary projection's weight). The weight starts from
`seeded_init.seeded_tensor` (normal, ``init_method_std``) under its global name, so
it is the same on every layout, whether the rest of the model is seeded or read from a causal LM's
checkpoint (which has no score head: `hf_weights` keeps the seeded one then).
"""

from __future__ import annotations

from functools import partial

import torch

__all__ = ["REWARD_WEIGHT", "RewardHead", "install_reward_head"]

REWARD_WEIGHT = "output_layer.reward_weight"  # the parameter's name in a GPTModel chunk


class RewardHead(torch.nn.Module):
    """``forward(hidden [s, b, h], weight=None, runtime_gather_output=None) -> ([s, b, 1], None)``, the
    output layer's calling convention (``weight``: the tied embedding Megatron offers, ignored)."""

    def __init__(self, hidden_size: int, *, seed: int, std: float, sequence_parallel: bool, tp_group,
                 dtype: torch.dtype, device=None):  # fmt: skip
        from .seeded_init import seeded_tensor

        super().__init__()
        weight = seeded_tensor(REWARD_WEIGHT, (1, hidden_size), seed=seed, std=std)
        self.reward_weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None, **_):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)  # fmt: skip
        return torch.matmul(hidden, self.reward_weight.t()), None


def install_reward_head(model, *, seed: int, tp_group) -> RewardHead:
    """Replace ``model``'s (a GPTModel's last-stage chunk, not yet DDP-wrapped) output layer by a
    `RewardHead`; returns it. The model must not tie its output layer to the embedding."""
    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError("a reward model's head replaces the output layer: build the GPTModel with "
                         "share_embeddings_and_output_weights=False.")  # fmt: skip
    config = model.config
    old = model.output_layer
    head = RewardHead(config.hidden_size, seed=seed, std=float(getattr(config, "init_method_std", 0.02)),
                      sequence_parallel=bool(config.sequence_parallel), tp_group=tp_group,
                      dtype=config.params_dtype, device=next(old.parameters()).device)  # fmt: skip
    model.output_layer = head
    model.sharded_state_dict = partial(_sharded_state_dict, model)
    return head


def _sharded_state_dict(model, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
    """A reward model's distributed-checkpoint state: every submodule's own (the head's weight replicated),
    without `LanguageModule`'s output-layer logic, which expects the vocabulary projection's weight."""
    from megatron.core.transformer.module import MegatronModule

    try:
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
    except ImportError:  # releases without it pass the metadata through as it is
        pass
    else:
        metadata = ensure_metadata_has_dp_cp_group(metadata)
    return MegatronModule.sharded_state_dict(model, prefix, sharded_offsets, metadata)
