"""``python -m ccr.experiments.shards write OUT ...``: write webdataset shards (``data=shards``,
docs/scale.md) from the splits of any configured dataset."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.shards import write_split
from ccr.experiments.config import compose


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ccr.experiments.shards write OUT [--shard-size N] [--splits train val test]
    key=value ...``: shard the splits of the data a run's config names (any reader, or the
    synthetic world), e.g. ``data=xflickrco data.root=...``."""
    parser = argparse.ArgumentParser(prog="python -m ccr.experiments.shards")
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write", help="write shards from a configured dataset's records")
    write.add_argument("out", type=Path)
    write.add_argument("--shard-size", type=int, default=1000)
    write.add_argument("--splits", nargs="+", default=["train", "val", "test"])
    args, overrides = parser.parse_known_args(argv)
    unknown = [arg for arg in overrides if "=" not in arg]
    if unknown:
        parser.error(f"unrecognised arguments {unknown} (config overrides are key=value)")
    cfg = compose(overrides)
    data = CCRDataModule(cfg.data, seed=cfg.seed)
    data.prepare_data()
    for role in args.splits:
        if cfg.data.splits.get(role) is None:
            continue
        index = write_split(
            data.records(role),
            data.image_root,
            args.out / role,
            shard_size=args.shard_size,
            languages=data.languages,
            captions_parallel=data.captions_parallel,
        )
        print(f"{role}: {index.total} samples in {len(index.files)} shards under {index.folder}")


if __name__ == "__main__":
    main()
