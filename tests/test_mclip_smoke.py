"""mCLIP end to end on a small synthetic world (spec §9 test 20): Stage 1a -> 1b -> TriKD -> English
fine-tuning -> evaluation through ``ccr.experiments.train``; the TriKD loss falls, the TriKD model
retrieves German (never seen with images) better than the same model with random projectors, and
the run is labelled with the protocol that ran."""

import csv
import json
from pathlib import Path

import pytest
from worlds import SMALL_PRETRAINED_BACKBONES

from ccr.experiments.config import compose
from ccr.experiments.evaluate import evaluate
from ccr.experiments.train import StageData, build_datamodule, stages_of, train
from ccr.experiments.trainer import build_trainer

STEPS = {"teacher": 80, "mte_nmt": 20, "mte_ctl": 100, "trikd": 60, "finetune": 10}
SMALL_WORLD = [
    *SMALL_PRETRAINED_BACKBONES,
    "data.synthetic.num_train=160",
    "data.synthetic.num_val=8",
    "data.synthetic.num_test=64",
    "data.synthetic.num_pretrain=800",
    "data.batch_size=16",
    "data.eval_batch_size=64",
    "data.tokenizer.vocab_size=300",
    "data.languages=[en,de]",
    "data.splits.val=null",
]
SHORT_SCHEDULES = [
    f"method.teacher.max_steps={STEPS['teacher']}",
    "optim.warmup_steps=10",
    f"method.translation.nmt.max_steps={STEPS['mte_nmt']}",
    "method.translation.nmt.warmup_steps=5",
    "method.translation.nmt.decay_from_step=5",
    f"method.translation.ctl.max_steps={STEPS['mte_ctl']}",
    "method.translation.max_tokens=320",
    f"method.trikd.max_steps={STEPS['trikd']}",
    "method.trikd.warmup_steps=10",
    f"method.finetune.english.max_steps={STEPS['finetune']}",
    "method.finetune.warmup_steps=2",
]
MARGIN = 2.0  # mean-recall points; chance on 64 images is 8.3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mclip_smoke")
    cfg = compose(
        [
            "method=mclip",
            "protocol=fine-tune-en",
            f"data.root={root / 'world'}",
            f"run_dir={root / 'runs'}",
            "run_id=smoke",
            "trainer.log_every_n_steps=1",
            "trainer.progress_refresh_rate=0",
            *SMALL_WORLD,
            *SHORT_SCHEDULES,
        ]
    )
    return cfg, train(cfg)


def language_mr(report):
    return {key: round(value, 2) for key, value in report.items() if key.endswith("/mR")}


@pytest.mark.slow
def test_every_stage_ran_and_the_run_is_labelled_fine_tuned_on_english(run):
    cfg, run_dir = run
    result = json.loads((run_dir / "metrics.json").read_text())
    assert result["protocol"] == "fine-tune-en" and result["stage_steps"] == STEPS
    again = evaluate(Path(result["checkpoint"]))
    assert again["mR"] == pytest.approx(result["metrics"]["mR"])


@pytest.mark.slow
def test_the_tri_kd_loss_falls(run):
    _, run_dir = run
    with open(run_dir / "csv" / "trikd" / "metrics.csv", newline="") as file:
        losses = [float(row["train/loss"]) for row in csv.DictReader(file) if row["train/loss"]]
    assert len(losses) == STEPS["trikd"]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.9 * first, (first, last)


@pytest.fixture(scope="module")
def trained_and_random(run):
    """Test scores after TriKD, and with TriKD's randomly initialised projectors."""
    cfg, run_dir = run
    trained = evaluate(run_dir / "stages" / "trikd" / "done.ckpt")
    data = build_datamodule(cfg, roles=("test",))
    stages = stages_of(cfg, data)
    trikd = next(stage for stage in stages if stage.name == "trikd")
    random_projectors = trikd.build(run_dir / "stages" / "mte_ctl" / "done.ckpt")
    trainer = build_trainer(cfg, run_dir, run_dir / "eval-random-projectors", callbacks=[])
    trainer.test(random_projectors, datamodule=StageData(data, trikd), verbose=False)
    return trained, random_projectors.last_report


@pytest.mark.slow
def test_tri_kd_on_english_retrieves_english_better_than_random_projectors(trained_and_random):
    trained, baseline = trained_and_random
    assert trained["en/mR"] > baseline["en/mR"] + MARGIN, (
        language_mr(trained),
        language_mr(baseline),
    )


@pytest.mark.slow
def test_tri_kd_on_english_retrieves_german_better_than_random_projectors(trained_and_random):
    trained, baseline = trained_and_random
    assert trained["de/mR"] > baseline["de/mR"] + MARGIN, (
        language_mr(trained),
        language_mr(baseline),
    )
