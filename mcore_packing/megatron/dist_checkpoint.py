"""Model and optimizer state through ``megatron.core.dist_checkpointing`` (``torch_dist`` format).

Every tensor is saved as a shard of its global tensor (``sharded_state_dict``), so a checkpoint written
at one (TP, PP, DP) layout loads at another: Megatron maps layers by their global numbers, splits or joins
TP shards, and the distributed optimizer's state is saved per parameter in model space
(``fully_reshardable``). The RNG states are saved per rank, keyed by the rank's place in the
layout; they are restored only when the layout is the same (with another layout no rank has a
predecessor to take them from).

What is loaded back is tensors and plain containers: ``dist_checkpointing`` reads ``common.pt`` with
``torch.load`` under torch's ``weights_only`` default (no arbitrary objects); `load_training_state`
refuses to run if that default was turned off.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

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


def _sharded_state(model, optimizer, *, with_rng: bool, loading: bool) -> dict:
    model_state = _unwrap(model).sharded_state_dict()
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=_METADATA)
    if with_rng:
        state[_RNG_KEY] = _rng_object()
    return state


def _distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer`` (Megatron chains one per parameter kind)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def _allocate_optimizer_state(optimizer) -> None:
    """The distributed optimizer reads its inner optimizer's step count while building the state dict to
    load into; torch's Adam (used where neither TransformerEngine nor Apex is installed) has none before
    its first step. Megatron's own dummy step (zero gradients, on the fp32 main shards only) allocates it;
    everything it touches is overwritten by the load."""
    for inner in _distributed_optimizers(optimizer):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def _torch_adam_steps_restored(optimizer):
    """Two spots where megatron-core 0.16's distributed optimizer mishandles torch's Adam (the optimizer
    it uses without TransformerEngine or Apex) on load; both are repaired here, nothing else changes.

    - It copies each saved state tensor over the live ones, expecting a saved 'step' tensor that
      ``fully_reshardable`` checkpoints do not hold (KeyError 'step'): each parameter's live step is
      offered as its own source (a copy onto itself).
    - It restores the step count as ONE tensor shared by every parameter's state; torch's Adam
      increments each parameter's step in place, so the shared count would advance once per parameter
      per step and the bias correction would be wrong from the first step after a resume (found by the
      resume-equivalence test). Each parameter gets its own copy.
    """
    patched = [
        inner for inner in _distributed_optimizers(optimizer) if isinstance(inner.optimizer, torch.optim.Optimizer)
    ]
    for inner in patched:
        original = inner._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, inner=inner, original=original):
            group_index, group_order = inner.model_param_group_index_map[model_param]
            live = inner.optimizer.state[inner.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in live and "step" not in tensors:
                tensors = {**tensors, "step": live["step"]}
            return original(model_param, tensors)

        inner._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states
            for state in inner.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()


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
        _allocate_optimizer_state(optimizer)
    state = dist_checkpointing.load(
        _sharded_state(model, optimizer, with_rng=restore_rng, loading=True), str(directory)
    )
    _unwrap(model).load_state_dict(state["model"])
    if optimizer is not None:
        with _torch_adam_steps_restored(optimizer):
            optimizer.load_state_dict(state["optimizer"])
    if restore_rng:
        rng = state[_RNG_KEY]
        torch.set_rng_state(rng["torch"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
