"""Training throughput of each method's paper-size model on one accelerator: is the chip used, and
does the input pipeline keep up?

    python benchmarks/bench_gpu.py                          # on a GPU: every method, paper sizes
    python benchmarks/bench_gpu.py --methods clip,ccrk --steps 30 data.num_workers=12
    python benchmarks/bench_gpu.py --tiny                   # CPU: tiny sizes, seconds (its test)
    python benchmarks/bench_gpu.py --methods ccrk --profile prof/   # also where a step's time goes

Each method is its paper preset with random weights of the paper's sizes (``paper_models``: no
download), trained on the synthetic world rendered at ``data.image_size`` (224 px). On one module,
three timed loops of ``--steps`` steps after ``--warmup``:

* ``bare``: a plain PyTorch loop (autocast as the trainer's precision, the method's AdamW groups and
  schedule, gradient clipping) on batches already on the device: what the model allows;
* ``lightning``: the suite's Trainer (``ccr.experiments.trainer.build_trainer``: loggers, progress bar,
  checkpoint callback, and the callbacks ``ccr.experiments.train`` adds: throughput, training position,
  the non-finite-loss stop) on those same pre-loaded batches: the framework's overhead;
* ``loader``: the same Trainer fed by the real training DataLoader: what a user's run gets
  (``--jpeg 500x375``: with the world's images re-encoded as JPEG photos of real-data size).

FLOPs per step are counted by ``torch.utils.flop_counter.FlopCounterMode`` over one training step
(forward and backward: matmuls, convolutions, and attention on CUDA, whose kernels the counter
knows, unlike the CPU one); MFU = FLOPs per step / seconds per step /
the device's peak (``PEAK_TFLOPS`` by device name, or ``--peak-tflops``). Trailing ``key=value``
arguments override the run config (``data.num_workers=12``, ``trainer.precision=32-true``).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
from torch.profiler import record_function
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper_models import PAPER_PRESET, paper_method

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from the vendors' datasheets, matched by
# the first name fragment found in torch.cuda.get_device_name(): put specific names first.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)
LOOPS = ("bare", "lightning", "loader")
PRECISIONS = ("bf16-mixed", "32-true")


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """The device's bf16 peak in TFLOP/s: ``override`` if given, else from ``PEAK_TFLOPS``, else
    None (MFU is then not reported)."""
    if override is not None:
        return override
    return next((peak for fragment, peak in PEAK_TFLOPS if fragment in device_name), None)


def mfu(flops_per_step: float, seconds_per_step: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak (``peak`` in TFLOP/s)."""
    return flops_per_step / seconds_per_step / (peak * 1e12)


def counted_flops(step: Callable[[], object]) -> int:
    """FLOPs torch's flop counter records while ``step()`` runs."""
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return counter.get_total_flops()


def autocast(device: torch.device, precision: str):
    """The autocast context Lightning uses for ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision}: bench_gpu measures {list(PRECISIONS)}")
    return (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if precision == "bf16-mixed"
        else nullcontext()
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def on_device(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }


class Repeat:
    """``count`` batches cycling over pre-loaded ones; an iterable with a length, so Lightning takes
    it for one loader (a list would be many)."""

    def __init__(self, batches: Sequence[dict], count: int):
        self.batches, self.count = batches, count

    def __iter__(self):
        return (self.batches[i % len(self.batches)] for i in range(self.count))

    def __len__(self) -> int:
        return self.count


class NoLogging:
    """Within it, the module's ``log``/``log_dict`` do nothing: the bare loop has no logger."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.log = self.module.log_dict = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        del self.module.log, self.module.log_dict


class PartRanges:
    """Within it, each forward of the module's direct children (encoders, fusion, heads) is a
    ``part:<name>`` profiler range, so a profile splits the forward pass by part without the method
    knowing. A part called several times a step (a text encoder per length bucket) sums."""

    def __init__(self, module):
        self.module, self.handles = module, []

    def __enter__(self):
        for name, child in self.module.named_children():
            ranges: list = []

            def opened(_module, _inputs, name=name, ranges=ranges):
                ranges.append(record_function(f"part:{name}"))
                ranges[-1].__enter__()

            def closed(_module, _inputs, _output, ranges=ranges):
                ranges.pop().__exit__(None, None, None)

            self.handles += [
                child.register_forward_pre_hook(opened),
                child.register_forward_hook(closed),
            ]

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def step_flops(module, batch: dict, device: torch.device, precision: str) -> int:
    """FLOPs of one training step, forward and backward."""
    module.train()

    def step():
        with autocast(device, precision):
            loss = module.training_step(batch, 0)
        loss.backward()

    with NoLogging(module):
        flops = counted_flops(step)
    module.zero_grad(set_to_none=True)
    return flops


def bare_step(module, cfg, total_steps: int, device: torch.device) -> Callable[[int, dict], None]:
    """A plain PyTorch training step as a function of (step, batch): autocast as the trainer's
    precision, the method's AdamW groups and schedule over ``total_steps``, gradient clipping."""
    from torch.optim import AdamW
    from torch.optim.lr_scheduler import LambdaLR

    from ccr.methods.layers.optim import SCHEDULES, param_groups, warmup_step_count

    o = cfg.optim
    optimizer = AdamW(
        param_groups(module, o.weight_decay, o.lr, module.lr_scales()),
        lr=o.lr,
        betas=tuple(o.betas),
        eps=o.eps,
    )
    schedule = partial(
        SCHEDULES[o.schedule],
        total_steps=total_steps,
        min_lr_ratio=o.min_lr_ratio,
        warmup_steps=warmup_step_count(total_steps, o.warmup_steps, o.warmup_ratio),
    )
    scheduler = LambdaLR(optimizer, schedule)

    def step(index: int, batch: dict) -> None:
        with record_function("step:forward"), autocast(device, cfg.trainer.precision):
            loss = module.training_step(batch, index)
        optimizer.zero_grad(set_to_none=True)
        with record_function("step:backward"):
            loss.backward()
        with record_function("step:optimizer"):
            if cfg.trainer.gradient_clip_val:
                torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val)
            optimizer.step()
            scheduler.step()

    return step


def bare_seconds(
    module, cfg, batches: Sequence[dict], steps: int, warmup: int, device: torch.device
) -> float:
    """Seconds of ``steps`` plain PyTorch training steps after ``warmup`` untimed ones."""
    module.to(device)  # as in profile_bare
    step = bare_step(module, cfg, warmup + steps, device)
    module.train()
    start = 0.0
    with NoLogging(module):
        for index in range(warmup + steps):
            if index == warmup:
                synchronize(device)
                start = time.perf_counter()
            step(index, batches[index % len(batches)])
        synchronize(device)
    return time.perf_counter() - start


def profile_bare(
    module, cfg, batches: Sequence[dict], steps: int, device: torch.device, path: Path
) -> dict:
    """Where a bare training step's time goes: ``torch.profiler`` over ``steps`` steps (after one
    untimed step), written to ``path`` as the operators by device time and by host time. Returns
    the summary: wall and device (kernel) milliseconds per step, the share of the wall time the
    device is busy, kernels launched per step and their mean length, and host-device
    synchronisations per step. A busy share far below 1 means the host (launches, syncs, Python)
    starves the chip; near 1 with short kernels means the work itself is too small per kernel."""
    from torch.profiler import ProfilerActivity, profile

    module.to(device)  # a Lightning loop before this one ends with the module moved to the CPU
    step = bare_step(module, cfg, steps + 1, device)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    module.train()
    with NoLogging(module), PartRanges(module):
        step(0, batches[0])
        synchronize(device)
        with profile(activities=activities) as profiler:
            start = time.perf_counter()
            for index in range(1, steps + 1):
                step(index, batches[index % len(batches)])
            synchronize(device)
            wall = time.perf_counter() - start
    averages = profiler.key_averages()
    summary = profile_summary(averages, steps, wall)
    kernels = summary["kernels_per_step"] > 0
    sort = "self_device_time_total" if kernels else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(summary, indent=1)
        + f"\n\n# by device time ({sort})\n"
        + averages.table(sort_by=sort, row_limit=30, max_name_column_width=70)
        + "\n# by host time (self_cpu_time_total)\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
    )
    return summary


def profile_summary(averages, steps: int, wall: float) -> dict:
    """Per-step figures from a profile's operator averages (``profile_bare``'s summary).

    Kernels are the device events that are not ranges: a ``record_function`` range (ours, or the
    optimiser's) shows on the device timeline as a span from its first kernel to its last, which
    would count its kernels twice and the gaps between them as work. For each ``step:``/``part:``
    range, ``parts_ms_per_step`` gives the host milliseconds inside it and that device span."""
    from torch.autograd import DeviceType

    kernels = [e for e in averages if e.device_type != DeviceType.CPU and not e.is_user_annotation]
    device_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    syncs = sum(e.count for e in averages if "Synchronize" in e.key)
    parts: dict[str, dict[str, float]] = {}
    for e in averages:
        if e.key.startswith(("step:", "part:")):
            on_host = e.device_type == DeviceType.CPU
            value = (e.cpu_time_total if on_host else e.self_device_time_total) / 1e3 / steps
            parts.setdefault(e.key, {})["host_ms" if on_host else "device_span_ms"] = round(
                value, 2
            )
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "device_ms_per_step": device_us / 1e3 / steps,
        "device_busy": device_us / 1e6 / wall if kernels else None,
        "kernels_per_step": launches / steps,
        "mean_kernel_us": device_us / launches if launches else None,
        "syncs_per_step": syncs / steps,
        "parts_ms_per_step": parts,
    }


def lightning_seconds(
    module, cfg, loader: Iterable, steps: int, warmup: int, device: torch.device
) -> tuple[float, float]:
    """Seconds of ``steps`` steps of the suite's Trainer after ``warmup`` untimed ones, and the
    startup: seconds from the epoch's start to its first batch (the loader's workers starting and
    filling their first batches), which a long run pays once and a short timed window can hide
    or catch."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ccr.experiments.trainer import (
        StopOnNonFiniteLoss,
        Throughput,
        TrainingPosition,
        build_trainer,
    )

    class Timer(L.Callback):
        epoch = first = start = end = None

        def on_train_epoch_start(self, trainer, pl_module):
            if self.epoch is None:
                self.epoch = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.first is None:
                self.first = time.perf_counter()
            if trainer.global_step == warmup and self.start is None:
                synchronize(device)
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == warmup + steps:
                synchronize(device)
                self.end = time.perf_counter()

    timer = Timer()
    callbacks = [Throughput(), TrainingPosition(), StopOnNonFiniteLoss("bench"), timer]  # a run's
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(
            cfg, Path(tmp), Path(tmp) / "checkpoints", warmup + steps, callbacks
        )
        for callback in trainer.callbacks:  # no multi-GB last.ckpt at the end of a benchmark
            if isinstance(callback, ModelCheckpoint):
                callback.save_last = False
        trainer.fit(module, train_dataloaders=loader)
    if timer.start is None or timer.end is None or timer.epoch is None or timer.first is None:
        raise RuntimeError(f"Lightning trained {trainer.global_step} of {warmup + steps} steps")
    return timer.end - timer.start, timer.first - timer.epoch


def as_jpeg_photos(image_dir: Path, size: str) -> None:
    """Re-encode the benchmark world's images in place as JPEGs of ``size`` ("500x375", quality 90):
    the decoding and resizing cost of real photos, on every core. File names stay (PIL reads by
    content); a marker file makes it once per world."""
    marker = image_dir / f".jpeg-{size}"
    if marker.exists():
        return
    width, height = (int(side) for side in size.split("x"))
    paths = sorted(p for p in image_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    with ProcessPoolExecutor() as pool:
        list(pool.map(partial(_as_jpeg, width=width, height=height), paths, chunksize=64))
    marker.touch()


def _as_jpeg(path: Path, width: int, height: int) -> None:
    from PIL import Image

    with Image.open(path) as image:
        photo = image.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
    photo.save(path, "JPEG", quality=90)


def trainer_seconds(
    module, cfg, loader: Iterable, steps: int, warmup: int, device: torch.device
) -> tuple[float, dict]:
    """``lightning_seconds`` with its start-up as ``startup_s``."""
    seconds, startup = lightning_seconds(module, cfg, loader, steps, warmup, device)
    return seconds, {"startup_s": startup}


def loader_seconds(
    module, cfg, loader, steps: int, warmup: int, device: torch.device
) -> tuple[float, dict]:
    """The trainer fed by the real training loader, timed in steady state: the warm-up is at least
    one batch per worker, so every worker has started and delivered before the clock runs. Also
    says whether an epoch boundary (the workers refilling for the next epoch) falls inside the
    timed window, which a real epoch of hundreds of steps makes rare and a small world makes
    frequent."""
    warmup = max(warmup, loader.num_workers)
    try:
        per_epoch: int | None = len(loader)
    except TypeError:  # an iterable-style loader (streamed shards) has no length
        per_epoch = None
    seconds, extras = trainer_seconds(module, cfg, loader, steps, warmup, device)
    crosses = per_epoch is not None and warmup + steps > per_epoch
    return seconds, {**extras, "warmup": warmup, "epoch_boundary_in_window": crosses}


def run_config(method: str, args, work: Path):
    """The composed run config: the method's paper preset on the synthetic world at the
    benchmark's sizes, then the command line's ``key=value`` overrides."""
    from ccr.experiments.config import compose

    sizes = [
        f"data.image_size={args.image_size}",
        f"data.max_length={args.max_length}",
        f"data.batch_size={args.batch}",
        f"data.synthetic.num_train={args.num_train}",
        f"data.synthetic.render_size={args.render_size or args.image_size}",
    ]
    return compose(
        [
            f"method={PAPER_PRESET[method]}",
            "data=synthetic",
            f"trainer={args.trainer}",
            f"data.root={work / 'world'}",
            "data.backbones=null",
            "data.synthetic.num_val=8",
            "data.synthetic.num_test=8",
            "data.synthetic.num_pretrain=8",
            *sizes,
            "trainer.checkpoint_every_n_steps=1000000",
            "trainer.log_every_n_steps=50",
            *args.overrides,
        ]
    )


def measure(method: str, args, work: Path, device: torch.device) -> dict:
    """One method's row: FLOPs, the three loops, peak memory, MFU and the ratios."""
    import lightning as L
    from omegaconf import open_dict

    from ccr import methods
    from ccr.experiments.pretrain.backbones import with_backbones
    from ccr.experiments.train import build_datamodule
    from ccr.experiments.trainer import configure_matmul_precision, configure_threads

    cfg = run_config(method, args, work)
    configure_threads(cfg)
    configure_matmul_precision(cfg)
    data = build_datamodule(cfg, roles=("train",))
    if args.jpeg:
        as_jpeg_photos(data.image_root, args.jpeg)
    with open_dict(cfg):
        cfg.method = paper_method(method, cfg.method, data.info, tiny=args.tiny)
    L.seed_everything(cfg.seed, verbose=False)
    info = with_backbones(data)
    stages = methods.get(method).pipeline(
        cfg.method, cfg.optim, info, cfg.evaluation, protocol=cfg.protocol
    )
    stage = stages[0]
    with torch.device(device):  # random init on the device: seconds, not minutes on the host
        module = stage.build(None)
    module.to(device)
    if hasattr(module, "parallel_batches"):  # rc3's parallel-text stream, read from the trainer's
        from ccr.methods.rc3.module import (
            StepIndexedBatches,  # datamodule in a run; this loop has none
        )

        module.parallel_batches = StepIndexedBatches(data.parallel_dataloader())
    loader = stage.dataloader(data)
    batches = []
    for batch in loader:
        batches.append(on_device(batch, device))
        if len(batches) == args.cached_batches:
            break
    del loader
    precision = cfg.trainer.precision
    row = {
        "method": method,
        "params_M": sum(p.numel() for p in module.parameters()) / 1e6,
        "batch": cfg.data.batch_size,
        "precision": precision,
        "num_workers": data.loader["num_workers"],
        "pin_memory": bool(data.loader.get("pin_memory")),
        "image_cache": bool(cfg.data.image_cache),
    }
    flops = step_flops(module, batches[0], device, precision)
    row["gflops_per_sample"] = flops / cfg.data.batch_size / 1e9
    print(f"[bench_gpu] {method}: {row['gflops_per_sample']:.2f} GFLOP/sample", flush=True)
    loops = {  # each gives (seconds of the timed steps, what else it measured)
        "bare": lambda: (bare_seconds(module, cfg, batches, args.steps, args.warmup, device), {}),
        "lightning": lambda: trainer_seconds(
            module, cfg, Repeat(batches, args.warmup + args.steps), args.steps, args.warmup, device
        ),
        "loader": lambda: loader_seconds(
            module, cfg, stage.dataloader(data), args.steps, args.warmup, device
        ),
    }
    for name in args.loops:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds, extras = loops[name]()
        row[name] = loop_row(seconds / args.steps, cfg.data.batch_size, flops, args.peak)
        row[name].update(extras)
        if extras.get("epoch_boundary_in_window"):
            print(
                f"[bench_gpu] {method} {name}: an epoch boundary falls inside the timed window "
                "(raise --num-train or lower --steps): the figure includes a refill",
                flush=True,
            )
        if device.type == "cuda":
            row[name]["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(
            f"[bench_gpu] {method} {name}: {row[name]['s_per_step']:.4f} s/step, "
            f"{row[name]['samples_per_s']:.1f} samples/s"
            + (
                f", {extras['startup_s']:.2f} s to the first batch" if "startup_s" in extras else ""
            ),
            flush=True,
        )
    if args.profile:
        row["profile"] = profile_bare(
            module, cfg, batches, args.profile_steps, device, Path(args.profile) / f"{method}.txt"
        )
        print(f"[bench_gpu] {method} profile: {row['profile']}", flush=True)
    for faster, slower in (("loader", "bare"), ("lightning", "bare"), ("loader", "lightning")):
        if faster in row and slower in row:
            ratio = row[faster]["samples_per_s"] / row[slower]["samples_per_s"]
            row[f"{faster}/{slower}"] = ratio
    return row


def loop_row(
    seconds_per_step: float, batch_size: int, flops_per_step: int, peak: float | None
) -> dict:
    rate = batch_size / seconds_per_step
    return {
        "s_per_step": seconds_per_step,
        "samples_per_s": rate,
        "mfu": None if peak is None else mfu(flops_per_step, seconds_per_step, peak),
    }


def table(rows: list[dict], device_name: str, peak: float | None, args) -> str:
    """The results as a Markdown table."""
    title = (
        f"bench_gpu on {device_name}, peak {peak if peak is not None else '?'} TFLOP/s, "
        f"{args.image_size} px, max_length {args.max_length}, {args.steps} timed steps after "
        f"{args.warmup}{' (tiny sizes)' if args.tiny else ''}"
        f"{f', images as {args.jpeg} JPEG' if args.jpeg else ''}"
    )
    lines = [
        title,
        "",
        "| method | params M | GFLOP/sample | loop | s/step | samples/s | startup s | peak GiB | MFU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for loop in (loop for loop in LOOPS if loop in r):
            t = r[loop]
            peak_gib = f"{t['peak_gib']:.1f}" if "peak_gib" in t else "-"
            utilisation = "-" if t["mfu"] is None else f"{100 * t['mfu']:.1f} %"
            startup = f"{t['startup_s']:.2f}" if "startup_s" in t else "-"
            lines.append(
                f"| {r['method']} | {r['params_M']:.1f} | {r['gflops_per_sample']:.2f} | {loop} "
                f"| {t['s_per_step']:.4f} | {t['samples_per_s']:.1f}"
                f"{' (epoch boundary)' if t.get('epoch_boundary_in_window') else ''} | {startup} "
                f"| {peak_gib} "
                f"| {utilisation} |"
            )
    lines.append("")
    for r in rows:
        ratios = ", ".join(f"{key} {value:.2f}" for key, value in r.items() if "/" in key)
        lines.append(
            f"- {r['method']}: {ratios or 'no ratios'} ({r['num_workers']} loader workers"
            f"{', pinned' if r['pin_memory'] else ''}"
            f"{', image cache' if r['image_cache'] else ''}, batch {r['batch']}, {r['precision']})"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(PAPER_PRESET))
    parser.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU, its test)")
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--trainer", default=None, help="trainer preset (default: gpu on cuda, else cpu)"
    )
    parser.add_argument("--batch", type=int, default=None, help="default: 128 (tiny: 4)")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps (default: 30; tiny: 2)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default: 5; tiny: 1)"
    )
    parser.add_argument("--image-size", type=int, default=None, help="default: 224 (tiny: 32)")
    parser.add_argument(
        "--render-size", type=int, default=None, help="world's rendered side (default: image size)"
    )
    parser.add_argument(
        "--jpeg",
        default=None,
        metavar="WxH",
        help="re-encode the world's images as JPEG photos of this size, e.g. 500x375",
    )
    parser.add_argument(
        "--max-length", type=int, default=None, help="caption tokens (default: 40; tiny: 16)"
    )
    parser.add_argument(
        "--num-train", type=int, default=None, help="world's train images (default: 8192; tiny: 16)"
    )
    parser.add_argument(
        "--loops",
        type=lambda text: text.split(","),
        default=list(LOOPS),
        help=f"which of {','.join(LOOPS)} to time (default: all)",
    )
    parser.add_argument("--cached-batches", type=int, default=4, help="distinct pre-loaded batches")
    parser.add_argument(
        "--peak-tflops",
        dest="peak",
        type=float,
        default=None,
        help="the device's peak TFLOP/s (default: PEAK_TFLOPS by device name)",
    )
    parser.add_argument(
        "--work", default=None, help="where the world is built (default: a temporary folder)"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="also profile bare steps with torch.profiler into DIR/<method>.txt",
    )
    parser.add_argument("--profile-steps", type=int, default=5, help="steps profiled")
    parser.add_argument("overrides", nargs="*", help="run config key=value overrides")
    args = parser.parse_args(argv)
    small = {
        "batch": 4,
        "steps": 2,
        "warmup": 1,
        "image_size": 32,
        "num_train": 16,
        "max_length": 16,
    }
    full = {
        "batch": 128,
        "steps": 30,
        "warmup": 5,
        "image_size": 224,
        "num_train": 8192,  # 64 batches: the loader's timed window stays inside one epoch
        "max_length": 40,
    }
    for key, value in (small if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = sorted(set(args.loops) - set(LOOPS))
    if unknown:
        parser.error(f"--loops: unknown {unknown}; choose from {list(LOOPS)}")
    args.trainer = args.trainer or ("gpu" if args.device.startswith("cuda") else "cpu")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    from ccr.experiments.cli import quiet

    args = parse_args(argv)
    quiet()
    device = torch.device(args.device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    args.peak = peak_tflops(device_name, args.peak)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        for method in args.methods.split(","):
            rows.append(measure(method, args, work, device))
            gc.collect()  # the method's model, batches and loaders, before the next is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
    report = table(rows, device_name, args.peak, args)
    print(report, flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device_name, "peak_tflops": args.peak, "rows": rows}, indent=1)
        )
    return rows


if __name__ == "__main__":
    main()
