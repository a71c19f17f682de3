"""FusionEncoder (text attends to image) and the projection / ITM / MLM heads."""

import pytest
import torch
from torch import nn

from ccr.methods.layers.fusion import FusionEncoder
from ccr.methods.layers.heads import ITMHead, MLMHead, ProjectionHead


@pytest.fixture
def fusion():
    torch.manual_seed(0)
    return FusionEncoder(width=32, image_dim=24, layers=2, heads=4).eval()


def test_fusion_keeps_text_shape_and_depends_on_the_image(fusion):
    text, image = torch.randn(3, 5, 32), torch.randn(3, 7, 24)
    mask = torch.ones(3, 5, dtype=torch.bool)
    out = fusion(text, mask, image)
    assert out.shape == (3, 5, 32)
    assert not torch.allclose(out, fusion(text, mask, image.flip(0)))


def test_fusion_ignores_masked_text_and_image_tokens(fusion):
    text, image = torch.randn(1, 5, 32), torch.randn(1, 7, 24)
    text_mask = torch.tensor([[True, True, True, False, False]])
    image_mask = torch.tensor([[True] * 4 + [False] * 3])
    out = fusion(text, text_mask, image, image_mask)
    changed = fusion(
        torch.cat([text[:, :3], torch.randn(1, 2, 32)], 1),
        text_mask,
        torch.cat([image[:, :4], torch.randn(1, 3, 24)], 1),
        image_mask,
    )
    torch.testing.assert_close(out[:, :3], changed[:, :3])
    torch.testing.assert_close(out[:, :3], fusion(text[:, :3], text_mask[:, :3], image[:, :4]))


def test_projection_head_normalises_only_when_asked():
    x = torch.randn(4, 16)
    assert torch.allclose(ProjectionHead(16, 8)(x).norm(dim=-1), torch.ones(4))
    raw = ProjectionHead(16, 8, normalize=False)(x)
    assert raw.shape == (4, 8) and not torch.allclose(raw.norm(dim=-1), torch.ones(4))


def test_itm_head_gives_two_logits():
    head = ITMHead(16, 32)
    assert head(torch.randn(5, 16)).shape == (5, 2)
    assert head.mlp[0].out_features == 32 and isinstance(head.mlp[1], nn.LayerNorm)


def test_mlm_head_ties_decoder_to_embeddings():
    embeddings = nn.Embedding(50, 16)
    head = MLMHead(16, 50, tie_to=embeddings)
    assert head.decoder.weight is embeddings.weight
    assert head(torch.randn(2, 3, 16)).shape == (2, 3, 50)
    with pytest.raises(ValueError, match="cannot tie"):
        MLMHead(16, 60, tie_to=embeddings)
