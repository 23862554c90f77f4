"""Every collective mcore_packing itself issues, with its tensors on the device the group's backend takes.

NCCL reduces only CUDA tensors ("No backend type associated with device type cpu"), gloo and MPI host
tensors; a group made with a device map (``"cpu:gloo,cuda:nccl"``) takes both. Each helper here looks up
the backend of the group it is given (`backend_device_types`) and:

- leaves a tensor where it is when the backend takes its device (a CUDA tensor under NCCL, a host tensor
  under gloo: no copy);
- otherwise moves it once to the backend's device (`backend_device`: the current CUDA device for NCCL,
  the CPU for gloo), runs the collective there, and copies the result back into the caller's tensor, so
  a caller's tensor keeps its device whatever the backend.

`all_reduce_values` takes and returns host numbers (counts, metric sums) with one transfer each way.
`tests/test_collectives.py` parses the package and fails on any ``torch.distributed`` collective called
outside this module, and runs every helper with the backend reported as NCCL to check the device of
every tensor handed to torch. Megatron's own collectives (the schedule's P2P, DDP's gradient reduction,
the optimizer's) are Megatron's business and stay as they are.

Layer 0 beside `compat`: it needs torch, but only the torch layers (``thd`` and above) import it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "all_gather_object",
    "all_gather_tensors",
    "all_reduce",
    "all_reduce_values",
    "backend_device",
    "backend_device_types",
    "barrier",
    "broadcast",
    "group_size",
]

_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "npu"}
_HOST_BACKENDS = ("gloo", "mpi", "ucc")

_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def group_size(group) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialized: a world of one)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def backend_device_types(group=None) -> tuple[str, ...]:
    """The device types ``group``'s backend takes tensors on, the preferred first: ``("cuda",)`` for
    NCCL, ``("cpu",)`` for gloo, both for a ``"cpu:gloo,cuda:nccl"`` group."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # a device map: "cpu:gloo,cuda:nccl"
        pairs = [part.split(":", 1) for part in backend.split(",") if ":" in part]
        return tuple(device for device, _ in pairs)
    if backend in _ACCELERATOR_BACKENDS:
        return (_ACCELERATOR_BACKENDS[backend],)
    if backend in _HOST_BACKENDS:
        return ("cpu",)
    raise ValueError(
        f"mcore_packing does not know which device the {backend!r} backend reduces on; use nccl, gloo or a "
        "device map such as 'cpu:gloo,cuda:nccl'."
    )


def _accelerator_device(device_type: str) -> torch.device:
    """The process's current device of an accelerator type (the one `torch.cuda.set_device` chose)."""
    module = getattr(torch, device_type)
    return torch.device(device_type, module.current_device())


def backend_device(group=None, like: torch.device | None = None) -> torch.device:
    """The device a tensor for ``group``'s collectives lives on: ``like`` when the backend takes its type
    (no copy), else the backend's preferred device (the current CUDA device for NCCL, the CPU for gloo)."""
    types = backend_device_types(group)
    if like is not None and torch.device(like).type in types:
        return torch.device(like)
    return torch.device("cpu") if types[0] == "cpu" else _accelerator_device(types[0])


def _staged(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` on the backend's device: itself when it is there already (contiguous), else one copy."""
    device = backend_device(group, tensor.device)
    if device == tensor.device:
        return tensor if tensor.is_contiguous() else tensor.contiguous()
    return tensor.to(device, non_blocking=True)


def _op(op: str):
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not one of {sorted(_OPS)}.")
    return getattr(dist.ReduceOp, _OPS[op])


def all_reduce(tensor: torch.Tensor, group=None, *, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ``group`` in place (``op``: sum, max or min) and return it. A group of one
    rank does nothing."""
    if group_size(group) == 1:
        return tensor
    staged = _staged(tensor, group)
    dist.all_reduce(staged, op=_op(op), group=group)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def all_reduce_values(values: Sequence, group=None, *, dtype: torch.dtype = torch.float64, op: str = "sum") -> list:
    """Host numbers (or 0-d tensors) reduced element-wise over ``group``: one tensor built on the backend's
    device, one collective, one copy back. Returns Python numbers (ints for an integer ``dtype``)."""
    values = list(values)
    if any(isinstance(v, torch.Tensor) for v in values):
        tensor = torch.stack([torch.as_tensor(v, dtype=dtype) for v in values])
    else:
        tensor = torch.tensor(values, dtype=dtype)
    if group_size(group) > 1:
        tensor = tensor.to(backend_device(group, tensor.device))
        dist.all_reduce(tensor, op=_op(op), group=group)
    return tensor.tolist()


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group) -> torch.Tensor:
    """Equal-shaped ``local`` tensors of ``group`` concatenated along dim 0 into ``output`` (rank order).
    Uses ``all_gather_single`` where this torch has it (``all_gather_into_tensor`` is deprecated)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = _staged(output, group)
    gather(out, _staged(local, group), group=group)
    if out is not output:
        output.copy_(out)
    return output


def all_gather_tensors(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (equal shapes) as a list in rank order, on ``tensor``'s device."""
    staged = _staged(tensor, group)
    gathered = [torch.empty_like(staged) for _ in range(group_size(group))]
    dist.all_gather(gathered, staged, group=group)
    return [g.to(tensor.device) for g in gathered]


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """``tensor`` of ``group``'s rank ``src`` (its index in the group) on every rank, in place."""
    if group_size(group) == 1:
        return tensor
    staged = _staged(tensor, group)
    dist.broadcast(staged, src=dist.get_global_rank(group, src), group=group)
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def all_gather_object(obj, group=None) -> list:
    """Every rank's picklable ``obj`` in rank order (torch moves the bytes to the backend's device)."""
    out = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    """Every rank of ``group`` reaches this point before any leaves it."""
    if dist.is_initialized():
        dist.barrier(group=group)
