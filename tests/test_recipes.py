"""Recipes validate in --dry-run; apply_packing is pure and idempotent; overrides use Hydra's grammar."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from mcore_packing.app.config import TrainConfig
from mcore_packing.app.recipes import RECIPES, apply_packing, llama3_8b_sft_packed
from mcore_packing.app.run_settings import plan_config, validate_layout
from mcore_packing.app.train_command import main
from mcore_packing.planning import ParallelLayout


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_validates_in_dry_run(name, capsys):
    assert main(["--recipe", name, "--dry-run", "data.num_samples=1500"]) == 0
    out = capsys.readouterr().out
    # A GRPO recipe has no rollouts to plan here (test_grpo_train.py plans them); SFT ones plan CHAMP.
    planned = '"first_global_batch": null' if RECIPES[name]().algorithm == "grpo" else '"num_microbatches_per_rank"'
    assert f"dry run OK: recipe {name}" in out and planned in out


@pytest.mark.parametrize("nodes, gpus", [(1, 8), (2, 8), (4, 4), (1, 2)])
def test_recipes_fit_the_cluster_they_are_given(nodes, gpus):
    for recipe in RECIPES.values():
        try:
            cfg = recipe(num_nodes=nodes, gpus_per_node=gpus)
        except ValueError as exc:  # a layout that cannot fill this cluster says what it needs
            assert "needs a multiple of" in str(exc)
            continue
        validate_layout(cfg, nodes * gpus)
        assert cfg.cluster.num_nodes == nodes and cfg.cluster.gpus_per_node == gpus
    assert llama3_8b_sft_packed(num_nodes=nodes, gpus_per_node=gpus).parallel.tp <= gpus


def test_overrides_use_hydra_grammar(capsys):
    assert (
        main(
            [
                "--recipe",
                "tiny_cpu_sft",
                "--dry-run",
                "data.num_samples=200",
                "sequence_packing.enabled=false",
                "dynamic_batching.enabled=true",
            ]
        )
        == 0
    )
    assert '"mode": "dynamic"' in capsys.readouterr().out
    assert main(["--recipe", "tiny_cpu_sft", "--dry-run", "+bogus.key=1"]) == 2
    assert "Unknown config key 'bogus'" in capsys.readouterr().err
    assert main(["--recipe", "tiny_cpu_sft", "--dry-run", "parallel.tpp=2"]) == 2
    assert "Unknown config key 'parallel.tpp' in override 'parallel.tpp=2'. Did you mean 'parallel.tp'?" in (
        capsys.readouterr().err
    )
    assert main(["--recipe", "nope", "--dry-run"]) == 2
    assert "Available:" in capsys.readouterr().err
    assert main(["--recipe", "tiny_cpu_sft", "--dry-run", "sequence_packing.algorithm=magic"]) == 2
    assert "sequence_packing: Unknown packing algorithm 'magic'" in capsys.readouterr().err


def test_refine_override_reaches_the_plan(capsys):
    assert main(["--recipe", "tiny_cpu_sft", "--dry-run", "sequence_packing.refine=false"]) == 0  # a known key
    assert main(["--recipe", "tiny_cpu_sft", "--dry-run", "sequence_packing.refine=maybe"]) == 2

    cfg = RECIPES["tiny_cpu_sft"]()
    assert plan_config(cfg, ParallelLayout()).refine is None  # the algorithm's default
    off = dataclasses.replace(cfg, sequence_packing=dataclasses.replace(cfg.sequence_packing, refine=False))
    assert plan_config(off, ParallelLayout()).refine is False


def test_apply_packing_is_pure_and_idempotent():
    base = dataclasses.replace(
        TrainConfig(),
        sequence_packing=dataclasses.replace(TrainConfig().sequence_packing, enabled=False),
        dynamic_batching=dataclasses.replace(TrainConfig().dynamic_batching, enabled=True, train_mb_tokens=6000),
    )
    snapshot = copy.deepcopy(base)
    once = apply_packing(base, algorithm="ffd")
    assert base == snapshot  # the input is untouched
    assert once.sequence_packing.enabled and not once.dynamic_batching.enabled
    assert once.sequence_packing.train_mb_tokens == 6000  # keeps the memory budget it replaces
    assert once.sequence_packing.algorithm == "first_fit_decreasing"
    assert apply_packing(once, algorithm="ffd") == once
    assert apply_packing(apply_packing(llama3_8b_sft_packed())) == apply_packing(llama3_8b_sft_packed())
    with pytest.raises(ValueError, match="Valid names"):
        apply_packing(base, algorithm="magic")


# Parameter counts from the models' own cards / safetensors index (an independent source).
PUBLISHED_PARAMETERS = {
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Llama-3.2-1B": 1_235_814_400,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-0.6B": 596_049_920,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_recipes_are_the_models_they_name(name):
    from mcore_packing.app.recipes import family_model

    shape = family_model(name).declared_shape(1)
    assert shape.num_parameters() == PUBLISHED_PARAMETERS[name]


def test_family_recipes_use_the_real_architecture():
    llama, qwen2, qwen3 = (
        RECIPES[n]().model for n in ("llama3_8b_sft_packed", "qwen2_7b_grpo_cp", "qwen3_8b_sft_packed")
    )
    assert (llama.family, llama.gated_mlp, llama.rotary_base, llama.rope_scaling_factor) == ("llama", True, 5e5, 8.0)
    assert qwen2.qkv_bias and not qwen2.linear_bias and qwen2.vocab_size == 152064
    assert qwen3.qk_norm and qwen3.declared_shape(1).head_size == 128 and not qwen3.tie_embeddings
    assert RECIPES["qwen3_0_6b_sft_single_gpu"]().model.tie_embeddings


def test_a_real_run_of_a_family_recipe_needs_the_checkpoint(tmp_path):
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    cfg = compose_config("qwen3_0_6b_sft_single_gpu", [f"run_dir={tmp_path}", "data.num_samples=64"])
    with pytest.raises(ConfigError, match=r"set model\.hf_path=/path/to/hf_folder"):
        prepare_run(cfg, 1)
    assert prepare_run(cfg, 1, dry_run=True).shape.num_parameters() == PUBLISHED_PARAMETERS["Qwen3-0.6B"]
