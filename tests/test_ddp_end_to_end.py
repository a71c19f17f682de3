"""Every registered method trains and tests under Lightning DDP on CPU (2 gloo processes) through
the real CLI, and one process re-scoring the saved checkpoint gives exactly the same test scores.

The tiny world is built to hit the uneven cases: 15 test images in eval batches of 6 (an uneven
last batch, and a distributed sampler that pads one process), and Japanese captions on a single
training record, so 1-to-K batches hold unequal caption counts per process, mCLIP's Stage 1b has
a short en-ja batch, and multi-language TriKD has processes with no Japanese rows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from worlds import QUICK_BACKBONES

from ccr import methods

REPO = Path(__file__).resolve().parents[1]
WORLD = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=48",
    "data.synthetic.num_val=12",
    "data.synthetic.num_test=15",
    "data.synthetic.num_pretrain=48",
    "data.synthetic.coverage.ja=0.03",
    "data.batch_size=8",
    "data.eval_batch_size=6",
    "data.tokenizer.vocab_size=400",
    "data.languages=[en,de,ja]",
    "data.num_workers=0",
]
# Stage 1b runs one epoch of its 62 parallel batches of 8 pairs (31 per process; no token counting
# or pair sampling), so the short ones come up; TriKD runs one epoch (3 steps) on en and ja, which
# is the translate-train protocol.
STAGES = {
    "mclip": [
        "method.teacher.max_steps=2",
        "method.translation.nmt.max_steps=2",
        "method.translation.ctl.max_steps=31",
        "method.translation.max_tokens=null",
        "method.translation.sampling_beta=null",
        "method.trikd.max_steps=3",
        "method.trikd.languages=[en,ja]",
        "protocol=translate-train",
    ],
    "rc3": [
        "method.pretrain.max_steps=3",
        "method.finetune.max_steps=3",
        "method.backbone.pretrained=null",
    ],  # pre-training, then ITR fine-tuning
}


def cli(module, *args, timeout=420):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"{module} failed:\n{done.stderr[-3000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("method", methods.names())
def test_ddp_training_scores_equal_a_one_process_rescoring(method, tmp_path_factory):
    runs = tmp_path_factory.mktemp("ddp_runs")
    world = tmp_path_factory.getbasetemp() / "ddp_world"
    cli(
        "ccr.experiments.train",
        f"method={method}",
        f"data.root={world}",
        f"run_dir={runs}",
        "run_id=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "trainer.cpu_threads=1",
        "trainer.max_steps=3",
        "trainer.progress_refresh_rate=0",
        *WORLD,
        *STAGES.get(method, []),
    )
    run_dir = runs / "synthetic" / method / "ddp"
    trained = json.loads((run_dir / "metrics.json").read_text())
    cli(
        "ccr.experiments.evaluate",
        f"ckpt={trained['checkpoint']}",
        "trainer.devices=1",
        "trainer.strategy=auto",
    )
    # eval/test[-first<N>]-<scorer>: -first<N> under an image budget (rc3's CPU preset)
    (folder,) = (run_dir / "eval").glob(f"test*-{trained['scorer']}")
    rescored = json.loads((folder / "metrics.json").read_text())

    unimodal = {key for key in trained["metrics"] if key.startswith(("i2i/", "t2t/"))}
    expected_unimodal = (
        6 if methods.get(method).own_embeddings else 0
    )  # RC3: no embeddings of its own
    assert trained["metrics"].keys() == rescored["metrics"].keys()
    assert len(unimodal) == expected_unimodal
    for key, value in trained["metrics"].items():
        # exactly, uni-modal scores too: evaluation encodes every item in one batch shape
        # (ccr.methods.base), so sharding does not move near-tied t2t pairs
        assert value == rescored["metrics"][key], key
    assert {"en/i2t/R@1", "ja/t2i/R@10", "mR"} <= set(trained["metrics"])


def _ddp_clip(runs, world, run_id, *extra, script=("-m", "ccr.experiments.train"), timeout=300):
    """A 2-process clip run of 6 steps on WORLD: 48 records, 8 per process and batch, so 3 steps
    an epoch, a checkpoint every 3 (each on an epoch boundary) and a validation every epoch. A
    loader worker, as in the presets: it draws the epoch's order as soon as its iterator starts."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    argv = [
        "method=clip",
        f"data.root={world}",
        f"run_dir={runs}",
        f"run_id={run_id}",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        "trainer.cpu_threads=1",
        "trainer.max_steps=6",
        "trainer.checkpoint_every_n_steps=3",
        "trainer.check_val_every_n_epoch=1",
        "trainer.progress_refresh_rate=0",
        *WORLD,
        "data.num_workers=1",
        *extra,
    ]
    return subprocess.run(
        [sys.executable, *script, *argv],
        cwd=REPO,
        env=env,
        timeout=timeout,
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_a_ddp_run_resumed_on_an_epoch_boundary_equals_the_uninterrupted_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("ddp_resume")
    world = tmp_path_factory.getbasetemp() / "ddp_world"
    whole = _ddp_clip(runs, world, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    # both processes kill themselves as their 5th batch starts: the last checkpoint is step 3's
    killed = _ddp_clip(
        runs, world, "cut", script=(str(REPO / "tests" / "interrupted_train.py"), "KILL", "5")
    )
    assert killed.returncode != 0
    resumed = _ddp_clip(runs, world, "cut", "ckpt_path=last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = json.loads((runs / "synthetic" / "clip" / "whole" / "metrics.json").read_text())
    result = json.loads((runs / "synthetic" / "clip" / "cut" / "metrics.json").read_text())
    assert result["resumed_from_step"] == 3 and result["train_steps"] == 6
    assert result["metrics"] == expected["metrics"]
