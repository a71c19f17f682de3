"""Two gloo processes with uneven shares, padded like a DistributedSampler, give exactly the report
of one process holding everything (metrics.RetrievalEvaluation syncs its states with cat)."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ccr.metrics import GroundTruth, RetrievalEvaluation

NUM_IMAGES = 9
LANGUAGES = ["en"] * NUM_IMAGES + ["de"] * (NUM_IMAGES - 1)  # image 8 has no "de" caption


def make_data():
    gen = torch.Generator().manual_seed(0)
    image = torch.randn(NUM_IMAGES, 6, generator=gen)
    caption_image = torch.cat([torch.arange(NUM_IMAGES), torch.arange(NUM_IMAGES - 1)])
    text = image[caption_image] + torch.randn(len(caption_image), 6, generator=gen)
    relevance = torch.rand(NUM_IMAGES, NUM_IMAGES, generator=gen)
    return image, text, caption_image, relevance


def shares(count: int, rank: int) -> list[list[int]]:
    """Batches of one process: rank 0 gets the first 3 items, rank 1 the rest plus a repeat of
    item 0 (a sampler's padding), in batches of 4."""
    items = list(range(3)) if rank == 0 else list(range(3, count)) + [0]
    return [items[i : i + 4] for i in range(0, len(items), 4)]


def evaluate(ranks: list[int]) -> dict[str, float]:
    image, text, caption_image, relevance = make_data()
    truth = GroundTruth(
        caption_image=caption_image,
        caption_language=LANGUAGES,
        image_ids=[str(i) for i in range(NUM_IMAGES)],
        image_relevance=relevance,
        mrv_languages=["en", "de"],
    )
    metric = RetrievalEvaluation(
        truth, ks=(1, 5), ndcg_k=5, unimodal_ndcg_ks=(5, 20), chunk_size=4, rerank_k=0
    )
    for rank in ranks:
        for batch in shares(NUM_IMAGES, rank):
            metric.update("images", torch.tensor(batch), image[batch])
        for batch in shares(len(caption_image), rank):
            metric.update("captions", torch.tensor(batch), text[batch])
    return metric.compute()


def worker(rank, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    queue.put((rank, evaluate([rank])))
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_process_sync_equals_single_process():
    expected = evaluate([0, 1])
    assert expected["all/MRV_dropped"] == 1 and {"i2i/NDCG@5", "t2t/NDCG@20"} <= set(expected)
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    processes = [context.Process(target=worker, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert results[0] == expected
    assert results[1] == expected


def test_one_process_missing_an_item_is_an_error():
    with pytest.raises(RuntimeError, match="evaluation: 6 of 9 images were never encoded"):
        evaluate([0])
