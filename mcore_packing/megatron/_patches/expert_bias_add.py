"""Training experts that have biases (GPT-OSS) with Megatron's local expert MLPs.

An expert ``MLP.forward`` given routing probabilities (``per_token_scale``) adds its scaled ``linear_fc2``
bias with ``output += ...``. At expert tensor parallelism 1 (the only size Megatron allows for expert
biases) the row-parallel ``linear_fc2`` returns its all-reduce's input as-is from a custom autograd
Function, so ``output`` is a view that autograd forbids modifying in place: the backward fails with
"Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace" (megatron-core
0.16.1 and 0.19.2; TransformerEngine's grouped experts take another path). `install(model)` puts a
forward hook on every expert ``linear_fc2`` that has a bias: an output that is such a view is copied,
so the in-place add acts on a tensor of its own (the same values; one copy of the expert's output).
"""

from __future__ import annotations

from . import Patch

__all__ = ["EXPERT_BIAS_ADD", "install"]

EXPERT_BIAS_ADD = Patch(
    name="expert_bias_add",
    what="an expert MLP with biases adds its routing-scaled fc2 bias in place to the view that the expert-TP-1 "
    "all-reduce returns (autograd refuses it in the backward); the view is copied first",
    versions=((0, 16), (0, 20)),
    verified={
        "0.16.1": {"megatron.core.transformer.mlp:MLP.forward": "c68406f3ca95514d"},
        "0.19.2": {"megatron.core.transformer.mlp:MLP.forward": "bce28c9dcc3a2555"},
    },
)


def _own_output(module, args, output):
    out, bias = output
    return (out.clone() if out._is_view() else out), bias


def install(model) -> int:
    """Hook every expert ``linear_fc2`` with a bias in ``model``; returns how many were hooked."""
    hooked = 0
    for name, module in model.named_modules():
        if ".local_experts." in name and name.endswith("linear_fc2") and getattr(module, "bias", None) is not None:
            module.register_forward_hook(_own_output)
            hooked += 1
    return hooked
