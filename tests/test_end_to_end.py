"""Every registered method trains a few steps through the CLI path, evaluates, and re-evaluates;
an interrupted run resumes from its last checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import methods
from experiments.config import compose
from experiments.evaluate import evaluate
from experiments.train import train

REPO = Path(__file__).resolve().parents[1]
TINY_WORLD = [
    "data.synthetic.num_train=48", "data.synthetic.num_val=12", "data.synthetic.num_test=16",
    "data.batch_size=8", "data.eval_batch_size=16", "data.tokenizer.vocab_size=400",
    "data.languages=[en,de,ja]",
]
# Methods with several stages carry their own step budgets; keep each to two steps here.
SHORT_STAGES = {
    "mclip": ["method.teacher.max_steps=2", "method.translation.nmt.max_steps=2",
              "method.translation.ctl.max_steps=2", "method.trikd.max_steps=2"],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


def smoke_overrides(method, world, run_dir, *extra):
    return [f"method={method}", f"data.root={world}", f"run_dir={run_dir}", "trainer.max_steps=2",
            "trainer.log_every_n_steps=1", "trainer.progress_refresh_rate=0", *TINY_WORLD,
            *SHORT_STAGES.get(method, []), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("method", methods.names())
def test_method_trains_evaluates_and_reevaluates(method, world, tmp_path):
    run_dir = train(compose(smoke_overrides(method, world, tmp_path / "runs")))
    result = json.loads((run_dir / "metrics.json").read_text())
    assert result["method"] == method and result["split"] == "test" and result["seed"] == 0
    assert result["config"]["preset"]["method"] == method
    report = result["metrics"]
    for lang in ("en", "de", "ja"):
        for direction in ("i2t", "t2i"):
            assert 0.0 <= report[f"{lang}/{direction}/R@10"] <= 100.0
    assert 0.0 <= report["mR"] <= 100.0
    assert (run_dir / "config.yaml").exists()

    again = evaluate(Path(result["checkpoint"]))
    assert again["mR"] == pytest.approx(report["mR"])
    assert (run_dir / "eval" / "test-itc" / "metrics.json").exists()


def _run(script_args, runs, world, run_id, *extra):
    argv = smoke_overrides("clip", world, runs, f"run_id={run_id}", "trainer.max_steps=12",
                           "trainer.checkpoint_every_n_steps=4", "trainer.check_val_every_n_epoch=1",
                           *extra)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *script_args, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def uninterrupted(world, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    done = _run(["-m", "experiments.train"], runs, world, "whole")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((runs / "synthetic" / "clip" / "whole" / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("signal_name, at_batch, resumed_step", [
    ("KILL", 6, 4),
    ("INT", 10, 8),
    ("KILL", 10, 8),
])
def test_interrupted_run_resumes_exactly(signal_name, at_batch, resumed_step, world, tmp_path,
                                         uninterrupted):
    """48 training records in batches of 8: 6 batches an epoch, so both resumes start mid-epoch."""
    runs = tmp_path / "runs"
    killed = _run([str(REPO / "tests" / "interrupted_train.py"), signal_name, str(at_batch)],
                  runs, world, "cut")
    assert killed.returncode != 0
    run = runs / "synthetic" / "clip" / "cut"
    assert not (run / "metrics.json").exists()
    before = (run / "csv" / "checkpoints" / "metrics.csv").read_text()

    resumed = _run(["-m", "experiments.train"], runs, world, "cut", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads((run / "metrics.json").read_text())
    assert result["resumed_from_step"] == resumed_step
    assert result["train_steps"] == 12
    assert result["metrics"] == uninterrupted["metrics"]
    assert (run / "csv" / "checkpoints" / "metrics.csv").read_text() == before  # earlier log kept
    for noise in ("litlogger", "LeafSpec", "weights_only"):
        assert noise not in resumed.stderr + resumed.stdout


@pytest.mark.slow
def test_a_staged_run_counts_every_step_of_every_stage_after_a_resume(world, tmp_path):
    runs = tmp_path / "runs"
    argv = smoke_overrides("mclip", world, runs, "run_id=m", "trainer.checkpoint_every_n_steps=1")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    killed = subprocess.run([sys.executable, str(REPO / "tests" / "interrupted_train.py"), "KILL",
                             "8", *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert killed.returncode != 0
    resumed = subprocess.run([sys.executable, "-m", "experiments.train", *argv, "ckpt_path=last"],
                             cwd=REPO, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "method.trikd.max_steps=2" in resumed.stdout
    result = json.loads((runs / "synthetic" / "mclip" / "m" / "metrics.json").read_text())
    assert result["stage_steps"] == {"teacher": 2, "mte_nmt": 2, "mte_ctl": 2, "trikd": 2}
    assert result["train_steps"] == 8 and result["resumed_from_step"] == 1
