"""Every place mcore_packing changes megatron-core's or torch's behaviour, in one package, each tied to the
megatron-core versions it applies to and pinned by a test.

- `cpu_device`: the CPU stand-in for Megatron's hard-coded CUDA call sites. It replaces the ``torch``
  global of the listed Megatron modules and, process-wide while the adapter is active,
  ``torch.Tensor.cuda`` and ``torch.Tensor.type`` (their answers differ only for calls from those
  modules). CPU-only machines; its call sites are pinned per megatron-core version by the tests that run
  it (test_step_equivalence.py, test_checkpoint.py, test_megatron_packed.py).
- `moe_without_te`: the MoE router's gating GEMM names ``te_general_gemm``, undefined without
  TransformerEngine; `define_missing_te_gemm()` defines it as None (the no-TE path). Pinned by source
  hash (tests/test_patches.py).
- `torch_adam_load`: two load bugs of the distributed optimizer on torch's Adam (no TE/Apex): KeyError
  'step', and one step tensor shared by every parameter. `TORCH_ADAM_LOAD.versions`; its call sites are
  pinned by source hash (tests/test_patches.py).

- `expert_bias_add`: an expert MLP with biases (GPT-OSS) adds its fc2 bias in place to a view autograd
  forbids modifying; `install(model)` copies that view first. Pinned by source hash (tests/test_patches.py).
- `rope_cp_group`: Megatron applies THD RoPE with the run's CP group; under dynamic CP the micro-batch's
  sub-group must place the positions. `rope_cp_group(model_chunk, group)` swaps it in for one forward.
  Pinned by source hash (tests/test_patches.py).

`Patch` records what a patch touches (``module:qualname`` of each Megatron function it wraps or whose
behaviour it depends on) and the source hash of each, per megatron-core version it was verified on.
`tests/test_patches.py` fails when the installed megatron-core is in a patch's range but has no verified
hashes, or when a call site's source changed: re-verify the patch, then record the new hashes.
"""

from __future__ import annotations

from .expert_bias_add import EXPERT_BIAS_ADD
from .patch_record import Patch, source_hash
from .rope_cp_group import ROPE_CP_GROUP

__all__ = ["EXPERT_BIAS_ADD", "MOE_WITHOUT_TE", "PATCHES", "ROPE_CP_GROUP", "TORCH_ADAM_LOAD", "Patch", "source_hash"]


TORCH_ADAM_LOAD = Patch(
    name="torch_adam_load",
    what="the distributed optimizer's load on torch's Adam: KeyError 'step'; one step tensor shared by every "
    "parameter (silently wrong bias correction after a resume)",
    versions=((0, 16), (0, 20)),
    verified={
        "0.16.1": {
            "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "15f257b4c4f9a7ef",
            "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states":
                "93c254228283b2df",
            "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values":
                "0338de756278b654",
        },
        # still needed: without the repair the resume test fails on 0.19.2 (the distributed optimizer's load)
        "0.19.2": {
            "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.load_state_dict": "7e5f988b86b48501",
            "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states":
                "40cab784659711a8",
            "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._init_optimizer_states_with_dummy_values":
                "0338de756278b654",
        },
    },
)  # fmt: skip

MOE_WITHOUT_TE = Patch(
    name="moe_without_te",
    what="the MoE router's gating GEMM reads the name te_general_gemm, defined only when TransformerEngine "
    "imports (NameError without TE); defined as None, which the code already treats as 'no TE GEMM'",
    versions=((0, 16), (0, 19)),  # 0.19.2 binds the name to None itself without TE
    verified={
        "0.16.1": {
            "megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction.forward": "dcba4f9f02b30a36",
            "megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction.backward": "222f6d592730bd28",
        },
    },
)  # fmt: skip


PATCHES = (TORCH_ADAM_LOAD, MOE_WITHOUT_TE, ROPE_CP_GROUP, EXPERT_BIAS_ADD)
"""The patches with pinned call sites (the CPU adapter pins its call sites through the tests that run it)."""
