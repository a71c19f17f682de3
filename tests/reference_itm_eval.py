"""Reference evaluator for golden tests: the argsort-per-row logic of the methods' public code
(ALBEF ``itm_eval`` and its descendants), re-written from the description in
shared/reference/peer-code-survey.md §2. Deliberately slow and simple: numpy, one row at a time.

Ties: ``np.argsort(kind="stable")`` on the negated row keeps tied candidates in index order, so a
tied positive is placed before tied negatives of larger index and after those of smaller index.
"""

from __future__ import annotations

import numpy as np


def _rank_of(row: np.ndarray, targets) -> int:
    order = np.argsort(-row, kind="stable")
    return min(int(np.where(order == target)[0][0]) for target in targets)


def itm_ranks(scores_i2t: np.ndarray, scores_t2i: np.ndarray, img2txt: dict, txt2img: dict):
    """(TR ranks per image, IR ranks per text): TR takes the best of the image's captions."""
    tr = np.array([_rank_of(scores_i2t[i], img2txt[i]) for i in range(scores_i2t.shape[0])])
    ir = np.array([_rank_of(scores_t2i[t], [txt2img[t]]) for t in range(scores_t2i.shape[0])])
    return tr, ir


def itm_eval(scores_i2t: np.ndarray, scores_t2i: np.ndarray, img2txt: dict, txt2img: dict) -> dict:
    """TR@K / IR@K in percent for K = 1, 5, 10, and their means, as the public code reports them."""
    tr, ir = itm_ranks(scores_i2t, scores_t2i, img2txt, txt2img)
    result = {}
    for name, ranks in (("txt", tr), ("img", ir)):
        for k in (1, 5, 10):
            result[f"{name}_r{k}"] = 100.0 * np.sum(ranks < k) / len(ranks)
        result[f"{name}_r_mean"] = (
            result[f"{name}_r1"] + result[f"{name}_r5"] + result[f"{name}_r10"]
        ) / 3
    result["r_mean"] = (result["txt_r_mean"] + result["img_r_mean"]) / 2
    return result
