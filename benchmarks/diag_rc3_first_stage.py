"""Which image and text features can give RC3 a first stage that finds the gold (issue 16).

    python benchmarks/diag_rc3_first_stage.py <run>/stages/pretrain/done.ckpt [--train 4096] [--steps 1500]

RC3 has no dual encoder: the paper scores every pair with the fused ITM head, and on CPU the suite
re-ranks a first stage's top k. That first stage is a linear probe trained on detached features.
This script extracts candidate features from a trained checkpoint, fits the same kind of probe
(two linear maps, InfoNCE at the run's first-stage temperature) on English training pairs for each
image/text pairing, and prints English text->image R@1 / R@10 and where the gold lands on the test
split, so a first stage is chosen by measurement:

- image ``only-pass``: mean final visual state of ``[CLS] visual`` (the current first stage);
- image ``empty-vtr``: VtR of the image with an empty English caption (the trained fused format);
- image ``tokens``: mean of RC3's visual tokens (the ROI projection of the grid regions);
- image ``regions``: mean of the frozen grid regions themselves (RC3's input, no RC3 weights);
- text ``tr``: TR, the ``[BOS]`` state of ``[BOS] x [LAN]`` (the current first stage);
- text ``world-xlmr``: the world's pretrained text encoder (a reference: what a pretrained text
  side gives; RC3 starts from random init on this world).
The checkpoint file is never written.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ccr.experiments.config import typed
from ccr.experiments.pretrain.backbones import with_backbones
from ccr.experiments.runs import load_checkpoint
from ccr.experiments.train import build_datamodule, stages_of
from ccr.experiments.trainer import configure_threads
from ccr.methods.layers.encoders import TextEncoder

ENGLISH = "en"


@torch.no_grad()
def image_features(module, images: torch.Tensor) -> dict[str, torch.Tensor]:
    regions = module.regions(images)
    visual = module.visual_tokens(images, regions)
    empty = module.data_info
    ids = torch.tensor([[empty.cls_token_id, empty.eos_token_id]]).expand(len(images), -1)
    mask = torch.ones_like(ids)
    vtr = module.net.encode(module.tag(ids, mask, ENGLISH), mask, visual.tokens, visual.mask).pooled
    return {
        "only-pass": module.image_only_features(visual),
        "empty-vtr": vtr,
        "tokens": visual.tokens.mean(1),
        "regions": regions.mean(1),
    }


@torch.no_grad()
def text_features(module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """TR and the world text encoder's pooled state, side by side ``[N, 2, d]``."""
    return torch.stack(
        [
            module.text_representation(input_ids, attention_mask, ENGLISH),
            WORLD_TEXT[0](input_ids, attention_mask).pooled,
        ],
        1,
    )


WORLD_TEXT: list = []


def collect_train(module, data, count: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    images, texts = [], []
    for batch in data.train_dataloader(languages=[ENGLISH]):
        images.append(image_features(module, batch["images"]))
        texts.append(text_features(module, batch["input_ids"][:, 0], batch["attention_mask"][:, 0]))
        if sum(len(t) for t in texts) >= count:
            break
    return {k: torch.cat([i[k] for i in images]) for k in images[0]}, torch.cat(texts)


def collect_test(module, data) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    view = data.eval_view("test")
    pixels = torch.stack([view.transform(p) for p in view.image_paths])
    parts = [image_features(module, pixels[i : i + 64]) for i in range(0, len(pixels), 64)]
    english = [i for i, lang in enumerate(view.caption_language) if lang == ENGLISH]
    tokens = data.tokenizer([view.captions[i] for i in english], data.info.max_length)
    text = torch.cat(
        [
            text_features(
                module, tokens["input_ids"][i : i + 256], tokens["attention_mask"][i : i + 256]
            )
            for i in range(0, len(english), 256)
        ]
    )
    return (
        {k: torch.cat([p[k] for p in parts]) for k in parts[0]},
        text,
        view.caption_image[english],
    )


def fit_probe(image: torch.Tensor, text: torch.Tensor, dim: int, temperature: float, steps: int):
    torch.manual_seed(0)
    image_map, text_map = torch.nn.Linear(image.shape[1], dim), torch.nn.Linear(text.shape[1], dim)
    mean_i, std_i = image.mean(0), image.std(0).clamp_min(1e-6)
    mean_t, std_t = text.mean(0), text.std(0).clamp_min(1e-6)
    params = [*image_map.parameters(), *text_map.parameters()]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    for _ in range(steps):
        rows = torch.randint(len(image), (256,))
        a = F.normalize(image_map((image[rows] - mean_i) / std_i), dim=-1)
        b = F.normalize(text_map((text[rows] - mean_t) / std_t), dim=-1)
        logits = a @ b.T / temperature
        target = torch.arange(len(rows))
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (
        lambda x: F.normalize(image_map((x - mean_i) / std_i), dim=-1),
        lambda x: F.normalize(text_map((x - mean_t) / std_t), dim=-1),
        float(loss.detach()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--train", type=int, default=4096, help="English training pairs to fit on")
    parser.add_argument("--steps", type=int, default=1500)
    args = parser.parse_args()
    run_dir = next(p for p in args.checkpoint.resolve().parents if (p / "config.yaml").exists())
    cfg = typed(OmegaConf.load(run_dir / "config.yaml"), str(run_dir / "config.yaml"))
    configure_threads(cfg)
    data = build_datamodule(cfg, roles=("train", "test"))
    module = stages_of(cfg, data)[0].build(None)
    module.load_state_dict(load_checkpoint(args.checkpoint)["state_dict"])
    module.eval()
    WORLD_TEXT.append(TextEncoder.from_config({"name": "world"}, with_backbones(data)).eval())
    settings = module.settings.first_stage
    train_images, train_text = collect_train(module, data, args.train)
    test_images, test_text, gold = collect_test(module, data)
    print(
        f"{len(train_text)} English training pairs; test: {len(test_images['tokens'])} images, "
        f"{len(test_text)} English captions"
    )
    with torch.no_grad():
        own = module.probe_text(test_text[:, 0]) @ module.probe_image(test_images["only-pass"]).T
    results = {"run's own probe (only-pass x tr)": (own, float("nan"))}
    for (t, text_kind), kind in itertools.product(enumerate(("tr", "world-xlmr")), train_images):
        image_map, text_map, loss = fit_probe(
            train_images[kind],
            train_text[:, t],
            int(settings.dim),
            float(settings.temperature),
            args.steps,
        )
        with torch.no_grad():
            scores = text_map(test_text[:, t]) @ image_map(test_images[kind]).T
        results[f"{kind} x {text_kind}"] = (scores, loss)
    print(f"{'first stage':34s} {'fit loss':>8s} {'R@1':>6s} {'R@10':>6s} {'median rank':>11s}")
    for name, (scores, loss) in results.items():
        rank = (scores > scores.gather(1, gold[:, None])).sum(1) + 1
        print(
            f"{name:34s} {loss:8.3f} {100 * (rank <= 1).float().mean():6.1f} "
            f"{100 * (rank <= 10).float().mean():6.1f} {int(rank.median()):11d}"
        )


if __name__ == "__main__":
    main()
