"""How every number of a report is scored, recorded in each ``metrics.json``.

The leaderboard puts two rows in one column only when their protocols are equal; bump ``version``
whenever a convention below changes what a metric means.
"""

METRIC_PROTOCOL: dict[str, str | int] = {
    "version": 4,
    "ties": "expected value under uniform random tie-breaking: R@K is the expected hit probability, "
    "MRR/MeanR the expected reciprocal/1-based rank, NDCG tie-averaged",
    "recall": "hit: a query counts when any positive is in the top K",
    "captions": "every caption is a query; i2t ranks the captions of the query's language",
    "median_rank": "floor of the median of the expected 1-based ranks",
    "ndcg": "binary for cross-modal at evaluation.ndcg_k; graded i2i/t2t with exponential gain 2^rel-1, "
    "relevance per image pair from the data",
    "unimodal": "i2i/NDCG@k and t2t/NDCG@k for each k of evaluation.unimodal_ndcg_ks, only when the data "
    "gives graded image relevance; the query is not its own candidate, t2t ranks the captions "
    "of every language, both rank the dual-encoder embeddings (never re-ranked)",
    "mrv": "mean over images of the std of expected ranks across data.mrv_languages; all/MRV = mean of TR and IR",
    "non_finite": "a NaN or infinite embedding or score is an error, never a score",
}
