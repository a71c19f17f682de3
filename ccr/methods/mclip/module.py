"""``mclip``: mCLIP (ACL 2023), triangle cross-modal knowledge distillation from a frozen English
CLIP into a frozen multilingual text encoder (MTE) through two small trainable projectors.

A pipeline of up to four resumable stages (``method.stages``), each built from the previous one's
checkpoint so that a stage needs nothing but that file:

* ``teacher``: the suite's ``clip`` baseline trained on English captions only. Without this stage
  the teacher is an open_clip model by name and pretrained tag or local checkpoint.
* ``mte_nmt`` (Stage 1a) and ``mte_ctl`` (Stage 1b): the MTE enhanced on parallel text
  (:class:`ccr.methods.mclip.translation.MTEEnhancement`); the teacher is carried along unchanged.
* ``trikd`` (Stage 2): :class:`MCLIP`, which trains only the shared CLIP-projector, the
  X-projector and the ITC temperature, and is the module evaluated.
* ``finetune`` (spec §5 settings 2-4), run after TriKD exactly when the run's ``protocol`` is
  ``fine-tune-<language>`` or ``fine-tune-all``: the same module and trainable parts, the
  multi-positive contrastive loss, the ITC temperature restarted. The protocol a run records is
  therefore what ran.

``method.variant`` (the run's ``variant``) selects an ablation of the paper's Table 2
(:data:`ABLATIONS`); ``method.recall_mode: dedup`` adds the reference code's recall
(``ccr.metrics.dedup``) to the report.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from timm.optim import Lamb
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR

from ccr.methods.base import DEFAULT_PROTOCOL, RetrievalModule, Stage, load_state
from ccr.methods.clip.module import CLIPModule
from ccr.methods.layers.batches import trim_padding
from ccr.methods.layers.distributed import row_layout
from ccr.methods.layers.encoders import (
    OpenClipText,
    OpenClipVisionTokens,
    TextEncoder,
    build_open_clip,
    resolve_world,
)
from ccr.methods.layers.grad_cache import encode_in_chunks
from ccr.methods.layers.optim import param_groups
from ccr.methods.mclip.distillation import (
    clamped_logit_scale,
    fixed_ttc_temperature,
    freeze,
    multi_positive_info_nce,
    trikd_loss,
)
from ccr.methods.mclip.translation import (
    MTEEnhancement,
    TranslationDecoder,
    clip_gradient_norm,
    inverse_sqrt_factor,
)
from ccr.methods.registry import register
from ccr.metrics import RetrievalEvaluation
from ccr.metrics.dedup import DedupRecallEvaluation

STAGES = ("teacher", "mte_nmt", "mte_ctl", "trikd")
STAGE_ONE = ("mte_nmt", "mte_ctl")
FINETUNE = "finetune"
ENGLISH = "en"
INITIAL_LR = 1e-7  # where every warm-up starts (spec §6)
RECALL_MODES = {"standard": RetrievalEvaluation, "dedup": DedupRecallEvaluation}


@dataclass(frozen=True)
class Ablation:
    """What an mCLIP variant keeps (spec Table 2): the Stage-1 sub-stages that run, and the loss
    terms of Stage 1 (NMT, CTL) and TriKD (ITC, TTC)."""

    stage_one: tuple[str, ...] = STAGE_ONE
    nmt: bool = True
    ctl: bool = True
    itc: bool = True
    ttc: bool = True


ABLATIONS = {
    "full": Ablation(),
    "no_ctl": Ablation(ctl=False),  # - L_CTL: the MTE enhanced by NMT only
    "no_nmt": Ablation(stage_one=("mte_ctl",), nmt=False),  # - L_NMT: XLM-R tuned by CTL only
    "no_stage1": Ablation(stage_one=()),  # - L_theta: the MTE as it comes
    "no_stage1_no_ttc": Ablation(stage_one=(), ttc=False),  # - L_theta - L_TTC
    "no_stage1_no_itc": Ablation(stage_one=(), itc=False),  # - L_theta - L_ITC
}


def ablation_of(method) -> Ablation:
    """The variant's switches; ``method.variant`` null means the full model."""
    name = method.get("variant") or "full"
    if name not in ABLATIONS:
        raise ValueError(
            f"mclip variant {name!r} (method.variant, from variant=) is not one of "
            f"{sorted(ABLATIONS)}"
        )
    return ABLATIONS[name]


@dataclass(frozen=True)
class Protocol:
    """How an mCLIP run is trained, from the run's ``protocol`` (handed to the method at build
    time: ``pipeline``, ``check_config``)."""

    name: str
    finetune_languages: tuple[str, ...] = ()  # empty: no fine-tuning stage
    finetune_settings: str | None = None  # which block of method.finetune (english|single|all)


def protocol_of(name: str, method, languages: list[str]) -> Protocol:
    """``zero-shot`` (TriKD on English only), ``translate-train`` (TriKD also on other languages),
    ``fine-tune-<language>`` (spec settings 2-3: fine-tune on that language's training captions)
    or ``fine-tune-all`` (setting 4: on every configured language). Fine-tuning starts from an
    English-only TriKD, so a label never hides non-English TriKD data."""
    trikd_languages = list(method.trikd.languages)
    english_only = trikd_languages == [ENGLISH]
    allowed = [
        "zero-shot",
        "translate-train",
        "fine-tune-all",
        *(f"fine-tune-{lang}" for lang in languages),
    ]
    if name not in allowed:
        raise ValueError(f"mclip protocol {name!r} (protocol=) is not one of {allowed}")
    if name == "translate-train" and english_only:
        raise ValueError(
            "protocol translate-train needs non-English method.trikd.languages, "
            f"got {trikd_languages}"
        )
    if name != "translate-train" and not english_only:
        raise ValueError(
            f"protocol {name} trains TriKD on English only; method.trikd.languages "
            f"is {trikd_languages} (that is protocol=translate-train)"
        )
    if name == "fine-tune-all":
        return Protocol(name, tuple(languages), "all")
    if name.startswith("fine-tune-"):
        language = name.removeprefix("fine-tune-")
        return Protocol(name, (language,), "english" if language == ENGLISH else "single")
    return Protocol(name)


class PostNormEncoderLayer(nn.Module):
    """A RoBERTa-style (post-LN, GELU) Transformer encoder layer with its own attention dropout."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float, attn_dropout: float):
        super().__init__()
        self.attention = nn.MultiheadAttention(dim, heads, dropout=attn_dropout, batch_first=True)
        self.attention_norm = nn.LayerNorm(dim)
        self.feed_forward = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))
        self.output_norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        attended, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
        x = self.attention_norm(x + self.dropout(attended))
        return self.output_norm(x + self.dropout(self.feed_forward(x)))


class XProjector(nn.Module):
    """Randomly initialised Transformer layers over the MTE's token states (no extra positions),
    read at each sentence's last non-pad token (``</s>`` under right padding)."""

    def __init__(
        self, dim: int, layers: int, heads: int, ffn: int, dropout: float, attn_dropout: float
    ):
        super().__init__()
        self.layers = nn.ModuleList(
            PostNormEncoderLayer(dim, heads, ffn, dropout, attn_dropout) for _ in range(layers)
        )
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
        for layer in self.layers:
            nn.init.normal_(layer.attention.in_proj_weight, std=0.02)
            nn.init.zeros_(layer.attention.in_proj_bias)

    def forward(self, states: Tensor, mask: Tensor) -> Tensor:
        padding = ~mask.bool()
        for layer in self.layers:
            states = layer(states, padding)
        last = mask.long().sum(1) - 1
        return states[torch.arange(len(states), device=states.device), last]


class OpenClipTeacher(nn.Module):
    """An open_clip CLIP model as the frozen English teacher: ``encode_images``/``encode_texts``
    give its joint embeddings. Captions arrive as MTE token ids, so they are decoded with the MTE's
    Hugging Face tokenizer and re-tokenised with CLIP's own BPE (shipped with open_clip)."""

    def __init__(
        self,
        model: str,
        pretrained: Any,
        mte_tokenizer: str,
        config: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        import open_clip
        from transformers import AutoTokenizer

        clip = build_open_clip(model, pretrained, config, {})
        self.image = OpenClipVisionTokens(clip, project=True)
        self.text = OpenClipText(clip, project=True)
        self.embed_dim = self.text.width
        context = self.text.positional_embedding.shape[0]
        self.clip_tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=context)
        self.mte_tokenizer = AutoTokenizer.from_pretrained(mte_tokenizer)

    def encode_images(self, images: Tensor) -> Tensor:
        return self.image(images)[:, 0]

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        texts = self.mte_tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        tokens = self.clip_tokenizer(texts).to(input_ids.device)
        return self.text(tokens, tokens != 0)[1]


class ClipBaselineTeacher(nn.Module):
    """The suite's ``clip`` baseline (trained by the ``teacher`` stage) as the frozen teacher.
    Its embeddings are L2-normalised, which the bias-free CLIP-projector is blind to."""

    def __init__(self, method, optim, data, evaluation):
        super().__init__()
        self.model = CLIPModule(method.teacher.clip, optim, data, evaluation)
        self.embed_dim = method.teacher.clip.embed_dim

    def encode_images(self, images: Tensor) -> Tensor:
        return self.model.encode_images(images)

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.model.encode_texts(input_ids, attention_mask)


def selected_stages(method) -> list[str]:
    """``method.stages`` checked (known names, in pipeline order, ending with ``trikd``), less the
    Stage-1 sub-stages the variant drops."""
    stages = list(method.stages)
    positions = [STAGES.index(s) if s in STAGES else -1 for s in stages]
    in_order = all(a < b for a, b in pairwise(positions))
    if -1 in positions or not stages or stages[-1] != "trikd" or not in_order:
        raise ValueError(
            f"method.stages {stages}: expected an ordered subset of {list(STAGES)} "
            "ending with 'trikd'"
        )
    ablation = ablation_of(method)
    if not (ablation.nmt and ablation.ctl) and "mte_ctl" not in stages:
        raise ValueError(
            f"mclip variant {method.variant!r} changes Stage 1b, which "
            f"method.stages {stages} does not run"
        )
    return [s for s in stages if s not in STAGE_ONE or s in ablation.stage_one]


def build_teacher(method, optim, data, evaluation) -> nn.Module:
    """The teacher's architecture: the ``clip`` baseline when a ``teacher`` stage trains it,
    otherwise the configured open_clip model with its pretrained weights."""
    if "teacher" in selected_stages(method):
        return ClipBaselineTeacher(method, optim, data, evaluation)
    cfg = method.teacher.open_clip
    config = OmegaConf.to_container(cfg.config) if cfg.config is not None else None
    return OpenClipTeacher(cfg.model, cfg.pretrained, cfg.mte_tokenizer, config)


def build_mte(method, data) -> TextEncoder:
    """The multilingual text encoder: an XLM-R by name or path (``world``: the synthetic world's
    pretrained one), or one built from an in-code config whose vocabulary, pad id and position
    table follow the data's tokenizer where left null."""
    cfg = resolve_world(method.mte, data, "text")
    config = cfg.get("config")
    if config is not None:
        config.setdefault("model_type", "xlm-roberta")
        defaults = {
            "vocab_size": data.vocab_size,
            "pad_token_id": data.pad_token_id,
            "bos_token_id": data.cls_token_id,
            "eos_token_id": data.eos_token_id,
            "max_position_embeddings": data.max_length + data.pad_token_id + 1,
        }
        config.update({k: v for k, v in defaults.items() if config.get(k) is None})
    return TextEncoder(**cfg)


def build_mte_stage(method, optim, data, evaluation, joint: bool) -> MTEEnhancement:
    """A Stage-1 module (1a or 1b) with freshly built parts; no decoder when the variant drops
    L_NMT."""
    t = method.translation
    ablation = ablation_of(method)
    mte = build_mte(method, data)
    decoder = (
        TranslationDecoder(list(data.languages), mte.out_dim, t.layers, t.heads, t.ffn, t.dropout)
        if ablation.nmt
        else None
    )
    teacher = (
        ClipBaselineTeacher(method, optim, data, evaluation)
        if "teacher" in selected_stages(method)
        else None
    )
    settings = {
        **OmegaConf.to_container(t.ctl if joint else t.nmt),
        "label_smoothing": t.label_smoothing,
        "ctl_weight": t.ctl_weight,
        "ctl_temperature": t.ctl_temperature,
        "grad_clip": method.grad_clip,
        "initial_lr": INITIAL_LR,
    }
    return MTEEnhancement(
        mte,
        decoder,
        settings,
        joint,
        data.pad_token_id,
        teacher,
        ablation.ctl,
        int(optim.get("grad_cache_chunks", 1)),
    )


def load_prefixed(module: nn.Module, state: Mapping[str, Tensor], prefix: str) -> None:
    """Load the entries of ``state`` under ``prefix`` into ``module`` (all of them, strictly)."""
    module.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})


def image_keys(ids: list[str], device: torch.device) -> Tensor:
    """A 63-bit integer per image id (BLAKE2b), so that rows of one image can be matched across
    processes; distinct ids collide with probability about n^2 / 2^64."""
    digests = [hashlib.blake2b(str(i).encode(), digest_size=8).digest() for i in ids]
    return torch.tensor(
        [int.from_bytes(d, "big") >> 1 for d in digests], dtype=torch.long, device=device
    )


@register("mclip")
class MCLIP(RetrievalModule):
    """The TriKD stage (``phase="trikd"``), the fine-tuning stage (``phase="finetune"``) and the
    evaluated model: image = norm(Wc·teacher_image), text in any language = norm(XProjector(MTE
    states) at </s>). Teacher and MTE are frozen, in eval().

    With ``optim.grad_cache_chunks`` > 1 the X-projector, the only trained pass with activations
    (the frozen towers run without gradient), runs in that many micro-batches; the losses see
    the whole batch."""

    supports_grad_cache = True

    def __init__(
        self, method, optim, data, evaluation, phase: str = "trikd", protocol: str | None = None
    ):
        """``protocol``: the run's, which picks the fine-tuning settings (``phase="finetune"``
        needs it; TriKD runs the same under every protocol)."""
        super().__init__(method, optim, data, evaluation)
        if phase not in ("trikd", FINETUNE):
            raise ValueError(f"MCLIP phase must be 'trikd' or '{FINETUNE}', got {phase!r}")
        if phase == FINETUNE and protocol is None:
            raise ValueError("MCLIP's fine-tuning phase needs the run's protocol (fine-tune-*)")
        self.phase = phase
        cfg = method.trikd
        self.ablation = ablation_of(method)
        self.protocol = None if protocol is None else protocol_of(protocol, method, data.languages)
        if method.recall_mode not in RECALL_MODES:
            raise ValueError(
                f"method.recall_mode {method.recall_mode!r}: expected one of {sorted(RECALL_MODES)}"
            )
        self.teacher = freeze(build_teacher(method, optim, data, evaluation))
        self.mte = freeze(build_mte(method, data))
        dim = self.mte.out_dim
        self.clip_projector = nn.Linear(self.teacher.embed_dim, dim, bias=False)
        nn.init.xavier_uniform_(self.clip_projector.weight)
        self.x_projector = XProjector(
            dim, cfg.projector_layers, cfg.heads, cfg.ffn, cfg.dropout, cfg.attn_dropout
        )
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / cfg.init_temperature)))
        if phase == "trikd" and not self.ablation.itc:
            self.logit_scale.requires_grad_(False)  # no ITC term: nothing trains the temperature
        self.ttc_temperature = fixed_ttc_temperature(cfg.ttc_temperature, cfg.ttc_scale_mode)

    def restart_temperature(self) -> None:
        """Fine-tuning starts the ITC logit scale again at ln(1/init_temperature) (spec §8-A14)."""
        with torch.no_grad():
            self.logit_scale.fill_(math.log(1.0 / self.method_cfg.finetune.init_temperature))

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()
        self.mte.eval()
        return self

    @property
    def evaluation_metric(self) -> type[RetrievalEvaluation]:
        """The evaluation of ``method.recall_mode`` (dedup adds the reference code's recall)."""
        return RECALL_MODES[self.method_cfg.recall_mode]

    def encode_images(self, images: Tensor) -> Tensor:
        with torch.no_grad():
            features = self.teacher.encode_images(images)
        return F.normalize(self.clip_projector(features), dim=-1)

    def encode_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """At the batch's own width (training trims its batches before calling): trimming here
        would let a caption's embedding follow the rounding of a shape its neighbours chose."""
        with torch.no_grad():
            mte = self.mte(input_ids, attention_mask)
        projected = encode_in_chunks(
            self.x_projector, mte.states, mte.mask, chunks=self.grad_cache_chunks
        )
        return F.normalize(projected, dim=-1)

    def teacher_texts(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """The English captions through the frozen CLIP text tower and the shared projector. With
        no caption (a process without English rows this step) the result is an empty [0, D] that
        still passes the projector, so this process joins the same gathers as the others."""
        with torch.no_grad():
            if len(input_ids):
                features = self.teacher.encode_texts(input_ids, attention_mask)
            else:
                features = self.clip_projector.weight.new_zeros(0, self.teacher.embed_dim)
        return F.normalize(self.clip_projector(features), dim=-1)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        """Per language of the batch, one loss on that language's rows; the mean over the
        languages present in the global batch. TriKD: ITC + λ·TTC for English, ITC alone
        otherwise (the teacher's text tower is never called on other languages), less the terms
        the variant drops. Fine-tuning: the multi-positive loss over (caption, image) rows.

        Every present caption is encoded in one call; each language's loss then takes its rows,
        which may be none on this process (DDP: every process runs each language's gathers, and a
        language no process has this step is skipped by all of them)."""
        h_image = self.encode_images(batch["images"])
        instance, language_index = batch["present"].bool().nonzero(as_tuple=True)
        ids = batch["input_ids"][instance, language_index]
        mask = batch["attention_mask"][instance, language_index]
        h_text = self.encode_texts(*trim_padding(ids, mask))
        keys = image_keys(batch["ids"], h_image.device) if self.phase == FINETUNE else None
        losses = []
        for k, language in enumerate(batch["languages"]):
            mine = language_index == k
            layout = row_layout(int(mine.sum()), h_image.device)
            if layout.total == 0:
                continue
            rows = instance[mine]
            if self.phase == FINETUNE:
                scale = clamped_logit_scale(self.logit_scale, self.method_cfg.trikd.max_logit_scale)
                loss = multi_positive_info_nce(h_text[mine], h_image[rows], keys[rows], scale)
                if layout.local:
                    self.log(f"train/finetune_{language}", loss.detach(), batch_size=layout.local)
                losses.append(loss)
                continue
            losses.append(
                self.trikd_step(
                    language, h_image[rows], h_text[mine], ids[mine], mask[mine], layout.local
                )
            )
        if not losses:
            raise ValueError("mCLIP: no process has a present caption in this step")
        return torch.stack(losses).mean()

    def trikd_step(
        self,
        language: str,
        h_image: Tensor,
        h_text: Tensor,
        ids: Tensor,
        mask: Tensor,
        local_rows: int,
    ) -> Tensor:
        """One language's TriKD loss (logged as this process's share of the global-batch loss)."""
        cfg = self.method_cfg.trikd
        with_ttc = language == ENGLISH and self.ablation.ttc
        h_teacher = self.teacher_texts(*trim_padding(ids, mask)) if with_ttc else None
        if not self.ablation.itc and h_teacher is None:
            raise ValueError(
                f"mclip variant without ITC has no loss for {language!r} captions: "
                "train TriKD on English only (method.trikd.languages=[en])"
            )
        loss = trikd_loss(
            h_image,
            h_text,
            self.logit_scale,
            h_teacher,
            ttc_weight=cfg.ttc_weight,
            ttc_temperature=self.ttc_temperature,
            max_scale=cfg.max_logit_scale,
            itc=self.ablation.itc,
        )
        if local_rows:
            if loss.itc is not None:
                self.log(f"train/itc_{language}", loss.itc.detach(), batch_size=local_rows)
            if loss.ttc is not None:
                self.log(f"train/ttc_{language}", loss.ttc.detach(), batch_size=local_rows)
        return loss.total

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        clip_gradient_norm(self, self.method_cfg.grad_clip)

    def phase_settings(self) -> tuple[float, float, int]:
        """(peak lr, weight decay, warm-up steps) of this phase (spec §6)."""
        if self.phase == FINETUNE:
            ft = self.method_cfg.finetune
            return ft[self.protocol.finetune_settings].lr, ft.weight_decay, ft.warmup_steps
        cfg = self.method_cfg.trikd
        return cfg.lr, cfg.weight_decay, cfg.warmup_steps

    def configure_optimizers(self):
        lr, weight_decay, warmup_steps = self.phase_settings()
        groups = param_groups(self, weight_decay, lr)
        optimizer = Lamb(groups, lr=lr, max_grad_norm=None)  # clipping: see grad_clip
        factor = partial(
            inverse_sqrt_factor,
            warmup_steps=warmup_steps,
            decay_from_step=warmup_steps,
            initial_ratio=INITIAL_LR / lr,
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": LambdaLR(optimizer, factor), "interval": "step"},
        }

    @classmethod
    def check_config(cls, method, languages: list[str], protocol: str = DEFAULT_PROTOCOL) -> None:
        selected_stages(method)  # the stage list and the variant
        protocol_of(protocol, method, languages)

    @classmethod
    def pipeline(
        cls, method, optim, data, evaluation, protocol: str = DEFAULT_PROTOCOL
    ) -> list[Stage]:
        names = selected_stages(method)
        run_protocol = protocol
        protocol = protocol_of(run_protocol, method, list(data.languages))
        if protocol.finetune_languages:
            names.append(FINETUNE)
        previous = {name: names[i - 1] if i else None for i, name in enumerate(names)}

        def checkpoint(name: str, path: Path | None) -> dict[str, Tensor] | None:
            """The previous stage's weights; None for the first stage, or when the caller loads a
            full checkpoint itself (ccr/experiments/evaluate.py builds with None)."""
            return None if previous[name] is None or path is None else load_state(path)

        def build_teacher_stage(path: Path | None) -> L.LightningModule:
            return ClipBaselineTeacher(method, optim, data, evaluation).model

        def build_mte_stage_from(joint: bool, name: str, path: Path | None) -> L.LightningModule:
            module = build_mte_stage(method, optim, data, evaluation, joint)
            state = checkpoint(name, path)
            if state is None:
                return module
            if previous[name] == "teacher":
                module.teacher.model.load_state_dict(state)
            else:
                module.load_state_dict(state)
            return module

        def build_trikd(path: Path | None) -> L.LightningModule:
            module = cls(method, optim, data, evaluation)
            state = checkpoint("trikd", path)
            if state is None:
                return module
            if previous["trikd"] == "teacher":
                module.teacher.model.load_state_dict(state)
            else:
                load_prefixed(module.mte, state, "mte.")
                if "teacher" in names:
                    load_prefixed(module.teacher, state, "teacher.")
            return module

        def build_finetune(path: Path | None) -> L.LightningModule:
            module = cls(method, optim, data, evaluation, phase=FINETUNE, protocol=run_protocol)
            state = checkpoint(FINETUNE, path)
            if state is not None:
                module.load_state_dict(state)
                module.restart_temperature()
            return module

        def stage(name: str) -> Stage:
            if name in ("teacher", "trikd"):
                cfg = method[name]
                build = build_teacher_stage if name == "teacher" else build_trikd
                return Stage(
                    name,
                    build,
                    lambda dm: dm.train_dataloader(languages=list(cfg.languages)),
                    cfg.max_steps,
                    f"method.{name}.max_steps",
                )
            if name == FINETUNE:
                block = protocol.finetune_settings
                return Stage(
                    name,
                    build_finetune,
                    lambda dm: dm.train_dataloader(languages=list(protocol.finetune_languages)),
                    method.finetune[block].max_steps,
                    f"method.finetune.{block}.max_steps",
                )
            joint = name == "mte_ctl"
            part = "ctl" if joint else "nmt"
            t = method.translation
            return Stage(
                name,
                partial(build_mte_stage_from, joint, name),
                lambda dm: dm.parallel_dataloader(beta=t.sampling_beta, max_tokens=t.max_tokens),
                t[part].max_steps,
                f"method.translation.{part}.max_steps",
            )

        return [stage(name) for name in names]
