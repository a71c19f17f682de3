"""Model selection on the val split (``evaluation.select_on``): the test scores the best
validation's weights, the record says which step that was, and a resume keeps the choice."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from falling_val_train import falling_val_scores
from worlds import QUICK_BACKBONES

from ccr.experiments.config import ConfigError, compose
from ccr.experiments.evaluate import evaluate
from ccr.experiments.selection import check_selection, selection_checkpoint, validation_steps
from ccr.experiments.train import train
from ccr.metrics import report_keys, retrieval_report

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


def test_selection_needs_a_val_split_and_says_so_before_reading_data(tmp_path):
    (tmp_path / "a-file").write_text("")  # the data root cannot exist: no data is read
    cfg = compose(
        overrides(
            tmp_path / "a-file" / "data",
            tmp_path / "runs",
            "noval",
            *SELECT,
            "data.splits.val=null",
        )
    )
    with pytest.raises(ConfigError, match=r"evaluation.select_on=en/mR .*data.splits.val is null"):
        train(cfg)
    assert not run_folder(tmp_path / "runs", "noval").exists()


def test_a_final_stage_that_would_never_validate_is_refused_before_training(world, tmp_path):
    cfg = compose(
        overrides(world, tmp_path / "runs", "never", *SELECT, "trainer.check_val_every_n_epoch=3")
    )
    with pytest.raises(
        ConfigError,
        match=r"trains 12 steps over epochs of 6 batches, and with "
        r"trainer.check_val_every_n_epoch=3 .* would never validate",
    ):
        train(cfg)
    assert not run_folder(tmp_path / "runs", "never").exists()


def test_a_validation_interval_inside_epochs_that_never_validate_is_refused_before_training(
    world, tmp_path
):
    """val_check_interval counts batches inside the epochs check_val_every_n_epoch lets validate:
    every 4 batches of every 3rd epoch never comes in a 2-epoch run."""
    cfg = compose(
        overrides(
            world,
            tmp_path / "runs",
            "never",
            *SELECT,
            "trainer.check_val_every_n_epoch=3",
            "trainer.val_check_interval=4",
        )
    )
    with pytest.raises(ConfigError, match="would never validate"):
        train(cfg)
    assert not run_folder(tmp_path / "runs", "never").exists()


def test_select_on_a_language_the_val_split_lacks_is_refused(tmp_path):
    cfg = compose(
        ["evaluation.select_on=ja/mR", "trainer.max_steps=12", "trainer.check_val_every_n_epoch=1"]
    )
    loader = torch.utils.data.DataLoader(torch.arange(6), batch_size=1)
    check_selection(cfg, loader, 12, ["en", "ja"])  # validates at steps 6 and 12, ja present
    with pytest.raises(
        ConfigError,
        match=r"select_on=ja/mR: the val split \(val\) has no 'ja' "
        r"captions; it has en, de",
    ):
        check_selection(cfg, loader, 12, ["en", "de"])


@pytest.mark.parametrize(
    "key, mode",
    [
        ("en/mR", "max"),
        ("mR", "max"),
        ("en/i2t/R@1", "max"),
        ("de/t2i/NDCG@10", "max"),
        ("en/t2i/MRR", "max"),
        ("en/i2t/MeanR", "min"),
        ("ja/t2i/MedR", "min"),
        ("all/MRV", "min"),
        ("all/MRV_std/i2t", "min"),
    ],
)
def test_selection_keeps_the_best_validation_in_the_keys_direction(key, mode, tmp_path):
    cfg = compose([f"evaluation.select_on={key}"])
    assert selection_checkpoint(cfg, tmp_path).mode == mode


def test_the_predicted_report_keys_are_the_keys_the_report_has():
    """report_keys (what select_on is checked against) matches retrieval_report's output."""
    torch.manual_seed(0)
    languages = ["en", "de", "ja"]
    caption_image = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    caption_language = [lang for lang in languages for _ in range(3)]
    report = retrieval_report(
        torch.randn(3, 4),
        torch.randn(9, 4),
        caption_image,
        caption_language,
        ["a", "b", "c"],
        ks=(1, 2),
        ndcg_k=3,
        unimodal_ndcg_ks=(2,),
        image_relevance=torch.eye(3),
    )
    assert sorted(
        report_keys(languages, ks=(1, 2), ndcg_k=3, unimodal_ndcg_ks=(2,), graded=True)
    ) == sorted(report)


class _Steps(L.LightningModule):
    """A one-weight model that records the global step of every validation."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.validated_at = []

    def training_step(self, batch, batch_idx):
        return (self.w - batch.float().mean()) ** 2

    def validation_step(self, batch, batch_idx):
        pass

    def on_validation_start(self):
        self.validated_at.append(self.trainer.global_step)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "batches, steps, accumulate, every, interval",
    [
        (6, 12, 1, 1, None),
        (6, 12, 1, 5, None),
        (6, 30, 1, 2, None),
        (6, 20, 1, 1, 4),
        (6, 30, 1, 3, 4),
        (6, 20, 1, None, 4),
        (6, 20, 1, 1, 0.5),
        (6, 12, 2, 1, None),
        (5, 12, 2, 1, 2),
    ],
)
def test_the_validation_schedule_is_lightnings(batches, steps, accumulate, every, interval):
    """validation_steps, which refuses a selection that would never validate, predicts the steps
    Lightning validates at."""
    module = _Steps()
    data = torch.utils.data.DataLoader(torch.arange(batches), batch_size=1)
    trainer = L.Trainer(
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        check_val_every_n_epoch=every,
        val_check_interval=interval,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(module, data, torch.utils.data.DataLoader(torch.arange(2)))
    assert module.validated_at == validation_steps(
        batches, steps, accumulate=accumulate, every_n_epochs=every, interval=interval
    )


@pytest.mark.parametrize("streamed", [False, True])
def test_the_validation_schedule_is_checked_on_each_processs_share_of_the_epoch(streamed):
    """40 items in batches of 4: one process has 10-batch epochs, so a 6-step stage that validates
    at epoch ends never validates; under 2 processes each rank's epoch is 5 batches (Lightning's
    DistributedSampler deals 20 items to each; a stream splits its batches itself), so it does."""
    if streamed:

        class Stream(torch.utils.data.IterableDataset):
            def __len__(self):
                return 10  # batches per epoch on one process

            def __iter__(self):
                yield from range(10)

        loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    else:
        loader = torch.utils.data.DataLoader(torch.arange(40), batch_size=4, drop_last=True)
    one = ["evaluation.select_on=en/mR", "trainer.check_val_every_n_epoch=1"]
    with pytest.raises(ConfigError, match="trains 6 steps over epochs of 10 batches"):
        check_selection(compose(one), loader, 6, ["en"])
    ddp = [*one, "trainer.devices=2", "trainer.strategy=ddp", "trainer.accelerator=cpu"]
    check_selection(compose(ddp), loader, 6, ["en"])  # each rank validates at step 5
    with pytest.raises(ConfigError, match="trains 4 steps over epochs of 5 batches per process"):
        check_selection(compose(ddp), loader, 4, ["en"])
