"""``cl2cm``: CL2CM, cross-lingual to cross-modal knowledge transfer (spec docs/specs/cl2cm.md).

Trained on triples (image v_i, English caption s_i, its machine translation t_i). One multilingual
text encoder G reads both captions; it is both halves of the cross-lingual (CL) network and the
text tower of the cross-modal (CM) network. Per batch, in the paper's order:

1. CL sentence level: InfoNCE between the [CLS] states of s and t (``L_cl_inst``).
2. CL word level: the token-to-token softmax of each (s_b, t_b) is supervised by pseudo-labels, an
   entropic optimal-transport plan thresholded at its mean (``L_word``), or attention as ablation.
3. CM instance level: InfoNCE between images and target captions (``L_cm_inst``).
4. Knowledge transfer: KL between the row softmaxes of the CM similarities (image i -> target j)
   and the teacher's (source i -> target j, a mix of [CLS] cosine and word max-sim), Eq. 15
   (``L_ckt``); the teacher side carries no gradient.

``L = α·L_cm_inst + (1 − α)·L_ckt + L_cl_inst + L_word``, one optimizer, joint training. Inference
is the CM network alone: a dual encoder (image encoder; G + text head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn

from ccr.datamodules.triples import triple_dataloader
from ccr.methods.base import DEFAULT_PROTOCOL, RetrievalModule, Stage
from ccr.methods.cl2cm.cross_lingual import (
    gather_padded,
    maxsim_word_similarity,
    relational_kd_loss,
    teacher_similarity,
    word_align_loss,
    word_mask,
)
from ccr.methods.cl2cm.optimal_transport import (
    attention_pseudo_labels,
    ot_pseudo_labels,
    sinkhorn_plan,
)
from ccr.methods.layers.batches import trim_padding
from ccr.methods.layers.contrastive import LearnableTemperature, info_nce
from ccr.methods.layers.distributed import gather_with_grad
from ccr.methods.layers.encoders import ImageEncoder, TextEncoder, TextOutput
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.layers.heads import ProjectionHead
from ccr.methods.registry import register

PSEUDO_LABELS = ("ot", "attention")


def resolve_settings(method) -> OmegaConf:
    """The method config with the switches of ``method.ablation`` (a key of ``method.ablations``,
    or null for the full model) applied on top."""
    ablation = method.get("ablation")
    table = method.ablations
    if ablation is not None and ablation not in table:
        raise ValueError(
            f"cl2cm ablation {ablation!r} (method.ablation, from variant=) is not one of "
            f"{sorted(table)}; to label a run freely set method.ablation=null or one of them"
        )
    overrides = table[ablation] if ablation is not None else {}
    settings = OmegaConf.merge(method, overrides)
    if settings.pseudo_label not in PSEUDO_LABELS:
        raise ValueError(f"method.pseudo_label {settings.pseudo_label!r}: expected {PSEUDO_LABELS}")
    return settings


@register("cl2cm")
class CL2CM(RetrievalModule):
    """Image encoder (+ a linear head when its width is not ``embed_dim``), the shared multilingual
    text encoder G and the CM text head Linear(H -> embed_dim); τ_n for both InfoNCE terms.

    With ``optim.grad_cache_chunks`` > 1 the image pass and both caption passes run in that many
    micro-batches (``encode_in_chunks``); every loss term still sees the whole batch."""

    supports_grad_cache = True

    @classmethod
    def check_config(cls, method, languages: list[str], protocol: str = DEFAULT_PROTOCOL) -> None:
        resolve_settings(method)  # the ablation's name and its switches

    def __init__(self, method, optim, data, evaluation):
        super().__init__(method, optim, data, evaluation)
        self.settings = resolve_settings(self.method_cfg)
        cfg, data = self.settings, self.data_info
        self.image_encoder = ImageEncoder.from_config(cfg.image_encoder, data)
        self.text_encoder = TextEncoder.from_config(cfg.text_encoder, data)
        width = self.image_encoder.out_dim
        self.image_head = (
            nn.Identity()
            if width == cfg.embed_dim
            else ProjectionHead(width, cfg.embed_dim, normalize=False)
        )
        self.text_head = ProjectionHead(self.text_encoder.out_dim, cfg.embed_dim, normalize=False)
        self.temperature = LearnableTemperature(**cfg.temperature)

    # ---- the CM network: inference --------------------------------------------------------------

    def encode_images(self, images: Tensor) -> Tensor:
        return F.normalize(self.image_head(self.image_encoder(images)[:, 0]), dim=-1)

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """At the batch's own width: trimming would let a caption's embedding follow the rounding
        of a shape its batch neighbours chose."""
        return self.text_features(self.text_encoder(input_ids, attention_mask))

    def text_features(self, text: TextOutput) -> Tensor:
        """f^t: the text head on G's [CLS] state, L2-normalised."""
        return F.normalize(self.text_head(text.pooled), dim=-1)

    # ---- training -------------------------------------------------------------------------------

    def losses(self, batch: dict) -> dict[str, Tensor]:
        """Every enabled loss term of one batch of triples (keys as logged under ``loss/``)."""
        cfg = self.settings
        tau_n = self.temperature()
        chunks = self.grad_cache_chunks
        target = encode_in_chunks(
            self.text_encoder,
            *trim_padding(batch["tgt_input_ids"], batch["tgt_attention_mask"]),
            chunks=chunks,
        )
        f_t = self.text_features(target)
        f_v = encode_in_chunks(self.encode_images, batch["images"], chunks=chunks)
        losses = {"cm_inst": info_nce(f_v, f_t, tau_n)}
        if not (cfg.use_cl_inst or cfg.use_word_align or cfg.use_ckt):
            return losses  # the baseline: the CM network alone
        source = encode_in_chunks(
            self.text_encoder,
            *trim_padding(batch["src_input_ids"], batch["src_attention_mask"]),
            chunks=chunks,
        )
        ws, wt = word_mask(source.mask), word_mask(target.mask)
        hs, ht = F.normalize(source.states, dim=-1), F.normalize(target.states, dim=-1)
        cls_s, cls_t = F.normalize(source.pooled, dim=-1), F.normalize(target.pooled, dim=-1)
        if cfg.use_cl_inst:
            losses["cl_inst"] = info_nce(cls_s, cls_t, tau_n)
        if cfg.use_word_align:
            losses["word"] = self.word_loss(source, target, hs, ht, ws, wt)
        if cfg.use_ckt:
            student = f_v @ gather_with_grad(f_t).t()
            with torch.no_grad():
                teacher = self.teacher_similarity(cls_s, cls_t, hs, ht, ws, wt)
            losses["ckt"] = relational_kd_loss(
                student, teacher, cfg.kd_temperature, cfg.kl_direction
            )
        return losses

    def word_loss(
        self, source: TextOutput, target: TextOutput, hs: Tensor, ht: Tensor, ws: Tensor, wt: Tensor
    ) -> Tensor:
        """L_word: token cosines of each positive pair against their pseudo-labels."""
        cfg = self.settings
        similarity = torch.einsum("bmh,bnh->bmn", hs, ht)
        if cfg.pseudo_label == "ot":
            plan = sinkhorn_plan(
                similarity,
                ws,
                wt,
                epsilon=cfg.ot.epsilon,
                iterations=cfg.ot.iterations,
                variant=cfg.ot.variant,
                marginal_penalty=cfg.ot.marginal_penalty,
                partial_mass=cfg.ot.partial_mass,
            )
            labels, rows = ot_pseudo_labels(plan, ws, wt, cfg.word_label_norm)
        else:
            labels, rows = attention_pseudo_labels(source.states, target.states, ws, wt)
        return word_align_loss(similarity, labels, rows, wt, cfg.word_temperature)

    def teacher_similarity(
        self, cls_s: Tensor, cls_t: Tensor, hs: Tensor, ht: Tensor, ws: Tensor, wt: Tensor
    ) -> Tensor:
        """S_cl [B, global B]: local source captions against every process's target captions."""
        cfg = self.settings
        sentence = cls_s @ gather_padded(cls_t).t()
        word = None
        if cfg.ckt_levels == "word" or (
            cfg.ckt_levels == "sent+word" and cfg.sentence_weight != 1.0
        ):
            word = maxsim_word_similarity(
                hs, gather_padded(ht, tokens=True), ws, gather_padded(wt, tokens=True)
            )
        return teacher_similarity(sentence, word, cfg.ckt_levels, cfg.sentence_weight)

    def total_loss(self, losses: dict[str, Tensor]) -> Tensor:
        """α·L_cm_inst + (1 − α)·L_ckt with the transfer on (L_cm_inst alone without it), plus the
        CL terms that are on."""
        alpha = self.settings.alpha
        if "ckt" in losses:
            total = alpha * losses["cm_inst"] + (1.0 - alpha) * losses["ckt"]
        else:
            total = losses["cm_inst"]
        return total + sum(losses[k] for k in ("cl_inst", "word") if k in losses)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        losses = self.losses(batch)
        total = self.total_loss(losses)
        size = len(batch["images"])
        for name, value in {**losses, "total": total}.items():
            self.log(f"loss/{name}", value.detach(), batch_size=size)
        return total

    @classmethod
    def pipeline(
        cls, method, optim, data, evaluation, protocol: str = DEFAULT_PROTOCOL
    ) -> list[Stage]:
        """One stage trained on triples (image, source caption, translation), under every
        protocol."""
        targets = method.target_languages
        targets = list(targets) if targets is not None else None
        return [
            Stage(
                "main",
                build=lambda previous: cls(method, optim, data, evaluation),
                dataloader=lambda dm: triple_dataloader(dm, method.source_language, targets),
            )
        ]
