"""What sizing CL2CM's streamed epoch costs before the first step (``triple_census``): counted from
the tars' ``.json`` members (a split with alignment marks) and from ``captions.jsonl`` (the same
split read as unmarked), against reading every byte of the shards once (``raw_samples``).

    python benchmarks/bench_triple_census.py --out /tmp/bench_census --samples 20000

Writes ``--samples`` records (a 64x64 random PNG, five captions in each of en, de, ja; every fourth
marked weak) as 10 shards under ``--out`` once, then times each count in this process (the page
cache is warm after the write). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image

from ccr.datamodules.records import Record
from ccr.datamodules.shards import ShardIndex, raw_samples, write_split
from ccr.datamodules.triples import triple_census

LANGUAGES = ["en", "de", "ja"]


def write(out: Path, samples: int) -> ShardIndex:
    if (out / "train" / "shards.json").is_file():
        return ShardIndex.load(out / "train")
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    records = []
    for i in range(samples):
        pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(out / "images" / f"{i}.png")
        captions = {lang: [f"{lang} caption {i} {k}" for k in range(5)] for lang in LANGUAGES}
        alignment = "weak" if i % 4 == 0 else "strict"
        records.append(Record(str(i), f"{i}.png", captions, {"alignment": alignment}))
    return write_split(
        records,
        out / "images",
        out / "train",
        shard_size=max(1, samples // 10),
        languages=LANGUAGES,
        captions_parallel=True,
    )


def seconds(call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args()
    index = write(args.out, args.samples)
    marked, census = seconds(lambda: triple_census(index, LANGUAGES, "en", ["de", "ja"]))
    unmarked, _ = seconds(
        lambda: triple_census(replace(index, alignment=False), LANGUAGES, "en", ["de", "ja"])
    )
    paths = [index.folder / name for name in index.files]
    every_byte, _ = seconds(lambda: sum(1 for _ in raw_samples(paths)))
    size = sum(path.stat().st_size for path in paths)
    print(
        json.dumps(
            {
                "samples": index.total,
                "shards": len(index.files),
                "megabytes": round(size / 1e6, 1),
                "triples": sum(census.triples),
                "weak": census.weak,
                "census_from_tars_s": round(marked, 2),
                "census_from_captions_jsonl_s": round(unmarked, 2),
                "read_every_byte_s": round(every_byte, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
