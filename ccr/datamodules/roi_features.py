"""Precomputed detector ROI features by image (``data.roi_features``; RC3 spec §2.8, first choice).

Region features are an input a dataset may ship beside its images. Two stores are read:

* an LMDB keyed by image id (UTF-8) whose values are either ``.npy`` arrays ``[n, dim]`` (the
  ``np.save`` format, read without unpickling) or, in the per-image layout of VOLTA / IGLUE
  (``features_extraction/h5_to_lmdb.py`` there), a pickled dict whose ``features`` field holds the
  regions, a float array, or in older stores a base64 float32 buffer beside a ``num_boxes`` field;
  its other fields (boxes, image size, labels) are not read, nor is the extra ``keys`` entry
  listing the ids. Unpickling runs whatever code a store holds, so pickled values are read only
  with ``data.roi_allow_pickle=true`` (a store you trust); otherwise they are an error.
* a folder of per-image files ``<id>.npy`` (the array ``[n, dim]``) or ``<id>.npz`` (field
  ``features``), for features extracted by the user. ``.npy`` wins when both exist.

A record's features are looked up under its record id, its image file name and that name's stem,
in this order: IGLUE keys Flickr30K by stem, xFlickr&CO by file name. Every image has the width of
the store's first one; every record a split uses is read and checked (shape, float dtype, width,
finite values) when the split is set up, before training. Batches hold a fixed ``data.roi_regions`` regions per image: fewer are
zero-padded and flagged absent in the mask (``roi_mask``), more keep the first ones (detector order,
most confident first) with a warning, as VOLTA pads and cuts to its ``max_region_num``.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from .records import Record

FIELD = "features"
LMDB_INDEX = "keys"  # VOLTA's list of every id, not an image
NPY_SUFFIXES = (".npy", ".npz")
MISSING_ROI_POLICIES = ("error", "skip")
_ENVIRONMENTS: dict[str, tuple[int, object]] = {}  # LMDB path -> (process id, open environment)


def lmdb_environment(path: Path):
    """The read-only environment of the LMDB at ``path`` in this process. py-lmdb opens a path
    once per process, so every reader shares it; a forked process (a DataLoader worker) closes
    its inherited copy and opens its own, as LMDB forbids using an environment across ``fork``."""
    name, pid = str(path.resolve()), os.getpid()
    opened = _ENVIRONMENTS.get(name)
    if opened is not None and opened[0] == pid:
        return opened[1]
    if opened is not None:
        opened[1].close()  # the parent's, inherited by fork: this process's copy only
    try:
        import lmdb
    except ImportError:
        raise ImportError(
            f"data.roi_features {path} is an LMDB store: install the 'lmdb' package "
            f"(pip install -e '.[roi]')"
        ) from None
    try:
        env = lmdb.open(
            str(path),
            subdir=path.is_dir(),
            readonly=True,
            lock=False,
            readahead=False,
            meminit=False,
        )
    except lmdb.Error as err:
        raise ValueError(f"{path}: not a readable LMDB ({err})") from None
    _ENVIRONMENTS[name] = (pid, env)
    return env


NPY_MAGIC = b"\x93NUMPY"


class LmdbFolder:
    """A read-only LMDB of ``.npy`` values or VOLTA/IGLUE pickles (a folder with ``data.mdb``, or
    the file itself); pickles only with ``allow_pickle``."""

    def __init__(self, path: Path, allow_pickle: bool = False):
        self.path, self.allow_pickle = path, allow_pickle

    def keys(self) -> Iterator[str]:
        with lmdb_environment(self.path).begin() as txn:
            for key in txn.cursor().iternext(keys=True, values=False):
                name = bytes(key).decode("utf-8")
                if name != LMDB_INDEX:
                    yield name

    def read(self, key: str) -> np.ndarray:
        with lmdb_environment(self.path).begin() as txn:
            raw = txn.get(key.encode("utf-8"))
        if raw is None:
            raise KeyError(key)
        where = f"{self.path}: image '{key}'"
        if bytes(raw[: len(NPY_MAGIC)]) == NPY_MAGIC:
            try:
                return np.load(io.BytesIO(raw), allow_pickle=False)
            except ValueError as err:
                raise ValueError(f"{where}: not a readable .npy value ({err})") from None
        if not self.allow_pickle:
            raise ValueError(
                f"{where}: the value is a Python pickle (VOLTA's h5_to_lmdb.py layout) and "
                "unpickling runs any code the store holds; set data.roi_allow_pickle=true "
                "for a store you trust, or store .npy values (docs/rc3.md)"
            )
        try:
            item = pickle.loads(raw)
        except Exception as err:  # a damaged pickle raises many types; all mean "unreadable"
            raise ValueError(
                f"{where}: the record does not unpickle ({type(err).__name__}: "
                f"{' '.join(str(err).split())})"
            ) from None
        if not isinstance(item, dict) or FIELD not in item:
            raise ValueError(
                f"{where}: not a pickled dict with a '{FIELD}' field (the per-image "
                f"layout of VOLTA's h5_to_lmdb.py)"
            )
        features = item[FIELD]
        if not isinstance(features, (bytes, str)):
            return np.asarray(features)
        if "num_boxes" not in item:
            raise ValueError(
                f"{where}: field '{FIELD}' is an encoded buffer but the record has no "
                f"'num_boxes' field to give its region count"
            )
        values = np.frombuffer(base64.b64decode(features), dtype=np.float32)
        boxes = int(np.asarray(item["num_boxes"]).reshape(-1)[0])
        if boxes <= 0 or len(values) % boxes:
            raise ValueError(
                f"{where}: field '{FIELD}' holds {len(values)} floats, not a multiple "
                f"of num_boxes={boxes}"
            )
        return values.reshape(boxes, -1)


class NpyFolder:
    """A folder of per-image ``<id>.npy`` / ``<id>.npz`` (field ``features``) files."""

    def __init__(self, path: Path):
        self.path = path

    def keys(self) -> Iterator[str]:
        with os.scandir(self.path) as entries:
            for entry in entries:
                name = Path(entry.name)
                if name.suffix in NPY_SUFFIXES and entry.is_file():
                    yield name.stem

    def read(self, key: str) -> np.ndarray:
        for suffix in NPY_SUFFIXES:
            path = self.path / f"{key}{suffix}"
            if not path.is_file():
                continue
            try:
                loaded = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as err:
                raise ValueError(f"{path}: not a readable {suffix} file ({err})") from None
            if suffix == ".npy":
                return loaded
            with loaded:
                if FIELD not in loaded.files:
                    raise ValueError(f"{path}: no field '{FIELD}' (fields: {loaded.files})")
                return loaded[FIELD]
        raise KeyError(key)


def open_store(path: str | Path, allow_pickle: bool = False) -> LmdbFolder | NpyFolder:
    """The store at ``path``: an LMDB (a file, or a folder holding ``data.mdb``), otherwise a
    folder of per-image files."""
    path = Path(path)
    if path.is_file() or (path / "data.mdb").is_file():
        return LmdbFolder(path, allow_pickle)
    if path.is_dir():
        return NpyFolder(path)
    raise FileNotFoundError(f"data.roi_features {path}: no such LMDB or folder")


def lookup_keys(record: Record) -> list[str]:
    """Where a record's features may be stored: its id, its image file name, that name's stem."""
    keys = [record.id]
    if record.image:
        image = PurePosixPath(record.image)
        keys += [image.name, image.stem]
    return list(dict.fromkeys(keys))


class RoiStore:
    """Image key -> float32 regions ``[n, dim]``, every image checked against the width of the
    store's first image (``dim``; ``probe`` names that image)."""

    def __init__(self, path: str | Path, allow_pickle: bool = False):
        self.source = str(path)
        self.backend = open_store(path, allow_pickle)
        self.probe = next(iter(self.backend.keys()), None)
        if self.probe is None:
            raise ValueError(f"data.roi_features {self.source}: the store holds no image")
        self.dim = int(self._regions(self.probe).shape[1])

    def describe(self) -> str:
        """The store and where its width was read, for messages."""
        return f"{self.source} (image '{self.probe}', field '{FIELD}')"

    def _regions(self, key: str) -> np.ndarray:
        """The stored regions of ``key`` as float32 ``[n >= 1, width]``, any width."""
        try:
            regions = self.backend.read(key)
        except KeyError:
            raise LookupError(f"{self.source}: no ROI features for image '{key}'") from None
        where = f"{self.source}: image '{key}': field '{FIELD}'"
        if regions.ndim != 2 or len(regions) == 0:
            raise ValueError(
                f"{where} has shape {tuple(regions.shape)}, expected [regions >= 1, dim]"
            )
        if not np.issubdtype(regions.dtype, np.floating):
            raise ValueError(f"{where} holds {regions.dtype}, not floats")
        regions = np.array(regions, dtype=np.float32)
        if not np.isfinite(regions).all():
            raise ValueError(f"{where} holds NaN or infinite values")
        return regions

    def features(self, key: str) -> np.ndarray:
        """The regions stored for ``key``; a missing image or a wrong shape or width fails in one
        line naming the store, the image and the field."""
        regions = self._regions(key)
        if regions.shape[1] != self.dim:
            raise ValueError(
                f"{self.source}: image '{key}': field '{FIELD}' is "
                f"{regions.shape[1]} wide, but the store's features are {self.dim} "
                f"wide (image '{self.probe}')"
            )
        return regions

    def match(
        self, records: list[Record], source: str, on_missing: str
    ) -> tuple[list[Record], dict[str, str], list[str]]:
        """(records that have features, record id -> store key, ids of skipped records).

        A record without features is an error naming it (``on_missing="error"``) or is left out
        and returned among the skipped (``"skip"``). The features of every kept record are read
        and checked now (:meth:`features`), so a broken one stops the setup, not a later stage."""
        if on_missing not in MISSING_ROI_POLICIES:
            raise ValueError(
                f"on_missing_roi must be one of {list(MISSING_ROI_POLICIES)}, got {on_missing!r}"
            )
        available = set(self.backend.keys())
        kept, keys, skipped = [], {}, []
        for record in records:
            candidates = lookup_keys(record)
            key = next((k for k in candidates if k in available), None)
            if key is not None:
                kept.append(record)
                keys[record.id] = key
            elif on_missing == "error":
                raise ValueError(
                    f"{source}: record '{record.id}' has no ROI features in "
                    f"{self.source} (looked up {candidates}); "
                    f"data.on_missing_roi=skip leaves such records out"
                )
            else:
                skipped.append(record.id)
        for key in dict.fromkeys(keys.values()):
            self.features(key)
        return kept, keys, skipped


class ImageRois:
    """The ROI features of a list of images as fixed-shape batch rows: ``roi_features``
    ``[regions, dim]`` (zero rows where the image has fewer) and ``roi_mask`` ``[regions]``
    (True on the image's own regions)."""

    def __init__(self, store: RoiStore, keys: list[str], regions: int):
        self.store, self.keys, self.regions = store, keys, regions
        self._warned = False

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        key = self.keys[index]
        regions = self.store.features(key)
        if len(regions) > self.regions and not self._warned:
            warnings.warn(
                f"{self.store.source}: image '{key}' has {len(regions)} regions, more "
                f"than data.roi_regions={self.regions}; the first {self.regions} are "
                f"kept (warned once per process)",
                stacklevel=2,
            )
            self._warned = True
        count = min(len(regions), self.regions)
        features = torch.zeros(self.regions, self.store.dim)
        features[:count] = torch.from_numpy(regions[:count])
        return {"roi_features": features, "roi_mask": torch.arange(self.regions) < count}
