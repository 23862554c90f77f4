"""``algorithm=rm``: a Bradley-Terry reward model on packed pairs (#39).

Exactness: the first step's loss, accuracy and the gradients of the score head and the final norm, packed and
dynamically batched at 1 rank, packed at TP2 + SP, and at CP2 (through Megatron's schedule), equal one plain
forward per sequence with
the loss in plain torch (`rm_workers.rm_exact_worker`: no packing, no schedule, no CP; the margin and the
centering term on). Learning: on synthetic pairs whose chosen response follows a hidden rule, a tiny model
trained on CPU scores held-out pairs with > 0.9 accuracy. Bad pairs are refused as DPO's are.
"""

from __future__ import annotations

import json

import pytest

from mcore_packing.app.train_command import main

from .distributed_harness import run_distributed
from .rm_workers import SMALL, hidden_rule_pairs

pytestmark = pytest.mark.multirank

ROWS = hidden_rule_pairs(6, seed=1)
SETTINGS = {"margin": 0.25, "center": 0.1}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("rm1"))
    # the control: each chosen response against the next pair's rejected one (the wrong pairs)
    swapped = [dict(r, rejected_tokens=ROWS[(i + 1) % len(ROWS)]["rejected_tokens"]) for i, r in enumerate(ROWS)]
    return run_distributed("tests.rm_workers:rm_exact_worker", 1, root=root, rows=ROWS, overrides=[],
                           modes=["packing", "dynamic"], reference=True, control_rows=swapped,
                           **SETTINGS)[0]  # fmt: skip


def _close(got: dict, ref: dict) -> tuple[float, float]:
    """The loss's relative error, and the worst of the score head's and the final norm's gradients (the
    norm's gradient flows back through the head, and under SP through its gather)."""
    loss_error = abs(got["loss"] - ref["loss"]) / abs(ref["loss"])
    grad_error = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) for k in ("head_grad", "norm_grad"))
    return loss_error, grad_error


def test_first_step_equals_one_forward_per_sequence(single, tmp_path):
    ref = single["reference"]
    assert 0.0 < ref["accuracy"] < 1.0 and ref["loss"] > 0  # not a trivial batch
    for mode in ("packing", "dynamic"):
        loss_error, grad_error = _close(single[mode], ref)
        print(f"1 rank {mode}: loss {loss_error:.1e}, gradients {grad_error:.1e}")
        assert loss_error <= 1e-5 and grad_error <= 1e-5 and single[mode]["accuracy"] == ref["accuracy"]
    assert single["packing"]["micro_batches"] > 1  # the pairs were packed into several micro-batches
    two = run_distributed("tests.rm_workers:rm_exact_worker", 2, root=str(tmp_path / "tp2"), rows=ROWS,
                          overrides=["parallel.tp=2", "parallel.sequence_parallel=true"], modes=["packing"],
                          **SETTINGS)[0]  # fmt: skip
    cp2 = run_distributed("tests.rm_workers:rm_exact_worker", 2, root=str(tmp_path / "cp2"), rows=ROWS,
                          overrides=["parallel.cp=2"], modes=["packing", "dynamic"], **SETTINGS)[0]  # fmt: skip
    for name, got in (("TP2 + SP", two["packing"]), ("CP2 (DP1)", cp2["packing"]), ("CP2 dynamic", cp2["dynamic"])):
        loss_error, grad_error = _close(got, ref)
        print(f"{name}: loss {loss_error:.1e}, gradients {grad_error:.1e}")
        assert loss_error <= 1e-5 and grad_error <= 1e-5 and got["accuracy"] == ref["accuracy"], name
    control = _close(single["control"], ref)[0]  # the wrong pairs: the check catches them
    print(f"control, wrong pairs: loss {control:.1e}")
    assert control > 1e-3


@pytest.mark.slow
def test_a_reward_model_learns_a_hidden_rule(tmp_path):
    """Chosen responses draw mostly low token ids: after 40 steps of 16 pairs the model ranks > 90% of 64
    held-out pairs right (about half at the start)."""
    curve = run_distributed("tests.rm_workers:rm_train_worker", 1, root=str(tmp_path), steps=40, batch_pairs=16,
                            eval_every=10, train_rows=hidden_rule_pairs(320, seed=2),
                            eval_rows=hidden_rule_pairs(64, seed=3))[0]  # fmt: skip
    print("\n".join(json.dumps(point) for point in curve))
    assert curve[0]["eval_accuracy"] < 0.75
    assert curve[-1]["eval_accuracy"] > 0.9, curve


def _pairs_file(tmp_path, rows) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_train_command_trains_a_reward_model_and_refuses_dpos_bad_pairs(tmp_path, capsys):
    rows = hidden_rule_pairs(8, seed=4)
    common = [*SMALL, "training.global_batch_size=4", "sequence_packing.train_mb_tokens=96"]
    pairs = f"rm.pairs={_pairs_file(tmp_path, rows)}"
    assert main([*common, pairs, f"run_dir={tmp_path}/run", "training.steps=2"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(0 <= r["accuracy"] <= 1 for r in records)
    assert all(len(r["sample_ids"]) == 8 for r in records)  # 4 pairs, both responses
    # Resume: one step, then the second from its checkpoint (the trained head restored) gives the same loss.
    assert main([*common, pairs, f"run_dir={tmp_path}/resumed", "training.steps=1"]) == 0
    assert main([*common, pairs, f"run_dir={tmp_path}/resumed", "training.steps=2", "resume=true"]) == 0
    resumed = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert resumed[-1]["step"] == 2 and abs(resumed[-1]["loss"] - records[1]["loss"]) <= 1e-6, (resumed, records)
    capsys.readouterr()
    bad = [
        (lambda r: r[1].update(rejected_tokens=r[1]["chosen_tokens"]), [],
         "pairs.jsonl:2: chosen_tokens equal rejected_tokens"),
        (lambda r: r[0].pop("rejected_tokens"), [], "pairs.jsonl:1 has"),
        (lambda r: r[2].update(chosen_tokens=[1, 2.5]), [], "pairs.jsonl:3: chosen_tokens must be a list of integer"),
        (None, ["sequence_packing.enabled=false"], "algorithm=rm keeps each (chosen, rejected) pair in one"),
        (None, ["sequence_packing.train_mb_tokens=16"], "Raise sequence_packing.train_mb_tokens"),
        (None, ["rm.margin=-1"], "rm.margin=-1.0 must be a finite number >= 0"),
    ]  # fmt: skip
    for k, (change, overrides, fragment) in enumerate(bad):
        changed = [dict(r) for r in rows]
        if change is not None:
            change(changed)
        folder = tmp_path / f"bad{k}"
        folder.mkdir()
        code = main([*common, f"rm.pairs={_pairs_file(folder, changed)}", f"run_dir={folder}/run", *overrides,
                     "--dry-run"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2 and fragment in err, (fragment, err[-2000:])
    assert main([*common, f"run_dir={tmp_path}/dry", "--dry-run"]) == 0
    assert "rm.pairs is not set" in capsys.readouterr().out


@pytest.mark.slow
def test_a_reward_model_from_a_hugging_face_lm_exports_as_a_sequence_classifier(tmp_path):
    """From a tiny Qwen2 causal LM (its body; the score head seeded), one step at lr 0 exports a
    ``Qwen2ForSequenceClassification`` whose scores, read by transformers, are the step's logged rewards."""
    import numpy as np
    import torch
    import transformers
    from safetensors import safe_open

    from .hf_models import make_chat_model

    hf = make_chat_model(tmp_path / "hf", vocab_size=384)
    rows = hidden_rule_pairs(4, seed=6)
    pairs = f"rm.pairs={_pairs_file(tmp_path, rows)}"
    code = main(["algorithm=rm", f"model.hf_path={hf}", pairs, f"run_dir={tmp_path}/run", "training.steps=1",
                 "training.global_batch_size=4", "optimizer.lr=0", "sequence_packing.train_mb_tokens=96",
                 f"training.export_dir={tmp_path}/export"])  # fmt: skip
    assert code == 0
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and config["num_labels"] == 1
    with safe_open(str(tmp_path / "export" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "score.weight" in names and "lm_head.weight" not in names
    model = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "export", dtype=torch.float32)
    scores = {}
    with torch.no_grad():
        for i in record["sample_ids"]:
            row = rows[i // 2]
            tokens = row["prompt_tokens"] + row["chosen_tokens" if i % 2 == 0 else "rejected_tokens"]
            scores[i] = float(model(torch.tensor([tokens])).logits[0, 0])
    chosen = np.mean([v for i, v in scores.items() if i % 2 == 0])
    rejected = np.mean([v for i, v in scores.items() if i % 2 == 1])
    print(f"transformers: chosen {chosen:.6f} rejected {rejected:.6f}; logged {record['chosen_reward']:.6f} "
          f"{record['rejected_reward']:.6f}")  # fmt: skip
    assert abs(chosen - record["chosen_reward"]) <= 1e-4 * max(1.0, abs(chosen))
    assert abs(rejected - record["rejected_reward"]) <= 1e-4 * max(1.0, abs(rejected))
    assert abs(chosen - rejected) > 1e-4  # two different numbers: the comparison can fail
