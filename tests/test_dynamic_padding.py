"""data.pad_to_multiple: training captions padded to the batch's longest caption (rounded up to a
multiple) instead of max_length, for the methods whose training is the same function of the
captions either way (clip); the others refuse it."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from test_datamodule import synthetic_cfg
from worlds import random_backbones

from ccr.datamodules.datamodule import CCRDataModule
from ccr.datamodules.datasets import TrainCollate
from ccr.datamodules.tokenization import train_offline_tokenizer
from ccr.methods.clip.module import CLIPModule

CONFIGS = Path(__file__).resolve().parents[1] / "ccr/experiments/configs"
CAPTIONS = [
    "a red circle",
    "two small blue squares above a green triangle on grass",
    "un cercle",
    "ein sehr kleines gelbes Dreieck links neben einem grossen roten Kreis",
    None,
    "x",
]


def info(pad_to_multiple=None, hf=False):
    data = SimpleNamespace(
        languages=["en", "de", "fr"],
        vocab_size=300,
        pad_token_id=1,
        cls_token_id=0,
        eos_token_id=2,
        mask_token_id=4,
        max_length=64,
        image_size=16,
        num_objects=0,
        pad_to_multiple=pad_to_multiple,
    )
    data.backbones = random_backbones(width=32, hf_text_for=data if hf else None)
    return data


def collate(pad_to_multiple):
    tokenizer = train_offline_tokenizer([c for c in CAPTIONS if c] * 3, vocab_size=300)
    return TrainCollate(
        tokenizer, 64, ["en", "de", "fr"], 0, False, pad_to_multiple=pad_to_multiple
    )


def items():
    image = torch.zeros(3, 16, 16)
    return [
        {
            "image": image + i,
            "texts": CAPTIONS[2 * i : 2 * i + 2] + ["x"],
            "id": str(i),
            "objects": [],
            "weak": False,
        }
        for i in range(3)
    ]


def test_a_trimmed_batch_keeps_every_token_and_drops_only_pad_columns_to_a_multiple():
    fixed, trimmed = collate(None)(items()), collate(8)(items())
    longest = int(fixed["attention_mask"].sum(-1).max())
    length = trimmed["input_ids"].shape[-1]
    assert (
        fixed["input_ids"].shape[-1] == 64 and length % 8 == 0 and longest <= length < longest + 8
    )
    assert torch.equal(trimmed["input_ids"], fixed["input_ids"][..., :length])
    assert torch.equal(trimmed["attention_mask"], fixed["attention_mask"][..., :length])
    assert not fixed["attention_mask"][..., length:].any()
    assert torch.equal(trimmed["present"], fixed["present"])


@pytest.mark.parametrize("hf", [False, True], ids=["tiny text encoder", "hf XLM-R text encoder"])
def test_clip_embeds_each_caption_and_scores_the_batch_the_same_with_trimmed_padding(hf):
    method = OmegaConf.load(CONFIGS / "method" / "clip.yaml").method
    base = OmegaConf.load(CONFIGS / "base.yaml")
    torch.manual_seed(0)
    module = CLIPModule(method, base.optim, info(pad_to_multiple=8, hf=hf), base.evaluation).eval()
    module.log = lambda *args, **kwargs: None
    fixed, trimmed = collate(None)(items()), collate(8)(items())
    assert trimmed["input_ids"].shape[-1] < 64
    with torch.no_grad():
        for k in range(3):
            rows = fixed["present"][:, k]  # an absent caption (all padding) is never encoded
            full = module.encode_texts(
                fixed["input_ids"][rows, k], fixed["attention_mask"][rows, k]
            )
            short = module.encode_texts(
                trimmed["input_ids"][rows, k], trimmed["attention_mask"][rows, k]
            )
            torch.testing.assert_close(short, full, rtol=1e-5, atol=1e-5)
        losses = []
        for batch in (fixed, trimmed):
            torch.manual_seed(1)  # the same language draws
            losses.append(module.training_step(batch, 0))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)


def test_a_method_not_checked_for_trimmed_padding_refuses_it_naming_the_key():
    from ccr.methods.ccrk.module import CCRk

    method = OmegaConf.load(CONFIGS / "method" / "ccrk.yaml").method
    method.ablation = None
    base = OmegaConf.load(CONFIGS / "base.yaml")
    with pytest.raises(ValueError, match="data.pad_to_multiple=8: CCRk is not checked"):
        CCRk(method, base.optim, info(pad_to_multiple=8), base.evaluation)


def test_the_datamodule_trims_training_batches_only_when_the_key_is_set(tmp_path):
    fixed = CCRDataModule(synthetic_cfg(tmp_path, num_workers=0, max_length=64), seed=0)
    trimmed = CCRDataModule(
        synthetic_cfg(tmp_path, num_workers=0, max_length=64, pad_to_multiple=8), seed=0
    )
    for module in (fixed, trimmed):
        module.prepare_data()
        module.setup("fit")
    assert trimmed.info.pad_to_multiple == 8 and fixed.info.pad_to_multiple is None
    lengths = set()
    for a, b in zip(fixed.train_dataloader(), trimmed.train_dataloader(), strict=True):
        length = b["input_ids"].shape[-1]
        lengths.add(length)
        assert a["input_ids"].shape[-1] == 64 and length % 8 == 0
        assert torch.equal(b["input_ids"], a["input_ids"][..., :length])
        assert not a["attention_mask"][..., length:].any()
        assert torch.equal(a["images"], b["images"])
    assert min(lengths) < 64  # some batch is shorter than max_length
