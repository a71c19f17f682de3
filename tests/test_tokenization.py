"""Tokenizers: the offline byte-level BPE (ja/zh included), its cache, and the HF wrapper."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from ccr.datamodules.tokenization import (
    SPECIAL_TOKENS,
    OfflineTokenizer,
    PretrainedTokenizer,
    build_tokenizer,
    train_offline_tokenizer,
)

CORPUS = [
    "A small red circle on the left.",
    "There is a large blue square at the top.",
    "Ein kleiner roter Kreis links und ein großes blaues Quadrat.",
    "Il y a une petite étoile blanche à gauche.",
    "Na obrázku je malá bílá hvězda vlevo.",
    "左に小さい赤い円があります。",
    "背景は草で、大きい青い四角形が写っている画像。",
    "左边有一个小的红色圆形。",
    "这张图片显示了一个大的蓝色正方形。",
] * 20


@pytest.fixture(scope="module")
def tokenizer() -> OfflineTokenizer:
    return train_offline_tokenizer(CORPUS, vocab_size=400)


def test_special_token_ids(tokenizer):
    ids = [
        tokenizer.cls_token_id,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        tokenizer.mask_token_id,
    ]
    assert ids == [0, 1, 2, 4]
    assert [tokenizer.raw.id_to_token(i) for i in range(5)] == SPECIAL_TOKENS
    assert tokenizer.vocab_size == tokenizer.raw.get_vocab_size() > 256


def test_batch_layout(tokenizer):
    out = tokenizer(["A small red circle.", "左边有一个小的红色圆形。", ""], max_length=24)
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == mask.shape == (3, 24) and ids.dtype == mask.dtype == torch.long
    for row in range(3):
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert ids[row, 0] == tokenizer.cls_token_id and ids[row, n - 1] == tokenizer.eos_token_id
        assert (ids[row, n:] == tokenizer.pad_token_id).all()
    assert int(mask[2].sum()) == 2  # an empty text is <s> </s>


def test_truncation_keeps_eos_last(tokenizer):
    out = tokenizer(["背景は草で、大きい青い四角形が写っている画像。" * 3], max_length=10)
    assert out["attention_mask"].sum() == 10 and out["input_ids"][0, -1] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    "text",
    [
        "左に小さい赤い円があります。",
        "这张图片显示了一个大的蓝色正方形。",
        "東京タワーの夜景",
        "猫がソファで寝ている",
        "一只狗在草地上奔跑",
    ],
)
def test_japanese_and_chinese_round_trip_without_unknown(tokenizer, text):
    ids = tokenizer([text], max_length=64)["input_ids"][0]
    content = ids[(ids != tokenizer.pad_token_id)][1:-1].tolist()
    assert content and 3 not in content  # never <unk>, even for characters not in the corpus
    assert tokenizer.decode(content) == text


def test_cjk_merges_stop_at_characters_while_words_merge():
    roomy = train_offline_tokenizer(CORPUS, vocab_size=2000)  # room to merge everything it can
    ids = roomy.raw.encode("小さい赤い円があります", add_special_tokens=False).ids
    assert [roomy.decode([i]) for i in ids] == list("小さい赤い円があります")
    words = [
        roomy.decode([i])
        for i in roomy.raw.encode("A small red circle", add_special_tokens=False).ids
    ]
    assert words == ["A", " small", " red", " circle"]


def test_unseen_scripts_fall_back_to_bytes(tokenizer):
    text = "한국어 🙂 Ünïcödé"
    ids = tokenizer.raw.encode(text, add_special_tokens=False).ids
    assert 3 not in ids and tokenizer.decode(ids) == text


def test_offline_tokenizer_is_cached_by_corpus(tmp_path, monkeypatch):
    cfg = {"name": "offline", "vocab_size": 300}
    first = build_tokenizer(cfg, corpus=CORPUS, cache_dir=tmp_path)
    cached = list(tmp_path.glob("tokenizer-*.json"))
    assert len(cached) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("retrained although cached")

    monkeypatch.setattr("ccr.datamodules.tokenization.train_offline_tokenizer", no_training)
    again = build_tokenizer(cfg, corpus=CORPUS, cache_dir=tmp_path)
    assert again.raw.get_vocab() == first.raw.get_vocab()
    monkeypatch.undo()
    build_tokenizer(cfg, corpus=CORPUS + ["a new caption"], cache_dir=tmp_path)
    assert len(list(tmp_path.glob("tokenizer-*.json"))) == 2


def test_offline_tokenizer_needs_a_corpus():
    with pytest.raises(ValueError, match="pass corpus"):
        build_tokenizer({"name": "offline", "vocab_size": 300})


def test_pretrained_tokenizer_from_a_local_folder(tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.raw,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
    )
    hf.save_pretrained(tmp_path / "tiny")
    loaded = build_tokenizer({"name": str(tmp_path / "tiny"), "vocab_size": 0})
    assert isinstance(loaded, PretrainedTokenizer)
    assert (
        loaded.cls_token_id,
        loaded.pad_token_id,
        loaded.eos_token_id,
        loaded.mask_token_id,
    ) == (0, 1, 2, 4)
    assert loaded.vocab_size == tokenizer.vocab_size
    texts = ["左边有一个小的红色圆形。", "A small red circle on the left."]
    ours, theirs = tokenizer(texts, 20), loaded(texts, 20)
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    assert theirs["input_ids"].dtype == torch.long


def test_pretrained_tokenizer_without_pad_or_mask_falls_back(tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_str(tokenizer.raw.to_str())
    raw.no_padding()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.save_pretrained(tmp_path / "nopad")
    loaded = PretrainedTokenizer(str(tmp_path / "nopad"))
    assert (loaded.cls_token_id, loaded.pad_token_id, loaded.mask_token_id) == (0, 2, 3)
    out = loaded(["A small red circle."], 16)
    n = int(out["attention_mask"][0].sum())
    assert (out["input_ids"][0, n:] == 2).all()


def test_data_presets_need_no_download(monkeypatch):
    """Presets with training captions use the suite's own tokenizer; the others name a hub
    tokenizer and fail at once, offline, saying what to use instead."""
    import socket
    import time

    from ccr.experiments.config import available, compose

    def no_network(*args, **kwargs):
        raise AssertionError("a preset tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    for name in available("data"):
        cfg = compose([f"data={name}"])
        if cfg.data.splits.train is not None:
            assert cfg.data.tokenizer.name == "offline", name
            continue
        started = time.perf_counter()
        with pytest.raises(
            ValueError, match=r"not in the local cache.*data\.tokenizer\.name=offline"
        ):
            build_tokenizer(cfg.data.tokenizer)
        assert time.perf_counter() - started < 10
