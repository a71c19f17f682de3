"""Every registered method learns on a small world through the training path, and re-evaluating its
checkpoint reproduces its scores; an interrupted run resumes from its last checkpoint."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from worlds import QUICK_BACKBONES, SMALL_PRETRAINED_BACKBONES

from ccr import methods
from ccr.experiments.config import compose
from ccr.experiments.evaluate import evaluate
from ccr.experiments.runs import load_checkpoint, scorer_label
from ccr.experiments.train import train

REPO = Path(__file__).resolve().parents[1]
TINY_WORLD = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=48",
    "data.synthetic.num_val=12",
    "data.synthetic.num_test=16",
    "data.synthetic.num_pretrain=48",
    "data.batch_size=8",
    "data.eval_batch_size=16",
    "data.tokenizer.vocab_size=400",
    "data.languages=[en,de,ja]",
    "trainer.cpu_threads=1",  # one torch thread per pytest worker, whatever the method's count (rc3: 2)
]
# Methods with several stages carry their own step budgets; keep each to two steps here.
SHORT_STAGES = {
    "mclip": [
        "method.teacher.max_steps=2",
        "method.translation.nmt.max_steps=2",
        "method.translation.ctl.max_steps=2",
        "method.trikd.max_steps=2",
    ],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


def smoke_overrides(method, world, run_dir, *extra):
    return [
        f"method={method}",
        f"data.root={world}",
        f"run_dir={run_dir}",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.progress_refresh_rate=0",
        *TINY_WORLD,
        *SHORT_STAGES.get(method, []),
        *extra,
    ]


# An easy world for the learning test: 16 scene kinds (4 shapes x 4 colours, one object, every
# attribute mentioned), one caption per image and language, 16 test images.
LEARNABLE_WORLD = [
    *SMALL_PRETRAINED_BACKBONES,
    "data.synthetic.num_train=96",
    "data.synthetic.num_val=8",
    "data.synthetic.num_test=16",
    "data.synthetic.num_pretrain=96",
    "data.synthetic.captions_per_image=1",
    "data.synthetic.num_shapes=4",
    "data.synthetic.num_colours=4",
    "data.synthetic.max_objects=1",
    "data.synthetic.background_prob=0.0",
    "data.synthetic.mention_prob=1.0",
    "data.batch_size=16",
    "data.eval_batch_size=16",
    "data.tokenizer.vocab_size=300",
    "data.languages=[en,de]",
    "trainer.check_val_every_n_epoch=1000",
    "optim.warmup_steps=5",
    "trainer.progress_refresh_rate=0",
    "trainer.cpu_threads=1",
]
LEARNING_STEPS = 60
# rc3 runs here from a random-init mBART (its preset starts from the world's denoising mBART, which
# this test world would first have to pretrain; tests/test_world_mbart.py covers that): its ITM head, the retrieval scorer, starts to separate
# pairs after ~150 steps of pre-training (docs/rc3.md, measured with its earlier first stage). It
# runs its whole protocol (fine-tune-en): 300 pre-training steps, then ITR fine-tuning on the
# English captions.
OWN_LEARNING_STEPS = {
    "mclip": [
        f"method.{stage}.max_steps={LEARNING_STEPS}"
        for stage in ("teacher", "translation.nmt", "translation.ctl", "trikd")
    ],
    "rc3": [
        "method.pretrain.max_steps=300",
        "method.finetune.max_steps=100",
        "method.backbone.pretrained=null",
    ],
}
OWN_STAGE_STEPS = {
    "rc3": ("fine-tune-en", {"pretrain": 300, "finetune": 100})
}  # what metrics.json records
# Chance mR with one gold among 16 candidates in both directions: mean of 100*k/16 for k in 1, 5, 10.
CHANCE_MR = 100 * (1 + 5 + 10) / 3 / 16
MARGIN = 15.0  # points above chance every method must reach after its steps


@pytest.fixture(scope="module")
def learnable_world(tmp_path_factory):
    return tmp_path_factory.mktemp("learnable_world")


@pytest.mark.slow
@pytest.mark.parametrize("method", methods.names())
def test_method_learns_and_reevaluation_reproduces_its_scores(method, learnable_world, tmp_path):
    """A short run on an easy world beats chance by MARGIN points of mR (a constant or untrained
    model scores chance), and evaluating its checkpoint again gives every metric back."""
    overrides = [
        f"method={method}",
        f"data.root={learnable_world}",
        f"run_dir={tmp_path / 'runs'}",
        f"trainer.max_steps={LEARNING_STEPS}",
        *LEARNABLE_WORLD,
        *OWN_LEARNING_STEPS.get(method, []),
    ]
    run_dir = train(compose(overrides))
    result = json.loads((run_dir / "metrics.json").read_text())
    assert (result["method"], result["split"], result["seed"]) == (method, "test", 0)
    if method in OWN_STAGE_STEPS:
        assert (result["protocol"], result["stage_steps"]) == OWN_STAGE_STEPS[method]
    report = result["metrics"]
    unimodal = {f"{side}/NDCG@{k}" for side in ("i2i", "t2t") for k in (10, 20, 50)}
    if methods.get(
        method
    ).own_embeddings:  # RC3 ranks by its cross-encoder: no embeddings of its own
        assert unimodal <= set(report), f"{method}: uni-modal NDCG missing from metrics.json"
    else:
        assert not unimodal & set(report), (
            f"{method}: uni-modal NDCG of embeddings it does not define"
        )
    assert report["mR"] >= CHANCE_MR + MARGIN, (
        f"{method}: mR {report['mR']:.1f}, chance {CHANCE_MR:.1f}"
    )

    again = evaluate(Path(result["checkpoint"]))
    assert again.keys() == report.keys()
    for key, value in report.items():
        assert again[key] == pytest.approx(value, abs=1e-9), key
    scorer = scorer_label(compose(overrides))  # itc, or the cross-encoder's label (rc3: itm@all)
    # eval/test[-first<N>]-<scorer>: -first<N> under an image budget (rc3's CPU preset)
    (folder,) = (run_dir / "eval").glob(f"test*-{scorer}")
    assert json.loads((folder / "metrics.json").read_text())["metrics"] == again


def _run(script_args, runs, world, run_id, *extra, method="clip"):
    argv = smoke_overrides(
        method,
        world,
        runs,
        f"run_id={run_id}",
        "trainer.max_steps=12",
        "trainer.checkpoint_every_n_steps=4",
        "trainer.check_val_every_n_epoch=1",
        *extra,
    )
    return _launch(script_args, argv)


def _launch(script_args, argv):
    """``python <script_args> <argv>`` from the repository root, its output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *script_args, *argv], cwd=REPO, env=env, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def uninterrupted(world, tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    done = _run(["-m", "ccr.experiments.train"], runs, world, "whole")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((runs / "synthetic" / "clip" / "whole" / "metrics.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    "signal_name, at_batch, resumed_step, every",
    [
        ("KILL", 6, 4, 4),
        ("INT", 10, 8, 4),
        ("KILL", 10, 8, 4),
        ("KILL", 8, 6, 6),  # the checkpoint closes epoch 0, which validates after it
        ("INT", 7, 6, 3),
    ],
)
def test_interrupted_run_resumes_exactly(
    signal_name, at_batch, resumed_step, every, world, tmp_path, uninterrupted
):
    """48 training records in batches of 8: 6 batches an epoch, so a checkpoint every 4 steps
    resumes mid-epoch, and one at step 6 on the boundary between epochs 0 and 1."""
    runs = tmp_path / "runs"
    killed = _run(
        [str(REPO / "tests" / "interrupted_train.py"), signal_name, str(at_batch)],
        runs,
        world,
        "cut",
        f"trainer.checkpoint_every_n_steps={every}",
    )
    assert killed.returncode != 0
    run = runs / "synthetic" / "clip" / "cut"
    assert not (run / "metrics.json").exists()
    before = (run / "csv" / "checkpoints" / "metrics.csv").read_text()

    resumed = _run(
        ["-m", "ccr.experiments.train"],
        runs,
        world,
        "cut",
        "ckpt_path=last",
        f"trainer.checkpoint_every_n_steps={every}",
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads((run / "metrics.json").read_text())
    assert result["resumed_from_step"] == resumed_step
    assert result["train_steps"] == 12
    assert result["metrics"] == uninterrupted["metrics"]
    assert (run / "csv" / "checkpoints" / "metrics.csv").read_text() == before  # earlier log kept
    # the resumed log continues the uninterrupted one: same epochs, steps and losses
    whole = Path(uninterrupted["checkpoint"]).parents[1] / "csv" / "checkpoints" / "metrics.csv"
    after = (run / "csv" / f"checkpoints-resumed-at-{resumed_step}" / "metrics.csv").read_text()
    assert _train_rows(before, below=resumed_step) + _train_rows(after) == _train_rows(
        whole.read_text()
    )
    # Lightning warns that a mid-epoch resume of a loader without state_dict is unreliable; the
    # suite re-positions its loaders itself (the equalities above), so the warning would mislead
    for noise in ("litlogger", "LeafSpec", "weights_only", "not resumable"):
        assert noise not in resumed.stderr + resumed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ccrk", "cl2cm", "covlr"])
def test_every_single_stage_method_resumes_exactly_after_a_kill(method, world, tmp_path):
    """Killed after 6 batches and resumed from its step-4 checkpoint, each method ends with the
    scores of its uninterrupted run (clip: the cases above; cl2cm trains on its own triple view)."""
    runs = tmp_path / "runs"
    whole = _run(["-m", "ccr.experiments.train"], runs, world, "whole", method=method)
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = _run(
        [str(REPO / "tests" / "interrupted_train.py"), "KILL", "6"],
        runs,
        world,
        "cut",
        method=method,
    )
    assert killed.returncode != 0
    resumed = _run(
        ["-m", "ccr.experiments.train"], runs, world, "cut", "ckpt_path=last", method=method
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    folder = runs / "synthetic" / method
    result = json.loads((folder / "cut" / "metrics.json").read_text())
    assert result["resumed_from_step"] == 4 and result["train_steps"] == 12
    assert (
        result["metrics"] == json.loads((folder / "whole" / "metrics.json").read_text())["metrics"]
    )


RC3_STAGES = [
    "method.pretrain.max_steps=6",
    "method.finetune.max_steps=4",
    "method.backbone.pretrained=null",  # no world mBART to build for a resume check
    "trainer.checkpoint_every_n_steps=2",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "at_batch, resumed_step", [(6, 4), (10, 2)], ids=["in-pretraining", "in-fine-tuning"]
)
def test_rc3_resumes_exactly_after_a_kill_in_either_stage(at_batch, resumed_step, world, tmp_path):
    """RC3's two stages (6 pre-training steps on pairs, weak pairs and parallel text; 4 English
    fine-tuning steps), checkpointed every 2 steps: killed mid-stage in either stage (batches are
    counted over both) and resumed from that stage's last checkpoint, the run ends with the scores
    of its uninterrupted run and counts every step of both stages."""
    runs = tmp_path / "runs"

    def rc3(script_args, run_id, *extra):
        return _run(script_args, runs, world, run_id, *RC3_STAGES, *extra, method="rc3")

    whole = rc3(["-m", "ccr.experiments.train"], "whole")
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = rc3([str(REPO / "tests" / "interrupted_train.py"), "KILL", str(at_batch)], "cut")
    assert killed.returncode != 0
    folder = runs / "synthetic" / "rc3"
    trained_before = _seconds_left_on_disk(folder / "cut", resumed_step)
    started = time.perf_counter()
    resumed = rc3(["-m", "ccr.experiments.train"], "cut", "ckpt_path=last")
    process_bound = time.perf_counter() - started
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = json.loads((folder / "cut" / "metrics.json").read_text())
    expected = json.loads((folder / "whole" / "metrics.json").read_text())
    assert result["resumed_from_step"] == resumed_step
    assert result["stage_steps"] == expected["stage_steps"] == {"pretrain": 6, "finetune": 4}
    assert result["metrics"] == expected["metrics"]
    # the wall time counts the killed process's training up to its checkpoints, not only the
    # resumed process (which alone is recorded beside it)
    assert "process_wall_time_s" not in expected
    assert 0 < result["process_wall_time_s"] <= process_bound
    assert result["wall_time_s"] == pytest.approx(
        trained_before + result["process_wall_time_s"], abs=0.2
    )


def _seconds_left_on_disk(run: Path, resumed_step: int) -> float:
    """Training seconds a killed staged run left on disk: each finished stage's, and those saved
    in the checkpoint it resumes from (the unfinished stage's at ``resumed_step``)."""
    finished = sum(json.loads(p.read_text())["seconds"] for p in run.glob("stages/*/seconds.json"))
    unfinished = (load_checkpoint(p) for p in run.glob("stages/*/*.ckpt") if p.name != "done.ckpt")
    saved = {
        ckpt["callbacks"]["TrainingPosition"]["seconds"]
        for ckpt in unfinished
        if ckpt["global_step"] == resumed_step
    }
    assert saved, f"no checkpoint at step {resumed_step} in {run}"
    return finished + max(saved)


def _train_rows(csv_text: str, below: int | None = None) -> list[tuple[str, str, str]]:
    """(epoch, step, train/loss) of each logged training step, those before ``below`` only."""
    lines = csv_text.splitlines()
    column = lines[0].split(",").index("train/loss")
    rows = [
        (cells[0], cells[1], cells[column])
        for cells in (line.split(",") for line in lines[1:])
        if cells[column]
    ]
    return [row for row in rows if below is None or int(row[1]) < below]


@pytest.mark.slow
def test_a_staged_run_resumed_in_its_last_stage_counts_every_step_and_ends_with_its_scores(
    world, tmp_path
):
    """mclip's four stages of two steps, checkpointed every step, killed as the last stage's second
    step begins: the resumed run counts every stage's steps and scores as the uninterrupted run."""
    runs = tmp_path / "runs"

    def argv(run_id):
        return smoke_overrides(
            "mclip", world, runs, f"run_id={run_id}", "trainer.checkpoint_every_n_steps=1"
        )

    train_module = ["-m", "ccr.experiments.train"]
    killed = _launch([str(REPO / "tests" / "interrupted_train.py"), "KILL", "8"], argv("m"))
    assert killed.returncode != 0
    resumed = _launch(train_module, [*argv("m"), "ckpt_path=last"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "method.trikd.max_steps=2" in resumed.stdout
    result = json.loads((runs / "synthetic" / "mclip" / "m" / "metrics.json").read_text())
    assert result["stage_steps"] == {"teacher": 2, "mte_nmt": 2, "mte_ctl": 2, "trikd": 2}
    whole = _launch(train_module, argv("whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    expected = json.loads((runs / "synthetic" / "mclip" / "whole" / "metrics.json").read_text())
    assert result["metrics"] == expected["metrics"]
    # killed as trikd's second step began
    assert result["train_steps"] == 8 and result["resumed_from_step"] == 1


@pytest.mark.slow
def test_an_evaluation_on_part_of_the_split_gets_its_own_record(uninterrupted):
    """``data.splits.test=test[:4]`` scores 4 images and writes ``eval/test-first4-itc``; the
    full-split record beside it is left as it was."""
    ckpt = Path(uninterrupted["checkpoint"])
    full = evaluate(ckpt)
    part = evaluate(ckpt, ["data.splits.test=test[:4]"])
    evals = ckpt.parents[1] / "eval"
    full_record = json.loads((evals / "test-itc" / "metrics.json").read_text())
    part_record = json.loads((evals / "test-first4-itc" / "metrics.json").read_text())
    assert full_record["metrics"] == full
    assert part_record["metrics"] == part != full
    assert part_record["config"]["data"]["splits"]["test"] == "test[:4]"
    assert part_record["config_fingerprint"] != full_record["config_fingerprint"]


@pytest.mark.slow
def test_an_image_budget_scores_exactly_what_the_sliced_split_scores(uninterrupted):
    """``evaluation.max_images=4`` reports the very values of ``data.splits.test=test[:4]``, in the
    same ``eval/test-first4-itc`` folder, with the budget in the recorded config."""
    ckpt = Path(uninterrupted["checkpoint"])
    part = evaluate(ckpt, ["data.splits.test=test[:4]"])
    budget = evaluate(ckpt, ["evaluation.max_images=4"])
    record = json.loads((ckpt.parents[1] / "eval" / "test-first4-itc" / "metrics.json").read_text())
    assert budget == part and record["metrics"] == budget
    assert record["config"]["evaluation"]["max_images"] == 4
