"""The paper preset (rc3_paper.yaml) builds from a tiny mBART saved locally (no download), keeps its
weights, appends the language tags and specials, and trains one step."""

import pytest
import torch
from rc3_helpers import Info, parallel_batch, train_batch
from transformers import MBartConfig, MBartModel

from ccr.experiments.config import compose
from ccr.methods.rc3.module import RC3


def saved_mbart(folder, vocab):
    torch.manual_seed(0)
    config = MBartConfig(
        vocab_size=vocab,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        scale_embedding=True,
        pad_token_id=Info.pad_token_id,
        bos_token_id=Info.cls_token_id,
        eos_token_id=Info.eos_token_id,
    )
    model = MBartModel(config)
    model.save_pretrained(folder)
    return model


def paper(folder, *overrides):
    cfg = compose(
        [
            "method=rc3_paper",
            f"method.backbone.pretrained={folder}",
            "method.anchors_per_task=8",
            *overrides,
        ]
    )
    return RC3(cfg.method, cfg.optim, Info(image_size=64), cfg.evaluation)


def test_paper_preset_loads_the_local_mbart_and_steps_once(tmp_path):
    saved = saved_mbart(tmp_path / "mbart", Info.vocab_size)
    module = paper(tmp_path / "mbart")
    net = module.net
    assert net.d_model == 32 and net.visual.patch_embed.weight.shape == (768, 3 * 32 * 32)
    assert net.vocab_size == Info.vocab_size + 3 + 3  # + tags en/de/ja + [CLS] [SEP] [SEP']
    layer = "encoder.layers.0.fc1.weight"
    assert torch.equal(net.model.state_dict()[layer], saved.state_dict()[layer])
    shared = net.model.shared.weight
    assert torch.equal(shared[: Info.vocab_size], saved.shared.weight)
    assert torch.equal(shared[net.special_ids["cls"]], saved.shared.weight[Info.cls_token_id])
    assert torch.equal(shared[net.special_ids["sep"]], saved.shared.weight[Info.eos_token_id])
    before = net.model.state_dict()[layer].clone()
    optimiser = torch.optim.AdamW(module.parameters(), lr=1e-3)
    batch = train_batch(weak=[i % 2 == 1 for i in range(8)])
    batch["images"] = torch.randn(8, 3, 64, 64)
    torch.manual_seed(0)
    total = module.total_loss(module.losses(batch, parallel_batch()))
    total.backward()
    optimiser.step()
    assert torch.isfinite(total)
    assert not torch.equal(net.model.state_dict()[layer], before)


def test_a_missing_checkpoint_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="method.backbone.pretrained"):
        paper(tmp_path / "absent")


def test_a_tokenizer_mismatch_is_a_clear_error(tmp_path):
    saved_mbart(tmp_path / "mbart", Info.vocab_size + 5)
    with pytest.raises(ValueError, match="data tokenizer"):
        paper(tmp_path / "mbart")
