"""Full-vocabulary cross-entropy and KL made a chunk of rows at a time, and the LoRA families'
next-token terms built on them (Medusa-2, Speculative Streaming)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class ChunkedTerms:
    ce: torch.Tensor  # mean CE against the labels (with a graph)
    kl: torch.Tensor  # mean KL(teacher || student) over the rows; 0 without a teacher
    hits: torch.Tensor  # (N,) bool: the student's argmax is the label
    agrees: torch.Tensor  # (N,) bool: the student's argmax is the teacher's; empty without a teacher


def chunked_ce(
    hidden: torch.Tensor, labels: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean CE of ``project(hidden)`` against ``labels`` and the top-1 hits (see :func:`chunked_terms`)."""
    terms = chunked_terms(hidden, labels, project, chunk_rows)
    return terms.ce, terms.hits


def chunked_terms(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    chunk_rows: int,
    teacher_hidden: torch.Tensor | None = None,
) -> ChunkedTerms:
    """CE of ``project(hidden)`` (N, V) against ``labels`` (N,) and, with ``teacher_hidden`` (N, h, no
    gradient), KL(project(teacher_hidden) || project(hidden)).

    With ``chunk_rows`` > 0 the logits are made ``chunk_rows`` rows at a time and each chunk is
    checkpointed: only its (chunk_rows, h) inputs are kept for the backward, which makes the chunk's
    logits again, so at most one chunk's (chunk_rows, V) logits exist at any time (a (16 x 2048)-row
    batch's logits over a 49k vocabulary, per stream, do not fit a GPU beside the model; a (2 x 2048)
    batch's main and original logits with their softmaxes took ~10 GB of a CPU's memory). The
    gradients are the unchunked ones, up to float summation order. 0 = all rows at once, kept."""
    rows = labels.numel()
    if not rows:
        zero, none = hidden.sum() * 0.0, labels.new_zeros(0, dtype=torch.bool)  # zero, with a graph
        return ChunkedTerms(zero, zero, none, none)
    size = chunk_rows if chunk_rows > 0 else rows
    recompute = chunk_rows > 0 and torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, rows, size):
        chunk = slice(start, start + size)
        teacher = None if teacher_hidden is None else teacher_hidden[chunk]
        part = (project, hidden[chunk], labels[chunk], teacher)
        parts.append(checkpoint(_chunk_sums, *part, use_reentrant=False) if recompute else _chunk_sums(*part))
    ce_sums, kl_sums, hits, agrees = zip(*parts, strict=True)
    return ChunkedTerms(
        torch.stack(ce_sums).sum() / rows, torch.stack(kl_sums).sum() / rows, torch.cat(hits), torch.cat(agrees)
    )


def _chunk_sums(
    project: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's CE sum, KL sum, hits and agreements (see :func:`chunked_terms`)."""
    student = project(hidden).float().log_softmax(-1)
    ce_sum = F.nll_loss(student, labels, reduction="sum")
    picked = student.detach().argmax(-1)
    if teacher_hidden is None:
        return ce_sum, ce_sum.new_zeros(()), picked == labels, labels.new_zeros(0, dtype=torch.bool)
    with torch.no_grad():
        teacher = project(teacher_hidden).float().log_softmax(-1)
    kl_sum = F.kl_div(student, teacher, log_target=True, reduction="sum")
    return ce_sum, kl_sum, picked == labels, picked == teacher.argmax(-1)


def next_token_terms(
    core, out: Any, input_ids: torch.Tensor, predicting: torch.Tensor, chunk_rows: int
) -> ChunkedTerms:
    """The LoRA families' next-token terms at the positions t where ``predicting`` (B, T - 1) says
    ``x_{t+1}`` is supervised: the adapted model's CE against ``x_{t+1}`` and, when the forward ran
    the original (``out.original_features``), KL(original || adapted), the guard on the served model.
    Both from last features through the target's ``lm_head``, ``chunk_rows`` rows at a time."""
    teacher = out.original_features
    return chunked_terms(
        out.features[:, :-1][predicting],
        input_ids[:, 1:][predicting],
        core.next_token_logits,
        chunk_rows,
        None if teacher is None else teacher[:, :-1][predicting],
    )


def distillation_metrics(terms: ChunkedTerms) -> dict[str, float]:
    """``loss/kl`` and ``agree/original``: how often the adapted model's argmax is the original's."""
    metrics = {"loss/kl": float(terms.kl.detach())}
    if terms.agrees.numel():
        metrics["agree/original"] = float(terms.agrees.float().mean())
    return metrics
