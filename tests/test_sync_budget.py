"""The sync budget: no call from mcore_packing's own frames that would make a GPU wait, inside the schedule's
forward step and loss, for SFT (token- and sequence-mean), DPO, GRPO/PPO (KL, dual clip, importance
sampling) and the log-prob pass, packed and dynamically batched, at CP1 (DP2) and CP2 (the built-in
attention's CP path): `sync_counter.SyncCounter` counts them on the CPU by what they are.

Megatron's own calls are pinned by site (megatron-core 0.16.1 and 0.19.2). Its unfused THD RoPE
(``rope_utils._apply_rotary_pos_emb_thd``, for q and for k in every layer of every packed micro-batch)
reads the cu_seqlens to the host (``tolist``) and compares the frequency table's length with
``cu_seqlens[-1]`` (0.16: the tensor's ``bool``; 0.19: its ``item``): 4 syncs per layer and THD
micro-batch, plus one ``item()`` per sequence of a row whose table is the whole row. With
TransformerEngine, ``apply_rope_fusion`` takes TE's fused kernel instead (`megatron.model`), and these are
gone. The rest are not syncs on a GPU: ``inv_freq`` moved to the GPU (once per run there; on
the CPU test bed it stays on the host, so at every forward) and, for BSHD rows under CP, a pinned
two-element index copied without blocking.

    python -m pytest -s tests/test_sync_budget.py     # prints every case's counts
    python -m tests.sync_workers                      # ... with where each call comes from
"""

from __future__ import annotations

import pytest

from .distributed_harness import run_distributed

pytestmark = pytest.mark.multirank

THD_ROPE = ("rope_utils.py", "_apply_rotary_pos_emb_thd")
# How each release compares the table's length with cu_seqlens[-1] (its other sync is the same .tolist()):
COMPARISON = {"0.16": "__bool__", "0.19": "item"}  # `if size == tensor:` / `if size == tensor.item():`


def _release() -> str:
    from mcore_packing.compat import megatron_core_version

    return ".".join(megatron_core_version().split(".")[:2])


def megatron_bound(site: tuple, row: dict) -> tuple[int, int]:
    """(least, most) calls Megatron's ``site`` may make in a case."""
    thd = row["forward_steps"] if "packing" in row["case"] else 0
    per_call = 2 * row["layers"] * thd  # q and k in every layer of every THD micro-batch
    offset_mode = per_call * 64  # 0.16 and 0.19: an .item() per sequence of a row whose table is the row
    comparison = COMPARISON[_release()]
    bounds = {
        (*THD_ROPE, "tolist"): (per_call, per_call),
        (*THD_ROPE, comparison): (per_call, per_call + (offset_mode if comparison == "item" else 0)),
        ("rotary_pos_embedding.py", "get_emb", "to"): (0, row["forward_steps"]),  # inv_freq: once per run on a GPU
        ("rope_utils.py", "get_pos_emb_on_this_cp_rank", "tensor"): (0, row["forward_steps"] if row["cp"] > 1 else 0),
    }
    if comparison != "item":
        bounds[(*THD_ROPE, "item")] = (0, offset_mode)
    return bounds.get(site, (0, 0))


@pytest.fixture(scope="module")
def counts():
    return run_distributed("tests.sync_workers:sync_budget_worker", 2, timeout=900)[0]


def test_no_sync_from_our_frames_in_the_forward_step_and_loss(counts):
    for row in counts:
        print(f"cp={row['cp']} {row['case']:<26} forward steps {row['forward_steps']:>2}: mcore_packing "
              f"{row['ours']}, megatron {row['megatron']}, other {row['other']}")  # fmt: skip
    assert {row["cp"] for row in counts} == {1, 2} and len(counts) == 20
    assert all(row["forward_steps"] > 0 for row in counts)
    offenders = {f"cp={row['cp']} {row['case']}": row["ours_where"] for row in counts if row["ours"] or row["other"]}
    assert offenders == {}, offenders


def test_megatron_calls_are_pinned_by_site(counts):
    for row in counts:
        for site, n in row["megatron_sites"].items():
            least, most = megatron_bound(site, row)
            assert least <= n <= most, (row["cp"], row["case"], site, n, row["megatron_where"])
        for site in ((*THD_ROPE, "tolist"), (*THD_ROPE, COMPARISON[_release()])):
            least, most = megatron_bound(site, row)
            assert least <= row["megatron_sites"].get(site, 0) <= most, (row["case"], site)


def test_counter_sees_the_syncs_a_loss_could_make():
    """Negative control: the counter charges a mask read to the host, a host tensor made in the step and a
    copy to a device to the frame that made them (here, this test, as ``other``)."""
    import torch

    from .sync_counter import SyncCounter

    counter = SyncCounter()
    mask = torch.ones(4)
    with counter:
        if mask.sum() > 0:  # what PerSample did per sample
            torch.tensor([1.0]).to("cpu")
        mask[mask > 0]  # a data-dependent size
        mask[mask > 0] = 0.0  # a masked fill: no wait
    kinds = sorted(kind for (owner, kind, *_), n in counter.counts.items() for _ in range(n) if owner == "other")
    assert kinds == ["host_data", "sync", "sync", "transfer"], counter.counts


@pytest.mark.parametrize("mode, cp", [("packing", 1), ("packing", 2), ("dynamic", 2)])
def test_a_micro_batch_reaches_the_device_in_one_transfer(mode, cp):
    """`prepare_micro_batch` on a device (``meta`` stands in for the GPU: it holds no data, so a read back
    would fail): every tensor there, through one non-blocking copy (pinned on CUDA: `thd.transfer`)."""
    import types

    import torch

    from mcore_packing.megatron.prepare import prepare_micro_batch
    from mcore_packing.planning import ParallelLayout, StepPlanConfig, plan_step
    from mcore_packing.thd import SequenceSample, StepTotals

    samples = [SequenceSample(list(range(n)), [0.0] * 2 + [1.0] * (n - 2)) for n in (5, 9, 14, 3)]
    plan = plan_step([len(s.tokens) for s in samples], StepPlanConfig(mode=mode, train_mb_tokens=64,
                                                                      layout=ParallelLayout(cp=cp)))  # fmt: skip
    group = types.SimpleNamespace(size=lambda: cp, rank=lambda: 0)
    pgs = types.SimpleNamespace(cp_size=cp, cp_rank=0, cp=group if cp > 1 else None)
    transfers = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if target is not None and torch.device(target).type != "cpu":
            transfers.append((torch.device(target).type, kwargs.get("non_blocking", False)))
        return original(self, *args, **kwargs)

    def prepare():
        return prepare_micro_batch(plan.micro_batches[0][0], samples, plan, pgs, totals=StepTotals(20, 4),
                                   normalization="token_mean", device=torch.device("meta"), segments=True)  # fmt: skip

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "to", to)
        prep = prepare()
    tensors = [prep.tokens, prep.labels, prep.loss_mask, prep.weights, prep.full_loss_mask, prep.segments]
    if prep.packed_seq_params is not None:
        tensors += [prep.packed_seq_params.cu_seqlens_q, prep.packed_seq_params.cu_seqlens_q_padded]
    assert all(t.device.type == "meta" for t in tensors)
    assert transfers == [("meta", True)], transfers  # host work (the CP split's indexing) stays on the host
