"""A checkpoint's evaluation split, encoded once and ranked by the suite's rank engine.

The demo must show the order the metrics score, so nothing here ranks by its own rule:

- a typed query's images are placed by ``ccr.metrics.ranks.best_positive_rank``, asking the engine
  for the rank each image would get as the query's positive (ties share their expected place,
  as in every metric);
- a dataset caption's ranks in its translations are the rank blocks of ``metrics.paired_ranks``,
  computed per language exactly as ``metrics.retrieval_report`` computes them, so their recalls are
  the run's ``metrics.json`` numbers.

Scores are the embeddings' similarities (the ``itc`` scorer; RC3's are its probe's, ``probe``); a
run evaluated with its cross-encoder (ITM re-ranking, or every pair) is shown without it, and
``scorer_note`` says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ccr.experiments.evaluate import load_last_stage
from ccr.experiments.runs import scorer_label
from ccr.methods.encoding import CAPTIONS, encode_batch, encode_view
from ccr.metrics.ranks import best_positive_rank, paired_ranks
from ccr.metrics.ties import expected_rank


@dataclass(frozen=True)
class Hit:
    """One retrieved image: its expected 1-based rank (tied images share the mean of their places)."""

    rank: float
    image: int
    image_id: str
    path: Path
    score: float


@dataclass(frozen=True)
class TranslationRank:
    """One caption of an image in one language, with the two ranks the metrics count for it."""

    language: str
    caption: int
    text: str
    image_rank: float  # text->image: expected 1-based rank of the caption's image for this caption
    caption_rank: (
        float  # image->text: rank of the image's best caption among this language's captions
    )


@dataclass
class RetrievalIndex:
    """Embeddings of one evaluation split and the rank blocks its report is computed from."""

    checkpoint: Path
    split: str
    scorer_note: str | None
    image_ids: list[str]
    image_paths: list[Path]
    captions: list[str]
    caption_image: Tensor  # [T] image index of every caption
    caption_language: list[str]  # [T]
    languages: list[str]
    image_emb: Tensor  # [N, D]
    text_emb: Tensor  # [T, D]
    t2i_blocks: Tensor  # [T, 3] rank block of every caption's image
    i2t_blocks: dict[str, Tensor]  # language -> [N, 3]; -1 rows: the image has no caption there
    encode_queries: Callable[[list[str]], Tensor]
    chunk_size: int = 1024

    def image_scores(self, query_emb: Tensor) -> Tensor:
        """Similarity [N] of every image to one query embedding [D]."""
        return (self.image_emb @ query_emb[:, None]).squeeze(1)

    def image_ranks(self, scores: Tensor) -> Tensor:
        """Expected 0-based rank [N] of every image for one query's ``scores`` [N], by the rank
        engine: row j asks where image j lands among all images for this query."""
        count = len(self.image_ids)
        everyone = torch.arange(count)
        return best_positive_rank(
            None,
            None,
            everyone,
            everyone,
            scores=scores[None].expand(count, count),
            chunk_size=self.chunk_size,
            direction="t2i",
        )

    def search(self, text: str, k: int) -> list[Hit]:
        """The ``k`` best images for a typed query, in rank order."""
        if not text.strip():
            raise ValueError("demo: type a query")
        if not 1 <= k <= len(self.image_ids):
            raise ValueError(f"demo: k must be between 1 and {len(self.image_ids)}, got {k}")
        scores = self.image_scores(self.encode_queries([text])[0])
        ranks = self.image_ranks(scores)
        order = torch.argsort(ranks, stable=True)[:k].tolist()
        return [
            Hit(float(ranks[i]) + 1.0, i, self.image_ids[i], self.image_paths[i], float(scores[i]))
            for i in order
        ]

    def translations(self, caption: int) -> list[TranslationRank]:
        """Every caption of ``caption``'s image, in configured language order, with its ranks."""
        if not 0 <= caption < len(self.captions):
            raise ValueError(f"demo: caption {caption} out of range (0..{len(self.captions) - 1})")
        image = int(self.caption_image[caption])
        siblings = (self.caption_image == image).nonzero().squeeze(1).tolist()
        caption_ranks = {
            lang: float(expected_rank(blocks[image : image + 1])[0]) + 1.0
            for lang, blocks in self.i2t_blocks.items()
        }
        image_ranks = expected_rank(self.t2i_blocks) + 1.0
        rows = [
            TranslationRank(
                self.caption_language[c],
                c,
                self.captions[c],
                float(image_ranks[c]),
                caption_ranks[self.caption_language[c]],
            )
            for c in siblings
        ]
        return sorted(rows, key=lambda row: (self.languages.index(row.language), row.caption))


def language_rank_blocks(
    image_emb: Tensor,
    text_emb: Tensor,
    caption_image: Tensor,
    caption_language: Sequence[str],
    languages: Sequence[str],
    *,
    chunk_size: int,
    ndcg_k: int,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(t2i blocks [T, 3], language -> i2t blocks [N, 3]) per language, as the report ranks them:
    a language's captions are ranked only among the captions of that language."""
    t2i = torch.empty(len(caption_language), 3, dtype=torch.long)
    i2t = {}
    for lang in languages:
        captions = torch.tensor(
            [i for i, c in enumerate(caption_language) if c == lang], dtype=torch.long
        )
        paired = paired_ranks(
            image_emb,
            text_emb[captions],
            caption_image[captions],
            chunk_size=chunk_size,
            ndcg_k=ndcg_k,
        )
        t2i[captions] = paired.t2i_rank
        i2t[lang] = paired.i2t_rank
    return t2i, i2t


def load_index(ckpt: Path, split: str = "test", overrides: Sequence[str] = ()) -> RetrievalIndex:
    """Rebuild the run's last-stage module from ``ckpt`` (weights only) and encode its ``split``
    as evaluation encodes it (``ccr.methods.encoding.encode_view``).

    ``overrides`` are config overrides as for ``ccr.experiments.evaluate`` (e.g. a data root)."""
    restored = load_last_stage(Path(ckpt), overrides, split)
    cfg, module = restored.cfg, restored.module
    view = restored.data.eval_view(split)
    batch_size = int(cfg.data.eval_batch_size)
    image_emb, text_emb = encode_view(module, view, batch_size)
    chunk_size = int(cfg.evaluation.chunk_size)
    t2i, i2t = language_rank_blocks(
        image_emb,
        text_emb,
        view.caption_image,
        view.caption_language,
        view.languages,
        chunk_size=chunk_size,
        ndcg_k=int(cfg.evaluation.ndcg_k),
    )
    tokenizer, max_length = view.tokenizer, view.max_length

    @torch.no_grad()
    def encode_queries(texts: list[str]) -> Tensor:
        """Typed queries as evaluation batches of captions (without a language: a method that
        tags captions with theirs says it needs one)."""
        batch = {**tokenizer(texts, max_length), "index": torch.arange(len(texts))}
        return encode_batch(module, CAPTIONS, batch, batch_size).embeddings

    embeddings, scored = module.embedding_scorer, scorer_label(cfg)
    note = (
        (
            f"ranked by embedding similarity ({embeddings}); this run's evaluation scored with {scored} "
            f"(its matching head), so compare with its eval/{split}-{embeddings} metrics"
        )
        if scored != embeddings
        else None
    )
    return RetrievalIndex(
        checkpoint=Path(ckpt),
        split=split,
        scorer_note=note,
        image_ids=list(view.image_ids),
        image_paths=list(view.image_paths),
        captions=list(view.captions),
        caption_image=view.caption_image.clone(),
        caption_language=list(view.caption_language),
        languages=list(view.languages),
        image_emb=image_emb,
        text_emb=text_emb,
        t2i_blocks=t2i,
        i2t_blocks=i2t,
        encode_queries=encode_queries,
        chunk_size=chunk_size,
    )
