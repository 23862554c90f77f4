"""One error path: lower layers raise `InvalidValue` carrying the key they were given, the app names it with
its config group, the commands turn `ConfigError` (and only it) into exit 2, and a crash during training
keeps its traceback instead of being reported as a config error."""

from __future__ import annotations

import pytest

from mcore_packing.app import trainer
from mcore_packing.app.config import ConfigError
from mcore_packing.app.train_command import compose_config, main
from mcore_packing.losses import ClippedPGConfig
from mcore_packing.rl import DPOConfig, GRPOConfig
from mcore_packing.validators import InvalidValue, require_positive_int


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: ClippedPGConfig(ratio_clip_c=0.5), "ratio_clip_c"),
        (lambda: GRPOConfig(num_minibatches=0), "num_minibatches"),
        (lambda: DPOConfig(sft_loss_weight=-1), "sft_loss_weight"),
        (lambda: require_positive_int("dp", 0), "dp"),
    ],
)
def test_lower_layers_raise_typed_errors_with_their_key(build, key):
    with pytest.raises(InvalidValue) as err:
        build()
    assert err.value.key == key and str(err.value).startswith(key)


def test_the_app_names_the_key_with_its_group():
    with pytest.raises(ConfigError) as err:
        compose_config(None, ["dpo.sft_loss_weight=-1"])
    assert err.value.key == "dpo.sft_loss_weight" and str(err.value).startswith("dpo.sft_loss_weight=-1")


def test_a_config_error_exits_2_and_a_crash_keeps_its_traceback(tmp_path, monkeypatch, capsys):
    def config_mistake(cfg):
        raise ConfigError("training.steps: a mistake")

    def crash(cfg):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(trainer, "train", config_mistake)
    assert main(["--recipe", "tiny_cpu_sft", f"run_dir={tmp_path}"]) == 2
    assert "config error: training.steps: a mistake" in capsys.readouterr().err
    monkeypatch.setattr(trainer, "train", crash)  # control: the same path, another exception
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["--recipe", "tiny_cpu_sft", f"run_dir={tmp_path}"])
    assert "config error" not in capsys.readouterr().err


def test_a_recipe_that_does_not_fit_the_cluster_is_a_config_error(capsys):
    assert main(["--recipe", "llama3_70b_sft_long_context", "--num-nodes", "1", "--dry-run"]) == 2
    assert "needs a multiple of" in capsys.readouterr().err


def test_export_targets_that_hold_files_are_refused_before_any_work(tmp_path, capsys):
    from mcore_packing.app.export_command import main as export_main
    from mcore_packing.app.trainer import prepare_run

    out = tmp_path / "my_model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert export_main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "my_model exists and is not empty" in capsys.readouterr().err and (out / "config.json").read_text() == "{}"
    cfg = compose_config(None, ["model.family=llama", f"training.export_dir={out}", f"run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"training.export_dir: .*my_model exists and is not empty.*remove it"):
        prepare_run(cfg, 1, dry_run=True)
    empty = tmp_path / "empty"
    empty.mkdir()  # control: an empty folder is a fine target
    prepare_run(compose_config(None, ["model.family=llama", f"training.export_dir={empty}", f"run_dir={tmp_path}"]),
                1, dry_run=True)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["training.step=3"], "Did you mean 'training.steps'?"),
        (["trainin.steps=3"], "Did you mean 'training'?"),
        (["parallel.tp=two"], "Value 'two' of type 'str' could not be converted to Integer"),
        (["data=jsonl2"], "Could not find 'data/jsonl2' Available options in 'data': champ jsonl"),
        (["--num-nodes", "2"], "--num-nodes and --gpus-per-node size a --recipe"),
    ],
)
def test_hydra_and_flag_mistakes_exit_2_with_the_fix(argv, fragment, capsys):
    """The plain `train` path (Hydra's own main) too: the overrides are composed and checked first."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and "To append to your config use" not in err, err


def test_the_dry_run_names_the_overrides_it_checked(tmp_path, capsys):
    assert main(["--dry-run", "training.steps=3", f"run_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert f"dry run OK: the default config with training.steps=3 run_dir={tmp_path} is valid" in out


def test_exporting_the_tiny_gpt_run_is_refused_before_loading_naming_why(tmp_path, capsys):
    import json

    from mcore_packing.app.checkpoint import FORMAT_VERSION, MANIFEST
    from mcore_packing.app.export_command import main as export_main
    from mcore_packing.planning import ModelShape

    step = tmp_path / "step_000001"
    step.mkdir()
    manifest = {"format_version": FORMAT_VERSION, "files": {}, "model_shape": ModelShape().to_dict(),
                "config": {"model": {"dtype": "float32"}}, "hf_path": None}  # fmt: skip
    (step / MANIFEST).write_text(json.dumps(manifest))
    assert export_main(["--checkpoint", str(step), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model.family=gpt model" in err and "only runs of a Hugging Face family" in err, err
    assert not (tmp_path / "out").exists()


def test_a_truncated_or_corrupt_checkpoint_is_named_before_megatron(tmp_path, capsys):
    import json

    import torch
    from safetensors.torch import save_file

    from mcore_packing.planning.hf_config import check_safetensors

    from .hf_models import make_chat_model

    folder = make_chat_model(tmp_path / "hf")
    weights = folder / "model.safetensors"
    tensors = check_safetensors(folder)
    assert tensors > 10  # control: the intact folder passes
    intact = weights.read_bytes()
    weights.write_bytes(intact[: len(intact) // 2])  # an interrupted download
    assert main(["--dry-run", f"model.hf_path={folder}", f"run_dir={tmp_path}"]) == 2
    assert "model.safetensors is truncated" in capsys.readouterr().err
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + intact[100:])
    with pytest.raises(ValueError, match="header is not JSON"):
        check_safetensors(folder)
    save_file({"a": torch.zeros(2)}, str(folder / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"names \['model-00002-of-00002.safetensors'\].*incomplete"):
        check_safetensors(folder)


def test_only_rank_0_prints_a_config_error(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert main(["training.step=3"]) == 2 and capsys.readouterr().err == ""  # the same exit code, quietly
    monkeypatch.setenv("RANK", "0")  # control
    assert main(["training.step=3"]) == 2 and "Did you mean 'training.steps'?" in capsys.readouterr().err
