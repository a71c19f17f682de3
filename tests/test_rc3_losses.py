"""RC3 spec §9 faithfulness tests 1-8, 10, 11 on the Euclidean contrastive losses (hand-computed
values from the spec)."""

import math

import pytest
import torch

from ccr.methods.rc3.euclidean_contrastive import (
    PosProbTracker,
    euclidean,
    interpolated_contrastive,
    interpolation_weights,
    involution_pairs,
    pairwise_euclidean,
    relevance_kl,
    rxvtcl_negatives,
    rxvtcl_vectors,
    xtcl_loss,
)

D_POS = torch.tensor([1.0])
D_NEG = torch.tensor([[4.0, 0.5]])


def test_fresh_alpha_gives_lambda_one_and_the_eq4_loss():  # §9.1
    loss, raw = interpolated_contrastive(D_POS, D_NEG, alpha=0.0)
    assert torch.equal(interpolation_weights(D_POS, D_NEG, 0.0), torch.ones(1, 2))
    assert loss.item() == pytest.approx(0.992699, abs=1e-6)
    assert raw.item() == pytest.approx(0.992699, abs=1e-6)


def test_hand_example_of_interpolated_negatives():  # §9.2
    lam = interpolation_weights(D_POS, D_NEG, 0.9 * 0.5)
    assert lam.tolist()[0] == pytest.approx([0.535887, 1.0], abs=1e-6)
    assert (lam * D_NEG).tolist()[0] == pytest.approx([2.143547, 0.5], abs=1e-6)
    closed = D_POS.item() ** 0.45 * 4.0**0.55
    assert (lam * D_NEG)[0, 0].item() == pytest.approx(closed, rel=1e-6)
    expected = [0.992699, 1.027523, 1.087689, 1.167739, 1.255773]
    got = [
        interpolated_contrastive(D_POS, D_NEG, 0.9 * p)[0].item() for p in (0, 0.25, 0.5, 0.75, 1)
    ]
    assert got == pytest.approx(expected, abs=1e-6)
    # the raw (Eq. 4) loss ignores α: it is what feeds the tracker
    assert interpolated_contrastive(D_POS, D_NEG, 0.45)[1].item() == pytest.approx(
        0.992699, abs=1e-6
    )


def test_interpolation_bounds_on_random_inputs():  # §9.3
    g = torch.Generator().manual_seed(0)
    anchor, positive, negatives = (
        torch.randn(32, 8, generator=g),
        torch.randn(32, 8, generator=g),
        torch.randn(32, 5, 8, generator=g),
    )
    d_pos, d_neg = euclidean(anchor, positive), euclidean(anchor, negatives)
    for alpha in (0.0, 0.3, 0.9):
        lam = interpolation_weights(d_pos, d_neg, alpha)
        d_tilde = lam * d_neg
        closer = d_neg <= d_pos[:, None]
        assert ((lam > 0) & (lam <= 1)).all()
        assert torch.equal(lam[closer], torch.ones_like(lam[closer]))
        farther = ~closer
        assert (d_tilde[farther] >= d_pos[:, None].expand_as(d_neg)[farther] - 1e-5).all()
        assert (d_tilde <= d_neg + 1e-6).all()
        materialised = anchor[:, None] + lam[..., None] * (negatives - anchor[:, None])
        assert torch.allclose(euclidean(anchor, materialised), d_tilde, atol=1e-5)
    assert closer.any() and farther.any()  # both branches were exercised


def test_tracker_window_eviction_and_checkpoint():  # §9.4
    tracker = PosProbTracker(window=100)
    assert tracker.p_avg() == 0.0
    losses = torch.linspace(0.1, 3.0, 101)
    for k, loss in enumerate(losses[:100], start=1):
        tracker.update(loss)
        assert tracker.p_avg() == pytest.approx(torch.exp(-losses[:k]).mean().item(), rel=1e-6)
    tracker.update(losses[100])
    assert tracker.p_avg() == pytest.approx(torch.exp(-losses[1:101]).mean().item(), rel=1e-6)
    restored = PosProbTracker(window=100)
    restored.load_state_dict(tracker.state_dict())
    assert restored.p_avg() == tracker.p_avg() and int(restored.count) == 101


P_TR = [0.665241, 0.244728, 0.090031]
D_TR = torch.tensor([[1.0, 2.0, 3.0]])


def test_kl_hand_examples():  # §9.5
    assert (-D_TR).softmax(1).tolist()[0] == pytest.approx(P_TR, abs=1e-6)
    assert relevance_kl(torch.tensor([[2.0, 2, 2]]), D_TR).item() == pytest.approx(
        0.308994, abs=1e-6
    )
    d_vt = torch.tensor([[3.0, 2, 2]])
    assert (-d_vt).softmax(1).tolist()[0] == pytest.approx([0.155362, 0.422319, 0.422319], abs=1e-6)
    assert relevance_kl(d_vt, D_TR).item() == pytest.approx(0.657205, abs=1e-6)


def test_kl_vanishes_for_shifted_distances_and_is_nonnegative():  # §9.6
    g = torch.Generator().manual_seed(1)
    d_tr = torch.rand(16, 3, generator=g) * 4
    for c in (0.0, 1.7, -0.3):
        assert torch.allclose(relevance_kl(d_tr + c, d_tr), torch.zeros(16), atol=1e-6)
    assert (
        relevance_kl(torch.rand(64, 3, generator=g) * 5, torch.rand(64, 3, generator=g) * 5)
        >= -1e-7
    ).all()
    assert relevance_kl(torch.full((1, 3), 2.0), torch.full((1, 3), 0.5)).item() == pytest.approx(
        0, abs=1e-7
    )


def test_weak_loss_equals_strict_loss_when_relevance_matches_or_kl_is_off():  # §9.6
    g = torch.Generator().manual_seed(2)
    anchor, positive, c1, c2 = (torch.randn(4, 8, generator=g) for _ in range(4))
    perm = torch.tensor([1, 0, 3, 2])
    strict, _, _ = rxvtcl_vectors(anchor, positive, c1, c2, perm, 0.4)
    d_vt = torch.stack(
        [euclidean(anchor, positive), euclidean(anchor, c1), euclidean(anchor, c2)], 1
    )
    matched, _, kl = rxvtcl_vectors(anchor, positive, c1, c2, perm, 0.4, d_tr=d_vt + 0.7)
    assert torch.allclose(matched, strict, atol=1e-6) and torch.allclose(
        kl, torch.zeros(4), atol=1e-6
    )
    mismatched, _, kl = rxvtcl_vectors(anchor, positive, c1, c2, perm, 0.4, d_tr=d_vt.flip(1))
    assert (kl > 1e-4).all() and torch.allclose(mismatched, strict + kl)


def test_kl_gradient_direction():  # §9.7
    d_vt = torch.tensor([[2.0, 2.0, 2.0]], requires_grad=True)
    relevance_kl(d_vt, D_TR).sum().backward()
    assert d_vt.grad.tolist()[0] == pytest.approx([1 / 3, 0.0, -1 / 3], abs=1e-4)


def test_kl_minimiser_grows_with_textual_distance():  # §9.8
    grid = torch.linspace(0.0, 5.0, 50001)
    minimisers = []
    for d0 in (0.5, 1.0, 2.0, 4.0):
        d_vt = torch.stack([grid, torch.full_like(grid, 2.0), torch.full_like(grid, 2.5)], 1)
        d_tr = torch.tensor([[d0, 2.0, 3.0]]).expand(len(grid), 3)
        minimisers.append(grid[relevance_kl(d_vt, d_tr).argmin()].item())
    assert minimisers == pytest.approx([0.311, 0.811, 1.811, 3.811], abs=2e-3)


def test_negative_bookkeeping_with_coded_pairs():  # §9.9
    def code(image, text_image, side):  # (image id, text id) -> a unique vector
        return torch.tensor([float(image), float(text_image), float(side)])

    n = 4
    anchor = torch.stack([code(b, b, 0) for b in range(n)])
    positive = torch.stack([code(b, b, 1) for b in range(n)])
    perm = torch.tensor([1, 0, 3, 2])
    c1 = torch.stack([code(b, int(perm[b]), 0) for b in range(n)])
    c2 = torch.stack([code(b, int(perm[b]), 1) for b in range(n)])
    negatives = rxvtcl_negatives(anchor, positive, c1, c2, perm)
    expected = [
        code(0, 1, 0),
        code(0, 1, 1),
        code(1, 0, 0),
        code(1, 0, 1),
        code(1, 1, 0),
        code(1, 1, 1),
    ]
    assert torch.equal(negatives[0], torch.stack(expected))
    assert torch.equal(positive[0], code(0, 0, 1))


def test_involution_pairs():
    for n in (2, 8, 64):
        perm = involution_pairs(n, torch.Generator().manual_seed(n))
        rows = torch.arange(n)
        assert torch.equal(perm[perm], rows) and (perm != rows).all()
    with pytest.raises(ValueError, match="even"):
        involution_pairs(5)


def test_xtcl_mask_keeps_exactly_the_other_texts(monkeypatch):  # §9.10
    import ccr.methods.rc3.euclidean_contrastive as ec

    seen = {}
    original = ec.interpolated_contrastive

    def spy(d_pos, d_neg, alpha, neg_mask=None):
        seen["mask"], seen["d_pos"], seen["d_all"] = neg_mask, d_pos, d_neg
        return original(d_pos, d_neg, alpha, neg_mask)

    monkeypatch.setattr(ec, "interpolated_contrastive", spy)
    src, tgt = torch.randn(5, 8), torch.randn(5, 8)
    xtcl_loss(src, tgt, 0.3)
    mask, n = seen["mask"], 5
    assert (mask.sum(1) == 2 * n - 2).all()
    rows = torch.arange(n)
    assert not mask[rows, rows].any() and not mask[rows, n + rows].any()
    assert torch.allclose(seen["d_pos"], euclidean(src, tgt), atol=1e-5)


def test_pairwise_distance_matches_direct_and_is_finite_at_zero():  # §9.15 eps
    a, b = torch.randn(3, 4), torch.randn(5, 4)
    assert torch.allclose(pairwise_euclidean(a, b), torch.cdist(a, b), atol=1e-5)
    x = torch.randn(2, 4, requires_grad=True)
    euclidean(x, x.detach().clone()).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_pairwise_distance_is_exact_for_close_points_of_large_norm():
    """LayerNorm'd TRs: norms near √d, a few hundredths apart. The |a|²+|b|²-2a·b expansion
    was wrong by ~4e-3 here (and the self-distance 3e-3 instead of 0)."""
    g = torch.Generator().manual_seed(0)
    centre = torch.randn(32, generator=g)
    centre = centre / centre.norm() * 32**0.5
    a = centre + 0.01 * torch.randn(8, 32, generator=g)
    b = torch.cat([a, centre + 0.01 * torch.randn(8, 32, generator=g)])
    exact = (a[:, None].double() - b[None].double()).pow(2).sum(-1).sqrt()
    got = pairwise_euclidean(a, b)
    assert (got.double() - exact).abs().max() < 1e-5
    a = a.clone().requires_grad_()
    pairwise_euclidean(a, a.detach().clone()).sum().backward()  # zero distances: finite gradient
    assert torch.isfinite(a.grad).all()


def test_lambda_carries_no_gradient():  # §9.11 (λ part)
    d_pos = torch.tensor([1.0], requires_grad=True)
    d_neg = torch.tensor([[4.0, 0.5]], requires_grad=True)
    loss, _ = interpolated_contrastive(d_pos, d_neg, 0.45)
    loss.sum().backward()
    lam = interpolation_weights(d_pos, d_neg, 0.45)
    assert not lam.requires_grad
    # with λ a constant, ∂L/∂d⁻ = -λ·p⁻ and ∂L/∂d⁺ = 1 - p⁺ exactly
    logits = torch.cat([-d_pos.detach()[:, None], -(lam * d_neg.detach())], 1)
    p = logits.softmax(1)
    assert torch.allclose(d_neg.grad, -lam * p[:, 1:], atol=1e-6)
    assert torch.allclose(d_pos.grad, 1 - p[:, 0], atol=1e-6)
    assert math.isfinite(loss.item())
