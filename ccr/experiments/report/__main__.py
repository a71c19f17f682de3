"""``python -m ccr.experiments.report --run A[,B] [--out DIR] [--top N]``: write the report.

Default output: ``A/report/`` for one run, ``A/report-vs-<B's folder name>/`` for two.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ccr.experiments import cli
from ccr.experiments.report.page import render_page
from ccr.experiments.report.ranks import instance_ranks, write_ranks_csv
from ccr.experiments.report.sources import load_run
from ccr.experiments.runs import write_atomic

TOP = 12


def build_report(folders: list[Path], out: Path | None = None, top: int = TOP) -> Path:
    """Write ``report.html`` and ``ranks.csv`` for one or two runs; return the HTML path."""
    if not 1 <= len(folders) <= 2:
        raise ValueError(f"a report compares one or two runs, got {len(folders)}")
    runs = [load_run(folder) for folder in folders]
    if len(runs) == 2:
        reason = runs[0].evaluated.same_items(runs[1].evaluated)
        if reason:
            raise ValueError(
                f"cannot compare {folders[0]} and {folders[1]} instance by instance: {reason}"
            )
    chunk = int(runs[0].record["config"].get("evaluation", {}).get("chunk_size", 1024))
    ranks = [instance_ranks(run.evaluated, chunk) for run in runs]
    if out is None:
        out = folders[0] / (
            "report" if len(folders) == 1 else f"report-vs-{folders[1].resolve().name}"
        )
    out.mkdir(parents=True, exist_ok=True)
    rows = write_ranks_csv(
        out / "ranks.csv",
        [(run.name, run.evaluated, r) for run, r in zip(runs, ranks, strict=True)],
    )
    page = out / "report.html"
    write_atomic(page, render_page(runs, ranks, top))
    print(f"report: {page} ({rows} rank rows in {out / 'ranks.csv'})")
    for run in runs:
        for difference in run.differences():
            print(
                f"warning: {run.folder}: recomputed score differs from metrics.json: {difference}"
            )
    return page


def _main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="a run folder, or two separated by a comma")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--top", type=int, default=TOP, help="images listed per section")
    options = parser.parse_args(args)
    if options.top < 1:
        raise ValueError(f"--top must be at least 1, got {options.top}")
    build_report([Path(p) for p in options.run.split(",") if p], options.out, options.top)


def main(argv: list[str] | None = None) -> None:
    cli.run(_main, argv)


if __name__ == "__main__":
    main()
