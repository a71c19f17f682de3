"""The leaderboard is built from metrics.json files alone, mean ± std over seeds."""

import csv
import json
import statistics

import pytest

from experiments.leaderboard import build, load_results


def _write(path, method, seed, mr, data="synthetic", split="test", scorer="itc", **metrics):
    path.mkdir(parents=True, exist_ok=True)
    record = {
        "method": method, "data": data, "protocol": "default", "scorer": scorer, "seed": seed,
        "split": split, "run_id": path.name, "languages": ["en", "de"],
        "metrics": {"mR": mr, "en/i2t/R@1": mr / 2, "all/MRV_std/i2t": 3.0 + seed, **metrics},
    }
    (path / "metrics.json").write_text(json.dumps(record))


def test_rows_group_seeds_and_report_mean_and_std(tmp_path):
    runs = tmp_path / "runs"
    for seed, mr in enumerate([40.0, 50.0, 60.0]):
        _write(runs / "synthetic" / "ccrk" / f"s{seed}", "ccrk", seed, mr)
    _write(runs / "synthetic" / "clip" / "s0", "clip", 0, 30.0)
    _write(runs / "synthetic" / "clip" / "val", "clip", 0, 99.0, split="val")  # not a test row
    rows = build(runs, tmp_path / "out")
    assert [r["method"] for r in rows] == ["ccrk", "clip"]
    ccrk = rows[0]
    assert ccrk["seeds"] == [0, 1, 2]
    assert ccrk["stats"]["mR"] == pytest.approx((50.0, statistics.pstdev([40, 50, 60])))
    assert rows[1]["stats"]["mR"] == (30.0, 0.0)

    markdown = (tmp_path / "out" / "leaderboard.md").read_text()
    assert "| ccrk | default | itc | 0,1,2 | 50.00 ± 8.16 |" in markdown
    with open(tmp_path / "out" / "leaderboard.csv") as f:
        table = list(csv.DictReader(f))
    assert float(table[0]["mR"]) == pytest.approx(50.0)
    assert float(table[0]["all/MRV_std/i2t std"]) == pytest.approx(statistics.pstdev([3, 4, 5]))
    assert (tmp_path / "out" / "leaderboard.png").stat().st_size > 1000


def test_rescored_runs_are_separate_rows(tmp_path):
    runs = tmp_path / "runs"
    _write(runs / "a", "ccrk", 0, 40.0)
    _write(runs / "a" / "eval" / "test-itm@16", "ccrk", 0, 45.0, scorer="itm@16")
    rows = build(runs, tmp_path / "out")
    assert sorted(r["scorer"] for r in rows) == ["itc", "itm@16"]


def test_malformed_result_names_the_file_and_field(tmp_path):
    bad = tmp_path / "runs" / "x"
    bad.mkdir(parents=True)
    (bad / "metrics.json").write_text(json.dumps({"method": "clip"}))
    with pytest.raises(ValueError, match=r"x/metrics.json: missing field\(s\) data"):
        load_results(tmp_path / "runs")
