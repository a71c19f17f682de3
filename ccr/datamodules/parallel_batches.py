"""Batches of parallel sentence pairs for text-only training (mCLIP Stage 1, spec §3).

Two choices of the spec live here, both working on a dict ``{(src, tgt): [(src_text, tgt_text)]}``:

* **Token-counted batches.** With ``max_tokens``, a batch holds as many pairs as fit in
  ``count x longest <= max_tokens``, where a pair's length is the longer of its two tokenised sides
  (the padded size the model sees, as fairseq counts it). Pairs are length-sorted after a seeded
  shuffle, cut, and the batches shuffled, so a batch wastes little padding. Without it a batch
  holds ``batch_size`` pairs.
* **Temperature-smoothed language pairs.** With ``beta``, every batch's direction is drawn with
  probability ``q_i = p_i^beta / sum_j p_j^beta`` (``p_i`` the share of direction i's pairs), so
  small pairs are seen more often than their size alone would give. An epoch keeps the number of
  batches a single pass over every pair would have; a direction drawn more often than it has
  batches starts over its (reshuffled) batches. Without ``beta`` every batch is used exactly once.

Every batch holds a single direction.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence

from .datasets import ParallelBatches

Pair = tuple[str, str]
Texts = list[tuple[str, str]]
Batch = tuple[str, str, Texts]


def smoothed_pair_probabilities(sizes: Mapping[Pair, int], beta: float) -> dict[Pair, float]:
    """``q_i = p_i^beta / sum_j p_j^beta`` over the directions with data (an empty one gets 0).
    ``beta = 1`` samples in proportion to size, ``beta -> 0`` uniformly."""
    if not 0 < beta <= 1:
        raise ValueError(f"language-pair sampling beta must be in (0, 1], got {beta}")
    total = sum(sizes.values())
    if total == 0:
        raise ValueError("language-pair sampling: no direction has any sentence pair")
    weights = {pair: (size / total) ** beta if size else 0.0 for pair, size in sizes.items()}
    norm = sum(weights.values())
    return {pair: weight / norm for pair, weight in weights.items()}


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``range(len(lengths))`` whose ``count x longest`` stays within
    ``max_tokens``. A single item longer than ``max_tokens`` is an error (it could never fit)."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(f"a sentence pair of {length} tokens exceeds max_tokens={max_tokens}")
        widest = max(longest, length)
        if current and widest * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, widest = [], length
        current.append(index)
        longest = widest
    if current:
        batches.append(current)
    return batches


def cut_direction(
    texts: Texts,
    rng: random.Random,
    batch_size: int,
    max_tokens: int | None,
    count_tokens: Callable[[list[str]], list[int]] | None,
) -> list[Texts]:
    """One direction's pairs shuffled and cut into batches (by tokens or by ``batch_size``; a
    direction with fewer than ``batch_size`` pairs gives one smaller batch)."""
    texts = list(texts)
    rng.shuffle(texts)
    if max_tokens is None:
        full = max(len(texts) // batch_size, 1 if texts else 0)
        return [texts[i * batch_size : (i + 1) * batch_size] for i in range(full)]
    if count_tokens is None:
        raise ValueError("token-counted batches need a token counter")
    src = count_tokens([s for s, _ in texts])
    tgt = count_tokens([t for _, t in texts])
    lengths = [max(a, b) for a, b in zip(src, tgt, strict=True)]
    order = sorted(range(len(texts)), key=lengths.__getitem__)  # stable: ties keep the shuffle
    cut = token_batches([lengths[i] for i in order], max_tokens)
    batches = [[texts[order[i]] for i in run] for run in cut]
    rng.shuffle(batches)
    return batches


def parallel_batches(
    texts: Mapping[Pair, Texts],
    *,
    batch_size: int,
    seed: int,
    beta: float | None = None,
    max_tokens: int | None = None,
    count_tokens: Callable[[list[str]], list[int]] | None = None,
) -> ParallelBatches:
    """The batches of one epoch (see the module docstring), reproducible from ``seed``."""
    rng = random.Random(seed)
    per_direction = {
        pair: cut_direction(pair_texts, rng, batch_size, max_tokens, count_tokens)
        for pair, pair_texts in texts.items()
    }
    if beta is None:
        return ParallelBatches(
            [
                (src, tgt, batch)
                for (src, tgt), batches in per_direction.items()
                for batch in batches
            ]
        )
    probabilities = smoothed_pair_probabilities({p: len(t) for p, t in texts.items()}, beta)
    directions = [pair for pair in per_direction if probabilities[pair] > 0]
    count = sum(len(batches) for batches in per_direction.values())
    drawn = rng.choices(directions, weights=[probabilities[p] for p in directions], k=count)
    queues = {pair: [] for pair in directions}
    chosen: list[Batch] = []
    for pair in drawn:
        if not queues[pair]:  # this direction's batches are used up: start over, reshuffled
            queues[pair] = rng.sample(per_direction[pair], len(per_direction[pair]))
        chosen.append((*pair, queues[pair].pop()))
    return ParallelBatches(chosen)
