"""Build the leaderboard from ``metrics.json`` files alone.

A row is one experiment: runs whose configurations are identical except for the seed (equal
``config_fingerprint``), with the same method, data, protocol, scorer and metric protocol. A row
shows mean ± std over its seeds (population std, ddof=0; one seed shows ± 0.00). Runs of one
method whose settings differ are separate rows, each naming the settings that differ; a seed run
twice is averaged once (its newest run) and the other runs are listed; a row scored under another
metric protocol than the suite's current one is marked. A pretrained model scored zero-shot by
``ccr.experiments.external`` is a row marked external, naming its library, model and weights tag.

Each row also says whether it converged: the rise of its validation mR over the last fifth of
training (``ccr.experiments.curves``; rows that rose by more than ``RISING_MARGIN`` are marked ↑, runs
recorded before curves existed show "no curve").

Writes ``leaderboard.md``, ``leaderboard.csv`` (every metric, mean and std: a metric a row lacks,
such as uni-modal NDCG on data without graded relevance, is an empty cell), ``leaderboard.png``
(mean recall per method and dataset) and ``learning_curves.png`` (each row's validation mR per step,
mean and spread over its seeds) beside the runs it reads, unless told where (``--out``).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ccr.datamodules.readers._files import decode_utf8
from ccr.experiments import cli
from ccr.experiments.config import ConfigError, typed
from ccr.experiments.curves import RISING_MARGIN, check_curve, mean_curve, row_rise
from ccr.experiments.runs import config_fingerprint, experiment_settings, plain, scorer_label
from ccr.metrics.protocol import METRIC_PROTOCOL

FAMILY = ("method", "data", "protocol", "scorer")
OTHER_PROTOCOL, UNRECORDED_PROTOCOL = "†", "‡"
UNIMODAL = ("i2i/NDCG@", "t2t/NDCG@")
PROBE = "probe"  # scorer label of rows ranked by RC3's first-stage probe (ccr.experiments.runs.scorer_label)


def load_results(runs: Path, split: str = "test") -> list[dict]:
    """Every metrics.json of ``split``, each with its fingerprint; a run re-scored with the same
    scorer and settings counts once (the newest file)."""
    latest: dict[tuple, dict] = {}
    for path in sorted(runs.rglob("metrics.json")):
        result = read_result(path)
        if result.get("split", "test") != split:
            continue
        check_curve(result, str(path))
        if "config" in result:
            result["config"] = as_current_code_reads(result["config"], path)
            result["config_fingerprint"] = config_fingerprint(result["config"])
            if not result.get(
                "external"
            ):  # labels as the current code names the scorer (RC3's probe)
                result["scorer"] = scorer_label(result["config"])
        elif "config_fingerprint" not in result:
            raise ValueError(f"{path}: has neither config_fingerprint nor config")
        result["_path"], result["_mtime"] = str(path), path.stat().st_mtime
        key = (
            result["method"],
            result["data"],
            result.get("run_id", str(path.parent)),
            result["scorer"],
            result["config_fingerprint"],
            _protocol_key(result),
        )
        if key not in latest or result["_mtime"] > latest[key]["_mtime"]:
            latest[key] = result
    return list(latest.values())


def read_result(path: Path) -> dict:
    """One ``metrics.json``, checked field by field: a file the suite would not have written
    (bare NaN, a string metric, a fractional seed, no metric at all) is refused naming the file
    and the field, so that no row silently averages it or counts it as a seed."""
    try:
        result = json.loads(decode_utf8(path, path.read_bytes()), parse_constant=_bare_constant)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
    except _BareConstant as err:
        raise ValueError(f"{path}: holds a bare {err} (the suite writes strict JSON)") from None
    if not isinstance(result, dict):
        raise ValueError(f"{path}: not a JSON object")
    missing = [k for k in (*FAMILY, "seed", "metrics") if k not in result]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
    for key in FAMILY:
        if not isinstance(result[key], str):
            raise ValueError(
                f"{path}: field '{key}' must be a string, got {type(result[key]).__name__}"
            )
    seed = result["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{path}: field 'seed' must be a whole number >= 0, got {seed!r}")
    metrics = result["metrics"]
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: field 'metrics' must be an object, got {type(metrics).__name__}")
    if not metrics:
        raise ValueError(
            f"{path}: field 'metrics' holds no metric; a run without scores is no seed"
        )
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"{path}: field 'metrics.{name}' must be a number, got {type(value).__name__}"
            )
    return result


class _BareConstant(Exception):
    """A bare ``NaN`` / ``Infinity`` in a JSON text (Python's json accepts them by default)."""


def _bare_constant(name: str) -> float:
    raise _BareConstant(name)


def as_current_code_reads(config: dict, path: Path) -> dict:
    """A stored config with every setting the schema has gained since it was written filled with
    its default, which by the schema's rule reproduces the old behaviour: a run from before
    ``data.roi_features`` existed and one with it at null are the same experiment, one row.
    A setting the schema no longer knows is an error naming the file. The ``method`` section is
    checked against its method's schema but kept as the run recorded it (its fingerprint is the
    one the run was published with; ``ccr.experiments.runs.LATER_DEFAULTS`` matches newer runs)."""
    try:
        checked = plain(typed(OmegaConf.create(config), "its config"))
    except ConfigError as err:
        raise ValueError(f"{path}: the current code cannot read this run's config: {err}") from None
    return {**checked, "method": config.get("method")}


def _protocol_key(result: dict) -> str:
    return json.dumps(result.get("metric_protocol"), sort_keys=True)


def _protocol_mark(result: dict) -> str:
    recorded = result.get("metric_protocol")
    if recorded is None:
        return UNRECORDED_PROTOCOL
    return "" if recorded == METRIC_PROTOCOL else OTHER_PROTOCOL


def _sliced_splits(settings: dict | None) -> list[str]:
    """``data.splits.<role>=name[:N]`` and ``evaluation.max_images=N`` settings: a row scored on
    part of a split is never comparable with full-split rows, so it always says so, alone in its
    family or not."""
    return [
        k
        for k, v in (settings or {}).items()
        if (k.startswith("data.splits.") and "[:" in str(v))
        or (k == "evaluation.max_images" and v is not None)
    ]


# A method's table of variants (``method.ablations``) lists what ``variant=`` may select; which one
# ran is the row's label. Rows whose tables differ (a variant added later) show no such keys.
VARIANT_TABLE = "method.ablations."


def _settings_shown(members_by_row: list[list[dict]]) -> list[str]:
    """For rows of one family: the settings in which each row differs from the others (the variant
    table aside), and any sliced split."""
    settings = [
        experiment_settings(m[0]["config"]) if "config" in m[0] else None for m in members_by_row
    ]
    if len(members_by_row) < 2:
        return [
            "" if s is None else ", ".join(f"{k}={s[k]}" for k in _sliced_splits(s))
            for s in settings
        ]
    known = [s for s in settings if s is not None]
    keys = sorted({k for s in known for k in s} if known else set())
    differing = [
        k
        for k in keys
        if len({json.dumps(s.get(k), sort_keys=True) for s in known}) > 1
        and not k.startswith(VARIANT_TABLE)
    ]
    shown = []
    for members, s in zip(members_by_row, settings, strict=True):
        if s is None:
            shown.append(f"config {members[0]['config_fingerprint']}")
        else:
            named = differing + [k for k in _sliced_splits(s) if k not in differing]
            shown.append(
                ", ".join(f"{k}={s.get(k)}" for k in named)
                or f"config {members[0]['config_fingerprint']}"
            )
    return shown


def aggregate(results: list[dict]) -> list[dict]:
    """One row per experiment (family + fingerprint + metric protocol), best mean recall first."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for result in results:
        key = (*(result[k] for k in FAMILY), result["config_fingerprint"], _protocol_key(result))
        groups[key].append(result)
    rows = []
    families: dict[tuple, list[dict]] = defaultdict(list)
    for members in groups.values():
        by_seed: dict[Any, list[dict]] = defaultdict(list)
        for m in sorted(members, key=lambda m: m["_mtime"], reverse=True):
            by_seed[m["seed"]].append(m)
        used = [runs[0] for runs in by_seed.values()]
        duplicates = {
            seed: [r.get("run_id", r["_path"]) for r in runs]
            for seed, runs in by_seed.items()
            if len(runs) > 1
        }
        stats = {}
        for name in sorted(set().union(*(m["metrics"] for m in used))):
            values = [m["metrics"][name] for m in used if name in m["metrics"]]
            stats[name] = (statistics.fmean(values), statistics.pstdev(values))
        rise, without_rise = row_rise(used)
        row = {
            **{k: used[0][k] for k in FAMILY},
            "config_fingerprint": used[0]["config_fingerprint"],
            "metric_protocol": used[0].get("metric_protocol"),
            "mark": _protocol_mark(used[0]),
            "seeds": sorted(m["seed"] for m in used),
            "duplicates": duplicates,
            "commits": _seeds_by_commit(used),
            "languages": used[0].get("languages", []),
            "external": used[0].get("external"),
            "stats": stats,
            "curve_rise": rise,  # mean over the seeds that have one
            "curve_seeds_without_rise": without_rise,
            "has_curve": any("learning_curve" in m for m in used),
            "curve": mean_curve(used),  # (steps, mean, std) or None
            "_members": used,
        }
        rows.append(row)
        families[tuple(row[k] for k in FAMILY)].append(row)
    for family in families.values():
        shown_by_row = _settings_shown([r["_members"] for r in family])
        for row, shown in zip(family, shown_by_row, strict=True):
            row["settings"] = shown
    for row in rows:
        del row["_members"]
    return sorted(rows, key=lambda r: (r["data"], -r["stats"].get("mR", (0.0, 0.0))[0]))


def _seeds_by_commit(runs: list[dict]) -> dict[str, list]:
    """The seeds each recorded code commit produced: a row whose seeds come from more than one
    commit has the same settings but perhaps not the same code, and its note says so."""
    seeds: dict[str, list] = defaultdict(list)
    for run in runs:
        seeds[str(run.get("git_commit") or "unrecorded")[:8]].append(run["seed"])
    return {commit: sorted(found) for commit, found in sorted(seeds.items())}


def _cell(row: dict, name: str, digits: int = 2) -> str:
    if name not in row["stats"]:
        return "–"
    mean, std = row["stats"][name]
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def unimodal_cutoffs(rows: list[dict]) -> list[int]:
    """The k of every uni-modal ``i2i/NDCG@k`` or ``t2t/NDCG@k`` any row reports, ascending (none
    for data without graded relevance, whose rows carry no uni-modal key)."""
    names = {name for r in rows for name in r["stats"]}
    return sorted(
        {
            int(name.split("@", 1)[1])
            for name in names
            if name.startswith(UNIMODAL) and name.split("@", 1)[1].isdigit()
        }
    )


BATCH_DEPENDENT = "batch-dependent"


def external_label(row: dict) -> str:
    """``external`` or ``external, <weights tag>`` for a pretrained model's row, with
    ``batch-dependent`` when its embeddings failed the batch-size check, else empty."""
    external = row.get("external")
    if not external:
        return ""
    check = external.get("batch_invariance") or {}
    return (
        "external"
        + (f", {external['pretrained']}" if external.get("pretrained") else "")
        + (f", {BATCH_DEPENDENT}" if check.get("invariant") is False else "")
    )


def still_rising(row: dict) -> bool:
    """True for a row whose validation mR rose by more than ``RISING_MARGIN`` over the last fifth."""
    return row["curve_rise"] is not None and row["curve_rise"] > RISING_MARGIN


def _rise_cell(row: dict) -> str:
    if not row["has_curve"]:
        return "no curve"
    if row["curve_rise"] is None:
        return "too few validations"
    return f"{row['curve_rise']:+.2f}" + (" ↑" if still_rising(row) else "")


def _method_cell(row: dict) -> str:
    marker = external_label(row)
    return row["method"] + row["mark"] + (f" ({marker})" if marker else "")


def _row_label(row: dict) -> str:
    """A row as its notes name it: the method and what sets the row apart (or its fingerprint)."""
    return f"{row['method']} ({row['settings'] or row['config_fingerprint']})"


def _notes(group: list[dict]) -> list[str]:
    notes = []
    if any(r.get("external") for r in group):
        notes.append(
            "- (external) a pretrained model scored zero-shot with the suite's metrics "
            "(`make eval MODEL=...`), not trained by the suite; the tag names its weights."
        )
    if any(BATCH_DEPENDENT in external_label(r) for r in group):
        notes.append(
            f"- ({BATCH_DEPENDENT}) the model embedded the same item differently in a full "
            "evaluation batch and alone (metrics.json: external.batch_invariance): its "
            "score depends on the evaluation batch size."
        )
    for r in group:
        for seed, run_ids in r["duplicates"].items():
            notes.append(
                f"- {_row_label(r)}: seed {seed} "
                f"ran {len(run_ids)} times ({', '.join(map(str, run_ids))}); the mean "
                f"uses the newest, {run_ids[0]}."
            )
        if len(r["commits"]) > 1:
            made = "; ".join(
                f"seed {','.join(map(str, seeds))} at {commit}"
                for commit, seeds in r["commits"].items()
            )
            notes.append(
                f"- {_row_label(r)}: its seeds "
                f"ran on different code ({made}); same settings, but check the commits "
                "before reading the spread as seed variance."
            )
    if any(still_rising(r) for r in group):
        notes.append(
            f"- ↑ still rising: validation mR rose by more than {RISING_MARGIN:.1f} over the "
            "last fifth of training (mean over seeds), so the row's budget stopped it "
            "before it converged."
        )
    partial = [r for r in group if r["curve_rise"] is not None and r["curve_seeds_without_rise"]]
    for r in partial:
        notes.append(
            f"- {_row_label(r)}: {r['curve_seeds_without_rise']} seed(s) without a "
            "validation on both sides of the last fifth; the rise averages the others."
        )
    if any(r["scorer"].startswith(PROBE) for r in group):
        notes.append(
            f"- scorer {PROBE} / {PROBE}+itm@k: ranked by a linear probe over frozen encoders, which "
            "is not part of RC3 (with +itm@k its ITM head re-orders the probe's top k); these rows "
            "measure the probe. RC3's own score is itm@all, its ITM head over every pair "
            '(docs/rc3.md "Retrieval").'
        )
    marks = {r["mark"] for r in group}
    if OTHER_PROTOCOL in marks:
        notes.append(
            f"- {OTHER_PROTOCOL} scored under another metric protocol than the suite's "
            f"current one (version {METRIC_PROTOCOL.get('version')}): not comparable "
            "with unmarked rows; re-evaluate the checkpoint to compare."
        )
    if UNRECORDED_PROTOCOL in marks:
        notes.append(
            f"- {UNRECORDED_PROTOCOL} metrics.json records no metric protocol (written "
            "before protocols were recorded): not comparable with unmarked rows."
        )
    return notes


def to_markdown(rows: list[dict]) -> str:
    """One table per dataset: mR, per-language R@1 (both directions), MRV (std reduction) and,
    where the data has graded relevance, uni-modal NDCG at each reported cut-off."""
    out = [
        "# Leaderboard",
        "",
        "Mean ± std over seeds, test split. mR: mean of R@1/5/10 in both directions over all",
        "languages. Per-language cells: i2t R@1 / t2i R@1. MRV: std of an instance's ranks across",
        "languages (lower is more consistent). NDCG@k cells: i2i / t2t graded NDCG (image among",
        "images, caption among the captions of every language; only for data with graded",
        "relevance, – where a row has none). A row averages runs whose configurations differ",
        "only in the seed; `settings` names what differs between rows of one method. Built from",
        "the runs' `metrics.json` files by `make leaderboard`. `val mR last 1/5`: how much the",
        f"validation mR rose over the last fifth of training (↑: more than {RISING_MARGIN:.1f}, still rising);",
        "`learning_curves.png` draws each row's validation mR per step.",
        "",
    ]
    for data in sorted({r["data"] for r in rows}):
        group = [r for r in rows if r["data"] == data]
        languages = list(dict.fromkeys(lang for r in group for lang in r["languages"]))
        cutoffs = unimodal_cutoffs(group)
        header = [
            "method",
            "protocol",
            "scorer",
            "settings",
            "seeds",
            "mR",
            "val mR last 1/5",
            *[f"{lang} R@1" for lang in languages],
            "MRV i2t",
            "MRV t2i",
            *[f"NDCG@{k} i2i / t2t" for k in cutoffs],
        ]
        out += [f"## {data}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in group:
            per_lang = [
                f"{_cell(r, f'{lang}/i2t/R@1', 1)} / {_cell(r, f'{lang}/t2i/R@1', 1)}"
                for lang in languages
            ]
            cells = [
                _method_cell(r),
                r["protocol"],
                r["scorer"],
                r["settings"],
                ",".join(map(str, r["seeds"])),
                _cell(r, "mR"),
                _rise_cell(r),
                *per_lang,
                _cell(r, "all/MRV_std/i2t"),
                _cell(r, "all/MRV_std/t2i"),
                *[
                    f"{_cell(r, f'i2i/NDCG@{k}', 3)} / {_cell(r, f't2t/NDCG@{k}', 3)}"
                    for k in cutoffs
                ],
            ]
            out.append("| " + " | ".join(cells) + " |")
        notes = _notes(group)
        out += ["", *notes] if notes else []
        out.append("")
    return "\n".join(out)


def write_csv(rows: list[dict], path: Path) -> None:
    names = sorted(set().union(*(r["stats"] for r in rows))) if rows else []
    head = [
        *FAMILY,
        "external",
        "settings",
        "config_fingerprint",
        "metric_protocol_version",
        "seeds",
        "duplicate_seed_runs",
        "val_mR_last_fifth_rise",
        "still_rising",
    ]
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*head, *[f"{n}{s}" for n in names for s in ("", " std")]])
        for r in rows:
            version = (r["metric_protocol"] or {}).get("version", "unrecorded")
            duplicates = "; ".join(
                f"seed {s}: {' '.join(map(str, ids))}" for s, ids in r["duplicates"].items()
            )
            values = [v for n in names for v in r["stats"].get(n, ("", ""))]
            rise = "" if r["curve_rise"] is None else round(r["curve_rise"], 4)
            writer.writerow(
                [
                    *(r[k] for k in FAMILY),
                    external_label(r),
                    r["settings"],
                    r["config_fingerprint"],
                    version,
                    " ".join(map(str, r["seeds"])),
                    duplicates,
                    rise,
                    int(still_rising(r)) if r["curve_rise"] is not None else "",
                    *values,
                ]
            )


def plot(rows: list[dict], path: Path) -> None:
    """Bar chart of mean recall with std error bars, one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = sorted({r["data"] for r in rows})
    fig, axes = plt.subplots(
        1, max(1, len(datasets)), figsize=(5 * max(1, len(datasets)), 3.5), squeeze=False
    )
    for ax, data in zip(axes[0], datasets, strict=False):  # one empty panel when no dataset
        group = [r for r in rows if r["data"] == data and "mR" in r["stats"]]
        labels = [
            f"{_method_cell(r)}\n{r['protocol']}/{r['scorer']}"
            + (f"\n{r['settings']}" if r["settings"] else "")
            for r in group
        ]
        means = [r["stats"]["mR"][0] for r in group]
        stds = [r["stats"]["mR"][1] for r in group]
        ax.bar(range(len(group)), means, yerr=stds, capsize=4, color="tab:blue")
        ax.set_xticks(range(len(group)), labels, fontsize=7)
        ax.set_ylabel("mean recall (test)")
        ax.set_title(data)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(rows: list[dict], path: Path) -> None:
    """Validation mR per step, one panel per dataset and method (its variants and settings as
    lines), mean over seeds with a ± std band; rows without a curve are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_curve = [r for r in rows if r["curve"] is not None]
    panels = sorted({(r["data"], r["method"].split("+")[0]) for r in with_curve})
    columns = min(3, max(1, len(panels)))
    lines = -(-max(1, len(panels)) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 3.5 * lines), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    if not panels:
        axes[0][0].text(0.5, 0.5, "no run records a learning curve", ha="center", va="center")
    for ax, (data, method) in zip(axes.flat, panels, strict=False):
        for r in (
            r for r in with_curve if (r["data"], r["method"].split("+")[0]) == (data, method)
        ):
            steps, means, stds = r["curve"]
            label = f"{_method_cell(r)} {r['scorer']}" + (
                f" ({r['settings']})" if r["settings"] else ""
            )
            line = ax.plot(
                steps, means, marker=".", label=label[:60] + (" ↑" if still_rising(r) else "")
            )[0]
            ax.fill_between(
                steps,
                [m - s for m, s in zip(means, stds, strict=True)],
                [m + s for m, s in zip(means, stds, strict=True)],
                color=line.get_color(),
                alpha=0.2,
            )
        ax.set_title(f"{method} on {data}", fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel("val mR")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build(runs: Path, out: Path | None = None) -> list[dict]:
    """Read ``runs``, write the leaderboard files to ``out`` (default: ``runs`` itself)."""
    rows = aggregate(load_results(runs))
    out = runs if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    (out / "leaderboard.md").write_text(to_markdown(rows), encoding="utf-8")
    write_csv(rows, out / "leaderboard.csv")
    plot(rows, out / "leaderboard.png")
    plot_curves(rows, out / "learning_curves.png")
    return rows


def _main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where to write leaderboard.{md,csv,png} (default: the --runs folder)",
    )
    options = parser.parse_args(args)
    if not options.runs.is_dir():
        raise FileNotFoundError(f"no runs folder {options.runs}")
    rows = build(options.runs, options.out)
    print(f"{len(rows)} leaderboard rows -> {(options.out or options.runs) / 'leaderboard.md'}")


def main() -> None:
    cli.run(_main)


if __name__ == "__main__":
    main()
