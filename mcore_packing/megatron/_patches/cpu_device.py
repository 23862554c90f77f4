"""Run Megatron-Core's real schedules and layers on a CPU-only machine.

Megatron hard-codes CUDA in a few places on the training path (megatron-core 0.16.1): tensor factories
with ``device="cuda"`` or ``torch.cuda.current_device()`` in the pipeline schedules and p2p
communication, ``torch.cuda.synchronize()``, RoPE (and YaRN's) moving ``inv_freq`` to the current CUDA device,
buffers in tensor-parallel layers, mappings, ``utils.GlobalMemoryBuffer`` and the DDP grad buffers, the
optimizers' scalars (found-inf flag, loss scale, clipping), dist_checkpointing's save finalization, and
in Mixture-of-Experts layers the router moving its weight to ``torch.cuda.current_device()``, the
token dispatcher's and shared experts' ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` (one
host stream here: a CPU runs in order), the auxiliary-loss tracker's ``device="cuda"``, and the
dispatcher's device-to-host copy of its all-to-all split sizes (``maybe_move_tensor_to_cpu``, replaced
while active: on a CPU the sizes stayed tensors, which gloo refuses), recomputation's CUDA generator state
(``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the CPU's), and, under TP x EP, the uneven
all-gather and reduce-scatter of expert tokens (``mappings._gather_along_first_dim`` /
``_reduce_scatter_along_first_dim`` with split sizes, which gloo cannot do: padded to even, or an
all-reduce and a slice; exact either way).

The adapter replaces the module-global name ``torch`` inside exactly those Megatron modules with a proxy:
tensor factories given a CUDA (or integer) device allocate on the CPU, ``torch.cuda.current_device()``
returns the CPU device and ``torch.cuda.synchronize()`` does nothing. A factory asked for pinned memory
(BSHD RoPE's CP index, ``torch.tensor(..., pin_memory=True).cuda()``) returns an unpinned CPU tensor
whose ``.cuda()`` stays on the CPU. ``Tensor.cuda()`` called from one of those modules (tied embeddings
under PP: ``weight.data.cuda()`` before the embedding all-reduce) returns the tensor itself while the
adapter is active; called from anywhere else it is torch's own. Likewise ``Tensor.type()`` asked from one
of those modules answers a CPU tensor's CUDA type string ('torch.cuda.FloatTensor'): Megatron's
optimizers (FP32, mixed precision, distributed) and gradient clipping accept parameters by that string
alone. Everything else passes through to the
real torch. Every redirected call site is recorded, so a test can pin the exact set to the installed
megatron-core and an upgrade cannot silently change it.

It is a stand-in for a GPU, used when the run's device is the CPU (`cpu_device_adapter(device=...)`; by
default when ``torch.cuda.is_available()`` is False).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections.abc import Iterator

import torch

from ...collectives import all_gather_tensors, all_reduce

__all__ = ["PATCHED_MODULES", "CpuDeviceAdapter", "cpu_device_adapter"]

PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.models.common.embeddings.rope_utils",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.utils",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
)
"""Megatron modules whose ``torch`` global is redirected while the adapter is active."""

_REPLACED_FUNCTIONS = (
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu", "_host_split_sizes"),
    ("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim", "_uneven_gather"),
    ("megatron.core.tensor_parallel.mappings", "_reduce_scatter_along_first_dim", "_uneven_reduce_scatter"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "_host_get_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", "_host_set_rng_state"),
)
"""(module, function, the `CpuDeviceAdapter` method that wraps it) of the module-level functions replaced
while the adapter is active (restored by ``uninstall``)."""

_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "zeros_like", "ones_like", "empty_like")
_CPU = torch.device("cpu")


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _HostTensor(torch.Tensor):
    """A CPU tensor whose ``.cuda()`` returns itself as a plain tensor (no GPU to move to)."""

    def cuda(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor)


class _HostEvent:
    """A CUDA event on the CPU: everything before it has already happened."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """The one stream of a CPU: work runs in order, so waiting and recording are no-ops. ``Stream()`` and
    ``current_stream()`` both answer it, so Megatron's MoE dispatcher sees no side stream (and does not
    call ``Tensor.record_stream``, which CPU tensors lack)."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return event or _HostEvent()


_HOST_STREAM = _HostStream()


class _CudaProxy:
    def __init__(self, adapter: CpuDeviceAdapter, module: str):
        self._adapter = adapter
        self._module = module

    def current_device(self):
        self._adapter._record(self._module, "cuda.current_device")
        return _CPU

    def synchronize(self, *args, **kwargs):
        self._adapter._record(self._module, "cuda.synchronize")

    def Stream(self, *args, **kwargs):  # torch.cuda's name
        self._adapter._record(self._module, "cuda.Stream")
        return _HOST_STREAM

    def current_stream(self, *args, **kwargs):
        self._adapter._record(self._module, "cuda.current_stream")
        return _HOST_STREAM

    def stream(self, stream):
        self._adapter._record(self._module, "cuda.stream")
        return contextlib.nullcontext()

    def Event(self, *args, **kwargs):  # torch.cuda's name
        self._adapter._record(self._module, "cuda.Event")
        return _HostEvent()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchProxy:
    """Stands in for ``torch`` inside one Megatron module."""

    def __init__(self, adapter: CpuDeviceAdapter, module: str):
        self._adapter = adapter
        self._module = module
        self.cuda = _CudaProxy(adapter, module)
        for name in _FACTORIES:
            setattr(self, name, self._factory(name))

    def _factory(self, name: str):
        real = getattr(torch, name)
        adapter, module = self._adapter, self._module

        def factory(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                adapter._record(module, name)
                kwargs["device"] = _CPU
            if kwargs.get("pin_memory"):
                adapter._record(module, f"{name}(pin_memory)")
                kwargs["pin_memory"] = False
                return real(*args, **kwargs).as_subclass(_HostTensor)
            return real(*args, **kwargs)

        factory.__name__ = name
        return factory

    def __getattr__(self, name):
        return getattr(torch, name)


class CpuDeviceAdapter:
    """Installs the proxies; ``call_sites`` lists what was redirected as ``(module, function, call)``."""

    def __init__(self, modules: tuple[str, ...] = PATCHED_MODULES):
        self.modules = modules
        self.call_sites: set[tuple[str, str, str]] = set()
        self._saved: dict[str, object] = {}
        self._lock = threading.Lock()

    def _record(self, module: str, call: str) -> None:
        frame = sys._getframe(2)
        # Walk out of our own frames to the Megatron function that made the call.
        while frame is not None and frame.f_globals.get("__name__", "") == __name__:
            frame = frame.f_back
        function = frame.f_code.co_name if frame is not None else "?"
        with self._lock:
            self.call_sites.add((module, function, call))

    def install(self) -> None:
        for name in self.modules:
            module = importlib.import_module(name)
            if name in self._saved:
                continue
            self._saved[name] = module.torch
            module.torch = _TorchProxy(self, name)
        if "Tensor.cuda" not in self._saved:
            self._saved["Tensor.cuda"] = torch.Tensor.cuda
            torch.Tensor.cuda = self._tensor_cuda(torch.Tensor.cuda)
        if "Tensor.type" not in self._saved:
            self._saved["Tensor.type"] = torch.Tensor.type
            torch.Tensor.type = self._tensor_type(torch.Tensor.type)
        for module_name, function, wrapper in _REPLACED_FUNCTIONS:
            key = f"{module_name}:{function}"
            if key not in self._saved:
                module = importlib.import_module(module_name)
                self._saved[key] = getattr(module, function)
                setattr(module, function, getattr(self, wrapper)(self._saved[key], module_name))

    def _uneven_gather(self, original, module: str):
        """Uneven all-gather (``output_split_sizes``: MoE tokens under TP x EP) as gloo can do it: every
        piece padded to the largest, one even all-gather, the padding cut off. Even gathers are Megatron's."""
        adapter = self

        def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
            if output_split_sizes is None or group.size() == 1:
                return original(input_, group, output_split_sizes, use_global_buffer)
            adapter._record(module, "_gather_along_first_dim(uneven)")
            sizes = [int(n) for n in output_split_sizes]
            padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
            padded[: input_.shape[0]] = input_
            pieces = all_gather_tensors(padded, group)
            return torch.cat([p[:n] for p, n in zip(pieces, sizes, strict=True)])

        return gather

    def _uneven_reduce_scatter(self, original, module: str):
        """Uneven reduce-scatter (``input_split_sizes``) as gloo can do it: an all-reduce of the whole
        tensor, then this rank's rows (the same sums). Even reduce-scatters are Megatron's."""
        adapter = self

        def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
            if input_split_sizes is None or group.size() == 1:
                return original(input_, group, input_split_sizes, use_global_buffer)
            adapter._record(module, "_reduce_scatter_along_first_dim(uneven)")
            total = all_reduce(input_.clone().contiguous(), group)
            sizes = [int(n) for n in input_split_sizes]
            start = sum(sizes[: group.rank()])
            return total[start : start + sizes[group.rank()]].contiguous()

        return reduce_scatter

    def _host_split_sizes(self, original, module: str):
        """Megatron's MoE dispatcher copies its split sizes device-to-host as numpy arrays, but only when
        they are CUDA tensors: on a CPU they stayed tensors, which gloo's ``all_to_all_single`` refuses as
        split sizes. Here a CPU tensor asked for ``as_numpy`` becomes the numpy array it would have been."""
        adapter = self

        def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
            if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
                adapter._record(module, "maybe_move_tensor_to_cpu(as_numpy)")
                return tensor.numpy()
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        return maybe_move_tensor_to_cpu

    def _host_get_rng_state(self, original, module: str):
        """Recomputation (Megatron's ``tensor_parallel.checkpoint``: ``recompute_granularity``) saves the
        CUDA generator's state beside the CPU's; a CPU run has only the CPU's, which the checkpoint saves
        and restores itself, so the "CUDA" state is the CPU's (restoring it again changes nothing)."""
        adapter = self

        def get_rng_state(device="cuda", clone=False, graph_safe=False):
            adapter._record(module, "_get_cuda_rng_state")
            return torch.get_rng_state()

        return get_rng_state

    def _host_set_rng_state(self, original, module: str):
        """The counterpart of `_host_get_rng_state`: nothing to set (the checkpoint restores the CPU's)."""
        adapter = self

        def set_rng_state(new_state, device=-1, graph_safe=False):
            adapter._record(module, "_set_cuda_rng_state")

        return set_rng_state

    def _tensor_cuda(self, original):
        adapter, modules = self, set(self.modules)

        def cuda(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in modules:
                adapter._record(caller, "Tensor.cuda")
                return tensor
            return original(tensor, *args, **kwargs)

        return cuda

    def _tensor_type(self, original):
        """``Tensor.type()`` (no arguments) asked from a listed module names a CPU tensor by its CUDA type
        string: Megatron's optimizers accept parameters only as 'torch.cuda.FloatTensor' and the like."""
        adapter, modules = self, set(self.modules)

        def type_(tensor, *args, **kwargs):
            name = original(tensor, *args, **kwargs)
            if args or kwargs or tensor.device.type != "cpu":
                return name
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in modules:
                adapter._record(caller, "Tensor.type")
                return name.replace("torch.", "torch.cuda.", 1)
            return name

        return type_

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            if name in ("Tensor.cuda", "Tensor.type"):
                setattr(torch.Tensor, name.split(".")[1], original)
            elif ":" in name:
                module_name, function = name.split(":")
                setattr(sys.modules[module_name], function, original)
            else:
                sys.modules[name].torch = original
        self._saved.clear()


_ACTIVE: CpuDeviceAdapter | None = None


@contextlib.contextmanager
def cpu_device_adapter(
    force: bool = False, device: torch.device | str | None = None
) -> Iterator[CpuDeviceAdapter | None]:
    """Redirect Megatron's CUDA call sites to the CPU inside the block when the run's ``device`` is the
    CPU (a CPU run on a GPU machine too); ``device`` None: when there is no GPU.

    Yields the adapter (or None for a CUDA run, unless ``force``). Nested use reuses the active adapter.
    """
    global _ACTIVE
    on_cpu = torch.device(device).type == "cpu" if device is not None else not torch.cuda.is_available()
    if not on_cpu and not force:
        yield None
        return
    if _ACTIVE is not None:
        yield _ACTIVE
        return
    adapter = CpuDeviceAdapter()
    adapter.install()
    _ACTIVE = adapter
    try:
        yield adapter
    finally:
        adapter.uninstall()
        _ACTIVE = None
