"""CL2CM's loss functions against the hand-computed values of spec cl2cm.md §9 (items 2-9, 12):
InfoNCE, the Sinkhorn plan and its marginals, OT pseudo-labels and thresholding, the word loss,
word max-sim, the knowledge-transfer KL (direction and temperature), and the OT variants."""

import math

import ot
import pytest
import torch
import torch.nn.functional as F

from ccr.methods.cl2cm.cross_lingual import (
    maxsim_word_similarity,
    relational_kd_loss,
    teacher_similarity,
    word_align_loss,
    word_mask,
)
from ccr.methods.cl2cm.optimal_transport import (
    attention_pseudo_labels,
    ot_pseudo_labels,
    sinkhorn_plan,
)
from ccr.methods.layers.contrastive import info_nce

TOY_C = torch.tensor([[[0.9, 0.1, 0.0], [0.2, 0.8, 0.7]]])
ALL2, ALL3 = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 3, dtype=torch.bool)


def sym_infonce(S, tau):
    """The spec's symmetric InfoNCE on a similarity matrix, through the suite's info_nce."""
    return info_nce(S, torch.eye(len(S)), tau)


def random_cosines(batch=4, ls=7, lt=6, h=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hs = F.normalize(torch.randn(batch, ls, h, generator=gen), dim=-1)
    ht = F.normalize(torch.randn(batch, lt, h, generator=gen), dim=-1)
    ws = torch.arange(ls)[None] < torch.tensor([7, 3, 5, 1])[:, None]
    wt = torch.arange(lt)[None] < torch.tensor([6, 4, 2, 3])[:, None]
    return torch.einsum("bmh,bnh->bmn", hs, ht), ws, wt


def test_symmetric_infonce_values():
    S = torch.tensor([[0.8, 0.2], [0.4, 0.6]])
    assert sym_infonce(S, 1.0).item() == pytest.approx(0.515414, abs=1e-6)
    assert sym_infonce(S, 0.07).item() == pytest.approx(0.015655, abs=1e-6)
    assert sym_infonce(S.t(), 1.0).item() == pytest.approx(0.515414, abs=1e-6)
    assert sym_infonce(torch.eye(2), 1.0).item() == pytest.approx(
        math.log(1 + math.e**-1), abs=1e-6
    )


def test_sinkhorn_marginals_padding_and_shift_invariance():
    C, ws, wt = random_cosines()
    A = sinkhorn_plan(C, ws, wt, epsilon=0.1, iterations=100)
    M, N = ws.sum(1, keepdim=True).float(), wt.sum(1, keepdim=True).float()
    assert torch.allclose(A.sum(1), wt / N, atol=1e-7)  # columns: exact after the last update
    assert torch.allclose(A.sum(2), ws / M, atol=1e-3 / M.max().item())
    valid = ws[:, :, None] & wt[:, None, :]
    assert (A[~valid] == 0).all()
    assert torch.allclose(A.sum((1, 2)), torch.ones(4), atol=1e-6)
    assert torch.allclose(sinkhorn_plan(C + 0.37, ws, wt), A, atol=1e-7)


@pytest.mark.filterwarnings("ignore:Sinkhorn did not converge")
def test_sinkhorn_matches_pot_on_each_pair():
    C, ws, wt = random_cosines(seed=1)
    A = sinkhorn_plan(C, ws, wt, epsilon=0.1, iterations=100)
    for b in range(len(C)):
        m, n = int(ws[b].sum()), int(wt[b].sum())
        reference = ot.sinkhorn(
            torch.full((m,), 1 / m),
            torch.full((n,), 1 / n),
            1 - C[b, :m, :n],
            0.1,
            method="sinkhorn_log",
            numItermax=100,
            stopThr=0.0,
        )
        assert torch.allclose(A[b, :m, :n], reference.float(), atol=1e-6)


def test_toy_ot_labels_threshold_and_word_loss():
    A = sinkhorn_plan(TOY_C, ALL2, ALL3, epsilon=0.1, iterations=100)
    expected = torch.tensor([[[1 / 3, 1 / 12, 1 / 12], [8.3e-7, 1 / 4, 1 / 4]]])
    assert torch.allclose(A, expected, atol=1e-6)
    labels, rows = ot_pseudo_labels(A, ALL2, ALL3, "mass")
    assert torch.allclose(labels, torch.tensor([[[1.0, 0, 0], [0, 0.5, 0.5]]]))
    assert rows.all()
    count_labels, _ = ot_pseudo_labels(A, ALL2, ALL3, "count")
    assert torch.allclose(count_labels, torch.tensor([[[1 / 3, 0, 0], [0, 1 / 8, 1 / 8]]]))
    assert word_align_loss(TOY_C, labels, rows, ALL3, 1.0).item() == pytest.approx(
        0.782973, abs=1e-6
    )
    assert word_align_loss(TOY_C, labels, rows, ALL3, 0.07).item() == pytest.approx(
        0.464641, abs=1e-6
    )


def test_permutation_labels_constant_cost_and_no_kept_row():
    P = torch.eye(3)[[1, 2, 0]][None]
    labels, rows = ot_pseudo_labels(sinkhorn_plan(P, ALL3, ALL3), ALL3, ALL3)
    assert torch.allclose(labels, P, atol=1e-6)
    assert word_align_loss(P, labels, rows, ALL3, 1.0).item() == pytest.approx(
        math.log(1 + 2 * math.e**-1), abs=1e-6
    )
    assert word_align_loss(P, labels, rows, ALL3, 0.07).item() == pytest.approx(1.25e-6, abs=2e-7)
    uniform = sinkhorn_plan(torch.full((1, 2, 3), 0.4), ALL2, ALL3)
    assert torch.allclose(uniform, torch.full_like(uniform, 1 / 6), atol=1e-6)
    nothing = torch.zeros(1, 2, dtype=torch.bool)
    assert word_align_loss(TOY_C, torch.zeros(1, 2, 3), nothing, ALL3, 0.07).item() == 0.0


def test_labels_are_constants_and_the_word_loss_reaches_the_similarity():
    C = TOY_C.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        A = sinkhorn_plan(C.bfloat16(), ALL2, ALL3)
    assert A.dtype == torch.float32 and not A.requires_grad
    labels, rows = ot_pseudo_labels(A, ALL2, ALL3)
    assert not labels.requires_grad
    word_align_loss(C, labels, rows, ALL3, 0.07).backward()
    assert C.grad.abs().sum() > 0


def test_word_mask_drops_cls_eos_and_padding():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    assert word_mask(mask).tolist() == [[False, True, True, False, False, False], [False] * 6]


def test_maxsim_word_similarity_values_and_masks():
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    pad = torch.tensor([5.0, 5.0])  # would win every max if padding were not masked
    source = torch.stack([e1, e2, pad])[None]
    targets = torch.stack(
        [torch.stack([e1, (e1 + e2) / math.sqrt(2), -e1]), torch.stack([e2, -e2, pad])]
    )
    ws = torch.tensor([[True, True, False]])
    wt = torch.tensor([[True, True, True], [True, True, False]])
    S = maxsim_word_similarity(source, targets, ws, wt)
    assert S.shape == (1, 2)
    assert S[0, 0].item() == pytest.approx(0.853553, abs=1e-6)
    assert S[0, 1].item() == pytest.approx(0.5, abs=1e-6)
    one, two = torch.stack([e1, pad]), torch.stack([e1, e2])  # {e1} vs {e1, e2}
    both, masks = torch.stack([one, two]), torch.tensor([[True, False], [True, True]])
    S2 = maxsim_word_similarity(both, both, masks, masks)
    assert S2[0, 1].item() == pytest.approx(1.0) and S2[1, 0].item() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "tau, student_teacher, teacher_student",
    [(1.0, 0.026345, 0.027955), (0.5, 0.067131, 0.082608), (0.07, 0.000785, 0.004852)],
)
def test_kd_direction_and_temperature(tau, student_teacher, teacher_student):
    S_cm, S_cl = torch.eye(2), torch.tensor([[1.0, 0.5], [0.5, 1.0]])
    assert relational_kd_loss(S_cm, S_cl, tau).item() == pytest.approx(student_teacher, abs=1e-6)
    assert relational_kd_loss(S_cm, S_cl, tau, "teacher_student").item() == pytest.approx(
        teacher_student, abs=1e-6
    )
    assert relational_kd_loss(S_cl, S_cl, tau).item() <= 1e-7


def test_combined_example_and_the_teacher_mix():
    S_ins = torch.tensor([[0.9, 0.3], [0.2, 0.7]])
    S_word = torch.tensor([[0.8, 0.5], [0.4, 0.9]])
    S_cl = teacher_similarity(S_ins, S_word, "sent+word", 0.6)
    assert torch.allclose(S_cl, torch.tensor([[0.86, 0.38], [0.28, 0.78]]))
    assert teacher_similarity(S_ins, None, "sent+word", 1.0) is S_ins
    assert teacher_similarity(S_ins, S_word, "word", 0.6) is S_word
    S_cm = torch.tensor([[0.5, 0.1], [0.3, 0.6]])
    cm_inst = sym_infonce(S_cm, 0.07)
    ckt = relational_kd_loss(S_cm, S_cl, 0.07)
    assert cm_inst.item() == pytest.approx(0.018399, abs=1e-6)
    assert ckt.item() == pytest.approx(0.013714, abs=1e-6)
    assert relational_kd_loss(S_cm, S_cl, 0.07, "teacher_student").item() == pytest.approx(
        0.005832, abs=1e-6
    )
    assert (0.4 * cm_inst + 0.6 * ckt).item() == pytest.approx(0.015588, abs=1e-6)


def test_unbalanced_and_partial_plans():
    C, ws, wt = random_cosines(seed=2)
    valid = ws[:, :, None] & wt[:, None, :]
    M, N = ws.sum(1).float(), wt.sum(1).float()
    partial = sinkhorn_plan(C, ws, wt, variant="partial", partial_mass=0.7, iterations=200)
    assert torch.allclose(partial.sum((1, 2)), torch.full((4,), 0.7), atol=1e-5)
    assert (partial.sum(2) <= 1 / M[:, None] + 1e-5).all() and (
        partial.sum(1) <= 1 / N[:, None] + 1e-5
    ).all()
    assert (partial[~valid] == 0).all()
    balanced = sinkhorn_plan(C, ws, wt)
    loose = sinkhorn_plan(C, ws, wt, variant="unbalanced", marginal_penalty=0.05)
    assert (loose[~valid] == 0).all()
    assert not torch.allclose(loose, balanced, atol=1e-3)
    tight = sinkhorn_plan(C, ws, wt, variant="unbalanced", marginal_penalty=1e4, iterations=300)
    assert torch.allclose(tight, balanced, atol=1e-4)  # a huge marginal penalty is balanced OT
    with pytest.raises(ValueError, match="OT variant"):
        sinkhorn_plan(C, ws, wt, variant="semi")


def test_attention_labels_are_a_softmax_over_target_words():
    states_s, states_t = torch.randn(2, 4, 8), torch.randn(2, 5, 8)
    ws = torch.tensor([[False, True, True, False], [False, True, False, False]])
    wt = torch.tensor([[False, True, True, True, False], [False, True, True, False, False]])
    labels, rows = attention_pseudo_labels(states_s, states_t, ws, wt)
    assert torch.equal(rows, ws)
    expected = (states_s[0, 1] @ states_t[0, 1:4].t() / math.sqrt(8)).softmax(0)
    assert torch.allclose(labels[0, 1, 1:4], expected, atol=1e-6)
    assert (labels[~ws] == 0).all() and (labels[:, :, 0] == 0).all()
