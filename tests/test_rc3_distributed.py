"""Two gloo processes holding unequal shares of a batch give RC3's contrastive terms, their
gradient (averaged as DDP does) and the tracker's α of one process with the global batch: XTCL's
negatives are every process's texts, R-XVtCL's means are over the global batch of anchors."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ccr.methods.layers.distributed import row_layout
from ccr.methods.rc3.euclidean_contrastive import (
    PosProbTracker,
    global_mean_scalar,
    rxvtcl_vectors,
    textual_distances,
    xtcl_loss,
)

WORLD, N, D = 2, 10, 6
SHARES = [slice(0, 6), slice(6, 10)]  # unequal: 6 and 4 rows, whole partner pairs on each


def inputs():
    g = torch.Generator().manual_seed(3)
    return {
        k: torch.randn(N, D, generator=g)
        for k in ("src", "tgt", "va", "vp", "c1", "c2", "ti", "tj")
    }


def local_perm(n):
    return torch.arange(n) ^ 1  # pairs 0<->1, 2<->3, ... inside each share


def terms(weight, x, tracker):
    """XTCL + R-XVtCL (weak, with the KL) on the rows of ``x``; updates ``tracker``."""
    alpha = 0.9 * tracker.p_avg()
    mapped = {k: v @ weight for k, v in x.items()}
    xtcl = xtcl_loss(mapped["src"], mapped["tgt"], alpha)
    perm = local_perm(len(x["va"]))
    d_tr = textual_distances(x["ti"], x["tj"], perm)
    loss_vec, raw, kl = rxvtcl_vectors(
        mapped["va"], mapped["vp"], mapped["c1"], mapped["c2"], perm, alpha, d_tr=d_tr
    )
    rxvtcl = row_layout(len(loss_vec), loss_vec.device).global_mean(loss_vec)
    tracker.update(global_mean_scalar(raw))
    return {"xtcl": xtcl.loss, "rxvtcl": rxvtcl, "total": xtcl.loss + rxvtcl}


def run(rows, steps=3):
    """Three steps (α moves with the tracker): values and gradients of the last one."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(D, D) * 0.5)
    tracker = PosProbTracker(window=100)
    x = {k: v[rows] for k, v in inputs().items()}
    for _ in range(steps):
        weight.grad = None
        values = terms(weight, x, tracker)
        values["total"].backward()
    return {k: v.detach() for k, v in values.items()}, weight.grad.clone(), tracker.p_avg()


def worker(rank, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        values, grad, p_avg = run(SHARES[rank])
        for tensor in [*values.values(), grad]:  # DDP averages gradients (and logged losses)
            dist.all_reduce(tensor)
            tensor /= WORLD
        torch.save((values, grad, p_avg), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_unequal_processes_match_one_process_with_the_global_batch(tmp_path):
    mp.start_processes(
        worker,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
        start_method="fork",
    )
    # one process: the same pairs (perm is block-wise the same), every row at once
    expected_values, expected_grad, expected_p = run(slice(0, N))
    for rank in range(WORLD):
        values, grad, p_avg = torch.load(tmp_path / f"rank{rank}.pt")
        for term, value in expected_values.items():
            assert torch.allclose(values[term], value, atol=1e-5), term
        assert torch.allclose(grad, expected_grad, atol=1e-5)
        assert abs(p_avg - expected_p) < 1e-6 and expected_p > 0
    # the halves alone would score differently: the gathered negatives matter
    alone, _, _ = run(SHARES[1])
    assert not torch.allclose(alone["xtcl"], expected_values["xtcl"], atol=1e-3)
