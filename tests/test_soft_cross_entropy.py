"""The chunked soft cross-entropy (train/soft_cross_entropy.py): the unfused expression's values and
gradients, across chunk boundaries, for a float32 and a bfloat16 student, with and without HASS's top-K
term."""

import pytest
import torch

from draftsmith.train import soft_cross_entropy as module
from draftsmith.train.soft_cross_entropy import soft_cross_entropies, soft_cross_entropy


def _unfused(student, teacher, top_k):
    terms = -(teacher.softmax(-1) * student.float().log_softmax(-1))
    top = teacher.topk(top_k, dim=-1).indices if top_k else None
    return terms.sum(-1), (terms.gather(-1, top).sum(-1) if top is not None else None)


@pytest.mark.parametrize("rows", [5, 2 * module.CHUNK_ROWS + 7])
@pytest.mark.parametrize("top_k", [0, 3])
def test_values_and_gradients_are_the_unfused_expressions(rows, top_k):
    torch.manual_seed(0)
    teacher = torch.randn(rows, 50) * 3
    weights = torch.rand(rows), torch.rand(rows)
    grads = []
    for fused in (False, True):
        student = (torch.randn(rows, 50, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
        ce, topk = (soft_cross_entropies if fused else _unfused)(student, teacher, top_k)
        loss = (ce * weights[0]).sum() + ((topk * weights[1]).sum() if top_k else 0.0)
        loss.backward()
        grads.append((ce.detach(), None if topk is None else topk.detach(), student.grad))
    (ce_a, topk_a, grad_a), (ce_b, topk_b, grad_b) = grads
    torch.testing.assert_close(ce_b, ce_a)
    assert (topk_b is None) == (top_k == 0)
    if top_k:
        torch.testing.assert_close(topk_b, topk_a)
    torch.testing.assert_close(grad_b, grad_a)


def test_the_top_k_term_sums_over_the_teachers_top_k_without_renormalizing():
    torch.manual_seed(0)
    student, teacher = torch.randn(5, 12), torch.randn(5, 12)
    ce, topk = soft_cross_entropies(student, teacher, 3)
    p, log_q = teacher.softmax(-1), student.log_softmax(-1)
    for row in range(5):
        top = sorted(range(12), key=lambda k: -float(teacher[row, k]))[:3]
        torch.testing.assert_close(topk[row], -sum(p[row, k] * log_q[row, k] for k in top))
    torch.testing.assert_close(ce, -(p * log_q).sum(-1))
    torch.testing.assert_close(soft_cross_entropy(student, teacher), ce)


def test_a_bfloat16_student_gets_a_bfloat16_gradient_computed_in_float32():
    torch.manual_seed(0)
    teacher = torch.randn(40, 64)
    low = torch.randn(40, 64).bfloat16().requires_grad_()
    high = low.detach().float().requires_grad_()
    soft_cross_entropy(low, teacher).sum().backward()
    soft_cross_entropy(high, teacher).sum().backward()
    assert low.grad.dtype == torch.bfloat16
    torch.testing.assert_close(low.grad.float(), high.grad.bfloat16().float())


def test_a_teacher_that_requires_a_gradient_is_refused():
    with pytest.raises(ValueError, match="teacher"):
        soft_cross_entropy(torch.randn(2, 3), torch.randn(2, 3, requires_grad=True))


@pytest.mark.parametrize("top_k", [0, 3])
def test_paired_rows_are_the_gathered_rows_and_unread_rows_get_no_gradient(top_k):
    rows = 2 * module.CHUNK_ROWS + 7
    torch.manual_seed(0)
    teacher = torch.randn(rows + 9, 40) * 3
    student_rows = torch.randperm(rows + 5)[:rows]
    student_rows[-1] = student_rows[0]  # a row read twice gets both gradients
    teacher_rows = torch.randint(0, rows + 9, (rows,))
    weights = torch.rand(rows), torch.rand(rows)
    results = []
    for paired in (False, True):
        student = (torch.randn(rows + 5, 40, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_()
        if paired:
            ce, topk = soft_cross_entropies(student, teacher, top_k, student_rows, teacher_rows)
        else:
            ce, topk = soft_cross_entropies(student[student_rows], teacher[teacher_rows], top_k)
        loss = (ce * weights[0]).sum() + ((topk * weights[1]).sum() if top_k else 0.0)
        loss.backward()
        results.append((ce.detach(), topk, student.grad))
    (ce_a, topk_a, grad_a), (ce_b, topk_b, grad_b) = results
    assert torch.equal(ce_b, ce_a)
    if top_k:
        assert torch.equal(topk_b.detach(), topk_a.detach())
    torch.testing.assert_close(grad_b, grad_a)
    unread = torch.ones(rows + 5, dtype=torch.bool)
    unread[student_rows] = False
    assert unread.any() and not grad_b[unread].any()


def test_rows_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError, match="differ in number"):
        soft_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), teacher_rows=torch.tensor([0, 1, 2]))
