"""Streaming (``data=shards``) against the map-style loader on one synthetic world: time to the
first training batch (map-style reads and validates every image of every split; the stream checks
a sample of shards), loader samples/s with one worker (the main process) and the RSS the loader
adds while iterating.

    python benchmarks/bench_streaming.py --world .cache/data/synthetic --out /tmp/bench_shards

The world is the default one (10,000 training images; built on first use). Shards are written
once under ``--out``. The timings are wall-clock on whatever machine runs it: on a shared machine
repeat it and read the spread. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from datamodules import shards
from experiments.config import compose
from experiments.train import build_datamodule


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def first_batch_and_rate(overrides: list[str], batches: int) -> dict:
    """Seconds to build the datamodule (reading / checking every split) and get the first
    training batch; then samples/s over ``batches`` more batches and the RSS they add."""
    cfg = compose(overrides)
    start = time.perf_counter()
    data = build_datamodule(cfg)
    iterator = iter(data.train_dataloader())
    next(iterator)
    to_first = time.perf_counter() - start
    before = rss_mib()
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        samples += len(next(iterator)["ids"])
    rate = samples / (time.perf_counter() - start)
    return {"time_to_first_batch_s": round(to_first, 2), "samples_per_s_one_worker": round(rate, 1),
            "rss_added_while_iterating_mib": round(rss_mib() - before, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", default=".cache/data/synthetic")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_shards"))
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--shard-size", type=int, default=1000)
    args = parser.parse_args()
    common = ["data.num_workers=0", "data.batch_size=64"]
    map_style = [f"data.root={args.world}", *common]
    if not (args.out / "train" / shards.INDEX).exists():
        start = time.perf_counter()
        shards.main(["write", str(args.out), "--shard-size", str(args.shard_size), *map_style])
        print(f"wrote shards in {time.perf_counter() - start:.0f} s", flush=True)
    streamed = ["data=shards", f"data.root={args.out}", f"data.cache_dir={args.out / 'cache'}",
                "data.image_size=32", "data.max_length=48", "data.tokenizer.vocab_size=2000", *common]
    first_batch_and_rate(streamed, 1)  # one-time work (tokenizer, evaluation images extracted)
    result = {"map_style": first_batch_and_rate(map_style, args.batches),
              "streamed": first_batch_and_rate(streamed, args.batches)}
    index = shards.ShardIndex.load(args.out / "train")
    result["train_samples"], result["shards"] = index.total, len(index.files)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
