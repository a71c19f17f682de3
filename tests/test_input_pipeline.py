"""The training input pipeline set by the trainer preset (workers from the machine, pinned memory,
prefetch) and the float32 matmul precision the GPU presets choose."""

import pytest
import torch
from omegaconf import OmegaConf
from test_datamodule import synthetic_cfg

from datamodules.datamodule import CCRDataModule
from experiments.config import ConfigError, compose
from experiments.trainer import configure_matmul_precision, loader_settings


@pytest.mark.parametrize("preset", ["gpu", "ddp", "multinode"])
def test_gpu_presets_take_workers_from_the_machine_pin_memory_and_prefetch(preset, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = compose([f"trainer={preset}"])
    per_process = 16 if preset == "gpu" else 8  # 16 cores; DDP: two local processes share them
    assert loader_settings(cfg, cores=16) == {"num_workers": per_process - 1, "pin_memory": True,
                                              "prefetch_factor": 4}
    assert cfg.trainer.float32_matmul_precision == "highest"


def test_cpu_preset_keeps_the_data_presets_worker_count_and_no_pinning():
    cfg = compose(["trainer=cpu", "data.num_workers=3"])
    assert loader_settings(cfg, cores=16) == {"num_workers": 3, "pin_memory": False}
    cfg = compose(["trainer=gpu", "trainer.loader_workers=5"])
    assert loader_settings(cfg, cores=16)["num_workers"] == 5


def test_an_unknown_matmul_precision_is_an_error_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.float32_matmul_precision"):
        compose(["trainer.float32_matmul_precision=fast"])


def test_the_matmul_precision_key_is_applied_and_null_leaves_torchs_setting():
    before = torch.get_float32_matmul_precision()
    try:
        configure_matmul_precision(compose(["trainer.float32_matmul_precision=medium"]))
        assert torch.get_float32_matmul_precision() == "medium"
        configure_matmul_precision(compose([]))
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(before)


def test_training_loader_takes_the_settings_and_gives_the_same_batches(tmp_path):
    cfg = synthetic_cfg(tmp_path, num_workers=0)
    plain = CCRDataModule(cfg, seed=0)
    tuned = CCRDataModule(OmegaConf.create(cfg), seed=0,
                          loader={"num_workers": 2, "pin_memory": True, "prefetch_factor": 3})
    for module in (plain, tuned):
        module.prepare_data()
        module.setup("fit")
    loader = tuned.train_dataloader()
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor) == (2, True, 3)
    assert loader.persistent_workers
    for expected, got in zip(plain.train_dataloader(), loader):
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert torch.equal(value, got[key]), key
            else:
                assert value == got[key], key
