"""Length buckets (methods/layers/length_buckets.py): the groups and lengths of sorting by caption
length, fetched to the host in one copy (each copy is a synchronisation on a GPU)."""

import torch
from torch.overrides import TorchFunctionMode

from methods.layers.length_buckets import length_buckets

HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


class HostReads(TorchFunctionMode):
    """Counts the tensor reads that copy a value to the host (a GPU synchronisation each)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += getattr(func, "__name__", "") in HOST_READS
        return func(*args, **(kwargs or {}))


def masks(rows=13, length=9, seed=0):
    lengths = torch.randint(0, length + 1, (rows,), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(length)[None, :] < lengths[:, None]).long()


def test_each_group_is_a_chunk_of_the_length_order_with_its_longest_length_at_least_one():
    mask = masks()
    mask[3] = 0  # an empty caption still gets a length of one
    lengths = mask.sum(1)
    order, groups = length_buckets(mask, 4)
    assert torch.equal(order, lengths.argsort())
    assert len(groups) == 4
    for (rows, size), expected in zip(groups, order.chunk(4)):
        assert torch.equal(rows, expected)
        assert size == max(int(lengths[expected].max()), 1) and isinstance(size, int)


def test_the_group_lengths_reach_the_host_in_one_read_whatever_the_bucket_count():
    mask = masks(rows=40)
    for buckets in (1, 4, 8):
        with HostReads() as reads:
            length_buckets(mask, buckets)
        assert reads.count == 1, buckets
