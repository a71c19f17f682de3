"""Real xFlickr&CO test captions (8 languages, 2000 images): MRV matches instances by id across
languages given in different orders, and counts the two instances with an empty caption."""

import json
from pathlib import Path

import torch

from ccr.metrics import retrieval_report
from ccr.metrics.functional import mean_rank_variance

ANNOTATIONS = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "data"
    / "real"
    / "iglue"
    / "datasets"
    / "xFlickrCO"
    / "annotations"
)
LANGUAGES = ["en", "de", "es", "id", "ja", "ru", "tr", "zh"]


def read_captions(language):
    """(image id, caption) pairs of one language, empty captions left out."""
    path = ANNOTATIONS / language / "test.jsonl"
    pairs = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, 1):
            record = json.loads(line)
            if "id" not in record or "sentences" not in record:
                raise ValueError(f"{path}:{line_number}: record lacks 'id' or 'sentences'")
            pairs += [(str(record["id"]), text) for text in record["sentences"] if text.strip()]
    return pairs


def test_xflickrco_mrv_matched_by_id_with_two_dropped():
    per_language = {lang: read_captions(lang) for lang in LANGUAGES}
    image_ids = sorted({image_id for pairs in per_language.values() for image_id, _ in pairs})
    assert len(image_ids) == 2000
    assert {
        lang: 2000 - len(pairs) for lang, pairs in per_language.items() if len(pairs) != 2000
    } == {"de": 1, "id": 1}
    gen = torch.Generator().manual_seed(0)
    position = {image_id: i for i, image_id in enumerate(image_ids)}
    caption_image, caption_language = [], []
    for lang in LANGUAGES:  # each language's captions in its own random order
        pairs = per_language[lang]
        for i in torch.randperm(len(pairs), generator=gen).tolist():
            caption_image.append(position[pairs[i][0]])
            caption_language.append(lang)
    caption_image = torch.tensor(caption_image)
    image_emb = torch.nn.functional.normalize(torch.randn(2000, 32, generator=gen), dim=1)
    text_emb = torch.nn.functional.normalize(
        image_emb[caption_image] + torch.randn(len(caption_image), 32, generator=gen), dim=1
    )
    report = retrieval_report(image_emb, text_emb, caption_image, caption_language, image_ids)
    assert report["all/MRV_dropped"] == 2
    # independent check: per-language ranks from each language's own 2000 x T_lang matrix
    tr_rows, ir_rows = [], []
    for slot, lang in enumerate(LANGUAGES):
        mine = torch.tensor([lang == other for other in caption_language])
        owners, scores = caption_image[mine], image_emb @ text_emb[mine].T
        images = torch.unique(owners)
        positive = scores[owners, torch.arange(len(owners))]
        best = torch.full((2000,), float("-inf")).scatter_reduce(0, owners, positive, "amax")
        # expected rank under random tie-breaking: float32 scores of 2000 x 2000 do tie now and then
        rows, threshold = scores[images], best[images, None]
        tied_positives = ((rows == threshold) & (owners[None, :] == images[:, None])).sum(1)
        tr = (rows > threshold).sum(1) + ((rows == threshold).sum(1) - tied_positives) / (
            tied_positives + 1.0
        )
        tr_rows.append((images, tr, slot))
        ir = (scores > positive[None, :]).sum(0) + ((scores == positive[None, :]).sum(0) - 1) / 2.0
        ir_rows.append((owners, ir, slot))
    for direction, rows in (("i2t", tr_rows), ("t2i", ir_rows)):
        instance = torch.cat([r[0] for r in rows])
        ranks = torch.cat([r[1] for r in rows])
        language = torch.cat([torch.full_like(r[0], r[2]) for r in rows])
        variance, std, dropped = mean_rank_variance(instance, language, ranks, len(LANGUAGES))
        assert dropped == 2
        assert report[f"all/MRV_var/{direction}"] == variance
        assert report[f"all/MRV_std/{direction}"] == std
    assert report["all/MRV_std/i2t"] > 0
