"""Every registered method trains a few steps through the CLI path, evaluates, and re-evaluates;
an interrupted run resumes from its last checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
def test_killed_run_resumes_from_its_last_checkpoint(world, tmp_path):
    runs = tmp_path / "runs"
    argv = smoke_overrides("clip", world, runs, "run_id=interrupted",
                           "trainer.max_steps=100000", "trainer.checkpoint_every_n_steps=3")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "experiments.train", *argv], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = runs / "synthetic" / "clip" / "interrupted" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 240
    while not last.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    time.sleep(1.0)  # let the checkpoint file be written completely
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last.exists(), "the run never wrote a checkpoint"
    step = torch.load(last, map_location="cpu", weights_only=False)["global_step"]
    assert step >= 3

    resumed = smoke_overrides("clip", world, runs, "run_id=interrupted", "ckpt_path=last",
                              f"trainer.max_steps={step + 4}", "trainer.checkpoint_every_n_steps=3")
    run_dir = train(compose(resumed))
    result = json.loads((run_dir / "metrics.json").read_text())
    assert result["resumed_from_step"] == step
    assert result["train_steps"] == step + 4
