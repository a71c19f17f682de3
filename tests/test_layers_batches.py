"""ccr.methods.layers.batches.trim_padding: the one copy every method uses, for evaluation batches
[N, L] and training batches [B, K, L] alike."""

import torch

from ccr.methods.layers.batches import trim_padding


def test_trims_the_columns_every_caption_pads_in_two_and_three_dimensions():
    mask = torch.tensor([[[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], [[1, 0, 0, 0, 0], [0, 0, 0, 0, 0]]])
    ids = torch.arange(mask.numel()).reshape(mask.shape) * mask
    trimmed_ids, trimmed_mask = trim_padding(ids, mask)
    assert torch.equal(trimmed_mask, mask[..., :3]) and torch.equal(trimmed_ids, ids[..., :3])
    flat_ids, flat_mask = trim_padding(ids[0], mask[0])
    assert torch.equal(flat_mask, mask[0, :, :3]) and torch.equal(flat_ids, ids[0, :, :3])


def test_no_captions_or_only_padding_keep_one_column():
    for mask in (torch.zeros(0, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long)):
        ids, trimmed = trim_padding(mask.clone(), mask)
        assert trimmed.shape == (len(mask), 1) and ids.shape == (len(mask), 1)
