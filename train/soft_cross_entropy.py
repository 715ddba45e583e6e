"""Soft cross-entropy to a teacher's distribution, a few rows at a time in the forward and the backward.

The drafters' distillation losses compare (rows, vocabulary) logits with a teacher's: on a CPU written
as ``-(softmax(t) * log_softmax(s)).sum(-1)`` each of the forward's and autograd's backward's ~10
element-wise passes makes and reads a tensor the size of the logits (hundreds of MB for a batch's
rows over an 8,192-token draft vocabulary), so the step waits on memory. Here every pass runs over
:data:`CHUNK_ROWS` rows at once, small enough to stay in the core's cache, and the backward is the
closed form ``(sum(p) q - p)`` rather than autograd's chain; only the inputs are kept for it. The
values and gradients are the unfused expression's, up to float rounding.

A loss that compares only some rows (the positions a step teaches, each with its teacher row elsewhere)
passes their indices instead of gathering them first: a gathered copy is another tensor the size of the
logits, written and read once more, and its backward scatters the gradient back through a third.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 32  # rows per pass: a (32, 8192) float32 tile is 1 MB, within one core's L2 cache


def soft_cross_entropies(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    top_k: int = 0,
    student_rows: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row, ``-sum_j p_j log q_j`` with ``p = softmax(teacher_logits)`` and ``q =
    softmax(student_logits)`` (computed in float32 whatever the student's dtype) and, with ``top_k`` > 0,
    the same sum over the teacher's ``top_k`` likeliest columns only (None without). ``student_rows`` and
    ``teacher_rows`` (1-D indices, as long as each other) pair row ``student_rows[i]`` with teacher row
    ``teacher_rows[i]`` for output ``i``; either left out means all of its rows in order. The gradient
    flows to ``student_logits`` only, in its dtype (zero in rows no output reads)."""
    if teacher_logits.requires_grad:
        raise ValueError("soft_cross_entropies: the teacher's logits must not require a gradient")
    pairs = _Pairs(student_rows, teacher_rows)
    if pairs.count(student_logits, teacher_logits) is None:
        raise ValueError("soft_cross_entropies: the student's and the teacher's rows differ in number")
    top_k = min(top_k, teacher_logits.shape[-1])
    ce, topk_ce = _SoftCrossEntropy.apply(student_logits, teacher_logits, top_k, pairs)
    return ce, topk_ce if top_k > 0 else None


def soft_cross_entropy(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_rows: torch.Tensor | None = None,
    teacher_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, ``-sum_j softmax(teacher)_j log softmax(student)_j`` (see :func:`soft_cross_entropies`)."""
    return soft_cross_entropies(student_logits, teacher_logits, 0, student_rows, teacher_rows)[0]


class _Pairs:
    """Which student row meets which teacher row: index tensors, or None for every row in order."""

    def __init__(self, student_rows: torch.Tensor | None, teacher_rows: torch.Tensor | None) -> None:
        self.student_rows, self.teacher_rows = student_rows, teacher_rows

    def count(self, student: torch.Tensor, teacher: torch.Tensor) -> int | None:
        """The number of pairs, or None where the two sides disagree."""
        sides = {len(self.student_rows) if self.student_rows is not None else student.shape[0]}
        sides.add(len(self.teacher_rows) if self.teacher_rows is not None else teacher.shape[0])
        return sides.pop() if len(sides) == 1 else None

    def student(self, logits: torch.Tensor, chunk: slice) -> torch.Tensor:
        return _take(logits, self.student_rows, chunk)

    def teacher(self, logits: torch.Tensor, chunk: slice) -> torch.Tensor:
        return _take(logits, self.teacher_rows, chunk)


def _take(logits: torch.Tensor, rows: torch.Tensor | None, chunk: slice) -> torch.Tensor:
    return logits[chunk] if rows is None else logits[rows[chunk]]


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, top_k: int, pairs: _Pairs):
        count = pairs.count(student, teacher)
        ce = student.new_empty(count, dtype=torch.float32)
        topk_ce = student.new_zeros(count if top_k > 0 else 0, dtype=torch.float32)
        top = torch.empty(count, top_k, dtype=torch.long, device=student.device) if top_k > 0 else None
        for chunk in _chunks(count):
            log_q = pairs.student(student, chunk).float().log_softmax(-1)
            rows = pairs.teacher(teacher, chunk)
            p = rows.float().softmax(-1)
            ce[chunk] = -(p * log_q).sum(-1)
            if top is not None:
                top[chunk] = picked = rows.topk(top_k, dim=-1).indices
                topk_ce[chunk] = -(p.gather(-1, picked) * log_q.gather(-1, picked)).sum(-1)
        ctx.save_for_backward(student, teacher, top)
        ctx.pairs = pairs
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not a zero tensor
        return ce, topk_ce

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor | None, grad_topk: torch.Tensor | None):
        student, teacher, top = ctx.saved_tensors
        pairs = ctx.pairs
        rows = pairs.student_rows
        grad = torch.empty_like(student) if rows is None else torch.zeros_like(student)
        for chunk in _chunks(pairs.count(student, teacher)):
            q = pairs.student(student, chunk).float().softmax(-1)
            p = pairs.teacher(teacher, chunk).float().softmax(-1)
            part = _chunk_gradient(q, p, chunk, grad_ce, grad_topk, top)
            if rows is None:
                grad[chunk] = part
            else:
                grad.index_add_(0, rows[chunk], part.to(grad.dtype))
        return grad, None, None, None


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
