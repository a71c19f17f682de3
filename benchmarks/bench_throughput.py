"""Training throughput of the `clip` baseline under Lightning against the same steps in a plain
PyTorch loop: same module, same batches, same optimizer, schedule and gradient clipping.

    python benchmarks/bench_throughput.py --steps 200 --rounds 3 [key=value config overrides]

The Lightning side is the suite's real trainer (progress bar, TensorBoard + CSV loggers,
checkpointing), so the overhead printed is what a user's run pays. Rounds alternate the two
loops; medians are reported. Target: Lightning overhead at most 5 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from functools import partial
from itertools import islice
from pathlib import Path

import lightning as L
import torch
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from ccr import methods
from ccr.experiments.config import compose
from ccr.experiments.pretrain.backbones import with_backbones
from ccr.experiments.train import build_datamodule
from ccr.experiments.trainer import build_trainer, configure_threads
from ccr.methods.layers.optim import param_groups, warmup_cosine


class StepTimer(L.Callback):
    """Seconds from the first to the last training batch, excluding ``warmup`` batches."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.start, self.end = warmup, None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def build_module(cfg, data):
    return methods.get(cfg.method.name)(cfg.method, cfg.optim, with_backbones(data), cfg.evaluation)


def lightning_seconds(cfg, data, steps: int, warmup: int) -> float:
    module = build_module(cfg, data)
    timer = StepTimer(warmup)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(cfg, Path(tmp), Path(tmp) / "checkpoints", warmup + steps, [timer])
        trainer.fit(module, train_dataloaders=data.train_dataloader())
    return timer.end - timer.start


def plain_seconds(cfg, data, steps: int, warmup: int) -> float:
    module = build_module(cfg, data)
    module.log = lambda *args, **kwargs: None  # the plain loop has no logger
    optim = cfg.optim
    optimizer = AdamW(
        param_groups(module, optim.weight_decay, optim.lr, module.lr_scales()),
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
    )
    scheduler = LambdaLR(
        optimizer,
        partial(
            warmup_cosine,
            warmup_steps=optim.warmup_steps,
            total_steps=warmup + steps,
            min_lr_ratio=optim.min_lr_ratio,
        ),
    )
    module.train()
    start = None
    batches = (b for _ in iter(int, 1) for b in data.train_dataloader())  # epochs without end
    for step, batch in enumerate(islice(batches, warmup + steps)):
        if step == warmup:
            start = time.perf_counter()
        loss = module.training_step(batch, step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val)
        optimizer.step()
        scheduler.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(["method=clip", "trainer.progress_refresh_rate=10", *args.overrides])
    torch.manual_seed(cfg.seed)
    configure_threads(cfg)
    data = build_datamodule(cfg)
    plain, light = [], []
    for round_ in range(args.rounds):
        order = [("plain", plain_seconds, plain), ("lightning", lightning_seconds, light)]
        for name, measure, out in order if round_ % 2 == 0 else order[::-1]:
            out.append(measure(cfg, data, args.steps, args.warmup))
            print(f"round {round_} {name:9s} {out[-1]:.2f} s", flush=True)
    batch = cfg.data.batch_size
    p, li = statistics.median(plain), statistics.median(light)
    print(
        f"\n{args.steps} steps of clip, batch {batch}, {torch.get_num_threads()} threads, "
        f"median of {args.rounds} rounds"
    )
    print(f"{'loop':10s} {'seconds':>8s} {'steps/s':>8s} {'samples/s':>10s}")
    for name, sec in (("plain", p), ("lightning", li)):
        print(f"{name:10s} {sec:8.2f} {args.steps / sec:8.2f} {args.steps * batch / sec:10.1f}")
    print(f"Lightning overhead: {100 * (li / p - 1):+.1f} % (target <= 5 %)")


if __name__ == "__main__":
    main()
