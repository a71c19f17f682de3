"""Two gloo processes running CoVLR's training step give the loss and the (DDP-averaged) gradients of
one process with the global batch: the inner gradient is averaged before the virtual step, so Θ' is
the global batch's, and ITC, the intra-modal losses and the label counts use the global batch.

Random draws are pinned for the comparison (first present language, last other language as the
text view, a flip as the image view); MLM
and MPM are off here because their masks are drawn per process (both are means over the local masked
positions, like CCRk's CMLM)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_covlr_module import B, build, grads, training_batch

import ccr.methods.covlr.module as covlr

WORLD = 2
SETTINGS = {
    "cls": {"uni_mode": "cls"},
    "nce": {"uni_mode": "nce"},
    "sum": {"uni_mode": "cls", "meta": False},
}


def first_language(present):
    return present.float().argmax(1)


def last_other_language(present, chosen):
    others = present.bool().clone()
    others[torch.arange(len(chosen)), chosen] = False
    last = present.shape[1] - 1 - others.flip(1).float().argmax(1)
    return last, others.any(1)


def flip(images, *args):
    return images.flip(-1)


PINNED = {
    "sample_one_language": first_language,
    "other_language": last_other_language,
    "flip_and_translate": flip,
}


def pin_draws():
    for name, value in PINNED.items():
        setattr(covlr, name, value)


def step(setting, batch):
    module = build(use_mlm=False, use_mpm=False, meta_alpha=0.5, **SETTINGS[setting])
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), grads(module)


def local_rows(batch, rank):
    rows = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    return {
        key: value[rows] if torch.is_tensor(value) and len(value) == B else value
        for key, value in batch.items()
    }


def worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        pin_draws()
        results = {}
        for setting in SETTINGS:
            loss, grad = step(setting, local_rows(training_batch(absent=[(2, 1), (6, 0)]), rank))
            for value in [loss, *grad.values()]:  # what DDP does with the gradients
                dist.all_reduce(value)
                value /= WORLD
            results[setting] = (loss, grad)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_global_batch(tmp_path, monkeypatch):
    mp.spawn(worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    for name, value in PINNED.items():
        monkeypatch.setattr(covlr, name, value)
    for setting in SETTINGS:
        expected_loss, expected = step(setting, training_batch(absent=[(2, 1), (6, 0)]))
        for rank in range(WORLD):
            loss, grad = torch.load(tmp_path / f"rank{rank}.pt")[setting]
            assert loss.item() == pytest.approx(expected_loss.item(), abs=1e-5), setting
            for name in expected:
                assert torch.allclose(grad[name], expected[name], atol=1e-6), (setting, name)
