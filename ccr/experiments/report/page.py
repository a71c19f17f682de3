"""The consistency report as one self-contained HTML page (inline SVG and images, no script)."""

from __future__ import annotations

import base64
import io
import math
from html import escape

from PIL import Image

from ccr.experiments.report.ranks import (
    DIRECTIONS,
    InstanceRanks,
    most_different,
    most_inconsistent,
    rank_gap,
)
from ccr.experiments.report.sources import Run
from ccr.experiments.report.svg import grouped_bars, histogram_bins

THUMBNAIL = 112
BINS = 12
STYLE = """
body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.num{text-align:right;font-variant-numeric:tabular-nums}
.instance{display:flex;gap:14px;border:1px solid #ddd;border-radius:6px;padding:10px;margin:10px 0}
.instance img{width:112px;height:112px;object-fit:contain;background:#eee}
.warn{background:#fff3cd;border:1px solid #e0c36c;padding:6px 10px}.ok{color:#2d6a3e}
.worst{background:#fde2e2}.best{background:#e3f4e6}.small{font-size:11px;color:#666}
"""


def _thumbnail(path: str) -> str:
    """The image as a small inline PNG, or a note when the file is gone."""
    try:
        with Image.open(path) as image:
            small = image.convert("RGB")
            small.thumbnail((THUMBNAIL, THUMBNAIL))
            buffer = io.BytesIO()
            small.save(buffer, format="PNG")
    except OSError:
        return f'<div class="small">image not readable:<br>{escape(path)}</div>'
    data = base64.b64encode(buffer.getvalue()).decode()
    return f'<img alt="{escape(path)}" src="data:image/png;base64,{data}">'


def _rank(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.4g}"


def _header(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        record, evaluated = run.record, run.evaluated
        version = (record.get("metric_protocol") or {}).get("version", "unrecorded")
        differences = run.differences()
        if record.get("scorer", "itc") != "itc":
            check = (
                f'<span class="warn">scored with {escape(record["scorer"])}: the ranks here are the '
                "embeddings' (itc; RC3: its probe's), not the cross-encoder's</span>"
            )
        elif differences:
            check = (
                f'<span class="warn">{len(differences)} recomputed score(s) differ from '
                f"metrics.json: {escape('; '.join(differences[:5]))}</span>"
            )
        else:
            check = (
                f'<span class="ok">all {len(run.recomputed)} recomputed scores equal '
                "metrics.json</span>"
            )
        rows.append(
            f"<tr><td>{escape(run.name)}</td><td>{escape(str(record['data']))}</td>"
            f"<td>{escape(str(record.get('protocol', '')))}</td><td>{escape(str(version))}</td>"
            f"<td class='num'>{len(evaluated.image_ids)}</td><td class='num'>{len(evaluated.captions)}</td>"
            f"<td>{escape(' '.join(evaluated.languages))}</td>"
            f"<td>{escape(' '.join(evaluated.mrv_languages or evaluated.languages))}</td><td>{check}</td></tr>"
        )
    return (
        "<table><tr><th>run</th><th>data</th><th>protocol</th><th>metric protocol</th><th>images</th>"
        "<th>captions</th><th>languages</th><th>MRV languages</th><th>check</th></tr>"
        + "".join(rows)
        + "</table>"
    )


def _recall(runs: list[Run]) -> str:
    languages = list(dict.fromkeys(lang for run in runs for lang in run.evaluated.languages))
    series = []
    for run in runs:
        for direction in DIRECTIONS:
            label = f"{run.name} {direction} R@1" if len(runs) > 1 else f"{direction} R@1"
            series.append(
                (label, [run.recomputed.get(f"{lang}/{direction}/R@1") for lang in languages])
            )
    chart = grouped_bars(
        languages, series, y_label="R@1 (%)", y_max=100.0, title="R@1 per language, both directions"
    )
    head = "".join(f"<th>{escape(lang)}</th>" for lang in languages)
    rows = []
    for run in runs:
        for direction in DIRECTIONS:
            for k in ("R@1", "R@5", "R@10"):
                cells = "".join(
                    f"<td class='num'>{run.recomputed[key]:.2f}</td>"
                    if (key := f"{lang}/{direction}/{k}") in run.recomputed
                    else "<td>–</td>"
                    for lang in languages
                )
                rows.append(f"<tr><td>{escape(run.name)}</td><td>{direction} {k}</td>{cells}</tr>")
    table = f"<table><tr><th>run</th><th>score</th>{head}</tr>{''.join(rows)}</table>"
    return f'<h2 id="recall">Recall per language</h2>{chart}{table}'


def _spread(runs: list[Run], ranks: list[InstanceRanks]) -> str:
    parts = [
        '<h2 id="spread">Rank spread across languages</h2>',
        "<p>An image's spread is the population standard deviation of its ranks over the MRV "
        "languages; MRV_std is its mean over the images that have every MRV language.</p>",
    ]
    for direction in DIRECTIONS:
        spreads = [[float(v) for v in r.spread(direction) if not math.isnan(v)] for r in ranks]
        upper = max((max(s) for s in spreads if s), default=1.0)
        labels: list[str] = []  # the same bins for every run
        series = []
        for run, values in zip(runs, spreads, strict=True):
            labels, counts = histogram_bins(values, BINS, upper)
            series.append((run.name, counts))
        title = {"i2t": "image→text (TR)", "t2i": "text→image (IR)"}[direction]
        parts.append(
            grouped_bars(
                labels,
                series,
                y_label="images",
                title=f"{title}: images per spread",
                value_format="{:.0f}",
            )
        )
        notes = []
        for run, values in zip(runs, spreads, strict=True):
            mean = sum(values) / len(values) if values else math.nan
            recorded = run.record["metrics"].get(f"all/MRV_std/{direction}")
            notes.append(
                f"{escape(run.name)}: mean spread {mean:.4f} over {len(values)} images; "
                f"metrics.json all/MRV_std/{direction} = "
                + ("–" if recorded is None else f"{recorded:.4f}")
            )
        parts.append("<p class='small'>" + "<br>".join(notes) + "</p>")
    return "".join(parts)


def _instance(image: int, runs: list[Run], ranks: list[InstanceRanks], headline: str) -> str:
    """One image: thumbnail, its caption in every language and every run's ranks."""
    evaluated = runs[0].evaluated
    languages = ranks[0].languages
    head = "".join(
        f"<th>{escape(run.name)} i2t</th><th>{escape(run.name)} t2i</th>"
        if len(runs) > 1
        else "<th>i2t rank</th><th>t2i rank</th>"
        for run in runs
    )
    rows = []
    for column, lang in enumerate(languages):
        caption_index = int(ranks[0].first_caption[image, column])
        caption = evaluated.captions[caption_index] if caption_index >= 0 else ""
        cells = []
        for r in ranks:
            for direction in DIRECTIONS:
                row = getattr(r, direction)[image]
                value = float(row[column])
                finite = [float(v) for v in row if not math.isnan(v)]
                css = (
                    "worst"
                    if finite and value == max(finite) and max(finite) > min(finite)
                    else "best"
                    if finite and value == min(finite) and max(finite) > min(finite)
                    else ""
                )
                cells.append(f"<td class='num {css}'>{_rank(value)}</td>")
        rows.append(
            f"<tr><td>{escape(lang)}</td><td lang='{escape(lang)}'>{escape(caption)}</td>"
            f"{''.join(cells)}</tr>"
        )
    image_id = evaluated.image_ids[image]
    return (
        f'<div class="instance" data-image-id="{escape(image_id)}">'
        f"{_thumbnail(evaluated.image_paths[image])}<div><b>{escape(image_id)}</b> "
        f"<span class='small'>(image {image}) {headline}</span>"
        f"<table><tr><th>language</th><th>caption (first in that language)</th>{head}</tr>"
        f"{''.join(rows)}</table></div></div>"
    )


def _inconsistent(runs: list[Run], ranks: list[InstanceRanks], top: int) -> str:
    parts = []
    for index, (run, r) in enumerate(zip(runs, ranks, strict=True)):
        spread = r.combined_spread()
        chosen = most_inconsistent(r, top)
        parts.append(
            f'<h2 id="inconsistent-{index}">{escape(run.name)}: the {len(chosen)} images whose '
            "ranks disagree most across languages</h2><section class='instances'>"
        )
        for image in chosen:
            headline = (
                f"spread {float(spread[image]):.4g} (i2t {float(r.spread('i2t')[image]):.4g}, "
                f"t2i {float(r.spread('t2i')[image]):.4g})"
            )
            parts.append(_instance(image, runs, ranks, headline))
        parts.append("</section>")
    return "".join(parts)


def _disagreement(runs: list[Run], ranks: list[InstanceRanks], top: int) -> str:
    gap = rank_gap(ranks[0], ranks[1])
    chosen = most_different(ranks[0], ranks[1], top)
    parts = [
        f'<h2 id="disagree">Where {escape(runs[0].name)} and {escape(runs[1].name)} disagree: '
        f"the {len(chosen)} images with the largest rank gap</h2>",
        "<p>Rank gap: the largest difference between the two runs' ranks of an image over "
        "languages and directions.</p><section class='instances'>",
    ]
    parts += [
        _instance(image, runs, ranks, f"rank gap {float(gap[image]):.4g}") for image in chosen
    ]
    parts.append("</section>")
    return "".join(parts)


def render_page(runs: list[Run], ranks: list[InstanceRanks], top: int) -> str:
    """The whole page for one run, or two runs side by side (same images and captions)."""
    title = "Consistency report: " + " vs ".join(run.name for run in runs)
    body = [
        f"<h1>{escape(title)}</h1>",
        _header(runs),
        _recall(runs),
        _spread(runs, ranks),
        _inconsistent(runs, ranks, top),
    ]
    if len(runs) == 2:
        body.append(_disagreement(runs, ranks, top))
    body.append(
        "<p class='small'>Ranks are expected 1-based ranks under uniform random tie-breaking "
        "(the suite's metric protocol); per-instance ranks of every image are in ranks.csv.</p>"
    )
    return (
        f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{escape(title)}</title>"
        f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )
