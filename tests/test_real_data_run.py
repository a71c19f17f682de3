"""The README's real-data commands: a CPU preset's `world` encoders are refused on real data before
anything is read, naming the keys and the fix, and a paper preset pointed at local model folders
trains and scores a real-format dataset with nothing downloaded."""

from __future__ import annotations

import gzip
import json
import socket
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict
from PIL import Image

from ccr.experiments import train as train_cli
from ccr.experiments.config import compose
from ccr.experiments.train import train

LANGUAGES = ("en", "de")
SPLITS = {"train": 8, "val": 4, "test_2016_flickr": 4}
TINY_XLMR = {
    "hidden_size": 32,
    "num_hidden_layers": 24,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 40,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
TINY_SWIN = {
    "img_size": 32,
    "patch_size": 4,
    "window_size": 4,
    "embed_dim": 16,
    "depths": [1, 1],
    "num_heads": [1, 2],
}
WORDS = ("dog", "cat", "red", "blue", "ball", "grass", "runs", "sits")


def save_multi30k(root: Path) -> Path:
    """Multi30K task 1 in its released layout: image lists, gzipped captions, images/."""
    task = root / "data" / "task1"
    (task / "image_splits").mkdir(parents=True)
    (task / "raw").mkdir()
    (root / "images").mkdir()
    index = 0
    for split, count in SPLITS.items():
        names = [f"{1000 + index + i}.jpg" for i in range(count)]
        (task / "image_splits" / f"{split}.txt").write_text("\n".join(names) + "\n")
        for lang in LANGUAGES:
            lines = [
                f"{lang} {WORDS[(index + i) % 8]} {WORDS[(index + i + 3) % 8]}"
                for i in range(count)
            ]
            with gzip.open(task / "raw" / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        for i, name in enumerate(names):
            colour = ((index + i) * 37 % 256, (index + i) * 91 % 256, 128)
            Image.new("RGB", (40, 40), colour).save(root / "images" / name)
        index += count
    return root


def save_xlmr_folder(folder: Path) -> Path:
    """A tiny 24-layer XLM-R model folder with its own tokenizer (save_pretrained layout)."""
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast, XLMRobertaConfig, XLMRobertaModel

    folder.mkdir(parents=True)
    bpe = ByteLevelBPETokenizer()
    corpus = [f"{lang} {a} {b}" for lang in LANGUAGES for a in WORDS for b in WORDS]
    bpe.train_from_iterator(
        corpus,
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    bpe.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
        model_max_length=40,
    )
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    XLMRobertaModel(
        XLMRobertaConfig(vocab_size=len(tokenizer), pad_token_id=1, **TINY_XLMR),
        add_pooling_layer=False,
    ).save_pretrained(folder)
    return folder


def save_swin_weights(path: Path) -> Path:
    """The state dict of a tiny Swin built under the paper preset's timm name (safetensors)."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = timm.create_model(
        "swin_base_patch4_window7_224", pretrained=False, num_classes=0, **TINY_SWIN
    )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the run tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    "method, extra, keys",
    [
        ("ccrk", [], "method.image_encoder.name=world, method.text_encoder.name=world"),
        (
            "mclip",
            [],
            (
                "method.teacher.clip.image_encoder.name=world, method.teacher.clip.text_encoder.name="
                "world, method.mte.name=world"
            ),
        ),
        # sections the run never builds are not named: mCLIP without its trained teacher
        ("mclip", ["method.stages=[mte_nmt,mte_ctl,trikd]"], "method.mte.name=world:"),
        # RC3's grid regions stand in only when the data ships no ROI features
        (
            "rc3",
            ["data.roi_features=/rois"],
            (
                "method.backbone.pretrained=world, "  # the world's denoising-pretrained mBART
                "method.first_stage.image_encoder.name=world, "
                "method.first_stage.text_encoder.name=world:"
            ),
        ),
    ],
)
def test_world_encoders_on_real_data_are_refused_first_naming_the_keys_and_the_fix(
    tmp_path, capsys, method, extra, keys
):
    missing_root = tmp_path / "no-such-dataset"  # nothing is read: the folder does not exist
    with pytest.raises(SystemExit) as stop:
        train_cli.main(
            [
                f"method={method}",
                "data=multi30k",
                f"data.root={missing_root}",
                f"run_dir={tmp_path / 'runs'}",
                *extra,
            ]
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {keys}") and "\n" not in err
    assert f"METHOD={method}_paper" in err and "data=multi30k" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "method, key",
    [
        ("ccrk_paper", "method.text_encoder.name=hf:xlm-roberta-large"),
        ("covlr_paper", "method.text_encoder.name=hf:bert-base-multilingual-cased"),
        ("mclip_paper", "method.mte.name=hf:xlm-roberta-base"),
    ],
)
def test_a_pretrained_text_encoder_with_the_suites_own_tokenizer_is_refused_first(
    tmp_path, capsys, method, key
):
    """Its embedding rows are indexed by its own tokenizer's ids: the offline BPE's ids would
    train and score silently wrong inputs."""
    with pytest.raises(SystemExit) as stop:
        train_cli.main(
            [
                f"method={method}",
                "data=multi30k",
                f"data.root={tmp_path / 'none'}",
                f"run_dir={tmp_path / 'runs'}",
            ]
        )
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    name = key.split("=hf:")[1]
    assert err == (
        f"error: {key} reads the token ids of its own tokenizer, but data.tokenizer.name"
        f"=offline (the suite's BPE); set data.tokenizer.name={name} (or its local folder)"
    )


@pytest.mark.slow
def test_the_readme_paper_preset_command_trains_on_real_data_from_local_folders_offline(
    tmp_path, no_network
):
    data = save_multi30k(tmp_path / "multi30k")
    xlmr = save_xlmr_folder(tmp_path / "models" / "xlm-roberta-large")
    swin = save_swin_weights(tmp_path / "models" / "swin_base_22k.safetensors")
    readme_args = [  # docs/datasets.md "Training on real data", as written
        "method=ccrk_paper",
        "data=multi30k",
        f"data.root={data}",
        "data.languages=[en,de]",
        f"method.image_encoder.pretrained={swin}",
        f"method.text_encoder.name=hf:{xlmr}",
        f"data.tokenizer.name={xlmr}",
    ]
    run = [
        "data.image_size=32",
        "data.max_length=16",
        "data.batch_size=4",
        "data.eval_batch_size=4",
        "data.num_workers=0",
        "trainer.max_steps=2",
        "trainer.progress_refresh_rate=0",
        "trainer.cpu_threads=1",
        f"run_dir={tmp_path / 'runs'}",
        "run_id=readme",
    ]
    cfg = compose(readme_args + run)
    with open_dict(cfg):  # the paper architectures at test size (keys the preset does not declare)
        cfg.method.image_encoder.options.update(TINY_SWIN)
        cfg.method.fusion.heads, cfg.method.embed_dim = 4, 16
    train(cfg)
    result = json.loads((tmp_path / "runs/multi30k/ccrk_paper/readme/metrics.json").read_text())
    assert result["train_steps"] == 2 and set(result["languages"]) == {"en", "de"}
    assert "en/i2t/R@1" in result["metrics"]
