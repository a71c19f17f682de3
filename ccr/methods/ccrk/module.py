"""``ccrk``: 1-to-K contrastive pre-training for cross-lingual cross-modal retrieval (KDD 2024).

Each image is trained together with its captions in all K languages (spec docs: ``docs/ccrk.md``,
full spec ``docs/specs/ccrk.md``). Per step, in the paper's order:

1. **KCL** (§3.1): the 1-to-K contrastive loss over the (global) batch — image→text with soft target
   1/K over all B·K captions, text→image InfoNCE over the B images.
2. **Hard sampling** (§3.2): without gradient, from the same features, one hard positive caption
   per image (the language the image matches worst is likeliest) plus a hard negative caption and a
   hard negative image.
3. **MITM** (§3.3): image–text matching on the fusion encoder's [CLS] over the 3B pairs.
4. **CMLM** (§3.4): masked LM on the hard positive caption, fused with its image.
5. **Total** (Eq. 6): the plain sum of the terms.

Retrieval ranks by the dual-encoder cosine; with ``evaluation.rerank_k > 0`` each query's top-k is
re-scored by the fusion encoder and ITM head (§5), and with ``evaluation.scorer=cross_encoder`` every
pair is (w/o CL), both through ``ccr/methods/layers/cross_encoder_scoring.py``.

Ablations (spec §3.5, paper Table 2 / Fig. 5) are named in ``method.ablations`` and selected with
``variant=<name>``, which also names the leaderboard row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor

from ccr.methods.base import DEFAULT_PROTOCOL, RetrievalModule
from ccr.methods.ccrk.fusion_init import fusion_from_hf_layers
from ccr.methods.ccrk.hard_sampling import (
    HardSamples,
    draw_positive_text,
    matching_loss,
    sample_hard_examples,
)
from ccr.methods.ccrk.one_to_k import one_to_k_loss
from ccr.methods.layers.contrastive import LearnableTemperature
from ccr.methods.layers.encoders import ImageEncoder, TextEncoder, TextOutput, keep_layers
from ccr.methods.layers.fusion import FusionEncoder
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.layers.heads import ITMHead, MLMHead, ProjectionHead
from ccr.methods.layers.length_buckets import length_buckets, merge_buckets
from ccr.methods.layers.masking import IGNORE_INDEX, mask_tokens
from ccr.methods.registry import register

CONTRASTIVE = ("one_to_k", "one_to_one", "none")
RERANK_SCORES = ("prob", "logit")


def resolve_settings(method) -> Any:
    """The method config with the switches of ``method.ablation`` (a key of ``method.ablations``,
    or null for the full model) merged on top; impossible combinations are errors."""
    ablation = method.get("ablation")
    table = method.get("ablations") or {}
    if ablation is not None and ablation not in table:
        raise ValueError(
            f"ccrk ablation {ablation!r} (method.ablation, from variant=) is not one of "
            f"{sorted(table)}; to label a run freely set method.ablation=null"
        )
    settings = OmegaConf.merge(method, table[ablation] if ablation is not None else {})
    for key, allowed in (("contrastive", CONTRASTIVE), ("rerank_score", RERANK_SCORES)):
        if settings[key] not in allowed:
            raise ValueError(f"method.{key}: expected one of {allowed}, got {settings[key]!r}")
    if settings.contrastive == "none" and not settings.use_fusion:
        raise ValueError(
            "method.contrastive=none with method.use_fusion=false leaves no loss to train"
        )
    return settings


UPPER = "upper"


def seed_layer_indices(choice: Any, fusion_layers: int, text_layers: int) -> list[int]:
    """The text-model layers that seed the fusion layers: an explicit list (the paper: XLM-R-large
    13, 15, ..., 23), or ``upper``: the top ``fusion_layers`` layers in order, the lowest of them
    repeated when the text model has fewer (the world's 2-layer XLM-R seeds 2 fusion layers from
    layers 0 and 1; a 1-layer test world from layer 0 twice)."""
    if choice == UPPER:
        return [max(0, text_layers - fusion_layers + i) for i in range(fusion_layers)]
    indices = list(choice)
    if len(indices) != fusion_layers:
        raise ValueError(
            f"method.fusion: init_from_text_layers has {len(indices)} layers but "
            f"fusion.layers is {fusion_layers}"
        )
    return indices


def build_text_and_fusion(
    method: Any, data: Any, image_dim: int
) -> tuple[TextEncoder, FusionEncoder]:
    """The multilingual text encoder and the fusion encoder (text attends to image).

    With ``fusion.init_from_text_layers`` (a list of layers, or ``upper``: the default preset, as
    the reference code seeds its fusion from the text model's upper layers) each fusion layer
    starts from one layer of the loaded HF text model (self-attention and FFN copied, cross-
    attention new), before the text encoder keeps only ``text_encoder.layers``; the fusion then has
    the text model's heads (``fusion.heads`` null, or equal) and FFN width. ``null``: the fusion
    encoder starts random.
    """
    text_cfg = OmegaConf.to_container(OmegaConf.create(method.text_encoder), resolve=True)
    choice, heads = method.fusion.init_from_text_layers, method.fusion.heads
    keep = text_cfg.pop("layers", None) if choice is not None else None
    text = TextEncoder.from_config(text_cfg, data)
    hf_model = getattr(text.backbone, "model", None)
    if heads is None:
        if hf_model is None:
            raise ValueError(
                "method.fusion.heads=null takes the heads of an 'hf:' text encoder; "
                "set fusion.heads for this one"
            )
        heads = hf_model.config.num_attention_heads
    if choice is None:
        return text, FusionEncoder(
            text.out_dim, image_dim, layers=method.fusion.layers, heads=heads
        )
    if hf_model is None:
        raise ValueError(
            "method.fusion.init_from_text_layers needs an 'hf:' text encoder (the world's "
            "is one); set it to null for a randomly initialised fusion encoder"
        )
    hf_config = hf_model.config
    if heads != hf_config.num_attention_heads:
        raise ValueError(
            f"method.fusion.heads={heads}, but the text layers that seed the fusion have "
            f"{hf_config.num_attention_heads} heads; set fusion.heads to match (or null)"
        )
    indices = seed_layer_indices(choice, method.fusion.layers, len(hf_model.encoder.layer))
    fusion = fusion_from_hf_layers(
        [hf_model.encoder.layer[i] for i in indices],
        text.out_dim,
        image_dim,
        heads=heads,
        mlp_ratio=hf_config.intermediate_size / hf_config.hidden_size,
    )
    if keep is not None:
        keep_layers(hf_model, keep)
    return text, fusion


@register("ccrk")
class CCRk(RetrievalModule):
    """Image encoder, multilingual text encoder, fusion encoder, projection / ITM / MLM heads, τ.

    With ``optim.grad_cache_chunks`` > 1 every encoder pass of a training step (image, captions,
    fusion, masked captions) runs in that many micro-batches (``encode_in_chunks``); KCL, hard
    sampling, MITM and CMLM still see the whole batch."""

    supports_grad_cache = True

    @classmethod
    def check_config(cls, method, languages: list[str], protocol: str = DEFAULT_PROTOCOL) -> None:
        resolve_settings(method)  # the ablation's name and its switches

    def __init__(self, method, optim, data, evaluation):
        super().__init__(method, optim, data, evaluation)
        self.method_cfg = resolve_settings(self.method_cfg)
        method, data = (
            self.method_cfg,
            self.data_info,
        )  # normalised by the base (checkpoints store dicts)
        if (
            method.contrastive == "none"
            and self.eval_cfg.rerank_k == 0
            and not self.scores_every_pair
        ):
            raise ValueError(
                "method.contrastive=none (w/o CL) ranks every candidate by ITM: set "
                "evaluation.scorer=cross_encoder (or, as runs before it did, evaluation.rerank_k "
                "to at least the number of candidates)"
            )
        if not method.use_fusion and (self.eval_cfg.rerank_k > 0 or self.scores_every_pair):
            raise ValueError(
                "method.use_fusion=false (pure contrastive) has no ITM head to score pairs with: "
                "set evaluation.rerank_k=0 and evaluation.scorer=embeddings"
            )
        self.image_encoder = ImageEncoder.from_config(method.image_encoder, data)
        self.text_encoder, fusion = build_text_and_fusion(method, data, self.image_encoder.out_dim)
        width = self.text_encoder.out_dim
        self.vision_proj = ProjectionHead(self.image_encoder.out_dim, method.embed_dim)
        self.text_proj = ProjectionHead(width, method.embed_dim)
        if method.use_fusion:  # pure contrastive (false): no fusion encoder, ITM or MLM head at all
            self.fusion = fusion
            self.itm_head = ITMHead(width)
            embeddings = self.text_encoder.input_embeddings()
            self.mlm_head = MLMHead(
                width,
                embeddings.num_embeddings,
                tie_to=embeddings if method.mlm.tie_to_embeddings else None,
            )
        self.temperature = LearnableTemperature(**method.temperature)
        self.special_token_ids = (
            data.pad_token_id,
            data.cls_token_id,
            data.eos_token_id,
            data.mask_token_id,
        )

    # ---- dual encoder (retrieval embeddings) ---------------------------------------------------

    def encode_images(self, images: Tensor) -> Tensor:
        return self.vision_proj(self.image_encoder(images)[:, 0])

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """One padded call, no length buckets: a caption's embedding must not follow the rounding
        of the shapes its batch neighbours put it in."""
        return self.text_proj(self.text_encoder(input_ids, attention_mask).pooled)

    def encode_captions(self, input_ids: Tensor, attention_mask: Tensor) -> TextOutput:
        """Text encoder over length buckets (see ``length_buckets``)."""
        order, groups = length_buckets(attention_mask, self.method_cfg.length_buckets)
        outputs = [
            self.text_encoder(input_ids[rows, :size], attention_mask[rows, :size])
            for rows, size in groups
        ]
        states = merge_buckets([out.states for out in outputs], order, input_ids.shape[1])
        pooled = torch.cat([out.pooled for out in outputs])[order.argsort()]
        return TextOutput(states=states, pooled=pooled, mask=attention_mask.bool())

    def fuse(self, text_states: Tensor, text_mask: Tensor, image_states: Tensor) -> Tensor:
        """Fusion encoder (caption tokens attend to all image tokens), over length buckets."""
        order, groups = length_buckets(text_mask, self.method_cfg.length_buckets)
        parts = [
            self.fusion(text_states[rows, :size], text_mask[rows, :size], image_states[rows])
            for rows, size in groups
        ]
        return merge_buckets(parts, order, text_states.shape[1])

    def _chunked_fuse(self, text_states: Tensor, text_mask: Tensor, image_states: Tensor) -> Tensor:
        """``fuse`` in ``optim.grad_cache_chunks`` micro-batches (training)."""
        return encode_in_chunks(
            self.fuse, text_states, text_mask, image_states, chunks=self.grad_cache_chunks
        )

    # ---- training --------------------------------------------------------------------------------

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        images = batch["images"]
        batch_size, languages, length = batch["input_ids"].shape
        input_ids = batch["input_ids"].reshape(
            batch_size * languages, length
        )  # image-major rows j*K + k
        attention_mask = batch["attention_mask"].reshape(batch_size * languages, length).clone()
        attention_mask[:, 0] = (
            1  # an absent caption (all padding) still attends to one token; no loss uses it
        )
        present = batch["present"].reshape(-1).bool()
        self.temperature.clamp_()  # [ref]: τ is put back into its bounds before every forward pass

        chunks = self.grad_cache_chunks
        image_states = encode_in_chunks(self.image_encoder, images, chunks=chunks)
        text = encode_in_chunks(self.encode_captions, input_ids, attention_mask, chunks=chunks)
        image_feat, text_feat = self.vision_proj(image_states[:, 0]), self.text_proj(text.pooled)
        temperature = self.temperature()

        losses = {}
        if self.method_cfg.contrastive != "none":  # w/o CL drops it
            losses["kcl"] = self.contrastive_loss(image_feat, text_feat, temperature, present)
        if self.method_cfg.use_fusion:  # pure contrastive drops MITM and CMLM
            samples = sample_hard_examples(
                image_feat, text_feat, temperature, self.method_cfg.hard_mining, present
            )
            losses["mitm"] = self.matching_loss(
                text.states,
                text.mask,
                image_states,
                image_feat,
                text_feat,
                temperature,
                present,
                samples,
            )
            losses["cmlm"] = self.masked_lm_loss(
                input_ids, attention_mask, image_states, present, samples
            )
        total = sum(losses.values())  # Eq. 6: unweighted sum

        self.log_dict(
            {f"train/{name}": value.detach() for name, value in losses.items()},
            batch_size=batch_size,
        )
        self.log("train/temperature", temperature.detach(), batch_size=batch_size)
        self.log(
            "train/absent_captions", (~present).sum().float(), batch_size=batch_size
        )  # no host read
        return total

    def contrastive_loss(
        self, image_feat: Tensor, text_feat: Tensor, temperature: Tensor, present: Tensor
    ) -> Tensor:
        """KCL over all K captions, or (w/o KCL) 1-to-1 InfoNCE on one uniformly drawn language."""
        cfg = self.method_cfg
        if cfg.contrastive == "one_to_one":
            rows = draw_positive_text(present.view(len(image_feat), -1).float())
            terms = one_to_k_loss(
                image_feat, text_feat[rows], temperature, weighting=cfg.kcl_weighting
            )
        else:
            terms = one_to_k_loss(
                image_feat, text_feat, temperature, present, weighting=cfg.kcl_weighting
            )
        self.log_dict(
            {"train/kcl_i2t": terms.i2t.detach(), "train/kcl_t2i": terms.t2i.detach()},
            batch_size=len(image_feat),
        )
        return terms.total

    def matching_loss(
        self,
        text_states: Tensor,
        text_mask: Tensor,
        image_states: Tensor,
        image_feat: Tensor,
        text_feat: Tensor,
        temperature: Tensor,
        present: Tensor,
        samples: HardSamples,
    ) -> Tensor:
        """MITM on the hard samples, or (w/o H-MITM) on uniformly drawn positives and negatives."""
        if not self.method_cfg.hard_mitm:
            samples = sample_hard_examples(image_feat, text_feat, temperature, "uniform", present)
        return matching_loss(
            self._chunked_fuse, self.itm_head, text_states, text_mask, image_states, samples
        ).loss

    def masked_lm_loss(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        image_states: Tensor,
        present: Tensor,
        samples: HardSamples,
    ) -> Tensor:
        """CMLM: mask the hard positive caption (or, w/o H-CMLM, a uniformly drawn language), re-encode
        it, fuse it with its image and predict the original tokens at the masked positions."""
        if self.method_cfg.hard_cmlm:
            rows = samples.positive_text
        else:
            rows = draw_positive_text(present.view(len(image_states), -1).float())
        masked = mask_tokens(
            input_ids[rows],
            attention_mask[rows],
            self.data_info.mask_token_id,
            self.mlm_head.decoder.out_features,
            self.special_token_ids,
            self.method_cfg.mlm.mask_probability,
        )
        text = encode_in_chunks(
            self.encode_captions,
            masked.input_ids,
            attention_mask[rows],
            chunks=self.grad_cache_chunks,
        )
        fused = self._chunked_fuse(text.states, text.mask, image_states)
        selected = masked.labels != IGNORE_INDEX
        logits = self.mlm_head(fused[selected])
        return F.cross_entropy(logits.float(), masked.labels[selected])

    def lr_scales(self) -> dict[str, float]:
        """Newly initialised parts (cross-attention, projections, ITM head, τ; the whole fusion
        encoder when it is not seeded from text layers) train at ``new_param_lr_scale`` × lr
        ([ref]: 2× when the encoders are pretrained)."""
        scale = self.method_cfg.new_param_lr_scale
        prefixes = ["vision_proj", "text_proj", "itm_head", "temperature"]
        if self.method_cfg.use_fusion and self.method_cfg.fusion.init_from_text_layers is None:
            prefixes.append("fusion")  # a random fusion encoder is new as a whole
        elif self.method_cfg.use_fusion:
            prefixes += [
                f"fusion.layers.{i}.{part}"
                for i in range(len(self.fusion.layers))
                for part in ("cross_attn", "norm_cross")
            ]
        return {prefix: scale for prefix in prefixes}

    # ---- evaluation: the cross-encoder (ITM re-ranking, every pair) ------------------------------

    def image_cache(self, images: Tensor) -> Tensor:
        """Image token states, the keys/values the fusion encoder attends to."""
        return self.image_encoder(images)

    def text_cache(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        """Token ids and masks; the scored captions are encoded block by block when scoring."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def cross_encoder(
        self, image_cache: Tensor, text_cache: Mapping[str, Tensor]
    ) -> FusionScorer | None:
        if not self.method_cfg.use_fusion:
            return None
        return FusionScorer(
            self, image_cache, text_cache["input_ids"], text_cache["attention_mask"]
        )

    @torch.no_grad()
    def match_scores(
        self, image_states: Tensor, input_ids: Tensor, attention_mask: Tensor
    ) -> Tensor:
        """ITM score of each (image, caption) pair (see ``fused_scores``), the captions encoded here."""
        text = self.encode_captions(input_ids, attention_mask)
        return self.fused_scores(image_states, text.states, text.mask)

    @torch.no_grad()
    def fused_scores(self, image_states: Tensor, text_states: Tensor, text_mask: Tensor) -> Tensor:
        """ITM score of each (image, encoded caption) pair, for ranking: the match probability (as
        its log-odds) or the raw match logit ([ref]).

        ``prob`` returns logit[1] − logit[0], whose order is exactly that of softmax(logits)[1]: the
        float32 probability itself rounds to 1.0 beyond log-odds ≈ 17, which a confident head reaches
        for the gold and its near misses alike, and the tied candidates then share their ranks.
        """
        logits = self.itm_head(self.fuse(text_states, text_mask, image_states)[:, 0]).float()
        return (
            logits[:, 1] - logits[:, 0] if self.method_cfg.rerank_score == "prob" else logits[:, 1]
        )


class FusionScorer:
    """CCRk's cross-encoder as a ``PairScorer``: a block of captions goes through the text encoder
    once, each pair through the fusion encoder and ITM head."""

    def __init__(
        self, module: CCRk, image_states: Tensor, input_ids: Tensor, attention_mask: Tensor
    ):
        self.module, self.image_states = module, image_states
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.device = image_states.device

    @torch.no_grad()
    def captions(self, index: Tensor) -> TextOutput:
        return self.module.encode_captions(self.input_ids[index], self.attention_mask[index])

    @torch.no_grad()
    def score(self, images: Tensor, block: TextOutput, rows: Tensor) -> Tensor:
        return self.module.fused_scores(
            self.image_states[images], block.states[rows], block.mask[rows]
        )
