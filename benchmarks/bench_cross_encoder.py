"""Throughput of cross-encoder scoring (pairs/s): RC3's and CCRk's ITM heads over every pair of a
block of the default world's test split, through the evaluation path (``score_matrix``).

    python benchmarks/bench_cross_encoder.py [--device cuda] [--images 32] [--captions 96]
        [--pair-batch N] [--caption-chunk N] [--threads N] [--methods rc3 ccrk] [key=value ...]

Each method is built at its preset's default size with random weights (a trained model costs the
same), on the first ``--images`` test images and the first ``--captions`` test captions; the
image-side inputs are computed once, as evaluation caches them, and only the pair scoring is timed
(one untimed warm-up round first). The printed estimate for the whole test split is its pair count
divided by the measured rate. ``key=value`` arguments override the run configuration (e.g. a
smaller world in another ``data.root`` with a one-step backbone recipe: the encoders keep their
architecture, hence their cost, and nothing is pretrained for minutes).
"""

from __future__ import annotations

import argparse
import time

import torch

from ccr import methods
from ccr.experiments.config import compose
from ccr.experiments.pretrain.backbones import with_backbones
from ccr.experiments.train import build_datamodule
from ccr.methods.layers.cross_encoder_scoring import score_matrix


def first_batches(data, images: int, captions: int) -> tuple[dict, dict]:
    view = data.eval_view("test")
    image_batch = next(iter(view.image_loader(images)))
    caption_batch = next(iter(view.caption_loader(captions)))
    return image_batch, caption_batch


def caches(module, name: str, images: dict, captions: dict, languages: list[str]):
    """The per-image and per-caption inputs evaluation keeps for the cross-encoder."""
    ids, mask = captions["input_ids"], captions["attention_mask"]
    if name == "rc3":  # captions carry their own language tag (RC3.tagged_captions)
        visual = module.eval_visual(images["images"])
        tagged = torch.stack(
            [
                module.tag(ids[i : i + 1], mask[i : i + 1], lang)[0]
                for i, lang in enumerate(languages)
            ]
        )
        return {"tokens": visual.tokens, "mask": visual.mask}, {
            "input_ids": tagged,
            "attention_mask": mask,
        }
    return module.image_cache(images["images"]), module.text_cache(ids, mask)


def pairs_per_second(name: str, args) -> tuple[float, float, int, dict]:
    cfg = compose([f"method={name}", *args.overrides])
    data = build_datamodule(cfg, roles=("test",))
    info = with_backbones(data)
    module = methods.get(name)(cfg.method, cfg.optim, info, cfg.evaluation).eval().to(args.device)
    with torch.no_grad():  # not around building: the world pretrains its backbones on first use
        return timed(module, name, cfg, data, args)


def timed(module, name: str, cfg, data, args) -> tuple[float, float, int, dict]:
    """(pairs per wall second, pairs per second of this process's CPU time, the split's pair count,
    the chunk sizes); on a machine shared with other jobs the CPU-time rate is what one idle
    thread would give (with --threads 1)."""
    images, captions = first_batches(data, args.images, args.captions)
    view = data.eval_view("test")
    languages = [view.caption_language[int(i)] for i in captions["index"]]
    images = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in images.items()}
    captions = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in captions.items()}
    image_cache, text_cache = caches(module, name, images, captions, languages)
    scorer = module.cross_encoder(image_cache, text_cache)
    chunks = {
        "pair_batch": args.pair_batch or int(cfg.evaluation.pair_batch_size),
        "caption_chunk": args.caption_chunk or int(cfg.evaluation.caption_chunk),
    }
    n_images, n_captions = len(images["index"]), len(captions["index"])
    score_matrix(scorer, n_images, n_captions, **chunks)  # warm-up
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start, cpu_start = time.perf_counter(), time.process_time()
    score_matrix(scorer, n_images, n_captions, **chunks)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    pairs = n_images * n_captions
    rate, cpu_rate = (
        pairs / (time.perf_counter() - start),
        pairs / (time.process_time() - cpu_start),
    )
    return rate, cpu_rate, len(view.image_ids) * len(view.caption_image), chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--captions", type=int, default=96)
    parser.add_argument(
        "--pair-batch",
        type=int,
        default=None,
        help="default: the preset's evaluation.pair_batch_size",
    )
    parser.add_argument(
        "--caption-chunk",
        type=int,
        default=None,
        help="default: the preset's evaluation.caption_chunk",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--methods", nargs="+", default=["rc3", "ccrk"])
    args, args.overrides = parser.parse_known_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"cpu, {torch.get_num_threads()} threads"
    )
    for name in args.methods:
        rate, cpu_rate, split_pairs, chunks = pairs_per_second(name, args)
        print(
            f"{name}: {rate:,.0f} pairs/s on {device} ({cpu_rate:,.0f} per CPU-second) ({args.images} images x {args.captions} captions, "
            f"pair_batch {chunks['pair_batch']}, caption_chunk {chunks['caption_chunk']}); this world's "
            f"test split, {split_pairs:,} pairs: ~{split_pairs / rate / 60:,.1f} min"
        )


if __name__ == "__main__":
    main()
