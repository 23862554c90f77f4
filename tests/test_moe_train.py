"""`python -m mcore_packing train` on a Mixture-of-Experts checkpoint (a tiny random Qwen3-MoE made with
transformers, 4 experts, top-2, one dense layer): it trains from the checkpoint and exports a folder
transformers loads; expert parallelism over 2 gloo ranks gives the losses, gradient norms, expert loads and
router losses of one rank (dropless routing, global normalization: nothing depends on where an expert
lives), packed and dynamically batched; a checkpoint written at EP2 resumes at EP1 and at TP2 with the
losses of the run that did not stop; the balance losses that depend on the batch split are refused naming
the key. The exactness of the router losses against an unpacked reference: test_moe_equivalence.py."""

from __future__ import annotations

import json

import pytest

from .hf_models import make_chat_model
from .test_train import metrics, train

MOE = [
    "training.steps=3",
    "training.global_batch_size=8",
    "data.max_sample_tokens=1024",
    "sequence_packing.train_mb_tokens=1024",
    "dynamic_batching.train_mb_tokens=1024",
    "optimizer.lr=0.001",
]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("moe") / "hf", family="qwen3_moe")


def _rows(run_dir):
    return [(r["loss"], r["grad_norm"]) for r in metrics(run_dir)]


def _noise(stderr: str) -> list[str]:
    """Warning lines other than ours (the test helper sets model keys an HF config.json overrides)."""
    return [line for line in stderr.splitlines() if "Warning" in line and "is ignored" not in line]


def _close(a, b, rtol=1e-5):
    return all(abs(x - y) <= rtol * abs(y) for pa, pb in zip(a, b, strict=True) for x, y in zip(pa, pb, strict=True))


@pytest.mark.slow
def test_an_moe_checkpoint_trains_and_exports(tmp_path, moe_model):
    import torch
    import transformers

    out = tmp_path / "exported"
    proc = train(tmp_path / "run", f"model.hf_path={moe_model}", f"training.export_dir={out}", *MOE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics(tmp_path / "run")
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert _noise(proc.stderr) == []
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4 and config["mlp_only_layers"] == [1]
    tokens = torch.tensor([[5, 100, 7, 300, 42]])
    with torch.no_grad():
        before = transformers.AutoModelForCausalLM.from_pretrained(moe_model).eval()(tokens).logits
        after = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits
    assert (after - before).abs().max() > 1e-3  # it trained (the exported logits equal Megatron's: test_hf_conversion)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("mode", [[], ["sequence_packing.enabled=false", "dynamic_batching.enabled=true",
                                        "dynamic_batching.train_mb_tokens=2048"]],  # rows of several samples
                         ids=["packed", "dynamic"])  # fmt: skip
def test_expert_parallel_ranks_give_the_losses_of_one_rank(tmp_path, moe_model, mode):
    router = ["model.moe_aux_loss_coeff=0.05", "model.moe_z_loss_coeff=0.001"]
    one = train(tmp_path / "one", f"model.hf_path={moe_model}", *MOE, *mode, *router)
    two = train(tmp_path / "two", f"model.hf_path={moe_model}", *MOE, *mode, *router, "parallel.ep=2", torchrun=2)
    assert one.returncode == 0 and two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert _noise(two.stderr) == [], two.stderr[-2000:]
    assert _close(_rows(tmp_path / "two"), _rows(tmp_path / "one")), (_rows(tmp_path / "two"), _rows(tmp_path / "one"))
    balance = {run: [(r["moe_balance_loss"], r["moe_z_loss"]) for r in metrics(tmp_path / run)]
               for run in ("one", "two")}  # fmt: skip
    assert _close(balance["two"], balance["one"]) and all(b >= 1.0 for b, _ in balance["one"])  # 1.0: even
    assert "balance loss" in one.stderr + one.stdout
    # every real token is counted once for each of its top-2 experts in the one MoE layer, pads not (the
    # routers get the padding mask): the loads are the same whichever rank holds the experts, packed or in
    # dynamic batching's padded rows (whose pads differ with the split)
    loads = {run: [(r["expert_load_max_over_mean"], r["routed_tokens"], r["useful_tokens"]) for r in
                   metrics(tmp_path / run)] for run in ("one", "two")}  # fmt: skip
    assert all(routed == 2 * real for run in loads.values() for _, routed, real in run)
    assert all(load > 1.0 for load, _, _ in loads["one"]) and loads["one"] == loads["two"]
    if mode:  # control: rows with pads, which would have been counted without the mask
        assert any(r["padded_tokens"] > r["useful_tokens"] for run in ("one", "two") for r in metrics(tmp_path / run))


@pytest.mark.slow
@pytest.mark.multirank
def test_a_checkpoint_written_at_ep2_resumes_at_ep1_and_at_tp2_with_the_same_losses(tmp_path, moe_model):
    import shutil

    steps = [f"model.hf_path={moe_model}", *MOE, "training.steps=4", "training.save_interval=2",
             "optimizer.lr_decay_iters=4", "model.moe_aux_loss_coeff=0.05"]  # fmt: skip
    straight = train(tmp_path / "straight", *steps, "parallel.ep=2", torchrun=2)
    first = train(tmp_path / "run", *steps, "training.steps=2", "parallel.ep=2", torchrun=2)
    assert straight.returncode == 0 and first.returncode == 0, first.stderr[-3000:]
    for name, layout, ranks in [("ep1", [], 0), ("tp2", ["parallel.tp=2", "parallel.sequence_parallel=true"], 2)]:
        shutil.copytree(tmp_path / "run", tmp_path / name)
        resumed = train(tmp_path / name, *steps, "resume=true", *layout, torchrun=ranks)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        rows = _rows(tmp_path / name)
        assert len(rows) == 4  # two steps before the checkpoint, two after it (not a fresh start)
        assert _close(rows[-2:], _rows(tmp_path / "straight")[-2:]), (name, rows, _rows(tmp_path / "straight"))


SEEDED_MOE = ["model.num_layers=4", "model.num_experts=4", "model.moe_router_topk=2", "model.gated_mlp=true",
              "model.linear_bias=false", "model.moe_aux_loss_coeff=0.05", "model.moe_z_loss_coeff=0.001",
              "training.steps=2", "parallel.variable_seq_lengths=true"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.multirank
def test_moe_runs_the_interleaved_pipeline_with_the_losses_of_one_rank(tmp_path):
    """The trainer's MoE meters over a stage's model chunks (PP2 x VPP2): the losses, router losses and
    expert loads of one rank (dynamic CP's MoE rows: test_moe_equivalence.py, the library step)."""
    runs = {"one": ([], 0), "vpp": (["parallel.pp=2", "parallel.vpp=2"], 2)}
    rows = {}
    for name, (layout, ranks) in runs.items():
        proc = train(tmp_path / name, *SEEDED_MOE, *layout, torchrun=ranks)
        assert proc.returncode == 0, (name, proc.stdout[-3000:] + proc.stderr[-3000:])
        keys = ("loss", "grad_norm", "moe_balance_loss", "moe_z_loss", "expert_load_max_over_mean")
        rows[name] = [tuple(r[k] for k in keys) for r in metrics(tmp_path / name)]
    assert _close(rows["vpp"], rows["one"]), (rows["vpp"], rows["one"])


def test_a_split_dependent_balance_loss_is_refused_and_the_per_sequence_one_is_run(tmp_path, moe_model):
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    base = [f"model.hf_path={moe_model}", *MOE, "model.moe_aux_loss_coeff=0.01", f"run_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"model\.moe_load_balancing=aux_loss: Megatron's aux_loss is computed per"):
        compose_config(None, [*base, "model.moe_load_balancing=aux_loss"])
    shape = prepare_run(compose_config(None, base), 1).shape  # control: the default, seq_aux_loss, runs
    # the run's setting, not config.json's
    assert (shape.moe_load_balancing, shape.moe_aux_loss_coeff) == ("seq_aux_loss", 0.01)


def _replay_rollouts(path, moe_layers: int = 1, change=None):
    """make_rollouts' rollouts with seeded routes [tokens, moe_layers, 2] (2 of the 4 experts per token)."""
    import numpy as np

    from .rl_workers import make_rollouts

    rng = np.random.default_rng(3)
    rows = []
    for r in make_rollouts(groups=4, per_group=2):
        n = len(r.prompt_tokens) + len(r.response_tokens)
        routes = np.stack([rng.permutation(4)[:2] for _ in range(n * moe_layers)]).reshape(n, moe_layers, 2)
        rows.append({"prompt_tokens": r.prompt_tokens, "response_tokens": r.response_tokens, "reward": r.reward,
                     "group_id": r.group_id, "routed_experts": routes.tolist()})  # fmt: skip
    if change is not None:
        change(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


REPLAY = ["algorithm=grpo", "grpo.router_replay=true", "grpo.num_prompts_per_step=2", "training.steps=2",
          "loss_fn.reference_policy_kl_penalty=0.05", "sequence_packing.train_mb_tokens=64",
          "optimizer.lr=0.001"]  # fmt: skip


def test_grpo_replays_the_engines_routes_and_reports_how_often_fresh_routing_differs(tmp_path, moe_model):
    rollouts = _replay_rollouts(tmp_path / "r.jsonl")
    proc = train(tmp_path / "run", f"model.hf_path={moe_model}", f"grpo.rollouts={rollouts}", *REPLAY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = metrics(tmp_path / "run")
    # random routes: fresh top-2 of 4 matches a random pair 1 time in 6, so most choices differ
    assert all(0.5 < r["router_replay_mismatch"] < 1.0 for r in records), records


def test_a_rollout_without_routes_exits_2_naming_its_line(tmp_path, moe_model):
    rollouts = _replay_rollouts(tmp_path / "r.jsonl", change=lambda rows: rows[2].pop("routed_experts"))
    proc = train(tmp_path / "run", f"model.hf_path={moe_model}", f"grpo.rollouts={rollouts}", *REPLAY, "--dry-run")
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert "r.jsonl:3 (group 1) has no routed_experts" in proc.stderr, proc.stderr[-2000:]


def _refusal(tmp_path, *overrides) -> str:
    """The `ConfigError` the train command's checks raise (in this process: the exit-2 path is the test
    above's), with the test runs' small settings."""
    from mcore_packing.app.config import ConfigError
    from mcore_packing.app.train_command import compose_config
    from mcore_packing.app.trainer import prepare_run

    from .test_train import SMALL

    given = {o.split("=", 1)[0] for o in overrides}
    args = [*(o for o in SMALL if o.split("=", 1)[0] not in given), *overrides, f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as info:
        prepare_run(compose_config(None, args), 1, dry_run=True)
    return str(info.value)


@pytest.mark.parametrize(
    ("change", "overrides", "fragment"),
    [
        (lambda rows: rows[1]["routed_experts"][0][0].__setitem__(1, rows[1]["routed_experts"][0][0][0]), [],
         "r.jsonl:2 (group 0): routed_experts names experts"),
        (lambda rows: rows[0]["routed_experts"].append([[0, 1]] * 1), [], "r.jsonl:1 (group 0): routed_experts has"),
        (lambda rows: rows[3]["routed_experts"][4][0].__setitem__(0, 7), [],
         "r.jsonl:4: routed_experts names expert 7"),
        (lambda rows: rows[0]["routed_experts"][1].append([2, 3]), [], "r.jsonl:1: routed_experts is ragged"),
        (None, ["model.recompute_granularity=full"], "grpo.router_replay=true: a fully recomputed forward"),
    ],
)
def test_bad_routes_are_refused_naming_the_line(tmp_path, moe_model, change, overrides, fragment):
    rollouts = _replay_rollouts(tmp_path / "r.jsonl", change=change)
    message = _refusal(tmp_path, f"model.hf_path={moe_model}", f"grpo.rollouts={rollouts}", *REPLAY, *overrides)
    assert fragment in message, message


def test_routes_for_another_model_are_refused(tmp_path, moe_model):
    rollouts = _replay_rollouts(tmp_path / "r.jsonl", moe_layers=2)
    message = _refusal(tmp_path, f"model.hf_path={moe_model}", f"grpo.rollouts={rollouts}", *REPLAY)
    assert "routed_experts is [tokens, 2, 2] but the model has 1 MoE layers" in message, message


def test_router_replay_on_a_dense_model_or_a_prepared_store_is_refused(tmp_path):
    rollouts = _replay_rollouts(tmp_path / "r.jsonl")
    assert "grpo.router_replay=true replays the experts of a Mixture-of-Experts" in _refusal(
        tmp_path, f"grpo.rollouts={rollouts}", *REPLAY)
    assert "prepared stores do not hold routed_experts yet" in _refusal(tmp_path, "data.prepared=/nowhere", *REPLAY)
