"""A run folder as the report reads it: its ``metrics.json`` and its evaluated test set.

An external model's folder holds the embeddings (``embeddings.pt``); a trained run's are encoded
again from the checkpoint its ``metrics.json`` names, with the run's stored configuration, by the
encoding evaluation uses (``ccr.experiments.evaluate.load_last_stage``, ``ccr.methods.encoding``). The report then recomputes every score from these
embeddings and says where they differ from ``metrics.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ccr.experiments.report.evaluated import EMBEDDINGS, EvaluatedSet
from ccr.methods.encoding import encode_view
from ccr.metrics.report import retrieval_report

# Scores the report does not recompute: uni-modal NDCG needs the synthetic world's relevance.
NOT_RECOMPUTED = ("i2i/", "t2t/")
TOLERANCE = 1e-9


@dataclass
class Run:
    """One run's recorded result, its evaluated set and the scores recomputed from it."""

    folder: Path
    record: dict
    evaluated: EvaluatedSet
    recomputed: dict[str, float]

    @property
    def name(self) -> str:
        external = self.record.get("external")
        tag = f" {external['pretrained']}" if external and external.get("pretrained") else ""
        return f"{self.record['method']}{tag} ({self.folder.name})"

    def differences(self) -> list[str]:
        """``key: recorded -> recomputed`` for every score that differs beyond rounding."""
        recorded = self.record["metrics"]
        return [
            f"{key}: {recorded[key]:.6g} -> {value:.6g}"
            for key, value in self.recomputed.items()
            if key in recorded and abs(recorded[key] - value) > TOLERANCE
        ]


def read_record(folder: Path) -> dict:
    path = folder / "metrics.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a finished run folder (no metrics.json)")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
    missing = [k for k in ("method", "data", "metrics", "config") if k not in record]
    if missing:
        raise ValueError(f"{path}: missing field(s) {', '.join(missing)}")
    return record


def load_run(folder: Path) -> Run:
    """Read ``folder`` and score its embeddings with the run's evaluation settings."""
    record = read_record(folder)
    embeddings = folder / EMBEDDINGS
    evaluated = (
        EvaluatedSet.load(embeddings) if embeddings.is_file() else encode_trained(folder, record)
    )
    evaluation = record["config"].get("evaluation", {})
    image_emb, text_emb = evaluated.embeddings()
    recomputed = retrieval_report(
        image_emb,
        text_emb,
        evaluated.caption_image,
        evaluated.caption_language,
        evaluated.image_ids,
        ks=tuple(evaluation.get("ks", (1, 5, 10))),
        ndcg_k=evaluation.get("ndcg_k", 10),
        chunk_size=evaluation.get("chunk_size", 1024),
        mrv_languages=evaluated.mrv_languages,
    )
    recomputed = {k: float(v) for k, v in recomputed.items() if not k.startswith(NOT_RECOMPUTED)}
    return Run(folder, record, evaluated, recomputed)


def encode_trained(folder: Path, record: dict) -> EvaluatedSet:
    """The test view of a trained run, encoded from the checkpoint its ``metrics.json`` names, with
    the run's stored configuration, as evaluation encodes it (``ccr.methods.encoding.encode_view``)."""
    from ccr.experiments.evaluate import load_last_stage

    checkpoint = record.get("checkpoint")
    if not checkpoint:
        raise ValueError(
            f"{folder / 'metrics.json'}: records no checkpoint and the folder has no "
            f"{EMBEDDINGS}; nothing to rank"
        )
    restored = load_last_stage(Path(checkpoint), split="test", run_dir=folder)
    view = restored.data.eval_view("test")
    image_emb, text_emb = encode_view(restored.module, view, int(restored.cfg.data.eval_batch_size))
    return EvaluatedSet(
        image_ids=list(view.image_ids),
        image_paths=[str(p) for p in view.image_paths],
        captions=list(view.captions),
        caption_image=view.caption_image,
        caption_language=list(view.caption_language),
        languages=list(view.languages),
        mrv_languages=view.mrv_languages,
        image_emb=image_emb,
        text_emb=text_emb,
    )
