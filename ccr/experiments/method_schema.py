"""The typed shape of each method's ``method:`` section (OmegaConf structured configs).

Composing types the run's ``method`` section by the schema of the method it names
(``method.name``), so a value of the wrong type (``method.embed_dim=abc``) or a key the method
does not have fails at once, naming the key, as the base sections do (``ccr/experiments/schema.py``).

Values live in one place, the method's preset (``configs/method/<name>.yaml``): a field without
a default (``MISSING``) must be set there, and composing a preset that leaves one unset is an
error naming it. A field has a default only where a configuration may omit it, and the default
is then what omitting it means: for a key added after runs were published, the value that
reproduces those runs (the preset may set another, e.g. covlr's ``uni_labels``), or an optional
part that stays off when absent. Encoder specs (``image_encoder``, ``text_encoder``, ...) are
open mappings, checked by ``ccr/methods/layers/encoders.py``; a variant table (``ablations``) maps a
name to keys of this same section, checked at composition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

EncoderSpec = dict[str, Any]  # name, pretrained, options ... (ccr/methods/layers/encoders.py)


@dataclass
class MethodConfig:
    """What every method section has: the registered method name."""

    name: str = MISSING
    # True: the method trains by the run's ``protocol`` (handed to it at build time); any other
    # method has one way to train, recorded as ``protocol=default``.
    trains_by_protocol: ClassVar[bool] = False


@dataclass
class TemperatureConfig:
    """A learnable (or fixed) contrastive temperature and its clamp."""

    init: float = MISSING
    min_value: float = MISSING
    max_value: float = MISSING
    learnable: bool = MISSING


@dataclass
class VariantsConfig(MethodConfig):
    """A method with named variants: ``ablation`` (from ``variant=``) selects one row of
    ``ablations``, whose keys override this section's. Both default to "none": runs stored
    before a method had the table trained its full model."""

    ablation: str | None = None
    ablations: dict[str, Any] = field(default_factory=dict)


# ---- clip -------------------------------------------------------------------------------------


@dataclass
class ClipConfig(MethodConfig):
    embed_dim: int = MISSING
    projection: str = "linear"  # added later; linear is what earlier runs trained
    lit: bool = False  # added later; earlier runs trained both towers
    image_encoder: EncoderSpec = MISSING
    text_encoder: EncoderSpec = MISSING
    temperature: TemperatureConfig = MISSING


# ---- ccrk -------------------------------------------------------------------------------------


@dataclass
class CCRkFusionConfig:
    layers: int = MISSING
    heads: int | None = MISSING
    init_from_text_layers: Any = MISSING  # "upper", a list of text layers, or null (random)


@dataclass
class CCRkMLMConfig:
    mask_probability: float = MISSING
    tie_to_embeddings: bool = MISSING


@dataclass
class CCRkConfig(VariantsConfig):
    embed_dim: int = MISSING
    image_encoder: EncoderSpec = MISSING
    text_encoder: EncoderSpec = MISSING
    fusion: CCRkFusionConfig = MISSING
    mlm: CCRkMLMConfig = MISSING
    temperature: TemperatureConfig = MISSING
    kcl_weighting: str = MISSING
    hard_mining: str = MISSING
    contrastive: str = MISSING
    hard_mitm: bool = MISSING
    hard_cmlm: bool = MISSING
    use_fusion: bool = True  # added later; earlier runs trained the full model
    new_param_lr_scale: float = MISSING
    rerank_score: str = MISSING
    length_buckets: int = MISSING


# ---- cl2cm ------------------------------------------------------------------------------------


@dataclass
class OTConfig:
    variant: str = MISSING
    epsilon: float = MISSING
    iterations: int = MISSING
    marginal_penalty: float = MISSING
    partial_mass: float = MISSING


@dataclass
class CL2CMConfig(VariantsConfig):
    embed_dim: int = MISSING
    image_encoder: EncoderSpec = MISSING
    text_encoder: EncoderSpec = MISSING
    source_language: str = MISSING
    target_languages: list[str] | None = MISSING
    temperature: TemperatureConfig = MISSING
    alpha: float = MISSING
    sentence_weight: float = MISSING
    kd_temperature: float = MISSING
    kl_direction: str = MISSING
    word_temperature: float = MISSING
    word_label_norm: str = MISSING
    pseudo_label: str = MISSING
    ot: OTConfig = MISSING
    use_cl_inst: bool = MISSING
    use_word_align: bool = MISSING
    use_ckt: bool = MISSING
    ckt_levels: str = MISSING


# ---- covlr ------------------------------------------------------------------------------------


@dataclass
class CrossModalConfig:
    layers: int = MISSING
    heads: int = MISSING


@dataclass
class ViewsConfig:
    max_shift: float = MISSING
    flip_probability: float = MISSING
    token_dropout: float = MISSING


@dataclass
class CoVLRConfig(VariantsConfig):
    embed_dim: int = MISSING
    d_model: int = MISSING
    image_encoder: EncoderSpec = MISSING
    text_encoder: EncoderSpec = MISSING
    cross_modal: CrossModalConfig = MISSING
    temperature: float = MISSING
    mask_probability: float = MISSING
    uni_text_captions: str = MISSING
    uni_mode: str = MISSING
    uni_labels: str = "object"  # added later; earlier runs classified the world's object labels
    nce: ViewsConfig = MISSING
    meta: bool = MISSING
    meta_alpha: float = MISSING
    second_order: bool = MISSING
    use_mlm: bool = MISSING
    use_mpm: bool = MISSING
    use_uni_img: bool = MISSING
    use_uni_txt: bool = MISSING
    new_param_lr_scale: float = MISSING
    length_buckets: int = MISSING


# ---- mclip ------------------------------------------------------------------------------------


@dataclass
class OpenClipTeacherConfig:
    model: str = MISSING
    pretrained: str | None = MISSING
    mte_tokenizer: str = MISSING
    config: dict[str, Any] | None = None  # an in-code open_clip CLIP config (tests)


@dataclass
class TeacherConfig:
    """The teacher stage (``teacher`` in ``stages``: a clip trained here) or, without it, the
    open_clip teacher. The clip part is optional: a run without the stage needs none of it."""

    languages: list[str] | None = None
    max_steps: int | None = None
    clip: ClipConfig | None = None
    open_clip: OpenClipTeacherConfig = MISSING


@dataclass
class StageOptimConfig:
    lr: float = MISSING
    betas: list[float] = MISSING
    warmup_steps: int = MISSING
    decay_from_step: int = MISSING
    max_steps: int = MISSING


@dataclass
class CTLStageConfig(StageOptimConfig):
    train_embeddings: bool = MISSING


@dataclass
class TranslationConfig:
    layers: int = MISSING
    heads: int = MISSING
    ffn: int = MISSING
    dropout: float = MISSING
    label_smoothing: float = MISSING
    ctl_weight: float = MISSING
    ctl_temperature: float = MISSING
    sampling_beta: float | None = MISSING  # null: languages sampled as the corpus has them
    max_tokens: int | None = MISSING  # null: fixed-size batches of pairs
    nmt: StageOptimConfig = MISSING
    ctl: CTLStageConfig = MISSING


@dataclass
class TriKDConfig:
    languages: list[str] = MISSING
    projector_layers: int = MISSING
    heads: int = MISSING
    ffn: int = MISSING
    dropout: float = MISSING
    attn_dropout: float = MISSING
    init_temperature: float = MISSING
    max_logit_scale: float = MISSING
    ttc_weight: float = MISSING
    ttc_temperature: float = MISSING
    ttc_scale_mode: str = MISSING
    lr: float = MISSING
    weight_decay: float = MISSING
    warmup_steps: int = MISSING
    max_steps: int = MISSING


@dataclass
class FinetuneBudget:
    lr: float = MISSING
    max_steps: int = MISSING


@dataclass
class MCLIPFinetuneConfig:
    init_temperature: float = MISSING
    weight_decay: float = MISSING
    warmup_steps: int = MISSING
    english: FinetuneBudget = MISSING
    single: FinetuneBudget = MISSING
    all: FinetuneBudget = MISSING


@dataclass
class MCLIPConfig(MethodConfig):
    trains_by_protocol: ClassVar[bool] = True

    variant: str | None = None  # the run's variant (Table 2 ablations); null: the full model
    recall_mode: str = MISSING
    stages: list[str] = MISSING
    grad_clip: float = MISSING
    teacher: TeacherConfig = MISSING
    mte: EncoderSpec = MISSING
    translation: TranslationConfig = MISSING
    trikd: TriKDConfig = MISSING
    finetune: MCLIPFinetuneConfig = MISSING


# ---- rc3 --------------------------------------------------------------------------------------


@dataclass
class PretrainConfig:
    max_steps: int | None = MISSING


@dataclass
class FinetuneOptimConfig:
    """Keys of the run's ``optim`` this stage replaces (``ccr/methods/rc3/module.py`` ``finetune_optim``)."""

    lr: float = MISSING
    weight_decay: float = MISSING
    warmup_ratio: float = MISSING
    schedule: str = MISSING
    min_lr_ratio: float = MISSING


@dataclass
class RC3FinetuneConfig:
    max_steps: int = MISSING
    batch_size: int | None = MISSING
    optim: FinetuneOptimConfig = MISSING


@dataclass
class BackboneConfig:
    pretrained: str | None = MISSING
    d_model: int = MISSING
    heads: int = MISSING
    ffn_dim: int = MISSING
    encoder_layers: int = MISSING
    decoder_layers: int = MISSING
    max_positions: int = MISSING
    dropout: float = MISSING
    init_std: float = MISSING
    patch_size: int = MISSING
    patch_embed_dim: int = MISSING


@dataclass
class VisualConfig:
    strict_input: str = MISSING
    regions: EncoderSpec | None = MISSING
    roi_dim: int = MISSING


@dataclass
class ProbeConfig:
    image_encoder: EncoderSpec | None = MISSING
    text_encoder: EncoderSpec | None = MISSING
    dim: int = MISSING
    temperature: float = MISSING


@dataclass
class RC3Config(VariantsConfig):
    trains_by_protocol: ClassVar[bool] = True

    pretrain: PretrainConfig = MISSING
    finetune: RC3FinetuneConfig = MISSING
    backbone: BackboneConfig = MISSING
    visual: VisualConfig = MISSING
    zeta: float = MISSING
    tracker_window: int = MISSING
    anchors_per_task: int = MISSING
    mask_probability: float = MISSING
    use_xtcl: bool = MISSING
    use_rxvtcl: bool = MISSING
    use_weak: bool = MISSING
    use_kl: bool = MISSING
    first_stage: ProbeConfig = MISSING
    # Read by trainer/cpu.yaml. Null only in configs stored before the keys existed, whose trainer
    # section holds the values their runs used.
    cpu_threads: int | None = None
    check_val_every_n_epoch: int | None = None


# ---- models scored as published (ccr/experiments/external.py) -------------------------------------


@dataclass
class ExternalConfig(MethodConfig):
    trains_by_protocol: ClassVar[bool] = True  # scored as published: protocol zero-shot

    library: str = MISSING
    model: str = MISSING
    pretrained: str | None = MISSING
    revision: str | None = None
    remote_code: bool = False
    text_length: int | None = None
    zoo: str | None = None
    image_model: str | None = None


SCHEMAS: dict[str, type[MethodConfig]] = {
    "clip": ClipConfig,
    "ccrk": CCRkConfig,
    "cl2cm": CL2CMConfig,
    "covlr": CoVLRConfig,
    "mclip": MCLIPConfig,
    "rc3": RC3Config,
    "external": ExternalConfig,
}
