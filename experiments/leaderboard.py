"""Build the leaderboard from ``metrics.json`` files alone.

One row per (method, data, protocol, scorer), mean ± std over seeds (population std, ddof=0; a
single seed shows ± 0.00 and n=1). Writes ``leaderboard.md``, ``leaderboard.csv`` (every metric,
mean and std) and ``leaderboard.png`` (mean recall per method and dataset).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path

ROW_KEY = ("method", "data", "protocol", "scorer")


def load_results(runs: Path, split: str = "test") -> list[dict]:
    """Every metrics.json of ``split``; for the same run and scorer the newest file wins."""
    latest: dict[tuple, tuple[float, dict]] = {}
    for path in sorted(runs.rglob("metrics.json")):
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
        missing = [k for k in (*ROW_KEY, "seed", "metrics") if k not in result]
        if missing:
            raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
        if result.get("split", "test") != split:
            continue
        key = (*(result[k] for k in ROW_KEY), result.get("run_id", str(path.parent)))
        mtime = path.stat().st_mtime
        if key not in latest or mtime > latest[key][0]:
            latest[key] = (mtime, result)
    return [result for _, result in latest.values()]


def aggregate(results: list[dict]) -> list[dict]:
    """Mean and std over seeds of every metric, one entry per row key, best mean recall first."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for result in results:
        groups[tuple(result[k] for k in ROW_KEY)].append(result)
    rows = []
    for key, members in groups.items():
        names = sorted(set().union(*(m["metrics"] for m in members)))
        stats = {}
        for name in names:
            values = [m["metrics"][name] for m in members if name in m["metrics"]]
            stats[name] = (statistics.fmean(values), statistics.pstdev(values))
        rows.append({
            **dict(zip(ROW_KEY, key)),
            "seeds": sorted(m["seed"] for m in members),
            "languages": members[0].get("languages", []),
            "stats": stats,
        })
    return sorted(rows, key=lambda r: (r["data"], -r["stats"].get("mR", (0.0, 0.0))[0]))


def _cell(row: dict, name: str, digits: int = 2) -> str:
    if name not in row["stats"]:
        return "–"
    mean, std = row["stats"][name]
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def to_markdown(rows: list[dict]) -> str:
    """One table per dataset: mR, per-language R@1 (both directions) and MRV (std reduction)."""
    out = ["# Leaderboard", "",
           "Mean ± std over seeds, test split. mR: mean of R@1/5/10 in both directions over all",
           "languages. Per-language cells: i2t R@1 / t2i R@1. MRV: std of an instance's ranks across",
           "languages (lower is more consistent). Built from the runs' `metrics.json` files by",
           "`make leaderboard`; each file holds the run's full config and seed.", ""]
    for data in sorted({r["data"] for r in rows}):
        group = [r for r in rows if r["data"] == data]
        languages = list(dict.fromkeys(lang for r in group for lang in r["languages"]))
        header = ["method", "protocol", "scorer", "seeds", "mR",
                  *[f"{lang} R@1" for lang in languages], "MRV i2t", "MRV t2i"]
        out += [f"## {data}", "", "| " + " | ".join(header) + " |",
                "|" + "---|" * len(header)]
        for r in group:
            per_lang = [
                f"{_cell(r, f'{lang}/i2t/R@1', 1)} / {_cell(r, f'{lang}/t2i/R@1', 1)}" for lang in languages
            ]
            cells = [r["method"], r["protocol"], r["scorer"], ",".join(map(str, r["seeds"])),
                     _cell(r, "mR"), *per_lang, _cell(r, "all/MRV_std/i2t"), _cell(r, "all/MRV_std/t2i")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def write_csv(rows: list[dict], path: Path) -> None:
    names = sorted(set().union(*(r["stats"] for r in rows))) if rows else []
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*ROW_KEY, "seeds", *[f"{n}{s}" for n in names for s in ("", " std")]])
        for r in rows:
            values = [v for n in names for v in r["stats"].get(n, ("", ""))]
            writer.writerow([*(r[k] for k in ROW_KEY), " ".join(map(str, r["seeds"])), *values])


def plot(rows: list[dict], path: Path) -> None:
    """Bar chart of mean recall with std error bars, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["data"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(datasets)), figsize=(5 * max(1, len(datasets)), 3.5),
                             squeeze=False)
    for ax, data in zip(axes[0], datasets):
        group = [r for r in rows if r["data"] == data and "mR" in r["stats"]]
        labels = [f"{r['method']}\n{r['protocol']}/{r['scorer']}" for r in group]
        means = [r["stats"]["mR"][0] for r in group]
        stds = [r["stats"]["mR"][1] for r in group]
        ax.bar(range(len(group)), means, yerr=stds, capsize=4, color="tab:blue")
        ax.set_xticks(range(len(group)), labels, fontsize=8)
        ax.set_ylabel("mean recall (test)")
        ax.set_title(data)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build(runs: Path, out: Path) -> list[dict]:
    rows = aggregate(load_results(runs))
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.md").write_text(to_markdown(rows), encoding="utf-8")
    write_csv(rows, out / "leaderboard.csv")
    plot(rows, out / "leaderboard.png")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    rows = build(args.runs, args.out)
    print(f"{len(rows)} leaderboard rows -> {args.out / 'leaderboard.md'}")


if __name__ == "__main__":
    main()
