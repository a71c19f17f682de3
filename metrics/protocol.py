"""How every number of a report is scored, recorded in each ``metrics.json``.

The leaderboard puts two rows in one column only when their protocols are equal; bump ``version``
whenever a convention below changes what a metric means.
"""

METRIC_PROTOCOL: dict[str, str | int] = {
    "version": 2,
    "ties": "expected rank under uniform random tie-breaking (tie-averaged)",
    "recall": "hit: a query counts when any positive is in the top K",
    "captions": "every caption is a query; i2t ranks the captions of the query's language",
    "median_rank": "floor of the median of 1-based ranks",
    "ndcg": "binary for cross-modal, exponential gain for graded i2i/t2t",
}
