"""``optim.grad_cache_chunks``: a training batch encoded in micro-batches gives one contrastive loss
over the whole batch with the gradient of the unchunked batch, on one process and under DDP."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import OmegaConf
from torch import nn
from worlds import random_backbones

import ccr.methods.layers.grad_cache as grad_cache
from ccr.methods.base import RetrievalModule
from ccr.methods.ccrk.module import CCRk
from ccr.methods.clip.module import CLIPModule
from ccr.methods.layers.grad_cache import encode_in_chunks

CONFIGS = Path(__file__).resolve().parents[1] / "ccr/experiments/configs"
ROWS, K, L, VOCAB, IMAGE = 64, 3, 10, 60, 16
INFO = dict(
    languages=["en", "de", "fr"],
    vocab_size=VOCAB,
    pad_token_id=0,
    cls_token_id=1,
    eos_token_id=2,
    mask_token_id=3,
    max_length=L,
    image_size=IMAGE,
    num_objects=0,
    backbones=random_backbones(width=32),
)
TOLERANCE = dict(rtol=1e-4, atol=1e-6)


def build(name, chunks, dropout=0.0, **method_overrides):
    """clip or ccrk from its preset on random tiny encoders, seeded, with ``grad_cache_chunks``."""
    method = OmegaConf.load(CONFIGS / "method" / f"{name}.yaml").method
    method.pop("optim", None)
    if name == "ccrk":  # a random fusion: the tiny text encoder has no pretrained layers to seed it
        method.ablation = None
        method.fusion.init_from_text_layers, method.fusion.heads = None, 4
    method = OmegaConf.merge(method, method_overrides)
    base = OmegaConf.load(CONFIGS / "base.yaml")
    base.optim.grad_cache_chunks = chunks
    info = dict(INFO, backbones=random_backbones(width=32))
    for side in ("image", "text"):
        info["backbones"][side]["dropout"] = dropout
    torch.manual_seed(0)
    module = {"clip": CLIPModule, "ccrk": CCRk}[name](method, base.optim, info, base.evaluation)
    return module.train()


def training_batch(rows=ROWS, one_language=False, seed=0):
    """Random images and captions of random lengths in K languages (all present, or only the
    first language when ``one_language``, so which caption clip draws is not random)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (rows, K, L), generator=gen)
    lengths = torch.randint(3, L + 1, (rows, K), generator=gen)
    mask = (torch.arange(L) < lengths[..., None]).long()
    ids[..., 0] = 1
    ids.scatter_(2, (lengths - 1)[..., None], 2)
    ids[mask == 0] = 0
    present = torch.ones(rows, K, dtype=torch.bool)
    if one_language:
        present[:, 1:] = False
        ids[:, 1:], mask[:, 1:] = 0, 0
    return {
        "images": torch.randn(rows, 3, IMAGE, IMAGE, generator=gen),
        "input_ids": ids,
        "attention_mask": mask,
        "present": present,
        "languages": INFO["languages"],
        "ids": [str(i) for i in range(rows)],
    }


def loss_and_grads(module, batch, seed=1):
    """The training step's loss and every parameter's gradient (None where it gets none)."""
    module.zero_grad()
    torch.manual_seed(seed)
    loss = module.training_step(batch, 0)
    loss.backward()
    return loss.detach(), {
        name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()
    }


def assert_same(result, expected):
    loss, grads = result
    assert torch.allclose(loss, expected[0], **TOLERANCE), (loss, expected[0])
    assert grads.keys() == expected[1].keys()
    for name, grad in grads.items():
        if expected[1][name] is None:
            assert grad is None, name
        else:
            assert grad is not None and torch.allclose(grad, expected[1][name], **TOLERANCE), name


@pytest.mark.parametrize(
    "name, overrides", [("clip", {}), ("ccrk", {}), ("ccrk", {"use_fusion": False})]
)
def test_four_micro_batches_of_16_give_the_loss_and_gradients_of_one_batch_of_64(name, overrides):
    batch = training_batch()
    whole = loss_and_grads(build(name, chunks=1, **overrides), batch)
    assert any(g is not None and g.abs().sum() > 0 for g in whole[1].values())
    module = build(name, chunks=4, **overrides)
    rows_seen = []
    module.image_encoder.register_forward_pre_hook(lambda m, args: rows_seen.append(len(args[0])))
    assert_same(loss_and_grads(module, batch), whole)
    assert rows_seen == [16] * 8  # four micro-batches, each run again in the backward pass


def test_micro_batches_see_the_whole_batch_as_negatives_unlike_separate_steps():
    """The point of the option: the loss over 64 rows is not the mean of four 16-row losses."""
    batch = training_batch()
    whole, _ = loss_and_grads(build("clip", chunks=4), batch)
    module = build("clip", chunks=1)
    separate = torch.stack(
        [
            loss_and_grads(module, {k: v[i * 16 : (i + 1) * 16] for k, v in batch.items()})[0]
            for i in range(4)
        ]
    ).mean()
    assert whole > separate + 0.5  # log 64 against log 16 negatives at initialisation


def test_dropout_masks_are_replayed_when_a_micro_batch_is_recomputed(monkeypatch):
    """With dropout the recomputed forward must draw the masks of the first one: the gradient
    equals that of the same micro-batched forward keeping its activations."""
    batch = training_batch()
    recomputed = loss_and_grads(build("clip", chunks=4, dropout=0.3), batch)
    monkeypatch.setattr(grad_cache, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    kept = loss_and_grads(build("clip", chunks=4, dropout=0.3), batch)
    assert_same(recomputed, kept)
    no_dropout = loss_and_grads(build("clip", chunks=4, dropout=0.0), batch)
    assert not torch.allclose(recomputed[0], no_dropout[0])  # dropout did act


def test_uneven_and_oversized_chunk_counts_keep_every_row():
    x = torch.randn(5, 3, requires_grad=True)
    out = encode_in_chunks(lambda t: (t * 2, t.sum(1)), x, chunks=8)
    assert torch.equal(out[0], x * 2) and torch.equal(out[1], x.sum(1))
    with pytest.raises(ValueError, match="different row counts"):
        encode_in_chunks(lambda a, b: a, x, torch.zeros(4), chunks=2)


def test_a_training_batch_norm_inside_a_micro_batch_is_refused_and_a_frozen_one_is_not():
    """Batch statistics of a micro-batch are not the batch's: no recomputation makes them exact."""
    encoder = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    x = torch.randn(8, 3)
    with pytest.raises(ValueError, match=r"grad_cache_chunks: a BatchNorm1d in training mode"):
        encode_in_chunks(encoder, x, chunks=2)
    encoder.eval()
    assert torch.allclose(encode_in_chunks(encoder, x, chunks=2), encoder(x), atol=1e-6)
    assert torch.equal(encode_in_chunks(encoder.train(), x, chunks=1), encoder(x))


def test_a_method_that_does_not_chunk_refuses_the_option():
    class Unchunked(RetrievalModule):
        """A method that never declares ``supports_grad_cache``."""

    base = OmegaConf.load(CONFIGS / "base.yaml")
    base.optim.grad_cache_chunks = 2
    with pytest.raises(ValueError, match=r"optim.grad_cache_chunks=2: Unchunked does not encode"):
        Unchunked({}, base.optim, INFO, base.evaluation)


# ---- two processes --------------------------------------------------------------------------------

WORLD = 2
CASES = [("clip", {}), ("ccrk", {"use_fusion": False})]  # no random draws that depend on the rank


class Step(nn.Module):
    """What Lightning's DDP wrapper does: the module's training step is the DDP forward."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch):
        return self.module.training_step(batch, 0)


def ddp_worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        batch = training_batch(one_language=True)
        local = {k: v[rank * ROWS // WORLD : (rank + 1) * ROWS // WORLD] for k, v in batch.items()}
        results = {}
        for name, overrides in CASES:
            module = build(name, chunks=2, **overrides)  # 2 processes x 2 micro-batches of 16
            rows_seen = []
            module.image_encoder.register_forward_pre_hook(
                lambda m, args, seen=rows_seen: seen.append(len(args[0]))
            )
            model = nn.parallel.DistributedDataParallel(Step(module))
            torch.manual_seed(1)
            loss = model(local)
            loss.backward()
            dist.all_reduce(loss := loss.detach())
            results[name] = (
                loss / WORLD,
                {
                    n: None if p.grad is None else p.grad.clone()
                    for n, p in module.named_parameters()
                },
                rows_seen,
            )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ddp_processes_with_two_micro_batches_each_match_one_process_with_the_batch_of_64(
    tmp_path,
):
    mp.spawn(ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    batch = training_batch(one_language=True)
    for name, overrides in CASES:
        expected = loss_and_grads(build(name, chunks=1, **overrides), batch)
        for rank in range(WORLD):
            loss, grads, rows_seen = torch.load(tmp_path / f"rank{rank}.pt")[name]
            assert rows_seen == [16] * 4  # two micro-batches, each run again in the backward pass
            assert_same((loss, grads), expected)
