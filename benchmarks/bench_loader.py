"""What one loader worker delivers, on the CPU: the proxy for whether the input pipeline keeps a GPU
fed without one at hand.

    python benchmarks/bench_loader.py --target 1600          # 1600 samples/s: clip's bare step rate

Two measurements, each in this one process (what one worker process does):

* ``jpeg``: images of real-data size (default 500x375, JPEG quality 90, smooth content with noise,
  about the bytes of a Flickr30K photo) generated here, read per item as the training loader does
  (decode, bicubic resize to ``--image-size``, normalise) against reading them from the
  pre-sized cache (``data.image_cache``);
* ``train``: the synthetic world's real training loader (items + collate: K captions tokenised to
  ``data.max_length``), its images rendered at ``--image-size``, direct and cached.

For each: items/s per worker and the workers a GPU step rate of ``--target`` samples/s needs.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ccr.datamodules.datasets import ImageTransform
from ccr.datamodules.image_cache import cached_images

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def photo_like(width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """Smooth colour fields plus sensor-like noise: JPEG sizes near real photos' (not pure noise)."""
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    image = np.asarray(
        Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), np.int16
    )
    noise = rng.normal(0, 12, image.shape).astype(np.int16)
    return Image.fromarray(np.clip(image + noise, 0, 255).astype(np.uint8))


def write_jpegs(folder: Path, count: int, width: int, height: int) -> list[Path]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        paths.append(folder / f"{i:05d}.jpg")
        photo_like(width, height, rng).save(paths[-1], "JPEG", quality=90)
    return paths


def rate(read, paths: list[Path], repeats: int) -> float:
    """Items per second of ``read(path)`` over ``paths``, ``repeats`` times (after one warm read)."""
    read(paths[0])
    start = time.perf_counter()
    for _ in range(repeats):
        for path in paths:
            read(path)
    return repeats * len(paths) / (time.perf_counter() - start)


def loader_rate(loader, batches: int) -> float:
    iterator = iter(loader)
    next(iterator)
    start, items = time.perf_counter(), 0
    for _ in range(batches):
        items += len(next(iterator)["images"])
    return items / (time.perf_counter() - start)


def report(name: str, per_worker: float, target: float) -> None:
    print(
        f"{name:34s} {per_worker:9.1f} items/s per worker  -> {math.ceil(target / per_worker):3d} workers "
        f"for {target:.0f} samples/s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=1600.0, help="GPU samples/s to feed")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--jpeg-size", default="500x375")
    parser.add_argument("--images", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)  # a loader worker runs one thread
    width, height = map(int, args.jpeg_size.split("x"))
    transform = ImageTransform(args.image_size, MEAN, STD)
    print(f"one process, one thread; {args.image_size} px; target {args.target:.0f} samples/s")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "jpeg").mkdir()
        paths = write_jpegs(tmp / "jpeg", args.images, width, height)
        kib = sum(p.stat().st_size for p in paths) / len(paths) / 1024
        report(
            f"jpeg {width}x{height} ({kib:.0f} KiB) direct",
            rate(transform, paths, args.repeats),
            args.target,
        )
        cached = cached_images(paths, transform, tmp / "cache")
        report(f"jpeg {width}x{height} cached", rate(cached, paths, args.repeats), args.target)
        for image_cache in (False, True):
            from ccr.experiments.config import compose
            from ccr.experiments.train import build_datamodule

            cfg = compose(
                [
                    "method=clip",
                    f"data.root={tmp / 'world'}",
                    "data.backbones=null",
                    f"data.image_size={args.image_size}",
                    f"data.batch_size={args.batch}",
                    f"data.synthetic.render_size={args.image_size}",
                    "data.num_workers=0",
                    f"data.synthetic.num_train={args.batch * (args.batches + 2)}",
                    "data.synthetic.num_val=8",
                    "data.synthetic.num_test=8",
                    "data.max_length=40",
                    f"data.image_cache={str(image_cache).lower()}",
                ]
            )
            data = build_datamodule(cfg, roles=("train",))
            name = f"train loader, world png{' cached' if image_cache else ''}"
            report(name, loader_rate(data.train_dataloader(), args.batches), args.target)


if __name__ == "__main__":
    main()
