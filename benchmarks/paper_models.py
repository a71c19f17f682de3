"""Each method's paper-size architecture as a method config with random weights, built in code.

Nothing is downloaded: Hugging Face text models are built from an in-code config (the ``hf``
encoder with ``config``, as the paper-config tests do), timm image models with ``pretrained``
off, open_clip towers from an in-code CLIP config and RC3's mBART from its shape fields. The
vocabulary stays the paper's (250,002 for XLM-R): the MLM heads' cost depends on it. Token ids
come from the benchmark's data, whose special ids the configs take over. RC3's mBART takes its
vocabulary from the data's tokenizer (the world's, about 2,000 tokens), so its embeddings and LM
head are smaller than mBART-50's 250,054-token ones (360 M parameters instead of about 610 M).

``tiny=True`` keeps every method's structure (layer splits, fusion, heads) at a few units of width
so the benchmark runs on a CPU in seconds (its test).

mCLIP is left out: its teacher needs an XLM-R tokenizer read from the Hugging Face cache by name,
which a random-weight benchmark cannot build offline.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

# method -> the preset it is measured with (clip has no paper preset: its encoders are set below)
PAPER_PRESET = {
    "clip": "clip",
    "ccrk": "ccrk_paper",
    "covlr": "covlr_paper",
    "cl2cm": "cl2cm_paper",
    "rc3": "rc3_paper",
}

XLMR_BASE = {
    "model_type": "xlm-roberta",
    "vocab_size": 250002,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 514,
    "type_vocab_size": 1,
    "layer_norm_eps": 1e-5,
}
XLMR_LARGE = {
    **XLMR_BASE,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
}
MBERT_BASE = {
    "model_type": "bert",
    "vocab_size": 119547,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
}
# open_clip's ViT-B-32 (image tower used; the text tower is built but never called by cl2cm)
CLIP_VIT_B32 = {
    "embed_dim": 512,
    "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
}

TINY_TEXT = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32}
TINY_SWIN = {
    "patch_size": 4,
    "window_size": 4,
    "embed_dim": 8,
    "depths": [1, 1],
    "num_heads": [1, 2],
}
TINY_VIT = {"patch_size": 8, "embed_dim": 16, "depth": 1, "num_heads": 2}


def hf_text(config: dict, data: Any, tiny: bool, layers: int | None = None) -> dict:
    """The suite's ``hf`` encoder from an in-code config with ``data``'s special ids."""
    config = {
        **config,
        "pad_token_id": data.pad_token_id,
        "bos_token_id": data.cls_token_id,
        "eos_token_id": data.eos_token_id,
    }
    if tiny:
        config |= TINY_TEXT | {
            "num_hidden_layers": layers or 1,
            "vocab_size": data.vocab_size,
            "max_position_embeddings": data.max_length + data.pad_token_id + 1,
        }
    return {"name": "hf", "pretrained": None, "config": config}


def paper_method(method: str, preset: DictConfig, data: Any, tiny: bool = False) -> DictConfig:
    """``preset`` (the composed run's ``method`` section of ``PAPER_PRESET[method]``) with the paper's
    encoders at random init (or tiny ones), the full model (no ablation)."""
    if method not in PAPER_PRESET:
        raise ValueError(
            f"bench_gpu has no paper-size model for {method!r}; it measures {sorted(PAPER_PRESET)}"
        )
    m = OmegaConf.to_container(preset, resolve=True)
    if "ablation" in m:
        m["ablation"] = None
    size = data.image_size
    if (
        method == "clip"
    ):  # ViT-B/16 + XLM-R base, 512-d embeddings (the CLIP-style baseline at scale)
        m["embed_dim"] = 16 if tiny else 512
        m["image_encoder"] = {
            "name": "timm:vit_base_patch16_224",
            "pretrained": None,
            "options": {"img_size": size, **(TINY_VIT if tiny else {})},
        }
        m["text_encoder"] = hf_text(XLMR_BASE, data, tiny)
    elif method == "ccrk":  # Swin-B + XLM-R large split into text layers and fusion seed layers
        m["image_encoder"] = {
            **m["image_encoder"],
            "pretrained": None,
            "options": {
                **m["image_encoder"].get("options", {}),
                "img_size": size,
                **(TINY_SWIN if tiny else {}),
            },
        }
        m["text_encoder"] = {
            **hf_text(XLMR_LARGE, data, tiny, layers=24),
            "layers": m["text_encoder"]["layers"],
        }
        if tiny:
            m["embed_dim"], m["fusion"]["heads"] = 8, 2
    elif method == "covlr":  # Swin-B + adapter, mBERT base, two 6-layer cross-modal encoders
        m["image_encoder"] = {
            **m["image_encoder"],
            "pretrained": None,
            "options": {"img_size": size, **(TINY_SWIN if tiny else {})},
        }
        m["text_encoder"] = hf_text(MBERT_BASE, data, tiny)
        if tiny:
            m["embed_dim"], m["d_model"], m["cross_modal"] = 8, 16, {"layers": 1, "heads": 2}
    elif method == "cl2cm":  # CLIP ViT-B/32 image tower + mBERT base
        clip = OmegaConf.to_container(OmegaConf.create(CLIP_VIT_B32))
        if tiny:
            m["embed_dim"] = 16
            clip = {
                "embed_dim": 16,
                "vision_cfg": {
                    "image_size": size,
                    "layers": 1,
                    "width": 16,
                    "patch_size": 8,
                    "head_width": 8,
                },
                "text_cfg": {
                    "context_length": 8,
                    "vocab_size": 32,
                    "width": 8,
                    "heads": 1,
                    "layers": 1,
                },
            }
        else:
            clip["vision_cfg"]["image_size"] = size
        m["image_encoder"] = {**m["image_encoder"], "pretrained": None, "config": clip}
        m["text_encoder"] = hf_text(MBERT_BASE, data, tiny)
    elif method == "rc3":  # mBART-50 large shape, 32 px patches, random init
        m["backbone"]["pretrained"] = None
        m["backbone"]["max_positions"] = max(m["backbone"]["max_positions"], data.max_length + 2)
        if tiny:
            m["backbone"] |= {
                "d_model": 16,
                "heads": 2,
                "ffn_dim": 32,
                "encoder_layers": 1,
                "decoder_layers": 1,
                "patch_size": 8,
                "patch_embed_dim": 16,
            }
            m["first_stage"]["dim"] = 8
            m["anchors_per_task"] = 4
    return OmegaConf.create(m)
