"""Inside a spawned gloo rank: a shared-prefix row through a tiny real GPTModel against each sequence alone.

The reference runs every sequence on its own through Megatron's stock DotProductAttention (local spec,
BSHD, an explicit causal mask): it shares no code with the shared-prefix path beyond the model's layers
and Megatron's RoPE.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from .megatron_workers import _grads, build_tiny_gpt, init_megatron


def _functional(rows, seed: int) -> torch.Tensor:
    """A fixed random weighting of each sequence's logits, defined per sequence and position (any layout)."""
    generator = torch.Generator().manual_seed(seed)
    return sum((row * torch.randn(row.shape, generator=generator)).sum() for row in rows)


def _shared_forward(model, row, attention, rotary, labels: bool) -> list[torch.Tensor]:
    """The row's per-sequence outputs (logits, or per-token losses with ``labels``), in sample order;
    ``attention`` edits the attached `SharedPrefixAttention` first (the controls)."""
    from mcore_packing.megatron import to_packed_seq_params
    from mcore_packing.megatron.shared_prefix import attach_shared_prefix, score_extra_rows

    params = attach_shared_prefix(to_packed_seq_params(row.batch), row, rotary, "cpu")
    if attention is not None:
        attention(params)
    kwargs = {"labels": row.labels} if labels else {}  # the row's targets and the extra ones
    extra = torch.tensor(row.extra_rows, dtype=torch.long) if labels else None
    with score_extra_rows(model, extra):
        output = model(row.batch.tokens, row.batch.position_ids, None, packed_seq_params=params, **kwargs)
    rows = row.sample_rows(output[0])
    return [rows[row.sample_ids.index(i)] for i in range(len(rows))]


def shared_prefix_worker(rank, world_size, cases):
    """World of 1. For each case (``tokens``: the sequences, ``groups``, ``prompts``, ``rule``): per-sequence
    logits, log-probs and parameter gradients of a fixed functional, from the shared-prefix row, from the
    ordinary packed row of the same sequences, and from one forward per sequence; and two controls: the
    context's keys left unrotated, and each later member attending to the previous member instead of the
    prompt."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter, get_packed_gpt_layer_spec, to_packed_seq_params
    from mcore_packing.megatron.shared_prefix import shared_prefix_of
    from mcore_packing.thd import PaddingRule, SequenceSample, build_packed_batch, unpack
    from mcore_packing.thd.shared_prefix import build_shared_prefix_row

    init_megatron()
    out = []
    with cpu_device_adapter():
        model = build_tiny_gpt(get_packed_gpt_layer_spec("local"), seed=0)
        reference_model = build_tiny_gpt(get_gpt_layer_local_spec(), seed=1)
        reference_model.load_state_dict(model.state_dict())
        for case in cases:
            seqs = [torch.tensor(t, dtype=torch.long) for t in case["tokens"]]
            samples = [SequenceSample(s, case["masks"][i]) for i, s in enumerate(seqs)]
            rule = PaddingRule(**case["rule"])
            row = build_shared_prefix_row(samples, case["groups"], case["prompts"], rule)

            def shared_forward(attention=None, rotary=model.rotary_pos_emb, labels=False, row=row):
                return _shared_forward(model, row, attention, rotary, labels)

            model.zero_grad(set_to_none=True)
            logits = shared_forward()
            _functional(logits, case["seed"]).backward()
            shared_grads = _grads(model)
            with torch.no_grad():
                losses = shared_forward(labels=True)
                unrotated = shared_forward(rotary=None)

                def previous_member(params):  # a later member sees the member before it, not the prompt
                    shared = shared_prefix_of(params)
                    context = list(shared.context_of)
                    members = [j for j, k in enumerate(context) if k >= 0]
                    for earlier, later in pairwise(members):
                        if context[earlier] == context[later]:
                            context[later] = earlier
                    object.__setattr__(shared, "context_of", tuple(context))

                crossed = shared_forward(previous_member)
            model.zero_grad(set_to_none=True)
            batch = build_packed_batch(samples, rule)
            packed = model(batch.tokens, batch.position_ids, None, packed_seq_params=to_packed_seq_params(batch))
            per_seq = unpack(packed[0], batch)
            packed_logits = [per_seq[i, : s.numel()] for i, s in enumerate(seqs)]
            _functional(packed_logits, case["seed"]).backward()
            packed_grads = _grads(model)
            reference_model.zero_grad(set_to_none=True)
            reference = []
            for s in seqs:
                n = s.numel()
                causal = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
                reference.append(reference_model(s[None], torch.arange(n)[None], causal)[0])
            _functional(reference, case["seed"]).backward()
            reference_grads = _grads(reference_model)
            reference_logprobs = [
                torch.log_softmax(r[:-1].detach(), -1).gather(-1, s[1:, None])[:, 0]
                for r, s in zip(reference, seqs, strict=True)
            ]
            out.append(
                {
                    "shared": [x.detach() for x in logits],
                    "packed": [x.detach() for x in packed_logits],
                    "reference": [x.detach() for x in reference],
                    "shared_logprobs": [-x[:-1] for x in losses],
                    "reference_logprobs": reference_logprobs,
                    "unrotated": unrotated,
                    "crossed": crossed,
                    "shared_grads": shared_grads,
                    "packed_grads": packed_grads,
                    "reference_grads": reference_grads,
                    "computed_tokens": row.computed_tokens,
                    "separate_tokens": row.separate_tokens,
                    "row_tokens": row.batch.total_tokens,
                    "packed_row_tokens": batch.total_tokens,
                }
            )
        out[0]["refusals"] = _refusals(model, reference_model, cases[0])
        for result, case in zip(out, cases, strict=True):  # the GPU's one varlen call, through a CPU stand-in
            result["varlen"] = _through_varlen_stand_in(model, case)
    return out


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False,
                     return_aux=None):  # fmt: skip
    """What torch documents ``varlen_attn`` to compute, on the CPU: span ``i`` of the queries attends to span
    ``i`` of the keys, causal aligned bottom-right (FlashAttention's since 2.1) when ``window_size=(-1, 0)``."""
    from torch.nn.attention.bias import causal_lower_right

    out = torch.zeros_like(q)
    for (a, b), (c, d) in zip(pairwise(cu_q.tolist()), pairwise(cu_k.tolist()), strict=True):
        if b == a:
            continue
        qs, ks, vs = (t.transpose(0, 1) for t in (q[a:b], k[c:d], v[c:d]))
        ks, vs = (t.repeat_interleave(qs.shape[0] // t.shape[0], dim=0) for t in (ks, vs))
        mask = causal_lower_right(b - a, d - c) if window_size == (-1, 0) else None
        attended = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        out[a:b] = attended.transpose(0, 1)
    return out


def _through_varlen_stand_in(model, case) -> list[torch.Tensor]:
    """The case's per-sequence logits with `PackedCoreAttention` on its GPU path (the gathered keys, one
    varlen call with separate query and key offsets), the kernel replaced by `_varlen_stand_in`."""
    from functools import partial

    import mcore_packing.megatron.attention as attention
    from mcore_packing.compat import varlen_attention
    from mcore_packing.thd import PaddingRule, SequenceSample
    from mcore_packing.thd.shared_prefix import build_shared_prefix_row

    samples = [SequenceSample(torch.tensor(t), m) for t, m in zip(case["tokens"], case["masks"], strict=True)]
    row = build_shared_prefix_row(samples, case["groups"], case["prompts"], PaddingRule(**case["rule"]))
    real = attention.varlen_attention, attention.PackedCoreAttention._use_varlen
    attention.varlen_attention = partial(varlen_attention, fn=_varlen_stand_in)
    attention.PackedCoreAttention._use_varlen = lambda self, q: True
    try:
        with torch.no_grad():
            return _shared_forward(model, row, None, model.rotary_pos_emb, False)
    finally:
        attention.varlen_attention, attention.PackedCoreAttention._use_varlen = real


def _refusals(model, stock_model, case) -> list[str]:
    """What the step driver says to a shared-prefix plan with a row-weighted loss, and with a model whose
    attention cannot read the layout (Megatron's stock attention)."""
    from mcore_packing.megatron import TokenMeanNLL
    from mcore_packing.megatron.schedule import _check_shared_prefix
    from mcore_packing.planning import SharedPrefix, StepPlanConfig, plan_step

    groups = [g for g, members in enumerate(case["groups"]) for _ in members]
    prompts = [case["prompts"][g] for g in groups]
    plan = plan_step([len(t) for t in case["tokens"]], StepPlanConfig(train_mb_tokens=256),
                     shared_prefix=SharedPrefix(group_ids=groups, prompt_lengths=prompts))  # fmt: skip
    messages = []
    for chunk, loss in ((model, TokenMeanNLL()), (stock_model, None)):
        try:
            _check_shared_prefix(chunk, plan, loss)
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    return messages
