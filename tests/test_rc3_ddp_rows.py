"""RC3 under DDP when a process has no rows of a pool (spec rc3.md §8, issue 16): two gloo
processes, the module wrapped in ``DistributedDataParallel`` as Lightning's ``ddp`` strategy does
(no unused-parameter search), one of them without strict rows, without weak rows or without
parallel pairs. Every process must run the same collectives in the same order (else gloo times
out), and the losses and averaged gradients must equal one process on the global batch.

The random draws (language pair, partner pairing, MLM masking) are fixed so that the one-process
reference draws what the two processes draw."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rc3_helpers import build, parallel_batch, train_batch
from torch import nn

import ccr.methods.rc3.module as rc3_module
from ccr.methods.layers.masking import IGNORE_INDEX, maskable_positions

WORLD, STEPS = 2, 2
# rows of each process: strict triplets, weak triplets, parallel (XTCL) pairs
SCENARIOS = {
    "no_strict_no_parallel_on_rank1": [(4, 0, 4), (0, 4, 0)],
    "no_weak_on_rank0": [(4, 0, 4), (2, 2, 4)],
    "nothing_but_parallel_on_rank0": [(0, 0, 4), (4, 4, 4)],
}


def fixed_draws(monkeypatch):
    """Partners 0↔1, 2↔3, ... of the drawn rows; the pair drawn with a fixed seed; every third
    content token masked."""
    draw = rc3_module.draw_triplet_rows

    def fixed_pair(present, candidates, limit):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return draw(present, candidates, limit)

    def fixed_mask(ids, mask, mask_token_id, special_ids, probability):
        chosen = maskable_positions(ids, mask, special_ids) & (torch.arange(ids.shape[1]) % 3 == 1)
        return ids.masked_fill(chosen, mask_token_id), ids.masked_fill(~chosen, IGNORE_INDEX)

    monkeypatch.setattr(rc3_module, "draw_triplet_rows", fixed_pair)
    monkeypatch.setattr(rc3_module, "mask_content", fixed_mask)
    monkeypatch.setattr(
        rc3_module,
        "involution_pairs",
        lambda n, generator=None, device=None: torch.arange(n, device=device) ^ 1,
    )


def rank_batches(rows, rank):
    strict, weak, pairs = rows
    batch = train_batch(seed=rank, weak=[False] * strict + [True] * weak, n=strict + weak)
    return batch, parallel_batch(seed=rank, n=pairs)


def concatenated(parts):
    """The global batch: every process's rows in rank order."""
    first = parts[0]
    return {
        k: (
            torch.cat([p[k] for p in parts])
            if torch.is_tensor(v)
            else v
            if isinstance(v, str) or k == "languages"
            else sum((p[k] for p in parts), [])
        )
        for k, v in first.items()
    }


class Step(nn.Module):
    """What Lightning's DDP wrapper does: forward is the training step's loss."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, batch, parallel):
        losses = self.module.losses(batch, parallel)
        return self.module.total_loss(losses), losses


def train(step, module, batch, parallel):
    """``STEPS`` forward/backward passes on fixed weights (the trackers move α): last losses and
    gradients."""
    for _ in range(STEPS):
        step.zero_grad()
        total, losses = step(batch, parallel)
        total.backward()
    values = {k: v.detach() for k, v in losses.items() if k != "kl"}
    grads = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in module.named_parameters()
    }
    return values, grads, module.vt_tracker.p_avg(), module.xtcl_tracker.p_avg()


def worker(rank, scenario, init_file, out_dir):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    try:
        torch.set_num_threads(1)
        module = build()
        step = nn.parallel.DistributedDataParallel(Step(module))
        values, grads, *p_avg = train(step, module, *rank_batches(SCENARIOS[scenario][rank], rank))
        for value in values.values():  # the logged loss of a DDP run is the mean over processes
            dist.all_reduce(value)
            value /= WORLD
        torch.save((values, grads, p_avg), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_processes_without_rows_of_a_pool_match_one_process(scenario, tmp_path, monkeypatch):
    fixed_draws(monkeypatch)  # before the fork: both processes and the reference draw alike
    mp.start_processes(
        worker,
        args=(scenario, str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    parts = [rank_batches(rows, rank) for rank, rows in enumerate(SCENARIOS[scenario])]
    module = build()
    expected, expected_grads, *expected_p = train(
        Step(module),
        module,
        concatenated([b for b, _ in parts]),
        concatenated([p for _, p in parts]),
    )
    assert set(expected) == {"mclm", "itm", "probe", "rxvtcl", "xtcl"}
    for rank in range(WORLD):
        values, grads, p_avg = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(values) == set(expected)
        for name, value in expected.items():
            assert torch.allclose(values[name], value, atol=1e-5), (name, values[name], value)
        for name, grad in expected_grads.items():
            assert torch.allclose(grads[name], grad, atol=1e-5), name
        assert p_avg == pytest.approx(expected_p, abs=1e-6) and min(expected_p) > 0
