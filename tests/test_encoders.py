"""Encoders: every backend gives the documented shapes, and local checkpoints load through the
same code path a user's pretrained weights take (tiny models saved to a temporary folder)."""

import pytest
import torch

from ccr.methods.layers.encoders import ImageEncoder, TextEncoder

TINY_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 64, "heads": 2, "layers": 2},
}


@pytest.fixture
def images():
    torch.manual_seed(0)
    return torch.randn(2, 3, 32, 32)


def test_tiny_image_encoder_returns_global_token_then_patches(images):
    encoder = ImageEncoder("tiny", image_size=32, patch_size=8, width=48, layers=1, heads=4)
    assert encoder(images).shape == (2, 1 + 16, 48)
    assert encoder.out_dim == 48


def test_tiny_image_encoder_loads_local_checkpoint(tmp_path, images):
    source = ImageEncoder("tiny", layers=1).eval()
    torch.save(source.backbone.state_dict(), tmp_path / "tiny.pt")
    loaded = ImageEncoder("tiny", str(tmp_path / "tiny.pt"), layers=1).eval()
    torch.testing.assert_close(loaded(images), source(images))


def test_timm_vit_keeps_cls_first_and_loads_saved_weights(tmp_path, images):
    import timm

    reference = timm.create_model("test_vit", num_classes=10, img_size=32).eval()
    torch.save(
        reference.state_dict(), tmp_path / "vit.pth"
    )  # with a classifier head the encoder drops
    encoder = ImageEncoder(
        "timm:test_vit", str(tmp_path / "vit.pth"), options={"img_size": 32}
    ).eval()
    tokens = encoder(images)
    features = reference.forward_features(images)
    prefix = reference.num_prefix_tokens
    assert tokens.shape == (2, 1 + features.shape[1] - prefix, encoder.out_dim)
    torch.testing.assert_close(tokens[:, 0], features[:, 0])
    torch.testing.assert_close(tokens[:, 1:], features[:, prefix:])


def test_timm_resnet_flattens_grid_and_prepends_average(images):
    encoder = ImageEncoder("timm:test_resnet").eval()
    tokens = encoder(images)
    grid = encoder.backbone.model.forward_features(images)  # [B, C, h, w]
    assert tokens.shape == (2, 1 + grid.shape[2] * grid.shape[3], grid.shape[1])
    torch.testing.assert_close(tokens[:, 0], grid.mean((2, 3)))
    torch.testing.assert_close(tokens[:, 1], grid[:, :, 0, 0])


def test_timm_swin_uses_channels_last_grid(images):
    options = {
        "img_size": 32,
        "embed_dim": 16,
        "depths": (1, 1),
        "num_heads": (1, 2),
        "window_size": 4,
    }
    encoder = ImageEncoder("timm:swin_tiny_patch4_window7_224", options=options).eval()
    tokens = encoder(images)
    grid = encoder.backbone.model.forward_features(images)  # [B, h, w, C]
    assert tokens.shape == (2, 1 + grid.shape[1] * grid.shape[2], 32)
    torch.testing.assert_close(tokens[:, 0], grid.mean((1, 2)))


def test_timm_checkpoint_mismatch_is_a_clear_error(tmp_path):
    torch.save({"unrelated.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt: checkpoint does not match"):
        ImageEncoder("timm:test_vit", str(tmp_path / "bad.pt"), options={"img_size": 32})


def test_open_clip_towers_from_in_code_config_match_encode_image_and_text(tmp_path, images):
    import open_clip

    clip = open_clip.CLIP(**TINY_CLIP).eval()
    torch.save(clip.state_dict(), tmp_path / "clip.pt")
    image_encoder = ImageEncoder(
        "open_clip:tiny", str(tmp_path / "clip.pt"), config=TINY_CLIP
    ).eval()
    tokens = image_encoder(images)
    assert tokens.shape == (2, 1 + 16, 32) and image_encoder.out_dim == 32
    torch.testing.assert_close(tokens[:, 0], clip.encode_image(images))

    text_encoder = TextEncoder("open_clip:tiny", str(tmp_path / "clip.pt"), config=TINY_CLIP).eval()
    ids = torch.randint(1, 98, (3, 16))
    ids[:, 0], ids[:, 6], ids[:, 7:] = 98, 99, 0  # <start> ... <end> then padding (argmax pooling)
    out = text_encoder(ids, (ids != 0).long())
    assert out.states.shape == (3, 16, 32) and text_encoder.out_dim == 32
    torch.testing.assert_close(out.pooled, clip.encode_text(ids))
    unprojected = TextEncoder("open_clip:tiny", config=TINY_CLIP, project=False)
    assert unprojected.out_dim == 64


def test_tiny_text_encoder_masks_padding():
    torch.manual_seed(0)
    encoder = TextEncoder(
        "tiny", vocab_size=50, pad_token_id=0, max_length=12, width=32, layers=2, heads=4
    ).eval()
    ids = torch.tensor([[1, 7, 8, 2, 0, 0]])
    short = encoder(ids[:, :4], torch.ones(1, 4, dtype=torch.long))
    padded = encoder(ids, (ids != 0).long())
    assert padded.states.shape == (1, 6, 32) and padded.mask.tolist() == [[True] * 4 + [False] * 2]
    torch.testing.assert_close(padded.states[:, :4], short.states)
    torch.testing.assert_close(padded.pooled, padded.states[:, 0])


def test_tiny_text_encoder_from_config_takes_vocabulary_from_data_info():
    class Info:
        vocab_size, pad_token_id, max_length = 77, 3, 9

    encoder = TextEncoder.from_config({"name": "tiny", "width": 16, "heads": 2}, Info())
    assert encoder.input_embeddings().num_embeddings == 77
    assert encoder.input_embeddings().padding_idx == 3
    with pytest.raises(ValueError, match="max_length 9"):
        encoder(torch.ones(1, 10, dtype=torch.long), torch.ones(1, 10))


def _tiny_xlmr_config():
    from transformers import XLMRobertaConfig

    return XLMRobertaConfig(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        pad_token_id=1,
    )


def test_hf_encoder_loads_saved_model_and_keeps_a_layer_subset(tmp_path):
    from transformers import XLMRobertaModel

    torch.manual_seed(0)
    reference = XLMRobertaModel(_tiny_xlmr_config()).eval()
    reference.save_pretrained(tmp_path / "xlmr")
    ids = torch.tensor([[0, 5, 6, 7, 2], [0, 9, 2, 1, 1]])
    mask = (ids != 1).long()

    encoder = TextEncoder(f"hf:{tmp_path / 'xlmr'}").eval()
    out = encoder(ids, mask)
    expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out.states, expected)
    torch.testing.assert_close(out.pooled, expected[:, 0])
    assert encoder.out_dim == 32 and encoder.backbone.model.pooler is None

    subset = TextEncoder(f"hf:{tmp_path / 'xlmr'}", layers=[1, 3]).eval()
    kept = subset.backbone.model.encoder.layer
    assert len(kept) == 2 and kept[1] is not None
    torch.testing.assert_close(kept[1].state_dict(), reference.encoder.layer[3].state_dict())
    with pytest.raises(ValueError, match="out of range"):
        TextEncoder(f"hf:{tmp_path / 'xlmr'}", layers=[4])


def test_hf_encoder_from_config_dict_is_random_init():
    config = _tiny_xlmr_config().to_dict()
    encoder = TextEncoder(
        "hf",
        config={
            k: config[k]
            for k in (
                "model_type",
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
                "pad_token_id",
            )
        },
    )
    out = encoder(torch.tensor([[0, 4, 2]]), torch.ones(1, 3))
    assert out.states.shape == (1, 3, 32)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="'tiny', 'timm:<model>'"):
        ImageEncoder("resnet50")
    with pytest.raises(ValueError, match="'tiny', 'hf:<model>'"):
        TextEncoder("bert")


def test_a_loaded_hf_encoder_starts_in_train_mode_like_every_other_module(tmp_path):
    """``from_pretrained`` returns its model in eval mode. Inside a training module that left the
    text encoder without dropout until Lightning's first validation switched everything to train
    mode, so a run resumed after that point (rebuilt: eval again) trained differently."""
    from transformers import XLMRobertaModel

    XLMRobertaModel(_tiny_xlmr_config()).save_pretrained(tmp_path / "xlmr")
    encoder = TextEncoder(name=f"hf:{tmp_path / 'xlmr'}", pretrained=True)
    assert all(module.training for module in encoder.modules())


def _truncated_safetensors(path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    return path


@pytest.mark.parametrize(
    "content, reason",
    [
        ([1, 2, 3], r"not a state dict \(it holds a list\)"),
        (
            {"model": {"visual.proj": 3}},
            r"not a state dict \(entry 'visual\.proj' is int, not a tensor\)",
        ),
    ],
)
def test_a_weights_file_that_is_not_a_state_dict_is_named(tmp_path, content, reason):
    path = tmp_path / "weights.pt"
    torch.save(content, path)
    with pytest.raises(ValueError, match=rf"{path}: {reason}"):
        ImageEncoder("open_clip:tiny", str(path), config=TINY_CLIP)


def test_a_truncated_safetensors_file_is_named(tmp_path):
    path = _truncated_safetensors(tmp_path / "weights.safetensors")
    with pytest.raises(ValueError, match=rf"{path}: not a readable safetensors file"):
        ImageEncoder("timm:test_vit", str(path), options={"img_size": 32})


def test_open_clip_by_name_with_a_local_file_that_is_not_a_state_dict_is_named(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(ValueError, match=rf"{path}: not a state dict \(it holds a list\)"):
        ImageEncoder("open_clip:ViT-B-32", str(path))


def test_a_missing_hf_model_folder_is_named(tmp_path):
    missing = tmp_path / "xlm-roberta-large"
    with pytest.raises(FileNotFoundError, match=rf"hf:{missing}: no such model folder"):
        TextEncoder(f"hf:{missing}", True)
