"""Model selection on the val split (``evaluation.select_on``): the test scores the best
validation's weights, the record says which step that was, and a resume keeps the choice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from falling_val_train import falling_val_scores
from worlds import QUICK_BACKBONES

from experiments.config import ConfigError, compose
from experiments.evaluate import evaluate
from experiments.train import train

REPO = Path(__file__).resolve().parents[1]
# 48 training records in batches of 8: 6 steps an epoch, so 12 steps validate at steps 6 and 12.
# A constant lr makes the first 6 steps of a 12-step run those of a 6-step run.
TINY = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=48",
    "data.synthetic.num_val=12",
    "data.synthetic.num_test=16",
    "data.batch_size=8",
    "data.eval_batch_size=16",
    "data.tokenizer.vocab_size=400",
    "data.languages=[en,de,ja]",
    "trainer.progress_refresh_rate=0",
    "trainer.check_val_every_n_epoch=1",
    "trainer.checkpoint_every_n_steps=4",
    "optim.warmup_steps=0",
    "optim.min_lr_ratio=1.0",
]
SELECT = ["evaluation.select_on=en/mR", "trainer.max_steps=12"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


def overrides(world, runs, run_id, *extra):
    return [f"data.root={world}", f"run_dir={runs}", f"run_id={run_id}", *TINY, *extra]


def run_folder(runs, run_id):
    return runs / "synthetic" / "clip" / run_id


def weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.slow
def test_the_test_scores_the_best_validation_not_the_last_step(world, tmp_path):
    """Val scores forced to fall: the step-6 validation wins, and the 12-step run's test and
    weights are exactly those of a 6-step run."""
    runs = tmp_path / "runs"
    train(compose(overrides(world, runs, "six", "trainer.max_steps=6")))
    with falling_val_scores():
        train(compose(overrides(world, runs, "best", *SELECT)))
    six, best = run_folder(runs, "six"), run_folder(runs, "best")
    record = json.loads((best / "metrics.json").read_text())
    assert record["selected"] == {"metric": "val/en/mR", "score": 94.0, "step": 6}
    assert record["train_steps"] == 12
    assert record["metrics"] == json.loads((six / "metrics.json").read_text())["metrics"]
    selected = weights(best / "checkpoints" / "done.ckpt")
    expected = weights(six / "checkpoints" / "done.ckpt")
    assert selected.keys() == expected.keys()
    assert all(torch.equal(selected[k], expected[k]) for k in expected)
    last = weights(best / "checkpoints" / "last.ckpt")  # the step-12 weights were not tested
    assert any(not torch.equal(selected[k], last[k]) for k in expected)


@pytest.mark.slow
def test_the_recorded_score_is_the_tested_weights_val_score(world, tmp_path):
    """Real scores: the winner is the better of the two validations, and re-scoring the run's
    checkpoint on val reproduces the score its record claims."""
    runs = tmp_path / "runs"
    train(compose(overrides(world, runs, "real", *SELECT)))
    run = run_folder(runs, "real")
    selected = json.loads((run / "metrics.json").read_text())["selected"]
    assert json.loads((run / "checkpoints" / "selected.json").read_text()) == selected
    logged = [
        line.split(",")
        for line in (run / "csv" / "checkpoints" / "metrics.csv").read_text().splitlines()
    ]
    column, step_column = logged[0].index("val/en/mR"), logged[0].index("step")
    scores = {int(row[step_column]) + 1: float(row[column]) for row in logged[1:] if row[column]}
    assert sorted(scores) == [6, 12]
    assert selected["score"] == max(scores.values()) == scores[selected["step"]]
    again = evaluate(run / "checkpoints" / "done.ckpt", split="val")
    assert again["en/mR"] == pytest.approx(selected["score"], rel=1e-6)  # logged as float32


@pytest.mark.slow
def test_a_resumed_run_keeps_the_validation_it_made_before_the_interruption(world, tmp_path):
    """Killed at batch 10 (after the step-6 validation, resumed from step 8): the step-6 weights
    still win, and the result equals the uninterrupted run's."""
    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = str(REPO / "tests" / "falling_val_train.py")

    def run(*args):
        return subprocess.run(
            [sys.executable, script, *args], cwd=REPO, env=env, capture_output=True, text=True
        )

    whole = run(*overrides(world, runs, "whole", *SELECT))
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = run("KILL", "10", *overrides(world, runs, "cut", *SELECT))
    assert killed.returncode != 0
    resumed = run(*overrides(world, runs, "cut", *SELECT, "ckpt_path=last"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = json.loads((run_folder(runs, "whole") / "metrics.json").read_text())
    result = json.loads((run_folder(runs, "cut") / "metrics.json").read_text())
    assert result["resumed_from_step"] == 8
    assert (
        result["selected"]
        == expected["selected"]
        == {"metric": "val/en/mR", "score": 94.0, "step": 6}
    )
    assert result["metrics"] == expected["metrics"]
    # the step-6 validation made before the kill is kept, the step-12 one made after the resume added
    assert [p["step"] for p in result["learning_curve"]["points"]] == [6, 12]
    assert result["learning_curve"] == expected["learning_curve"]


@pytest.mark.slow
def test_the_record_holds_the_mean_recall_of_every_validation(world, tmp_path):
    """metrics.json's learning curve: one point per validation (steps 6 and 12), its val mR as logged."""
    runs = tmp_path / "runs"
    train(compose(overrides(world, runs, "curve", "trainer.max_steps=12")))
    run = run_folder(runs, "curve")
    curve = json.loads((run / "metrics.json").read_text())["learning_curve"]
    logged = [
        line.split(",")
        for line in (run / "csv" / "checkpoints" / "metrics.csv").read_text().splitlines()
    ]
    column, step_column = logged[0].index("val/mR"), logged[0].index("step")
    scores = {int(row[step_column]) + 1: float(row[column]) for row in logged[1:] if row[column]}
    assert curve["metric"] == "val/mR"
    assert [(p["stage"], p["step"]) for p in curve["points"]] == [("main", 6), ("main", 12)]
    assert [p["value"] for p in curve["points"]] == pytest.approx([scores[6], scores[12]], abs=1e-4)
    assert scores[6] != scores[12]


def test_selection_needs_a_val_split(world, tmp_path):
    cfg = compose(overrides(world, tmp_path / "runs", "noval", *SELECT, "data.splits.val=null"))
    with pytest.raises(ConfigError, match=r"evaluation.select_on=en/mR .*data.splits.val is null"):
        train(cfg)


def test_a_final_stage_that_would_never_validate_is_refused_before_training(world, tmp_path):
    cfg = compose(
        overrides(world, tmp_path / "runs", "never", *SELECT, "trainer.check_val_every_n_epoch=3")
    )
    with pytest.raises(
        ConfigError,
        match=r"12 steps, 2 full epoch\(s\) of 6 batches, and validates "
        r"every 3 epoch\(s\), so it would never validate",
    ):
        train(cfg)
    assert not (run_folder(tmp_path / "runs", "never") / "checkpoints").exists()
