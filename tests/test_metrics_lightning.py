"""``metrics.RetrievalEvaluation`` is a torchmetrics ``Metric`` by the contract: the ground truth comes
at construction, ``compute()`` takes no arguments and syncs the processes' rows itself, so the
metric goes into a ``MetricCollection`` and through Lightning's ``self.log`` like any other, in one
process or in a 2-process DDP run (``tests/ddp_logged_metric.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_logged_metric import COLLECTION_PREFIX, SETTINGS, retrieval_set
from torchmetrics import MetricCollection

from ccr.metrics import GroundTruth, RetrievalEvaluation, retrieval_report

REPO = Path(__file__).resolve().parents[1]


def expected_report() -> dict[str, float]:
    """The report of the whole set, straight from ``retrieval_report`` (no metric in between)."""
    image, text, truth = retrieval_set()
    settings = {key: value for key, value in SETTINGS.items() if key != "rerank_k"}
    report = retrieval_report(
        image,
        text,
        truth.caption_image,
        truth.caption_language,
        truth.image_ids,
        image_relevance=truth.image_relevance,
        mrv_languages=truth.mrv_languages,
        **settings,
    )
    return {key: float(value) for key, value in report.items()}


def fed(metric):
    """``metric`` updated with the set in shuffled batches of 4, image 0 sent twice."""
    image, text, _ = retrieval_set()
    gen = torch.Generator().manual_seed(1)
    for side, table in (("images", image), ("captions", text)):
        order = torch.cat([torch.randperm(len(table), generator=gen), torch.tensor([0])])
        for index in order.split(4):
            metric.update(side, index, table[index])
    return metric


def test_compute_takes_no_arguments_and_gives_the_report_of_the_set():
    _, _, truth = retrieval_set()
    metric = fed(RetrievalEvaluation(truth, **SETTINGS))
    expected = expected_report()
    assert metric.compute() == expected
    assert metric.compute() == expected  # asked again (as Lightning and collections do): the same
    metric.reset()
    with (
        pytest.warns(UserWarning, match="called before the ``update``"),
        pytest.raises(RuntimeError, match="evaluation produced no images"),
    ):
        metric.compute()
    assert fed(metric).compute() == expected


def test_a_metric_collection_reports_every_key_under_its_prefix():
    _, _, truth = retrieval_set()
    collection = fed(
        MetricCollection({"retrieval": RetrievalEvaluation(truth, **SETTINGS)}, prefix="val/")
    )
    assert collection.compute() == {f"val/{key}": value for key, value in expected_report().items()}


def test_ground_truth_of_mismatched_sizes_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"caption_image has shape \(3,\) for 2 caption languages"):
        GroundTruth(torch.arange(3), ["en", "en"], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"image_relevance has shape \(2, 2\), expected \(3, 3\)"):
        GroundTruth(torch.arange(3), ["en"] * 3, ["a", "b", "c"], image_relevance=torch.eye(2))


def test_a_pair_scorer_with_re_ranking_is_refused_at_construction():
    _, _, truth = retrieval_set()
    with pytest.raises(ValueError, match="set evaluation.rerank_k=0"):
        RetrievalEvaluation(
            truth, **{**SETTINGS, "rerank_k": 3}, build_pair_scores=lambda images, captions: None
        )


@pytest.mark.slow
def test_both_ddp_processes_log_the_one_process_report_through_self_log(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    script = REPO / "tests" / "ddp_logged_metric.py"
    done = subprocess.run(
        ["timeout", "-k", "10", "240", sys.executable, str(script), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    expected = expected_report()
    # Lightning logs a float as a float32 tensor
    as_logged = {key: torch.tensor(value).item() for key, value in expected.items()}
    as_logged |= {COLLECTION_PREFIX + key: value for key, value in as_logged.items()}
    for rank in (0, 1):
        logged = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert logged == as_logged, rank
