"""Contrastive loss over the global batch: 2 gloo processes give the 1-process gradients."""

import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from ccr.methods.layers.contrastive import LearnableTemperature, info_nce
from ccr.methods.layers.distributed import gather_with_grad, rank, world_size

WORLD, LOCAL_BATCH, DIM = 2, 3, 8


def _model_and_batch():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"image": nn.Linear(DIM, 4), "text": nn.Linear(DIM, 4), "tau": LearnableTemperature()}
    )
    images, texts = torch.randn(WORLD * LOCAL_BATCH, DIM), torch.randn(WORLD * LOCAL_BATCH, DIM)
    return model, images, texts


def _loss(model, images, texts):
    return info_nce(
        F.normalize(model["image"](images), dim=-1),
        F.normalize(model["text"](texts), dim=-1),
        model["tau"](),
    )


def _worker(process_rank, port, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=process_rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model, images, texts = _model_and_batch()
        local = slice(process_rank * LOCAL_BATCH, (process_rank + 1) * LOCAL_BATCH)
        loss = _loss(model, images[local], texts[local])
        loss.backward()
        grads = {}
        for name, param in model.named_parameters():  # what DDP does: average over processes
            dist.all_reduce(param.grad)
            grads[name] = param.grad / WORLD
        loss_sum = loss.detach().clone()
        dist.all_reduce(loss_sum)
        if process_rank == 0:
            torch.save(
                {
                    "grads": grads,
                    "loss": loss_sum / WORLD,
                    "rank_seen": rank(),
                    "world": world_size(),
                },
                out_path,
            )
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_gradients_equal_single_process_global_batch(tmp_path):
    out_path = tmp_path / "rank0.pt"
    mp.spawn(_worker, args=(_free_port(), str(out_path)), nprocs=WORLD, join=True)
    result = torch.load(out_path)
    assert result["world"] == WORLD and result["rank_seen"] == 0

    model, images, texts = _model_and_batch()
    loss = _loss(model, images, texts)
    loss.backward()
    torch.testing.assert_close(result["loss"], loss.detach())
    for name, param in model.named_parameters():
        torch.testing.assert_close(result["grads"][name], param.grad, msg=name)
        assert param.grad.abs().sum() > 0, name


def test_without_process_group_gather_is_identity():
    x = torch.randn(4, 3, requires_grad=True)
    assert gather_with_grad(x) is x and rank() == 0 and world_size() == 1


def test_info_nce_matches_the_definition():
    torch.manual_seed(1)
    images, texts = F.normalize(torch.randn(5, 4), dim=-1), F.normalize(torch.randn(5, 4), dim=-1)
    tau = torch.tensor(0.1)
    logits = images @ texts.t() / tau
    by_hand = (
        -(logits.diag() - logits.logsumexp(1)).mean() / 2
        - (logits.diag() - logits.logsumexp(0)).mean() / 2
    )
    torch.testing.assert_close(info_nce(images, texts, tau), by_hand)
    assert info_nce(images, images, torch.tensor(0.01)) < 0.01


def test_temperature_is_log_parameterised_and_clamped():
    tau = LearnableTemperature(init=0.07, min_value=0.01, max_value=0.5)
    torch.testing.assert_close(tau.log_tau.detach(), torch.tensor(math.log(0.07)))
    with torch.no_grad():
        tau.log_tau.fill_(math.log(1e-4))
    assert tau().item() == pytest.approx(0.01)
    fixed = LearnableTemperature(init=0.07, learnable=False)
    assert not fixed.log_tau.requires_grad
