"""Tiny RC3 modules and batches for the rc3 tests (no world, no downloads)."""

from dataclasses import dataclass

import torch
from omegaconf import open_dict

from ccr.experiments.config import compose
from ccr.methods.rc3.module import PRETRAIN, RC3

B, K, L, VOCAB, IMAGE = 8, 3, 12, 60, 16
LANGUAGES = ("en", "de", "ja")


@dataclass
class Info:
    languages: tuple = LANGUAGES
    vocab_size: int = VOCAB
    pad_token_id: int = 1
    cls_token_id: int = 0
    eos_token_id: int = 2
    mask_token_id: int = 4
    max_length: int = L
    image_size: int = IMAGE
    num_objects: int = 0


TINY = [
    "method.backbone.pretrained=null",
    "method.backbone.d_model=32",
    "method.backbone.heads=2",
    "method.backbone.ffn_dim=64",
    "method.backbone.dropout=0.0",
    "method.first_stage.dim=16",
    "method.visual.roi_dim=8",
    "method.visual.strict_input=patch",
    "method.visual.regions=null",
    "method.first_stage.image_encoder=null",
    "method.first_stage.text_encoder=null",
]


def config(*overrides):
    return compose(["method=rc3", *TINY, *overrides])


def build(*overrides, seed=0, phase=PRETRAIN):
    cfg = config(*overrides)
    torch.manual_seed(seed)
    return RC3(cfg.method, cfg.optim, Info(), cfg.evaluation, phase=phase)


def with_tiny_regions(*overrides, phase=PRETRAIN):
    """RC3-ROI whose regions come from a random tiny ViT (width 8, 16 px images: 4 regions)."""
    cfg = config("method.visual.strict_input=roi", *overrides)
    with open_dict(cfg):
        cfg.method.visual.regions = {"name": "tiny", "width": 8, "layers": 1, "heads": 2}
    torch.manual_seed(0)
    return RC3(cfg.method, cfg.optim, Info(), cfg.evaluation, phase=phase)


def captions(gen, n=B, length=L):
    ids = torch.randint(5, VOCAB, (n, length), generator=gen)
    lengths = torch.randint(4, length + 1, (n,), generator=gen)
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids[:, 0] = Info.cls_token_id
    ids.scatter_(1, (lengths - 1)[:, None], Info.eos_token_id)
    ids[mask == 0] = Info.pad_token_id
    return ids, mask


def train_batch(seed=0, weak=None, n=B):
    """A training batch: n instances, K languages each present; ``weak`` a list of bools."""
    gen = torch.Generator().manual_seed(seed)
    ids, masks = zip(*(captions(gen, n) for _ in range(K)), strict=True)
    batch = {
        "images": torch.randn(n, 3, IMAGE, IMAGE, generator=gen),
        "input_ids": torch.stack(ids, 1),
        "attention_mask": torch.stack(masks, 1),
        "present": torch.ones(n, K, dtype=torch.bool),
        "languages": list(LANGUAGES),
        "ids": [f"r{i}" for i in range(n)],
    }
    if weak is not None:
        batch["alignment_weak"] = torch.tensor(weak, dtype=torch.bool)
    return batch


def parallel_batch(seed=0, n=B):
    gen = torch.Generator().manual_seed(seed + 100)
    src, src_mask = captions(gen, n)
    tgt, tgt_mask = captions(gen, n)
    return {
        "src_input_ids": src,
        "src_attention_mask": src_mask,
        "tgt_input_ids": tgt,
        "tgt_attention_mask": tgt_mask,
        "src_language": "en",
        "tgt_language": "de",
    }
