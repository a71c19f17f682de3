"""The consistency report on a tiny world: its ranks, spreads and listed instances equal a
brute-force recomputation from the embeddings, its numbers equal the metrics' own, two runs side
by side, and the page renders in headless Chromium without console errors."""

import csv
import json
import math
import re

import numpy as np
import pytest
from browser import render, requires_chromium
from external_models import save_tiny_hf_clip, save_tiny_open_clip
from worlds import QUICK_BACKBONES

from ccr.experiments import external
from ccr.experiments.config import compose
from ccr.experiments.report.__main__ import build_report
from ccr.experiments.report.__main__ import main as report_main
from ccr.experiments.report.evaluated import EMBEDDINGS, EvaluatedSet
from ccr.experiments.train import train

LANGUAGES = ["en", "de", "ja"]
TINY_WORLD = [
    *QUICK_BACKBONES,
    "data.synthetic.num_train=32",
    "data.synthetic.num_val=8",
    "data.synthetic.num_test=16",
    "data.eval_batch_size=16",
    "data.batch_size=8",
    "data.tokenizer.vocab_size=300",
    f"data.languages=[{','.join(LANGUAGES)}]",
    "data.num_workers=0",
]
TOP = 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two external models scored on one tiny world: {"open_clip": folder, "hf": folder}."""
    base = tmp_path_factory.mktemp("report")
    world, models = base / "world", base / "models"
    common = [f"data.root={world}", *TINY_WORLD]
    folders = {}
    open_clip_dir = save_tiny_open_clip(models / "oc")
    hf_dir = save_tiny_hf_clip(
        models / "hf", ["a red square", "ein grüner Kreis", "左に赤い四角"] * 4
    )
    for name, model in (
        ("open_clip", f"open_clip:local-dir:{open_clip_dir}"),
        ("hf", f"hf:{hf_dir}"),
    ):
        external.main([f"model={model}", "device=cpu", f"run_dir={base / name}", *common])
        (folders[name],) = [p.parent for p in (base / name).rglob("metrics.json")]
    folders["common"] = common
    folders["base"] = base
    return folders


def brute_force_ranks(evaluated):
    """Expected 1-based ranks [N, L] per direction, straight from the definition with numpy.
    The score matrix is one float32 matmul, as the engine's (a different BLAS kernel could
    round a near-tie differently)."""
    image_emb, text_emb = evaluated.image_emb, evaluated.text_emb
    owner = evaluated.caption_image.numpy()
    n = len(evaluated.image_ids)
    i2t = np.full((n, len(evaluated.languages)), np.nan)
    t2i = np.full((n, len(evaluated.languages)), np.nan)
    for column, lang in enumerate(evaluated.languages):
        captions = np.array([i for i, c in enumerate(evaluated.caption_language) if c == lang])
        scores = (image_emb @ text_emb[captions].T).numpy()  # [N, C]
        for image in range(n):
            positive = owner[captions] == image
            if not positive.any():
                continue
            best = scores[image][positive].max()
            higher, tied = (scores[image] > best).sum(), (scores[image] == best).sum()
            tied_positives = (scores[image][positive] == best).sum()
            i2t[image, column] = higher + (tied - tied_positives) / (tied_positives + 1) + 1
            first = np.flatnonzero(positive)[0]
            column_scores, gold = scores[:, first], scores[image, first]
            higher, tied = (column_scores > gold).sum(), (column_scores == gold).sum()
            t2i[image, column] = higher + (tied - 1) / 2 + 1
    return i2t, t2i


def spread(table, columns):
    return table[:, columns].std(1)


def listed_ids(page: str, section: str) -> list[str]:
    start = page.index(f'<h2 id="{section}">')
    end = page.find("<h2", start + 1)
    return re.findall(
        r'class="instance" data-image-id="([^"]+)"', page[start : end if end > 0 else None]
    )


def top_by(values, ids, count):
    order = sorted(
        (i for i in range(len(values)) if not math.isnan(values[i])), key=lambda i: (-values[i], i)
    )
    return [ids[i] for i in order[:count]]


def test_the_report_lists_exactly_the_instances_with_the_largest_spread(runs, tmp_path):
    page_path = build_report([runs["open_clip"]], tmp_path, top=TOP)
    page = page_path.read_text()
    evaluated = EvaluatedSet.load(runs["open_clip"] / EMBEDDINGS)
    record = json.loads((runs["open_clip"] / "metrics.json").read_text())
    i2t, t2i = brute_force_ranks(evaluated)
    columns = list(range(len(LANGUAGES)))
    combined = (spread(i2t, columns) + spread(t2i, columns)) / 2
    expected = top_by(list(combined), evaluated.image_ids, TOP)
    assert listed_ids(page, "inconsistent-0") == expected
    # the spreads are what MRV averages: their means are the metrics' own MRV values
    assert np.nanmean(spread(i2t, columns)) == pytest.approx(
        record["metrics"]["all/MRV_std/i2t"], abs=1e-9
    )
    assert np.nanmean(spread(t2i, columns)) == pytest.approx(
        record["metrics"]["all/MRV_std/t2i"], abs=1e-9
    )
    assert np.nanmean(combined) == pytest.approx(record["metrics"]["all/MRV"], abs=1e-9)
    assert "recomputed scores equal metrics.json" in page

    with (tmp_path / "ranks.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * len(evaluated.image_ids)
    for row in rows:
        table = i2t if row["direction"] == "i2t" else t2i
        image = int(row["image_index"])
        assert row["image_id"] == evaluated.image_ids[image]
        for column, lang in enumerate(LANGUAGES):
            assert float(row[f"rank_{lang}"]) == pytest.approx(table[image, column], abs=1e-9)
        assert float(row["spread"]) == pytest.approx(spread(table, columns)[image], abs=1e-9)


def test_each_listed_instance_shows_its_captions_and_ranks(runs, tmp_path):
    page = build_report([runs["open_clip"]], tmp_path, top=1).read_text()
    evaluated = EvaluatedSet.load(runs["open_clip"] / EMBEDDINGS)
    (image_id,) = listed_ids(page, "inconsistent-0")
    image = evaluated.image_ids.index(image_id)
    i2t, t2i = brute_force_ranks(evaluated)
    card = page[page.index(f'data-image-id="{image_id}"') :]
    card = card[: card.index("</table>")]
    assert "data:image/png;base64," in card
    for column, lang in enumerate(LANGUAGES):
        first = next(
            i
            for i, (owner, c) in enumerate(
                zip(evaluated.caption_image.tolist(), evaluated.caption_language, strict=True)
            )
            if owner == image and c == lang
        )
        caption = (
            evaluated.captions[first]
            .replace("&", "&amp;")
            .replace("<", "&lt;")
            .replace(">", "&gt;")
        )
        row = card[card.index(f"<td>{lang}</td>") :]
        row = row[: row.index("</tr>")]
        assert caption in row
        assert re.findall(r"class='num[^']*'>([^<]+)<", row) == [
            f"{i2t[image, column]:.4g}",
            f"{t2i[image, column]:.4g}",
        ]


def test_two_runs_side_by_side_list_where_they_disagree_most(runs, tmp_path):
    page = build_report([runs["open_clip"], runs["hf"]], tmp_path, top=TOP).read_text()
    a = EvaluatedSet.load(runs["open_clip"] / EMBEDDINGS)
    b = EvaluatedSet.load(runs["hf"] / EMBEDDINGS)
    (a_i2t, a_t2i), (b_i2t, b_t2i) = brute_force_ranks(a), brute_force_ranks(b)
    gap = np.nanmax(np.concatenate([np.abs(a_i2t - b_i2t), np.abs(a_t2i - b_t2i)], 1), 1)
    assert listed_ids(page, "disagree") == top_by(list(gap), a.image_ids, TOP)
    assert listed_ids(page, "inconsistent-1")  # the second run's own section
    with (tmp_path / "ranks.csv").open() as f:
        runs_in_csv = {row["run"] for row in csv.DictReader(f)}
    assert len(runs_in_csv) == 2


def test_runs_on_different_captions_are_not_compared(runs, tmp_path, capsys):
    other = tmp_path / "other"
    model = json.loads((runs["open_clip"] / "metrics.json").read_text())["method"]
    external.main(
        [
            f"model={model}",
            "device=cpu",
            f"run_dir={other}",
            *runs["common"],
            "data.languages=[en,de]",
        ]
    )
    (folder,) = [p.parent for p in other.rglob("metrics.json")]
    with pytest.raises(SystemExit) as exit_info:
        report_main(["--run", f"{runs['open_clip']},{folder}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert err.startswith("error: cannot compare") and err.endswith("their captions differ")


def test_a_folder_without_metrics_and_a_foreign_embeddings_file_are_one_line_errors(
    runs, tmp_path, capsys
):
    with pytest.raises(SystemExit):
        report_main(["--run", str(tmp_path)])
    assert (
        capsys.readouterr().err.strip()
        == f"error: {tmp_path} is not a finished run folder (no metrics.json)"
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metrics.json").write_text((runs["open_clip"] / "metrics.json").read_text())
    (broken / EMBEDDINGS).write_bytes(b"not a tensor file")
    with pytest.raises(SystemExit):
        report_main(["--run", str(broken)])
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(f"error: {broken / EMBEDDINGS}: not an evaluated set")
    )


def test_a_changed_metrics_json_is_flagged_not_trusted(runs, tmp_path):
    """The page recomputes every score; a metrics.json that disagrees is shown as such."""
    folder = tmp_path / "edited"
    folder.mkdir()
    record = json.loads((runs["open_clip"] / "metrics.json").read_text())
    record["metrics"]["en/i2t/R@1"] += 10
    (folder / "metrics.json").write_text(json.dumps(record))
    (folder / EMBEDDINGS).write_bytes((runs["open_clip"] / EMBEDDINGS).read_bytes())
    page = build_report([folder], tmp_path / "out").read_text()
    assert "1 recomputed score(s) differ from metrics.json: en/i2t/R@1" in page


@pytest.mark.slow
def test_a_trained_run_is_re_encoded_from_its_checkpoint_and_matches_its_metrics(runs, tmp_path):
    run_dir = train(
        compose(
            [
                "method=clip",
                f"run_dir={tmp_path / 'runs'}",
                "trainer.max_steps=2",
                "trainer.log_every_n_steps=1",
                "trainer.progress_refresh_rate=0",
                *runs["common"],
            ]
        )
    )
    page = build_report([run_dir], tmp_path / "out").read_text()
    assert re.search(r"all \d+ recomputed scores equal metrics.json", page)
    assert len(listed_ids(page, "inconsistent-0")) == 12


@requires_chromium
def test_the_page_renders_in_headless_chromium_without_console_errors(runs, tmp_path):
    page = build_report([runs["open_clip"], runs["hf"]], tmp_path, top=3)
    screenshot = tmp_path / "report.png"
    assert render(page, screenshot) == []
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@requires_chromium
def test_the_browser_helper_reports_console_errors(tmp_path):
    """The check above can fail: a page with a script error and a missing file is caught."""
    bad = tmp_path / "bad.html"
    bad.write_text(
        "<html><body><script>console.error('boom'); missing_function();</script>"
        "<img src='absent.png'></body></html>"
    )
    errors = render(bad)
    assert any("boom" in e for e in errors)
    assert any("missing_function is not defined" in e for e in errors)
    assert any("absent.png" in e for e in errors)


def test_spread_uses_only_the_mrv_languages(runs, tmp_path):
    """With data.mrv_languages a subset (as xFlickr&CO's en de ja zh of 8), the spread and the
    listed images use only those languages, and the means still equal the metrics' MRV."""
    model = json.loads((runs["open_clip"] / "metrics.json").read_text())["method"]
    external.main(
        [
            f"model={model}",
            "device=cpu",
            f"run_dir={tmp_path / 'runs'}",
            *runs["common"],
            "data.mrv_languages=[en,ja]",
        ]
    )
    (folder,) = [p.parent for p in (tmp_path / "runs").rglob("metrics.json")]
    page = build_report([folder], tmp_path / "out", top=TOP).read_text()
    evaluated = EvaluatedSet.load(folder / EMBEDDINGS)
    record = json.loads((folder / "metrics.json").read_text())
    i2t, t2i = brute_force_ranks(evaluated)
    columns = [LANGUAGES.index("en"), LANGUAGES.index("ja")]
    combined = (spread(i2t, columns) + spread(t2i, columns)) / 2
    assert listed_ids(page, "inconsistent-0") == top_by(list(combined), evaluated.image_ids, TOP)
    assert np.nanmean(combined) == pytest.approx(record["metrics"]["all/MRV"], abs=1e-9)
    everything = (spread(i2t, [0, 1, 2]) + spread(t2i, [0, 1, 2])) / 2
    assert top_by(list(everything), evaluated.image_ids, TOP) != listed_ids(page, "inconsistent-0")


def test_a_record_without_an_image_cannot_join_an_evaluated_set(tmp_path):
    from ccr.datamodules.records import Record
    from ccr.experiments.report.evaluated import EvaluatedSet

    records = [Record("a", "a.png", {"en": ["one"]}), Record("b", None, {"en": ["two"]})]
    with pytest.raises(ValueError, match="record 'b' has no image"):
        EvaluatedSet.from_records(records, ["en"], tmp_path, None)
    with pytest.raises(ValueError, match="holds no embeddings"):
        EvaluatedSet.from_records(records[:1], ["en"], tmp_path, None).embeddings()
