"""``python -m mcore_packing export``: a training checkpoint -> a Hugging Face folder (transformers, vLLM).

    python -m mcore_packing export --checkpoint outputs/local/sft/checkpoints --out my-model
    python -m mcore_packing export --checkpoint outputs/local/sft/checkpoints/step_000200 --out my-model --dtype float32

``--checkpoint`` is a step folder or the checkpoint folder (its ``latest`` step). One process reads every
rank's file (data-parallel rank 0, context-parallel rank 0 of each TP/PP position), merges the TP shards
of every pipeline stage (`megatron.hf_weights.merge_to_hf`) and writes config.json, safetensors shards
with their index and the tokenizer files of the folder the run was imported from. The model must be one
of the Hugging Face families (a run with ``model.hf_path``, or a recipe's family).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["export_checkpoint", "main"]


def _step_folder(path: Path) -> Path:
    if (path / "latest").is_file():
        return path / (path / "latest").read_text().strip()
    if not any(path.glob("rank*.pt")):
        raise FileNotFoundError(f"{path} is neither a checkpoint step folder (rank*.pt) nor holds a 'latest' pointer.")
    return path


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Write the Hugging Face folder of a training checkpoint; returns ``out``."""
    import torch

    from ..megatron.hf_folder import save_hf_folder
    from ..megatron.hf_weights import merge_to_hf
    from ..planning import ModelShape

    folder = _step_folder(Path(checkpoint))
    shards, layers, meta = {}, {}, None
    for path in sorted(folder.glob("rank*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=True)
        if "layout" not in state:
            raise ValueError(f"{path} was written before checkpoints recorded their layout; it cannot be exported.")
        layout, meta = state["layout"], state
        if layout["dp_rank"] == 0 and layout["cp_rank"] == 0:
            shards[(layout["pp_rank"], layout["tp_rank"])] = state["model"]
            layers[layout["pp_rank"]] = layout["layer_numbers"]
    tp, pp = meta["layout"]["tp_size"], meta["layout"]["pp_size"]
    missing = [(p, t) for p in range(pp) for t in range(tp) if (p, t) not in shards]
    if missing:
        raise ValueError(f"{folder} lacks the files of (pp, tp) ranks {missing}; the checkpoint is incomplete.")
    shape = ModelShape(**meta["model_shape"])
    return save_hf_folder(merge_to_hf(shards, layers, shape), shape, out, source=meta["hf_path"], dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_packing export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a checkpoint step folder, or the folder with 'latest'")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
