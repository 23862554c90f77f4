"""Two load bugs of megatron-core's distributed optimizer on torch's Adam (the optimizer it uses without
TransformerEngine or Apex: CPUs, and GPUs without TE), repaired around Megatron's own code.

- Building the state dict to load into reads the inner optimizer's step count, which torch's Adam has only
  after its first step: `allocate_optimizer_state` runs Megatron's own dummy step (zero gradients, on the
  fp32 main shards; everything it touches is overwritten by the load).
- `repaired(optimizer)` around ``optimizer.load_state_dict``: (1) each saved state is copied over the live
  one expecting a saved 'step' tensor that ``fully_reshardable`` checkpoints do not hold (KeyError
  'step'): each parameter's live step is offered as its own source; (2) the step count is restored as ONE
  tensor shared by every parameter, which torch's Adam increments in place once per parameter per step,
  so the bias correction would be wrong from the first step after a resume (found by the
  resume-equivalence test): each parameter gets its own copy.

Applies to `TORCH_ADAM_LOAD.versions`; outside that range both are no-ops. The call sites are pinned in
`tests/test_patches.py`.
"""

from __future__ import annotations

import contextlib

import torch

from . import TORCH_ADAM_LOAD

__all__ = ["allocate_optimizer_state", "repaired"]


def _distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside ``optimizer`` (Megatron chains one per parameter kind)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def allocate_optimizer_state(optimizer) -> None:
    """Give torch's Adam inside every distributed optimizer its state before a load (see the module)."""
    if not TORCH_ADAM_LOAD.applies():
        return
    for inner in _distributed_optimizers(optimizer):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


@contextlib.contextmanager
def repaired(optimizer):
    """Inside the block, ``optimizer.load_state_dict`` loads torch's Adam state correctly (see the module)."""
    patched = []
    if TORCH_ADAM_LOAD.applies():
        patched = [i for i in _distributed_optimizers(optimizer) if isinstance(i.optimizer, torch.optim.Optimizer)]
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
