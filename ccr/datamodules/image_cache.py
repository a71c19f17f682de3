"""A split's images decoded and resized once into one uint8 array on disk, read by the loaders in
place of the image files (``data.image_cache: true``).

Decoding a JPEG and resizing it bicubically costs a loader worker milliseconds per image, every
epoch; reading a pre-sized row of a memory-mapped ``.npy`` costs microseconds. The rows hold exactly
the bytes :meth:`ImageTransform.pixels` returns, so a cached image is the same tensor as the direct
path's. The file is named by a hash of the image size and each file's path, size and modification
time: a changed image gets a new cache, never a stale row.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .datasets import ImageTransform


def cache_key(paths: Sequence[Path], size: int) -> str:
    """Hash of the image size and every file's path, byte size and modification time."""
    digest = hashlib.sha256(f"{size}\n".encode())
    for path in paths:
        stat = os.stat(path)
        digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:20]


class _Pixels(Dataset):
    def __init__(self, paths: Sequence[Path], transform: ImageTransform):
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, np.ndarray]:
        return index, self.transform.pixels(self.paths[index])


def _stack(items):
    return [i for i, _ in items], np.stack([p for _, p in items])


def build_cache(
    paths: Sequence[Path], transform: ImageTransform, folder: Path, workers: int = 0
) -> Path:
    """The cache file of ``paths`` at ``transform.size`` in ``folder``, built if absent (decoding in
    ``workers`` processes; written to a temporary name and renamed, so concurrent builders and
    interrupted builds never leave a partial file under the final name)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = transform.size
    target = folder / f"images-{size}px-{cache_key(paths, size)}.npy"
    if target.exists():
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        rows = np.lib.format.open_memmap(
            staging, mode="w+", dtype=np.uint8, shape=(len(paths), size, size, 3)
        )
        loader = DataLoader(
            _Pixels(paths, transform), batch_size=64, num_workers=workers, collate_fn=_stack
        )
        for indices, pixels in loader:
            rows[indices[0] : indices[-1] + 1] = pixels
        rows.flush()
        del rows
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    target.with_suffix(".json").write_text(json.dumps({"images": len(paths), "size": size}))
    return target


class CachedImages:
    """Drop-in for :class:`ImageTransform` on the cached paths: ``cached(path)`` is the normalised
    image tensor, read from the cache row of ``path`` (the array is opened lazily in each loader
    worker, never pickled)."""

    def __init__(self, paths: Sequence[Path], file: Path, transform: ImageTransform):
        self.rows = {str(path): row for row, path in enumerate(paths)}
        self.file, self.transform = file, transform
        self._array: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_array": None}

    def __call__(self, path: Path) -> torch.Tensor:
        row = self.rows.get(str(path))
        if row is None:
            raise KeyError(f"{path}: not among the images cached in {self.file}")
        if self._array is None:
            self._array = np.load(self.file, mmap_mode="r")
        return self.transform.normalise(np.array(self._array[row]))


def cached_images(
    paths: Sequence[Path], transform: ImageTransform, folder: Path, workers: int = 0
) -> CachedImages:
    """``paths`` (unique, in any order) cached at the transform's size in ``folder``."""
    unique = list(dict.fromkeys(paths))
    return CachedImages(unique, build_cache(unique, transform, folder, workers), transform)
