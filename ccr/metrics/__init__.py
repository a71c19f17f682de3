"""Retrieval metrics of CCR Suite: one chunked rank engine and everything derived from ranks."""

from ccr.metrics import ranks
from ccr.metrics.evaluation import GroundTruth, RetrievalEvaluation
from ccr.metrics.functional import mean_rank_variance
from ccr.metrics.graded import graded_ndcg, graded_ndcg_at
from ccr.metrics.protocol import METRIC_PROTOCOL
from ccr.metrics.ranks import best_positive_rank, paired_ranks, rank_and_ndcg
from ccr.metrics.report import better_direction, report_keys, retrieval_report
from ccr.metrics.reranking import Reranker

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
