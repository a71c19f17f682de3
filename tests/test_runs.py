"""One run per folder, weights-only checkpoints, atomic files, strict JSON, zero-step and diverged
runs: the ways a run could lose or falsify its result."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from worlds import QUICK_BACKBONES

from ccr.experiments.config import ConfigError, compose
from ccr.experiments.evaluate import evaluate
from ccr.experiments.runs import claim_run_dir, save_config, write_atomic, write_metrics
from ccr.experiments.train import train

REPO = Path(__file__).resolve().parents[1]
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
    "trainer.max_steps=3",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return tmp_path_factory.mktemp("world")


def tiny(world, runs, *extra):
    return compose([f"data.root={world}", f"run_dir={runs}", *TINY, *extra])


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_payload_never_runs(tmp_path, world):
    cfg = tiny(world, tmp_path / "runs", "run_id=x", "data.root=/nonexistent")
    run = tmp_path / "runs" / "synthetic" / "clip" / "x"
    run.mkdir(parents=True)
    save_config(cfg, run)
    marker = tmp_path / "payload-ran"
    evil = run / "checkpoints" / "last.ckpt"
    evil.parent.mkdir()
    torch.save({"state_dict": {}, "x": Payload(marker)}, evil)
    with pytest.raises(ConfigError, match=r"last\.ckpt is not a suite checkpoint"):
        evaluate(evil)  # the data root does not exist: the checkpoint is refused before any data
    assert not marker.exists()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "ccr.experiments.evaluate", f"ckpt={evil}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and not marker.exists()
    assert (
        done.stderr.strip().splitlines()[-1].startswith(f"error: {evil} is not a suite checkpoint")
    )


def test_a_run_folder_with_a_checkpoint_or_a_result_is_never_reused(tmp_path, world):
    runs = tmp_path / "runs"
    with claim_run_dir(tiny(world, runs, "run_id=once")) as folder:
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"x")
    with pytest.raises(
        ConfigError,
        match="already exists with checkpoints; resume it with "
        "ckpt_path=last, or choose another run_id",
    ):
        with claim_run_dir(tiny(world, runs, "run_id=once", "seed=1")):
            pass
    (folder / "metrics.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"has finished \(metrics.json exists\); choose another"):
        with claim_run_dir(tiny(world, runs, "run_id=once", "seed=1")):
            pass


def test_a_failed_start_leaves_no_run_folder(tmp_path, world):
    runs = tmp_path / "runs"
    with pytest.raises(RuntimeError, match="setup failed"):
        with claim_run_dir(tiny(world, runs, "run_id=failed")) as folder:
            save_config(tiny(world, runs, "run_id=failed"), folder)
            raise RuntimeError("setup failed")
    assert not folder.exists()
    with claim_run_dir(tiny(world, runs, "run_id=failed")) as again:
        assert again == folder


def test_a_folder_left_by_a_failed_start_is_replaced_by_the_next_run(tmp_path, world, capsys):
    """A folder with a config but no checkpoint and no result (a start killed before its first
    checkpoint, or left by an older version) does not block its run_id."""
    runs = tmp_path / "runs"
    stub = runs / "synthetic" / "clip" / "stub"
    stub.mkdir(parents=True)
    save_config(tiny(world, runs, "run_id=stub", "seed=7"), stub)
    (stub / "csv").mkdir()
    with claim_run_dir(tiny(world, runs, "run_id=stub")) as folder:
        assert folder == stub and sorted(p.name for p in folder.iterdir()) == [".lock"]
    assert (
        "holds no checkpoint and no result (a failed start); this run replaces it"
        in capsys.readouterr().out
    )


def test_config_only_problems_are_reported_before_data_is_read_and_leave_no_folder(tmp_path):
    """The data root cannot exist (its parent is a file): each error below must come from the
    config alone."""
    runs = tmp_path / "runs"
    (tmp_path / "a-file").write_text("")
    base = [f"data.root={tmp_path / 'a-file' / 'data'}", f"run_dir={runs}", "run_id=early"]
    cases = [
        (["method=ccrk", "variant=bogus"], "ccrk ablation 'bogus'"),
        (["method=cl2cm", "variant=bogus"], "cl2cm ablation 'bogus'"),
        (["method=rc3", "variant=bogus"], "rc3 ablation 'bogus'"),
        (["method=mclip", "variant=bogus"], "mclip variant 'bogus'"),
        (["method=mclip", "protocol=fine-tune-xx"], "mclip protocol 'fine-tune-xx'"),
        (
            ["method=rc3", "data.languages=[de,ja]"],
            "rc3 protocol fine-tune-en fine-tunes on English",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            train(compose([*base, *overrides]))
        assert not runs.exists() or not any(runs.rglob("early")), overrides


def test_resume_needs_an_existing_run_with_a_checkpoint_and_the_same_config(tmp_path, world):
    runs = tmp_path / "runs"
    with pytest.raises(ConfigError, match="no run folder .*mistyped"):
        with claim_run_dir(tiny(world, runs, "run_id=mistyped", "ckpt_path=last")):
            pass
    with claim_run_dir(tiny(world, runs, "run_id=r")) as folder:
        save_config(tiny(world, runs, "run_id=r"), folder)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        with claim_run_dir(tiny(world, runs, "run_id=r", "ckpt_path=last")):
            pass
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"differs in .*seed: 0 -> 1"):
        with claim_run_dir(tiny(world, runs, "run_id=r", "ckpt_path=last", "seed=1")):
            pass


def test_a_second_writer_is_refused(tmp_path, world):
    runs = tmp_path / "runs"
    with claim_run_dir(tiny(world, runs, "run_id=busy")) as folder:
        save_config(tiny(world, runs, "run_id=busy"), folder)
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"x")
        env = {k: v for k, v in os.environ.items() if k != "CCR_RUN_DIR"}
        env["PYTHONPATH"] = str(REPO)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ccr.experiments.train",
                f"data.root={world}",
                f"run_dir={runs}",
                *TINY,
                "run_id=busy",
                "ckpt_path=last",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
    assert done.returncode == 2
    assert (
        f"error: run folder {folder} is in use by another process (pid {os.getpid()})"
        in done.stderr
    )


def test_files_are_replaced_atomically(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text("old: 1\n")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError):
        write_atomic(path, "new: 2\n" * 1000)
    assert path.read_text() == "old: 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["config.yaml"]


def test_metrics_json_is_strict(tmp_path, world):
    cfg = tiny(world, tmp_path / "runs")
    with pytest.raises(ValueError, match="non-finite value nan at 'metrics.mR'"):
        write_metrics(tmp_path / "metrics.json", cfg, {"mR": float("nan")})
    assert not (tmp_path / "metrics.json").exists()
    write_metrics(tmp_path / "metrics.json", cfg, {"mR": 1.0})
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["metric_protocol"]["version"] >= 1 and len(record["config_fingerprint"]) == 16


@pytest.mark.slow
def test_zero_training_steps_is_an_error(tmp_path, world):
    cfg = tiny(world, tmp_path / "runs", "data.batch_size=64", "run_id=z")
    with pytest.raises(ValueError, match=r"would train zero steps.*48 items, data.batch_size=64"):
        train(cfg)
    assert not (tmp_path / "runs" / "synthetic" / "clip" / "z" / "metrics.json").exists()


@pytest.mark.slow
def test_a_diverged_run_stops_with_one_line_and_writes_no_metrics(tmp_path, world):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ccr.experiments.train",
            f"data.root={world}",
            f"run_dir={tmp_path / 'runs'}",
            *TINY,
            "trainer.max_steps=6",
            "optim.lr=1e6",
            "run_id=d",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged at step ") and "stage 'main'" in last
    assert "train/temperature" in last
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / "synthetic" / "clip" / "d" / "metrics.json").exists()


@pytest.mark.slow
def test_make_compare_runs_again_after_a_failed_start(tmp_path, world):
    """A start that failed before its first checkpoint (here: a killed one, which leaves its
    folder with the config only) does not stop a re-run of compare from training that run."""
    from ccr.experiments import compare

    overrides = [f"data.root={world}", f"run_dir={tmp_path / 'runs'}", *TINY]
    argv = ["method=clip", "data=synthetic", "seed=0", *overrides]
    folder = tmp_path / "runs" / "synthetic" / "clip" / compare.run_id(argv, 0)
    folder.mkdir(parents=True)
    save_config(compose([*argv, f"run_id={folder.name}"]), folder)
    compare._main(["--seeds", "0", "--methods", "clip", "--", *overrides])
    assert json.loads((folder / "metrics.json").read_text())["train_steps"] == 3
