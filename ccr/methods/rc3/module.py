"""``rc3``: RC3, regularised cross-lingual visio-textual contrastive pre-training (spec
docs/specs/rc3.md, docs/rc3.md).

A single-stream mBART encoder–decoder (``ccr/methods/rc3/seq2seq.py``) trained, every step, on the
sum of four objectives on their own data pools (§3.5):

* MCLM (strict triplets): MLM of the masked caption x^i given the image, plus translation of it into
  x^j on the decoder;
* ITM (strict triplets): the ITM head on (v, x^i) against (v, partner's x^i);
* XTCL (parallel text, ``datamodule.parallel_dataloader()``): Euclidean contrastive loss with
  interpolated negatives between text-only TRs;
* R-XVtCL (strict and weak triplets): the same loss between fused VtRs, six negatives from one
  partner triplet; weak triplets (``alignment_weak``) add KL(P_vtr ‖ P_tr) (``ccr/methods/layers/
  euclidean_contrastive.py``).

Visual input (``method.visual.strict_input``): ROI features for strict triplets and evaluation,
read from the batch (``roi_features`` with its ``roi_mask``: a dataset's precomputed detector
features, ``data.roi_features``) or else the grid regions of a frozen image backbone (spec §2.8),
or raw-pixel patches (RC3-Patch); weak triplets always use patches. Retrieval is the paper's: the ITM
logit of every (image, tagged caption) pair (``evaluation.scorer=cross_encoder``, the preset's
default; ``ccr/methods/layers/cross_encoder_scoring.py``).

The first stage is not part of RC3: linear probe heads trained with InfoNCE on detached features,
so they never change what RC3 trains. They read frozen pretrained encoders
(``method.first_stage.image_encoder`` / ``text_encoder``, the world's ViT and XLM-R by default), or,
when those are null, RC3's own passes (image-only pass, mean visual state; text TR). Fine-tuning
takes its hard negative caption from them (IGLUE's precomputed pool stands in), and they rank only
under ``evaluation.scorer=embeddings``: leaderboard scorer ``probe``, or ``probe+itm@k`` with the ITM
head over the probe's top k, rows that measure the probe, not RC3.

The run's ``protocol`` picks the stages (spec §5): ``fine-tune-en`` (the paper's) pre-trains, then
fine-tunes for image-text retrieval on English training captions (IGLUE/VOLTA's 4-candidate
cross-entropy over ITM logits, ``phase="finetune"``); ``pretrain-only`` retrieves straight from the
pre-trained ITM head, a diagnostic the paper never reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import permutations
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ccr.methods.base import DEFAULT_PROTOCOL, RetrievalModule, Stage, load_state
from ccr.methods.layers.batches import fill_to, trim_padding
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.layers.distributed import RowLayout, row_layout
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.layers.heads import MLMHead, ProjectionHead
from ccr.methods.layers.masking import IGNORE_INDEX, maskable_positions
from ccr.methods.rc3.euclidean_contrastive import (
    ContrastiveTerm,
    PosProbTracker,
    global_mean_scalar,
    involution_pairs,
    rxvtcl_vectors,
    textual_distances,
    xtcl_loss,
)
from ccr.methods.rc3.first_stage import FrozenEncoders
from ccr.methods.rc3.regions import GridRegions
from ccr.methods.rc3.seq2seq import SingleStreamSeq2Seq, world_backbone
from ccr.methods.registry import register

VISUAL_INPUTS = ("patch", "roi", "combined")
PRETRAIN, FINETUNE = "pretrain", "finetune"
ENGLISH = "en"
FINE_TUNE_EN, PRETRAIN_ONLY = "fine-tune-en", "pretrain-only"
PROTOCOLS = (FINE_TUNE_EN, PRETRAIN_ONLY)
PRETRAINING_ONLY_PARTS = ("net.model.decoder.", "mlm_head.")  # what only pre-training reads
PARALLEL = "parallel"  # the pretrain stage's parallel-text loader (XTCL)


def resolve_settings(method) -> OmegaConf:
    """The method config with the switches of ``method.ablation`` (from ``variant=``) applied."""
    ablation = method.get("ablation")
    if ablation is not None and ablation not in method.ablations:
        raise ValueError(
            f"rc3 ablation {ablation!r} (method.ablation, from variant=) is not one of "
            f"{sorted(method.ablations)}; to label a run freely set method.ablation=null"
        )
    settings = OmegaConf.merge(method, method.ablations[ablation] if ablation is not None else {})
    if settings.visual.strict_input not in VISUAL_INPUTS:
        raise ValueError(
            f"method.visual.strict_input {settings.visual.strict_input!r}: expected {VISUAL_INPUTS}"
        )
    return settings


def protocol_of(name: str, languages: list[str]) -> str:
    """The run's protocol (``protocol=``, handed to the method at build time):
    ``fine-tune-en`` (spec §5: pre-training, then ITR fine-tuning on English training captions)
    or ``pretrain-only`` (the diagnostic: no fine-tuning). Anything else would mislabel the run."""
    if name not in PROTOCOLS:
        raise ValueError(f"rc3 protocol {name!r} (protocol=) is not one of {list(PROTOCOLS)}")
    if name == FINE_TUNE_EN and ENGLISH not in languages:
        raise ValueError(
            f"rc3 protocol {name} fine-tunes on English captions, but data.languages "
            f"{list(languages)} has no {ENGLISH!r}"
        )
    return name


def finetune_optim(optim, finetune) -> OmegaConf:
    """The run's ``optim`` with the fine-tuning stage's own keys (``method.finetune.optim``)
    on top; a key ``optim`` does not have is an error naming it."""
    unknown = sorted(set(finetune.optim) - set(optim))
    if unknown:
        raise ValueError(
            f"method.finetune.optim.{unknown[0]} is not an optim key; keys: {sorted(optim)}"
        )
    return OmegaConf.merge(optim, OmegaConf.to_container(finetune.optim))  # its keys, untyped


def itr_negatives(similarity: Tensor, same_image: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Row i's three negatives for (image i, caption i), as row indices of the batch: a caption
    of another image drawn uniformly, another image drawn uniformly, and the hard negative, the
    caption of another image that the first stage scores highest for image i (``similarity``
    [image, caption]): what it would hand the ITM head to re-rank at test time."""
    other = ~same_image
    if not other.any(1).all():
        raise ValueError(
            "rc3 fine-tuning: a training batch holds a single image; its captions "
            "have no negative (data.batch_size or method.finetune.batch_size >= 2)"
        )
    random_caption = (
        torch.rand(other.shape, device=other.device).masked_fill(~other, -1.0).argmax(1)
    )
    random_image = torch.rand(other.shape, device=other.device).masked_fill(~other, -1.0).argmax(1)
    hard_caption = similarity.masked_fill(~other, float("-inf")).argmax(1)
    return random_caption, random_image, hard_caption


def four_way_loss(logits: Tensor) -> Tensor:
    """Per-row cross-entropy over the 4 candidates' ITM logits ``[n, 4]``, the true pair in
    column 0 (IGLUE/VOLTA's retrieval fine-tuning)."""
    return F.cross_entropy(
        logits, torch.zeros(len(logits), dtype=torch.long, device=logits.device), reduction="none"
    )


def same_image_rows(ids: list) -> Tensor:
    """``[n, n]``: whether rows i and j show the same image (equal record ids)."""
    return torch.tensor([[a == b for b in ids] for a in ids], dtype=torch.bool)


def mask_content(
    input_ids: Tensor,
    attention_mask: Tensor,
    mask_token_id: int,
    special_ids: list[int],
    probability: float,
) -> tuple[Tensor, Tensor]:
    """RC3's MLM corruption (§8.12): each content token (attended, not special) becomes [MASK]
    with ``probability``; returns (masked ids, labels with IGNORE_INDEX off the masked tokens)."""
    content = maskable_positions(input_ids, attention_mask, special_ids)
    chosen = content & (torch.rand(input_ids.shape, device=input_ids.device) < probability)
    labels = input_ids.masked_fill(~chosen, IGNORE_INDEX)
    return input_ids.masked_fill(chosen, mask_token_id), labels


@dataclass
class VisualInput:
    """Visual tokens ``[N, k, d]`` and which of them the encoder attends to ``[N, k]`` (all, but
    for the padding of an image with fewer shipped ROI regions than ``data.roi_regions``)."""

    tokens: Tensor
    mask: Tensor | None = None

    def __post_init__(self):
        if self.mask is None:
            self.mask = torch.ones(
                self.tokens.shape[:2], dtype=torch.bool, device=self.tokens.device
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, index: Tensor) -> VisualInput:
        return VisualInput(self.tokens[index], self.mask[index])

    def repeat(self, times: int) -> VisualInput:
        return VisualInput(self.tokens.repeat(times, 1, 1), self.mask.repeat(times, 1))


class Triplets:
    """Rows of one source (strict or weak) with an ordered language pair (l_i, l_j): images,
    captions x^i / x^j trimmed to a common length, and their languages. Even row count.

    ``real`` is the number of leading rows that are data: all of them, or 0 for a ``placeholder``."""

    def __init__(self, batch: dict, rows: Tensor, pair: tuple[int, int]):
        languages = batch["languages"]
        (ki, kj), self.rows = pair, rows
        self.real = len(rows)
        self.lang_i, self.lang_j = languages[ki], languages[kj]
        self.images = batch["images"][rows]
        ids = torch.cat([batch["input_ids"][rows, ki], batch["input_ids"][rows, kj]])
        mask = torch.cat([batch["attention_mask"][rows, ki], batch["attention_mask"][rows, kj]])
        ids, mask = trim_padding(ids, mask)
        n = len(rows)
        self.ids_i, self.ids_j, self.mask_i, self.mask_j = ids[:n], ids[n:], mask[:n], mask[n:]
        self.roi = batch["roi_features"][rows] if "roi_features" in batch else None
        self.roi_mask = batch["roi_mask"][rows] if "roi_mask" in batch else None

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def placeholder(cls, batch: dict, bos_id: int, eos_id: int) -> Triplets:
        """Two stand-in rows (blank images, captions ``<s> </s>``) with ``real == 0``. A process
        without rows of a pool runs the pool's computation on them and keeps none of the outputs:
        its autograd graph reaches the same parameters and runs the same collectives (forward and
        backward) as a process with rows, so DDP neither stalls nor gains a contribution."""
        k = len(batch["languages"])
        ids = torch.tensor([bos_id, eos_id], device=batch["input_ids"].device).expand(2, k, 2)
        stand_in = {
            "languages": batch["languages"],
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "images": batch["images"].new_zeros(2, *batch["images"].shape[1:]),
        }
        if "roi_features" in batch:
            stand_in["roi_features"] = batch["roi_features"].new_zeros(
                2, *batch["roi_features"].shape[1:]
            )
            stand_in["roi_mask"] = torch.ones(
                stand_in["roi_features"].shape[:2], dtype=torch.bool, device=ids.device
            )
        triplets = cls(stand_in, torch.arange(2, device=ids.device), (0, 1))
        triplets.real = 0
        return triplets


def global_share(values: Tensor, layout: RowLayout) -> Tensor:
    """``layout.global_mean(values)``, or an exact zero that stays in the graph when no process
    has a row (a mean over nothing)."""
    return layout.global_mean(values) if layout.total else values.sum()


def draw_triplet_rows(
    present: Tensor, candidates: Tensor, limit: int
) -> tuple[Tensor, tuple[int, int]] | None:
    """One ordered language pair (l_i ≠ l_j) drawn uniformly among the pairs that at least two of
    the ``candidates`` rows have, and the first ``limit`` of those rows (batches are shuffled; an
    even number: one is dropped when odd). None when no pair has two rows."""
    pairs = [
        (i, j)
        for i, j in permutations(range(present.shape[1]), 2)
        if int((present[candidates, i] & present[candidates, j]).sum()) >= 2
    ]
    if not pairs:
        return None
    i, j = pairs[int(torch.randint(len(pairs), ()))]
    rows = candidates.nonzero().flatten()
    rows = rows[(present[rows, i] & present[rows, j])][:limit]
    return rows[: len(rows) - len(rows) % 2], (i, j)


@register("rc3")
class RC3(RetrievalModule):
    """The seq2seq backbone, ITM / MLM heads, the two positive-probability trackers and the
    first-stage probe heads; ``phase`` is the stage it trains in: ``pretrain`` (§3) or
    ``finetune`` (§5 ITR fine-tuning, which trains only what retrieval reads).

    With ``optim.grad_cache_chunks`` > 1 every encoder pass that trains (the fused quadruples, MCLM
    with its decoder, the XTCL text passes, the fine-tuning candidates) runs in that many
    micro-batches (``encode_in_chunks``); every loss, the trackers and the draws see the whole
    step."""

    supports_grad_cache = True

    embedding_scorer = "probe"  # encode_images/encode_texts are the first-stage probe's, not RC3's
    own_embeddings = False

    def __init__(self, method, optim, data, evaluation, phase: str = PRETRAIN):
        super().__init__(method, optim, data, evaluation)
        if phase not in (PRETRAIN, FINETUNE):
            raise ValueError(f"RC3 phase must be {PRETRAIN!r} or {FINETUNE!r}, got {phase!r}")
        self.phase = phase
        self.settings = resolve_settings(self.method_cfg)
        cfg, data = self.settings, self.data_info
        reads_regions = cfg.visual.strict_input != "patch"
        shipped = getattr(data, "roi_dim", None)  # width of the data's own ROI features, if any
        if reads_regions and shipped is not None and shipped != cfg.visual.roi_dim:
            raise ValueError(
                f"rc3: method.visual.roi_dim={cfg.visual.roi_dim}, but "
                f"data.roi_features {data.roi_store} is {shipped} wide; "
                f"set method.visual.roi_dim={shipped}"
            )
        grid = reads_regions and shipped is None and cfg.visual.regions is not None
        self.regions = GridRegions.from_config(cfg.visual.regions, data) if grid else None
        roi_dim = None  # no ROI projection for RC3-Patch
        if reads_regions:
            roi_dim = self.regions.dim if self.regions is not None else cfg.visual.roi_dim
        self.net = SingleStreamSeq2Seq(
            world_backbone(cfg.backbone, data),
            data.languages,
            data.vocab_size,
            data.pad_token_id,
            data.cls_token_id,
            data.eos_token_id,
            roi_dim,
        )
        d = self.net.d_model
        self.itm_head = nn.Linear(d, 1)
        self.mlm_head = MLMHead(d, self.net.vocab_size, tie_to=self.net.model.shared)
        self.xtcl_tracker = PosProbTracker(cfg.tracker_window)
        self.vt_tracker = PosProbTracker(cfg.tracker_window)
        first = cfg.first_stage
        if (first.image_encoder is None) != (first.text_encoder is None):
            raise ValueError(
                "method.first_stage: name both image_encoder and text_encoder, or "
                "neither (the probe then reads RC3's own passes)"
            )
        try:
            self.first_encoders = (
                FrozenEncoders(first.image_encoder, first.text_encoder, data)
                if first.image_encoder is not None
                else None
            )
        except ValueError as err:
            raise ValueError(
                f"method.first_stage: {err}; or set method.first_stage.image_encoder"
                f" and text_encoder to null to probe RC3's own passes"
            ) from None
        own = self.first_encoders is None
        self.probe_image = ProjectionHead(d if own else self.first_encoders.image_dim, first.dim)
        self.probe_text = ProjectionHead(d if own else self.first_encoders.text_dim, first.dim)
        self.parallel_loader: Callable[[], DataLoader] | None = None  # from the stage
        self.parallel_batches = None  # the XTCL stream, built on the first training step
        reads_patches = cfg.use_rxvtcl and cfg.use_weak and phase == PRETRAIN
        if cfg.visual.strict_input == "roi" and not reads_patches:
            # nothing reads raw-pixel patches: keep the patch pathway out of training (and of DDP)
            self.net.visual.patch_embed.requires_grad_(False)
            self.net.visual.patch_proj.requires_grad_(False)
        if phase == FINETUNE:
            self.freeze_pretraining_only_parts()
            self.optim_cfg = finetune_optim(self.optim_cfg, self.method_cfg.finetune)
        if not reads_regions:
            rank_zero_info("rc3: patch-only visual input (RC3-Patch); no ROI features are used")
        elif shipped is not None:
            rank_zero_info(
                f"rc3: {cfg.visual.strict_input} input; ROI features are the data's "
                f"precomputed detector features, data.roi_features {data.roi_store}"
            )
        elif self.regions is not None:
            rank_zero_info(
                f"rc3: {cfg.visual.strict_input} input; ROI features are grid pseudo-ROIs "
                f"of the frozen image backbone {cfg.visual.regions.name!r} (spec §2.8)"
            )

    def freeze_pretraining_only_parts(self) -> None:
        """Fine-tuning trains the single-stream encoder (token table, visual tokeniser, layers),
        the ITM head and the probe heads, as VOLTA fine-tunes the whole encoder: the decoder and
        the MLM head, which no fine-tuning loss reads, stay as pre-trained (and out of DDP). The
        token table they share with the encoder is named ``net.model.shared`` and trains."""
        for name, param in self.named_parameters():
            if name.startswith(PRETRAINING_ONLY_PARTS):
                param.requires_grad_(False)

    # ---- inputs ---------------------------------------------------------------------------------

    def specials(self) -> list[int]:
        data = self.data_info
        return [
            data.pad_token_id,
            data.cls_token_id,
            data.eos_token_id,
            data.mask_token_id,
            *self.net.tag_ids.values(),
            *self.net.special_ids.values(),
        ]

    def strict_visual(self, triplets: Triplets) -> VisualInput:
        """Visual tokens of strict triplets (``visual.strict_input``)."""
        return self.visual_tokens(triplets.images, triplets.roi, triplets.roi_mask)

    def visual_tokens(
        self, images: Tensor, roi: Tensor | None = None, roi_mask: Tensor | None = None
    ) -> VisualInput:
        """Patches, ROI features or both (``visual.strict_input``). ROI features are the batch's
        own (``roi`` and its ``roi_mask``, a dataset that ships them) or else the frozen
        backbone's grid regions."""
        kind = self.settings.visual.strict_input
        if kind == "patch":
            return VisualInput(self.net.visual.patches(images))
        if roi is None:
            if self.regions is None:
                raise ValueError(
                    f"method.visual.strict_input={kind} needs ROI features: a batch key "
                    f"'roi_features', or method.visual.regions naming a frozen image backbone "
                    f"(spec §2.8); or use strict_input=patch (RC3-Patch)"
                )
            roi = self.regions(images)
        rois = VisualInput(self.net.visual.rois(roi), roi_mask)
        if kind == "roi":
            return rois
        tokens = self.net.combined_tokens(rois.tokens, self.net.visual.patches(images))
        rest = rois.mask.new_ones(len(tokens), tokens.shape[1] - rois.tokens.shape[1])
        return VisualInput(tokens, torch.cat([rois.mask, rest], 1))  # [SEP] and patches attended

    def tag(self, ids: Tensor, mask: Tensor, language: str) -> Tensor:
        return self.net.tag_source(ids, mask, language)

    # ---- losses ---------------------------------------------------------------------------------

    def pooled_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        visual: Tensor | None = None,
        visual_mask: Tensor | None = None,
    ) -> Tensor:
        """The encoder's state at index 0 (TR or VtR), in ``optim.grad_cache_chunks``
        micro-batches when training."""
        inputs = (
            (input_ids, attention_mask)
            if visual is None
            else (
                input_ids,
                attention_mask,
                visual,
                visual_mask,
            )
        )
        return encode_in_chunks(
            lambda *rows: self.net.encode(*rows).pooled, *inputs, chunks=self.grad_cache_chunks
        )

    def fused_quadruple(self, visual: VisualInput, t: Triplets, perm: Tensor) -> tuple[Tensor, ...]:
        """VtR of (v, x^i), (v, x^j), (v, x̂^i), (v, x̂^j) in one encoder call: ``[N, d]`` each."""
        xi, xj = self.tag(t.ids_i, t.mask_i, t.lang_i), self.tag(t.ids_j, t.mask_j, t.lang_j)
        ids = torch.cat([xi, xj, xi[perm], xj[perm]])
        mask = torch.cat([t.mask_i, t.mask_j, t.mask_i[perm], t.mask_j[perm]])
        visual = visual.repeat(4)
        return self.pooled_states(ids, mask, visual.tokens, visual.mask).chunk(4)

    def text_representation(self, ids: Tensor, mask: Tensor, language: str) -> Tensor:
        """TR: the state at ``[BOS]`` of the text-only input ``[BOS] x [LAN]``."""
        return self.pooled_states(self.tag(ids, mask, language), mask)

    def mclm_loss(self, visual: VisualInput, t: Triplets) -> Tensor:
        """MLM on the masked x^i given v, plus translation into x^j on the decoder (§3.1); each a
        token mean over the global batch (a collective)."""
        masked, labels = mask_content(
            t.ids_i,
            t.mask_i,
            self.data_info.mask_token_id,
            self.specials(),
            self.settings.mask_probability,
        )
        labels[t.real :] = IGNORE_INDEX

        def token_losses(ids, mask, tokens, tokens_mask, labels, ids_j, mask_j):
            """Per token of these rows: the MLM loss (0 off the masked tokens), the
            translation NLL and which target tokens are real."""
            encoded = self.net.encode(ids, mask, tokens, tokens_mask)
            text_states = encoded.states[:, 1 + tokens.shape[1] :]
            chosen = labels != IGNORE_INDEX
            logits = self.mlm_head(text_states[chosen]).float()
            mlm = F.cross_entropy(logits, labels[chosen], reduction="none")
            mlm = torch.zeros(labels.shape, dtype=mlm.dtype, device=mlm.device).masked_scatter(
                chosen, mlm
            )
            return (mlm, *self.net.translation_nll(encoded, ids_j, mask_j, t.lang_j))

        tagged = self.tag(masked, t.mask_i, t.lang_i)
        mlm, nll, targets = encode_in_chunks(
            token_losses,
            *(tagged, t.mask_i, visual.tokens, visual.mask, labels, t.ids_j, t.mask_j),
            chunks=self.grad_cache_chunks,
        )
        mlm = mlm[labels != IGNORE_INDEX]
        translation = nll[: t.real][targets[: t.real]]
        return global_share(mlm, row_layout(len(mlm), mlm.device)) + global_share(
            translation, row_layout(len(translation), mlm.device)
        )

    def contrastive_source(
        self, t: Triplets, visual: VisualInput, alpha: float, layout: RowLayout, regularise: bool
    ) -> tuple[ContrastiveTerm, tuple[Tensor, ...]]:
        """R-XVtCL on one source (``layout``: every process's real row count). Returns the term
        and the fused (anchor, positive, C1, C2, perm) for ITM reuse."""
        perm = involution_pairs(len(t), device=visual.tokens.device)
        fused = self.fused_quadruple(visual, t, perm)
        d_tr = None
        if regularise:
            with torch.no_grad():
                d_tr = textual_distances(
                    self.text_representation(t.ids_i, t.mask_i, t.lang_i),
                    self.text_representation(t.ids_j, t.mask_j, t.lang_j),
                    perm,
                )
        loss_vec, raw, kl = rxvtcl_vectors(*fused, perm, alpha, d_tr=d_tr)
        n = t.real
        kl = kl[:n].mean().detach() if kl is not None and n else None
        return ContrastiveTerm(global_share(loss_vec[:n], layout), raw[:n], kl), (*fused, perm)

    def itm_loss(self, anchor: Tensor, c1: Tensor) -> Tensor:
        """BCE of the ITM head: (v, x^i) matches, (v, partner's x^i) does not (§3.2); the mean
        over the global batch's pairs (a collective)."""
        logits = self.itm_head(torch.cat([anchor, c1])).squeeze(1).float()
        labels = torch.cat(
            [torch.ones_like(logits[: len(anchor)]), torch.zeros_like(logits[len(anchor) :])]
        )
        bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        return global_share(bce, row_layout(len(bce), bce.device))

    def probe_loss(self, t: Triplets, visual: VisualInput, layout: RowLayout) -> Tensor:
        """InfoNCE of the first-stage probe heads on detached features (no gradient to the net),
        negatives from the global batch (a collective when any process has rows)."""
        image = self.first_stage_image(t.images, visual)[: t.real]
        text = self.first_stage_text(t.ids_i, t.mask_i, t.lang_i)[: t.real]
        return self.probe_info_nce(self.probe_image(image), self.probe_text(text), layout)

    @torch.no_grad()
    def first_stage_image(self, images: Tensor, visual: VisualInput) -> Tensor:
        """Detached image features the probe reads: the frozen first-stage encoder's, or RC3's
        image-only pass over ``visual``."""
        if self.first_encoders is not None:
            return self.first_encoders.image_features(images)
        return self.image_only_features(visual)

    @torch.no_grad()
    def first_stage_text(self, input_ids: Tensor, attention_mask: Tensor, language: str) -> Tensor:
        """Detached caption features the probe reads: the frozen first-stage encoder's (untagged
        input), or RC3's TR."""
        if self.first_encoders is not None:
            return self.first_encoders.text_features(input_ids, attention_mask)
        return self.text_representation(input_ids, attention_mask, language)

    def probe_info_nce(self, image: Tensor, text: Tensor, layout: RowLayout) -> Tensor:
        """InfoNCE over probe embeddings, or an exact zero on every process when none has a row."""
        if not layout.total:
            return image.sum() + text.sum()
        return info_nce(image, text, self.settings.first_stage.temperature)

    def image_only_features(self, visual: VisualInput) -> Tensor:
        """Mean final state over the attended visual positions of ``[CLS] visual`` (no text)."""
        empty = torch.zeros(len(visual), 0, dtype=torch.long, device=visual.tokens.device)
        states = self.net.encode(empty, empty.bool(), visual.tokens, visual.mask).states[:, 1:]
        weights = visual.mask.to(states.dtype).unsqueeze(-1)
        return (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def xtcl_term(self, batch: dict) -> ContrastiveTerm:
        """XTCL on the first ``anchors_per_task`` pairs of one parallel-text batch (§3.3). A
        process without pairs encodes two ``<s> </s>`` stand-ins and keeps none (see
        ``Triplets.placeholder``): the gathers and their backward run everywhere."""
        alpha = self.settings.zeta * self.xtcl_tracker.p_avg()
        n = min(self.settings.anchors_per_task, len(batch["src_input_ids"]))
        sides = []
        for side in ("src", "tgt"):
            ids, mask = batch[f"{side}_input_ids"][:n], batch[f"{side}_attention_mask"][:n]
            if n == 0:
                ids = ids.new_tensor(
                    [self.data_info.cls_token_id, self.data_info.eos_token_id]
                ).expand(2, 2)
                mask = torch.ones_like(ids)
            ids, mask = trim_padding(ids, mask)
            sides.append(self.text_representation(ids, mask, batch[f"{side}_language"])[:n])
        return xtcl_loss(*sides, alpha)

    def pool(self, batch: dict, candidates: Tensor) -> Triplets:
        """This process's triplets among ``candidates`` rows (one drawn language pair), or the
        placeholder when it has none."""
        drawn = draw_triplet_rows(
            batch["present"].bool(), candidates, self.settings.anchors_per_task
        )
        if drawn is None:
            return Triplets.placeholder(
                batch, self.data_info.cls_token_id, self.data_info.eos_token_id
            )
        return Triplets(batch, *drawn)

    def losses(self, batch: dict, parallel: dict | None = None) -> dict[str, Tensor]:
        """Every enabled objective of one step (keys as logged under ``loss/``); updates the
        trackers after the losses are built. ``kl`` (mean over this process's weak anchors) is a
        diagnostic that is already inside ``rxvtcl``.

        Every process runs the same computations and collectives in the same order whatever its
        rows: a pool it lacks runs on ``Triplets.placeholder`` (the weak pool too when no process
        has a weak row). Each loss is this process's share of the global-batch mean."""
        cfg = self.settings
        weak = batch.get("alignment_weak")
        weak = torch.zeros(len(batch["images"]), dtype=torch.bool) if weak is None else weak.bool()
        weak = weak.to(batch["present"].device)
        strict = self.pool(batch, ~weak)
        device = self.itm_head.weight.device
        strict_layout = row_layout(strict.real, device)
        alpha = cfg.zeta * self.vt_tracker.p_avg()
        strict_visual = self.strict_visual(strict)
        term_s, fused = self.contrastive_source(
            strict, strict_visual, alpha, strict_layout, regularise=False
        )
        n = strict.real
        losses = {
            "mclm": self.mclm_loss(strict_visual, strict),
            "itm": self.itm_loss(fused[0][:n], fused[2][:n]),
            "probe": self.probe_loss(strict, strict_visual, strict_layout),
        }
        raws = [term_s.raw]
        if cfg.use_rxvtcl:
            rxvtcl = term_s.loss
            if cfg.use_weak:
                # Runs on stand-in rows even where no process has a weak row (an exact zero): with
                # ROI strict input the patch pathway is read only here, and DDP needs every
                # trained parameter in every step's graph.
                weak_t = self.pool(batch, weak)
                weak_layout = row_layout(weak_t.real, device)
                patches = VisualInput(self.net.visual.patches(weak_t.images))
                term_w, _ = self.contrastive_source(
                    weak_t, patches, alpha, weak_layout, regularise=cfg.use_kl
                )
                rxvtcl = rxvtcl + term_w.loss
                raws.append(term_w.raw)
                if term_w.kl is not None:
                    losses["kl"] = term_w.kl
            losses["rxvtcl"] = rxvtcl
            self.update_tracker(self.vt_tracker, torch.cat(raws))
        if cfg.use_xtcl:
            parallel = parallel if parallel is not None else self.next_parallel_batch()
            term_t = self.xtcl_term(parallel)
            losses["xtcl"] = term_t.loss
            self.update_tracker(self.xtcl_tracker, term_t.raw)
        return losses

    def finetune_losses(self, batch: dict) -> dict[str, Tensor]:
        """ITR fine-tuning (spec §5, the IGLUE/VOLTA recipe) on the batch's English captions:
        ``itr``, the 4-way cross-entropy over the ITM logits of each strict row's candidates
        (``candidate_logits``), and ``probe``, the first stage's InfoNCE on detached features of
        the same rows, so that its candidates follow the encoder being fine-tuned. Weakly aligned
        rows serve only as negatives. Each loss is this process's share of the global mean."""
        k = batch["languages"].index(ENGLISH)
        rows = batch["present"][:, k].bool().nonzero().flatten()
        ids, mask = trim_padding(batch["input_ids"][rows, k], batch["attention_mask"][rows, k])
        captions = self.tag(ids, mask, ENGLISH)
        roi = [batch[key][rows] if key in batch else None for key in ("roi_features", "roi_mask")]
        visual = self.visual_tokens(batch["images"][rows], *roi)
        image_features = self.first_stage_image(batch["images"][rows], visual)
        text_features = self.first_stage_text(ids, mask, ENGLISH)
        image, text = self.probe_image(image_features), self.probe_text(text_features)
        same = same_image_rows([batch["ids"][int(i)] for i in rows]).to(image.device)
        negatives = itr_negatives(image.detach() @ text.detach().T, same)
        logits = self.candidate_logits(visual, captions, mask, negatives)
        weak = batch.get("alignment_weak")
        anchors = torch.ones_like(rows, dtype=torch.bool) if weak is None else ~weak.bool()[rows]
        layout = row_layout(int(anchors.sum()), image.device)
        return {
            "itr": global_share(four_way_loss(logits)[anchors], layout),
            "probe": self.probe_info_nce(image[anchors], text[anchors], layout),
        }

    def candidate_logits(
        self,
        visual: VisualInput,
        captions: Tensor,
        mask: Tensor,
        negatives: tuple[Tensor, Tensor, Tensor],
    ) -> Tensor:
        """ITM logits ``[n, 4]`` of each row's candidates in one encoder call, the true pair
        first: (v_i, x_i), (v_i, random x), (random v, x_i), (v_i, hard x)."""
        random_caption, random_image, hard_caption = negatives
        own = torch.arange(len(captions), device=captions.device)
        images = torch.cat([own, own, random_image, own])
        texts = torch.cat([own, random_caption, own, hard_caption])
        seen = visual.rows(images)
        pooled = self.pooled_states(captions[texts], mask[texts], seen.tokens, seen.mask)
        return self.itm_head(pooled).squeeze(1).float().view(4, len(own)).T

    @staticmethod
    def update_tracker(tracker: PosProbTracker, raw: Tensor) -> None:
        """Record the global-batch mean raw loss of a step (a collective); a step in which no
        process had an anchor records nothing."""
        mean = global_mean_scalar(raw)
        if mean is not None:
            tracker.update(mean)

    def total_loss(self, losses: dict[str, Tensor]) -> Tensor:
        """Unit-weight sum of the objectives (§3.5) and the probe's own loss (its gradient reaches
        only the probe heads); ``kl`` is part of ``rxvtcl`` already."""
        return sum(value for key, value in losses.items() if key != "kl")

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        losses = self.finetune_losses(batch) if self.phase == FINETUNE else self.losses(batch)
        total = self.total_loss(losses)
        size = len(batch["images"])
        for name, value in {**losses, "total": total}.items():
            self.log(f"loss/{name}", value.detach(), batch_size=size)
        if self.phase == PRETRAIN:
            self.log("train/p_avg_vt", self.vt_tracker.p_avg(), batch_size=size)
            self.log("train/p_avg_xtcl", self.xtcl_tracker.p_avg(), batch_size=size)
        return total

    def next_parallel_batch(self) -> dict:
        """The XTCL batch of this step: batch ``global_step`` of the cycled parallel-text stream
        (indexed by step, so a resumed run draws the same batches)."""
        if self.parallel_batches is None:
            if self.parallel_loader is None:
                raise RuntimeError(
                    f"rc3: XTCL (method.use_xtcl) reads parallel text, but no '{PARALLEL}' "
                    "loader was attached (the pretrain stage's extra_loaders; attach_loaders)"
                )
            self.parallel_batches = StepIndexedBatches(self.parallel_loader())
        batch = self.parallel_batches.batch(int(self.global_step))
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def attach_loaders(self, loaders: Mapping[str, Callable[[], DataLoader]]) -> None:
        """The parallel-text loader factory XTCL draws its batches from."""
        self.parallel_loader = loaders[PARALLEL]

    @classmethod
    def check_config(cls, method, languages: list[str], protocol: str = DEFAULT_PROTOCOL) -> None:
        protocol_of(protocol, languages)
        resolve_settings(method)  # the ablation's name and the visual input

    @classmethod
    def pipeline(
        cls, method, optim, data, evaluation, protocol: str = DEFAULT_PROTOCOL
    ) -> list[Stage]:
        """``pretrain`` on every language's training batches, then, under ``fine-tune-en``,
        ``finetune`` built from its checkpoint and trained on English captions only."""
        protocol = protocol_of(protocol, list(data.languages))
        pretrain = Stage(
            PRETRAIN,
            lambda previous: cls(method, optim, data, evaluation),
            lambda datamodule: datamodule.train_dataloader(),
            method.pretrain.max_steps,
            "method.pretrain.max_steps" if method.pretrain.max_steps is not None else None,
            extra_loaders=lambda datamodule: {PARALLEL: datamodule.parallel_dataloader},
        )
        if protocol == PRETRAIN_ONLY:
            return [pretrain]

        def build_finetune(previous: Path | None) -> RC3:
            """From the pre-training checkpoint (None: the caller loads a checkpoint itself)."""
            module = cls(method, optim, data, evaluation, phase=FINETUNE)
            if previous is not None:
                module.load_state_dict(load_state(previous))
            return module

        ft = method.finetune
        finetune = Stage(
            FINETUNE,
            build_finetune,
            lambda datamodule: datamodule.train_dataloader(
                languages=[ENGLISH], batch_size=ft.batch_size
            ),
            ft.max_steps,
            "method.finetune.max_steps",
        )
        return [pretrain, finetune]

    # ---- evaluation: the ITM head over every pair (the probe's embeddings under scorer=embeddings) --

    # an evaluation batch's shipped ROI features (data.roi_features) and each caption's language
    image_inputs = ("roi_features", "roi_mask")
    caption_inputs = ("language",)

    def eval_visual(
        self, images: Tensor, roi_features: Tensor | None = None, roi_mask: Tensor | None = None
    ) -> VisualInput:
        """Visual tokens of evaluation images, the input kind of strict training triplets: the
        images' shipped ROI features when given, else the grid regions stand in."""
        return self.visual_tokens(images, roi_features, roi_mask)

    def encode_images(
        self, images: Tensor, roi_features: Tensor | None = None, roi_mask: Tensor | None = None
    ) -> Tensor:
        if self.first_encoders is not None:
            return in_fixed_shape(
                lambda rows: self.probe_image(self.first_encoders.image_features(rows)), images
            )
        shipped = ()
        if roi_features is not None:
            if roi_mask is None:  # every region attended
                roi_mask = roi_features.new_ones(roi_features.shape[:2], dtype=torch.bool)
            shipped = (roi_features, roi_mask)
        return in_fixed_shape(
            lambda *rows: self.probe_image(self.image_only_features(self.eval_visual(*rows))),
            images,
            *shipped,
        )

    def tagged_captions(
        self, input_ids: Tensor, attention_mask: Tensor, language: Sequence[str] | None
    ) -> Tensor:
        """Captions with their own language tags (``language``: each row's language)."""
        if language is None or len(language) != len(input_ids):
            given = "none" if language is None else f"{len(language)} for {len(input_ids)} captions"
            raise ValueError(
                "rc3 tags every caption with its language: pass language=[one code per "
                f"caption] (an evaluation batch's 'language'); got {given}"
            )
        tagged = input_ids.clone()
        for code in set(language):
            rows = torch.tensor([lang == code for lang in language], device=input_ids.device)
            tagged[rows] = self.tag(input_ids[rows], attention_mask[rows], code)
        return tagged

    def encode_texts(
        self, input_ids: Tensor, attention_mask: Tensor, language: Sequence[str] | None = None
    ) -> Tensor:
        """First-stage caption embeddings, every caption padded to ``data.max_length`` and encoded
        in calls of one fixed shape (``in_fixed_shape``). RC3's own text pass tags each caption
        with its ``language``; a frozen first-stage encoder reads untagged captions."""
        input_ids, attention_mask = pad_to(
            input_ids, attention_mask, self.data_info.max_length, self.data_info.pad_token_id
        )
        if self.first_encoders is not None:
            return in_fixed_shape(
                lambda ids, mask: self.probe_text(self.first_encoders.text_features(ids, mask)),
                input_ids,
                attention_mask,
            )
        tagged = self.tagged_captions(input_ids, attention_mask, language)
        return in_fixed_shape(
            lambda ids, mask: self.probe_text(self.net.encode(ids, mask).pooled),
            tagged,
            attention_mask,
        )

    def image_cache(
        self, images: Tensor, roi_features: Tensor | None = None, roi_mask: Tensor | None = None
    ) -> dict[str, Tensor]:
        visual = self.eval_visual(images, roi_features, roi_mask)
        return {"tokens": visual.tokens, "mask": visual.mask}

    def text_cache(
        self, input_ids: Tensor, attention_mask: Tensor, language: Sequence[str] | None = None
    ) -> dict[str, Tensor]:
        return {
            "input_ids": self.tagged_captions(input_ids, attention_mask, language),
            "attention_mask": attention_mask,
        }

    def cross_encoder(self, image_cache: dict, text_cache: dict) -> MatchingScorer:
        return MatchingScorer(
            self,
            VisualInput(image_cache["tokens"], image_cache["mask"]),
            text_cache["input_ids"],
            text_cache["attention_mask"],
        )

    @torch.no_grad()
    def match_logits(
        self, visual: VisualInput, input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor:
        """ITM logit of each (image, tagged caption) pair: the paper's retrieval score."""
        input_ids, attention_mask = trim_padding(input_ids, attention_mask)
        encoded = self.net.encode(input_ids, attention_mask, visual.tokens, visual.mask)
        return self.itm_head(encoded.pooled).squeeze(1).float()


EVAL_ROWS = 8  # rows of every first-stage encoder call in evaluation


def in_fixed_shape(encode, *inputs: Tensor, rows: int = EVAL_ROWS) -> Tensor:
    """``encode(*inputs)`` computed in calls of exactly ``rows`` rows (a short last call is filled
    up with copies of its first row, whose outputs are dropped). CPU kernels round differently for
    different shapes (1e-7 here); on near-tied first-stage scores that reordered rankings between
    a DDP run and a one-process re-scoring. One shape gives each row the same bits in any batch."""
    outputs = []
    for start in range(0, len(inputs[0]), rows):
        part = [x[start : start + rows] for x in inputs]
        outputs.append(encode(*(fill_to(rows, x) for x in part))[: len(part[0])])
    return torch.cat(outputs)


def pad_to(
    input_ids: Tensor, attention_mask: Tensor, length: int, pad_id: int
) -> tuple[Tensor, Tensor]:
    """Captions right-padded (or trimmed of all-padding columns) to exactly ``length`` columns."""
    input_ids, attention_mask = trim_padding(input_ids, attention_mask)
    extra = length - input_ids.shape[1]
    if extra < 0:
        raise ValueError(
            f"rc3: a caption has {input_ids.shape[1]} tokens, more than data.max_length={length}"
        )
    return F.pad(input_ids, (0, extra), value=pad_id), F.pad(attention_mask, (0, extra), value=0)


class MatchingScorer:
    """RC3's cross-encoder as a ``PairScorer``: the ITM logit of ``[CLS] visual [BOS] caption [LAN]``
    for each pair (single stream: nothing of a caption is computed without its image)."""

    def __init__(self, module: RC3, visual: VisualInput, input_ids: Tensor, attention_mask: Tensor):
        self.module, self.visual = module, visual
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.device = visual.tokens.device

    def captions(self, index: Tensor) -> tuple[Tensor, Tensor]:
        return self.input_ids[index], self.attention_mask[index]

    @torch.no_grad()
    def score(self, images: Tensor, block: tuple[Tensor, Tensor], rows: Tensor) -> Tensor:
        input_ids, attention_mask = block
        return self.module.match_logits(
            self.visual.rows(images), input_ids[rows], attention_mask[rows]
        )


class StepIndexedBatches:
    """Batch ``step`` of a training loader cycled over its epochs, in the loader's seeded order
    (its ``EpochSampler`` sharding included), without iterating: resume-exact by construction."""

    def __init__(self, loader):
        self.loader = loader
        self.sampler, self.dataset, self.collate = loader.sampler, loader.dataset, loader.collate_fn
        self._epoch, self._order = None, None

    def batch(self, step: int) -> dict:
        per_epoch = len(self.sampler)
        if per_epoch == 0:
            raise ValueError(
                "rc3: the parallel-text loader is empty (XTCL needs parallel captions)"
            )
        epoch, position = divmod(step, per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(self.sampler)
        return self.collate(self.dataset[self._order[position]])
