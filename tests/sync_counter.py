"""A test-side counter of the calls that make a GPU step wait for the device, usable on a CPU.

On a CPU nothing synchronizes, so the counter recognizes the calls that would on CUDA, by what they are
(a ``TorchFunctionMode`` sees every torch call made from Python code, tensor methods and dunders too):

- ``sync``: a value read to the host (``item``, ``tolist``, ``cpu``, ``numpy``, ``bool()``, ``float()``,
  ``int()``, ``index()``, ``torch.equal``), or an output whose size depends on the data (``nonzero``,
  ``masked_select``, ``unique``, indexing with a boolean tensor, ``repeat_interleave`` of tensor repeats);
- ``host_data``: a tensor made from host data inside the step (``torch.tensor``, ``torch.as_tensor`` of
  non-tensors, ``from_numpy``): on a GPU it is a blocking copy, to the device directly or later;
- ``transfer``: ``.to(<device>)``, ``.cuda()``, ``.pin_memory()``, or ``copy_`` across devices.

Each call is charged to the frame that made it (the first frame outside torch and this file):
``mcore_packing``, ``megatron`` or ``other``; calls torch makes internally are not charged (a mode is off
while it handles a call, and torch's own Python frames count as ``torch``). Fill/arange factories and
device-to-device operations are not counted: they launch kernels and never wait.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_SYNC = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
    torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__index__, torch.equal, torch.Tensor.equal,
    torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique,
    torch.Tensor.unique, torch.unique_consecutive, torch.Tensor.unique_consecutive,
}  # fmt: skip
_HOST_DATA = {torch.tensor, torch.as_tensor, torch.from_numpy}
_TRANSFER = {torch.Tensor.cuda, torch.Tensor.pin_memory}
_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.abspath(__file__)
_ADAPTER = os.path.join("_patches", "cpu_device.py")


def _device_argument(args, kwargs) -> bool:
    if "device" in kwargs:
        return True
    return any(isinstance(a, (str, torch.device)) or (isinstance(a, torch.Tensor)) for a in args[1:])


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def classify(func, args, kwargs) -> str | None:
    """The kind of a torch call (see the module docstring), or None when it never waits for the device."""
    if func in _SYNC:
        return "sync"
    if func in _HOST_DATA:
        if func is torch.as_tensor and args and isinstance(args[0], torch.Tensor):
            return "transfer" if _device_argument(args, kwargs) else None
        return "host_data"
    if func in _TRANSFER:
        return "transfer"
    if func is torch.Tensor.to:
        return "transfer" if _device_argument(args, kwargs) else None
    if func is torch.Tensor.copy_ and len(args) > 1 and args[0].device != args[1].device:
        return "transfer"
    if func is torch.Tensor.__getitem__ and _bool_index(args):
        return "sync"
    if func is torch.Tensor.__setitem__ and _bool_index(args):  # a scalar value is a masked_fill: no wait
        value = args[2] if len(args) > 2 else None
        return "sync" if isinstance(value, torch.Tensor) and value.numel() > 1 else None
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        if isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and kwargs.get("output_size") is None:
            return "sync"
    return None


def _origin() -> tuple[str, str]:
    """(owner, "file:line") of the first frame outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH_DIR) and not path.endswith(_ADAPTER):
            break  # (the CPU adapter's proxy makes Megatron's own calls: they are charged to Megatron)
        if path.startswith(_TORCH_DIR) and "overrides.py" not in path:
            return "torch", f"{os.path.relpath(path, _TORCH_DIR)}:{frame.f_lineno}"
        frame = frame.f_back
    if frame is None:
        return "other", "?"
    path = frame.f_code.co_filename.replace(os.sep, "/")
    line = f":{frame.f_code.co_name}:{frame.f_lineno}"
    if "/mcore_packing/" in path:
        return "mcore_packing", path.split("/mcore_packing/", 1)[1] + line
    if "/megatron/" in path:
        return "megatron", path.split("/megatron/", 1)[1] + line
    return "other", path.rsplit("/", 1)[-1] + line


class SyncCounter(TorchFunctionMode):
    """``with counter:`` (re-entrant, any number of times) counts the waiting calls made inside.
    ``counts[(owner, kind, function, where)]`` holds how often; `total(owner)` sums an owner's."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        if kind is not None:
            owner, where = _origin()
            if owner != "torch":
                self.counts[(owner, kind, getattr(func, "__name__", str(func)), where)] += 1
        return func(*args, **kwargs)

    def total(self, owner: str) -> int:
        return sum(n for (who, *_), n in self.counts.items() if who == owner)

    def report(self, owner: str) -> list[str]:
        return [f"{n} x {kind} {name} at {where}" for (who, kind, name, where), n in sorted(self.counts.items())
                if who == owner]  # fmt: skip

    def sites(self, owner: str) -> dict:
        """``{(file, function, called): count}`` of an owner (line numbers dropped: they move between releases)."""
        out: collections.Counter = collections.Counter()
        for (who, _, name, where), n in self.counts.items():
            if who == owner:
                file, function, _ = where.rsplit(":", 2)
                out[(file.rsplit("/", 1)[-1], function, name)] += n
        return dict(out)


@contextlib.contextmanager
def inside_forward_steps(around):
    """While active, every forward step of Megatron's schedule (`megatron.schedule._forward_step`) and every
    loss call it hands back run inside ``around()``, a context-manager factory (`SyncCounter` itself, or
    CUDA's sync debug mode). Yields a list that gets one entry per forward step."""
    import mcore_packing.megatron.schedule as schedule

    original, seen = schedule._forward_step, []

    def forward_step_factory(loss_func, process_groups, **options):
        inner = original(loss_func, process_groups, **options)

        def forward_step(data_iterator, model_chunk):
            with around():
                output, loss = inner(data_iterator, model_chunk)
            seen.append(1)

            def loss_inside(*args):
                with around():
                    return loss(*args)

            return output, loss_inside

        return forward_step

    schedule._forward_step = forward_step_factory
    try:
        yield seen
    finally:
        schedule._forward_step = original
