"""Retrieval metrics of CCR Suite: one chunked rank engine and everything derived from ranks."""

from metrics import ranks
from metrics.evaluation import GroundTruth, RetrievalEvaluation
from metrics.functional import mean_rank_variance
from metrics.graded import graded_ndcg, graded_ndcg_at
from metrics.protocol import METRIC_PROTOCOL
from metrics.ranks import best_positive_rank, paired_ranks, rank_and_ndcg
from metrics.report import better_direction, report_keys, retrieval_report
from metrics.reranking import Reranker

__all__ = [
    "METRIC_PROTOCOL",
    "GroundTruth",
    "Reranker",
    "better_direction",
    "report_keys",
    "RetrievalEvaluation",
    "best_positive_rank",
    "graded_ndcg",
    "graded_ndcg_at",
    "mean_rank_variance",
    "paired_ranks",
    "rank_and_ndcg",
    "ranks",
    "retrieval_report",
]
