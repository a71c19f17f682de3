"""Golden tests: every Recall@K and rank of the suite equals the argsort-per-row reference evaluator
(tests/reference_itm_eval.py) and the reference values of docs/reference/metric-baselines.md."""

import numpy as np
import pytest
import torch
from reference_itm_eval import itm_eval, itm_ranks

from ccr.metrics import best_positive_rank, paired_ranks, rank_and_ndcg, retrieval_report
from ccr.metrics.functional import mean_rank_variance, recall_at_k


def suite_ranks(scores_i2t: torch.Tensor, caption_image: torch.Tensor, chunk_size=7):
    """TR and IR ranks of the suite's engine from one score matrix (images x captions)."""
    num_images = scores_i2t.shape[0]
    tr = best_positive_rank(
        None,
        None,
        torch.arange(num_images),
        caption_image,
        scores=scores_i2t,
        chunk_size=chunk_size,
    )
    ir = best_positive_rank(
        None,
        None,
        caption_image,
        torch.arange(num_images),
        scores=scores_i2t.T.contiguous(),
        chunk_size=chunk_size,
        direction="t2i",
    )
    return tr, ir


def reference(scores_i2t: torch.Tensor, caption_image: torch.Tensor):
    img2txt = {
        i: (caption_image == i).nonzero().flatten().tolist() for i in range(scores_i2t.shape[0])
    }
    txt2img = {t: int(i) for t, i in enumerate(caption_image)}
    s = scores_i2t.numpy()
    return itm_ranks(s, s.T.copy(), img2txt, txt2img), itm_eval(s, s.T.copy(), img2txt, txt2img)


def assert_matches_reference(scores_i2t, caption_image):
    (ref_tr, ref_ir), ref = reference(scores_i2t, caption_image)
    tr, ir = suite_ranks(scores_i2t, caption_image)
    np.testing.assert_array_equal(tr.numpy(), ref_tr)
    np.testing.assert_array_equal(ir.numpy(), ref_ir)
    for k in (1, 5, 10):
        assert recall_at_k(tr, k) == pytest.approx(ref[f"txt_r{k}"], abs=1e-12)
        assert recall_at_k(ir, k) == pytest.approx(ref[f"img_r{k}"], abs=1e-12)


@pytest.mark.parametrize("captions_per_image", [1, 5])
def test_random_matrices_match_reference(captions_per_image):
    gen = torch.Generator().manual_seed(captions_per_image)
    num_images = 40
    caption_image = torch.arange(num_images).repeat_interleave(captions_per_image)
    caption_image = caption_image[torch.randperm(len(caption_image), generator=gen)]
    scores = torch.randn(num_images, len(caption_image), generator=gen)
    scores += 2.0 * (caption_image[None, :] == torch.arange(num_images)[:, None])
    assert_matches_reference(scores, caption_image)


def test_identity_and_reversed_matrices_match_reference():
    num = 25
    identity = torch.eye(num)
    assert_matches_reference(identity, torch.arange(num))
    tr, ir = suite_ranks(identity, torch.arange(num))
    assert tr.eq(0).all() and ir.eq(0).all()
    reversed_scores = -torch.eye(num) + torch.arange(num, dtype=torch.float32)[None, :] * 1e-3
    assert_matches_reference(reversed_scores, torch.arange(num))
    tr, _ = suite_ranks(reversed_scores, torch.arange(num))
    assert tr.eq(num - 1).all()


def test_tie_rule_hand_example():
    """Rank = expected rank under uniform random tie-breaking (docs/metrics.md, "Tie rule")."""
    scores = torch.tensor([[0.5, 0.5, 0.9, 0.1], [0.2, 0.7, 0.7, 0.7]])
    candidate_group = torch.tensor([0, 1, 5, 1])  # image 0: caption 0; image 1: captions 1 and 3
    ranks = best_positive_rank(None, None, torch.arange(2), candidate_group, scores=scores)
    # query 0: one higher, then a block of 2 with 1 positive; query 1: block of 3 with 2 positives
    assert ranks.tolist() == pytest.approx([1 + 1 / 2, 0 + 1 / 3], abs=1e-15)


def test_tie_rule_relation_to_argsort_reference():
    """The stable argsort reference places tied candidates in index order: its rank is the
    strictly-higher count plus the tied negatives of lower index, where ours adds the expected
    number of tied negatives before the positive, (tied - 1) / 2; without ties both agree."""
    gen = torch.Generator().manual_seed(3)
    num = 30
    scores = torch.randint(0, 3, (num, num), generator=gen).float()
    (ref_tr, ref_ir), _ = reference(scores, torch.arange(num))
    tr, ir = suite_ranks(scores, torch.arange(num))
    positive = scores.diagonal()
    lower_index = torch.arange(num)[None, :] < torch.arange(num)[:, None]
    for ours, ref, matrix in ((tr, ref_tr, scores), (ir, ref_ir, scores.T)):
        tied_before = ((matrix == positive[:, None]) & lower_index).sum(1)
        tied = (matrix == positive[:, None]).sum(1)
        assert tied_before.sum() > 0
        np.testing.assert_array_equal(
            ours.numpy() + tied_before.numpy() - (tied.numpy() - 1) / 2, ref
        )


def test_embedding_sweep_equals_score_matrix_path():
    """paired_ranks (one matmul sweep, both directions) equals the engine on the full matrix."""
    gen = torch.Generator().manual_seed(5)
    image = torch.randn(70, 16, generator=gen)
    caption_image = torch.randint(0, 60, (200,), generator=gen)  # images 60..69 have no caption
    text = image[caption_image] + torch.randn(200, 16, generator=gen)
    text[7] = text[3]  # an exact duplicate caption creates ties
    paired = paired_ranks(image, text, caption_image, chunk_size=16)
    scores = image @ text.T
    queries = torch.unique(caption_image)
    tr, tr_ndcg = rank_and_ndcg(None, None, queries, caption_image, scores=scores[queries])
    ir, ir_ndcg = rank_and_ndcg(
        None, None, caption_image, torch.arange(70), scores=scores.T.contiguous()
    )
    assert paired.i2t_rank[60:].eq(-1).all()
    torch.testing.assert_close(paired.i2t_rank[queries], tr)
    torch.testing.assert_close(paired.t2i_rank, ir)
    torch.testing.assert_close(paired.i2t_ndcg[queries], tr_ndcg)
    torch.testing.assert_close(paired.t2i_ndcg, ir_ndcg)


def make_baseline_similarities(num_images=1000, num_languages=4, dim=256):
    """The matrices of metric-baselines.md size (a): seed 1234, float64, rounded to float32."""
    gen = torch.Generator().manual_seed(1234)
    image = torch.randn(num_images, dim, generator=gen, dtype=torch.float64)
    instance = torch.randn(num_images, dim, generator=gen, dtype=torch.float64)
    matrices = []
    for lang in range(num_languages):
        eps = torch.randn(num_images, dim, generator=gen, dtype=torch.float64)
        text = image + instance + (4.0 + 0.4 * lang) * eps
        image_n = torch.nn.functional.normalize(image, dim=1)
        text_n = torch.nn.functional.normalize(text, dim=1)
        matrices.append((image_n @ text_n.T).float())
    return matrices


def test_reference_values_of_metric_baselines_size_a():
    matrices = make_baseline_similarities()
    assert sum(m.double().sum().item() for m in matrices) == pytest.approx(
        744.387277382371, abs=1e-6
    )
    expected_r = [
        (69.0, 86.5, 91.7, 67.7, 87.0, 91.1),
        (61.5, 82.9, 89.0, 60.7, 82.2, 88.7),
        (48.6, 74.2, 81.4, 49.0, 73.5, 81.9),
        (39.8, 63.7, 73.1, 41.2, 64.4, 73.3),
    ]
    expected_ndcg = [
        (0.803547, 0.795021),
        (0.748512, 0.744345),
        (0.644291, 0.648149),
        (0.553792, 0.561566),
    ]
    ids = torch.arange(1000)
    tr_all, ir_all = [], []
    for lang, scores in enumerate(matrices):
        tr, tr_ndcg = rank_and_ndcg(None, None, ids, ids, scores=scores, chunk_size=300)
        ir, ir_ndcg = rank_and_ndcg(
            None, None, ids, ids, scores=scores.T.contiguous(), chunk_size=300
        )
        got = tuple(recall_at_k(r, k) for r in (tr, ir) for k in (1, 5, 10))
        assert got == pytest.approx(expected_r[lang], abs=1e-9)
        assert (tr_ndcg.mean().item(), ir_ndcg.mean().item()) == pytest.approx(
            expected_ndcg[lang], abs=1e-6
        )
        tr_all.append(tr)
        ir_all.append(ir)
    languages = torch.arange(4).repeat_interleave(1000)
    instances = ids.repeat(4)
    tr_var, _, dropped = mean_rank_variance(instances, languages, torch.cat(tr_all), 4)
    ir_var, _, _ = mean_rank_variance(instances, languages, torch.cat(ir_all), 4)
    assert (tr_var, ir_var, dropped) == pytest.approx((717.205938, 717.316563, 0), abs=1e-6)


def test_report_recalls_equal_reference_per_language():
    gen = torch.Generator().manual_seed(11)
    image = torch.randn(30, 8, generator=gen)
    caption_image = torch.arange(30).repeat(2)
    text = image[caption_image] + 1.5 * torch.randn(60, 8, generator=gen)
    languages = ["en"] * 30 + ["de"] * 30
    report = retrieval_report(image, text, caption_image, languages, [f"img{i}" for i in range(30)])
    for lang, rows in (("en", slice(0, 30)), ("de", slice(30, 60))):
        _, ref = reference(image @ text[rows].T, torch.arange(30))
        for k in (1, 5, 10):
            assert report[f"{lang}/i2t/R@{k}"] == pytest.approx(ref[f"txt_r{k}"], abs=1e-12)
            assert report[f"{lang}/t2i/R@{k}"] == pytest.approx(ref[f"img_r{k}"], abs=1e-12)
        assert report[f"{lang}/mR"] == pytest.approx(ref["r_mean"], abs=1e-12)
