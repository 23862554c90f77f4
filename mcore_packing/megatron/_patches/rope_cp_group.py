"""Megatron's RoPE on packed (THD) rows under dynamic context parallelism.

``Attention.forward`` applies rotary embeddings to a THD row with ``cp_group=self.pg_collection.cp``: the
run's CP group, whose size and rank say which chunks of each sequence this rank holds. Under dynamic CP
a micro-batch runs on its own sub-group (`megatron.dynamic_cp`), so the positions must come from that
group. `rope_cp_group(model_chunk, group)` hands every attention module of the chunk a copy of its
process-group collection whose ``cp`` is ``group`` for the forward of one micro-batch, and restores the
modules' own afterwards (the backward replays the recorded indexing; it reads no group). The attention
itself (`attention.PackedCoreAttention`) takes the group from ``PackedSeqParams.cp_group``.

BSHD micro-batches (dynamic batching, `packed_seq.bshd_cp_params`): GPTModel slices the rotary table by
``PackedSeqParams.cp_group``, but sizes it with ``RotaryEmbedding.get_rotary_seq_len``, which reads
``max_seqlen_q`` when params are given (None for BSHD: TransformerEngine would scale it by the CP size)
and otherwise multiplies this rank's length by the run's static ``context_parallel_size``. With
``rotary_seq_len`` (the row's whole width) every rotary module of the chunk answers that length for the
forward instead (an instance attribute, removed afterwards; ``RotaryEmbedding.forward``'s cache is keyed
by the length and the group, both passed explicitly, so no stale table is reused).
"""

from __future__ import annotations

import contextlib
import copy

from .patch_record import Patch

__all__ = ["ROPE_CP_GROUP", "rope_cp_group"]

_ROTARY_LEN = "megatron.core.models.common.embeddings.rotary_pos_embedding:RotaryEmbedding.get_rotary_seq_len"
_PREPROCESS = "megatron.core.models.gpt.gpt_model:GPTModel._preprocess"  # sizes and slices the BSHD table

ROPE_CP_GROUP = Patch(
    name="rope_cp_group",
    what="Attention.forward applies THD RoPE with the run's CP group (pg_collection.cp), not the micro-batch's: "
    "under dynamic CP each attention module gets the row's sub-group for the forward; BSHD rows: "
    "RotaryEmbedding.get_rotary_seq_len answers the row's width (it would scale by the static CP size)",
    versions=((0, 16), (0, 20)),
    verified={
        "0.16.1": {
            "megatron.core.transformer.attention:Attention.forward": "0e779c3e4ce2b594",
            _ROTARY_LEN: "545376b777e5986a",
            _PREPROCESS: "d29a34761692bd99",
        },
        "0.19.2": {
            "megatron.core.transformer.attention:Attention.forward": "b144e903f3ca6d8f",
            _ROTARY_LEN: "46e9ea3ece6bb552",
            _PREPROCESS: "1bc57437dfdab74a",
        },
    },
)


@contextlib.contextmanager
def rope_cp_group(model_chunk, group, *, rotary_seq_len: int | None = None):
    """While active, every Megatron ``Attention`` module of ``model_chunk`` sees ``group`` as its CP group;
    with ``rotary_seq_len`` (a BSHD row's whole width), every ``RotaryEmbedding`` sizes its table to it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.attention import Attention

    saved, sized = [], []
    for module in model_chunk.modules():
        if isinstance(module, Attention) and getattr(module, "pg_collection", None) is not None:
            saved.append((module, module.pg_collection))
            swapped = copy.copy(module.pg_collection)
            swapped.cp = group
            module.pg_collection = swapped
        elif rotary_seq_len is not None and isinstance(module, RotaryEmbedding):
            module.get_rotary_seq_len = lambda *args, **kwargs: rotary_seq_len
            sized.append(module)
    try:
        yield
    finally:
        for module, collection in saved:
            module.pg_collection = collection
        for module in sized:
            del module.get_rotary_seq_len  # the class's method again
