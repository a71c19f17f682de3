"""Experiment loggers as a config choice (``trainer.logger``): TensorBoard and CSV by default,
W&B and MLflow only when their optional package is installed."""

import errno
import importlib.util
import os

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from ccr.experiments import loggers, train
from ccr.experiments.config import ConfigError, compose


def test_tensorboard_and_csv_are_the_default_loggers_in_the_run_folder(tmp_path):
    built = loggers.build_loggers(compose([]), tmp_path, "main", 25)
    assert len(built) == 2
    assert isinstance(built[0], TensorBoardLogger) and isinstance(built[1], CSVLogger)
    assert all(x.save_dir == str(tmp_path) for x in built)


def test_the_logger_list_chooses_the_loggers(tmp_path):
    built = loggers.build_loggers(compose(["trainer.logger=[csv]"]), tmp_path, "main", 25)
    assert len(built) == 1 and isinstance(built[0], CSVLogger)


def test_an_unknown_logger_is_refused():
    with pytest.raises(ConfigError, match="trainer.logger: unknown logger 'neptune'; choose from"):
        loggers.check_loggers(compose(["trainer.logger=[csv,neptune]"]))


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_an_optional_logger_without_its_package_is_a_one_line_error_before_the_run(
    name, monkeypatch, tmp_path, capsys
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loggers.importlib.util,
        "find_spec",
        lambda module, *a: None if module == name else real(module, *a),
    )
    with pytest.raises(SystemExit) as exit_info:
        train.main([f"trainer.logger=[csv,{name}]", f"run_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert f"'{name}' needs the {name} package: pip install 'ccr-suite[{name}]'" in err
    assert not any(tmp_path.iterdir())


def test_mlflow_logs_into_the_run_folder_when_installed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (built,) = loggers.build_loggers(compose(["trainer.logger=[mlflow]"]), tmp_path, "main", 25)
    assert built._tracking_uri == (tmp_path / "mlruns").resolve().as_uri()


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a failed write: no file named


def test_a_full_disk_while_the_csv_log_is_written_is_one_line_naming_the_file(
    tmp_path, monkeypatch, capsys
):
    from ccr.experiments import cli

    (csv_logger,) = loggers.build_loggers(compose(["trainer.logger=[csv]"]), tmp_path, "main", 1)
    monkeypatch.setattr("csv.DictWriter.writerows", full_disk)

    def log_a_step(args):
        csv_logger.log_metrics({"train/loss": 1.0}, step=0)

    with pytest.raises(SystemExit):
        cli.run(log_a_step, [])
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'csv' / 'main' / 'metrics.csv'}: No space left on device; free "
        "space, or write the run elsewhere (run_dir=<folder>)"
    )


def test_a_full_disk_while_tensorboard_writes_names_its_folder(tmp_path, monkeypatch):
    (board,) = loggers.build_loggers(compose(["trainer.logger=[tensorboard]"]), tmp_path, "main", 1)
    monkeypatch.setattr("torch.utils.tensorboard.writer.FileWriter.add_event", full_disk)
    with pytest.raises(OSError) as raised:
        board.log_metrics({"train/loss": 1.0}, step=0)
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename == str(tmp_path / "tensorboard" / "main")
