"""Tiny pretrained-style dual encoders saved in a test's folder (nothing is downloaded): an
open_clip ``local-dir:`` model and a Hugging Face CLIP model with its processor and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 24, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def save_tiny_open_clip(folder: Path, seed: int = 0) -> Path:
    """An open_clip model folder (config + weights) loadable as ``local-dir:<folder>``."""
    import open_clip

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = open_clip.CLIP(**TINY_OPEN_CLIP)
    config = {
        "model_cfg": TINY_OPEN_CLIP,
        "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]},
    }
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    torch.save(model.state_dict(), folder / "open_clip_pytorch_model.bin")
    return folder


def save_tiny_hf_clip(folder: Path, corpus: list[str], seed: int = 0) -> Path:
    """A Hugging Face CLIP folder: model, image processor and a byte-level BPE tokenizer trained on
    ``corpus``."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=300, min_frequency=1, special_tokens=["<pad>", "<s>", "</s>"]
    )
    bpe.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=32,
    )
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.5] * 3,
        image_std=[0.25] * 3,
    ).save_pretrained(folder)
    return folder


def save_tiny_metaclip2(folder: Path, corpus: list[str], seed: int = 0) -> Path:
    """A Hugging Face MetaCLIP 2 folder (``MetaClip2Model``, as the mt5-worldwide checkpoints)."""
    from transformers import CLIPImageProcessor, MetaClip2Config, MetaClip2Model

    tokenizer = _save_tiny_tokenizer(folder, corpus)
    torch.manual_seed(seed)
    config = MetaClip2Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=8,
    )
    MetaClip2Model(config).save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.5] * 3,
        image_std=[0.25] * 3,
    ).save_pretrained(folder)
    return folder


def _save_tiny_tokenizer(folder: Path, corpus: list[str]):
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=300, min_frequency=1, special_tokens=["<pad>", "<s>", "</s>"]
    )
    bpe.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=32,
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


REMOTE_CONFIG = """
from transformers import PretrainedConfig


class TinyDualConfig(PretrainedConfig):
    model_type = "ccr_tiny_dual"

    def __init__(self, vocab_size=300, width=16, patch_size=8, embed_dim=8,
                 max_position_embeddings=32, batch_centered=False, **kwargs):
        self.vocab_size, self.width, self.patch_size = vocab_size, width, patch_size
        self.embed_dim, self.max_position_embeddings = embed_dim, max_position_embeddings
        self.batch_centered = batch_centered
        super().__init__(**kwargs)
"""

REMOTE_MODEL = '''
import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration_tiny_dual import TinyDualConfig


class TinyDualModel(PreTrainedModel):
    """Patch-mean image features and mask-mean token features, each projected; with
    ``batch_centered`` an image embedding subtracts its batch's mean (so depends on the batch)."""

    config_class = TinyDualConfig

    def __init__(self, config):
        super().__init__(config)
        self.vision_patches = nn.Conv2d(3, config.width, config.patch_size, config.patch_size)
        self.visual_projection = nn.Linear(config.width, config.embed_dim, bias=False)
        self.text_embeddings = nn.Embedding(config.vocab_size, config.width)
        self.text_projection = nn.Linear(config.width, config.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))
        self.post_init()

    def _init_weights(self, module):
        pass

    def get_image_features(self, pixel_values):
        features = self.visual_projection(self.vision_patches(pixel_values).flatten(2).mean(-1))
        if self.config.batch_centered:
            features = features - features.mean(0, keepdim=True)
        return features

    def get_text_features(self, input_ids, attention_mask=None):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        mask = mask.unsqueeze(-1).float()
        pooled = (self.text_embeddings(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.text_projection(pooled)
'''


def save_tiny_remote_code(
    folder: Path, corpus: list[str], seed: int = 0, batch_centered: bool = False
) -> Path:
    """A Hugging Face folder whose modelling code ships with it (``auto_map``), like jina-clip-v2:
    loadable only with ``trust_remote_code``."""
    from transformers import AutoConfig, AutoModel, CLIPImageProcessor

    tokenizer = _save_tiny_tokenizer(folder, corpus)
    (folder / "configuration_tiny_dual.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny_dual.py").write_text(REMOTE_MODEL)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "ccr_tiny_dual",
                "vocab_size": len(tokenizer),
                "batch_centered": batch_centered,
                "auto_map": {
                    "AutoConfig": "configuration_tiny_dual.TinyDualConfig",
                    "AutoModel": "modeling_tiny_dual.TinyDualModel",
                },
            }
        )
    )
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(seed)
    AutoModel.from_config(config, trust_remote_code=True).save_pretrained(folder)
    CLIPImageProcessor(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        image_mean=[0.5] * 3,
        image_std=[0.25] * 3,
    ).save_pretrained(folder)
    return folder


def save_tiny_mclip(folder: Path, corpus: list[str], width: int = 16, seed: int = 0) -> Path:
    """An M-CLIP text-encoder folder as the hub's: ``config.json`` naming the XLM-R ``modelBase``
    (a tiny one saved beside it) and the widths, weights ``transformer.*`` + ``LinearTransformation.*``,
    and its tokenizer. Its image tower is an open_clip model of embedding width ``width``."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    tokenizer = _save_tiny_tokenizer(folder, corpus)
    base = folder.parent / f"{folder.name}-xlmr-base"
    config = XLMRobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=40,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(base)
    torch.manual_seed(seed)
    transformer = XLMRobertaModel(config)
    projection = torch.nn.Linear(24, width)
    state = {
        **{f"transformer.{k}": v for k, v in transformer.state_dict().items()},
        **{f"LinearTransformation.{k}": v for k, v in projection.state_dict().items()},
    }
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "M-CLIP",
                "modelBase": str(base),
                "transformerDimensions": 24,
                "numDims": width,
            }
        )
    )
    return folder
