"""Benchmark: embeddings -> full retrieval report, against the matmul + a per-row numpy argsort loop
(as fast as the public evaluators'), the torchmetrics Retrieval* metrics, and the similarity matmul
alone (the floor). The "world" size is the default synthetic world's test split (1000 images x 30
captions) with graded i2i/t2t NDCG, against the t2t matmul alone.

Every measurement runs in a fresh subprocess, which builds its inputs, warms up on a tiny problem,
resets its peak-RSS counter (/proc/self/clear_refs) and then times one evaluation; "extra memory"
is the peak resident set during that evaluation minus the resident set before it.

    python benchmarks/bench_metrics.py                     # multi30k, coco5k, xflickrco
    python benchmarks/bench_metrics.py --stress            # + 20000x20000 and 100000x100000
    python benchmarks/bench_metrics.py --sizes coco5k --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


@dataclass(frozen=True)
class Size:
    images: int
    captions_per_image: int
    languages: int
    graded: bool = False  # with graded i2i/t2t NDCG; its floor is then the t2t matmul


SIZES = {
    "multi30k": Size(1000, 1, 4),
    "coco5k": Size(5000, 5, 1),
    "xflickrco": Size(2000, 1, 8),
    "world": Size(1000, 5, 6, graded=True),
    "stress20k": Size(20000, 1, 1),
    "stress100k": Size(100000, 1, 1),
}
DEFAULT_SIZES = ["multi30k", "coco5k", "xflickrco", "world"]
STRESS_SIZES = ["stress20k", "stress100k"]
METHODS = ["report", "matmul", "argsort", "torchmetrics"]
DIM = 256
FULL_MATRIX_LIMIT = 4 * 2**30  # bytes of one score matrix that a peer may materialise
TORCHMETRICS_SCORE_LIMIT = 4 * 10**6  # scores per torchmetrics run; larger sizes use a query subset


def make_embeddings(size: Size, seed: int = 1234):
    """Images and captions with language-dependent noise (metric-baselines.md setup, float32)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    image = torch.randn(size.images, DIM, generator=gen)
    instance = torch.randn(size.images, DIM, generator=gen)
    owner = torch.arange(size.images).repeat_interleave(size.captions_per_image)
    texts, caption_image, caption_language = [], [], []
    for lang in range(size.languages):
        eps = torch.randn(len(owner), DIM, generator=gen)
        texts.append(image[owner] + instance[owner] + (4.0 + 0.4 * lang) * eps)
        caption_image.append(owner)
        caption_language += [f"l{lang}"] * len(owner)
    normalize = torch.nn.functional.normalize
    return (
        normalize(image, dim=1),
        normalize(torch.cat(texts), dim=1),
        torch.cat(caption_image),
        caption_language,
    )


def skip_reason(method: str, size: Size) -> str | None:
    """Why a peer cannot run at this size, or None."""
    matrix_bytes = size.images * size.images * size.captions_per_image * 4
    if size.graded and method in ("argsort", "torchmetrics"):
        return "computes no graded i2i/t2t NDCG"
    if method == "argsort" and 2 * matrix_bytes > FULL_MATRIX_LIMIT:
        return f"needs both dense score matrices ({2 * matrix_bytes / 2**30:.0f} GiB)"
    if method == "torchmetrics" and matrix_bytes * 25 > 16 * 2**30:
        return f"needs about 100 B per score ({matrix_bytes * 25 / 2**30:.0f} GiB peak) on a shared 23 GiB machine"
    return None


def language_views(image, text, caption_image, caption_language):
    """Per language: (caption embeddings, caption image index)."""
    import torch

    views = []
    for lang in dict.fromkeys(caption_language):
        mine = torch.tensor([other == lang for other in caption_language])
        views.append((text[mine], caption_image[mine]))
    return views


def graded_relevance(num_images: int):
    """A graded image relevance in {0, .25, .5, .75, 1}, symmetric, 1 on the diagonal (seeded)."""
    import torch

    gen = torch.Generator().manual_seed(7)
    relevance = (torch.rand(num_images, num_images, generator=gen) * 5).floor() / 4
    relevance = torch.minimum(torch.maximum(relevance, relevance.T), torch.tensor(1.0))
    return relevance.fill_diagonal_(1.0)


def run_report(image, text, caption_image, caption_language, graded=False):
    from ccr.metrics import retrieval_report

    report = retrieval_report(
        image,
        text,
        caption_image,
        caption_language,
        [str(i) for i in range(len(image))],
        image_relevance=graded_relevance(len(image)) if graded else None,
    )
    return {key: value for key, value in report.items() if "/R@" in key}


def run_matmul(image, text, caption_image, caption_language, graded=False):
    """The floor: every cross-modal score computed once (row chunks when the matrix would not
    fit); with ``graded``, the caption x caption (t2t) matmul alone."""
    if graded:
        for start in range(0, len(text), 1024):
            text[start : start + 1024] @ text.T
        return {}
    for texts, _ in language_views(image, text, caption_image, caption_language):
        if len(image) * len(texts) * 4 <= FULL_MATRIX_LIMIT:
            image @ texts.T
        else:
            for start in range(0, len(image), 1024):
                image[start : start + 1024] @ texts.T
    return {}


def argsort_ranks(scores, positives):
    """Per query row: indices sorted by descending score (numpy argsort reversed), then the first
    position holding one of the row's positives: the public evaluators' loop (ALBEF itm_eval)."""
    import numpy as np

    ranks = np.empty(len(scores), dtype=np.int64)
    for row, wanted in enumerate(positives):
        order = np.argsort(scores[row])[::-1]
        ranks[row] = np.where(np.isin(order, wanted))[0].min()
    return ranks


def run_argsort(image, text, caption_image, caption_language):
    """Matmul, then the per-row numpy argsort loop as fast as the public evaluators."""
    import numpy as np

    values = {}
    for lang, (texts, owners) in zip(
        dict.fromkeys(caption_language),
        language_views(image, text, caption_image, caption_language),
        strict=True,
    ):
        scores = (image @ texts.T).numpy()
        owner = owners.numpy()
        captions_of = [[] for _ in range(len(image))]
        for caption, img in enumerate(owner.tolist()):
            captions_of[img].append(caption)
        queries = [i for i, captions in enumerate(captions_of) if captions]
        i2t = argsort_ranks(scores[queries], [np.array(captions_of[i]) for i in queries])
        t2i = argsort_ranks(np.ascontiguousarray(scores.T), [np.array([img]) for img in owner])
        for k in (1, 5, 10):
            values[f"{lang}/i2t/R@{k}"] = 100.0 * float((i2t < k).sum()) / len(i2t)
            values[f"{lang}/t2i/R@{k}"] = 100.0 * float((t2i < k).sum()) / len(t2i)
    return values


def run_torchmetrics(image, text, caption_image, caption_language, fraction: float):
    """RetrievalHitRate@1/5/10 and RetrievalNormalizedDCG@10 per language and direction, one update
    with the whole flattened matrix each (on the first ``fraction`` of the queries)."""
    import torch
    from torchmetrics.retrieval import RetrievalHitRate, RetrievalNormalizedDCG

    values = {}
    for lang, (texts, owners) in zip(
        dict.fromkeys(caption_language),
        language_views(image, text, caption_image, caption_language),
        strict=True,
    ):
        scores = image @ texts.T
        i2t_target = owners[None, :] == torch.arange(len(image))[:, None]
        for direction, matrix, target in (
            ("i2t", scores, i2t_target),
            ("t2i", scores.T, i2t_target.T),
        ):
            rows = max(1, int(len(matrix) * fraction))
            matrix, target = matrix[:rows], target[:rows].long()
            indexes = torch.arange(rows)[:, None].expand_as(matrix).flatten()
            for k in (1, 5, 10):
                hit = RetrievalHitRate(top_k=k)(matrix.flatten(), target.flatten(), indexes)
                values[f"{lang}/{direction}/R@{k}"] = 100.0 * hit.item()
            RetrievalNormalizedDCG(top_k=10)(matrix.flatten(), target.flatten(), indexes)
    return values


def torchmetrics_fraction(size: Size) -> float:
    scores = size.images * size.images * size.captions_per_image * size.languages * 2
    return min(1.0, TORCHMETRICS_SCORE_LIMIT / scores)


def read_status(field: str) -> int:
    """A /proc/self/status field in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worker(method: str, size_name: str) -> None:
    """One timed measurement; prints a JSON line."""
    import torch

    torch.set_num_threads(2)
    size = SIZES[size_name]
    fraction = torchmetrics_fraction(size) if method == "torchmetrics" else 1.0
    if method in ("report", "matmul"):

        def run(*data):
            return {"report": run_report, "matmul": run_matmul}[method](*data, graded=size.graded)
    elif method == "argsort":
        run = run_argsort
    else:

        def run(*data):
            return run_torchmetrics(*data, fraction=fraction)

    run(*make_embeddings(Size(50, size.captions_per_image, size.languages), seed=0))
    data = make_embeddings(size)
    Path("/proc/self/clear_refs").write_text("5")
    base = read_status("VmRSS")
    start = time.perf_counter()
    values = run(*data)
    seconds = time.perf_counter() - start
    extra_mib = (read_status("VmHWM") - base) / 1024
    print(
        json.dumps(
            {
                "seconds": seconds / fraction,
                "extra_mib": extra_mib,
                "fraction": fraction,
                "values": values,
            }
        )
    )


def measure(method: str, size_name: str) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", method, size_name],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{method} at {size_name} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_values(report: dict, other: dict) -> str:
    if not other:
        return ""
    shared = [key for key in other if key in report]
    worst = max(abs(report[key] - other[key]) for key in shared)
    return "identical R@K" if worst == 0 else f"max |R@K diff| {worst:.2g}"


def benchmark(size_name: str, repeats: int, wanted: list[str]) -> None:
    size = SIZES[size_name]
    runs: dict[str, list[dict]] = {}
    methods = [m for m in wanted if skip_reason(m, size) is None]
    for method in wanted:
        if method not in methods:
            print(f"  {size_name}: {method} skipped: {skip_reason(method, size)}", flush=True)
    for round_index in range(repeats):
        rotated = methods[round_index % len(methods) :] + methods[: round_index % len(methods)]
        for method in rotated:
            if method == "torchmetrics" and round_index > 0:
                continue  # minutes per run: measured once
            runs.setdefault(method, []).append(measure(method, size_name))
    median = {m: statistics.median(r["seconds"] for r in rs) for m, rs in runs.items()}
    report_values = runs["report"][0]["values"]
    for method, results in runs.items():
        fraction = results[0]["fraction"]
        if method == "report":
            note = "reference values"
        elif fraction == 1.0:
            note = compare_values(report_values, results[0]["values"])
        else:
            note = f"time x{1 / fraction:.1f} from {fraction:.0%} of the queries"
        print(
            f"| {size_name} | {method} | {median[method]:.3f} | "
            f"{max(r['extra_mib'] for r in results):.0f} | "
            f"{median[method] / median['report']:.2f} | "
            f"{median[method] / median['matmul']:.2f} | {len(results)} | {note} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes", default=",".join(DEFAULT_SIZES), help=f"comma-separated, from {', '.join(SIZES)}"
    )
    parser.add_argument("--stress", action="store_true", help="add " + " and ".join(STRESS_SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help="comma-separated subset of " + ", ".join(METHODS) + " (report and matmul always run)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    sizes = args.sizes.split(",") + (STRESS_SIZES if args.stress else [])
    unknown = [name for name in sizes if name not in SIZES]
    if unknown:
        parser.error(f"unknown size {unknown[0]!r}; choose from {', '.join(SIZES)}")
    bad_methods = [m for m in args.methods.split(",") if m not in METHODS]
    if bad_methods:
        parser.error(f"unknown method {bad_methods[0]!r}; choose from {', '.join(METHODS)}")
    wanted = [m for m in METHODS if m in {"report", "matmul", *args.methods.split(",")}]
    print("| size | method | median s | peak extra MiB | x report | x matmul | runs | values |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for size_name in sizes:
        benchmark(size_name, args.repeats if size_name != "stress100k" else 1, wanted)


if __name__ == "__main__":
    main()
