"""Megatron's RoPE on packed (THD) rows under dynamic context parallelism.

``Attention.forward`` applies rotary embeddings to a THD row with ``cp_group=self.pg_collection.cp``: the
run's CP group, whose size and rank say which chunks of each sequence this rank holds. Under dynamic CP
a micro-batch runs on its own sub-group (`megatron.dynamic_cp`), so the positions must come from that
group. `rope_cp_group(model_chunk, group)` hands every attention module of the chunk a copy of its
process-group collection whose ``cp`` is ``group`` for the forward of one micro-batch, and restores the
modules' own afterwards (the backward replays the recorded indexing; it reads no group). The attention
itself (`attention.PackedCoreAttention`) takes the group from ``PackedSeqParams.cp_group``.
"""

from __future__ import annotations

import contextlib
import copy

from . import Patch

__all__ = ["ROPE_CP_GROUP", "rope_cp_group"]

ROPE_CP_GROUP = Patch(
    name="rope_cp_group",
    what="Attention.forward applies THD RoPE with the run's CP group (pg_collection.cp), not the micro-batch's: "
    "under dynamic CP each attention module gets the row's sub-group for the forward",
    versions=((0, 16), (0, 20)),
    verified={
        "0.16.1": {"megatron.core.transformer.attention:Attention.forward": "0e779c3e4ce2b594"},
        "0.19.2": {"megatron.core.transformer.attention:Attention.forward": "b144e903f3ca6d8f"},
    },
)


@contextlib.contextmanager
def rope_cp_group(model_chunk, group):
    """While active, every Megatron ``Attention`` module of ``model_chunk`` sees ``group`` as its CP group."""
    from megatron.core.transformer.attention import Attention

    saved = []
    for module in model_chunk.modules():
        if isinstance(module, Attention) and getattr(module, "pg_collection", None) is not None:
            saved.append((module, module.pg_collection))
            swapped = copy.copy(module.pg_collection)
            swapped.cp = group
            module.pg_collection = swapped
    try:
        yield
    finally:
        for module, collection in saved:
            module.pg_collection = collection
