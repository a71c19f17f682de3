"""Seconds per training step of each method at one and at two torch intra-op threads: the
measurement behind ``method.cpu_threads`` (the cpu trainer preset's thread count per method).

    python benchmarks/bench_threads.py [--methods clip rc3] [--steps 40] [--rounds 2] [key=value ...]

Every stage of a method's pipeline is timed from a fresh module (a later stage starts from random
weights here, which costs the same per step), with the suite's real trainer and datamodule and
the cpu preset's data-loading worker. Rounds alternate the thread order; medians are printed with
the 1-thread / 2-thread time ratio (above 1: two threads are faster). Run it on an idle machine:
with other jobs on the cores two OpenMP threads can be many times slower than one.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import lightning as L
import torch
from bench_throughput import StepTimer  # a sibling script: python benchmarks/bench_threads.py

from ccr.experiments.config import compose
from ccr.experiments.train import StageData, build_datamodule, stages_of
from ccr.experiments.trainer import TrainingPosition, build_trainer

THREADS = (1, 2)


def seconds_per_step(cfg, data, stage, index: int, threads: int, steps: int, warmup: int) -> float:
    L.seed_everything(cfg.seed + index, verbose=False)
    module = stage.build(None)
    torch.set_num_threads(threads)
    timer = StepTimer(warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp), Path(tmp) / "checkpoints", warmup + steps, [timer])
        trainer.fit(module, datamodule=StageData(data, stage, TrainingPosition()))
    return (timer.end - timer.start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["clip", "ccrk", "cl2cm", "covlr", "rc3"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = []
    for method in args.methods:
        cfg = compose(
            [f"method={method}", "trainer=cpu", "trainer.progress_refresh_rate=0", *args.overrides]
        )
        data = build_datamodule(cfg)
        stages = stages_of(cfg, data)
        times = {}
        for round_ in range(args.rounds):
            for threads in THREADS if round_ % 2 == 0 else THREADS[::-1]:
                for index, stage in enumerate(stages):
                    sec = seconds_per_step(
                        cfg, data, stage, index, threads, args.steps, args.warmup
                    )
                    times.setdefault((stage.name, threads), []).append(sec)
                    print(
                        f"round {round_} {method}/{stage.name} {threads} thread(s): {sec:.3f} s/step",
                        flush=True,
                    )
        for stage in stages:
            one, two = (statistics.median(times[(stage.name, t)]) for t in THREADS)
            rows.append((f"{method}/{stage.name}", one, two, one / two))
    print(f"\n{args.steps} steps per measurement, median of {args.rounds} rounds")
    print(f"{'method/stage':24s} {'1 thread':>9s} {'2 threads':>10s} {'ratio':>6s}")
    for name, one, two, ratio in rows:
        print(f"{name:24s} {one:9.3f} {two:10.3f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
