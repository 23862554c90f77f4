"""Writing a Hugging Face model folder: ``config.json``, safetensors shards with their index, tokenizer files.

`save_hf_folder` takes full (merged) Hugging Face tensors, e.g. from `hf_weights.merge_to_hf`, and
writes what ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load: shards of at most
``max_shard_bytes`` (``model.safetensors`` when one is enough, else ``model-0000i-of-0000n.safetensors``
plus ``model.safetensors.index.json``), ``config.json`` with ``torch_dtype``, and the tokenizer and
generation files copied from the folder the model was imported from. The files appear under their final
names only when complete (written to a temporary name first, then renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from ..planning.hf_config import check_output_folder, hf_config_from_shape, read_hf_config
from ..planning.model_shape import ModelShape

__all__ = ["TOKENIZER_FILES", "save_hf_folder"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    return [*shards, current] if current else shards


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save_hf_folder(
    tensors: dict[str, torch.Tensor],
    shape: ModelShape,
    out: str | Path,
    *,
    source: str | Path | None = None,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 5 * 2**30,
    overwrite: bool = False,
    head: str = "lm",
) -> Path:
    """Write ``tensors`` as a Hugging Face folder for ``shape``; ``source`` (the imported folder) supplies
    the tokenizer files and the config fields this library does not model (token ids, ...). Written into a
    temporary sibling folder and renamed into place, so a failed export leaves nothing half-written; a
    non-empty ``out`` is refused unless ``overwrite``. ``head="reward"``: a reward model, written as the
    family's ``*ForSequenceClassification`` with one label (``score.weight``; no ``lm_head``)."""
    import tempfile

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}.")
    out = Path(out)
    check_output_folder(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_folder(tensors, shape, staging, source, dtype, max_shard_bytes, head)
        if out.exists():
            retired = out.with_name(f".{out.name}.replaced-{staging.name.rsplit('-', 1)[-1]}")
            os.rename(out, retired)
            os.rename(staging, out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_folder(tensors, shape: ModelShape, out: Path, source, dtype: str, max_shard_bytes: int,
                  head: str = "lm") -> None:  # fmt: skip
    from safetensors.torch import save_file

    cast = {k: v.detach().to(_DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    shards = _shards(cast, max_shard_bytes)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for name, shard in zip(names, shards, strict=True):
        _atomic_write(out / name, lambda p, s=shard: save_file(s, str(p), metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in cast.values())},
            "weight_map": {t: n for n, s in zip(names, shards, strict=True) for t in s},
        }
        _atomic_write(out / "model.safetensors.index.json", lambda p: p.write_text(json.dumps(index, indent=2)))
    extra = read_hf_config(source) if source is not None else None
    config = hf_config_from_shape(shape, dtype=dtype, extra=extra)
    if head == "reward":  # one score per sequence, read at its last non-padding token
        config.update(architectures=[config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")],
                      num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})  # fmt: skip
    _atomic_write(out / "config.json", lambda p: p.write_text(json.dumps(config, indent=2)))
    for name in TOKENIZER_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, out / name)
