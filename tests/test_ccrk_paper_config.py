"""The paper-scale config (ccrk_paper.yaml) built at tiny width: Swin image tokens, an XLM-R model split
into text layers 1,3,...,11 and fusion layers seeded from 13,15,...,23, one training step (spec §2)."""

from pathlib import Path

import torch
from omegaconf import OmegaConf
from test_ccrk_module import EVALUATION, OPTIM, VOCAB, Info, training_batch
from transformers import AutoConfig, AutoModel

from ccr.methods.ccrk.fusion_init import fusion_from_hf_layers
from ccr.methods.ccrk.module import CCRk

PAPER = Path(__file__).resolve().parents[1] / "ccr/experiments/configs/method/ccrk_paper.yaml"
TINY_XLMR = {
    "model_type": "xlm-roberta",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 24,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 40,
    "pad_token_id": 1,
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


def tiny_xlmr(seed=0):
    torch.manual_seed(seed)
    return AutoModel.from_config(AutoConfig.for_model(**TINY_XLMR)).eval()


def test_fusion_layer_copies_self_attention_and_ffn_of_an_hf_layer():
    hf_layer = tiny_xlmr().encoder.layer[5]
    fusion_layer = fusion_from_hf_layers(
        [hf_layer], width=32, image_dim=16, heads=4, mlp_ratio=2.0
    ).layers[0]
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        ours = fusion_layer.norm_self(x + fusion_layer.self_attn(x, x, x, need_weights=False)[0])
        theirs = hf_layer.attention(x)[0]
        assert torch.allclose(ours, theirs, atol=1e-5)
        ours_ffn = fusion_layer.norm_ffn(x + fusion_layer.ffn(x))
        assert torch.allclose(ours_ffn, hf_layer.output(hf_layer.intermediate(x), x), atol=1e-5)


def test_paper_architecture_from_a_tiny_config_trains_one_step(tmp_path):
    source = tiny_xlmr(seed=3)
    checkpoint = tmp_path / "xlmr.pt"
    torch.save(source.state_dict(), checkpoint)
    paper = OmegaConf.load(PAPER).method
    paper.ablation = None  # the full model (a run resolves it from variant=)
    assert paper.image_encoder.name == "timm:swin_base_patch4_window7_224"
    assert paper.image_encoder.pretrained == "ms_in22k"
    tiny = OmegaConf.merge(
        paper,
        {
            "embed_dim": 16,
            "image_encoder": {"pretrained": None, "options": TINY_SWIN},
            "text_encoder": {"name": "hf", "pretrained": str(checkpoint), "config": TINY_XLMR},
            "fusion": {"heads": 4},
        },
    )
    torch.manual_seed(0)
    module = CCRk(tiny, OPTIM, Info(), EVALUATION)

    text_layers = module.text_encoder.backbone.model.encoder.layer
    assert len(text_layers) == 6 and len(module.fusion.layers) == 6
    for position, index in enumerate(paper.text_encoder.layers):
        assert torch.equal(
            text_layers[position].intermediate.dense.weight,
            source.encoder.layer[index].intermediate.dense.weight,
        )
    for position, index in enumerate(paper.fusion.init_from_text_layers):
        assert torch.equal(
            module.fusion.layers[position].ffn[0].weight,
            source.encoder.layer[index].intermediate.dense.weight,
        )
    assert module.mlm_head.decoder.weight is module.text_encoder.input_embeddings().weight
    assert module.lr_scales()["fusion.layers.5.cross_attn"] == 2.0

    image_tokens = module.image_encoder(torch.randn(2, 3, 32, 32))
    assert image_tokens.shape == (
        2,
        1 + 4 * 4,
        32,
    )  # pooled token + final 4x4 grid (8x8 patches, 1 merge)

    loss = module.training_step(training_batch(), 0)
    assert torch.isfinite(loss)
    loss.backward()
    assert module.fusion.layers[0].cross_attn.in_proj_weight.grad.abs().sum() > 0
    assert (
        module.text_encoder.backbone.model.encoder.layer[0].attention.self.query.weight.grad
        is not None
    )
