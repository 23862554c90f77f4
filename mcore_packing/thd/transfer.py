"""One host-to-device transfer for all of a micro-batch's tensors.

A micro-batch is built on the host (tokens, labels, masks, positions, loss weights, cu_seqlens, the CP
gather index, ...): moving each tensor on its own costs one copy, and on CUDA one blocking stream
synchronization per pageable copy. `to_device_once` lays them out in one byte buffer (16-byte aligned,
pinned on CUDA), copies it with ``non_blocking=True`` and hands back views of the device copy with each
tensor's dtype and shape: one transfer, no synchronization. On the CPU the tensors are returned as they are.
"""

from __future__ import annotations

import torch

__all__ = ["to_device_once"]

_ALIGN = 16


def to_device_once(tensors: dict, device: torch.device | str) -> dict:
    """``tensors`` (name -> host tensor or None) on ``device`` through one transfer; None stays None."""
    device = torch.device(device)
    if device.type == "cpu":
        return dict(tensors)
    items = [(name, t.contiguous()) for name, t in tensors.items() if t is not None]
    offsets, total = [], 0
    for _, t in items:
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for (_, t), start in zip(items, offsets, strict=True):
        if t.numel():
            buffer[start : start + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    moved = buffer.to(device, non_blocking=True)
    out = dict.fromkeys(tensors)
    for (name, t), start in zip(items, offsets, strict=True):
        piece = moved[start : start + t.numel() * t.element_size()]
        out[name] = piece.view(t.dtype).view(t.shape) if t.numel() else torch.empty(t.shape, dtype=t.dtype,
                                                                                     device=device)  # fmt: skip
    return out
