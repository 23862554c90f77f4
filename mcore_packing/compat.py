"""The one place that knows about optional dependencies and version differences.

- TransformerEngine: optional (``pip install 'mcore-packing[te]'``). Used when importable; never needed.
  `te_version` reads its version from the metadata (which rule it follows for packed rows: `te_contract`).
- megatron-core: 0.16 to 0.19. ``PackedSeqParams`` grew fields over releases (``total_tokens``,
  ``pad_between_seqs``); we detect fields instead of comparing versions. Its import warns four times that
  TE and Apex are absent (`MEGATRON_IMPORT_NOISE`); `quiet_megatron_imports` filters exactly those, since
  which attention backend runs is ours to say.
- torch: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen, CUDA only, fp16/bf16) when
  present. Its signature changed between releases (an ``is_causal`` flag first; keyword ``window_size``,
  ``scale`` and ``enable_gqa`` later); `varlen_attention` calls either. (Collectives, and torch's
  renamed all-gather among them, live in `mcore_packing.collectives`.)
- pyarrow: optional (``pip install 'mcore-packing[arrow]'``): ``prepare`` reads Parquet files and Hugging Face
  ``datasets`` folders (``save_to_disk``: Arrow stream files) through it; JSONL needs nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata

__all__ = [
    "MEGATRON_IMPORT_NOISE",
    "megatron_core_version",
    "packed_seq_params_fields",
    "quiet_megatron_imports",
    "require_megatron",
    "require_pyarrow",
    "te_available",
    "te_thd_partitioned_indices",
    "te_version",
    "varlen_attention",
    "varlen_attn_available",
]


@functools.lru_cache(maxsize=1)
def te_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (it needs CUDA and cuDNN)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # ImportError, or OSError/RuntimeError from missing CUDA libraries
        return False
    return True


def te_thd_partitioned_indices():
    """TransformerEngine's ``thd_get_partitioned_indices`` if TE is importable, else None."""
    if not te_available():
        return None
    try:
        import transformer_engine_torch as tex  # the C++ extension module
    except ImportError:
        return None
    return getattr(tex, "thd_get_partitioned_indices", None)


@functools.lru_cache(maxsize=1)
def varlen_attn_available() -> bool:
    """True when torch ships ``varlen_attn`` and a CUDA device is present to run it."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def varlen_attn_takes_window() -> bool:
    """True when torch's ``varlen_attn`` runs here and takes ``window_size`` (a sliding window in the kernel)."""
    import inspect

    if not varlen_attn_available():
        return False
    from torch.nn.attention.varlen import varlen_attn

    return "window_size" in inspect.signature(varlen_attn).parameters


def varlen_attention(q, k, v, cu_seqlens, max_seqlen: int, *, scale: float, causal: bool = True, fn=None,
                     cu_seqlens_k=None, max_seqlen_k: int | None = None, left: int = -1):  # fmt: skip
    """Variable-length attention over ``[T, H, D]`` tensors through whichever ``varlen_attn`` torch has.
    ``cu_seqlens_k`` / ``max_seqlen_k``: keys laid out with their own offsets (a shared-prefix row), the
    causal mask then aligned bottom-right in each span (FlashAttention's since 2.1); default the queries'.

    Newer releases take ``window_size=(-1, 0)`` for causal masking, ``scale`` and ``enable_gqa``; older
    ones take ``is_causal`` and neither of the others, so the default scale is checked against ``scale``
    and grouped K/V heads are repeated to the query heads. ``left`` >= 0: a causal sliding window, each query
    seeing itself and the ``left`` keys before it (``window_size=(left, 0)``; newer releases only). ``fn``
    replaces torch's function (tests).
    """
    import inspect
    import math

    if fn is None:
        from torch.nn.attention.varlen import varlen_attn as fn
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (left, 0) if causal else (-1, -1)
    elif left >= 0:
        raise RuntimeError(f"this torch's varlen_attn has no window_size, so no sliding window (left={left}); the "
                           "attention takes its explicit path instead (PackedCoreAttention checks "
                           "varlen_attn_takes_window).")  # fmt: skip
    else:
        kwargs["is_causal"] = causal
    if "scale" in params:
        kwargs["scale"] = scale
    elif not math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]), rel_tol=1e-6):
        raise RuntimeError(
            f"this torch's varlen_attn has no scale argument and softmax_scale={scale} is not 1/sqrt(head_dim); "
            "use PackedCoreAttention(backend='sdpa') or a newer torch."
        )
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if cu_seqlens_k is None:
        cu_seqlens_k, max_seqlen_k = cu_seqlens, max_seqlen
    return fn(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen, max_seqlen_k, **kwargs)


MEGATRON_IMPORT_NOISE = (".*Transformer Engine and Apex are not installed.*", ".*Apex is not installed.*")
"""The warnings megatron-core's modules give on import when TE and Apex are absent (the fallbacks they
name are what runs on such a machine; `te_available` and the attention backend say what we use)."""


def quiet_megatron_imports() -> None:
    """Filter `MEGATRON_IMPORT_NOISE` (only those messages) for the process: called where we import
    megatron-core, so a user's own script that imports `mcore_packing.megatron` sees none of them."""
    import warnings

    for pattern in MEGATRON_IMPORT_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)


def require_megatron():
    """Import megatron.core or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module("megatron.core")
    except ImportError as exc:
        raise ImportError(
            "mcore_packing's Megatron integration needs megatron-core (>=0.16,<0.20): pip install 'megatron-core'."
        ) from exc


def require_pyarrow():
    """Import pyarrow (with ``pyarrow.parquet``) or raise an ImportError that says how to install it."""
    try:
        importlib.import_module("pyarrow.parquet")
        return importlib.import_module("pyarrow")
    except ImportError as exc:
        raise ImportError(
            "reading Parquet files and Hugging Face datasets folders needs pyarrow: pip install "
            "'mcore-packing[arrow]' (or pyarrow>=14). JSONL input needs nothing more."
        ) from exc


@functools.lru_cache(maxsize=1)
def te_version() -> str | None:
    """The installed TransformerEngine's version (its distribution's metadata; TE need not import), or
    None. Cached: the packed-THD builder reads it for every micro-batch (`megatron.te_contract`)."""
    for name in ("transformer-engine", "transformer_engine", "transformer-engine-torch"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def megatron_core_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


@functools.lru_cache(maxsize=1)
def packed_seq_params_fields() -> frozenset[str]:
    """Field names of the installed ``megatron.core.packed_seq_params.PackedSeqParams``."""
    require_megatron()
    from megatron.core.packed_seq_params import PackedSeqParams

    return frozenset(f.name for f in dataclasses.fields(PackedSeqParams))
