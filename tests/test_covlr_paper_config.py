"""covlr_paper.yaml's architecture (Swin image tokens + adapter, a BERT text encoder loaded from a local
checkpoint, cross-modal encoders) built at tiny width from locally saved models, one training step."""

from pathlib import Path

import torch
from omegaconf import OmegaConf
from test_covlr_module import EVALUATION, OPTIM, VOCAB, Info, grads, training_batch
from transformers import AutoConfig, AutoModel

from ccr.methods.covlr.module import CoVLR

PAPER = Path(__file__).resolve().parents[1] / "ccr/experiments/configs/method/covlr_paper.yaml"
TINY_BERT = {
    "model_type": "bert",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
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


def test_paper_architecture_from_tiny_saved_models_trains_one_step(tmp_path):
    torch.manual_seed(3)
    source = AutoModel.from_config(AutoConfig.for_model(**TINY_BERT))
    checkpoint = tmp_path / "bert.pt"
    torch.save(source.state_dict(), checkpoint)
    paper = OmegaConf.load(PAPER).method
    assert paper.image_encoder.name == "timm:swin_base_patch4_window7_224"
    assert paper.text_encoder.name == "hf:bert-base-multilingual-cased"
    assert (paper.d_model, paper.cross_modal.layers, paper.cross_modal.heads) == (768, 6, 12)
    tiny = OmegaConf.merge(
        paper,
        {
            "ablation": None,
            "embed_dim": 16,
            "d_model": 24,
            "cross_modal": {"heads": 4},
            "image_encoder": {"pretrained": None, "options": TINY_SWIN},
            "text_encoder": {"name": "hf", "pretrained": str(checkpoint), "config": TINY_BERT},
        },
    )
    torch.manual_seed(0)
    module = CoVLR(tiny, OPTIM, Info(), EVALUATION)
    module.log = module.log_dict = lambda *args, **kwargs: None
    bert = module.text_tower.encoder.backbone.model
    assert torch.equal(
        bert.encoder.layer[1].output.dense.weight, source.encoder.layer[1].output.dense.weight
    )
    assert (
        module.image_tower.adapter.in_features == 32
        and module.text_tower.adapter.out_features == 24
    )
    assert len(module.cross_i2t.layers) == 6 and module.lr_scales()["cross_i2t"] == 5.0

    loss = module.training_step(training_batch(), 0)
    assert torch.isfinite(loss)
    loss.backward()
    assert [name for name, grad in grads(module).items() if grad.abs().sum() == 0] == []
