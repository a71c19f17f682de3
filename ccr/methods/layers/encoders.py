"""Image and text encoders shared by every method, behind one interface per modality.

Backends are picked by ``name``:

* ``tiny``: a small random-init transformer (the CPU default for tests and smoke runs);
* ``timm:<model>`` (images), ``hf:<model or path>`` (texts): the model zoos by name;
* ``open_clip:<model>``: a tower of an open_clip CLIP model (or one built from ``config``);
* ``pretrained`` (with ``spec``): one tower of a pretrained dual encoder, exactly as
  ``ccr/experiments/external.py`` scores it (``ccr/methods/layers/pretrained_dual.py``): its global token
  is the model's projected embedding, and it is the only token (``method.encoders=zoo:<name>``
  sets both encoders, and the data's preprocessing and tokenizer, to a zoo model);
* ``world`` (in ``from_config``): the synthetic world's own pretrained backbone, whatever settings
  ``DataInfo.backbones`` gives (a timm ViT state dict, a Hugging Face XLM-R folder).

``pretrained`` selects weights: ``None``/``False`` random init, ``True`` or a tag (timm /
open_clip pretrained tag) for users with network access, or a local checkpoint path. Tests save tiny
models to a temporary folder and load them through that same path, so nothing downloads.

``ImageEncoder(images) -> [B, 1+P, D]``: token states with the global token first.
``TextEncoder(input_ids, attention_mask) -> TextOutput(states [N,L,D], pooled [N,D], mask [N,L])``.
Both expose ``out_dim`` (= D).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ccr.methods.layers.weights import load_state_dict_file


def transformer_stack(
    width: int, layers: int, heads: int, mlp_ratio: float, dropout: float
) -> nn.TransformerEncoder:
    """Pre-LN GELU transformer encoder (batch first) used by the tiny backends."""
    layer = nn.TransformerEncoderLayer(
        width,
        heads,
        int(width * mlp_ratio),
        dropout,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def load_weights(module: nn.Module, path: str | Path, ignore_prefixes: Sequence[str] = ()) -> None:
    """Load a local checkpoint into ``module``; every module weight must be present.

    Checkpoint keys absent from the module are allowed only under ``ignore_prefixes`` (e.g. a
    classifier head the encoder drops); anything else is an error naming the keys.
    """
    state = load_state_dict_file(path)
    own = module.state_dict()
    extra = [k for k in state if k not in own and not k.startswith(tuple(ignore_prefixes))]
    missing = [k for k in own if k not in state]
    if missing or extra:
        raise ValueError(
            f"{path}: checkpoint does not match the encoder "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )
    module.load_state_dict({k: v for k, v in state.items() if k in own})


def _is_local_path(pretrained: Any) -> bool:
    return isinstance(pretrained, (str, Path)) and Path(pretrained).exists()


def _names_a_folder(name: str) -> bool:
    """A Hugging Face name that can only be a local folder (absolute, ``./``, ``../``, ``~``);
    ``org/model`` stays a hub name."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).is_absolute()


def _plain(mapping: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain dict from a dict or an OmegaConf node (libraries check ``isinstance(x, dict)``)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(mapping, DictConfig):
        return OmegaConf.to_container(mapping, resolve=True)
    return dict(mapping or {})


WORLD = "world"


def resolve_world(cfg: Mapping[str, Any], data: Any, modality: str) -> dict[str, Any]:
    """An encoder section with ``name: world`` (the synthetic world's pretrained backbone) turned
    into the settings the data provides (``DataInfo.backbones[modality]``); other sections as they
    are. On data without such a backbone this is an error: name a real model there."""
    cfg = _plain(cfg)
    if cfg.get("name") != WORLD:
        return cfg
    provided = getattr(data, "backbones", None) or {}
    if modality not in provided:
        example = (
            "hf:xlm-roberta-base" if modality == "text" else "timm:swin_base_patch4_window7_224"
        )
        raise ValueError(
            f"{modality} encoder 'world' is the synthetic world's pretrained {modality} encoder, "
            f"which this data does not provide (only data=synthetic with data.backbones set); "
            f"name a real model instead, e.g. {example}"
        )
    extra = {k: v for k, v in cfg.items() if k not in ("name", "pretrained")}
    return {**extra, **copy.deepcopy(dict(provided[modality]))}  # callers may edit theirs


def _split_name(name: str) -> tuple[str, str]:
    backend, _, model = name.partition(":")
    return backend, model


# ---------------------------------------------------------------------------------------------
# Images
# ---------------------------------------------------------------------------------------------


class TinyViT(nn.Module):
    """Small random-init ViT: patch embedding, [CLS] + learned positions, pre-LN transformer."""

    def __init__(
        self,
        image_size: int,
        patch_size: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
    ):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(
                f"image_size {image_size} is not a multiple of patch_size {patch_size}"
            )
        self.patch_embed = nn.Conv2d(3, width, patch_size, patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, width))
        self.pos_embed = nn.Parameter(
            torch.randn(1, 1 + (image_size // patch_size) ** 2, width) * 0.02
        )
        self.blocks = transformer_stack(width, layers, heads, mlp_ratio, dropout)
        self.norm = nn.LayerNorm(width)
        self.width = width

    def forward(self, images: Tensor) -> Tensor:
        patches = self.patch_embed(images).flatten(2).transpose(1, 2)
        tokens = (
            torch.cat([self.cls_token.expand(len(patches), -1, -1), patches], dim=1)
            + self.pos_embed
        )
        return self.norm(self.blocks(tokens))


class TimmTokens(nn.Module):
    """A timm backbone as token states: ViTs keep their [CLS] (or the patch mean) first; CNNs and
    Swin flatten the final feature grid and prepend its average-pooled token."""

    def __init__(self, model: str, pretrained: Any, options: Mapping[str, Any]):
        super().__init__()
        import timm

        local = _is_local_path(pretrained)
        if isinstance(pretrained, str) and not local:  # a timm pretrained tag
            model, pretrained = f"{model}.{pretrained}", True
        self.model = timm.create_model(
            model, pretrained=bool(pretrained) and not local, num_classes=0, **options
        )
        if local:
            load_weights(self.model, pretrained, ignore_prefixes=("head", "fc.", "classifier"))
        self.width = self.model.num_features
        self.output_fmt = getattr(self.model, "output_fmt", "NCHW")
        self.prefix_tokens = getattr(self.model, "num_prefix_tokens", 0)
        self.has_cls = getattr(self.model, "cls_token", None) is not None

    def forward(self, images: Tensor) -> Tensor:
        features = self.model.forward_features(images)
        if features.dim() == 4:
            grid = features if str(self.output_fmt) == "NHWC" else features.permute(0, 2, 3, 1)
            patches = grid.flatten(1, 2)
            return torch.cat([patches.mean(1, keepdim=True), patches], dim=1)
        patches = features[:, self.prefix_tokens :]
        global_token = features[:, :1] if self.has_cls else patches.mean(1, keepdim=True)
        return torch.cat([global_token, patches], dim=1)


def build_open_clip(
    model: str, pretrained: Any, config: Mapping[str, Any] | None, options: Mapping[str, Any]
) -> nn.Module:
    """An open_clip model by name (``pretrained``: tag or local path) or from an in-code ``config``
    (``embed_dim``, ``vision_cfg``, ``text_cfg``; ``pretrained`` then a local path or nothing)."""
    import open_clip

    if config is None:
        if _is_local_path(pretrained):  # open_clip reads it unchecked; a bad file is named here
            load_state_dict_file(pretrained)
        return open_clip.create_model(model, pretrained=pretrained or None, **options)
    clip = open_clip.CLIP(**config, **options)
    if pretrained:
        load_weights(clip, pretrained)
    return clip


class OpenClipVisionTokens(nn.Module):
    """The visual tower of an open_clip ViT. Token 0 equals ``encode_image``; with ``project`` the
    patch tokens go through the same projection, so every token lives in the joint space."""

    def __init__(self, clip: nn.Module, project: bool):
        super().__init__()
        self.visual = clip.visual
        if not hasattr(self.visual, "output_tokens"):
            raise ValueError(
                f"open_clip image tower {type(self.visual).__name__} has no token output; "
                "use a ViT model"
            )
        self.visual.output_tokens = True
        if not project:
            self.visual.proj = None
        self.width = (
            self.visual.proj.shape[1]
            if self.visual.proj is not None
            else self.visual.transformer.width
        )

    def forward(self, images: Tensor) -> Tensor:
        pooled, tokens = self.visual(images)
        if self.visual.proj is not None:
            tokens = tokens @ self.visual.proj
        return torch.cat([pooled.unsqueeze(1), tokens], dim=1)


class PretrainedImageTokens(nn.Module):
    """The image tower of a pretrained dual encoder: one token, its projected embedding."""

    def __init__(self, spec: Mapping[str, Any]):
        super().__init__()
        from ccr.methods.layers.pretrained_dual import DualSpec, image_tower

        self.tower = image_tower(DualSpec.from_mapping(_plain(spec)))
        self.width = self.tower.width

    def forward(self, images: Tensor) -> Tensor:
        return self.tower(images).unsqueeze(1)


class ImageEncoder(nn.Module):
    """Images ``[B,3,H,W]`` -> token states ``[B, 1+P, out_dim]``, the global token first.

    ``name``: ``tiny`` (options image_size, patch_size, width, layers, heads), ``timm:<model>``
    (``options`` go to ``timm.create_model``), ``open_clip:<model>`` (``config`` builds the CLIP
    model in code; ``project`` maps tokens into the joint embedding space).
    """

    def __init__(
        self,
        name: str = "tiny",
        pretrained: Any = None,
        *,
        image_size: int = 32,
        patch_size: int = 8,
        width: int = 64,
        layers: int = 2,
        heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        project: bool = True,
        config: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        spec: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        backend, model = _split_name(name)
        options, config = _plain(options), (_plain(config) if config is not None else None)
        if backend == PRETRAINED:
            self.backbone = PretrainedImageTokens(_needs_spec(spec, "image"))
        elif backend == "tiny":
            self.backbone = TinyViT(
                image_size, patch_size, width, layers, heads, mlp_ratio, dropout
            )
            if pretrained:
                load_weights(self.backbone, pretrained)
        elif backend == "timm":
            self.backbone = TimmTokens(model, pretrained, options)
        elif backend == "open_clip":
            self.backbone = OpenClipVisionTokens(
                build_open_clip(model, pretrained, config, options), project
            )
        else:
            raise ValueError(
                f"image encoder {name!r}: expected 'tiny', 'timm:<model>', 'open_clip:<model>' "
                "or 'pretrained'"
            )
        self.out_dim = self.backbone.width

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], data: Any) -> ImageEncoder:
        """Build from a method config section; the tiny backend takes ``image_size`` from
        ``DataInfo`` unless it is set explicitly; ``name: world`` takes the data's pretrained
        image backbone (:func:`resolve_world`)."""
        kwargs = resolve_world(cfg, data, "image")
        if kwargs.get("name", "tiny") == "tiny":
            kwargs.setdefault("image_size", data.image_size)
        return cls(**kwargs)

    def forward(self, images: Tensor) -> Tensor:
        return self.backbone(images)


# ---------------------------------------------------------------------------------------------
# Texts
# ---------------------------------------------------------------------------------------------


@dataclass
class TextOutput:
    """Token states ``[N, L, D]``, the pooled sentence state ``[N, D]`` and the bool mask ``[N, L]``
    (True on real tokens)."""

    states: Tensor
    pooled: Tensor
    mask: Tensor


class TinyTextTransformer(nn.Module):
    """Small random-init text transformer; the pooled state is the first ([CLS]) token."""

    def __init__(
        self,
        vocab_size: int,
        pad_token_id: int,
        max_length: int,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        dropout: float,
    ):
        super().__init__()
        self.token_embed = nn.Embedding(vocab_size, width, padding_idx=pad_token_id)
        self.pos_embed = nn.Parameter(torch.randn(1, max_length, width) * 0.02)
        self.blocks = transformer_stack(width, layers, heads, mlp_ratio, dropout)
        self.norm = nn.LayerNorm(width)
        self.width = width

    def forward(self, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        length = input_ids.shape[1]
        if length > self.pos_embed.shape[1]:
            raise ValueError(
                f"text length {length} exceeds the encoder's max_length {self.pos_embed.shape[1]}"
            )
        x = self.token_embed(input_ids) + self.pos_embed[:, :length]
        states = self.norm(self.blocks(x, src_key_padding_mask=~mask))
        return states, states[:, 0]

    def input_embeddings(self) -> nn.Embedding:
        return self.token_embed


class HFText(nn.Module):
    """A transformers encoder (XLM-R, mBERT, ...): last hidden states, pooled = first token.

    ``layers`` keeps a subset of the encoder layers (an int n: the first n; a list: those indices),
    e.g. CCRk's text encoder from XLM-R-large layers [1, 3, ..., 11]. The HF pooler is dropped so
    no parameter goes unused under DDP.
    """

    def __init__(
        self,
        model: str,
        pretrained: Any,
        config: Mapping[str, Any] | None,
        layers: int | Sequence[int] | None,
        options: Mapping[str, Any],
    ):
        super().__init__()
        from transformers import AutoConfig, AutoModel

        if _names_a_folder(model) and not Path(model).expanduser().is_dir():
            raise FileNotFoundError(f"hf:{model}: no such model folder")
        if config is not None:
            hf_config = AutoConfig.for_model(**config)
            self.model = AutoModel.from_config(hf_config, **options)
            if pretrained:
                load_weights(self.model, pretrained)
        elif pretrained is False:
            self.model = AutoModel.from_config(AutoConfig.from_pretrained(model), **options)
        else:
            self.model = AutoModel.from_pretrained(model, **options)
        self.model.train()  # from_pretrained leaves eval mode; a module starts training, as torch's do
        if getattr(self.model, "pooler", None) is not None:
            self.model.pooler = None
        if layers is not None:
            keep_layers(self.model, layers)
        self.width = self.model.config.hidden_size

    def forward(self, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        states = self.model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        return states, states[:, 0]

    def input_embeddings(self) -> nn.Embedding:
        return self.model.get_input_embeddings()


def keep_layers(model: nn.Module, layers: int | Sequence[int]) -> None:
    """Keep only the given encoder layers of a HF model (``model.encoder.layer``), in order."""
    stack = model.encoder.layer
    indices = list(range(layers)) if isinstance(layers, int) else list(layers)
    bad = [i for i in indices if not 0 <= i < len(stack)]
    if bad:
        raise ValueError(f"layer indices {bad} out of range for a {len(stack)}-layer model")
    model.encoder.layer = nn.ModuleList(stack[i] for i in indices)
    model.config.num_hidden_layers = len(indices)


class OpenClipText(nn.Module):
    """The text tower of an open_clip CLIP model (causal, pooled at the EOT token).

    With ``project`` (default) the pooled state equals ``encode_text`` and the token states are
    projected the same way, so both live in the joint space.
    """

    def __init__(self, clip: nn.Module, project: bool):
        super().__init__()
        if not hasattr(clip, "token_embedding"):
            raise ValueError(
                f"open_clip model {type(clip).__name__} has no built-in text transformer"
            )
        self.token_embedding = clip.token_embedding
        self.positional_embedding = clip.positional_embedding
        self.transformer = clip.transformer
        self.ln_final = clip.ln_final
        self.register_buffer("attn_mask", clip.attn_mask, persistent=False)
        self.pool_type = clip.text_pool_type
        self.eos_id = getattr(clip, "text_eos_id", None)
        self.text_projection = clip.text_projection if project else None
        width = clip.transformer.width
        if self.text_projection is None:
            self.width = width
        elif isinstance(self.text_projection, nn.Linear):
            self.width = self.text_projection.out_features
        else:
            self.width = self.text_projection.shape[1]

    def _project(self, x: Tensor) -> Tensor:
        if self.text_projection is None:
            return x
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(x)
        return x @ self.text_projection

    def forward(self, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        from open_clip.transformer import text_global_pool

        length = input_ids.shape[1]
        x = self.token_embedding(input_ids) + self.positional_embedding[:length]
        attn_mask = None if self.attn_mask is None else self.attn_mask[:length, :length]
        x = self.ln_final(self.transformer(x, attn_mask=attn_mask))
        pooled = text_global_pool(x, input_ids, self.pool_type, eos_token_id=self.eos_id)
        return self._project(x), self._project(pooled)

    def input_embeddings(self) -> nn.Embedding:
        return self.token_embedding


class PretrainedTextTokens(nn.Module):
    """The text tower of a pretrained dual encoder: one state, its projected embedding."""

    def __init__(self, spec: Mapping[str, Any]):
        super().__init__()
        from ccr.methods.layers.pretrained_dual import DualSpec, text_tower

        self.tower = text_tower(DualSpec.from_mapping(_plain(spec)))
        self.width = self.tower.width

    def forward(self, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        pooled = self.tower(input_ids, mask.long())
        return pooled.unsqueeze(1), pooled

    def input_embeddings(self) -> nn.Embedding:
        raise ValueError(
            "a pretrained dual encoder's text tower exposes no token embedding table "
            "to tie a head to"
        )


TINY_TEXT_LAYERS = 2
PRETRAINED = "pretrained"


def _needs_spec(spec: Mapping[str, Any] | None, modality: str) -> Mapping[str, Any]:
    if not spec:
        raise ValueError(
            f"{modality} encoder 'pretrained' needs spec: {{library, model, ...}} "
            "(method.encoders=zoo:<name> fills it)"
        )
    return spec


class TextEncoder(nn.Module):
    """Token ids ``[N, L]`` + attention mask -> :class:`TextOutput`.

    ``name``: ``tiny`` (needs ``vocab_size``, ``pad_token_id``, ``max_length``: ``from_config``),
    ``hf:<name or local path>`` (or ``hf`` with a ``config`` dict holding ``model_type``; ``layers``
    keeps a subset of layers; weights load from the name unless ``pretrained: false``),
    ``open_clip:<model>`` (``config`` builds the CLIP model in code).
    """

    def __init__(
        self,
        name: str = "tiny",
        pretrained: Any = None,
        *,
        vocab_size: int | None = None,
        pad_token_id: int = 0,
        max_length: int = 64,
        width: int = 64,
        layers: int | Sequence[int] | None = None,
        heads: int = 4,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        project: bool = True,
        config: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        spec: Mapping[str, Any] | None = None,
    ):
        super().__init__()
        backend, model = _split_name(name)
        options, config = _plain(options), (_plain(config) if config is not None else None)
        if backend == PRETRAINED:
            self.backbone = PretrainedTextTokens(_needs_spec(spec, "text"))
        elif backend == "tiny":
            if vocab_size is None:
                raise ValueError(
                    "tiny text encoder needs vocab_size "
                    "(TextEncoder.from_config fills it from DataInfo)"
                )
            depth = TINY_TEXT_LAYERS if layers is None else layers
            self.backbone = TinyTextTransformer(
                vocab_size, pad_token_id, max_length, width, depth, heads, mlp_ratio, dropout
            )
            if pretrained:
                load_weights(self.backbone, pretrained)
        elif backend == "hf":
            self.backbone = HFText(model, pretrained, config, layers, options)
        elif backend == "open_clip":
            self.backbone = OpenClipText(
                build_open_clip(model, pretrained, config, options), project
            )
        else:
            raise ValueError(
                f"text encoder {name!r}: expected 'tiny', 'hf:<model>', 'open_clip:<model>' or "
                "'pretrained'"
            )
        self.out_dim = self.backbone.width

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], data: Any) -> TextEncoder:
        """Build from a method config section, taking vocabulary size, pad id and max length from
        ``DataInfo`` for the tiny backend (the keys can still be set explicitly); ``name: world``
        takes the data's pretrained text backbone (:func:`resolve_world`)."""
        kwargs = resolve_world(cfg, data, "text")
        if kwargs.get("name", "tiny") == "tiny":
            kwargs.setdefault("vocab_size", data.vocab_size)
            kwargs.setdefault("pad_token_id", data.pad_token_id)
            kwargs.setdefault("max_length", data.max_length)
        return cls(**kwargs)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> TextOutput:
        mask = attention_mask.bool()
        states, pooled = self.backbone(input_ids, mask)
        # a pretrained dual encoder's tower gives one state (its embedding): the mask follows
        return TextOutput(states=states, pooled=pooled, mask=mask[:, : states.shape[1]])

    def input_embeddings(self) -> nn.Embedding:
        """The token embedding table (e.g. to tie an MLM decoder to it)."""
        return self.backbone.input_embeddings()
