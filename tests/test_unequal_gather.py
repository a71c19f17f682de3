"""Gathers with gradient over processes holding different numbers of rows: 2 gloo processes with
7 and 12 rows (and with 0 and 19) give the loss and the DDP-averaged gradients of one process
with all 19 rows, for InfoNCE and the 1-to-K loss (captions absent unevenly)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from ccr.methods.ccrk.one_to_k import one_to_k_loss
from ccr.methods.layers.contrastive import LearnableTemperature, info_nce
from ccr.methods.layers.distributed import RowLayout, gather_with_grad, row_layout

WORLD, ROWS, K, IN_DIM, DIM = 2, 19, 3, 6, 5
SPLITS = ((7, 12), (0, 19))


def problem():
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(ROWS, IN_DIM, generator=gen)
    texts = torch.randn(ROWS * K, IN_DIM, generator=gen)
    present = torch.rand(ROWS * K, generator=gen) > 0.3
    present.view(ROWS, K)[:, 0] = True  # every instance keeps a caption
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "image": nn.Linear(IN_DIM, DIM),
            "text": nn.Linear(IN_DIM, DIM),
            "tau": LearnableTemperature(init=0.1),
        }
    )
    return images, texts, present, model


LOSSES = ("info_nce", "one_to_k")


def loss_of(name, model, images, texts, present):
    """Image i pairs with caption block i (with caption i*K for InfoNCE)."""
    image = F.normalize(model["image"](images), dim=-1)
    text = F.normalize(model["text"](texts), dim=-1)
    tau = model["tau"]()
    if name == "info_nce":
        return info_nce(image, text[::K], tau)
    return one_to_k_loss(image, text, tau, present).total


def loss_and_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        images, texts, present, model = problem()
        results = {}
        for split in SPLITS:
            start, count = sum(split[:rank]), split[rank]
            rows = slice(start, start + count)
            captions = slice(start * K, (start + count) * K)
            assert row_layout(count, "cpu") == RowLayout(counts=split, rank=rank)
            for name in LOSSES:
                local = loss_of(name, model, images[rows], texts[captions], present[captions])
                loss, grads = loss_and_grads(model, local)
                for grad in [loss, *grads]:  # what DDP (and a mean over processes) does
                    dist.all_reduce(grad)
                    grad /= WORLD
                results[split, name] = (loss, grads)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_unequal_rows_on_two_processes_equal_one_process_with_all_rows(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    images, texts, present, model = problem()
    expected = {
        name: loss_and_grads(model, loss_of(name, model, images, texts, present)) for name in LOSSES
    }
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for split in SPLITS:
            for name, (expected_loss, expected_grads) in expected.items():
                loss, grads = results[split, name]
                torch.testing.assert_close(loss, expected_loss, msg=f"{split} {name}")
                for grad, reference in zip(grads, expected_grads, strict=True):
                    assert reference.abs().sum() > 0
                    torch.testing.assert_close(grad, reference, msg=f"{split} {name}")


def test_gather_keeps_rank_order_and_layout_arithmetic():
    layout = RowLayout(counts=(7, 0, 12), rank=2)
    assert (layout.local, layout.offset, layout.total) == (12, 7, 19)
    values = torch.arange(12.0)
    # three processes: this one's share is sum * 3 / 19, so the mean of the shares is the global mean
    assert layout.global_mean(values).item() == pytest.approx(66 * 3 / 19)
    x = torch.randn(4, 2)
    assert gather_with_grad(x) is x  # no process group: identity
