"""``python tests/ddp_logged_metric.py OUT``: a 2-process Lightning DDP validation (CPU, gloo) of a
LightningModule that owns a ``metrics.RetrievalEvaluation`` (ground truth given at construction)
and a ``MetricCollection`` holding another, updates both in ``validation_step`` and logs
``compute()`` through ``self.log_dict`` at the epoch's end. Each process writes what it logged to
``OUT/rank<r>.json``. The data is ``retrieval_set()``: 9 images and 17 captions in batches of 2 and 3,
so each process's DistributedSampler share is padded with a repeat."""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader
from torchmetrics import MetricCollection

from ccr.metrics import GroundTruth, RetrievalEvaluation

NUM_IMAGES = 9
LANGUAGES = ["en"] * NUM_IMAGES + ["de"] * (NUM_IMAGES - 1)  # image 8 has no "de" caption
SETTINGS = {"ks": (1, 5), "ndcg_k": 5, "unimodal_ndcg_ks": (5, 20), "chunk_size": 4, "rerank_k": 0}
COLLECTION_PREFIX = "collection/"


def retrieval_set() -> tuple[torch.Tensor, torch.Tensor, GroundTruth]:
    """Image and caption embeddings of a small two-language set and its ground truth."""
    gen = torch.Generator().manual_seed(0)
    image = torch.randn(NUM_IMAGES, 6, generator=gen)
    caption_image = torch.cat([torch.arange(NUM_IMAGES), torch.arange(NUM_IMAGES - 1)])
    text = image[caption_image] + torch.randn(len(caption_image), 6, generator=gen)
    truth = GroundTruth(
        caption_image=caption_image,
        caption_language=LANGUAGES,
        image_ids=[f"img{i}" for i in range(NUM_IMAGES)],
        image_relevance=torch.rand(NUM_IMAGES, NUM_IMAGES, generator=gen),
        mrv_languages=["en", "de"],
    )
    return image, text, truth


class LoggedRetrieval(L.LightningModule):
    """Embeddings looked up by item index; the metrics are attributes, as torchmetrics asks."""

    def __init__(self) -> None:
        super().__init__()
        self.image, self.text, truth = retrieval_set()
        self.retrieval = RetrievalEvaluation(truth, **SETTINGS)
        self.collection = MetricCollection(
            {"retrieval": RetrievalEvaluation(truth, **SETTINGS)}, prefix=COLLECTION_PREFIX
        )

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0):
        side, table = ("images", self.image) if dataloader_idx == 0 else ("captions", self.text)
        self.retrieval.update(side, batch, table[batch])
        self.collection.update(side, batch, table[batch])

    def on_validation_epoch_end(self) -> None:
        self.log_dict(self.retrieval.compute())
        self.log_dict(self.collection.compute())
        self.retrieval.reset()
        self.collection.reset()


def main(out: Path) -> None:
    torch.set_num_threads(1)
    module = LoggedRetrieval()
    loaders = [
        DataLoader(torch.arange(NUM_IMAGES), batch_size=2),
        DataLoader(torch.arange(len(LANGUAGES)), batch_size=3),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(module, dataloaders=loaders, verbose=False)
    logged = {key: value.item() for key, value in trainer.callback_metrics.items()}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(logged))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
