"""Soft cross-entropy to a teacher's distribution, a few rows at a time in the forward and the backward.

The drafters' distillation losses compare (rows, vocabulary) logits with a teacher's: on a CPU written
as ``-(softmax(t) * log_softmax(s)).sum(-1)`` each of the forward's and autograd's backward's ~10
element-wise passes makes and reads a tensor the size of the logits (hundreds of MB for a batch's
rows over an 8,192-token draft vocabulary), so the step waits on memory. Here every pass runs over
:data:`CHUNK_ROWS` rows at once, small enough to stay in the core's cache, and the backward is the
closed form ``(sum(p) q - p)`` rather than autograd's chain; only the inputs are kept for it. The
values and gradients are the unfused expression's, up to float rounding.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 32  # rows per pass: a (32, 8192) float32 tile is 1 MB, within one core's L2 cache


def soft_cross_entropies(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, top_k: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, ``-sum_j p_j log q_j`` with ``p = softmax(teacher_logits)`` and ``q =
    softmax(student_logits)`` (computed in float32 whatever the student's dtype) and, with ``top_k`` > 0,
    the same sum over the teacher's ``top_k`` likeliest columns only (None without). The gradient flows
    to ``student_logits`` only, in its dtype."""
    if teacher_logits.requires_grad:
        raise ValueError("soft_cross_entropies: the teacher's logits must not require a gradient")
    top = None
    if top_k > 0:
        top = teacher_logits.topk(min(top_k, teacher_logits.shape[-1]), dim=-1).indices
    ce, topk_ce = _SoftCrossEntropy.apply(student_logits, teacher_logits, top)
    return ce, topk_ce if top is not None else None


def soft_cross_entropy(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per row, ``-sum_j softmax(teacher)_j log softmax(student)_j`` (see :func:`soft_cross_entropies`)."""
    return soft_cross_entropies(student_logits, teacher_logits)[0]


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, top: torch.Tensor | None):
        rows = student.shape[0]
        ce = student.new_empty(rows, dtype=torch.float32)
        topk_ce = student.new_zeros(rows if top is not None else 0, dtype=torch.float32)
        for chunk in _chunks(rows):
            log_q = student[chunk].float().log_softmax(-1)
            p = teacher[chunk].float().softmax(-1)
            ce[chunk] = -(p * log_q).sum(-1)
            if top is not None:
                picked = top[chunk]
                topk_ce[chunk] = -(p.gather(-1, picked) * log_q.gather(-1, picked)).sum(-1)
        ctx.save_for_backward(student, teacher, top)
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zero tensor
        return ce, topk_ce

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor | None, grad_topk: torch.Tensor | None):
        student, teacher, top = ctx.saved_tensors
        grad = torch.empty_like(student)
        for chunk in _chunks(student.shape[0]):
            q = student[chunk].float().softmax(-1)
            p = teacher[chunk].float().softmax(-1)
            grad[chunk] = _chunk_gradient(q, p, chunk, grad_ce, grad_topk, top)
        return grad, None, None


def _chunk_gradient(q, p, chunk, grad_ce, grad_topk, top) -> torch.Tensor:
    """d/ds of ``grad_ce * CE + grad_topk * TopK`` for one chunk: ``-sum_{j in S} p_j log q_j`` has the
    gradient ``(sum_{j in S} p_j) q - p 1_S`` in the logits ``s``."""
    grad = torch.zeros_like(q)
    if grad_ce is not None:
        weight = grad_ce[chunk, None]
        grad += (q * p.sum(-1, keepdim=True) - p) * weight
    if top is not None and grad_topk is not None:
        weight, picked = grad_topk[chunk, None], top[chunk]
        held = p.gather(-1, picked)
        grad += q * (held.sum(-1, keepdim=True) * weight)
        grad.scatter_add_(-1, picked, -held * weight)
    return grad


def _chunks(rows: int):
    for start in range(0, rows, CHUNK_ROWS):
        yield slice(start, min(start + CHUNK_ROWS, rows))
