"""Train every registered method (or the ones named) on one dataset with the same budget and seeds.

    python -m ccr.experiments.compare --seeds 0 1 2 --data synthetic --methods clip ccrk -- trainer.max_steps=2000

Each run is its own process (a clean seed and memory state) with run id
``compare-<fingerprint>-seed<s>``: the fingerprint of the settings (budget, data, method config)
means a re-run with other settings starts new runs instead of reusing old ones; a re-run with the
same settings skips finished runs and resumes interrupted ones.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from ccr import methods
from ccr.experiments import cli
from ccr.experiments.config import compose
from ccr.experiments.runs import checkpoints_in, config_fingerprint, run_root


def run_id(argv: list[str], seed: int) -> str:
    return f"compare-{config_fingerprint(compose(argv))[:8]}-seed{seed}"


def _main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--methods", nargs="+", default=methods.names())
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    options = parser.parse_args(args)
    for method in options.methods:
        for seed in options.seeds:
            argv = [f"method={method}", f"data={options.data}", f"seed={seed}", *options.overrides]
            argv.append(f"run_id={run_id(argv, seed)}")
            folder = run_root(compose(argv)) / argv[-1].split("=", 1)[1]
            if (folder / "metrics.json").exists():
                print(f"skip {method} seed {seed}: already done ({folder})")
                continue
            if folder.exists() and checkpoints_in(folder):
                print(f"resume {method} seed {seed} ({folder})", flush=True)
                argv.append("ckpt_path=last")
            else:
                print(f"train {method} seed {seed}", flush=True)
            done = subprocess.run(
                [sys.executable, "-m", "ccr.experiments.train", *argv],
                cwd=Path(__file__).resolve().parents[2],
            )
            if done.returncode:
                raise SystemExit(done.returncode)


def main() -> None:
    cli.run(_main)


if __name__ == "__main__":
    main()
