"""Mixture-of-Experts shapes (#23, first part; GPT-OSS #42): HF config.json <-> `ModelShape` for Qwen3-MoE,
Mixtral, Qwen2-MoE and GPT-OSS against transformers' own models (parameter counts and which layers are MoE), the refused
families, the published parameter counts of the recipes, the MoE cost model by hand, expert parallelism
in the layout, and the refusal of a balance loss that is not yet exact when packed."""

from __future__ import annotations

import pytest

from mcore_packing.planning import CostModel, ModelShape, ParallelLayout
from mcore_packing.planning.hf_config import hf_config_from_shape, shape_from_hf_config

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3],
                                         norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, num_experts=6, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=80)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=48, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8)),
}  # fmt: skip


def _hf_model(family: str):
    import transformers

    name, extra = FAMILIES[family]
    config = getattr(transformers, name)(**TINY, **extra)
    return config, transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shape_counts_and_places_experts_as_transformers_builds_them(family):
    config, model = _hf_model(family)
    shape = shape_from_hf_config(config.to_dict())
    assert shape.family == family and shape.is_moe
    layers = model.model.layers
    assert shape.moe_layers() == [hasattr(layer.mlp, "experts") for layer in layers]
    total = sum(p.numel() for p in model.parameters())
    assert shape.num_parameters() == total
    # active: a token uses top-k of the E experts of every MoE layer (router and shared expert always)
    experts = [layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts")]
    idle = sum(p.numel() for e in experts for p in e.parameters())
    idle = idle * (shape.num_experts - shape.moe_router_topk) // shape.num_experts
    assert shape.num_parameters(active=True) == total - idle
    unset = {"num_experts": None, "moe_ffn_hidden_size": None, "moe_shared_expert_size": None,
             "moe_shared_expert_gate": False, "moe_dense_layers": ()}  # fmt: skip
    dense = ModelShape(**{**shape.to_dict(), **unset})
    assert dense.num_parameters() != total  # control: the same shape without experts is another model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_json_round_trips_through_transformers(family):
    import transformers

    config, _ = _hf_model(family)
    shape = shape_from_hf_config(config.to_dict())
    written = hf_config_from_shape(shape, dtype="float32")
    assert written["architectures"] == [type(_hf_model(family)[1]).__name__]
    reread = getattr(transformers, FAMILIES[family][0])(**{k: v for k, v in written.items() if k != "model_type"})
    assert shape_from_hf_config(reread.to_dict()) == shape


def test_what_each_family_routes_like():
    qwen3 = shape_from_hf_config(_hf_model("qwen3_moe")[0].to_dict())
    assert qwen3.moe_dense_layers == (0, 2, 3) and qwen3.moe_router_topk_norm  # sparse step 2, layer 3 dense
    mixtral = shape_from_hf_config(_hf_model("mixtral")[0].to_dict())
    assert mixtral.expert_size == 48 and mixtral.moe_router_topk_norm and not mixtral.moe_dense_layers
    qwen2 = shape_from_hf_config(_hf_model("qwen2_moe")[0].to_dict())
    assert (qwen2.moe_shared_expert_size, qwen2.moe_shared_expert_gate, qwen2.moe_router_topk_norm) == (80, True, False)
    assert qwen2.qkv_bias


@pytest.mark.parametrize(
    ("config_class", "extra", "fragment"),
    [
        ("DeepseekV3Config", {}, "multi-head latent attention (kv_lora_rank=512)"),
        ("GptOssConfig", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config='mxfp4'"),
        ("GptOssConfig", {"swiglu_alpha": 1.0}, "swiglu_alpha=1.0 is not supported: Megatron's quick_gelu"),
        ("GptOssConfig", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 0.7,
                                              "original_max_position_embeddings": 64}}, "rope mscale=0.7"),
        ("MixtralConfig", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported"),
        ("Qwen2MoeConfig", {"sliding_window": 4096, "use_sliding_window": True}, "use_sliding_window=True is not"),
    ],
)
def test_families_that_do_not_convert_exactly_are_refused_naming_the_field(config_class, extra, fragment):
    import transformers

    with pytest.raises(ValueError, match=r"config\.json: ") as err:
        shape_from_hf_config(getattr(transformers, config_class)(**extra).to_dict())
    assert fragment in str(err.value)


# The model cards' published totals and activated parameters, in billions to the cards' one decimal
# (Qwen's 3.35B active is written "3.3B"): within 0.1B of the card is as exact as the source allows.
PUBLISHED = {"Qwen3-30B-A3B": (30.5, 3.3), "Mixtral-8x7B": (46.7, 12.9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_recipes_are_the_models_they_name(name):
    from mcore_packing.app.recipes import family_model

    shape = family_model(name).declared_shape(1)
    total, active = PUBLISHED[name]
    assert abs(shape.num_parameters() / 1e9 - total) < 0.1
    assert abs(shape.num_parameters(active=True) / 1e9 - active) < 0.1
    assert abs(shape.num_parameters(active=True) / 1e9 - total) > 10  # control: active is not the total


def test_the_moe_recipes_split_experts_over_expert_parallel_ranks(capsys):
    from mcore_packing.app.recipes import RECIPES
    from mcore_packing.app.train_command import main

    cfg = RECIPES["qwen3_30b_a3b_sft_packed"](num_nodes=2, gpus_per_node=8)
    assert (cfg.parallel.tp, cfg.parallel.ep) == (2, 8)
    assert RECIPES["mixtral_8x7b_sft_packed"]().parallel.ep == 8 // 4  # 16 GPUs / (TP4 x PP2): DP 2
    assert main(["--recipe", "qwen3_30b_a3b_sft_packed", "--dry-run", "data.num_samples=300"]) == 0
    out = capsys.readouterr().out
    assert '"ep": 4' in out and '"total": 30532122624' in out and '"active_per_token": 3353032704' in out


def test_the_moe_cost_model_counts_the_routed_experts_by_hand():
    shape = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                       vocab_size=100, normalization="RMSNorm", gated_mlp=True, linear_bias=False, num_experts=8,
                       moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_size=40,
                       moe_shared_expert_gate=True, moe_dense_layers=(1,))  # fmt: skip
    attention = 64 * (4 + 2 * 2) * 16 + 64 * 64  # q, k, v and the output projection
    moe_layer = 2 * 3 * 64 * 32 + 64 * 8 + 3 * 64 * 40 + 64  # two experts, router, shared expert and its gate
    dense_layer = 3 * 64 * 96
    linear = 3 * (2 * (2 * attention + moe_layer + dense_layer) + 2 * 64 * 100)
    model = CostModel.from_shape(shape)
    assert model.linear == linear and model.quadratic == 3 * 2 * 2 * 64
    all_experts = CostModel.from_shape(ModelShape(**{**shape.to_dict(), "moe_router_topk": 8}))
    assert all_experts.linear > model.linear  # control: routing to every expert costs more


def test_expert_parallelism_is_a_layout_dimension():
    layout = ParallelLayout.for_world(8, tp=2, ep=4, sequence_parallel=True)
    assert (layout.dp, layout.ep) == (4, 4)
    layout.check_experts(8)
    with pytest.raises(ValueError, match=r"needs parallel\.sequence_parallel=true"):
        ParallelLayout.for_world(8, tp=2, ep=4).check_experts(8)  # Megatron's MoE under TP needs SP
    with pytest.raises(ValueError, match="ep=4 must divide dp x cp = 1 x 2"):
        ParallelLayout.for_world(4, tp=2, cp=2, ep=4)
    with pytest.raises(ValueError, match=r"model\.num_experts=6 cannot be split over parallel\.ep=4"):
        layout.check_experts(6)
    with pytest.raises(ValueError, match="the model is dense"):
        layout.check_experts(None)
    ParallelLayout.for_world(4, tp=2, cp=2, ep=2, sequence_parallel=True).check_experts(6)  # control: EP over DP x CP


def test_gpt_oss_is_what_its_config_says_and_runs_at_tp1():
    config, _ = _hf_model("gpt_oss")
    shape = shape_from_hf_config(config.to_dict())
    assert (shape.window_size, shape.window_layers, shape.attention_sinks, shape.swiglu_limit) == (8, (0, 2), True, 7.0)
    assert (shape.yarn_factor, shape.yarn_original_max_position_embeddings, shape.yarn_truncate) == (32.0, 4096, False)
    assert shape.linear_bias and shape.qkv_bias and shape.moe_router_topk_norm and shape.window_per_layer() == [
        True, False, True, False]  # fmt: skip
    with pytest.raises(ValueError, match=r"parallel\.tp=2: this model's experts have biases"):
        ParallelLayout(tp=2, sequence_parallel=True).check_experts(4, biased=True)
    ParallelLayout(ep=2, cp=2).check_experts(4, biased=True)  # controls: TP1 with EP and CP; TP2 with whole experts
    ParallelLayout(tp=2, sequence_parallel=True, etp=1).check_experts(4, biased=True)
    with pytest.raises(ValueError, match=r"etp=3: expert tensor parallelism is 1"):
        ParallelLayout(tp=2, etp=3)
    with pytest.raises(ValueError, match=r"layer_types=\['chunked_attention'"):
        shape_from_hf_config({**config.to_dict(), "layer_types": ["chunked_attention"] * 4})
    qwen = shape_from_hf_config(_hf_model("qwen3_moe")[0].to_dict())
    with pytest.raises(ValueError, match=r"model\.family=qwen3_moe with model\.attention_sinks=True: the Hugging"):
        hf_config_from_shape(ModelShape(**{**qwen.to_dict(), "attention_sinks": True}))  # export would drop them


def test_gpt_oss_keys_are_checked_and_the_command_exits_2_before_megatron(tmp_path, capsys):
    """The shape keys GPT-OSS added, and from the command line (a dry run: nothing of Megatron starts) a
    GPT-OSS checkpoint at TP2 without ``parallel.etp=1`` and an ``etp`` that is neither 1 nor tp."""
    from mcore_packing.app.train_command import main

    from .hf_models import make_chat_model

    with pytest.raises(ValueError, match=r"model\.yarn_factor and model\.rope_scaling_factor are both set"):
        ModelShape(yarn_factor=4.0, rope_scaling_factor=8.0)
    with pytest.raises(ValueError, match=r"model\.window_layers holds \[5\]; layers are 0 to 1"):
        ModelShape(window_size=8, window_layers=[5])
    with pytest.raises(ValueError, match=r"model\.window_layers is set but model\.window_size is not"):
        ModelShape(window_layers=[0])
    with pytest.raises(ValueError, match=r"model\.swiglu_limit clamps a gated MLP: set model\.gated_mlp=true"):
        ModelShape(swiglu_limit=7.0)
    with pytest.raises(ValueError, match=r"model\.window_size"):
        ModelShape(window_size=0)
    assert ModelShape(window_size=8, window_layers=[1]).window_per_layer() == [False, True]  # control
    folder = make_chat_model(tmp_path / "gpt_oss", family="gpt_oss")
    tp2 = [f"model.hf_path={folder}", "parallel.tp=2", "parallel.sequence_parallel=true", "cluster.gpus_per_node=2",
           f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert main(["--dry-run", *tp2]) == 2
    assert "parallel.tp=2: this model's experts have biases (GPT-OSS)" in capsys.readouterr().err
    assert main(["--dry-run", *tp2, "parallel.etp=3"]) == 2
    assert "parallel.etp=3: expert tensor parallelism is 1 (whole experts) or tp=2" in capsys.readouterr().err
    assert main(["--dry-run", *tp2, "parallel.etp=1"]) == 0  # control: whole experts


def test_moe_shape_settings_are_checked():
    base = dict(num_layers=2, gated_mlp=True, linear_bias=False, num_experts=4)
    with pytest.raises(ValueError, match=r"moe_router_topk=5 must be between 1 and model\.num_experts=4"):
        ModelShape(**base, moe_router_topk=5)
    with pytest.raises(ValueError, match="moe_dense_layers holds \\[2\\]"):
        ModelShape(**base, moe_dense_layers=(2,))
    with pytest.raises(ValueError, match=r"model\.moe_ffn_hidden_size is set but model\.num_experts is not"):
        ModelShape(moe_ffn_hidden_size=8)
    with pytest.raises(ValueError, match="needs a shared expert"):
        ModelShape(**base, moe_shared_expert_gate=True)
    with pytest.raises(ValueError, match=r"model\.moe_load_balancing"):
        ModelShape(**base, moe_load_balancing="per_row")
    with pytest.raises(ValueError, match=r"set model\.moe_router_topk_norm=true"):
        ModelShape(**base, moe_router_score="sigmoid", moe_router_topk_norm=False)
    with pytest.raises(ValueError, match="balances a sigmoid router"):
        ModelShape(**base, moe_router_expert_bias=True)
    assert ModelShape(**base, moe_dense_layers=[0]).moe_dense_layers == (0,)  # Hydra's lists become tuples


def test_the_default_model_becomes_an_moe_with_its_keys_and_a_split_dependent_balance_loss_is_refused(tmp_path,
                                                                                                      capsys):
    from mcore_packing.app.train_command import main

    moe = ["model.num_experts=4", "model.gated_mlp=true", "model.linear_bias=false", f"run_dir={tmp_path}"]
    assert main(["--dry-run", *moe]) == 0
    assert main(["--dry-run", "model.num_experts=4"]) == 2
    assert "set model.gated_mlp=true" in capsys.readouterr().err
    assert main(["--dry-run", *moe, "model.moe_aux_loss_coeff=0.01", "model.moe_z_loss_coeff=0.001"]) == 0
    for kind, reason in [("aux_loss", "computed per micro-batch"), ("global_aux_loss", "seen so far in the step")]:
        assert main([*moe, f"model.moe_load_balancing={kind}", "model.moe_aux_loss_coeff=0.01"]) == 2
        err = capsys.readouterr().err
        assert f"model.moe_load_balancing={kind}: Megatron's {kind} " in err and reason in err, err
        assert "use model.moe_load_balancing=seq_aux_loss" in err.lower()
    assert main(["--dry-run", *moe, "model.moe_load_balancing=aux_loss", "model.moe_aux_loss_coeff=0"]) == 0
