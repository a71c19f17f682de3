"""Host reads (each a GPU synchronisation) in ccrk's training step: the length buckets' groups and
lengths fetched in one copy, and hard sampling's own-caption weights taken by a view."""

import torch
from torch.overrides import TorchFunctionMode

from ccr.methods.layers.length_buckets import length_buckets

HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


class HostReads(TorchFunctionMode):
    """Counts the tensor reads that copy a value to the host (a GPU synchronisation each)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name == "__getitem__" else ()
        boolean_index = any(
            torch.is_tensor(i) and i.dtype == torch.bool
            for i in (index if isinstance(index, tuple) else (index,))
        )
        self.count += name in HOST_READS or boolean_index  # a boolean index reads its count back
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
    for (rows, size), expected in zip(groups, order.chunk(4), strict=True):
        assert torch.equal(rows, expected)
        assert size == max(int(lengths[expected].max()), 1) and isinstance(size, int)


def test_the_group_lengths_reach_the_host_in_one_read_whatever_the_bucket_count():
    mask = masks(rows=40)
    for buckets in (1, 4, 8):
        with HostReads() as reads:
            length_buckets(mask, buckets)
        assert reads.count == 1, buckets


def test_hard_sampling_reads_back_only_its_argument_check_and_picks_each_instances_own_captions():
    from ccr.methods.ccrk.hard_sampling import caption_owner_mask, own_block, sampling_weights

    matrix = torch.randn(5, 5 * 3)
    own = caption_owner_mask(5, 3, matrix.device)
    assert torch.equal(own_block(matrix, 3), matrix[own].view(5, 3))
    image_feat = torch.nn.functional.normalize(torch.randn(5, 8), dim=-1)
    text_feat = torch.nn.functional.normalize(torch.randn(15, 8), dim=-1)
    for mode in ("reference", "paper"):
        with HostReads() as reads:
            sampling_weights(image_feat, text_feat, 0.07, mode)
        assert reads.count == 1, mode  # "an instance has no present caption"
