"""Model and optimizer state through ``megatron.core.dist_checkpointing`` (``torch_dist`` format).

Every tensor is saved as a shard of its global tensor (``sharded_state_dict``), so a checkpoint written
at one (TP, PP, DP) layout loads at another: Megatron maps layers by their global numbers, splits or joins
TP shards, and the distributed optimizer's state is saved per parameter in model space
(``fully_reshardable``). The RNG states are saved per rank, keyed by the rank's place in the
layout; they are restored only when the layout is the same (with another layout no rank has a
predecessor to take them from).

Loading goes through `_patches.torch_adam_load` (two megatron-core load bugs of the distributed
optimizer on torch's Adam, repaired where they apply). What is loaded back is tensors and plain
containers: ``dist_checkpointing`` reads ``common.pt`` (megatron-core 0.16; 0.19 keeps the common state
inside the ``.distcp`` files) with ``torch.load`` under torch's ``weights_only`` default (no arbitrary
objects); `load_training_state` refuses to run if that default was turned off.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ._patches import torch_adam_load

__all__ = ["load_training_state", "save_training_state"]

_RNG_KEY = "rng_state"
# The distributed optimizer's layout-independent format in megatron-core 0.16 (its default,
# fully_sharded_model_space, needs flattened ShardedTensors, which 0.16 no longer supports).
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _layout_position() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, this rank's offset) of the per-rank RNG object: (PP, TP, DP x CP)."""
    from megatron.core import parallel_state as ps

    shape = (
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_tensor_model_parallel_world_size(),
        ps.get_data_parallel_world_size(with_context_parallel=True),
    )
    offset = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_data_parallel_rank(with_context_parallel=True),
    )
    return shape, offset


def _rng_object():
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    tracker = tensor_parallel.get_cuda_rng_tracker()
    state = {"torch": torch.get_rng_state(), "tracker": tracker.get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    shape, offset = _layout_position()
    return ShardedObject(_RNG_KEY, state, shape, offset, replica_id=0)


def _unwrap(model):
    """The GPTModel inside Megatron DDP: its keys carry no ``module.`` prefix, so a checkpoint does not
    depend on the wrapper."""
    return getattr(model, "module", model)


def _model_state(model) -> dict:
    """The model's sharded state: ``{"model": ...}``, or per chunk ``{"model0": ..., "model1": ...}`` under
    a virtual pipeline (Megatron-LM's keys). Only the nesting differs: every tensor is saved under its
    global name (chunks map layers by their global numbers), so a checkpoint written at one vpp loads at
    another."""
    return {key: _unwrap(chunk).sharded_state_dict() for key, chunk in _chunks_by_key(model).items()}


def _sharded_state(model, optimizer, *, with_rng: bool, loading: bool) -> dict:
    state = _model_state(model)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=loading, metadata=_METADATA)
    if with_rng:
        state[_RNG_KEY] = _rng_object()
    return state


def save_training_state(directory: str | os.PathLike, model, optimizer) -> None:
    """Collective: every rank writes its shards of the model, optimizer and RNG state into ``directory``
    (created; must be empty). Returns when every rank's files are written."""
    from megatron.core import dist_checkpointing

    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_sharded_state(model, optimizer, with_rng=True, loading=False), str(directory))


def load_training_state(directory: str | os.PathLike, model, optimizer, *, restore_rng: bool) -> None:
    """Collective: load the model (and optimizer, unless None) saved by `save_training_state` at any
    layout into this rank's shards; the RNG states too when ``restore_rng`` (same layout only)."""
    from megatron.core import dist_checkpointing, tensor_parallel

    if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") not in ("", "0"):
        raise RuntimeError(
            "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set: torch.load would unpickle arbitrary objects from the "
            "checkpoint. Unset it to resume."
        )
    if optimizer is not None:
        torch_adam_load.allocate_optimizer_state(optimizer)
    state = dist_checkpointing.load(
        _sharded_state(model, optimizer, with_rng=restore_rng, loading=True), str(directory)
    )
    for key, chunk in _chunks_by_key(model).items():
        _unwrap(chunk).load_state_dict(state[key])
    if optimizer is not None:
        with torch_adam_load.repaired(optimizer):
            optimizer.load_state_dict(state["optimizer"])
    if restore_rng:
        rng = state[_RNG_KEY]
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _chunks_by_key(model) -> dict:
    """Each model chunk under its checkpoint key: ``model``, or ``model0``, ``model1``, ... for a chunk list."""
    return {f"model{i}": chunk for i, chunk in enumerate(model)} if isinstance(model, list) else {"model": model}
