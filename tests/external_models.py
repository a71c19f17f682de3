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
    config = {"model_cfg": TINY_OPEN_CLIP,
              "preprocess_cfg": {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}}
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
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1,
                            special_tokens=["<pad>", "<s>", "</s>"])
    bpe.post_processor = TemplateProcessing(single="<s> $A </s>",
                                            special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", model_max_length=32)
    tokenizer.save_pretrained(folder)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=8),
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder
