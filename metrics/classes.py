"""torchmetrics ``Metric`` classes: they accumulate per-query values over batches and gather them
across processes (``dist_reduce_fx="cat"``). States are per-query ranks or per-query NDCG values,
never query x candidate pairs."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from metrics import functional


class _PerQueryMetric(Metric):
    """Holds one value per query seen (a rank or an NDCG)."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("values", default=[], dist_reduce_fx="cat")

    def update(self, values: Tensor) -> None:
        self.values.append(values.detach().flatten())

    def _all(self) -> Tensor:
        return dim_zero_cat(self.values)


class RecallAtK(_PerQueryMetric):
    """Hit-style R@K in percent from 0-based best-positive ranks."""

    def __init__(self, k: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k

    def compute(self) -> Tensor:
        return torch.tensor(functional.recall_at_k(self._all(), self.k))


class MeanReciprocalRank(_PerQueryMetric):
    def compute(self) -> Tensor:
        return torch.tensor(functional.mean_reciprocal_rank(self._all()))


class MeanRank(_PerQueryMetric):
    """Mean 1-based rank of the best positive."""

    def compute(self) -> Tensor:
        return torch.tensor(functional.mean_rank(self._all()))


class MedianRank(_PerQueryMetric):
    """Median 1-based rank of the best positive."""

    def compute(self) -> Tensor:
        return torch.tensor(functional.median_rank(self._all()))


class MeanNDCG(_PerQueryMetric):
    """Mean of per-query NDCG@k values (binary or graded, from ``metrics.ranks`` or ``metrics.graded``)."""

    def compute(self) -> Tensor:
        return self._all().double().mean()


class MeanRankVariance(Metric):
    """MRV across languages, matched by integer instance key. ``compute`` returns
    {"var": MRV_var, "std": MRV_std, "dropped": instances missing a language}."""

    full_state_update = False

    def __init__(self, num_languages: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.num_languages = num_languages
        self.add_state("instance", default=[], dist_reduce_fx="cat")
        self.add_state("language", default=[], dist_reduce_fx="cat")
        self.add_state("ranks", default=[], dist_reduce_fx="cat")

    def update(self, instance: Tensor, language: Tensor, ranks: Tensor) -> None:
        self.instance.append(instance.detach().long().flatten())
        self.language.append(language.detach().long().flatten())
        self.ranks.append(ranks.detach().long().flatten())

    def compute(self) -> dict[str, Tensor]:
        variance, std, dropped = functional.mean_rank_variance(
            dim_zero_cat(self.instance), dim_zero_cat(self.language), dim_zero_cat(self.ranks),
            self.num_languages,
        )
        return {"var": torch.tensor(variance), "std": torch.tensor(std), "dropped": torch.tensor(dropped)}
