"""Train every registered method (or the ones named) on one dataset with the same budget and seeds.

    python -m experiments.compare --seeds 0 1 2 --data synthetic --methods clip ccrk -- trainer.max_steps=2000

Each run is its own process (a clean seed and memory state) with run id ``compare-seed<s>``, so a
re-run skips finished runs and the leaderboard picks every row up.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import methods
from experiments.config import compose
from experiments.runs import resolve_run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--methods", nargs="+", default=methods.names())
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    args = parser.parse_args()
    for method in args.methods:
        for seed in args.seeds:
            argv = [f"method={method}", f"data={args.data}", f"seed={seed}",
                    f"run_id=compare-seed{seed}", *args.overrides]
            if (resolve_run_dir(compose(argv)) / "metrics.json").exists():
                print(f"skip {method} seed {seed}: already done")
                continue
            print(f"train {method} seed {seed}", flush=True)
            subprocess.run([sys.executable, "-m", "experiments.train", *argv], check=True,
                           cwd=Path(__file__).resolve().parents[1])


if __name__ == "__main__":
    main()
