"""``python -m mcore_packing export``: a training checkpoint -> a Hugging Face folder (transformers, vLLM).

    python -m mcore_packing export --checkpoint outputs/sft/latest/checkpoints --out my-model
    python -m mcore_packing export --checkpoint outputs/sft/latest/checkpoints/step_000200 --out my-model \
        --dtype float32

``--dtype`` defaults to the run's training dtype (``model.dtype``); config.json's ``dtype`` and
``torch_dtype`` both name the dtype of the stored tensors. A non-empty ``--out`` is refused unless
``--overwrite``; the folder is written next to it and renamed into place, so a failed export leaves
nothing half-written.

``--checkpoint`` is a step folder or the checkpoint folder (its newest complete step). One process builds
the model at TP1/PP1 (torch.distributed with a world of one, gloo), loads the distributed checkpoint into
it (Megatron joins the TP shards and pipeline stages, whatever layout wrote them), converts the names
(`megatron.hf_weights.merge_to_hf`) and writes config.json, safetensors shards with their index and the
tokenizer files of the folder the run was imported from. It needs memory for the whole model. The model
must be one of the Hugging Face families (a run with ``model.hf_path``, or a recipe's family). A reward
model (``algorithm=rm``) is written as the family's ``*ForSequenceClassification`` with one label:
``score.weight`` instead of ``lm_head.weight`` (transformers reads the score at each sequence's last
non-padding token; set ``pad_token_id`` in config.json to score padded batches).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["build_parser", "export_checkpoint", "main"]


def _step_folder(path: Path) -> Path:
    from .checkpoint import MANIFEST, find_checkpoint

    if (path / MANIFEST).is_file():
        return path
    found = find_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"{path} is neither a checkpoint step folder ({MANIFEST}) nor holds a complete one.")
    return found


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, dtype: str | None = None,
                      overwrite: bool = False) -> Path:  # fmt: skip
    """Write the Hugging Face folder of a training checkpoint; returns ``out``. ``dtype`` None: the run's
    training dtype. Starts torch.distributed (a world of one) when it is not running; call it from a
    process without a parallel layout."""
    import torch

    from ..megatron import build_gpt_model, cpu_device_adapter, initialize_parallel
    from ..megatron.dist_checkpoint import load_training_state
    from ..megatron.hf_folder import save_hf_folder
    from ..megatron.hf_weights import merge_to_hf
    from ..planning import ModelShape
    from ..planning.hf_config import HF_FAMILIES, check_output_folder
    from .checkpoint import read_manifest
    from .model_setup import init_distributed

    check_output_folder(out, overwrite=overwrite)  # before the model is loaded
    folder = _step_folder(Path(checkpoint))
    manifest = read_manifest(folder)
    shape = ModelShape(**manifest["model_shape"])
    if shape.family not in HF_FAMILIES:  # before the model is loaded
        raise ValueError(
            f"{folder} holds a model.family={shape.family} model (Megatron's own layout: LayerNorm, biases on every "
            f"linear), which no Hugging Face architecture matches exactly; only runs of a Hugging Face family "
            f"({', '.join(sorted(HF_FAMILIES))}: model.hf_path, or a recipe's model) export."
        )
    dtype = dtype or manifest["config"]["model"]["dtype"]
    head = "reward" if manifest["config"].get("algorithm") == "rm" else "lm"  # a reward model: its score head
    init_distributed("gloo")
    with cpu_device_adapter(force=True):
        initialize_parallel(seed=0)
        trained_dtype = getattr(torch, manifest["config"]["model"]["dtype"])
        model, _ = build_gpt_model(shape, dtype=trained_dtype, device="cpu", head=head)
        load_training_state(folder, model, None, restore_rng=False)
    layers = [layer.layer_number - 1 for layer in model.module.decoder.layers]
    hf = merge_to_hf({(0, 0): model.module.state_dict()}, {0: layers}, shape)
    return save_hf_folder(hf, shape, out, source=manifest["hf_path"], dtype=dtype, overwrite=overwrite, head=head)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mcore_packing export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", required=True, help="a checkpoint step folder, or the folder with 'latest'")
    parser.add_argument("--out", required=True, help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="the stored tensors' dtype (default: the run's training dtype, model.dtype)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .trainer import quiet_megatron_on_cpu

    quiet_megatron_on_cpu()
    try:
        out = export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
