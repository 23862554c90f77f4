"""Run a test function on N real torch.distributed (gloo, or NCCL on GPUs) processes and collect what each
rank returns.

The worker is named as ``"module:function"`` so the spawned interpreters can import it. Each rank
initializes a gloo process group that meets in a file of its own temporary folder (a TCP port picked
free can be taken by a neighbouring test before rank 0 binds it), calls the function with ``(rank, world_size,
**kwargs)``, and pickles its return value (or its traceback) to a temporary file.
"""

from __future__ import annotations

import importlib
import os
import pickle
import tempfile
import time
import traceback
import warnings

import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, target: str, kwargs: dict, out_dir: str, backend: str = "gloo") -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        rendezvous = "file://" + os.path.join(out_dir, "rendezvous")
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world_size)
        module_name, function_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), function_name)
        result = {"ok": fn(rank, world_size, **kwargs)}
    except BaseException:  # report everything to the parent, which fails the test
        result = {"error": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def _all_reported(out_dir: str, world_size: int) -> bool:
    return all(os.path.exists(os.path.join(out_dir, f"rank{rank}.pkl")) for rank in range(world_size))


def run_distributed(target: str, world_size: int, timeout: float = 600.0, backend: str = "gloo", **kwargs) -> list:
    """Run ``target`` on ``world_size`` ranks (gloo; ``backend="nccl"`` on GPUs, one per rank); return the
    per-rank results in rank order."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry,
            args=(world_size, target, kwargs, out_dir, backend),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if ctx.join(timeout=2):
                    break
            except mp.ProcessExitedException as exc:
                # A rank that died after writing its result (gloo can abort while tearing down a group
                # whose peer already left) is reported, not failed: the result is what the test checks.
                if not _all_reported(out_dir, world_size):
                    raise
                warnings.warn(f"{target}: {exc} after every rank reported its result", stacklevel=2)
                break
            if time.monotonic() > deadline:
                for process in ctx.processes:
                    process.kill()
                raise TimeoutError(f"{target} on {world_size} ranks did not finish in {timeout:.0f} s (hang?)")
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {target} wrote no result")
            with open(path, "rb") as f:
                result = pickle.load(f)
            if "error" in result:  # every failed rank's traceback: the first one is often a peer's echo
                errors.append(f"rank {rank} of {target} failed:\n{result['error']}")
            else:
                results.append(result["ok"])
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
