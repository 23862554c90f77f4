"""Inside spawned gloo ranks: what the real Megatron model keeps for the backward, measured on the CPU.

Method: every tensor autograd saves during a forward passes a saved-tensor hook; the hook records its
storage (by address, bytes once per storage; parameters excluded) in a holder that the graph keeps, and
the holder's release (when autograd frees the graph, after the backward) returns the bytes. The live total
over a step, and its peak, are the activations the step holds. Static terms: the parameters' bytes, the
DDP gradient buffers' and the optimizer state's after one step.
"""

from __future__ import annotations

import contextlib

import torch


class SavedBytes:
    """Bytes autograd holds for the backward, live and at their peak, while `hooks()` is active."""

    def __init__(self, exclude: set):
        self.exclude = exclude
        self.refs: dict = {}
        self.sizes: dict = {}
        self.live = 0
        self.peak = 0
        self.log: list = []

    def hooks(self):
        meter = self

        class Held:
            __slots__ = ("key", "tensor")

            def __init__(self, tensor):
                self.tensor = tensor
                storage = tensor.untyped_storage()
                self.key = storage.data_ptr()
                if self.key in meter.exclude:
                    self.key = None
                    return
                if meter.refs.get(self.key, 0) == 0:
                    meter.sizes[self.key] = storage.nbytes()
                    meter.live += storage.nbytes()
                    meter.peak = max(meter.peak, meter.live)
                    meter.log.append((tuple(tensor.shape), str(tensor.dtype), storage.nbytes()))
                meter.refs[self.key] = meter.refs.get(self.key, 0) + 1

            def __del__(self):
                if self.key is None:
                    return
                meter.refs[self.key] -= 1
                if meter.refs[self.key] == 0:
                    meter.live -= meter.sizes.pop(self.key)

        return torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.tensor)


def _shape(**overrides):
    from mcore_packing.planning import ModelShape

    fields = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                  vocab_size=250, max_sequence_length=2048, normalization="RMSNorm", gated_mlp=True, linear_bias=False)
    return ModelShape(**{**fields, **overrides})


def _static(chunks, optimizer) -> dict:
    """Measured static bytes: parameters, the DDP gradient buffers, the optimizer's state tensors."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]  # MoE: experts apart
    state = [t for opt in inner for per in opt.state.values() for k, t in per.items()
             if torch.is_tensor(t) and k != "step"]  # fmt: skip
    return {"params": sum(p.nbytes for c in chunks for p in c.parameters()),
            "grads": sum(b.grad_data.nbytes for c in chunks for b in c.buffers + c.expert_parallel_buffers),
            "optimizer": sum(t.nbytes for t in state)}  # fmt: skip


@contextlib.contextmanager
def _routed_tokens(model, counts: list):
    """Within the block, each MoE layer's experts append the number of tokens they received to ``counts``."""
    hooks = [m.register_forward_pre_hook(lambda _m, args: counts.append(int(args[0].shape[0])))
             for name, m in model.named_modules() if name.endswith("mlp.experts")]  # fmt: skip
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def memory_worker(rank, world_size, layouts, batches):
    """For each layout (``ParallelLayout`` fields, ``recompute``, ``shape``: `ModelShape` overrides; DP
    fills the world) and batch (``(mode, lengths)``):
    measured and predicted bytes. Without PP each of this rank's micro-batches' forward alone (what it
    saves); with PP the whole step through Megatron's schedule (the stage's peak of live saved bytes).
    Then the static terms after one optimizer step. Rows: (layout, mode, what, measured, predicted)."""
    from mcore_packing.megatron import (
        ProcessGroups,
        build_gpt_chunks,
        cpu_device_adapter,
        forward_backward,
        initialize_parallel,
        prepare_micro_batch,
    )
    from mcore_packing.megatron.optimizer import build_optimizer
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.planning.memory import (
        MemorySettings,
        activation_bytes,
        micro_batch_memory,
        stage_peak,
        static_bytes,
    )
    from mcore_packing.planning.memory_budget import memory_view
    from mcore_packing.thd import SequenceSample

    rows = []
    for entry in layouts:
        fields = {k: v for k, v in entry.items() if k not in ("recompute", "shape", "distributed_optimizer")}
        shape = _shape(**{**(entry.get("shape") or {})})
        recompute, sharded = entry.get("recompute"), bool(entry.get("distributed_optimizer"))
        settings = MemorySettings(dtype_bytes=4, grad_bytes=4, attention="sdpa-math", recompute=recompute or "none",
                                  distributed_optimizer=sharded)  # fmt: skip
        parts = fields.get("tp", 1) * fields.get("cp", 1) * fields.get("pp", 1)
        layout = ParallelLayout(**fields, dp=world_size // parts)
        initialize_parallel(layout)
        pgs = ProcessGroups.from_megatron()
        stage = pgs.pp_rank
        with cpu_device_adapter():
            chunks, _ = build_gpt_chunks(shape, layout, dtype=torch.float32, attention_backend="local", device="cpu",
                                         variable_seq_lengths=True, recompute=recompute,
                                         use_distributed_optimizer=sharded)  # fmt: skip
            model = chunks if layout.vpp > 1 else chunks[0]
            optimizer = build_optimizer(model, lr=1e-3, use_distributed_optimizer=sharded)
            params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
            for mode, lengths in batches:
                g = torch.Generator().manual_seed(sum(lengths))
                samples = [SequenceSample(torch.randint(0, shape.vocab_size, (n,), generator=g)) for n in lengths]
                plan = plan_step(lengths, StepPlanConfig(mode=mode, train_mb_tokens=max(256, max(lengths)),
                                                         layout=layout))  # fmt: skip
                mine = plan.for_rank(pgs.dp_rank)
                predict = [activation_bytes(shape, layout, settings, memory_view(plan, mb), stage=stage,
                                            cp_rank=pgs.cp_rank) for mb in mine]  # fmt: skip
                if layout.pp == 1:
                    for mb, terms in zip(mine, predict, strict=True):
                        prep = prepare_micro_batch(mb, samples, plan, pgs, totals=None, normalization=None,
                                                   device="cpu", segments=shape.is_moe)  # fmt: skip
                        meter, routed = SavedBytes(params), []
                        with meter.hooks(), _routed_tokens(model, routed):
                            loss = model.module(prep.tokens, prep.position_ids, None, labels=prep.labels,
                                                packed_seq_params=prep.packed_seq_params,
                                                **({"padding_mask": prep.padding_mask} if shape.is_moe else {}))
                        if shape.is_moe:  # the formula with the tokens the router sent here; the table's
                            exact = activation_bytes(shape, layout, settings, memory_view(plan, mb), stage=stage,
                                                     cp_rank=pgs.cp_rank, expert_tokens=routed)  # fmt: skip
                            rows.append((entry, mode, "activations (routed tokens as counted)", meter.peak,
                                         sum(exact.values())))  # fmt: skip
                            what = "activations (balanced routing: the planner's)"
                        else:
                            what = "activations"
                        rows.append((entry, mode, what, meter.peak, sum(terms.values())))
                        del loss
                else:
                    meter = SavedBytes(params)
                    for chunk in chunks:
                        chunk.zero_grad_buffer()
                    with meter.hooks():
                        forward_backward(model, samples, plan, pgs, device="cpu")
                    pairs = [[micro_batch_memory(shape, layout, settings, memory_view(plan, mb), stage=stage, chunk=v,
                                                 cp_rank=pgs.cp_rank) for v in range(layout.vpp)]
                             for mb in mine]  # fmt: skip
                    peak = stage_peak(pairs, layout, stage)
                    rows.append((entry, mode, f"stage {stage} peak ({len(mine)} micro-batches)", meter.peak, peak))
            optimizer.step()
            measured, predicted = _static(chunks, optimizer), static_bytes(shape, layout, settings, stage=stage)
            rows += [(entry, "-", name, measured[name], predicted[name]) for name in measured]
    return rows
