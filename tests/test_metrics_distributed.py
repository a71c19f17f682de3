"""Two gloo processes with uneven query counts sync to exactly the single-process result."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from metrics import MeanNDCG, MeanRank, MeanRankVariance, MedianRank, RecallAtK

SPLIT = 7  # process 0 gets 7 queries, process 1 the other 13


def make_data():
    gen = torch.Generator().manual_seed(0)
    ranks = torch.randint(0, 30, (20,), generator=gen)
    ndcg = torch.rand(20, generator=gen, dtype=torch.float64)
    order = torch.randperm(20, generator=gen)  # rows in no particular instance order
    instance = torch.arange(10).repeat(2)[order]
    language = torch.arange(2).repeat_interleave(10)[order]
    keep = torch.arange(20) != 3  # one instance misses a language
    return ranks[keep], ndcg[keep], instance[keep], language[keep]


def build_metrics():
    return {"R@5": RecallAtK(5), "MeanR": MeanRank(), "MedR": MedianRank(), "NDCG": MeanNDCG(),
            "MRV": MeanRankVariance(num_languages=2)}


def compute_all(metrics, ranks, ndcg, instance, language):
    for name, metric in metrics.items():
        if name == "MRV":
            metric.update(instance, language, ranks)
        else:
            metric.update(ndcg if name == "NDCG" else ranks)
    results = {}
    for name, metric in metrics.items():
        value = metric.compute()
        results |= {f"MRV/{k}": v.item() for k, v in value.items()} if name == "MRV" else {name: value.item()}
    return results


def worker(rank, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = make_data()
    part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    results = compute_all(build_metrics(), *(tensor[part] for tensor in data))
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_sync_equals_single_process():
    expected = compute_all(build_metrics(), *make_data())
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=worker, args=(rank, free_port_value, queue))
                 for free_port_value in [free_port()] for rank in range(2)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert expected["MRV/dropped"] == 1
    assert results[0] == expected
    assert results[1] == expected
