"""Why CCRk's ITM re-ranking does not beat its dual encoder on the default world (issue 14, item 1).

    python benchmarks/diag_ccrk_itm.py runs/synthetic/ccrk/<run>/checkpoints/done.ckpt [--extra-itm-steps 1500]

Prints, for a ccrk checkpoint trained on the synthetic world:

A. Test text->image on English (one caption per image, 1000 queries): R@1 of the dual encoder (ITC)
   and of ITM re-ranking its top 16, scored strictly (the gold image) and semantically (the top-1
   image is one the caption truly describes: the same objects, and every size, position and
   background the caption mentions holds), and which attribute the wrong top-1 images get wrong.
B. Training batches: the share of hard-mined MITM negatives that the caption truly describes, i.e.
   negative labels that contradict the caption (the false-negative hypothesis), against uniform draws.

``--extra-itm-steps N`` first trains only the fusion encoder and the ITM head for N more steps on
hard-mined training batches (encoders frozen, AdamW at ``--lr``), to test whether the head is
simply under-trained at the run's budget. The checkpoint file is never written.
"""

from __future__ import annotations

import argparse
import itertools
import random
import re
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ccr.datamodules.synthetic.scene import BACKGROUNDS, COLOURS, SHAPES
from ccr.experiments.config import typed
from ccr.experiments.runs import load_checkpoint
from ccr.experiments.train import build_datamodule, stages_of
from ccr.experiments.trainer import configure_threads
from ccr.methods.ccrk.hard_sampling import matching_loss, sample_hard_examples

POSITIONS = {
    "on the left": "left",
    "on the right": "right",
    "at the top": "top",
    "at the bottom": "bottom",
    "in the centre": "centre",
}
MENTION = re.compile(
    rf"(?:(small|large) )?({'|'.join(COLOURS)}) ({'|'.join(SHAPES)})"
    rf"((?: (?:{'|'.join(POSITIONS)}))?)"
)
BATCH, TOP_K = 64, 16


def parse(caption: str) -> tuple[list[tuple], str | None]:
    """An English world caption -> ([(colour, shape, size|None, position|None)], background|None)."""
    text = caption.lower().rstrip(".")
    background = next((b for b in BACKGROUNDS if f"the {b}" in text), None)
    for b in BACKGROUNDS:
        text = text.replace(f"on the {b}", "")
    mentions = [
        (colour, shape, size or None, POSITIONS.get(where.strip()))
        for size, colour, shape, where in MENTION.findall(text)
    ]
    return mentions, background


def describes(parsed: tuple[list[tuple], str | None], scene: dict) -> bool:
    """Whether the caption is true of the scene: its objects, and every detail it mentions."""
    mentions, background = parsed
    objects = scene["objects"]
    if (background is not None and scene["background"] != background) or len(mentions) != len(
        objects
    ):
        return False
    return any(
        all(
            o["colour"] == c
            and o["shape"] == s
            and z in (None, o["size"])
            and p in (None, o["position"])
            for (c, s, z, p), o in zip(mentions, order, strict=True)
        )
        for order in itertools.permutations(objects)
    )


def what_is_wrong(parsed: tuple[list[tuple], str | None], scene: dict) -> str:
    """The first mismatch of a caption with a scene it does not describe."""
    mentions, background = parsed
    if sorted(m[:2] for m in mentions) != sorted(
        (o["colour"], o["shape"]) for o in scene["objects"]
    ):
        return "object count" if len(mentions) != len(scene["objects"]) else "colour/shape"
    if background is not None and scene["background"] != background:
        return "background"
    return (
        "position"
        if describes(([(c, s, z, None) for c, s, z, _ in mentions], None), scene)
        else "size"
    )


def training_batches(data, rng: random.Random):
    """Endless batches of BATCH random train records, one shared caption index in every language."""
    records, languages, transform = (
        data.records("train"),
        list(data.languages),
        data.image_transform(),
    )
    while True:
        rows = rng.sample(range(len(records)), BATCH)
        shared = [rng.randrange(len(records[j].captions["en"])) for j in rows]
        tokens = data.tokenizer(
            [
                records[j].captions[lang][s]
                for j, s in zip(rows, shared, strict=True)
                for lang in languages
            ],
            data.info.max_length,
        )
        images = torch.stack([transform(data.image_root / records[j].image) for j in rows])
        english = [records[j].captions["en"][s] for j, s in zip(rows, shared, strict=True)]
        yield rows, english, tokens, images


def encode_batch(module, tokens, images):
    image_states = module.image_encoder(images)
    text = module.encode_captions(tokens["input_ids"], tokens["attention_mask"])
    return image_states, text, module.vision_proj(image_states[:, 0]), module.text_proj(text.pooled)


def train_itm_further(module, data, steps: int, lr: float) -> None:
    """Fusion encoder + ITM head only, on hard-mined batches; encoders and projections frozen."""
    params = [*module.fusion.parameters(), *module.itm_head.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    batches, losses = training_batches(data, random.Random(0)), []
    module.train()
    for step in range(steps):
        _, _, tokens, images = next(batches)
        with torch.no_grad():
            image_states, text, image_feat, text_feat = encode_batch(module, tokens, images)
            samples = sample_hard_examples(image_feat, text_feat, module.temperature(), "reference")
        loss = matching_loss(
            module.fuse, module.itm_head, text.states, text.mask, image_states, samples
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if (step + 1) % 250 == 0:
            print(f"  extra ITM step {step + 1}: mitm {sum(losses[-250:]) / 250:.3f}", flush=True)
    module.eval()


@torch.no_grad()
def probe_test(module, data) -> None:
    view, records = data.eval_view("test"), data.records("test")
    scenes = [r.extras["scene"] for r in records]
    images = torch.stack([view.transform(p) for p in view.image_paths])
    image_states = torch.cat(
        [module.image_cache(images[i : i + 256]) for i in range(0, len(images), 256)]
    )
    image_emb = F.normalize(module.vision_proj(image_states[:, 0]), dim=-1)
    queries = [(i, r.captions["en"][0]) for i, r in enumerate(records)]
    tokens = data.tokenizer([c for _, c in queries], data.info.max_length)
    text_emb = F.normalize(
        module.encode_texts(tokens["input_ids"], tokens["attention_mask"]), dim=-1
    )
    top = (text_emb @ image_emb.T).topk(TOP_K, dim=1).indices
    hits, wrong, flips, ambiguous = Counter(), {"itc": Counter(), "itm": Counter()}, Counter(), 0
    for q, (gold, caption) in enumerate(queries):
        candidates = top[q]
        scores = module.match_scores(
            image_states[candidates],
            tokens["input_ids"][q].expand(TOP_K, -1),
            tokens["attention_mask"][q].expand(TOP_K, -1),
        )
        picks = {"itc": int(candidates[0]), "itm": int(candidates[scores.argmax()])}
        parsed = parse(caption)
        if not describes(parsed, scenes[gold]):
            raise SystemExit(f"parser: '{caption}' does not describe its own scene {scenes[gold]}")
        ambiguous += sum(describes(parsed, scenes[int(c)]) for c in candidates) > 1
        for name, pick in picks.items():
            hits[f"{name} strict"] += pick == gold
            hits[f"{name} semantic"] += describes(parsed, scenes[pick])
            if not describes(parsed, scenes[pick]):
                wrong[name][what_is_wrong(parsed, scenes[pick])] += 1
        if (picks["itc"] == gold) != (picks["itm"] == gold):
            flips["itm right, itc wrong" if picks["itm"] == gold else "itc right, itm wrong"] += 1
    n = len(queries)
    print(f"A. test text->image, English, {n} queries, ITM over the ITC top {TOP_K}")
    for kind in ("strict", "semantic"):
        print(
            f"   R@1 {kind:8s}: itc {100 * hits[f'itc {kind}'] / n:.1f}   itm@{TOP_K} {100 * hits[f'itm {kind}'] / n:.1f}"
        )
    print(
        f"   queries whose top {TOP_K} holds another image the caption truly describes: {100 * ambiguous / n:.1f}%"
    )
    print(f"   flips: {dict(flips)}")
    for name in ("itc", "itm"):
        print(f"   {name} top-1 not described, first mismatch: {dict(wrong[name].most_common())}")


@torch.no_grad()
def probe_training_negatives(module, data, batches: int = 30) -> None:
    records, stream = data.records("train"), training_batches(data, random.Random(0))
    languages = len(data.languages)
    contradicting = {mode: Counter() for mode in ("reference", "uniform")}
    for _ in range(batches):
        rows, english, tokens, images = next(stream)
        _, _, image_feat, text_feat = encode_batch(module, tokens, images)
        for mode, count in contradicting.items():
            samples = sample_hard_examples(image_feat, text_feat, module.temperature(), mode)
            for j in range(BATCH):
                positive = parse(english[int(samples.positive_text[j]) // languages])
                count["image"] += describes(
                    positive, records[rows[int(samples.negative_image[j])]].extras["scene"]
                )
                negative = parse(english[int(samples.negative_text[j]) // languages])
                count["caption"] += describes(negative, records[rows[j]].extras["scene"])
    total = batches * BATCH
    print(
        f"B. MITM negatives in {batches} training batches of {BATCH}, share that the caption truly describes"
    )
    for mode, count in contradicting.items():
        print(
            f"   {mode:9s}: negative images {100 * count['image'] / total:.1f}%   "
            f"negative captions {100 * count['caption'] / total:.1f}%"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--extra-itm-steps", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-4)
    args = parser.parse_args()
    torch.manual_seed(0)
    run_dir = args.checkpoint.resolve().parents[1]
    cfg = typed(OmegaConf.load(run_dir / "config.yaml"), str(run_dir / "config.yaml"))
    configure_threads(cfg)
    data = build_datamodule(cfg, roles=("train", "test"))
    module = stages_of(cfg, data)[-1].build(None)
    module.load_state_dict(load_checkpoint(args.checkpoint)["state_dict"])
    module.eval()
    if args.extra_itm_steps:
        train_itm_further(module, data, args.extra_itm_steps, args.lr)
    probe_test(module, data)
    probe_training_negatives(module, data)


if __name__ == "__main__":
    main()
