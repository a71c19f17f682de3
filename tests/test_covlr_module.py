"""The CoVLR module (spec covlr.md): registration, parameter groups, gradient routing, the ablation
switches, and what reaches each loss. The tiny setup here (spec §2.3 sizes, dropout 0, fp32) is
shared by the other covlr tests."""

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from methods.covlr import CoVLR

CONFIG = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "method" / "covlr.yaml"
B, K, L, VOCAB, IMAGE, CLASSES = 8, 3, 16, 120, 32, 10
OPTIM = OmegaConf.create({"lr": 1e-3, "weight_decay": 0.02, "betas": [0.9, 0.98], "eps": 1e-6,
                          "warmup_steps": 2, "min_lr_ratio": 0.01})
EVALUATION = OmegaConf.create({"ks": [1, 5, 10], "ndcg_k": 10, "chunk_size": 1024, "rerank_k": 0})


@dataclass
class Info:
    languages: tuple = ("de", "en", "ja")
    vocab_size: int = VOCAB
    pad_token_id: int = 1
    cls_token_id: int = 0
    eos_token_id: int = 2
    mask_token_id: int = 4
    max_length: int = L
    image_size: int = IMAGE
    num_objects: int = CLASSES


def method_config(**overrides):
    """covlr.yaml at the spec's tiny test sizes, plus ``overrides``."""
    tiny = {"embed_dim": 32, "cross_modal": {"layers": 1, "heads": 2}}
    return OmegaConf.merge(OmegaConf.load(CONFIG), tiny, overrides)


def build(num_objects=CLASSES, **overrides):
    torch.manual_seed(0)
    module = CoVLR(method_config(**overrides), OPTIM, Info(num_objects=num_objects), EVALUATION)
    module.log = module.log_dict = lambda *args, **kwargs: None  # no trainer attached here
    return module


def training_batch(seed=0, batch=B, languages=K, absent=(), labels=True):
    """A docs/interfaces.md training batch: ids [B, K, L] with <s> first and </s> last, objects."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch, languages, L), generator=gen)
    lengths = torch.randint(4, L + 1, (batch, languages), generator=gen)
    mask = (torch.arange(L) < lengths[..., None]).long()
    ids[..., 0] = Info.cls_token_id
    ids.scatter_(2, (lengths - 1)[..., None], Info.eos_token_id)
    ids[mask == 0] = Info.pad_token_id
    present = torch.ones(batch, languages, dtype=torch.bool)
    for instance, language in absent:
        present[instance, language] = False
        ids[instance, language] = Info.pad_token_id
        mask[instance, language] = 0
    out = {"images": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen), "input_ids": ids,
           "attention_mask": mask, "present": present, "languages": list(Info.languages)[:languages],
           "ids": [str(i) for i in range(batch)]}
    if labels:
        objects = (torch.rand(batch, CLASSES, generator=gen) < 0.3).long()
        objects[0] = 0  # one unlabelled image: masked out of the classification loss
        objects[1, 0] = 1
        out["objects"] = objects
    return out


def grads(module):
    """Name -> gradient clone (zeros where a parameter got none)."""
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()}
