"""Inputs a user can get wrong outside the data files: a checkpoint of another method, a full disk,
a read-only run folder, a GPU preset on a machine without one. Each is a one-line ``error:`` naming
the file or the key, before any data is read where the config alone decides."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from ccr.experiments import evaluate as evaluate_cli
from ccr.experiments import train as train_cli
from ccr.experiments.config import compose
from ccr.experiments.runs import save_config

# Any read would fail (no dataset, no tokenizer folder): the checks below must come first.
NO_DATA = ["data=multi30k", "data.root=/no/such/dataset", "data.tokenizer.name=/no/such/tokenizer"]


def run_cli(main, args, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def checkpoint_of(method: str, path: Path) -> Path:
    """A weights-only checkpoint as Lightning writes it for a module of ``method``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "state_dict": {"logit_scale": torch.zeros(())},
            "global_step": 3,
            "hyper_parameters": {"method": {"name": method}},
        },
        path,
    )
    return path


def test_training_from_a_checkpoint_of_another_method_is_refused_before_any_data(tmp_path, capsys):
    ckpt = checkpoint_of("clip", tmp_path / "clip.ckpt")
    err = run_cli(
        train_cli.main,
        ["method=ccrk_paper", f"ckpt_path={ckpt}", *NO_DATA, f"run_dir={tmp_path / 'runs'}"],
        capsys,
    )
    assert err == (
        f"error: {ckpt} is a checkpoint of method 'clip', not of this run's method "
        "'ccrk' (method.name)"
    )


def test_evaluating_a_checkpoint_of_another_method_is_refused_before_any_data(tmp_path, capsys):
    run = tmp_path / "runs" / "synthetic" / "ccrk" / "x"
    run.mkdir(parents=True)
    save_config(compose(["method=ccrk_paper", *NO_DATA]), run)
    ckpt = checkpoint_of("clip", run / "checkpoints" / "last.ckpt")
    err = run_cli(evaluate_cli.main, [f"ckpt={ckpt}"], capsys)
    assert err == (
        f"error: {ckpt} is a checkpoint of method 'clip', not of this run's method "
        "'ccrk' (method.name)"
    )


def test_the_gpu_preset_without_a_gpu_is_refused_before_any_data(tmp_path, capsys, monkeypatch):
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: False))
    monkeypatch.setattr(MPSAccelerator, "is_available", staticmethod(lambda: False))
    err = run_cli(
        train_cli.main,
        ["method=ccrk_paper", "trainer=gpu", *NO_DATA, f"run_dir={tmp_path / 'runs'}"],
        capsys,
    )
    assert err == (
        "error: trainer.accelerator=gpu (TRAINER=gpu) but this machine has no GPU that "
        "torch can use; use TRAINER=cpu (trainer=cpu)"
    )
    assert not (tmp_path / "runs").exists()


def test_more_gpus_than_the_machine_has_are_refused_naming_the_key(tmp_path, capsys, monkeypatch):
    from lightning.pytorch.accelerators import CUDAAccelerator

    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "auto_device_count", staticmethod(lambda: 1))
    err = run_cli(
        train_cli.main,
        [
            "method=ccrk_paper",
            "trainer=gpu",
            "trainer.devices=4",
            *NO_DATA,
            f"run_dir={tmp_path / 'runs'}",
        ],
        capsys,
    )
    assert err == "error: trainer.devices=4 asks for 4 GPUs but this machine has 1"


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_a_result_names_the_file(tmp_path, capsys, monkeypatch):
    from ccr.experiments import cli
    from ccr.experiments.runs import write_atomic

    target = tmp_path / "run" / "metrics.json"
    monkeypatch.setattr("ccr.experiments.runs.os.fsync", no_space)
    err = run_cli(lambda argv: cli.run(lambda args: write_atomic(target, "{}"), argv), [], capsys)
    assert err == (
        f"error: {target}: No space left on device; free space, or write the run "
        "elsewhere (run_dir=<folder>)"
    )
    assert list(target.parent.iterdir()) == []  # no partial file is left behind


def test_a_full_disk_while_saving_a_checkpoint_names_the_file(tmp_path, monkeypatch):
    from ccr.experiments.trainer import AtomicCheckpointIO

    target = tmp_path / "checkpoints" / "last.ckpt"
    monkeypatch.setattr("ccr.experiments.trainer.os.fsync", no_space)
    with pytest.raises(OSError) as raised:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, target)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert list(target.parent.iterdir()) == []


def test_a_read_only_run_dir_is_a_one_line_error_naming_the_folder(tmp_path, capsys, monkeypatch):
    """Root ignores permission bits, so the read-only file system is simulated where the run
    folder is created."""
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "runs")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    err = run_cli(
        train_cli.main, ["method=ccrk_paper", *NO_DATA, f"run_dir={tmp_path / 'runs'}"], capsys
    )
    assert err == (
        f"error: {tmp_path / 'runs' / 'multi30k' / 'ccrk_paper'}: Read-only file system; "
        "write the run elsewhere (run_dir=<folder>)"
    )
