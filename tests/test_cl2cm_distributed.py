"""Two gloo processes, each with half of a batch of triples, give every CL2CM loss term and the
gradient (averaged as DDP does) of one process with the global batch: InfoNCE over gathered
features, the word loss normalised by the global count of labelled words, and the transfer KL
against the gathered (differently padded) target captions."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_cl2cm_module import B, build, triple_batch

WORLD = 2
TERMS = ("cm_inst", "cl_inst", "word", "ckt")


def local_half(batch, rank):
    rows = slice(rank * B // WORLD, (rank + 1) * B // WORLD)
    return {k: v[rows] for k, v in batch.items()}


def losses_and_grads(module, batch):
    losses = module.losses(batch)
    total = module.total_loss(losses)
    module.zero_grad()
    total.backward()
    values = {k: v.detach() for k, v in {**losses, "total": total}.items()}
    return values, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        module = build()
        batch = {k: v for k, v in triple_batch(seed=1).items() if torch.is_tensor(v)}
        values, grads = losses_and_grads(module, local_half(batch, rank))
        for tensor in [*values.values(), *grads.values()]:  # DDP averages gradients
            dist.all_reduce(tensor)
            tensor /= WORLD
        torch.save((values, grads), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_match_one_process_with_the_global_batch(tmp_path):
    # fork: the workers inherit the imported suite instead of importing it again (seconds each)
    mp.start_processes(
        worker,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    module = build()
    batch = {k: v for k, v in triple_batch(seed=1).items() if torch.is_tensor(v)}
    # the halves trim to different lengths, so the gathered target tokens must be re-padded
    lengths = [int(local_half(batch, r)["tgt_attention_mask"].sum(1).max()) for r in range(WORLD)]
    assert lengths[0] != lengths[1]
    expected_values, expected_grads = losses_and_grads(module, batch)
    for rank in range(WORLD):
        values, grads = torch.load(tmp_path / f"rank{rank}.pt")
        for term in (*TERMS, "total"):
            assert torch.allclose(values[term], expected_values[term], atol=1e-5), term
        assert grads.keys() == expected_grads.keys()
        for name, grad in grads.items():
            assert torch.allclose(grad, expected_grads[name], atol=1e-5), name
