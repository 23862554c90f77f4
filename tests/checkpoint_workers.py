"""Workers for the resume tests: the real trainer (`mcore_packing.app.trainer.train`) called several times
inside one set of spawned gloo ranks, each call on its own TP/PP layout (Megatron's parallel state is
re-initialized per call), so one launch covers every layout."""

from __future__ import annotations

import shutil
from pathlib import Path

SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "data.num_samples=48",
    "data.max_sample_tokens=512",
    "data.long_samples=truncate",
    "data.vocab_size=512",
    "training.global_batch_size=8",
    "optimizer.lr=0.01",
    "optimizer.lr_warmup_iters=1",
    "optimizer.lr_decay_iters=4",  # the 2-step run follows the 4-step run's schedule
    "optimizer.weight_decay=0.01",
    "optimizer.clip_grad=0.5",  # low enough to clip: the clipping state matters for equality
    "sequence_packing.train_mb_tokens=1024",
    "logging.progress_bar=false",
]


def _train(run_dir: Path, *overrides: str) -> dict:
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import train

    cfg = compose_config(None, [*SMALL, f"run_dir={run_dir}", *overrides])
    summary = train(cfg)
    return {"losses": summary["losses"], "steps": summary["steps"], "sample_ids": summary["sample_ids"]}


def _copy_checkpoint(rank: int, source: Path, target: Path) -> None:
    import torch.distributed as dist

    if rank == 0:
        target.mkdir(parents=True)
        shutil.copytree(source, target / source.name)
    dist.barrier()


def _optimizer_override(distributed_optimizer: bool) -> str:
    return f"optimizer.use_distributed_optimizer={str(distributed_optimizer).lower()}"


def write_runs_worker(rank: int, world_size: int, *, root: str, distributed_optimizer: bool) -> dict:
    """Straight 4 steps, and 2 steps that leave a checkpoint at step 2, at (TP, PP, DP) = (1, 1, 2)."""
    from mcore_packing.compat import megatron_core_version

    root, opt = Path(root), _optimizer_override(distributed_optimizer)
    return {
        "straight": _train(root / "straight", "training.steps=4", opt),
        "first": _train(root / "first", "training.steps=2", opt),
        "megatron_core": megatron_core_version(),
    }


def resume_layouts_worker(rank: int, world_size: int, *, root: str, distributed_optimizer: bool, layouts, control,
                          written: dict | None = None):  # fmt: skip
    """`write_runs_worker`'s runs (or ``written``: its result from another process, e.g. another
    megatron-core, whose runs lie under ``root``); then for each layout, the 2-step checkpoint resumed there
    for steps 3-4. ``control`` adds a resume that loads the model but not the optimizer state (it must
    differ)."""
    import mcore_packing.megatron.dist_checkpoint as dc

    root, opt = Path(root), _optimizer_override(distributed_optimizer)
    if written is None:
        written = write_runs_worker(rank, world_size, root=str(root), distributed_optimizer=distributed_optimizer)
    out = dict(written)
    saved = root / "first" / "checkpoints" / "step_000002"
    for tp, pp in layouts:
        name = f"tp{tp}pp{pp}"
        _copy_checkpoint(rank, saved, root / name / "checkpoints")
        layout = [f"parallel.tp={tp}", f"parallel.pp={pp}"]
        out[name] = _train(root / name, "training.steps=4", "resume=true", opt, *layout)
    if control:
        _copy_checkpoint(rank, saved, root / "control" / "checkpoints")
        real = dc.load_training_state
        dc.load_training_state = lambda d, model, optimizer, restore_rng: real(d, model, None, restore_rng=restore_rng)
        try:
            out["control"] = _train(root / "control", "training.steps=4", "resume=true", opt)
        finally:
            dc.load_training_state = real
    return out


def adam_reference_worker(
    rank: int, world_size: int, *, distributed_optimizer: bool, clip: float, folder: str, steps: int = 3
):
    """Megatron's optimizer (built by `build_optimizer`) against Adam with decoupled weight decay and
    global-norm clipping written out in plain torch (float64), on the same gradients, for ``steps`` steps.
    Returns the largest relative parameter error, and the same for a reference that does not clip (the
    negative control) and Megatron's reported gradient norms next to the reference's. Then saves and loads
    the training state through dist_checkpointing, so the CUDA call sites the CPU adapter redirected on
    the whole optimizer + checkpoint path are recorded."""
    import math

    import torch

    from mcore_packing.megatron import build_gpt_model, cpu_device_adapter, initialize_parallel
    from mcore_packing.megatron.optimizer import build_optimizer, build_scheduler
    from mcore_packing.planning import ModelShape

    lr, wd, b1, b2, eps = 0.01, 0.1, 0.9, 0.95, 1e-8
    shape = ModelShape(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, max_sequence_length=64)
    from mcore_packing.megatron.dist_checkpoint import load_training_state, save_training_state

    with cpu_device_adapter() as adapter:
        initialize_parallel(seed=1)
        model, _ = build_gpt_model(shape, seed=1, device="cpu", use_distributed_optimizer=distributed_optimizer)
        optimizer = build_optimizer(model, lr=lr, weight_decay=wd, adam_beta1=b1, adam_beta2=b2, adam_eps=eps,
                                    clip_grad=clip, use_distributed_optimizer=distributed_optimizer)  # fmt: skip
        # The schedule sets each group's weight decay (Megatron exempts biases and norms through it).
        build_scheduler(optimizer, lr=lr, min_lr=lr, lr_decay_iters=steps, lr_decay_style="constant", weight_decay=wd)
        named = dict(model.module.named_parameters())
        references = {c: {n: p.detach().double().clone() for n, p in named.items()} for c in (True, False)}
        moments = {
            c: {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in references[c].items()} for c in (True, False)
        }
        norms = []
        for t in range(1, steps + 1):
            generator = torch.Generator().manual_seed(100 + t)  # the same gradients on every rank
            grads = {n: torch.randn(p.shape, generator=generator, dtype=torch.float64) for n, p in named.items()}
            model.zero_grad_buffer()
            for n, p in named.items():
                p.main_grad.copy_(grads[n])
            model.finish_grad_sync()
            _, megatron_norm, _ = optimizer.step()
            total = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
            norms.append((float(megatron_norm), total))
            for clipped in (True, False):
                scale = min(1.0, clip / (total + 1e-6)) if clipped and clip > 0 else 1.0
                for n, p in references[clipped].items():
                    g = grads[n] * scale
                    m, v = moments[clipped][n]
                    m.mul_(b1).add_(g, alpha=1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    if not (n.endswith(".bias") or p.dim() == 1):  # Megatron: no decay on biases and norms
                        p.mul_(1 - lr * wd)
                    denom = (v / (1 - b2**t)).sqrt().add_(eps)
                    p.addcdiv_(m / (1 - b1**t), denom, value=-lr)

        def error(reference):
            return max(float((named[n].detach().double() - r).norm() / r.norm()) for n, r in reference.items())

        result = {"error": error(references[True]), "unclipped_error": error(references[False]), "norms": norms}
        save_training_state(folder, model, optimizer)
        load_training_state(folder, model, optimizer, restore_rng=True)
        result["reloaded_error"] = error(references[True])
        result["call_sites"] = sorted(adapter.call_sites) if adapter is not None else []
        return result


def save_load_timing_worker(rank: int, world_size: int, *, root: str, repeats: int = 3):
    """The README's main job (the Hydra defaults) after one step: checkpoint size, save and load seconds
    (each the best of ``repeats``), through the trainer's own `Checkpointer`."""
    import time

    from mcore_packing.app.checkpoint import Checkpointer, data_fingerprint
    from mcore_packing.app.global_batches import GlobalBatchSampler
    from mcore_packing.app.model_setup import default_device, device_context, setup_training
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run
    from mcore_packing.megatron import nll_loss, train_step
    from mcore_packing.planning import plan_step

    cfg = compose_config(None, [f"run_dir={root}", "logging.progress_bar=false"])
    inputs = prepare_run(cfg, world_size)
    sampler = GlobalBatchSampler(len(inputs.lengths), cfg.training.global_batch_size, cfg.training.seed)
    with device_context(default_device()):
        setup = setup_training(cfg, inputs.shape)
        ids = sampler.next_batch()
        plan = plan_step([inputs.lengths[i] for i in ids], inputs.step_config)
        loss = nll_loss(cfg.training.loss_normalization)
        train_step(setup.policy, [inputs.data.samples[i] for i in ids], plan, loss=loss)
        checkpointer = Checkpointer(cfg, setup.rank, inputs.layout, data_fingerprint(inputs.data.samples))
        saves, loads = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            folder = checkpointer.save(1, setup, sampler)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpointer.load(folder, setup, sampler)
            loads.append(time.perf_counter() - start)
    size = sum(p.stat().st_size for p in folder.iterdir())
    params = sum(p.numel() for p in setup.policy.model.parameters())
    return {"bytes": size, "parameters": params, "save_s": min(saves), "load_s": min(loads)}


INTERLEAVED = ["parallel.pp=2", "parallel.vpp=2"]
DYNAMIC = ["sequence_packing.enabled=false", "dynamic_batching.enabled=true", "dynamic_batching.train_mb_tokens=1024",
           "parallel.variable_seq_lengths=true"]  # fmt: skip


def interleaved_resume_worker(rank: int, world_size: int, *, root: str) -> dict:
    """The trainer at (PP, VPP) = (2, 2) against the same run at PP1 x DP2, through checkpoints both ways
    (4 layers: one per model chunk): a PP1 checkpoint of step 2 resumed interleaved, packed and dynamic;
    an interleaved checkpoint of step 2 resumed at PP1. Every run's steps 3-4 must be its straight run's."""
    root, layers = Path(root), "model.num_layers=4"
    out = {
        "straight": _train(root / "straight", "training.steps=4", layers),
        "first": _train(root / "first", "training.steps=2", layers),
        "straight_vpp": _train(root / "straight_vpp", "training.steps=4", layers, *INTERLEAVED),
        "first_vpp": _train(root / "first_vpp", "training.steps=2", layers, *INTERLEAVED),
    }
    resumes = {"vpp_packed": ("first", INTERLEAVED), "vpp_dynamic": ("first", [*INTERLEAVED, *DYNAMIC]),
               "pp1_from_vpp": ("first_vpp", [])}  # fmt: skip
    for name, (written, layout) in resumes.items():
        _copy_checkpoint(rank, root / written / "checkpoints" / "step_000002", root / name / "checkpoints")
        out[name] = _train(root / name, "training.steps=4", "resume=true", layers, *layout)
    return out
