"""DFlash: block denoising at random anchors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.drafters.base import FrozenTarget
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.losses.offsets import chain_length, shift_left
from draftsmith.train.losses.teacher import draft_vocab_teacher
from draftsmith.train.soft_cross_entropy import soft_cross_entropy


def dflash_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    anchors: int = 512,
    gamma: float = 4.0,
    soft_labels: bool = True,
    teacher_chunk_rows: int = 1024,
) -> LossOutput:
    """DFlash: block denoising at ``anchors`` random anchors per sequence (assistant tokens followed by
    one; fewer when a sequence has fewer), each block ``[x_a, mask, ...]`` at rotary positions a..a+K-1
    (K = ``drafter.block_size``) seeing the target's context strictly before a and its own block
    bidirectionally (:func:`dflash_mask`). Block position k predicts ``x_{a+k}``, supervised where that is
    an assistant token: by the target's distribution there over the draft vocabulary (``soft_labels``,
    where the target's argmax is drafted) or by the data token (false: the reference's hard labels).
    Position k weighs ``exp(-(k-1)/gamma)`` (the paper: gamma 7, 5, 4 for blocks of 16, 10, 8; 0 = flat);
    the loss is the weighted mean. Training draws anchors from the global RNG; evaluation from a fixed
    seed, so evaluations compare and leave the training stream alone.

    Metrics: ``loss/ce``, ``acc/step{k}`` (top-1 agreement with the target's argmax over its whole
    vocabulary at block position k), ``sim/accept_length`` = ``1 + sum_k prod_{j<=k} acc_j`` (as every
    family logs it) and ``sim/block_accept_length``, the mean accepted prefix + 1 of the fully labelled
    blocks themselves."""
    core = getattr(model, "module", model)
    size = int(core.config.block_size)
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    generator = None if model.training else torch.Generator(device=supervised.device).manual_seed(0)
    starts, kept = sample_anchors(supervised, anchors, generator)  # (B, N)
    if not starts.shape[1]:  # no assistant token is followed by another: nothing to denoise
        return LossOutput(core.mask_embedding.sum() * 0.0, {})
    labels = starts[..., None] + torch.arange(size, device=starts.device)  # (B, N, K) positions a + k
    width = supervised.shape[1]
    at = labels.clamp(max=width - 1)
    labelled = kept[..., None] & (labels < width) & supervised.gather(1, at.flatten(1)).view_as(at)
    labelled[..., 0] = False  # the anchor's own token is given, not predicted
    features = _dflash_block_forward(model, core, batch, frozen, starts, kept)  # (B, N * K, h)
    before_all = (at - 1).clamp(min=0).flatten(1)  # the target's state at a+k-1 teaches x_{a+k}
    needed = torch.zeros(supervised.shape, dtype=torch.long, device=supervised.device)
    needed = needed.scatter_add_(1, before_all, labelled.flatten(1).long()) > 0
    teacher = draft_vocab_teacher(frozen, core, batch, needed, teacher_chunk_rows)
    rows = labelled.flatten(1)
    logits = core.head(frozen)(features[rows]).float()  # (n, N') over the draft vocabulary
    before = before_all[rows]
    batch_index = torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(rows)[rows]
    truth = teacher.argmax[batch_index, before]  # the target's argmax over its whole vocabulary
    vocab_index = core.vocab_index(frozen.lm_head.weight.shape[0])
    if soft_labels:
        columns = truth if vocab_index is None else vocab_index[truth]
        ce = soft_cross_entropy(logits, teacher.logits, teacher_rows=teacher.row[batch_index, before])
    else:
        tokens = batch.input_ids.gather(1, at.flatten(1))[rows]
        columns = tokens if vocab_index is None else vocab_index[tokens]
        ce = F.cross_entropy(logits, columns.clamp(min=0), reduction="none")
    k = torch.arange(size, device=rows.device).expand_as(labelled).flatten(1)[rows]
    weight = torch.exp(-(k - 1).float() / gamma) if gamma > 0 else torch.ones_like(ce)
    weight = weight * (columns >= 0)  # a token outside the draft vocabulary cannot be proposed
    loss = (ce * weight).sum() / weight.sum().clamp_min(1e-6)
    hits = torch.zeros_like(labelled)
    hits.view(hits.shape[0], -1)[rows] = core.token_ids(logits.detach().argmax(-1)) == truth
    metrics = {"loss/ce": float(loss.detach()), **block_accuracy(hits, labelled)}
    return LossOutput(loss, metrics)


def sample_anchors(
    supervised: torch.Tensor, count: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``count`` distinct anchor positions per row of ``supervised`` (B, T), drawn uniformly among
    assistant tokens followed by another (a block with at least one label): (B, N) positions (0 where
    unused) and (B, N) bool, which are used."""
    valid = supervised & shift_left(supervised, 1)
    available = valid.sum(1, keepdim=True)
    number = min(count, int(available.max())) if valid.numel() else 0
    draw = torch.rand(valid.shape, device=valid.device, generator=generator).masked_fill(~valid, 2.0)
    chosen = draw.argsort(dim=1)[:, :number]  # the valid positions first, in random order
    kept = torch.arange(number, device=valid.device) < available
    return torch.where(kept, chosen, 0), kept


def dflash_mask(starts: torch.Tensor, kept: torch.Tensor, width: int, size: int) -> torch.Tensor:
    """(B, 1, N K, width + N K) bool: which keys each block query sees. The keys are the context's
    ``width`` positions, then the blocks in order; block n sees the context before its anchor
    ``starts[:, n]`` and its own K rows (bidirectionally), never another block. An unused block
    (``kept`` False) sees only itself."""
    b, n = starts.shape
    block_of = torch.arange(n * size, device=starts.device) // size  # (N K,)
    anchor = starts.gather(1, block_of[None].expand(b, -1))  # (B, N K)
    context = torch.arange(width, device=starts.device)[None, None] < anchor[..., None]
    context = context & kept.gather(1, block_of[None].expand(b, -1))[..., None]
    own = (block_of[:, None] == block_of[None, :])[None].expand(b, -1, -1)
    return torch.cat([context, own], dim=-1)[:, None]


def _dflash_block_forward(model, core, batch: TrainBatch, frozen: FrozenTarget, starts, kept) -> torch.Tensor:
    """The drafter's output features (B, N K, h) of every block at once, the whole sequence its context."""
    size, (b, width) = int(core.config.block_size), batch.input_ids.shape
    states = batch.drafter_states.float()
    blocks = starts.shape[1] * size
    first = (torch.arange(blocks, device=starts.device) % size == 0)[None].expand(b, -1)
    ids = torch.zeros(b, blocks, dtype=torch.long, device=starts.device)
    ids[first] = batch.input_ids.gather(1, starts).flatten()
    positions = starts.repeat_interleave(size, dim=1) + torch.arange(blocks, device=starts.device) % size
    context_positions = torch.arange(width, device=starts.device)[None].expand(b, -1)
    return model(
        frozen.embed_tokens(ids).to(states.dtype),
        ~first,
        states,
        torch.cat([context_positions, positions], dim=1),
        dflash_mask(starts, kept, width, size),
    )


def block_accuracy(hits: torch.Tensor, labelled: torch.Tensor) -> dict[str, float]:
    """From (B, N, K) per-position hits and labels: ``acc/step{k}``, the chain length they imply, and the
    mean accepted prefix of the fully labelled blocks (+1: the target's own token)."""
    metrics, accuracies = {}, []
    for k in range(1, hits.shape[-1]):
        if labelled[..., k].any():
            accuracies.append(float(hits[..., k][labelled[..., k]].float().mean()))
            metrics[f"acc/step{k}"] = accuracies[-1]
    if accuracies:
        metrics["sim/accept_length"] = chain_length(accuracies)
    full = labelled[..., 1:].all(-1)
    if full.any():
        prefix = hits[..., 1:][full].long().cumprod(-1).sum(-1)
        metrics["sim/block_accept_length"] = 1.0 + float(prefix.float().mean())
    return metrics
