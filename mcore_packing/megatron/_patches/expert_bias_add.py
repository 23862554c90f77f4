"""Training experts that have biases (GPT-OSS) with Megatron's local expert MLPs.

An expert ``MLP.forward`` given routing probabilities (``per_token_scale``) adds its scaled ``linear_fc2``
bias with ``output += ...``. At expert tensor parallelism 1 (the only size Megatron allows for expert
biases) the row-parallel ``linear_fc2`` returns its all-reduce's input as-is from a custom autograd
Function, so ``output`` is a view that autograd forbids modifying in place: the backward fails with
"Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace" (megatron-core
0.16.1 and 0.19.2; TransformerEngine's grouped experts take another path). `install(model)` puts a
forward hook on every expert ``linear_fc2`` that has a bias: an output that is such a view is copied,
so the in-place add acts on a tensor of its own (the same values; one copy of the expert's output).

Second, at tp > 1 with sequence parallelism that bias is marked ``sequence_parallel``, so
``finalize_model_grads`` sums its gradient over the TP ranks; but with whole experts (expert TP 1) the
TP ranks are expert-data-parallel ranks, whose sum DDP has already taken: the gradient came out doubled
(Adam hides it from the losses; `tests/test_hf_conversion.py::test_gpt_oss_at_tp2_with_whole_experts`
checks it against transformers' gradient). `install` clears the mark on those biases.
"""

from __future__ import annotations

from .patch_record import Patch

__all__ = ["EXPERT_BIAS_ADD", "install"]

_FORWARD = "megatron.core.transformer.mlp:MLP.forward"  # the in-place add
_ROW = "megatron.core.tensor_parallel.layers:RowParallelLinear.__init__"  # marks the bias sequence_parallel
_TP_SUM = "megatron.core.distributed.finalize_model_grads:_allreduce_non_tensor_model_parallel_grads"

EXPERT_BIAS_ADD = Patch(
    name="expert_bias_add",
    what="an expert MLP with biases adds its routing-scaled fc2 bias in place to the view that the expert-TP-1 "
    "all-reduce returns (autograd refuses it in the backward): the view is copied first; that bias's gradient is "
    "summed over TP after DDP already summed it over the expert-data-parallel ranks: its sequence_parallel mark "
    "is cleared",
    versions=((0, 16), (0, 20)),
    verified={
        "0.16.1": {_FORWARD: "c68406f3ca95514d", _ROW: "53e9171f04638fc2", _TP_SUM: "591de3cbdd75c68e"},
        "0.19.2": {_FORWARD: "bce28c9dcc3a2555", _ROW: "18d5d22dd93914b2", _TP_SUM: "591de3cbdd75c68e"},
    },
)


def _own_output(module, args, output):
    out, bias = output
    return (out.clone() if out._is_view() else out), bias


def install(model) -> int:
    """Hook every expert ``linear_fc2`` with a bias in ``model`` and clear its bias's ``sequence_parallel``
    mark (module docstring); returns how many were hooked."""
    hooked = 0
    for name, module in model.named_modules():
        if ".local_experts." in name and name.endswith("linear_fc2") and getattr(module, "bias", None) is not None:
            module.register_forward_hook(_own_output)
            module.bias.sequence_parallel = False
            hooked += 1
    return hooked
