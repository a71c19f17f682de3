"""``covlr``: coordinated cross-modal consistency and intra-modal structure by meta-optimisation.

CoVLR (spec ``docs/specs/covlr.md``, notes ``docs/covlr.md``). One training step, on one batch:

1. **Meta-train task** at Θ (§3.1): ℓ_cro = ℓ_itc + ℓ_mlm + ℓ_mpm. ITC is in-batch symmetric
   InfoNCE between the uni-modal global tokens (fixed τ); MLM predicts masked caption tokens from
   the image-to-text cross-modal encoder; MPM regresses masked visual tokens (stop-gradient targets)
   from the text-to-image cross-modal encoder.
2. **Virtual step** (§3.3): Θ' = Θ − α ∇_Θ ℓ_cro, one plain first-order gradient step on the
   uni-modal towers ℓ_uni reads (``virt``), written with ``torch.func.functional_call``.
3. **Meta-test task** at Θ' (§3.2): ℓ_uni = image term + text term; soft-label classification
   of the object labels (``cls``), or InfoNCE against augmented views inside each modality (``nce``).
4. **Update** (Eq. 7, first order): Θ gets ∇ℓ_cro(Θ) + ∇_{Θ'}ℓ_uni(Θ'), the heads their own task's
   gradient; one AdamW step (``ccr.methods.covlr.meta``: a single loss, automatic optimisation).

Labels (§3.2 ``cls``, Eq. 5): the classifiers predict the data's object *categories* by default
(``uni_labels: category``; the default world: the shape, its analogue of COCO's categories), or the
finer object labels (``object``; the world: colour × shape, which say most of what a caption says).

Multilingual (§7): each image is paired with a caption of one of its languages drawn per step; one
shared text encoder. ``cls``: the text classifier sees every present caption of the image; ``nce``:
a text's positive view is the image's caption in another language (token dropout without one).
Retrieval scores by the cosine of the ITC embeddings (dual encoder, §4.1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import Tensor, nn
from torch.func import functional_call

from ccr.methods.base import RetrievalModule
from ccr.methods.covlr.augment import drop_tokens, flip_and_translate
from ccr.methods.covlr.init_weights import bert_init_
from ccr.methods.covlr.intra_modal import soft_label_cross_entropy, view_info_nce
from ccr.methods.covlr.meta import meta_objective
from ccr.methods.covlr.patch_masking import mask_patches
from ccr.methods.covlr.towers import ImageTower, TextTower
from ccr.methods.layers.batches import sample_one_language, trim_padding
from ccr.methods.layers.contrastive import info_nce
from ccr.methods.layers.encoders import ImageEncoder, TextEncoder
from ccr.methods.layers.fusion import FusionEncoder
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.layers.heads import ProjectionHead
from ccr.methods.layers.length_buckets import length_buckets, merge_buckets
from ccr.methods.layers.masking import IGNORE_INDEX, mask_tokens
from ccr.methods.registry import register

UNI_MODES = ("auto", "cls", "nce")
UNI_TEXT_CAPTIONS = ("all", "drawn")
LABEL_LEVELS = ("category", "object")
PRECISIONS = ("32-true", "bf16-mixed")


def check_precision(precision: str) -> None:
    """Only fp32 and bf16-mixed: under 16-mixed the inner gradient would be taken from an unscaled
    fp16 loss (underflow) while the outer one is loss-scaled (spec §3.5)."""
    if str(precision) not in PRECISIONS:
        raise ValueError(
            f"covlr trains with trainer.precision in {PRECISIONS}, got {precision!r} "
            "(the virtual step needs unscaled gradients)"
        )


def resolve_settings(method) -> OmegaConf:
    """The method config with the switches of ``method.ablation`` (a key of ``method.ablations``,
    from ``variant=``; null: the full model) merged on top. A config stored before a key existed
    has it from the method's schema, at the behaviour it trained with (``uni_labels: object``;
    ``ccr/experiments/method_schema.py``)."""
    ablation = method.get("ablation")
    table = method.get("ablations") or {}
    if ablation is not None and ablation not in table:
        raise ValueError(
            f"covlr ablation {ablation!r} (method.ablation, from variant=) is not one of "
            f"{sorted(table)}; to label a run freely set method.ablation=null"
        )
    settings = OmegaConf.merge(method, table[ablation] if ablation is not None else {})
    if settings.uni_labels not in LABEL_LEVELS:
        raise ValueError(
            f"method.uni_labels: expected one of {LABEL_LEVELS}, got {settings.uni_labels!r}"
        )
    return settings


def label_classes(level: str, data) -> Tensor | None:
    """The 0/1 map ``[num_objects, C]`` from the data's object labels to the classifier's C
    classes (its categories, sorted by name), or None when the classes are the labels themselves."""
    if level == "object":
        return None
    categories = list(getattr(data, "object_categories", None) or [])
    if len(categories) != data.num_objects:
        raise ValueError(
            f"method.uni_labels=category needs the category of each of the data's "
            f"{data.num_objects} object labels (DataInfo.object_categories), got "
            f"{len(categories)}; use method.uni_labels=object (variant=objects)"
        )
    names = sorted(set(categories))
    rows = torch.arange(len(categories))
    columns = torch.tensor([names.index(category) for category in categories], dtype=torch.long)
    classes = torch.zeros(len(categories), len(names))
    classes[rows, columns] = 1.0
    return classes


def encode_in_buckets(
    tower, input_ids: Tensor, attention_mask: Tensor, buckets: int
) -> tuple[Tensor, Tensor]:
    """``tower(ids, mask) -> (states, pooled)`` over length groups (CCRk's ``length_buckets``): the
    same result as one padded call, without most pad tokens (captions average 20 of 48 tokens in
    the default world, ja/zh set the maximum). States come back ``[N, L, D]``, zero at padding."""
    order, groups = length_buckets(attention_mask, buckets)
    outputs = [tower(input_ids[rows, :size], attention_mask[rows, :size]) for rows, size in groups]
    states = merge_buckets([states for states, _ in outputs], order, input_ids.shape[1])
    return states, torch.cat([pooled for _, pooled in outputs])[order.argsort()]


def other_language(present: Tensor, chosen: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of ``present [B, K]``: a present language other than ``chosen`` drawn uniformly, and
    whether one exists (bool [B]); rows without one get ``chosen`` back."""
    others = present.bool().clone()
    others[torch.arange(len(chosen), device=chosen.device), chosen] = False
    has_other = others.any(1)
    weights = torch.where(has_other[:, None], others, F.one_hot(chosen, others.shape[1]).bool())
    return torch.multinomial(weights.float(), 1).squeeze(1), has_other


def sub_params(params: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries under ``prefix.`` with the prefix removed (keys relative to that submodule)."""
    start = len(prefix) + 1
    return {name[start:]: value for name, value in params.items() if name.startswith(prefix + ".")}


@dataclass
class TrainingView:
    """What both tasks read from one batch, drawn once per step (so ℓ_uni is deterministic).

    ``input_ids``/``attention_mask`` [B, L]: each image's caption in its drawn language.
    ``cls``: ``objects`` [B, C] the image's classes (``method.uni_labels``); ``captions``/
    ``caption_mask`` [N, L] every present caption and ``caption_objects`` [N, C] their image's. ``nce``: ``images_aug`` and ``positive_ids``/
    ``positive_mask`` [B, L] (the caption in another language, or a token-dropout copy)."""

    images: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    objects: Tensor | None = None
    captions: Tensor | None = None
    caption_mask: Tensor | None = None
    caption_objects: Tensor | None = None
    images_aug: Tensor | None = None
    positive_ids: Tensor | None = None
    positive_mask: Tensor | None = None


@register("covlr")
class CoVLR(RetrievalModule):
    """Image / text towers, two cross-modal encoders, ITC / MLM / MPM heads (Θ_cro), uni heads (Θ_uni).

    With ``optim.grad_cache_chunks`` > 1 every tower and cross-modal encoder pass of both tasks, at Θ
    and at Θ', runs in that many micro-batches (``encode_in_chunks``): the losses, the inner
    gradient and the virtual step are those of the whole batch."""

    supports_grad_cache = True

    def __init__(self, method, optim, data, evaluation):
        super().__init__(method, optim, data, evaluation)
        self.method_cfg = resolve_settings(self.method_cfg)
        cfg, data = self.method_cfg, self.data_info
        self.uni_mode = self._resolve_uni_mode(cfg.uni_mode, data.num_objects)
        classes = label_classes(cfg.uni_labels, data) if self.uni_mode == "cls" else None
        self.register_buffer("label_classes", classes, persistent=False)
        num_classes = data.num_objects if classes is None else classes.shape[1]
        if cfg.uni_text_captions not in UNI_TEXT_CAPTIONS:
            raise ValueError(
                f"method.uni_text_captions: expected one of {UNI_TEXT_CAPTIONS}, "
                f"got {cfg.uni_text_captions!r}"
            )
        width = cfg.d_model
        self.image_tower = ImageTower(ImageEncoder.from_config(cfg.image_encoder, data), width)
        self.text_tower = TextTower(TextEncoder.from_config(cfg.text_encoder, data), width)
        new: list[nn.Module] = [self.image_tower.adapter, self.text_tower.adapter]
        self.itc_image = ProjectionHead(width, cfg.embed_dim)
        self.itc_text = ProjectionHead(width, cfg.embed_dim)
        new += [self.itc_image, self.itc_text]
        cross = cfg.cross_modal
        if cfg.use_mlm:
            self.cross_i2t = FusionEncoder(width, width, layers=cross.layers, heads=cross.heads)
            self.mlm_head = nn.Linear(width, data.vocab_size)
            new += [self.cross_i2t, self.mlm_head]
        if cfg.use_mpm:
            self.cross_t2i = FusionEncoder(width, width, layers=cross.layers, heads=cross.heads)
            self.mpm_head = nn.Linear(width, width)
            self.mask_vector = nn.Parameter(torch.zeros(width))
            nn.init.trunc_normal_(self.mask_vector, std=0.02, a=-0.04, b=0.04)
            new += [self.cross_t2i, self.mpm_head]
        if cfg.use_uni_img:
            self.image_uni_head = self._uni_head(width, cfg.embed_dim, num_classes)
            new.append(self.image_uni_head)
        if cfg.use_uni_txt:
            self.text_uni_head = self._uni_head(width, cfg.embed_dim, num_classes)
            new.append(self.text_uni_head)
        for module in new:
            bert_init_(module)
        self.special_token_ids = (
            data.pad_token_id,
            data.cls_token_id,
            data.eos_token_id,
            data.mask_token_id,
        )
        self._inner_grads: dict[str, Tensor] | None = None

    @staticmethod
    def _resolve_uni_mode(mode: str, num_objects: int) -> str:
        if mode not in UNI_MODES:
            raise ValueError(f"method.uni_mode: expected one of {UNI_MODES}, got {mode!r}")
        if mode == "auto":
            return "cls" if num_objects > 0 else "nce"
        if mode == "cls" and num_objects == 0:
            raise ValueError(
                "method.uni_mode=cls needs object labels, but the data has none (use nce or auto)"
            )
        return mode

    def _uni_head(self, width: int, embed_dim: int, num_classes: int) -> nn.Module:
        """φ_cls: a linear classifier (``cls``); ψ: a projection with L2 output (``nce``)."""
        return (
            nn.Linear(width, num_classes)
            if self.uni_mode == "cls"
            else ProjectionHead(width, embed_dim)
        )

    def class_targets(self, objects: Tensor) -> Tensor:
        """The batch's multi-hot object labels ``[B, num_objects]`` as multi-hot classes ``[B, C]``
        (an image holding two objects of one category has that category once)."""
        if self.label_classes is None:
            return objects
        return (
            (objects.to(self.label_classes.dtype) @ self.label_classes)
            .clamp(max=1)
            .to(objects.dtype)
        )

    # ---- parameter groups (spec §2.2) -------------------------------------------------------------

    def parameter_groups(self) -> dict[str, list[str]]:
        """Top-level name prefixes of Θ (``shared``), Θ_cro, Θ_uni, and ``virt`` ⊂ Θ: the towers ℓ_uni
        reads, which the virtual step moves."""
        present = {name.split(".")[0] for name, _ in self.named_parameters()}
        groups = {
            "shared": ["image_tower", "text_tower", "cross_i2t", "cross_t2i"],
            "cro": ["itc_image", "itc_text", "mlm_head", "mpm_head", "mask_vector"],
            "uni": ["image_uni_head", "text_uni_head"],
        }
        groups = {key: [p for p in prefixes if p in present] for key, prefixes in groups.items()}
        cfg = self.method_cfg
        groups["virt"] = [
            tower
            for tower, read in (("image_tower", cfg.use_uni_img), ("text_tower", cfg.use_uni_txt))
            if read
        ]
        return groups

    def virtual_parameter_names(self) -> list[str]:
        """Names of the trainable parameters the virtual step moves."""
        prefixes = tuple(f"{tower}." for tower in self.parameter_groups()["virt"])
        return [
            n
            for n, p in self.named_parameters()
            if p.requires_grad and prefixes and n.startswith(prefixes)
        ]

    def lr_scales(self) -> dict[str, float]:
        """Everything but the (pretrained) encoders trains at ``new_param_lr_scale`` x lr (spec §5)."""
        scale = self.method_cfg.new_param_lr_scale
        groups = self.parameter_groups()
        prefixes = [
            "image_tower.adapter",
            "text_tower.adapter",
            "cross_i2t",
            "cross_t2i",
            *groups["cro"],
            *groups["uni"],
        ]
        return {prefix: scale for prefix in prefixes}

    # ---- dual encoder (retrieval embeddings) ---------------------------------------------------

    def encode_images(self, images: Tensor) -> Tensor:
        return self.itc_image(self.image_tower(images)[:, 0])

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """One padded call, no length buckets (as CCRk's)."""
        return self.itc_text(self.text_tower(input_ids, attention_mask)[1])

    def encode_text(
        self, tower, input_ids: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``tower`` (the text tower, or a functional call of it) over length buckets."""
        return encode_in_buckets(tower, input_ids, attention_mask, self.method_cfg.length_buckets)

    def chunked(self, encode, *inputs: Tensor):
        """``encode(*inputs)`` in ``optim.grad_cache_chunks`` micro-batches (training)."""
        return encode_in_chunks(encode, *inputs, chunks=self.grad_cache_chunks)

    def chunked_text(
        self, tower, input_ids: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``encode_text`` in ``optim.grad_cache_chunks`` micro-batches (training)."""
        return self.chunked(
            lambda ids, mask: self.encode_text(tower, ids, mask), input_ids, attention_mask
        )

    # ---- training --------------------------------------------------------------------------------

    def on_fit_start(self) -> None:
        check_precision(self.trainer.precision)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        cfg = self.method_cfg
        view = self.training_view(batch)
        cro_terms = self.cross_modal_losses(view)
        cro = sum(cro_terms.values())
        virtual = self.virtual_parameter_names()
        uni_terms: dict[str, Tensor] = {}

        def intra(theta: dict[str, Tensor]) -> Tensor:
            uni_terms.update(self.intra_modal_losses(view, theta))
            return sum(uni_terms.values())

        if not virtual:  # no intra-modal loss: pure consistency training
            loss = cro
        elif cfg.meta:
            step = meta_objective(
                cro,
                dict(self.named_parameters()),
                virtual,
                intra,
                cfg.meta_alpha,
                second_order=cfg.second_order,
            )
            loss, self._inner_grads = step.loss, step.inner_grads
        else:  # plain multi-task sum, same terms at Θ
            params = dict(self.named_parameters())
            loss = cro + intra({name: params[name] for name in virtual})
        batch_size = len(view.images)
        self.log_dict(
            {f"train/{k}": v.detach() for k, v in {**cro_terms, **uni_terms}.items()},
            batch_size=batch_size,
        )
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """Log cos(g_cro, g_uni) over the virtual parameters (spec §3.4); g_uni = merged − g_cro.
        Skipped under gradient accumulation, where .grad sums several batches."""
        inner, self._inner_grads = self._inner_grads, None
        if not inner or self.trainer.accumulate_grad_batches != 1:
            return
        params = dict(self.named_parameters())
        dot = cro_sq = uni_sq = torch.zeros((), device=self.device)
        for name, g_cro in inner.items():
            if params[name].grad is None:
                continue
            g_uni = params[name].grad.float() - g_cro.float()
            dot = dot + (g_cro.float() * g_uni).sum()
            cro_sq, uni_sq = cro_sq + g_cro.float().square().sum(), uni_sq + g_uni.square().sum()
        cosine = dot / (cro_sq.sqrt() * uni_sq.sqrt()).clamp(min=1e-12)
        self.log("train/grad_cosine", cosine)

    def training_view(self, batch: dict) -> TrainingView:
        """Draw this step's caption language and, per mode, the labels or the augmented views."""
        cfg = self.method_cfg
        ids, mask = trim_padding(batch["input_ids"], batch["attention_mask"])
        present = batch["present"].bool()
        rows = torch.arange(len(present), device=present.device)
        language = sample_one_language(present)
        view = TrainingView(
            images=batch["images"],
            input_ids=ids[rows, language],
            attention_mask=mask[rows, language],
        )
        if self.uni_mode == "cls":
            if "objects" not in batch:
                raise ValueError("covlr uni_mode=cls: the training batch has no 'objects' labels")
            view.objects = self.class_targets(batch["objects"])
            if cfg.use_uni_txt and cfg.uni_text_captions == "drawn":
                view.captions, view.caption_mask, view.caption_objects = (
                    view.input_ids,
                    view.attention_mask,
                    view.objects,
                )
            elif cfg.use_uni_txt:
                flat = present.reshape(-1)
                view.captions = ids.reshape(-1, ids.shape[-1])[flat]
                view.caption_mask = mask.reshape(-1, mask.shape[-1])[flat]
                view.caption_objects = view.objects.repeat_interleave(present.shape[1], dim=0)[flat]
            return view
        if cfg.use_uni_img:
            view.images_aug = flip_and_translate(
                view.images, cfg.nce.max_shift, cfg.nce.flip_probability
            )
        if cfg.use_uni_txt:
            other, has_other = other_language(present, language)
            dropped_ids, dropped_mask = drop_tokens(
                view.input_ids,
                view.attention_mask,
                self.special_token_ids,
                self.data_info.pad_token_id,
                cfg.nce.token_dropout,
            )
            view.positive_ids = torch.where(has_other[:, None], ids[rows, other], dropped_ids)
            view.positive_mask = torch.where(has_other[:, None], mask[rows, other], dropped_mask)
        return view

    def cross_modal_losses(self, view: TrainingView) -> dict[str, Tensor]:
        """The meta-train task at Θ: ITC (+ MLM, + MPM when switched on), §3.1."""
        cfg = self.method_cfg
        image_tokens = self.chunked(self.image_tower, view.images)
        text_states, text_pooled = self.chunked_text(
            self.text_tower, view.input_ids, view.attention_mask
        )
        losses = {
            "itc": info_nce(
                self.itc_image(image_tokens[:, 0]), self.itc_text(text_pooled), cfg.temperature
            )
        }
        if cfg.use_mlm:
            losses["mlm"] = self.masked_language_loss(view, image_tokens)
        if cfg.use_mpm:
            losses["mpm"] = self.masked_patch_loss(image_tokens, text_states, view.attention_mask)
        return losses

    def masked_language_loss(self, view: TrainingView, image_tokens: Tensor) -> Tensor:
        """Re-encode the masked caption, let it attend to the clean image tokens, predict the originals."""
        masked = mask_tokens(
            view.input_ids,
            view.attention_mask,
            self.data_info.mask_token_id,
            self.mlm_head.out_features,
            self.special_token_ids,
            self.method_cfg.mask_probability,
        )
        states = self.chunked_text(self.text_tower, masked.input_ids, view.attention_mask)[0]
        fused = self.chunked(self.cross_i2t, states, view.attention_mask, image_tokens)
        selected = masked.labels != IGNORE_INDEX
        return F.cross_entropy(self.mlm_head(fused[selected]).float(), masked.labels[selected])

    def masked_patch_loss(
        self, image_tokens: Tensor, text_states: Tensor, text_mask: Tensor
    ) -> Tensor:
        """Corrupt visual tokens, let them attend to the clean caption, regress the clean tokens."""
        masked = mask_patches(image_tokens, self.mask_vector, self.method_cfg.mask_probability)
        query_mask = torch.ones(masked.selected.shape, dtype=torch.bool, device=image_tokens.device)
        fused = self.chunked(self.cross_t2i, masked.tokens, query_mask, text_states, text_mask)
        prediction = self.mpm_head(fused[masked.selected]).float()
        return F.mse_loss(prediction, image_tokens.detach()[masked.selected].float())

    def intra_modal_losses(self, view: TrainingView, theta: dict[str, Tensor]) -> dict[str, Tensor]:
        """The meta-test task with the towers' parameters ``theta`` (Θ' or Θ), §3.2."""
        cfg = self.method_cfg
        losses = {}
        if cfg.use_uni_img:
            image_params = sub_params(theta, "image_tower")

            def image_tower(images: Tensor) -> Tensor:
                return functional_call(self.image_tower, image_params, (images,))

            if self.uni_mode == "cls":
                tokens = self.chunked(image_tower, view.images)
                losses["uni_img"] = soft_label_cross_entropy(
                    self.image_uni_head(tokens[:, 0]), view.objects
                )
            else:
                both = self.chunked(image_tower, torch.cat([view.images, view.images_aug]))
                anchors, views = self.image_uni_head(both[:, 0]).chunk(2)
                losses["uni_img"] = view_info_nce(anchors, views, cfg.temperature)
        if cfg.use_uni_txt:
            text_params = sub_params(theta, "text_tower")

            def tower(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
                return functional_call(self.text_tower, text_params, (ids, mask))

            if self.uni_mode == "cls":
                pooled = self.chunked_text(tower, view.captions, view.caption_mask)[1]
                losses["uni_txt"] = soft_label_cross_entropy(
                    self.text_uni_head(pooled), view.caption_objects
                )
            else:
                ids = torch.cat([view.input_ids, view.positive_ids])
                mask = torch.cat([view.attention_mask, view.positive_mask])
                pooled = self.chunked_text(tower, ids, mask)[1]
                anchors, views = self.text_uni_head(pooled).chunk(2)
                losses["uni_txt"] = view_info_nce(anchors, views, cfg.temperature)
        return losses
