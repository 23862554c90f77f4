"""Hugging Face checkpoints into Megatron GPTModel (and back): logits equal the HF model's.

Tiny random models of each family (tests/hf_models.py) are saved with transformers, imported with
`mcore_packing.megatron.hf_weights`, and compared with the same model run by transformers, sequence by
sequence, in fp32: at TP=PP=1 and on real gloo ranks at TP=2 and PP=2, one sequence per forward and
packed THD rows. A converter with gate and up swapped must fail the same comparison, and so must a
GPT-OSS model without any one of its parts (window, sinks, YaRN, clamp, interleaved gate/up).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from .distributed_harness import run_distributed
from .hf_models import FAMILIES, hf_logits, make_tiny

RTOL = 1e-5
SEQUENCES = [[5, 17, 99, 3, 42, 7, 100, 0, 64], [1, 2], [88] * 5 + list(range(20, 40)), [7]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    folders = {family: make_tiny(family, root / family) for family in FAMILIES}
    references = {family: hf_logits(folder, SEQUENCES) for family, folder in folders.items()}
    return folders, references


def _logprobs(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for seq, row in zip(SEQUENCES, logits, strict=True):
        lp = torch.log_softmax(row.float(), -1)[:-1]
        out.append(lp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0])
    return out


def check(result: dict, reference: list[torch.Tensor]) -> dict:
    errors = {}
    for key in ("alone", "packed"):
        if key in result:
            errors[key] = max(rel_err(a, b) for a, b in zip(result[key], reference, strict=True))
    want = _logprobs(reference)
    errors["logprobs"] = max(
        float((result["logprobs"][i, : len(w)] - w).abs().max()) if len(w) else 0.0 for i, w in enumerate(want)
    )
    return errors


@pytest.mark.multirank
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_imports_with_hf_logits(checkpoints, family):
    folders, references = checkpoints
    result = run_distributed("tests.hf_workers:logits_worker", 1, folder=str(folders[family]), sequences=SEQUENCES)[0]
    errors = check(result, references[family])
    assert errors["alone"] <= RTOL and errors["packed"] <= RTOL and errors["logprobs"] <= 1e-5, errors


@pytest.mark.multirank
def test_gpt_oss_at_tp2_with_whole_experts(checkpoints):
    """TP2 with sequence parallelism: attention (and its sinks) cut over the TP ranks, every expert whole on
    both (``etp=1``: Megatron has expert biases only there), each TP rank's tokens to its experts. The
    experts' fc2 bias gradients of one SFT step equal transformers' (Megatron alone sums them over TP after
    DDP summed them over the same ranks: twice the gradient, the negative control)."""
    import transformers

    folders, references = checkpoints
    results = run_distributed("tests.hf_workers:logits_worker", 2, folder=str(folders["gpt_oss"]), sequences=SEQUENCES,
                              tp=2, sp=True, etp=1, bias_grads=True)  # fmt: skip
    errors = check(results[0], references["gpt_oss"])
    assert all(e <= RTOL for e in errors.values()), errors
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt_oss"], dtype=torch.float32)
    targets = sum(len(s) - 1 for s in SEQUENCES)
    loss = sum(torch.nn.functional.cross_entropy(hf(torch.tensor([s])).logits[0, :-1], torch.tensor(s[1:]),
                                                 reduction="sum") for s in SEQUENCES if len(s) > 1) / targets
    loss.backward()
    want = hf.model.layers[0].mlp.experts.down_proj_bias.grad
    for case, bound in (("repaired", 1e-5), ("unrepaired", None)):
        got = results[0]["bias_grads"][case]
        error = max(rel_err(got[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.bias"], want[e])
                    for e in range(len(want)))  # fmt: skip
        assert (error <= bound) if bound else (error > 0.5), (case, error)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("family", "tp", "ep", "pp"),
    [
        ("qwen3_moe", 1, 2, 1),
        ("qwen3_moe", 2, 1, 1),
        ("mixtral", 1, 2, 1),
        ("qwen2_moe", 2, 2, 1),
        ("qwen3_moe", 2, 1, 2),
        ("gpt_oss", 1, 2, 2),
    ],
)
def test_moe_families_import_at_expert_and_tensor_parallel_sizes(checkpoints, family, tp, ep, pp):
    """Experts split over EP ranks (each reads only its own experts' tensors) and over TP like a dense MLP
    (with sequence parallelism, which Megatron's MoE layer needs under TP), and over pipeline stages (the
    later stage's routers get this TP rank's share of the padding mask); the tokens of every sequence
    travel to their experts' ranks by Megatron's all-to-all and back."""
    folders, references = checkpoints
    results = run_distributed("tests.hf_workers:logits_worker", tp * ep * pp, folder=str(folders[family]),
                              sequences=SEQUENCES, tp=tp, ep=ep, pp=pp, sp=tp > 1)  # fmt: skip
    errors = check(results[0], references[family])
    assert all(e <= RTOL for e in errors.values()), (family, tp, ep, pp, errors)
    if ep > 1:  # each rank read only its experts: fewer tensors than the whole checkpoint
        assert results[0]["stats"]["tensors_read"] < run_distributed(
            "tests.hf_workers:logits_worker", 1, folder=str(folders[family]), sequences=SEQUENCES[:1]
        )[0]["stats"]["tensors_read"]


@pytest.mark.multirank
def test_gpt_oss_at_cp2_with_its_experts_over_two_ranks(checkpoints):
    """CP2 x EP2 on two ranks: each sequence split into 4 chunks (a window of 4 and the sinks over the CP
    ranks' shares, YaRN at global positions), the experts' tokens moved by the all-to-all."""
    folders, references = checkpoints
    results = run_distributed("tests.hf_workers:logits_worker", 2, folder=str(folders["gpt_oss"]), sequences=SEQUENCES,
                              cp=2, ep=2)  # fmt: skip
    assert check(results[0], references["gpt_oss"])["logprobs"] <= 1e-5


@pytest.mark.multirank
def test_negative_control_gpt_oss_without_each_of_its_parts_is_caught(checkpoints):
    folders, references = checkpoints
    patches = ["no_window", "no_sinks", "no_yarn", "no_clamp", "gate_up_halves"]
    (result,) = run_distributed("tests.hf_workers:variants_worker", 1, folder=str(folders["gpt_oss"]),
                                sequences=SEQUENCES, patches=patches)  # fmt: skip
    errors = {p: max(rel_err(a, b) for a, b in zip(result[p], references["gpt_oss"], strict=True)) for p in patches}
    assert all(e > 100 * RTOL for e in errors.values()), errors


@pytest.mark.multirank
def test_negative_control_the_other_routing_normalization_is_caught(checkpoints):
    folders, references = checkpoints
    for family in ("qwen3_moe", "qwen2_moe"):  # renormalized top-k, and softmax over all experts
        result = run_distributed("tests.hf_workers:logits_worker", 1, folder=str(folders[family]),
                                 sequences=SEQUENCES, patch="flip_topk_norm")[0]  # fmt: skip
        assert check(result, references[family])["alone"] > 100 * RTOL, family


@pytest.mark.multirank
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
@pytest.mark.parametrize("family", ["qwen3", "llama_tied", "qwen2"])
def test_tensor_and_pipeline_parallel_imports_match(checkpoints, family, tp, pp):
    folders, references = checkpoints
    results = run_distributed(
        "tests.hf_workers:logits_worker", tp * pp, folder=str(folders[family]), sequences=SEQUENCES, tp=tp, pp=pp
    )
    errors = check(results[0], references[family])
    assert all(e <= RTOL for e in errors.values()), (family, tp, pp, errors)


@pytest.mark.multirank
def test_tp2_pp2_together(checkpoints):
    folders, references = checkpoints
    results = run_distributed(
        "tests.hf_workers:logits_worker", 4, folder=str(folders["qwen3"]), sequences=SEQUENCES, tp=2, pp=2
    )
    errors = check(results[0], references["qwen3"])
    assert errors["logprobs"] <= RTOL, errors
    # Stage 0: the embedding and layer 0 (11 tensors); stage 1: layer 1, final norm, lm_head. Never all 25.
    assert sorted(r["stats"]["tensors_read"] for r in results) == [12, 12, 13, 13]


@pytest.mark.multirank
def test_negative_control_swapped_gate_and_up_is_caught(checkpoints):
    folders, references = checkpoints
    result = run_distributed(
        "tests.hf_workers:logits_worker", 1, folder=str(folders["llama3"]), sequences=SEQUENCES, patch="swap_gate_up"
    )[0]
    errors = check(result, references["llama3"])
    assert errors["alone"] > 1e-2 and errors["packed"] > 1e-2, errors


def _merge(results, shape, expert_tp=None):
    from mcore_packing.megatron.hf_weights import merge_to_hf

    shards = {(r["pp_rank"], r["tp_rank"]): r["state"] for r in results if r["dp_rank"] == 0}
    layers = {r["pp_rank"]: r["layer_numbers"] for r in results}
    return merge_to_hf(shards, layers, shape, expert_tp=expert_tp)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "family, tp, pp",
    [("qwen2", 2, 2), ("llama_tied", 2, 2), ("qwen3", 1, 1), ("qwen3_moe", 1, 2), ("mixtral", 1, 1), ("gpt_oss", 2, 1)],
)
def test_import_then_export_is_bit_exact(checkpoints, tmp_path, family, tp, pp):
    from safetensors.torch import load_file

    from mcore_packing.megatron.hf_folder import save_hf_folder
    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    folders, _ = checkpoints
    shape = shape_from_hf_config(read_hf_config(folders[family]))
    etp = 1 if shape.linear_bias else None  # GPT-OSS's biased experts: whole on every TP rank
    results = run_distributed("tests.hf_workers:round_trip_worker", tp * pp, folder=str(folders[family]), tp=tp, pp=pp,
                              etp=etp, sp=shape.is_moe and tp > 1)  # fmt: skip
    merged = _merge(results, shape, expert_tp=etp)
    original = load_file(str(folders[family] / "model.safetensors"))
    assert sorted(merged) == sorted(original)
    assert all(torch.equal(merged[k], original[k]) for k in original), [
        k for k in original if not torch.equal(merged[k], original[k])
    ]
    # Written as fp32 shards of at most 40 kB: an index and several files, each tensor intact.
    out = save_hf_folder(
        merged, shape, tmp_path / "out", source=folders[family], dtype="float32", max_shard_bytes=40_000
    )
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    from mcore_packing.megatron.hf_weights import HFTensors

    written = HFTensors(out)
    assert all(torch.equal(written.read(k), original[k]) for k in original)
    assert shape_from_hf_config(read_hf_config(out)) == shape


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_after_a_packed_sft_step_the_export_loads_in_transformers(checkpoints, tmp_path, family):
    from mcore_packing.megatron.hf_folder import save_hf_folder
    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    folders, references = checkpoints
    shape = shape_from_hf_config(read_hf_config(folders[family]))
    (result,) = run_distributed(
        "tests.hf_workers:round_trip_worker", 1, folder=str(folders[family]), sft_step=True, sequences=SEQUENCES
    )
    out = save_hf_folder(_merge([result], shape), shape, tmp_path / "out", source=folders[family], dtype="float32")
    reloaded = hf_logits(out, SEQUENCES)
    errors = [rel_err(a, b) for a, b in zip(result["logits"], reloaded, strict=True)]
    assert max(errors) <= RTOL, errors
    moved = max(rel_err(a, b) for a, b in zip(reloaded, references[family], strict=True))
    assert moved > 1e-3, moved  # the step changed the model: the comparison is not of two unchanged copies


def _broken_copy(src, dst, *, drop=None, config_changes=None):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if drop:
        tensors = load_file(str(dst / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.multirank
def test_bad_checkpoints_fail_before_training_naming_the_tensor(checkpoints, tmp_path):
    folders, _ = checkpoints
    missing = _broken_copy(folders["qwen2"], tmp_path / "missing", drop="model.layers.1.self_attn.k_proj.bias")
    wrong = _broken_copy(folders["llama3"], tmp_path / "wrong", config_changes={"intermediate_size": 80})
    errors = [
        run_distributed("tests.hf_workers:load_error_worker", 1, folder=str(folder))[0] for folder in (missing, wrong)
    ]
    assert "tensor 'model.layers.1.self_attn.k_proj.bias' is missing" in errors[0], errors[0]
    assert "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight gives shape (192, 64)" in errors[1]
    assert "(160, 64)" in errors[1], errors[1]
    # The intact folder loads (the control for both).
    assert run_distributed("tests.hf_workers:load_error_worker", 1, folder=str(folders["qwen2"]))[0] is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_count_of_the_shape_equals_the_checkpoints(checkpoints, family):
    from safetensors import safe_open

    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    folders, _ = checkpoints
    with safe_open(str(folders[family] / "model.safetensors"), framework="pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert shape_from_hf_config(read_hf_config(folders[family])).num_parameters() == stored


@pytest.mark.slow
def test_export_never_overwrites_or_half_writes_and_states_one_dtype(checkpoints, tmp_path, monkeypatch):
    """A non-empty folder is refused unless overwrite; a failed write leaves neither the folder nor a partial
    sibling; config.json's dtype and torch_dtype both name the stored tensors' dtype."""
    from safetensors import safe_open

    import mcore_packing.megatron.hf_folder as hf_folder
    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    source = checkpoints[0]["llama3"]
    shape = shape_from_hf_config(read_hf_config(source))
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    target = tmp_path / "user_model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # the user's own model lives here
    with pytest.raises(FileExistsError, match=r"exists and is not empty.*--overwrite"):
        hf_folder.save_hf_folder(tensors, shape, target, source=source, dtype="bfloat16")
    assert (target / "config.json").read_text() == "{}"  # untouched

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        hf_folder.save_hf_folder(tensors, shape, tmp_path / "fresh", source=source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_model"]  # nothing half-written left behind
    monkeypatch.undo()

    hf_folder.save_hf_folder(tensors, shape, target, source=source, dtype="bfloat16", overwrite=True)
    config = json.loads((target / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys()} == {"torch.bfloat16"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["user_model"]  # the replaced folder is gone too
