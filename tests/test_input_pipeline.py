"""The training input pipeline set by the trainer preset (workers from the machine, pinned memory,
prefetch) and the float32 matmul precision the GPU presets choose."""

import pytest
import torch
from omegaconf import OmegaConf
from test_datamodule import synthetic_cfg

from ccr.datamodules.datamodule import CCRDataModule
from ccr.experiments.config import ConfigError, compose
from ccr.experiments.trainer import configure_matmul_precision, loader_settings


@pytest.mark.parametrize("preset", ["gpu", "ddp", "multinode"])
def test_gpu_presets_take_workers_from_the_machine_pin_memory_and_prefetch(preset, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = compose([f"trainer={preset}"])
    per_process = 16 if preset == "gpu" else 8  # 16 cores; DDP: two local processes share them
    assert loader_settings(cfg, cores=16) == {
        "num_workers": per_process - 1,
        "pin_memory": True,
        "prefetch_factor": 4,
    }
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
    tuned = CCRDataModule(
        OmegaConf.create(cfg),
        seed=0,
        loader={"num_workers": 2, "pin_memory": True, "prefetch_factor": 3},
    )
    for module in (plain, tuned):
        module.prepare_data()
        module.setup("fit")
    loader = tuned.train_dataloader()
    assert (loader.num_workers, loader.pin_memory, loader.prefetch_factor) == (2, True, 3)
    assert loader.persistent_workers
    for expected, got in zip(plain.train_dataloader(), loader, strict=True):
        for key, value in expected.items():
            if torch.is_tensor(value):
                assert torch.equal(value, got[key]), key
            else:
                assert value == got[key], key


def test_cached_images_are_exactly_the_pixels_of_the_direct_path(tmp_path):
    from PIL import Image

    from ccr.datamodules.datasets import ImageTransform
    from ccr.datamodules.image_cache import cached_images

    gen = torch.Generator().manual_seed(0)
    paths = []
    for i, (w, h, kind) in enumerate([(50, 37, "JPEG"), (37, 50, "PNG"), (24, 24, "JPEG")]):
        pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        paths.append(tmp_path / f"{i}.{kind.lower()}")
        Image.fromarray(pixels).save(paths[-1], kind)
    transform = ImageTransform(24, [0.5, 0.4, 0.3], [0.2, 0.25, 0.3])
    cached = cached_images(paths + paths[:1], transform, tmp_path / "cache", workers=0)
    for path in reversed(paths):
        assert torch.equal(cached(path), transform(path))
    assert len(list((tmp_path / "cache").glob("*.npy"))) == 1
    again = cached_images(paths, transform, tmp_path / "cache")  # reused, not rebuilt
    assert again.file == cached.file
    import os

    os.utime(paths[0], ns=(1, 1))  # a changed file gets a new cache
    assert cached_images(paths, transform, tmp_path / "cache").file != cached.file
    with pytest.raises(KeyError, match="not among the images cached"):
        cached(tmp_path / "other.png")


def test_datamodule_with_the_image_cache_gives_the_same_batches_and_eval_images(tmp_path):
    plain = CCRDataModule(synthetic_cfg(tmp_path, num_workers=0), seed=0)
    cached = CCRDataModule(synthetic_cfg(tmp_path, num_workers=0, image_cache=True), seed=0)
    for module in (plain, cached):
        module.prepare_data()
        module.setup("fit")
    for expected, got in zip(plain.train_dataloader(), cached.train_dataloader(), strict=True):
        assert torch.equal(expected["images"], got["images"])
        assert torch.equal(expected["input_ids"], got["input_ids"])
    plain_images = next(iter(plain.eval_view("val").image_loader(4)))["images"]
    cached_view = cached.eval_view("val")
    assert type(cached_view.transform).__name__ == "CachedImages"
    assert torch.equal(plain_images, next(iter(cached_view.image_loader(4)))["images"])
    assert list((tmp_path / "image-cache").glob("*.npy"))


def test_normalising_by_lookup_gives_the_bits_of_the_per_pixel_arithmetic_for_every_byte():
    from ccr.datamodules.datasets import ImageTransform

    transform = ImageTransform(
        4, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    )
    every_byte = torch.arange(256, dtype=torch.uint8).view(16, 16, 1).repeat(1, 1, 3)
    every_byte[..., 1] = every_byte[..., 1].flip(0)  # channels see the bytes at other positions
    arithmetic = (every_byte.permute(2, 0, 1).float() / 255.0 - transform.mean) / transform.std
    assert torch.equal(transform.normalise(every_byte.numpy()), arithmetic)
