"""Two gloo processes with the distributed 1-to-K loss give the gradient of one process with the
global batch (spec ccrk.md §3.1: caption blocks gathered with their images, image-major order kept)."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from ccr.methods.ccrk.one_to_k import one_to_k_loss

WORLD, LOCAL_B, K, IN_DIM, DIM = 2, 3, 3, 5, 4


def make_problem():
    gen = torch.Generator().manual_seed(0)
    image_inputs = torch.randn(WORLD * LOCAL_B, IN_DIM, generator=gen)
    text_inputs = torch.randn(WORLD * LOCAL_B * K, IN_DIM, generator=gen)
    torch.manual_seed(0)
    model = nn.ModuleDict({"image": nn.Linear(IN_DIM, DIM), "text": nn.Linear(IN_DIM, DIM)})
    return image_inputs, text_inputs, model


def loss_and_grads(model, image_inputs, text_inputs, weighting):
    image = F.normalize(model["image"](image_inputs), dim=1)
    text = F.normalize(model["text"](text_inputs), dim=1)
    loss = one_to_k_loss(image, text, 0.2, weighting=weighting).total
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        image_inputs, text_inputs, model = make_problem()
        images = image_inputs[rank * LOCAL_B : (rank + 1) * LOCAL_B]
        texts = text_inputs[rank * LOCAL_B * K : (rank + 1) * LOCAL_B * K]
        results = {}
        for weighting in ("paper", "reference"):
            loss, grads = loss_and_grads(model, images, texts, weighting)
            for grad in grads:  # what DDP does: average the parameter gradients
                dist.all_reduce(grad)
                grad /= WORLD
            dist.all_reduce(loss)
            results[weighting] = (loss / WORLD, grads)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_match_one_process_with_the_global_batch(tmp_path):
    mp.spawn(worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    image_inputs, text_inputs, model = make_problem()
    for weighting in ("paper", "reference"):
        expected_loss, expected_grads = loss_and_grads(model, image_inputs, text_inputs, weighting)
        for rank in range(WORLD):
            loss, grads = torch.load(tmp_path / f"rank{rank}.pt")[weighting]
            assert torch.allclose(loss, expected_loss, atol=1e-6)
            for grad, expected in zip(grads, expected_grads, strict=True):
                assert torch.allclose(grad, expected, atol=1e-6)
