"""CL2CM's cross-lingual losses on token states (spec cl2cm.md §3.3, §3.5): the word-alignment
loss, the word-level max-sim similarity and the relational knowledge-transfer KL.

Token states are L2-normalised by the caller; ``*_mask`` tensors are bool word masks (True on
real word tokens, False on [CLS], [SEP]/</s> and padding: :func:`word_mask`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ccr.methods.layers.distributed import gather_with_grad, world_size

KL_DIRECTIONS = ("student_teacher", "teacher_student")
CKT_LEVELS = ("sent", "word", "sent+word")


def word_mask(attention_mask: Tensor) -> Tensor:
    """True on the word tokens of right-padded captions: every real token except the first
    ([CLS] / <s>) and the last (the [SEP] / </s> the tokenizer puts at the last real position)."""
    mask = attention_mask.bool()
    length = mask.sum(1, keepdim=True)
    position = torch.arange(mask.shape[1], device=mask.device)[None, :]
    return mask & (position > 0) & (position < length - 1)


@torch.no_grad()
def gather_padded(x: Tensor, tokens: bool = False) -> Tensor:
    """``x [B, ...]`` of every process concatenated in rank order, without gradient (the teacher
    side). ``tokens``: ``x`` is ``[B, L, ...]`` per token and is right-padded to the longest L of
    all processes first (each process trims its own padding). Bool tensors stay bool."""
    if world_size() == 1:
        return x
    is_bool = x.dtype == torch.bool
    x = x.float() if is_bool else x
    if tokens:
        length = torch.tensor([x.shape[1]], device=x.device)
        dist.all_reduce(length, op=dist.ReduceOp.MAX)
        pad = [0, 0] * (x.dim() - 2) + [0, int(length) - x.shape[1]]
        x = F.pad(x, pad)
    gathered = gather_with_grad(x)
    return gathered.bool() if is_bool else gathered


def word_align_loss(
    similarity: Tensor, labels: Tensor, rows: Tensor, target_mask: Tensor, temperature: float
) -> Tensor:
    """Cross-entropy of the labels against softmax over target words of ``similarity / τ_w``,
    averaged over the labelled source words ``rows`` of the GLOBAL batch.

    ``similarity [B, Ls, Lt]`` carries the gradient; ``labels`` and ``rows`` are constants. Under
    several processes the local sum is divided by the global count and multiplied by the world
    size, so that averaging the processes' gradients (DDP) gives the global-batch mean exactly.
    0 when no word is labelled.
    """
    target_mask = target_mask.bool()
    logits = (similarity.float() / temperature).masked_fill(~target_mask[:, None, :], float("-inf"))
    log_p = logits.log_softmax(2).masked_fill(~target_mask[:, None, :], 0.0)
    log_p = log_p.masked_fill(~rows[:, :, None], 0.0)
    per_word = -(labels * log_p).sum(2)
    count = rows.sum().float()
    if world_size() > 1:
        count = count.clone()
        dist.all_reduce(count)
        return per_word.sum() * world_size() / count.clamp_min(1)
    return per_word.sum() / count.clamp_min(1)


def maxsim_word_similarity(
    source_tokens: Tensor, target_tokens: Tensor, source_mask: Tensor, target_mask: Tensor
) -> Tensor:
    """S_word [Bs, Bt]: for source caption i and target caption j, the mean over i's words of
    each word's best cosine among j's words (directional). One matmul over all token pairs."""
    bs, ls, h = source_tokens.shape
    bt, lt, _ = target_tokens.shape
    sim = source_tokens.reshape(bs * ls, h) @ target_tokens.reshape(bt * lt, h).t()
    sim = sim.view(bs, ls, bt, lt).masked_fill(~target_mask.bool()[None, None, :, :], float("-inf"))
    best = sim.max(3).values.masked_fill(~source_mask.bool()[:, :, None], 0.0)  # [Bs, Ls, Bt]
    best = best.nan_to_num(0.0, neginf=0.0)  # a target without words
    return best.sum(1) / source_mask.sum(1, keepdim=True).clamp_min(1)


def teacher_similarity(sentence: Tensor, word: Tensor | None, levels: str, mix: float) -> Tensor:
    """S_cl from the sentence-level and word-level similarities: ``sent``, ``word`` or
    ``mix·sent + (1 - mix)·word`` (``sent+word``, Eq. 14)."""
    if levels not in CKT_LEVELS:
        raise ValueError(f"ckt_levels {levels!r}: expected one of {CKT_LEVELS}")
    if levels == "sent":
        return sentence
    if levels == "word":
        return word
    return sentence if mix == 1.0 else mix * sentence + (1.0 - mix) * word


def relational_kd_loss(
    student: Tensor, teacher: Tensor, temperature: float, direction: str = "student_teacher"
) -> Tensor:
    """Mean over rows of KL between the row softmaxes of ``student`` (S_cm) and ``teacher`` (S_cl),
    both divided by τ. ``student_teacher``: KL(p_cm ‖ p_cl), Eq. 15 as written;
    ``teacher_student``: KL(p_cl ‖ p_cm) (Hinton-style). The teacher side is detached."""
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"kl_direction {direction!r}: expected one of {KL_DIRECTIONS}")
    log_p_student = F.log_softmax(student.float() / temperature, dim=1)
    log_p_teacher = F.log_softmax(teacher.detach().float() / temperature, dim=1)
    if direction == "student_teacher":
        return (log_p_student.exp() * (log_p_student - log_p_teacher)).sum(1).mean()
    return (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(1).mean()
