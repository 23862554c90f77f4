"""Hugging Face checkpoints into Megatron GPTModel (and back): logits equal the HF model's.

Tiny random models of each family (tests/hf_models.py) are saved with transformers, imported with
`mcore_packing.megatron.hf_weights`, and compared with the same model run by transformers, sequence by
sequence, in fp32: at TP=PP=1 and on real gloo ranks at TP=2 and PP=2, one sequence per forward and
packed THD rows. A converter with gate and up swapped must fail the same comparison, and so must a
GPT-OSS model without any one of its parts (window, sinks, YaRN, clamp, interleaved gate/up).

Every case runs in one spawn per world size (`CASES`; `tests.hf_workers.cases_worker` rebuilds
Megatron's parallel state between cases), so the ranks' start (torch and Megatron imported) is paid
three times, not once per case; each test reads its case's result.
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
GPT_OSS_PARTS = ["no_window", "no_sinks", "no_yarn", "no_clamp", "gate_up_halves"]
MOE_LAYOUTS = [("qwen3_moe", 1, 2, 1), ("qwen3_moe", 2, 1, 1), ("mixtral", 1, 2, 1), ("qwen2_moe", 2, 2, 1),
               ("qwen3_moe", 2, 1, 2), ("gpt_oss", 1, 2, 2)]  # fmt: skip
"""(family, tp, ep, pp) of the MoE imports (TP runs with sequence parallelism)."""
DENSE_LAYOUTS = [("qwen3", 2, 1), ("qwen3", 1, 2), ("llama_tied", 2, 1), ("llama_tied", 1, 2), ("qwen2", 2, 1),
                 ("qwen2", 1, 2), ("mistral", 2, 1)]  # fmt: skip
ROUND_TRIPS = [("qwen2", 2, 2), ("llama_tied", 2, 2), ("qwen3", 1, 1), ("qwen3_moe", 1, 2), ("mixtral", 1, 1),
               ("gpt_oss", 2, 1), ("mistral", 1, 1)]  # fmt: skip
SFT_EXPORTS = ["llama3", "qwen3", "qwen3_moe", "qwen2_moe", "gpt_oss"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _cases(folders: dict, broken: dict) -> dict:
    """Case id -> (world size, the case for `cases_worker`)."""
    cases = {}

    def add(key, world, worker, family, **kwargs):
        cases[key] = (world, {"worker": worker, "folder": str(folders[family]), **kwargs})

    for family in FAMILIES:
        add(("alone", family), 1, "logits", family, sequences=SEQUENCES)
    for family, tp, ep, pp in MOE_LAYOUTS:
        add(("moe", family, tp, ep, pp), tp * ep * pp, "logits", family, sequences=SEQUENCES, tp=tp, ep=ep, pp=pp,
            sp=tp > 1)  # fmt: skip
    for family, tp, pp in DENSE_LAYOUTS:
        add(("dense", family, tp, pp), tp * pp, "logits", family, sequences=SEQUENCES, tp=tp, pp=pp)
    add(("tp2_pp2",), 4, "logits", "qwen3", sequences=SEQUENCES, tp=2, pp=2)
    add(("gpt_oss_tp2",), 2, "logits", "gpt_oss", sequences=SEQUENCES, tp=2, sp=True, etp=1, bias_grads=True)
    add(("gpt_oss_cp2",), 2, "logits", "gpt_oss", sequences=SEQUENCES, cp=2, ep=2)
    add(("gpt_oss_parts",), 1, "variants", "gpt_oss", sequences=SEQUENCES, patches=GPT_OSS_PARTS)
    add(("mistral_no_window",), 1, "variants", "mistral", sequences=SEQUENCES, patches=["no_window"])
    for family in ("qwen3_moe", "qwen2_moe"):  # renormalized top-k, and softmax over all experts
        add(("flip_topk_norm", family), 1, "variants", family, sequences=SEQUENCES, patches=["flip_topk_norm"])
    add(("swap_gate_up",), 1, "logits", "llama3", sequences=SEQUENCES, patch="swap_gate_up")
    for family, tp, pp in ROUND_TRIPS:
        etp = 1 if family == "gpt_oss" else None  # GPT-OSS's biased experts: whole on every TP rank
        add(("round_trip", family, tp, pp), tp * pp, "round_trip", family, tp=tp, pp=pp, etp=etp,
            sp=family in ("qwen3_moe", "mixtral", "gpt_oss") and tp > 1)  # fmt: skip
    for family in SFT_EXPORTS:
        add(("sft_export", family), 1, "round_trip", family, sft_step=True, sequences=SEQUENCES)
    for name, folder in broken.items():
        cases[("load_error", name)] = (1, {"worker": "load_error", "folder": str(folder)})
    return cases


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    folders = {family: make_tiny(family, root / family) for family in FAMILIES}
    references = {family: hf_logits(folder, SEQUENCES) for family, folder in folders.items()}
    return folders, references


@pytest.fixture(scope="module")
def broken(checkpoints, tmp_path_factory):
    """A Qwen2 folder missing a tensor, a Llama-3 folder whose config.json disagrees with its weights, and
    the intact Qwen2 folder (the control)."""
    folders, _ = checkpoints
    root = tmp_path_factory.mktemp("broken")
    return {"missing": _broken_copy(folders["qwen2"], root / "missing", drop="model.layers.1.self_attn.k_proj.bias"),
            "wrong": _broken_copy(folders["llama3"], root / "wrong", config_changes={"intermediate_size": 80}),
            "intact": folders["qwen2"]}  # fmt: skip


class _Spawns:
    """The results of every case, one spawn per world size, started when a test first asks for one."""

    def __init__(self, cases: dict):
        self.cases, self.results = cases, {}

    def __call__(self, key) -> list:
        """Every rank's result of case ``key`` (a case that raised: RuntimeError with its traceback)."""
        world = self.cases[key][0]
        if world not in self.results:
            keys = [k for k, (w, _) in self.cases.items() if w == world]
            ranks = run_distributed("tests.hf_workers:cases_worker", world, timeout=1200.0,
                                    cases=[self.cases[k][1] for k in keys])  # fmt: skip
            self.results[world] = {k: [rank[i] for rank in ranks] for i, k in enumerate(keys)}
        found = self.results[world][key]
        errors = [r["error"] for r in found if "error" in r]
        if errors:
            raise RuntimeError(f"case {key} failed:\n{errors[0]}")
        return [r["ok"] for r in found]


@pytest.fixture(scope="module")
def spawns(checkpoints, broken):
    return _Spawns(_cases(checkpoints[0], broken))


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
def test_each_family_imports_with_hf_logits(checkpoints, spawns, family):
    result = spawns(("alone", family))[0]
    errors = check(result, checkpoints[1][family])
    assert errors["alone"] <= RTOL and errors["packed"] <= RTOL and errors["logprobs"] <= 1e-5, errors


@pytest.mark.multirank
@pytest.mark.parametrize(("family", "tp", "ep", "pp"), MOE_LAYOUTS)
def test_moe_families_import_at_expert_and_tensor_parallel_sizes(checkpoints, spawns, family, tp, ep, pp):
    """Experts split over EP ranks (each reads only its own experts' tensors) and over TP like a dense MLP
    (with sequence parallelism, which Megatron's MoE layer needs under TP), and over pipeline stages (the
    later stage's routers get this TP rank's share of the padding mask); the tokens of every sequence
    travel to their experts' ranks by Megatron's all-to-all and back."""
    results = spawns(("moe", family, tp, ep, pp))
    errors = check(results[0], checkpoints[1][family])
    assert all(e <= RTOL for e in errors.values()), (family, tp, ep, pp, errors)
    if ep > 1 and pp == 1:  # each rank read only its experts: fewer tensors than the whole checkpoint
        assert results[0]["stats"]["tensors_read"] < spawns(("alone", family))[0]["stats"]["tensors_read"]


@pytest.mark.multirank
def test_gpt_oss_at_tp2_with_whole_experts(checkpoints, spawns):
    """TP2 with sequence parallelism: attention (and its sinks) cut over the TP ranks, every expert whole on
    both (``etp=1``: Megatron has expert biases only there), each TP rank's tokens to its experts. The
    experts' fc2 bias gradients of one SFT step equal transformers' (Megatron alone sums them over TP after
    DDP summed them over the same ranks: twice the gradient, the negative control)."""
    import transformers

    folders, references = checkpoints
    result = spawns(("gpt_oss_tp2",))[0]
    errors = check(result, references["gpt_oss"])
    assert all(e <= RTOL for e in errors.values()), errors
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["gpt_oss"], dtype=torch.float32)
    targets = sum(len(s) - 1 for s in SEQUENCES)
    loss = sum(torch.nn.functional.cross_entropy(hf(torch.tensor([s])).logits[0, :-1], torch.tensor(s[1:]),
                                                 reduction="sum") for s in SEQUENCES if len(s) > 1) / targets
    loss.backward()
    want = hf.model.layers[0].mlp.experts.down_proj_bias.grad
    for case, bound in (("repaired", 1e-5), ("unrepaired", None)):
        got = result["bias_grads"][case]
        error = max(rel_err(got[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.bias"], want[e])
                    for e in range(len(want)))  # fmt: skip
        assert (error <= bound) if bound else (error > 0.5), (case, error)


@pytest.mark.multirank
def test_gpt_oss_at_cp2_with_its_experts_over_two_ranks(checkpoints, spawns):
    """CP2 x EP2 on two ranks: each sequence split into 4 chunks (a window of 4 and the sinks over the CP
    ranks' shares, YaRN at global positions), the experts' tokens moved by the all-to-all."""
    assert check(spawns(("gpt_oss_cp2",))[0], checkpoints[1]["gpt_oss"])["logprobs"] <= 1e-5


@pytest.mark.multirank
def test_negative_control_gpt_oss_without_each_of_its_parts_is_caught(checkpoints, spawns):
    result = spawns(("gpt_oss_parts",))[0]
    reference = checkpoints[1]["gpt_oss"]
    errors = {p: max(rel_err(a, b) for a, b in zip(result[p], reference, strict=True)) for p in GPT_OSS_PARTS}
    assert all(e > 100 * RTOL for e in errors.values()), errors


@pytest.mark.multirank
def test_negative_control_mistral_without_its_window_is_caught(checkpoints, spawns):
    """Mistral's sliding window (4 tokens on every layer, sequences of up to 25) left out: far off."""
    result = spawns(("mistral_no_window",))[0]["no_window"]
    assert max(rel_err(a, b) for a, b in zip(result, checkpoints[1]["mistral"], strict=True)) > 100 * RTOL


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_negative_control_the_other_routing_normalization_is_caught(checkpoints, spawns, family):
    result = spawns(("flip_topk_norm", family))[0]["flip_topk_norm"]
    assert max(rel_err(a, b) for a, b in zip(result, checkpoints[1][family], strict=True)) > 100 * RTOL


@pytest.mark.multirank
@pytest.mark.parametrize(("family", "tp", "pp"), DENSE_LAYOUTS)
def test_tensor_and_pipeline_parallel_imports_match(checkpoints, spawns, family, tp, pp):
    errors = check(spawns(("dense", family, tp, pp))[0], checkpoints[1][family])
    assert all(e <= RTOL for e in errors.values()), (family, tp, pp, errors)


@pytest.mark.multirank
def test_tp2_pp2_together(checkpoints, spawns):
    results = spawns(("tp2_pp2",))
    errors = check(results[0], checkpoints[1]["qwen3"])
    assert errors["logprobs"] <= RTOL, errors
    # Stage 0: the embedding and layer 0 (11 tensors); stage 1: layer 1, final norm, lm_head. Never all 25.
    assert sorted(r["stats"]["tensors_read"] for r in results) == [12, 12, 13, 13]


@pytest.mark.multirank
def test_negative_control_swapped_gate_and_up_is_caught(checkpoints, spawns):
    errors = check(spawns(("swap_gate_up",))[0], checkpoints[1]["llama3"])
    assert errors["alone"] > 1e-2 and errors["packed"] > 1e-2, errors


def _merge(results, shape, expert_tp=None):
    from mcore_packing.megatron.hf_weights import merge_to_hf

    shards = {(r["pp_rank"], r["tp_rank"]): r["state"] for r in results if r["dp_rank"] == 0}
    layers = {r["pp_rank"]: r["layer_numbers"] for r in results}
    return merge_to_hf(shards, layers, shape, expert_tp=expert_tp)


@pytest.mark.multirank
@pytest.mark.parametrize(("family", "tp", "pp"), ROUND_TRIPS)
def test_import_then_export_is_bit_exact(checkpoints, spawns, tmp_path, family, tp, pp):
    from safetensors.torch import load_file

    from mcore_packing.megatron.hf_folder import save_hf_folder
    from mcore_packing.megatron.hf_weights import HFTensors
    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    folders, _ = checkpoints
    shape = shape_from_hf_config(read_hf_config(folders[family]))
    merged = _merge(spawns(("round_trip", family, tp, pp)), shape, expert_tp=1 if family == "gpt_oss" else None)
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
    written = HFTensors(out)
    assert all(torch.equal(written.read(k), original[k]) for k in original)
    assert shape_from_hf_config(read_hf_config(out)) == shape


@pytest.mark.multirank
@pytest.mark.parametrize("family", SFT_EXPORTS)
def test_after_a_packed_sft_step_the_export_loads_in_transformers(checkpoints, spawns, tmp_path, family):
    from mcore_packing.megatron.hf_folder import save_hf_folder
    from mcore_packing.planning.hf_config import read_hf_config, shape_from_hf_config

    folders, references = checkpoints
    shape = shape_from_hf_config(read_hf_config(folders[family]))
    (result,) = spawns(("sft_export", family))
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
def test_bad_checkpoints_fail_before_training_naming_the_tensor(spawns):
    errors = {name: spawns(("load_error", name))[0] for name in ("missing", "wrong", "intact")}
    assert "tensor 'model.layers.1.self_attn.k_proj.bias' is missing" in errors["missing"], errors["missing"]
    assert "model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp.up_proj.weight gives shape (192, 64)" in errors[
        "wrong"]  # fmt: skip
    assert "(160, 64)" in errors["wrong"], errors["wrong"]
    assert errors["intact"] is None  # the intact folder loads (the control for both)


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
