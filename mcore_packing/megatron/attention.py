"""A Megatron core-attention module for packed (THD) and padded (BSHD) batches, without TransformerEngine.

Megatron's own ``DotProductAttention`` refuses ``packed_seq_params``; this module takes its place in the
layer spec (`layer_spec.get_packed_gpt_layer_spec`) and keeps attention inside each sequence.

Backends, picked per call:
- CPU (or ``backend="sdpa"``): ``scaled_dot_product_attention`` per sequence over its real tokens.
  Padding positions get zeros (they are masked out of the loss and no real token attends to them).
- CUDA with ``torch.nn.attention.varlen.varlen_attn`` (``backend="varlen"``, the default on GPU): one
  FlashAttention varlen call over the padded spans.
- Context parallel (CP > 1): the rank holds chunks r and 2*CP-1-r of every sequence. K and V are
  all-gathered over the CP group (differentiable), put back in sequence order (an index that came with
  the micro-batch), and each local chunk attends to the keys up to its end, causal aligned bottom-right:
  two attention calls per sequence, no mask built, no host sync.

Sliding windows and attention sinks (GPT-OSS's; Mistral's and Mixtral's windows): a layer Megatron's config
gives a window (``window_size=(left, 0)``, per layer by ``window_attn_skip_freq``) lets a query at ``i`` of its
sequence see keys ``i - left .. i`` of that sequence only: the positions are the sequence's own, so a window
never reaches across a packed boundary, and under CP (bottom-right alignment over the gathered keys) it
is applied to the sequence's global positions. ``softmax_type="learnable"`` gives every head a learned
sink logit (``softmax_offset``, Megatron's name and TP split) added to the softmax's denominator;
"off-by-one" a sink of 0. Sink layers, and windowed layers on the CPU or under CP, run an explicit softmax
per sequence (queries in blocks, keys cut to the window): FlashAttention's varlen call has no sink. A window
without sinks on a GPU is the varlen call's own ``window_size=(left, 0)`` (torch releases that take it).

With TransformerEngine installed, `get_packed_gpt_layer_spec` uses TE's attention instead of this module.
Only causal self-attention (GPT) is supported; dropout uses torch's RNG (no TP RNG tracker fork).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..compat import require_megatron, varlen_attention, varlen_attn_available, varlen_attn_takes_window
from ..thd.context_parallel import all_gather_cat, bshd_inverse_order
from .packed_seq import ThdLayout, cp_inverse_index, thd_layout
from .shared_prefix import SharedPrefixAttention, shared_prefix_of

require_megatron()
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402

__all__ = ["BACKENDS", "PackedCoreAttention"]

BACKENDS = ("auto", "sdpa", "varlen")


class PackedCoreAttention(MegatronModule):
    """Core attention honouring ``PackedSeqParams`` (THD) on any device; BSHD (dynamic batching) too."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        backend: str = "auto",
    ):
        super().__init__(config=config)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
        if attention_type != "self":
            raise ValueError(
                f"PackedCoreAttention supports self-attention only, got attention_type={attention_type!r}."
            )
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backend = backend
        self.window = _layer_window(config, layer_number)
        self._init_sinks(config, pg_collection)
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)

    def _init_sinks(self, config, pg_collection) -> None:
        """``softmax_offset``: one sink logit per head of this TP rank (learnable: a parameter split over TP
        like the heads; off-by-one: zeros), or None (vanilla softmax)."""
        kind = getattr(config, "softmax_type", "vanilla")
        tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        self.tp_group = tp
        if kind == "vanilla":
            self.softmax_offset = None
            return
        heads = config.num_attention_heads // (tp.size() if tp is not None else config.tensor_model_parallel_size)
        if kind == "off-by-one":
            self.register_buffer("softmax_offset", torch.zeros(heads, dtype=config.params_dtype), persistent=False)
            return
        if kind != "learnable":
            raise ValueError(f"softmax_type={kind!r}: PackedCoreAttention supports vanilla, off-by-one, learnable.")
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
        if config.perform_initialization:
            config.init_method(self.softmax_offset.data)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks split over TP along the heads (Megatron's ``DotProductAttention`` layout)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        if not isinstance(self.softmax_offset, torch.nn.Parameter):
            return {}
        state = self.state_dict(prefix="", keep_vars=True)
        dp_cp = (metadata or {}).get("dp_cp_group")
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=dp_cp)  # fmt: skip

    # -- helpers ---------------------------------------------------------------------------------------
    def _scale(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _sdpa(self, q, k, v):
        """Causal attention of q [Lq, Hq, D] to k/v [Lk, Hkv, D] -> [Lq, Hq, D], the queries being the last
        ``Lq`` positions of the ``Lk`` keys (a lower-right causal mask: TransformerEngine's and
        FlashAttention's bottom-right alignment). No mask is built here: equal lengths take SDPA's
        ``is_causal``, others torch's ``causal_lower_right`` bias, which CUDA kernels apply in place."""
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        if self.window is not None or self.softmax_offset is not None:
            return self._explicit(q, k, v)
        square = q.shape[0] == k.shape[0]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=None if square else causal_lower_right(q.shape[0], k.shape[0]),
            dropout_p=self._dropout(),
            is_causal=square,
            scale=self._scale(q.shape[-1]),
        )
        return out.transpose(0, 1)

    def _explicit(self, q, k, v, block: int = 1024):
        """`_sdpa` with a sliding window and/or sinks: an explicit fp32 softmax over each block of queries,
        the keys cut to those the block can see (bottom-right causal, ``window`` to the left), the heads'
        sink logits appended to the scores and dropped after the softmax."""
        first = k.shape[0] - q.shape[0]  # the first query's position among the keys
        out = torch.empty_like(q)
        sink = None if self.softmax_offset is None else self.softmax_offset.float().reshape(-1, 1, 1)
        for lo in range(0, q.shape[0], block):
            hi = min(lo + block, q.shape[0])
            positions = torch.arange(first + lo, first + hi, device=q.device)
            start = 0 if self.window is None else max(0, first + lo - self.window[0])
            keys = torch.arange(start, first + hi, device=q.device)
            allowed = keys[None] <= positions[:, None]
            if self.window is not None:
                allowed &= keys[None] >= positions[:, None] - self.window[0]
            scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k[start : first + hi].float())
            scores = (scores * self._scale(q.shape[-1])).masked_fill(~allowed, float("-inf"))
            if sink is not None:
                scores = torch.cat([scores, sink.expand(-1, hi - lo, 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., : keys.numel()]
            probs = F.dropout(probs, p=self._dropout(), training=self.training)
            out[lo:hi] = torch.einsum("hqk,khd->qhd", probs.to(v.dtype), v[start : first + hi])
        return out

    def _check_mask_type(self, attn_mask_type) -> None:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"PackedCoreAttention implements causal attention only, got {mask_type}.")

    # -- forward ---------------------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not support attention_bias.")
        self._check_mask_type(attn_mask_type)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            out = self._thd(query, key, value, packed_seq_params)
            return out.reshape(out.shape[0], -1)
        return self._bshd(query, key, value, self._micro_batch_group(packed_seq_params))

    def _micro_batch_group(self, params):
        """The micro-batch's CP group: ``params.cp_group`` (`to_packed_seq_params` / `bshd_cp_params` set it:
        the run's, or under dynamic CP the row's sub-group; ``local_cp_size=1`` without a group: no CP for
        this micro-batch), else the one this module was built with. None: no CP."""
        if params is None:
            return self.cp_group
        group = getattr(params, "cp_group", None)
        if group is None and getattr(params, "local_cp_size", None) != 1:
            group = self.cp_group
        return group

    def _use_varlen(self, query: torch.Tensor) -> bool:
        if self.backend == "sdpa" or self.softmax_offset is not None:
            return False  # FlashAttention's varlen call has no sink: sink layers take the explicit path
        if self.window is not None and not varlen_attn_takes_window():
            return False  # a torch whose varlen_attn has no window_size
        if self.backend == "varlen":
            if not varlen_attn_available():
                raise RuntimeError("backend='varlen' needs torch.nn.attention.varlen.varlen_attn and a CUDA device.")
            return True
        # FlashAttention runs fp16/bf16 only: fp32 (e.g. exactness checks) takes SDPA per sequence.
        return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_attn_available()

    def _thd(self, q, k, v, params) -> torch.Tensor:
        layout = thd_layout(params)
        group = self._micro_batch_group(params)
        cp_size = group.size() if group is not None else 1
        shared = shared_prefix_of(params)
        if shared is not None:
            if cp_size > 1:
                raise ValueError(
                    "a shared-prefix row (grpo.shared_prefix) runs without context parallelism; set "
                    "parallel.cp=1 or grpo.shared_prefix=false."
                )
            return self._thd_shared_prefix(q, k, v, params, layout, shared)
        if cp_size == 1:
            if self._use_varlen(q):
                return self._thd_varlen(q, k, v, params, layout)
            out = torch.zeros_like(q)
            for start, n in zip(layout.padded_starts, layout.real_lengths, strict=True):
                if n == 0:  # a zero-length sequence of a fixed-shape row: no token
                    continue
                s = slice(start, start + n)
                out[s] = self._sdpa(q[s], k[s], v[s])
            return out
        return self._thd_context_parallel(q, k, v, params, layout, group)

    def _thd_shared_prefix(self, q, k, v, params, layout: ThdLayout, shared: SharedPrefixAttention) -> torch.Tensor:
        """A shared-prefix row (`thd.shared_prefix`): each segment's keys gathered as its context's (rotated
        back by the segment's key shift, `megatron.shared_prefix`) then its own; a segment's queries attend
        to them causally aligned bottom-right (a context or a plain sequence: to its own only). On a GPU one
        varlen call with separate query and key offsets; on the CPU SDPA per segment over its real tokens."""
        plan = shared.key_plan(layout, q.device)
        keys, values = shared.gathered_keys(k, v, plan, self.config, self.cp_group)
        if self._use_varlen(q):
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            if cu.device != q.device or cu.dtype != torch.int32:
                cu = cu.to(device=q.device, dtype=torch.int32)
            return varlen_attention(q, keys, values, cu, max(layout.padded_lengths), scale=self._scale(q.shape[-1]),
                                    cu_seqlens_k=plan.cu_keys, max_seqlen_k=plan.max_keys, left=self._left)  # fmt: skip
        out = torch.zeros_like(q)
        for j, (start, n) in enumerate(zip(layout.padded_starts, layout.real_lengths, strict=True)):
            if n == 0:
                continue
            first, through = plan.key_starts[j], plan.key_starts[j] + plan.context_lengths[j] + n
            out[start : start + n] = self._sdpa(q[start : start + n], keys[first:through], values[first:through])
        return out

    @property
    def _left(self) -> int:
        """The window's left extent for FlashAttention's ``window_size=(left, 0)``; -1 without a window."""
        return -1 if self.window is None else self.window[0]

    def _thd_varlen(self, q, k, v, params, layout: ThdLayout) -> torch.Tensor:
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if cu.device != q.device or cu.dtype != torch.int32:  # params built elsewhere
            cu = cu.to(device=q.device, dtype=torch.int32)
        scale = self._scale(q.shape[-1])
        return varlen_attention(q, k, v, cu, max(layout.padded_lengths), scale=scale, left=self._left)

    def _gather_kv(self, k, v, index: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather local K/V over CP (``group``, default this module's) and reorder to packed order with
        ``index`` (the inverse split, on the device)."""
        kv = torch.cat([k, v], dim=-1)
        full = all_gather_cat(kv, group if group is not None else self.cp_group)[index]
        return full[..., : k.shape[-1]], full[..., k.shape[-1] :]

    def _thd_context_parallel(self, q, k, v, params, layout: ThdLayout, group) -> torch.Tensor:
        """Each local chunk of each span attends to the span's keys up to the chunk's end (bottom-right
        causal): chunk ``p`` of ``c`` tokens sees keys ``[0, (p + 1) c)``. Spans, chunks and offsets are
        host ints from the layout; the gather index came with the micro-batch (`cp_inverse_index`)."""
        cp, rank = group.size(), group.rank()
        k_full, v_full = self._gather_kv(k, v, cp_inverse_index(params, cp, q.device), group)
        out = torch.empty_like(q)
        local = 0
        for start, span in zip(layout.padded_starts, layout.padded_lengths, strict=True):
            chunk = span // (2 * cp)
            if chunk == 0:  # a zero-length sequence (fixed-shape rows, TE's padding flag) holds no token
                continue
            for part in (rank, 2 * cp - 1 - rank):
                keys = slice(start, start + (part + 1) * chunk)
                s = slice(local, local + chunk)
                out[s] = self._sdpa(q[s], k_full[keys], v_full[keys])
                local += chunk
        return out

    def _bshd(self, q, k, v, group) -> torch.Tensor:
        """q [s, b, Hq, D] (the local CP part of each row when ``group`` has more than one rank) -> [s, b, Hq*D]."""
        s, b = q.shape[0], q.shape[1]
        cp = group.size() if group is not None else 1
        if cp == 1:
            out = torch.stack([self._sdpa(q[:, i], k[:, i], v[:, i]) for i in range(b)], dim=1)
            return out.reshape(s, b, -1)
        rank, chunk = group.rank(), s // 2
        k_full, v_full = self._gather_kv(k, v, bshd_inverse_order(s * cp, cp, device=q.device), group)
        parts = []
        for i, part in enumerate((rank, 2 * cp - 1 - rank)):  # this rank's two chunks, bottom-right causal
            rows, keys = slice(i * chunk, (i + 1) * chunk), slice(0, (part + 1) * chunk)
            parts.append(torch.stack([self._sdpa(q[rows, j], k_full[keys, j], v_full[keys, j]) for j in range(b)], 1))
        return torch.cat(parts).reshape(s, b, -1)


def _layer_window(config, layer_number: int) -> tuple[int, int] | None:
    """This layer's sliding window ``(left, 0)`` as Megatron decides it (``window_size``, per layer by
    ``window_attn_skip_freq``), or None (full causal attention)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = getattr(config, "window_size", None)
    if not is_layer_window_attention(window, getattr(config, "window_attn_skip_freq", None), layer_number):
        return None
    left, right = (int(w) for w in window)
    if right != 0 or left < 0:
        raise ValueError(f"window_size={tuple(window)}: causal attention takes (left >= 0, 0).")
    return left, right
