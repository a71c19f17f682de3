"""The leaderboard is built from metrics.json files alone: a row averages runs that differ only in
the seed; anything else is its own row, with the difference shown."""

import csv
import json
import os
import statistics

import pytest

from ccr.experiments import leaderboard
from ccr.experiments.leaderboard import _settings_shown, build, load_results
from ccr.experiments.runs import config_fingerprint
from ccr.metrics import METRIC_PROTOCOL


def _config(seed=0, **settings):
    config = {
        "seed": seed,
        "run_id": None,
        "run_dir": "runs",
        "optim": {"lr": 1e-3},
        "trainer": {"max_steps": 1500, "progress_refresh_rate": 10},
        "data": {"splits": {"test": "test"}, "num_workers": 1, "root": "/data/a"},
    }
    for key, value in settings.items():
        section, name = key.split("__")
        config[section][name] = value
    return config


def _write(
    path,
    method,
    seed,
    mr,
    data="synthetic",
    split="test",
    scorer="itc",
    protocol=METRIC_PROTOCOL,
    config=None,
    mtime=None,
    git_commit=None,
    **metrics,
):
    path.mkdir(parents=True, exist_ok=True)
    config = config or _config(seed)
    record = {
        "method": method,
        "data": data,
        "protocol": "default",
        "scorer": scorer,
        "seed": seed,
        "split": split,
        "run_id": path.name,
        "languages": ["en", "de"],
        "config_fingerprint": config_fingerprint(config),
        "config": config,
        "metrics": {"mR": mr, "en/i2t/R@1": mr / 2, "all/MRV_std/i2t": 3.0 + seed, **metrics},
    }
    if protocol is not None:
        record["metric_protocol"] = protocol
    if git_commit is not None:
        record["git_commit"] = git_commit
    (path / "metrics.json").write_text(json.dumps(record))
    if mtime is not None:
        os.utime(path / "metrics.json", (mtime, mtime))


def test_rows_group_seeds_and_report_mean_and_std(tmp_path):
    runs = tmp_path / "runs"
    for seed, mr in enumerate([40.0, 50.0, 60.0]):
        _write(runs / "synthetic" / "ccrk" / f"s{seed}", "ccrk", seed, mr, config=_config(seed))
    _write(runs / "synthetic" / "clip" / "s0", "clip", 0, 30.0)
    _write(runs / "synthetic" / "clip" / "val", "clip", 0, 99.0, split="val")  # not a test row
    rows = build(runs, tmp_path / "out")
    assert [r["method"] for r in rows] == ["ccrk", "clip"]
    ccrk = rows[0]
    assert ccrk["seeds"] == [0, 1, 2]
    assert ccrk["stats"]["mR"] == pytest.approx((50.0, statistics.pstdev([40, 50, 60])))
    assert rows[1]["stats"]["mR"] == (30.0, 0.0)

    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| ccrk | default | itc |  | 0,1,2 | 50.00 ± 8.16 |" in markdown
    with open(tmp_path / "out" / "leaderboard.csv") as f:
        table = list(csv.DictReader(f))
    assert float(table[0]["mR"]) == pytest.approx(50.0)
    assert float(table[0]["all/MRV_std/i2t std"]) == pytest.approx(statistics.pstdev([3, 4, 5]))
    assert (tmp_path / "out" / "leaderboard.png").stat().st_size > 1000


def test_different_settings_are_separate_rows_naming_the_difference(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "a", "clip", 0, 40.0, config=_config(0))
    _write(runs / "b", "clip", 1, 50.0, config=_config(1))
    _write(runs / "c", "clip", 0, 70.0, config=_config(0, trainer__max_steps=100))
    _write(runs / "d", "clip", 0, 60.0, config=_config(0, data__splits={"test": "test_2017"}))
    rows = build(runs, tmp_path / "out")
    by_settings = {r["settings"]: (r["seeds"], r["stats"]["mR"][0]) for r in rows}
    assert by_settings == {
        "data.splits.test=test, trainer.max_steps=1500": ([0, 1], 45.0),
        "data.splits.test=test, trainer.max_steps=100": ([0], 70.0),
        "data.splits.test=test_2017, trainer.max_steps=1500": ([0], 60.0),
    }
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert (
        "| clip | default | itc | data.splits.test=test, trainer.max_steps=100 | 0 | 70.00"
        in markdown
    )


def test_a_variant_table_that_grew_is_not_shown_as_a_setting_of_the_row():
    old = {**_config(0), "method": {"labels": "object", "ablations": {"no_mlm": {"mlm": False}}}}
    new = {
        **_config(0),
        "method": {
            "labels": "category",
            "ablations": {"no_mlm": {"mlm": False}, "objects": {"labels": "object"}},
        },
    }
    shown = _settings_shown([[{"config": old}], [{"config": new}]])
    assert shown == ["method.labels=object", "method.labels=category"]


def test_execution_only_settings_do_not_split_a_row(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "a", "clip", 0, 40.0, config=_config(0))
    moved = _config(
        1, data__num_workers=4, data__root="/elsewhere", trainer__progress_refresh_rate=0
    )
    _write(runs / "b", "clip", 1, 50.0, config=moved)
    rows = build(runs, tmp_path / "out")
    assert len(rows) == 1 and rows[0]["seeds"] == [0, 1]


def test_the_same_seed_twice_is_reported_not_averaged(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "first", "clip", 0, 40.0, mtime=1_000_000)
    _write(runs / "again", "clip", 0, 44.0, mtime=2_000_000)
    _write(runs / "other", "clip", 1, 50.0, config=_config(1))
    rows = build(runs, tmp_path / "out")
    assert len(rows) == 1
    assert rows[0]["seeds"] == [0, 1]
    assert rows[0]["stats"]["mR"][0] == pytest.approx(47.0)  # newest seed-0 run (44) and seed 1
    assert rows[0]["duplicates"] == {0: ["again", "first"]}
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "seed 0 ran 2 times (again, first); the mean uses the newest, again." in markdown


def test_a_row_whose_seeds_ran_on_different_commits_says_so(tmp_path):
    runs = tmp_path / "runs"
    for seed, commit in enumerate(["aaaaaaaa11", "aaaaaaaa11", "bbbbbbbb22"]):
        _write(
            runs / f"s{seed}", "clip", seed, 40.0 + seed, config=_config(seed), git_commit=commit
        )
    rows = build(runs, tmp_path / "out")
    assert rows[0]["commits"] == {"aaaaaaaa": [0, 1], "bbbbbbbb": [2]}
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "its seeds ran on different code (seed 0,1 at aaaaaaaa; seed 2 at bbbbbbbb)" in markdown
    for seed in range(3):  # one commit: no note
        _write(
            runs / f"s{seed}",
            "clip",
            seed,
            40.0 + seed,
            config=_config(seed),
            git_commit="aaaaaaaa11",
        )
    build(runs, tmp_path / "out")
    assert "different code" not in (tmp_path / "out" / "leaderboard.md").read_text()


def test_rows_scored_under_another_metric_protocol_are_marked(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "now", "clip", 0, 40.0)
    _write(
        runs / "old", "clip", 1, 90.0, config=_config(1), protocol={**METRIC_PROTOCOL, "version": 1}
    )
    _write(runs / "older", "clip", 2, 95.0, config=_config(2), protocol=None)
    rows = build(runs, tmp_path / "out")
    assert sorted((r["seeds"], r["mark"]) for r in rows) == [([0], ""), ([1], "†"), ([2], "‡")]
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| clip† |" in markdown and "| clip‡ |" in markdown and "| clip |" in markdown
    assert "another metric protocol" in markdown and "records no metric protocol" in markdown


def test_rescored_runs_are_separate_rows(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "a", "ccrk", 0, 40.0)
    rerank = _config(0)
    rerank["evaluation"] = {"rerank_k": 16}
    _write(runs / "a" / "eval" / "test-itm@16", "ccrk", 0, 45.0, scorer="itm@16", config=rerank)
    rows = build(runs, tmp_path / "out")
    assert sorted(r["scorer"] for r in rows) == ["itc", "itm@16"]


def test_rc3_rows_scored_by_its_probe_say_so_and_its_own_scorer_is_itm_at_all(tmp_path):
    """Runs stored before the cross-encoder scorer existed recorded ``itm@8`` / ``itc`` for RC3,
    whose embeddings are a first-stage probe: the leaderboard names them by what ranked them."""
    runs = tmp_path / "runs"
    for folder, scorer, evaluation in (
        ("a", "itm@8", {"rerank_k": 8}),
        ("a/eval/test-itc", "itc", {"rerank_k": 0}),
        ("b", "itm@all", {"rerank_k": 0, "scorer": "cross_encoder"}),
    ):
        config = {**_config(0), "method": {"name": "rc3"}, "evaluation": evaluation}
        _write(runs / folder, "rc3", 0, 10.0, scorer=scorer, config=config)
    rows = build(runs, tmp_path / "out")
    assert sorted(r["scorer"] for r in rows) == ["itm@all", "probe", "probe+itm@8"]
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| rc3 | default | probe+itm@8 |" in markdown and "which is not part of RC3" in markdown


def test_malformed_result_names_the_file_and_field(tmp_path):
    bad = tmp_path / "runs" / "x"
    bad.mkdir(parents=True)
    (bad / "metrics.json").write_text(json.dumps({"method": "clip"}))
    with pytest.raises(ValueError, match=r"x/metrics.json: missing field\(s\) data"):
        load_results(tmp_path / "runs")


def _write_raw(path, text):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.json").write_text(text)


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda r: r["metrics"].update({"mR": float("nan")}), r"holds a bare NaN"),
        (
            lambda r: r["metrics"].update({"mR": "40.0"}),
            r"field 'metrics\.mR' must be a number, got str",
        ),
        (
            lambda r: r["metrics"].update({"mR": True}),
            r"field 'metrics\.mR' must be a number, got bool",
        ),
        (lambda r: r.update({"seed": "0"}), r"field 'seed' must be a whole number >= 0, got '0'"),
        (lambda r: r.update({"seed": 1.5}), r"field 'seed' must be a whole number >= 0, got 1\.5"),
        (lambda r: r.update({"metrics": {}}), r"field 'metrics' holds no metric"),
        (lambda r: r.update({"metrics": [40.0]}), r"field 'metrics' must be an object"),
        (lambda r: r.update({"method": 3}), r"field 'method' must be a string, got int"),
    ],
)
def test_a_malformed_metrics_json_is_refused_naming_the_file_and_field(tmp_path, edit, error):
    _write(tmp_path / "runs" / "good", "clip", 0, 40.0)
    _write(tmp_path / "runs" / "bad", "clip", 1, 41.0)
    path = tmp_path / "runs" / "bad" / "metrics.json"
    record = json.loads(path.read_text())
    edit(record)
    path.write_text(json.dumps(record))  # json.dumps writes NaN as a bare NaN
    with pytest.raises(ValueError, match=r"bad/metrics\.json: " + error):
        load_results(tmp_path / "runs")


def test_a_metrics_json_that_is_not_an_object_or_not_utf8_is_refused_naming_the_file(tmp_path):
    _write_raw(tmp_path / "runs" / "list", "[1, 2]")
    with pytest.raises(ValueError, match=r"list/metrics\.json: not a JSON object"):
        load_results(tmp_path / "runs")
    (tmp_path / "runs" / "list" / "metrics.json").write_bytes(b'{"method": "caf\xe9"}')
    with pytest.raises(ValueError, match=r"list/metrics\.json:1: not UTF-8 text"):
        load_results(tmp_path / "runs")


def test_written_beside_the_runs_unless_told_where(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    _write(runs / "a", "clip", 0, 40.0)
    monkeypatch.chdir(tmp_path)
    leaderboard._main(["--runs", str(runs)])
    assert (runs / "leaderboard.md").exists() and not (tmp_path / "leaderboard.md").exists()
    leaderboard._main(["--runs", str(runs), "--out", str(tmp_path / "elsewhere")])
    assert (tmp_path / "elsewhere" / "leaderboard.md").exists()


def _unimodal(i2i, t2t, ks=(10, 20, 50)):
    return {
        f"{side}/NDCG@{k}": value + k / 1000
        for k in ks
        for side, value in (("i2i", i2i), ("t2t", t2t))
    }


def test_unimodal_ndcg_columns_show_each_cut_off_and_never_invent_a_zero(tmp_path):
    runs = tmp_path / "runs"
    for seed, i2i in enumerate([0.5, 0.7]):
        _write(
            runs / "covlr" / f"s{seed}",
            "covlr",
            seed,
            40.0,
            config=_config(seed),
            **_unimodal(i2i, 0.3),
        )
    _write(runs / "old" / "s0", "clip", 0, 30.0)  # an older metrics.json without uni-modal keys
    _write(runs / "real" / "s0", "clip", 0, 20.0, data="xflickrco")  # real data: no relevance
    rows = build(runs, tmp_path / "out")
    covlr = next(r for r in rows if r["method"] == "covlr")
    assert covlr["stats"]["i2i/NDCG@20"] == pytest.approx((0.62, 0.1))
    assert leaderboard.unimodal_cutoffs(rows) == [10, 20, 50]

    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    synthetic, real = markdown.split("## synthetic")[1].split("## xflickrco")
    assert "| MRV t2i | NDCG@10 i2i / t2t | NDCG@20 i2i / t2t | NDCG@50 i2i / t2t |" in synthetic
    assert (
        "| 0.610 ± 0.100 / 0.310 ± 0.000 | 0.620 ± 0.100 / 0.320 ± 0.000 | 0.650 ± 0.100 / 0.350 ± 0.000 |"
        in synthetic
    )
    clip_line = next(line for line in synthetic.splitlines() if line.startswith("| clip"))
    assert clip_line.endswith("| – / – | – / – | – / – |")
    assert "NDCG@" not in real
    with open(tmp_path / "out" / "leaderboard.csv") as f:
        table = {row["method"] + row["data"]: row for row in csv.DictReader(f)}
    assert float(table["covlrsynthetic"]["t2t/NDCG@50"]) == pytest.approx(0.35)
    assert (
        table["clipxflickrco"]["t2t/NDCG@50"] == ""
        and table["clipsynthetic"]["i2i/NDCG@10 std"] == ""
    )


def test_runs_with_other_unimodal_cut_offs_are_their_own_row(tmp_path):
    runs = tmp_path / "runs"
    for ks in ([10, 20, 50], [5, 10]):
        config = {**_config(0), "evaluation": {"unimodal_ndcg_ks": ks}}
        _write(runs / str(ks[0]), "covlr", 0, 40.0, config=config, **_unimodal(0.5, 0.3, ks))
    rows = build(runs, tmp_path / "out")
    assert sorted(r["settings"] for r in rows) == [
        "evaluation.unimodal_ndcg_ks=[10, 20, 50]",
        "evaluation.unimodal_ndcg_ks=[5, 10]",
    ]
    assert leaderboard.unimodal_cutoffs(rows) == [5, 10, 20, 50]


def test_a_row_scored_on_part_of_a_split_always_names_the_slice(tmp_path):
    """Alone in its family, a row has no differing settings to show; a sliced test split must still
    be shown, or a 100-image score would read as a full-split one."""
    runs = tmp_path / "runs"
    sliced = _config(0, data__splits={"test": "test[:100]"})
    _write(runs / "synthetic" / "ccrk+no_cl" / "s0", "ccrk+no_cl", 0, 55.0, config=sliced)
    _write(runs / "synthetic" / "ccrk" / "s0", "ccrk", 0, 50.0)
    _write(runs / "synthetic" / "ccrk" / "part", "ccrk", 0, 52.0, config=sliced)
    rows = {
        (r["method"], r["stats"]["mR"][0]): r["settings"] for r in build(runs, tmp_path / "out")
    }
    assert rows[("ccrk+no_cl", 55.0)] == "data.splits.test=test[:100]"
    assert rows[("ccrk", 52.0)] == "data.splits.test=test[:100]"
    assert rows[("ccrk", 50.0)] == "data.splits.test=test"


def test_a_row_scored_within_an_image_budget_always_names_the_budget(tmp_path):
    """``evaluation.max_images=100`` cuts val and test as ``[:100]`` does: shown even alone."""
    runs = tmp_path / "runs"
    budget = {**_config(0), "evaluation": {"max_images": 100}}
    _write(runs / "synthetic" / "rc3" / "s0", "rc3", 0, 40.0, config=budget)
    _write(
        runs / "synthetic" / "clip" / "s0",
        "clip",
        0,
        30.0,
        config={**_config(0), "evaluation": {"max_images": None}},
    )
    rows = {r["method"]: r["settings"] for r in build(runs, tmp_path / "out")}
    assert rows == {"rc3": "evaluation.max_images=100", "clip": ""}


def test_a_run_from_before_a_setting_existed_joins_the_row_of_its_default(tmp_path):
    """A config written before ``data.roi_regions`` existed reads as the default (36), which
    reproduces the old behaviour: the same experiment, one row. Another value is another row."""
    runs = tmp_path / "runs"
    _write(runs / "old", "ccrk", 0, 40.0, config=_config(0))
    _write(runs / "new", "ccrk", 1, 50.0, config=_config(1, data__roi_regions=36))
    _write(runs / "other", "ccrk", 0, 70.0, config=_config(0, data__roi_regions=10))
    rows = {r["settings"]: (r["seeds"], r["stats"]["mR"][0]) for r in build(runs, tmp_path / "out")}
    assert rows == {"data.roi_regions=36": ([0, 1], 45.0), "data.roi_regions=10": ([0], 70.0)}


def test_a_stored_setting_the_schema_no_longer_knows_names_the_file(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "gone", "ccrk", 0, 40.0, config=_config(0, data__retired_knob=1))
    with pytest.raises(ValueError, match=r"gone/metrics.json: .*data.retired_knob"):
        load_results(runs)


# ---- learning curves ------------------------------------------------------------------------------


def _with_curve(path, values, steps_per_point=150, stage_steps=None, stage="main"):
    """Add a learning curve (one validation every ``steps_per_point`` steps) to a written run."""
    record = json.loads((path / "metrics.json").read_text())
    record["stage_steps"] = stage_steps or {stage: steps_per_point * len(values)}
    offset = sum(list(record["stage_steps"].values())[:-1])
    record["learning_curve"] = {
        "metric": "val/mR",
        "points": [
            {"stage": stage, "step": offset + steps_per_point * (i + 1), "value": v}
            for i, v in enumerate(values)
        ],
    }
    (path / "metrics.json").write_text(json.dumps(record))


def test_a_row_whose_curve_rose_over_the_last_fifth_is_marked_still_rising(tmp_path):
    runs = tmp_path / "runs"
    # one validation every 150 of 1,500 steps: the last fifth runs from step 1200 (8th point) to 1500
    at_margin = [
        10,
        20,
        30,
        40,
        45,
        48,
        49,
        50,
        50.2,
        50.5,
    ]  # +0.5, and +1.5 with the bump: mean +1.0
    rising = [10, 12, 14, 16, 18, 20, 22, 24, 26, 28]  # step 1200: 24, step 1500: 28
    for seed, bump in enumerate([0.0, 1.0]):
        _write(runs / f"clip{seed}", "clip", seed, 50.0, config=_config(seed))
        _with_curve(runs / f"clip{seed}", [v + bump * (i == 9) for i, v in enumerate(at_margin)])
    _write(runs / "rising", "ccrk", 0, 30.0, config=_config(0))
    _with_curve(runs / "rising", rising)
    rows = {r["method"]: r for r in build(runs, tmp_path / "out")}
    assert rows["clip"]["curve_rise"] == pytest.approx(1.0)
    assert rows["ccrk"]["curve_rise"] == pytest.approx(4.0)
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| 50.00 ± 0.00 | +1.00 |" in markdown  # not more than the margin: not marked
    assert "| 30.00 ± 0.00 | +4.00 ↑ |" in markdown
    assert "- ↑ still rising: validation mR rose by more than 1.0" in markdown
    steps, means, stds = rows["clip"]["curve"]
    assert steps == list(range(150, 1501, 150)) and means[-1] == 51.0 and stds[-1] == 0.5
    assert (tmp_path / "out" / "learning_curves.png").stat().st_size > 1000
    with open(tmp_path / "out" / "leaderboard.csv") as f:
        table = {r["method"]: r for r in csv.DictReader(f)}
    assert (table["ccrk"]["val_mR_last_fifth_rise"], table["ccrk"]["still_rising"]) == ("4.0", "1")


def test_a_flat_curve_is_not_marked_and_the_rise_reads_the_final_stage_only(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "flat", "clip", 0, 50.0)
    _with_curve(
        runs / "flat", [10, 30, 45, 49, 50, 50.4, 50.2, 50.6, 50.9, 50.0]
    )  # 1200: 50.6 -> 50.0
    _write(runs / "staged", "mclip", 0, 40.0)
    # stage 1 (1000 steps) rose a lot; the final stage (500 steps, from run step 1000) is flat
    record = json.loads((runs / "staged" / "metrics.json").read_text())
    record["stage_steps"] = {"stage1": 1000, "finetune": 500}
    record["learning_curve"] = {
        "metric": "val/mR",
        "points": [
            {"stage": "stage1", "step": 500, "value": 5.0},
            {"stage": "stage1", "step": 1000, "value": 30.0},
            {"stage": "finetune", "step": 1300, "value": 40.0},
            {"stage": "finetune", "step": 1400, "value": 40.5},
            {"stage": "finetune", "step": 1500, "value": 40.9},
        ],
    }
    (runs / "staged" / "metrics.json").write_text(json.dumps(record))
    rows = {r["method"]: r for r in build(runs, tmp_path / "out")}
    assert rows["clip"]["curve_rise"] == pytest.approx(-0.6)
    assert rows["mclip"]["curve_rise"] == pytest.approx(0.4)  # boundary 1400: 40.5 -> 40.9
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| -0.60 |" in markdown and "| +0.40 |" in markdown
    assert " ↑ |" not in markdown and "- ↑ still rising" not in markdown


def test_runs_without_a_curve_still_load_and_show_no_curve(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "old", "clip", 0, 50.0)  # written before learning curves existed
    _write(runs / "once", "ccrk", 0, 40.0)
    _with_curve(
        runs / "once", [40.0], steps_per_point=780, stage_steps={"main": 1500}
    )  # one validation
    rows = {r["method"]: r for r in build(runs, tmp_path / "out")}
    assert rows["clip"]["curve_rise"] is None and rows["clip"]["curve"] is None
    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| no curve |" in markdown and "| too few validations |" in markdown
    assert (tmp_path / "out" / "learning_curves.png").exists()


def test_a_malformed_curve_is_an_error_naming_the_file_and_point(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "bad", "clip", 0, 50.0)
    _with_curve(runs / "bad", [40.0, 41.0])
    record = json.loads((runs / "bad" / "metrics.json").read_text())
    record["learning_curve"]["points"][1]["value"] = None
    (runs / "bad" / "metrics.json").write_text(json.dumps(record))
    with pytest.raises(
        ValueError, match=r"bad/metrics.json: learning_curve.points\[1\] needs an integer"
    ):
        load_results(runs)
