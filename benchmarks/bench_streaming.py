"""Streaming (``data=shards``) against the map-style loader on one synthetic world: time to the
first training batch, split into the datamodule's setup (map-style reads and validates every image
of every split; the stream checks a sample of shards and validates only the extracted val/test
images) and the first batch (the stream fills its shuffle buffers); then loader samples/s with one
worker (the main process) and the process's peak RSS. Each mode runs in its own process.

    python benchmarks/bench_streaming.py --world .cache/data/synthetic --out /tmp/bench_shards

The world is the default one (10,000 training images; built on first use); ``--train-size N``
builds and measures a world with N training images instead (the other splits unchanged). Shards are written
once under ``--out``. The timings are wall-clock on whatever machine runs it: on a shared machine
repeat it and read the spread. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from ccr.datamodules import shards
from ccr.experiments.config import compose
from ccr.experiments.shards import main as write_shards
from ccr.experiments.train import build_datamodule


def first_batch_and_rate(overrides: list[str], batches: int) -> dict:
    """Seconds to build the datamodule (reading / checking every split) and to get the first
    training batch; samples/s over ``batches`` more batches; the process's peak RSS."""
    cfg = compose(overrides)
    start = time.perf_counter()
    data = build_datamodule(cfg)
    setup = time.perf_counter() - start
    iterator = iter(data.train_dataloader())
    next(iterator)
    to_first = time.perf_counter() - start
    start, samples = time.perf_counter(), 0
    for _ in range(batches):
        samples += len(next(iterator)["ids"])
    rate = samples / (time.perf_counter() - start)
    return {
        "setup_s": round(setup, 2),
        "time_to_first_batch_s": round(to_first, 2),
        "samples_per_s_one_worker": round(rate, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def measure_in_subprocess(overrides: list[str], batches: int) -> dict:
    """``first_batch_and_rate`` in a fresh interpreter (its own peak RSS)."""
    code = (
        "import json, sys; from benchmarks.bench_streaming import first_batch_and_rate; "
        "print(json.dumps(first_batch_and_rate(sys.argv[2:], int(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(batches), *overrides],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", default=".cache/data/synthetic")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_shards"))
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--train-size", type=int, help="training images (default: the world's)")
    args = parser.parse_args()
    common = ["data.num_workers=0", "data.batch_size=64"]
    size = [f"data.synthetic.num_train={args.train_size}"] if args.train_size else []
    map_style = [f"data.root={args.world}", *size, *common]
    if not (args.out / "train" / shards.INDEX).exists():
        start = time.perf_counter()
        write_shards(["write", str(args.out), "--shard-size", str(args.shard_size), *map_style])
        print(f"wrote shards in {time.perf_counter() - start:.0f} s", flush=True)
    streamed = [
        "data=shards",
        f"data.root={args.out}",
        f"data.cache_dir={args.out / 'cache'}",
        "data.image_size=32",
        "data.max_length=48",
        "data.tokenizer.vocab_size=2000",
        *common,
    ]
    measure_in_subprocess(streamed, 1)  # one-time work (tokenizer, evaluation images extracted)
    result = {
        "map_style": measure_in_subprocess(map_style, args.batches),
        "streamed": measure_in_subprocess(streamed, args.batches),
    }
    index = shards.ShardIndex.load(args.out / "train")
    result["train_samples"], result["shards"] = index.total, len(index.files)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
