"""``python -m ccr.experiments.train method=covlr`` on a tiny world: trains a few steps through the CLI,
evaluates, and beats chance recall by a stated margin."""

import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_IMAGES, CAPTIONS_PER_IMAGE, KS = 32, 5, (1, 5, 10)
MARGIN = 10.0  # mean recall points above a random ranking
# The CLI path with random-init encoders: on small world backbones (tests/worlds.py) 120 steps of
# covlr gave mR 23.5-25.3 against chance 16.0 over three settings, and 12.8 with backbones
# pretrained on 800 scenes: too unstable at this budget to hold a margin (issue 17's note).
RANDOM_INIT_ENCODERS = ["method.image_encoder.name=tiny", "method.text_encoder.name=tiny"]
# The run classifies the colour x shape labels (variant=objects): on random-init encoders at this
# budget they are a strong supervised signal of their own (mR 54.2), the default shape categories are
# not (mR 24.9, under the margin; one run each, issue 32). The default world's pretrained encoders
# reverse the order (docs/covlr.md), and tests/test_covlr_labels.py trains the default labels.
VARIANT = "objects"


def chance_mean_recall() -> float:
    """Expected mR (one language) of a random ranking: i2t finds one of 5 captions among 5N, t2i its image among N."""
    captions = TEST_IMAGES * CAPTIONS_PER_IMAGE
    i2t = [1 - comb(captions - CAPTIONS_PER_IMAGE, k) / comb(captions, k) for k in KS]
    t2i = [k / TEST_IMAGES for k in KS]
    return 100 * sum(i2t + t2i) / 6


@pytest.mark.slow
def test_cli_run_beats_chance(tmp_path):
    argv = [
        "method=covlr",
        f"variant={VARIANT}",
        f"data.root={tmp_path / 'world'}",
        f"run_dir={tmp_path / 'runs'}",
        "run_id=e2e",
        "data.synthetic.num_train=512",
        *RANDOM_INIT_ENCODERS,
        "data.synthetic.num_val=16",
        f"data.synthetic.num_test={TEST_IMAGES}",
        "data.languages=[en,de]",
        "data.batch_size=32",
        "data.eval_batch_size=64",
        "data.tokenizer.vocab_size=300",
        "trainer.max_steps=120",
        "optim.warmup_steps=10",
        "optim.lr=3e-3",
        "trainer.check_val_every_n_epoch=1000",
        "trainer.progress_refresh_rate=0",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "ccr.experiments.train", *argv],
        cwd=REPO,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    result = json.loads(
        (tmp_path / "runs" / "synthetic" / f"covlr+{VARIANT}" / "e2e" / "metrics.json").read_text()
    )
    chance = chance_mean_recall()
    assert result["train_steps"] == 120
    assert result["metrics"]["mR"] > chance + MARGIN, (result["metrics"]["mR"], chance)
