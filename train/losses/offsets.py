"""What position t reads some offsets ahead, and the per-offset terms and chain lengths built on it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftsmith.train.batch import TrainBatch


def shift_left(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """``tensor[:, t + shift]`` at t (zeros past the end), same shape: what position t reads ``shift`` ahead."""
    shifted = torch.zeros_like(tensor)
    if shift < tensor.shape[1]:
        shifted[:, : tensor.shape[1] - shift] = tensor[:, shift:]
    return shifted


def chain_length(accuracies: list[float]) -> float:
    """``1 + sum_k prod_{j<=k} acc_j``: the expected length of a top-1 chain with these per-step accuracies."""
    return 1.0 + float(torch.tensor(accuracies, dtype=torch.float64).cumprod(0).sum())


def per_offset_ce(
    batch: TrainBatch,
    count: int,
    head_ce: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    name: str,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """The per-offset terms shared by Medusa's heads and Speculative Streaming's streams: head k
    (1..``count``) at position t predicts ``x_{t+k+1}``, supervised where that is an assistant token.

    ``head_ce(k, rows)`` gets the (B, T - k - 1) bool mask of head k's supervised positions and returns
    its CE and top-1 hits there. Returns the CEs (head 1 first) and the metrics ``loss/{name}{k}``,
    ``acc/{name}{k}`` and ``sim/accept_length`` = 1 + the mean number of leading heads that are all
    right at a position (the acceptance length of a top-1 chain on this data)."""
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    length = supervised.shape[1]
    correct = torch.zeros(*supervised.shape, count, dtype=torch.bool, device=supervised.device)
    ces, metrics = [], {}
    for k in range(1, count + 1):
        rows = supervised[:, k + 1 :]
        ce, hits = head_ce(k, rows)
        correct[:, : rows.shape[1], k - 1][rows] = hits
        ces.append(ce)
        metrics[f"loss/{name}{k}"] = float(ce.detach())
        if hits.numel():
            metrics[f"acc/{name}{k}"] = float(hits.float().mean())
    starts = supervised[:, 2:]  # positions where head 1 has a label
    if starts.any():
        leading = correct[:, : length - 2][starts].float().cumprod(-1).sum(-1)
        metrics["sim/accept_length"] = float(1.0 + leading.mean())
    return ces, metrics
