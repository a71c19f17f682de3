"""Stand-ins for the synthetic world's pretrained backbones in tests.

The presets name the world's backbones (``name: world``). A test world is far smaller than the
default one, so its backbones are built with ``QUICK_BACKBONES`` (seconds, not minutes); a
unit test that builds a method from its preset with hand-made data info (no world at all) gives that
info ``RANDOM_BACKBONES``, which resolves ``world`` to the random-init tiny encoders.
"""

QUICK_BACKBONES = [
    "data.synthetic.num_pretrain=48",  # a list that sets its own size later overrides this
    "data.backbones.text.hidden_size=32",
    "data.backbones.text.layers=1",
    "data.backbones.text.heads=2",
    "data.backbones.text.intermediate_size=64",
    "data.backbones.text.steps=8",
    "data.backbones.text.batch_size=8",
    "data.backbones.text.warmup_steps=2",
    "data.backbones.image.embed_dim=32",
    "data.backbones.image.depth=1",
    "data.backbones.image.num_heads=2",
    "data.backbones.image.steps=4",
    "data.backbones.image.batch_size=8",
    "data.backbones.image.warmup_steps=1",
]


def random_hf_text(data) -> dict:
    """A random-init tiny XLM-R whose vocabulary and special ids follow ``data`` (a DataInfo)."""
    return {
        "name": "hf",
        "pretrained": None,
        "config": {
            "model_type": "xlm-roberta",
            "vocab_size": data.vocab_size,
            "pad_token_id": data.pad_token_id,
            "bos_token_id": data.cls_token_id,
            "eos_token_id": data.eos_token_id,
            "max_position_embeddings": data.max_length + data.pad_token_id + 1,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 128,
        },
    }


def random_backbones(width: int = 64, hf_text_for=None) -> dict:
    """``DataInfo.backbones`` resolving ``world`` to random-init tiny encoders of this width; with
    ``hf_text_for`` (a DataInfo) the text side is a Hugging Face XLM-R for that data, as the world's
    is (mCLIP's MTE must be one)."""
    text = (
        random_hf_text(hf_text_for)
        if hf_text_for is not None
        else {"name": "tiny", "pretrained": None, "width": width, "layers": 2, "heads": 4}
    )
    return {
        "image": {
            "name": "tiny",
            "pretrained": None,
            "patch_size": 8,
            "width": width,
            "layers": 2,
            "heads": 4,
        },
        "text": text,
    }


RANDOM_BACKBONES = random_backbones()

# Backbones that do learn on a small world (the recipe tests/test_backbones.py holds to a measured
# translation preference), for tests whose claim rests on pretraining: learning within a short budget,
# mCLIP's zero-shot transfer. Set data.synthetic.num_pretrain beside it. It keeps XLM's dropout: on a
# few hundred scenes the dropout-free default recipe overfits (measured: cl2cm's CLI test fell to de
# t2i mR 23.5 against 28.7 needed; mCLIP's Tri-KD loss fell 9 % where it fell more than 10 %).
SMALL_PRETRAINED_BACKBONES = [
    "data.backbones.text.dropout=0.1",
    "data.backbones.text.hidden_size=32",
    "data.backbones.text.layers=1",
    "data.backbones.text.heads=2",
    "data.backbones.text.intermediate_size=64",
    "data.backbones.text.steps=250",
    "data.backbones.text.batch_size=32",
    "data.backbones.text.lr=3e-3",
    "data.backbones.text.warmup_steps=20",
    "data.backbones.image.embed_dim=32",
    "data.backbones.image.depth=1",
    "data.backbones.image.num_heads=2",
    "data.backbones.image.steps=300",
    "data.backbones.image.batch_size=32",
    "data.backbones.image.lr=3e-3",
]
