"""Workers for the sliding-window and attention-sink test (they run inside spawned gloo ranks).

Reference (`window_reference_worker`, one process): Megatron's stock GPTModel with its stock
``DotProductAttention`` (local spec), ``window_size=(W - 1, 0)`` on every other layer
(``window_attn_skip_freq=2``: layers 1 and 3) and learnable sinks (``softmax_type="learnable"``,
Megatron's ``SoftmaxOne``), ONE SEQUENCE PER FORWARD, the token-mean NLL in plain torch. Megatron builds
the sliding-window mask and the sinks on the CUDA device; the reference builds the same mask on the CPU
here (``get_sliding_window_causal_mask``'s definition: key j visible to query i when i - left <= j <= i)
and the sinks with ``torch.cuda.current_device`` answering "cpu" while the model is built.
The sinks are drawn at scale 1 so they matter.

Under test (`window_step_worker`): `PackedCoreAttention` in the packed layer spec, the planner, the batch
builder and the schedule driver at DP, CP2 and TP2. ``negative="one_span"``: every packed row is attended
as one sequence (a window then reaches across the packed boundary).
"""

from __future__ import annotations

import torch

from .step_workers import (
    _init,
    build_gpt,
    build_stage,
    collect_full_grads,
    gather_results,
    load_sharded,
    model_config,
    sequence_logprobs,
    wrap_in_ddp,
)


def window_config(window: int, **layout):
    config = model_config(**layout)
    config.window_size = (window - 1, 0)
    config.window_attn_skip_freq = 2  # Megatron: windowed where layer_number % 2 != 0
    config.softmax_type = "learnable"
    return config


def _cpu_window_mask(sq, skv, window_size):
    """True where a query may NOT attend (Megatron's convention), on the tensor's device."""
    rows = torch.arange(skv - sq, skv)[:, None]
    keys = torch.arange(skv)[None]
    return ~((keys <= rows + window_size[1]) & (keys >= rows - window_size[0]))


def window_reference_worker(rank, world_size, samples, windows):
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mcore_packing.megatron import cpu_device_adapter

    fused_softmax.get_sliding_window_causal_mask = _cpu_window_mask  # the CUDA-only mask, on the CPU
    _init()
    out = {}
    with cpu_device_adapter():
        for window in windows:
            torch.manual_seed(0)
            current = torch.cuda.current_device
            torch.cuda.current_device = lambda: "cpu"  # DotProductAttention puts its sinks there
            try:
                model = build_gpt(window_config(window), get_gpt_layer_local_spec())
            finally:
                torch.cuda.current_device = current
            with torch.no_grad():
                for layer in model.decoder.layers:
                    layer.self_attention.core_attention.softmax_offset.normal_(0.0, 1.0)
            masks = [torch.tensor(s["loss_mask"], dtype=torch.float32) for s in samples]
            total = sum(m[1:].sum() for m in masks)
            logprobs = sequence_logprobs(model, [s["tokens"] for s in samples])  # one forward per sequence
            loss = sum(-(logp * m[1:]).sum() for logp, m in zip(logprobs, masks, strict=True)) / total
            loss.backward()
            out[window] = {
                "loss": float(loss.detach()),
                "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
                "state_dict": {k: v.clone() for k, v in model.state_dict().items() if v is not None},
            }
    return out


def _one_span(layout_fn):
    """Negative control: the row's spans merged into one (the window crosses packed boundaries)."""
    from mcore_packing.megatron import attention
    from mcore_packing.megatron.packed_seq import ThdLayout

    def merged(params):
        total = layout_fn(params).total
        return ThdLayout(padded_starts=(0,), padded_lengths=(total,), real_lengths=(total,))

    attention.thd_layout = merged
    return lambda: setattr(attention, "thd_layout", layout_fn)


def window_step_worker(rank, world_size, configs, samples, references):
    from megatron.core import parallel_state as ps

    from mcore_packing.megatron import ProcessGroups, attention, cpu_device_adapter, forward_backward, nll_loss
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample

    seq_samples = [SequenceSample(s["tokens"], s["loss_mask"]) for s in samples]
    lengths = [len(s["tokens"]) for s in samples]
    results = []
    for cfg in configs:
        tp, cp = cfg.get("tp", 1), cfg.get("cp", 1)
        _init(tp=tp, cp=cp)
        undo = _one_span(attention.thd_layout) if cfg.get("negative") == "one_span" else (lambda: None)
        with cpu_device_adapter():
            config = window_config(cfg["window"], tp=tp, cp=cp, sp=tp > 1)
            module = build_stage(config)
            load_sharded(module, references[cfg["window"]]["state_dict"], ps.get_tensor_model_parallel_rank(), tp, 0)
            ddp = wrap_in_ddp(config, module)
            layout = ParallelLayout(dp=world_size // (tp * cp), tp=tp, cp=cp, sequence_parallel=tp > 1)
            plan = plan_step(lengths, StepPlanConfig(mode="packing", train_mb_tokens=96, layout=layout))
            pgs = ProcessGroups.from_megatron()
            result = forward_backward(ddp, seq_samples, plan, pgs, loss=nll_loss("token_mean"), device="cpu")
            grads = collect_full_grads(ddp, 0)
            windows = [m.window for m in module.modules() if isinstance(m, attention.PackedCoreAttention)]
        undo()
        mine = grads if ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0 else {}
        merged, losses, _ = gather_results(world_size, mine, result.loss)
        results.append({"config": cfg, "loss": losses[0], "all_losses_equal": len(set(losses)) == 1, "grads": merged,
                        "windows": windows, "num_microbatches": result.num_microbatches})  # fmt: skip
        ps.destroy_model_parallel()
    return results if rank == 0 else None

