"""Worker for `test_seeded_init.py`: one model shape built on several layouts from one seed, each gathered
into Hugging Face tensors by the export path (`hf_weights.merge_to_hf`, which shares no code with
`seeded_init`), and a policy and its reference built one after the other."""

from __future__ import annotations

SHAPE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=51, normalization="RMSNorm", gated_mlp=True, linear_bias=False, qk_norm=True,
             family="qwen3")  # fmt: skip
"""Llama/Qwen-shaped (so the export path can gather it), an odd vocabulary (padded at TP2)."""

BUILDS = {
    "tp1": ({}, {}),
    "tp2": ({"tp": 2}, {}),
    "pp2": ({"pp": 2}, {}),
    "tp2 gpu branch": ({"tp": 2}, {"cpu_initialization": False}),  # Megatron makes the parameters "on the GPU"
    "tp2 gpu branch, Megatron's init": ({"tp": 2}, {"cpu_initialization": False, "init": "megatron"}),
    "tp1, Megatron's init": ({}, {"init": "megatron"}),
}


def _gathered(chunks, layout, shape) -> dict:
    """Every rank's shards merged into Hugging Face tensors (on every rank)."""
    import torch.distributed as dist

    from mcore_packing.megatron import ProcessGroups
    from mcore_packing.megatron.hf_weights import merge_to_hf

    pgs = ProcessGroups.from_megatron()
    module = chunks[0].module
    state = {k: v.detach().clone() for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    layers = [layer.layer_number - 1 for layer in module.decoder.layers]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pgs.pp_rank, dist.get_rank(pgs.tp), layers, state))
    shards = {(pp, tp): s for pp, tp, _, s in everyone}
    layer_numbers = {pp: numbers for pp, _, numbers, _ in everyone}
    return merge_to_hf(shards, layer_numbers, shape)


def init_worker(rank: int, world_size: int) -> dict:
    """{build: HF tensors} for every `BUILDS` entry, whether a reference built after the policy (same seed,
    Megatron's GPU branch) holds the policy's weights, and `_dynamic_cp_groups`."""
    import torch

    from mcore_packing.megatron import build_gpt_chunks, cpu_device_adapter, initialize_parallel
    from mcore_packing.planning import ModelShape, ParallelLayout

    shape = ModelShape(**SHAPE)
    out = {"builds": {}}
    with cpu_device_adapter():
        for name, (parallel, options) in BUILDS.items():
            layout = ParallelLayout(dp=world_size // (parallel.get("tp", 1) * parallel.get("pp", 1)), **parallel)
            initialize_parallel(layout, seed=5)
            chunks, _ = build_gpt_chunks(shape, layout, seed=7, device="cpu", **options)
            out["builds"][name] = _gathered(chunks, layout, shape)
        layout = ParallelLayout(tp=2)
        initialize_parallel(layout, seed=5)
        built = [build_gpt_chunks(shape, layout, seed=7, device="cpu", cpu_initialization=False)[0][0].module
                 for _ in range(2)]  # the policy, then its reference, on the GPU branch  # fmt: skip
        out["policy_equals_reference"] = all(
            torch.equal(a, b) for a, b in zip(built[0].parameters(), built[1].parameters(), strict=True)
        )
        out.update(_dynamic_cp_groups(shape))
    return out


def _dynamic_cp_groups(shape) -> dict:
    """`build_policy` under dynamic CP: the communicators the policy makes, those its reference makes when
    given the policy's groups (none), and whether the two start from the same weights."""
    import torch
    import torch.distributed as dist

    from mcore_packing.megatron import build_policy, initialize_parallel
    from mcore_packing.planning import ParallelLayout

    layout = ParallelLayout(cp=2)
    initialize_parallel(layout, seed=5)
    made, original = [], dist.new_group

    def counted(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    dist.new_group = counted
    try:
        policy = build_policy(shape, layout, device=torch.device("cpu"), seed=7, dynamic_cp=True)
        by_policy = len(made)
        reference = build_policy(shape, layout, device=torch.device("cpu"), seed=7, dynamic_cp=True,
                                 process_groups=policy.process_groups)  # fmt: skip
    finally:
        dist.new_group = original
    return {
        "groups_by_policy": by_policy, "groups_by_reference": len(made) - by_policy,
        "reference_shares_groups": reference.process_groups.dynamic_cp is policy.process_groups.dynamic_cp,
        "build_policy_equal": all(torch.equal(a, b) for a, b in zip(policy.model.parameters(),
                                                                    reference.model.parameters(), strict=True)),
    }  # fmt: skip
