"""The config schema exists once: the Hydra default is the tiny_cpu_sft recipe, every YAML holds only what
differs from its dataclass, the ``model`` group is `ModelShape`'s fields, and the planner's section keys are
the section dataclasses' fields. Each check has a negative control."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mcore_packing.app.config import GROUPS, MODEL_DEFAULTS, ModelConfig
from mcore_packing.app.train_command import CONFIG_DIR, compose_config
from mcore_packing.planning import ModelShape, StepPlanConfig
from mcore_packing.planning.sections import SECTIONS, section_keys

# the model group's keys that are not the shape
RUN_KEYS = {"hf_path", "dtype", "attention_backend", "fp8_recipe", "logprob_chunk_size", "recompute_granularity"}


def test_the_hydra_default_and_the_tiny_cpu_sft_recipe_are_one_config():
    default, recipe = compose_config(None, []), compose_config("tiny_cpu_sft", [])
    assert default == recipe
    # control: the comparison sees a single changed key
    assert compose_config(None, ["model.num_query_groups=4"]) != recipe


def restated_defaults(group: str, text: str) -> list[str]:
    """Keys a group YAML sets to the value its schema already has (so two places would hold the default)."""
    schema = GROUPS[group]()
    values = yaml.safe_load(text) or {}
    return [
        f"{group}.{key}"
        for key, value in values.items()
        if key != "defaults" and value != "???" and getattr(schema, key) == value
    ]


def test_group_yamls_hold_only_what_differs_from_the_schema():
    files = sorted(Path(CONFIG_DIR).glob("*/*.yaml"))
    assert {f.parent.name for f in files} == set(GROUPS)
    restated = [key for f in files for key in restated_defaults(f.parent.name, f.read_text())]
    assert restated == []


def test_negative_control_a_restated_default_is_flagged():
    assert restated_defaults("parallel", "defaults:\n  - schema\ntp: 1\ncp: 2\n") == ["parallel.tp"]


def test_model_group_is_the_model_shape_fields_declared_once():
    shape_fields = {f.name: f for f in dataclasses.fields(ModelShape)}
    config_fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    assert set(config_fields) == set(shape_fields) | RUN_KEYS
    for name, f in shape_fields.items():  # the shape's defaults, except the documented differences
        assert config_fields[name].default == MODEL_DEFAULTS.get(name, f.default), name
    shape = ModelConfig(num_layers=3, head_dim=32).declared_shape(vocab_size=100)
    assert (shape.num_layers, shape.head_dim, shape.vocab_size, shape.num_query_groups) == (3, 32, 100, 2)


def test_section_keys_are_the_section_dataclass_fields():
    for name, cls in SECTIONS.items():
        assert section_keys(name) == {f.name for f in dataclasses.fields(cls)}
        assert GROUPS[name] is cls  # the Hydra group is the planner's own class
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['sequence_length_divisible_by'\] in sequence_packing"):
        StepPlanConfig.from_sections(sequence_packing={"enabled": True, "sequence_length_divisible_by": 8})


@pytest.mark.parametrize(
    ("steps", "warmup", "fragments"),
    [
        (1, 1, ["warmup over 1 step from 0,", "so 1 optimizer step applies 0 updates;"]),
        (3, 2, ["warmup over 2 steps from 0,", "so 3 optimizer steps apply 2 updates;"]),
    ],
)
def test_the_schedule_is_described_in_grammatical_words(steps, warmup, fragments):
    from mcore_packing.app.trainer import describe_schedule

    overrides = [f"training.steps={steps}", f"optimizer.lr_warmup_iters={warmup}", "optimizer.lr_decay_style=constant"]
    text = describe_schedule(compose_config(None, overrides))
    assert all(f in text for f in fragments), text
    learning = compose_config(None, [*overrides, "optimizer.lr_warmup_init=1e-4"])
    assert "step 1 runs at lr 0" not in describe_schedule(learning)  # control: a warmup that starts above 0


def test_a_warmup_longer_than_the_run_is_said():
    from mcore_packing.app.trainer import describe_schedule

    long = describe_schedule(compose_config(None, ["training.steps=5", "optimizer.lr_warmup_iters=8"]))
    assert "the run ends inside the warmup, at optimizer step 5 of 8: lr never reaches 0.003" in long
    short = describe_schedule(compose_config(None, ["training.steps=9", "optimizer.lr_warmup_iters=8"]))
    assert "inside the warmup" not in short  # control: a warmup that ends inside the run
