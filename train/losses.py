"""Losses, one per drafter family: ``loss(model, batch, frozen, **options) -> LossOutput``.

The options are the recipe's ``loss`` section; their defaults are the published recipes' values.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from draftsmith.core.tree import causal_mask
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.registry import Family
from draftsmith.drafters.ttt_attention import TTTMask
from draftsmith.drafters.vocab import DraftHead
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.recipe_loader import RecipeError, check_keys
from draftsmith.train.soft_cross_entropy import soft_cross_entropies, soft_cross_entropy


def _feature_pairs(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE's alignment: position t reads ``(f_t, x_{t+1})`` and predicts ``f_{t+1}``, whose logits
    predict ``x_{t+2}``; a position is supervised when ``x_{t+2}`` is an assistant token, so the last
    position (nothing to predict) is masked.

    Returns input features (B, T-1, h), next tokens (B, T-1), target features (B, T-1, h), weights (B, T-1)."""
    features = batch.hidden_states.float()
    weights = torch.zeros_like(batch.loss_mask[:, 1:], dtype=features.dtype)
    weights[:, :-1] = (batch.loss_mask[:, 2:] * batch.attention_mask[:, 2:]).to(features.dtype)
    return features[:, :-1], batch.input_ids[:, 1:], features[:, 1:], weights


def _length_scaled_noise(features: torch.Tensor, scale: float) -> torch.Tensor:
    """The official EAGLE noise: uniform, width ``scale * 512 / T`` (the paper states U(-0.1, 0.1))."""
    width = scale * 512 / features.shape[1]
    return (torch.rand_like(features) - 0.5) * width


def feature_distillation_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    ce_weight: float = 0.1,
    feature_noise: float = 0.2,
    metric_steps: int = 3,
    metric_rows: int = 128,
) -> LossOutput:
    """EAGLE / FSPAD: ``SmoothL1(f, f_target) + ce_weight * CE(lm_head(f_target) || lm_head(f~))``.

    ``feature_noise`` perturbs the input features while training (0 turns it off). With a reduced
    draft vocabulary the CE runs over those tokens only (EAGLE-3's choice: the drafter never proposes
    anything else, and the full-vocabulary head would dominate the step's cost). The logged top-1
    accuracies compare with the target's argmax over its whole vocabulary, on at most ``metric_rows``
    supervised positions: in training only step 1's (free: it reads the step's own forward); in
    evaluation steps 1..``metric_steps``, unrolling the drafter on its own predicted features (no
    gradient; each step is one more forward over the batch, so training skips them), and
    ``sim/accept_length``, the top-1 chain length they imply."""
    inputs, next_tokens, targets, weights = _feature_pairs(batch)
    positions = torch.arange(inputs.shape[1], device=inputs.device)[None].expand(inputs.shape[0], -1)
    embeds = frozen.embed_tokens(next_tokens).to(inputs.dtype)
    noisy = inputs + _length_scaled_noise(inputs, feature_noise) if model.training and feature_noise else inputs
    mask = _padded_causal_mask(batch.attention_mask[:, 1:], inputs.dtype)
    rows = weights > 0
    # evaluation unrolls the drafter on its own features at every position; a training step reads rows only
    out = model(embeds, noisy, positions, attention_mask=mask, rows=rows if model.training else None)

    total = weights.sum().clamp_min(1.0)
    per_row = F.smooth_l1_loss(out.next_features[rows], targets[rows], reduction="none").mean(-1)
    regression = (per_row * weights[rows]).sum() / total
    head = DraftHead(frozen.lm_head, getattr(model, "module", model).draft_vocab)
    with torch.no_grad():
        teacher = head(targets[rows])
    ce = (soft_cross_entropy(head(out.token_features[rows]), teacher) * weights[rows]).sum() / total
    metrics = {"loss/smooth_l1": float(regression.detach()), "loss/ce": float(ce.detach())}
    steps = 1 if model.training else metric_steps
    if rows.any() and steps > 0:
        picked = rows.nonzero()[:metric_rows]
        metrics.update(
            _draft_step_accuracy(model, frozen, head, embeds, inputs, out, positions, mask, picked, targets, steps)
        )
    return LossOutput(regression + ce_weight * ce, metrics)


@torch.no_grad()
def _draft_step_accuracy(model, frozen, head, embeds, inputs, first, positions, mask, picked, targets, steps):
    """Top-1 agreement with the target's argmax when the drafter's inputs at earlier positions are its
    own predictions, as at draft step k, and ``1 + sum_k prod_{j<=k} acc_j``."""
    at = (picked[:, 0], picked[:, 1])
    truth = frozen.lm_head(targets[at]).argmax(-1)
    out, accuracies = first, []
    for step in range(1, steps + 1):
        if step > 1:
            shifted = torch.cat([inputs[:, :1], out.next_features[:, :-1]], dim=1)
            out = model(embeds, shifted, positions, attention_mask=mask)
        accuracies.append(float((head.top1(out.token_features[at]) == truth).float().mean()))
    metrics = {f"acc/step{k}": a for k, a in enumerate(accuracies, start=1)}
    if steps > 1:
        metrics["sim/accept_length"] = chain_length(accuracies)
    return metrics


# the new tokens per turn of the project's benches (`bench --max-new-tokens 64`)
ANSWER_START_TOKENS = 64


def chain_length(accuracies: list[float]) -> float:
    """``1 + sum_k prod_{j<=k} acc_j``: the expected length of a top-1 chain with these per-step accuracies."""
    return 1.0 + float(torch.tensor(accuracies, dtype=torch.float64).cumprod(0).sum())


def _padded_causal_mask(padding: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return causal_mask(padding.shape[1], dtype, padding.device, padding)


def eagle3_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    decay: float = 0.8,
    teacher_chunk_rows: int = 1024,
    topk_distill: int = 0,
    topk_weight: float = 1.0,
    align_mask: bool = False,
    align_topk: int = 3,
    answer_start_weight: float = 1.0,
):
    """EAGLE-3 / FSPAD-3: the training-time test, ``sum_i decay^i * CE_i`` over ``drafter.ttt_steps`` steps.

    Step 0: position t reads the fused target states at t and ``x_{t+1}`` (causal attention) and
    predicts ``x_{t+2}``. Step i: position t reads step i-1's fed-back hidden at t and ``x_{t+1+i}``
    (rotary position t + i) and predicts ``x_{t+2+i}``, attending causally to step 0's keys plus only
    its own position's keys of steps 1..i (:func:`ttt_mask`): the chain the runtime drafts, one step
    per depth. ``CE_i`` is the soft cross-entropy to the target's distribution restricted to the draft
    vocabulary, at positions whose label is an assistant token and whose target argmax is drafted.
    The teacher's full-vocabulary logits (no gradient) are made only where they teach a supervised
    token, ``teacher_chunk_rows`` rows at a time.

    Two objectives found after EAGLE-3, both off by default:

    * ``topk_distill`` K > 0: HASS's harmonized objective distillation (Zhang et al., ICLR 2025). Each
      step adds ``topk_weight * TopK_i``, ``TopK_i = -sum_{k in top-K of p} p_k log q_k``: the CE_i sum
      over only the teacher's K most likely draft tokens, ``p`` not renormalized (HASS's
      ``compute_loss``; its default weight 1.0, K 10; its script adds it in a fine-tuning stage after
      training without it). A draft tree holds the drafter's few best tokens and verification accepts
      only the target's likeliest ones, so HASS weighs ranking those right over fitting the tail of
      ``p``, which a one-layer drafter spends capacity on. K = the draft vocabulary makes TopK_i = CE_i.
    * ``align_mask``: GRIFFIN's token-alignment loss masking (Hu et al., 2025). Step i >= 1 feeds the
      drafter the data tokens ``x_{t+2..t+1+i}``, but at serve time a chain reaches depth i only through
      tokens the drafter proposed; so position t trains step i only if at every step j < i the
      drafter's ``align_topk`` best columns (GRIFFIN's ``--topk_train``, 3: the tree's branches; 1 is
      a top-1 chain) held the token step j + 1 reads, ``x_{t+2+j}``. A step j without a label there
      (the chain would cross a prompt token) breaks the chain too. Step 0 is never masked, and each
      step's CE is the mean over the positions it keeps, as in GRIFFIN. GRIFFIN masks only in its
      later stages, each started from the previous stage's drafter (``train.init_from``): an
      untrained drafter proposes almost nothing right, so from scratch the deeper steps get next
      to no positions, each weighing the whole step's mean.
    * ``answer_start_weight`` w != 1: a position whose label is among the first ``ANSWER_START_TOKENS``
      tokens of its answer weighs w in each step's mean (CE and TopK), the rest 1. An answer's start reads
      the least context and is where a short decode spends its rounds (``sim/answer_start_tau``).

    Metrics: ``loss/step{i}`` (CE_i over the positions step i trains), ``acc/step{i+1}`` (top-1
    agreement with the target's argmax over its whole vocabulary at every labelled position, a token
    outside the draft vocabulary a miss; the masks above change no metric but ``loss/*``) and
    ``sim/accept_length`` = ``1 + sum_k prod_{j<=k} acc_j``, the top-1 chain length they imply;
    ``sim/answer_start_accept_length``, the same over the first ``ANSWER_START_TOKENS`` tokens of every
    answer only (what a bench of that many new tokens per turn decodes: the hardest stretch of an
    answer, where the whole-answer figure, lifted by long predictable answers, overstates the runtime's
    τ), and ``sim/answer_start_tau``, :func:`walked_tau` of those tokens (what a 64-token bench with a
    chain of ``ttt_steps`` drafts measures); with ``topk_distill``, ``loss/topk{i}``; with ``align_mask``,
    ``align/step{i}``, the share of labelled positions step i trains."""
    if align_mask and align_topk < 1:
        raise RecipeError(f"loss.align_topk must be >= 1 with loss.align_mask, got {align_topk}")
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the drafter; compute goes through model()
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    needed = _shift_left(supervised, 1)  # f_s teaches x_{s+1}: needed where that is an assistant token
    teacher = _draft_vocab_teacher(frozen, core, batch, needed, teacher_chunk_rows)
    drafted = needed & core.t2d[teacher.argmax]  # (B, T): the target's argmax at f_s is in the draft vocabulary
    total, metrics, accuracies = 0.0, {}, []
    labels = [_shift_left(supervised, 2 + step) for step in range(core.config.ttt_steps)]  # x_{t+2+i} supervised
    read = read_rows(labels) if core.feeds_back else labels
    steps = ttt_unroll(model, frozen, batch.input_ids, batch.attention_mask, batch.drafter_states.float(), read=read)
    on_chain = torch.ones_like(supervised)  # (B, T): the drafter proposed every token step i at t has read
    answer_start, start_accuracies, hit_grids = answer_starts(supervised, ANSWER_START_TOKENS), [], []
    for step, out in enumerate(steps):
        labelled = labels[step]
        # the head only where a label is: its logits over the draft vocabulary are the step's largest tensor
        logits = core.logits(out.token_features[labelled])
        taught_at = labelled & _shift_left(drafted, 1 + step)  # (B, T): the positions this step's CE teaches
        if align_mask:
            taught_at = taught_at & on_chain
            if labelled.any():
                metrics[f"align/step{step}"] = float(on_chain[labelled].float().mean())
            on_chain = on_chain & _proposed_next_input(core, logits, labelled, batch.input_ids, step, align_topk)
        # the taught rows of the logits and their teachers go by index: a gathered copy is as large as the logits
        taught, teachers = taught_at[labelled].nonzero().squeeze(1), teacher.rows(taught_at, 1 + step)
        ce, topk_ce = soft_cross_entropies(logits, teacher.logits, topk_distill, taught, teachers)
        weights = _row_weights(_shift_left(answer_start, 2 + step)[taught_at], answer_start_weight)
        # a weighted mean; the floor only keeps a step without rows at 0 (weights below 1 may sum under 1)
        rows = weights.sum().clamp_min(torch.finfo(torch.float32).tiny)
        step_loss = (ce * weights).sum() / rows
        metrics[f"loss/step{step}"] = float(step_loss.detach())
        if topk_ce is not None:
            topk_loss = (topk_ce * weights).sum() / rows
            metrics[f"loss/topk{step}"] = float(topk_loss.detach())
            step_loss = step_loss + topk_weight * topk_loss
        total = total + decay**step * step_loss
        if labelled.any():
            hits = core.token_ids(logits.detach().argmax(-1)) == _shift_left(teacher.argmax, 1 + step)[labelled]
            accuracies.append(float(hits.float().mean()))
            hit_grids.append(torch.zeros_like(supervised).masked_scatter(labelled, hits))
            metrics[f"acc/step{step + 1}"] = accuracies[-1]
            early = _shift_left(answer_start, 2 + step)[labelled]  # the token step i predicts is x_{t+2+i}
            if early.any():
                start_accuracies.append(float(hits[early].float().mean()))
    if accuracies:
        metrics["sim/accept_length"] = chain_length(accuracies)
    if start_accuracies and len(start_accuracies) == len(accuracies):
        metrics["sim/answer_start_accept_length"] = chain_length(start_accuracies)
    if len(hit_grids) == core.config.ttt_steps and answer_start.any():
        metrics["sim/answer_start_tau"] = walked_tau(hit_grids, answer_start)
    return LossOutput(total, metrics)


def _row_weights(early: torch.Tensor, weight: float) -> torch.Tensor:
    """(N,) float32: ``weight`` where ``early`` (a label among its answer's first tokens), else 1."""
    return torch.where(early, weight, 1.0).float()


def walked_tau(hits: list[torch.Tensor], windows: torch.Tensor) -> float:
    """The τ a runtime drafting top-1 chains of ``len(hits)`` tokens measures decoding each window.

    ``hits[i][b, t]``: draft step i at position t (reading the target's states at t and ``x_{t+1}``)
    proposes ``x_{t+2+i}``. ``windows`` (B, T) marks the tokens decoded (each answer's first
    ``ANSWER_START_TOKENS``). Walked as the runtime decodes: the prompt's forward makes a window's first
    token; each round after the last token ``x_p`` drafts from ``t = p - 1``, accepts its leading hits
    and adds the target's own next token. τ = tokens / target forwards, the prompt's included, as
    ``bench`` counts. A round starts right after the drafter missed, where its next guesses are
    harder than average, so this sits below the chain length of the per-step accuracies over every
    position (``sim/answer_start_accept_length``)."""
    grids, tokens, forwards = [grid.tolist() for grid in hits], 0, 0
    for row, marks in enumerate(windows.tolist()):
        start = 0
        while start < len(marks):
            if not marks[start]:
                start += 1
                continue
            end = start
            while end < len(marks) and marks[end]:
                end += 1
            tokens, forwards, last = tokens + end - start, forwards + 1, start
            while last + 1 < end:
                accepted = 0
                while last > 0 and accepted < len(grids) and grids[accepted][row][last - 1]:
                    accepted += 1
                last, forwards = last + accepted + 1, forwards + 1
            start = end
    return tokens / forwards


def answer_starts(supervised: torch.Tensor, tokens: int) -> torch.Tensor:
    """(B, T) bool: the first ``tokens`` positions of every run of supervised positions (each answer)."""
    index = torch.arange(supervised.shape[1], device=supervised.device).expand_as(supervised)
    previous = torch.cat([torch.zeros_like(supervised[:, :1]), supervised[:, :-1]], dim=1)
    starts = torch.where(supervised & ~previous, index, torch.full_like(index, -1))
    return supervised & (index - starts.cummax(dim=1).values < tokens)


@torch.no_grad()
def _proposed_next_input(
    core, logits: torch.Tensor, labelled: torch.Tensor, input_ids: torch.Tensor, step: int, top_k: int
) -> torch.Tensor:
    """(B, T) bool: at the ``labelled`` positions, whether the drafter's ``top_k`` best draft columns at
    this step (``logits``, one row per labelled position) hold ``x_{t+2+step}``, the token the next
    step reads there; False elsewhere (no label: nothing says the chain would go on)."""
    best = core.token_ids(logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices)
    proposed = torch.zeros_like(labelled)
    proposed[labelled] = (best == _shift_left(input_ids, 2 + step)[labelled][:, None]).any(-1)
    return proposed


def peagle_loss(model, batch: TrainBatch, frozen: FrozenTarget, decay: float = 1.0, teacher_chunk_rows: int = 1024):
    """P-EAGLE: :func:`eagle3_loss` over ``drafter.ttt_steps`` depths, the depths after the first reading
    the drafter's placeholders (``PEagleModel.ttt_step_inputs``) rather than the previous depth's token
    and hidden: depth i at position t, rotary position t + i, predicts ``x_{t+2+i}``, supervised by the
    target's distribution over the draft vocabulary where that token is an assistant token. The depths
    weigh alike by default (``decay`` 1, as the paper's per-depth mean); the metrics are EAGLE-3's, and
    ``sim/accept_length`` is the top-1 chain's length, what one forward per round drafts."""
    return eagle3_loss(model, batch, frozen, decay=decay, teacher_chunk_rows=teacher_chunk_rows)


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
    teacher = _draft_vocab_teacher(frozen, core, batch, needed, teacher_chunk_rows)
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
    valid = supervised & _shift_left(supervised, 1)
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


def ttt_unroll(
    model,
    frozen: FrozenTarget,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    states,
    read: list[torch.Tensor] | None = None,
):
    """The training-time test's steps, each a ``DrafterOutput`` over all positions (see :func:`eagle3_loss`):
    step 0 reads the target ``states`` (B, T, layers x h), step i what the drafter's
    ``ttt_step_inputs`` names (EAGLE-3: the hidden step i-1 fed back and ``x_{t+1+i}``; P-EAGLE: its
    placeholders), at rotary position t + i; their keys accumulate in one KV cache, masked by
    :func:`ttt_mask`. ``read[i]`` (B, T) bool: the positions of step i whose outputs are read
    (:func:`read_rows`); the MLP runs there only. None: everywhere."""
    core = getattr(model, "module", model)
    width = input_ids.shape[1]
    key_padding = _shift_left(attention_mask, 1)  # position s reads x_{s+1}: real when x_{s+1} is
    cache, hidden = DynamicCache(), states
    for step in range(core.config.ttt_steps):
        tokens = frozen.embed_tokens(_shift_left(input_ids, 1 + step)).to(states.dtype)
        positions = (torch.arange(width, device=input_ids.device) + step)[None].expand(input_ids.shape[0], -1)
        mask = TTTMask(key_padding, step)  # the drafters' attention skips what it hides (ttt_attention)
        rows = None if read is None else read[step]
        inputs = core.ttt_step_inputs(step, tokens, states, hidden)
        out = model(position_ids=positions, attention_mask=mask, cache=cache, rows=rows, **inputs)  # through DDP
        hidden = out.next_features
        yield out


def read_rows(labels: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per training-time-test step, the positions whose output is read: where that step or a later
    one has a label. A step-i output at position t is only ever read by later steps at t (their queries
    see step 0's keys and their own position's), so elsewhere it may be left uncomputed."""
    read, later = [], torch.zeros_like(labels[-1])
    for labelled in reversed(labels):
        later = later | labelled
        read.append(later)
    return read[::-1]


def ttt_mask(key_padding: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, T, (step + 1) T) additive mask of training-time-test step ``step`` (:class:`TTTMask`, as one
    tensor): query t sees step 0's keys at positions <= t (real ones, ``key_padding`` (B, T)) and its own
    position's key of every step 1..``step``; the key columns are the steps' keys in order, as the KV cache
    holds them."""
    return TTTMask(key_padding, step).dense(dtype)


def _shift_left(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """``tensor[:, t + shift]`` at t (zeros past the end), same shape: what position t reads ``shift`` ahead."""
    shifted = torch.zeros_like(tensor)
    if shift < tensor.shape[1]:
        shifted[:, : tensor.shape[1] - shift] = tensor[:, shift:]
    return shifted


@dataclass
class DraftVocabTeacher:
    """The target's distribution at the positions that teach a supervised token: ``logits`` (n, N) over
    the draft vocabulary, one row per needed position in row-major order, ``row`` (B, T) the row of each
    position (-1 where not needed), and ``argmax`` (B, T) its top token over the whole vocabulary (0
    where not needed). Compact because a dense (B, T, N) tensor would be the step's largest."""

    logits: torch.Tensor
    row: torch.Tensor
    argmax: torch.Tensor

    def rows(self, where: torch.Tensor, shift: int) -> torch.Tensor:
        """The indices of the logits rows read ``shift`` positions ahead of each True position of ``where``
        (B, T)."""
        return _shift_left(self.row, shift)[where]


@torch.no_grad()
def _draft_vocab_teacher(
    frozen: FrozenTarget, core, batch: TrainBatch, needed: torch.Tensor, chunk_rows: int
) -> DraftVocabTeacher:
    """The teacher at the ``needed`` (B, T) positions only: ``chunk_rows`` rows of full-vocabulary
    logits at a time (0 = all at once). Where the batch carries the target's greedy tokens (a feature
    cache keeps them), only the draft vocabulary's columns are computed."""
    features = batch.hidden_states.float()
    rows = features[needed]
    vocab = core.draft_token_ids()
    size = chunk_rows if chunk_rows > 0 else max(rows.shape[0], 1)
    parts, tops = [features.new_zeros(0, vocab.numel())], [torch.zeros(0, dtype=torch.long, device=features.device)]
    whole = vocab.numel() == frozen.lm_head.weight.shape[0]  # ascending ids: every token, so no rows to gather
    head = DraftHead(frozen.lm_head, vocab[:0] if whole else vocab) if batch.target_argmax is not None else None
    for start in range(0, rows.shape[0], size):
        if head is not None:
            parts.append(head(rows[start : start + size]).float())
            continue
        logits = frozen.lm_head(rows[start : start + size]).float()
        parts.append(logits[:, vocab])
        tops.append(logits.argmax(-1))
    row = torch.full(needed.shape, -1, dtype=torch.long, device=features.device)
    row[needed] = torch.arange(rows.shape[0], device=features.device)
    argmax = torch.zeros(needed.shape, dtype=torch.long, device=features.device)
    argmax[needed] = torch.cat(tops) if head is None else batch.target_argmax[needed]
    return DraftVocabTeacher(torch.cat(parts), row, argmax)


def medusa_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    decay: float = 0.8,
    soft_labels: bool = False,
) -> LossOutput:
    """Medusa-1: ``sum_k decay^k * CE_k`` (k = 1..K) over assistant tokens, the target frozen.

    Head k at position t reads ``f_t`` and is supervised on ``x_{t+k+1}`` where that token is an
    assistant token (hard labels), or on the target's own distribution for it,
    ``softmax(lm_head(f_{t+k}))`` (``soft_labels``: self-distillation; needs no regenerated data).
    With a draft vocabulary, hard labels outside it are left out of the CE (a head cannot name them)
    and soft labels are the target's distribution restricted to it.

    Metrics: ``acc/head{k}`` = top-1 agreement with ``x_{t+k+1}`` (a token outside the draft vocabulary
    counts as a miss), and ``sim/accept_length`` = 1 + the mean number of leading heads that are all
    right at a position: the acceptance length of a top-1 chain on this data."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the heads; compute still goes through model()
    features = batch.hidden_states.float()
    rows = _medusa_head_rows(batch, int(core.config.num_heads))
    logits = model([features[:, : mask.shape[1]][mask] for mask in rows])  # head k: (N_k, V')
    return LossOutput(*_medusa_heads_ce(core, batch, features, rows, logits, frozen, decay, soft_labels))


def _medusa_head_rows(batch: TrainBatch, heads: int) -> list[torch.Tensor]:
    """Head k (1-based) at t predicts ``x_{t+k+1}``, so it has a label for t < T - k - 1: ``rows[k - 1]``
    (B, span_k = max(T - k - 1, 0)) says where that label is an assistant token. Head k reads the
    features ``features[:, :span_k][rows[k - 1]]``."""
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    return [supervised[:, k + 1 :] for k in range(1, heads + 1)]


def _medusa_heads_ce(
    core, batch: TrainBatch, features: torch.Tensor, rows: list[torch.Tensor], logits, frozen, decay, soft_labels
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum_k decay^k * CE_k`` and its metrics (see :func:`medusa_loss`) from each head's logits at its
    rows; ``core`` is the ``MedusaHeads``, ``features`` (B, T, h) float what they read."""
    vocab_index = core.vocab_index(core.config.vocab_size)

    def head_ce(k: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head_logits, labels = logits[k - 1], batch.input_ids[:, k + 1 :][mask]
        columns = labels if vocab_index is None else vocab_index[labels]
        if soft_labels:
            ce = _medusa_soft_ce(head_logits, features[:, k : k + mask.shape[1]][mask], frozen, core)
        else:
            known = columns >= 0
            ce = F.cross_entropy(head_logits[known], columns[known]) if known.any() else head_logits.sum() * 0.0
        return ce, head_logits.detach().argmax(-1) == columns

    ces, metrics = _per_offset_ce(batch, len(rows), head_ce, "head")
    return sum(decay**k * ce for k, ce in enumerate(ces, start=1)), metrics


def _per_offset_ce(
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


def _medusa_soft_ce(head_logits: torch.Tensor, teacher_features: torch.Tensor, frozen: FrozenTarget, core):
    """CE against the target's distribution at the label position (over the draft vocabulary if any)."""
    if head_logits.shape[0] == 0:
        return head_logits.sum() * 0.0
    with torch.no_grad():
        teacher = DraftHead(frozen.lm_head, core.draft_vocab)(teacher_features)
    return soft_cross_entropy(head_logits, teacher).mean()  # it reads both in float32, a few rows at a time


def medusa2_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    kl_weight: float = 1.0,
    head_weight: float = 0.2,
    decay: float = 0.8,
    soft_labels: bool = False,
    logit_chunk_rows: int = 1024,
) -> LossOutput:
    """Medusa-2: ``kl_weight * KL(original || adapted) + head_weight * sum_k decay^k * CE_k``.

    The LoRA-adapted target and the heads train together: the heads read the adapted model's features,
    so their CE also trains the LoRA. The KL is self-distillation against the same target with the
    adapters off, at the positions whose next token is an assistant token; with self-distilled data
    (the target's own answers) it is what keeps the served model's quality. The heads are supervised
    as in :func:`medusa_loss`; ``soft_labels`` takes the adapted model's distribution (the one
    verification compares against) as their teacher. The KL's full-vocabulary logits (adapted and
    original) are made ``logit_chunk_rows`` rows at a time (see :func:`_chunked_terms`).

    Metrics: :func:`medusa_loss`'s, plus ``loss/kl``, ``loss/heads`` and ``agree/original`` (how often
    the adapted model's argmax is the original's at those positions)."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the model; compute still goes through model()
    rows = _medusa_head_rows(batch, int(core.config.num_heads))
    out = model(batch.input_ids, attention_mask=batch.attention_mask, head_rows=rows, logits=False)
    features = out.features.float()
    heads, metrics = _medusa_heads_ce(core.heads, batch, features, rows, out.head_logits, frozen, decay, soft_labels)
    predicting = (batch.loss_mask * batch.attention_mask).bool()[:, 1:]  # x_{t+1} is an assistant token
    terms = _next_token_terms(core, out, batch.input_ids, predicting, logit_chunk_rows)
    metrics.update({**_distillation_metrics(terms), "loss/heads": float(heads.detach())})
    return LossOutput(kl_weight * terms.kl + head_weight * heads, metrics)


def _next_token_terms(
    core, out: Any, input_ids: torch.Tensor, predicting: torch.Tensor, chunk_rows: int
) -> ChunkedTerms:
    """The LoRA families' next-token terms at the positions t where ``predicting`` (B, T - 1) says
    ``x_{t+1}`` is supervised: the adapted model's CE against ``x_{t+1}`` and, when the forward ran
    the original (``out.original_features``), KL(original || adapted), the guard on the served model.
    Both from last features through the target's ``lm_head``, ``chunk_rows`` rows at a time."""
    teacher = out.original_features
    return _chunked_terms(
        out.features[:, :-1][predicting],
        input_ids[:, 1:][predicting],
        core.next_token_logits,
        chunk_rows,
        None if teacher is None else teacher[:, :-1][predicting],
    )


def _distillation_metrics(terms: ChunkedTerms) -> dict[str, float]:
    """``loss/kl`` and ``agree/original``: how often the adapted model's argmax is the original's."""
    metrics = {"loss/kl": float(terms.kl.detach())}
    if terms.agrees.numel():
        metrics["agree/original"] = float(terms.agrees.float().mean())
    return metrics


def streaming_loss(
    model,
    batch: TrainBatch,
    frozen: FrozenTarget,
    main_weight: float = 1.0,
    stream_weight: float = 0.1,
    pruning_weight: float = 1.0,
    kl_weight: float = 1.0,
    logit_chunk_rows: int = 1024,
) -> LossOutput:
    """Speculative Streaming: ``main_weight * CE(x_{t+1}) + stream_weight * sum_j CE_j(x_{t+j+1})``,
    plus ``kl_weight * KL(original || adapted)`` (default 1.0, as Medusa-2's) and, when the model has a
    tree-pruning adapter, ``pruning_weight * CE_prune(x_{t+1})``.

    The main stream at t predicts ``x_{t+1}``, stream j (1..γ) at t predicts ``x_{t+j+1}``, and so
    does the adapter's early exit at t ``x_{t+1}`` (its input is detached: that term trains the
    adapter alone); a term counts where its label is an assistant token. The KL is self-distillation
    of the main stream against the same target with the adapters off (see :func:`medusa2_loss`): it
    keeps the served, adapted model close to the original; ``kl_weight`` 0 skips that extra forward.
    Every full-vocabulary logit (main, original, streams, adapter) is computed ``logit_chunk_rows`` rows
    at a time (0 = all at once; see :func:`_chunked_terms`): the same loss and gradients, without the
    (rows x (γ + 2) x V) logits in memory. ``frozen`` is unused: the model runs the target itself.

    Metrics: ``loss/main``, ``loss/stream{j}``, ``acc/stream{j}`` (top-1 against the label),
    ``loss/kl`` and ``agree/original`` (with the KL), ``loss/pruning``, ``acc/pruning`` and
    ``sim/accept_length`` = 1 + the mean number of leading streams that are all right at a position."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the model; compute still goes through model()
    out = model(batch.input_ids, attention_mask=batch.attention_mask, original=kl_weight > 0, logits=False)
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    streams = out.stream_hidden.shape[2]
    main_rows = supervised[:, 1:]
    main = _next_token_terms(core, out, batch.input_ids, main_rows, logit_chunk_rows)
    loss, metrics = main_weight * main.ce, {"loss/main": float(main.ce.detach())}
    if out.original_features is not None:
        loss = loss + kl_weight * main.kl
        metrics.update(_distillation_metrics(main))
    if out.pruning_hidden is not None:
        pruning_ce, pruning_metrics = _pruning_ce(
            core, out.pruning_hidden, batch.input_ids, main_rows, logit_chunk_rows
        )
        loss = loss + pruning_weight * pruning_ce
        metrics.update(pruning_metrics)

    def stream_ce(j: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = out.stream_hidden[:, : rows.shape[1], j - 1][rows]
        return _chunked_ce(hidden, batch.input_ids[:, j + 1 :][rows], core.next_token_logits, logit_chunk_rows)

    ces, stream_metrics = _per_offset_ce(batch, streams, stream_ce, "stream")
    metrics.update(stream_metrics)
    loss = loss + stream_weight * sum(ces)
    return LossOutput(loss, metrics)


def _pruning_ce(
    core, pruning_hidden: torch.Tensor, input_ids: torch.Tensor, rows: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """The tree-pruning adapter's next-token CE: ``lm_head(o_θ(M_t))`` against ``x_{t+1}`` at ``rows``."""
    labels = input_ids[:, 1:][rows]
    ce, hits = _chunked_ce(pruning_hidden[:, :-1][rows], labels, core.next_token_logits, chunk_rows)
    metrics = {"loss/pruning": float(ce.detach())}
    if labels.numel():
        metrics["acc/pruning"] = float(hits.float().mean())
    return ce, metrics


@dataclass
class ChunkedTerms:
    ce: torch.Tensor  # mean CE against the labels (with a graph)
    kl: torch.Tensor  # mean KL(teacher || student) over the rows; 0 without a teacher
    hits: torch.Tensor  # (N,) bool: the student's argmax is the label
    agrees: torch.Tensor  # (N,) bool: the student's argmax is the teacher's; empty without a teacher


def _chunked_ce(
    hidden: torch.Tensor, labels: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean CE of ``project(hidden)`` against ``labels`` and the top-1 hits (see :func:`_chunked_terms`)."""
    terms = _chunked_terms(hidden, labels, project, chunk_rows)
    return terms.ce, terms.hits


def _chunked_terms(
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
    """One chunk's CE sum, KL sum, hits and agreements (see :func:`_chunked_terms`)."""
    student = project(hidden).float().log_softmax(-1)
    ce_sum = F.nll_loss(student, labels, reduction="sum")
    picked = student.detach().argmax(-1)
    if teacher_hidden is None:
        return ce_sum, ce_sum.new_zeros(()), picked == labels, labels.new_zeros(0, dtype=torch.bool)
    with torch.no_grad():
        teacher = project(teacher_hidden).float().log_softmax(-1)
    kl_sum = F.kl_div(student, teacher, log_target=True, reduction="sum")
    return ce_sum, kl_sum, picked == labels, picked == teacher.argmax(-1)


LossFn = Callable[..., LossOutput]  # loss(model, batch: TrainBatch, frozen: FrozenTarget, **options)


def family_loss(family: Family) -> LossFn:
    """The loss function a family names (:attr:`Family.loss`), defined in this module."""
    loss = globals().get(family.loss)
    if not callable(loss):
        raise RecipeError(f"drafter family {family.name!r} names the loss {family.loss!r}, which train/losses.py lacks")
    return loss


def loss_option_names(family: Family) -> list[str]:
    """The recipe's ``loss.*`` keys of a family: its loss function's keywords after (model, batch, frozen)."""
    return list(inspect.signature(family_loss(family)).parameters)[3:]


def check_loss_options(family: Family, options: dict[str, Any]) -> dict[str, Any]:
    """The recipe's ``loss`` section checked against the family's loss function: known keys, and each value
    of its default's kind (a weight, rate or noise a finite number >= 0; a count a whole number >= 0; a
    switch true or false), since nan passes every ``<=`` test and would train on a nan loss. Returns the
    values as numbers (YAML 1.1 reads ``5e-5`` as text)."""
    check_keys("loss", options, loss_option_names(family))
    parameters = list(inspect.signature(family_loss(family)).parameters.values())[3:]
    defaults = {parameter.name: parameter.default for parameter in parameters}
    return {key: _loss_value(f"loss.{key}", value, defaults[key]) for key, value in options.items()}


def _loss_value(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise RecipeError(f"{key} must be true or false, got {value!r}")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RecipeError(f"{key} must be a whole number >= 0, got {value!r}")
        return value
    if not isinstance(default, float):
        return value
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None or not math.isfinite(number) or number < 0:
        raise RecipeError(f"{key} must be a finite number >= 0, got {value!r}")
    return number
