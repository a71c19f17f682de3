"""Inline SVG charts (no script, no external file): grouped bars with a legend and value labels."""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

PALETTE = ("#3b6fb6", "#e08a2c", "#5aa469", "#c4455b", "#7d5ba6", "#8c8c8c")


def grouped_bars(
    groups: list[str],
    series: Sequence[tuple[str, Sequence[float | None]]],
    *,
    y_label: str,
    y_max: float | None = None,
    title: str = "",
    value_format: str = "{:.1f}",
) -> str:
    """Bars for each group (x axis), one bar per series; ``None`` draws no bar. Returns ``<svg>``."""
    values = [v for _, vs in series for v in vs if v is not None]
    top = y_max if y_max is not None else (max(values) if values else 1.0) or 1.0
    slanted = len(groups) > 8  # long axis labels would overlap: tilt them
    bar, gap, left, bottom, height = 18, 14, 56, (80 if slanted else 44), 220
    group_width = bar * len(series) + gap
    width = left + group_width * len(groups) + 20
    legend_height = 18 * len(series)
    total = height + bottom + legend_height + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" '
        f'role="img" aria-label="{escape(title or y_label)}" font-family="sans-serif" font-size="11">'
    ]
    if title:
        parts.append(
            f'<text x="{left}" y="14" font-size="13" font-weight="bold">{escape(title)}</text>'
        )
    y0 = 24
    for tick in range(5):
        tick_value = top * tick / 4
        y = y0 + height - height * tick / 4
        parts.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
        )
        parts.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick_value:.3g}</text>'
        )
    parts.append(
        f'<text transform="translate(12,{y0 + height / 2}) rotate(-90)" '
        f'text-anchor="middle">{escape(y_label)}</text>'
    )
    for g, group in enumerate(groups):
        x_group = left + g * group_width + gap / 2
        for s, (name, vs) in enumerate(series):
            value = vs[g]
            if value is None:
                continue
            h = height * min(value, top) / top
            x, y = x_group + s * bar, y0 + height - h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar - 2}" height="{h:.1f}" '
                f'fill="{PALETTE[s % len(PALETTE)]}"><title>{escape(name)} · {escape(group)}: '
                f"{value_format.format(value)}</title></rect>"
            )
            if len(groups) * len(series) <= 40:
                parts.append(
                    f'<text x="{x + (bar - 2) / 2:.1f}" y="{y - 3:.1f}" text-anchor="middle" '
                    f'font-size="9">{value_format.format(value)}</text>'
                )
        x_label, y_label_at = x_group + bar * len(series) / 2, y0 + height + 14
        turn = f' transform="rotate(-35 {x_label:.1f} {y_label_at})"' if slanted else ""
        parts.append(
            f'<text x="{x_label:.1f}" y="{y_label_at}" text-anchor="{"end" if slanted else "middle"}"'
            f"{turn}>{escape(group)}</text>"
        )
    for s, (name, _) in enumerate(series):
        y = y0 + height + bottom + 18 * s
        parts.append(
            f'<rect x="{left}" y="{y - 9}" width="10" height="10" fill="{PALETTE[s % len(PALETTE)]}"/>'
        )
        parts.append(f'<text x="{left + 16}" y="{y}">{escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def histogram_bins(values: list[float], bins: int, upper: float) -> tuple[list[str], list[int]]:
    """Counts of ``values`` in ``bins`` equal bins over [0, upper] (the last bin closed)."""
    upper = upper if upper > 0 else 1.0
    counts = [0] * bins
    for value in values:
        counts[min(int(value / upper * bins), bins - 1)] += 1
    labels = [f"{upper * i / bins:.3g}–{upper * (i + 1) / bins:.3g}" for i in range(bins)]
    return labels, counts
