"""EAGLE-3 / FSPAD-3: the training-time test's per-step cross-entropy, and the objectives found after it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.drafters.base import FrozenTarget
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.losses.offsets import chain_length, shift_left
from draftsmith.train.losses.options import Loss
from draftsmith.train.losses.teacher import draft_vocab_teacher
from draftsmith.train.losses.ttt import read_rows, ttt_unroll
from draftsmith.train.recipe_loader import RecipeError
from draftsmith.train.soft_cross_entropy import soft_cross_entropies

# the new tokens per turn of the project's benches (`bench --max-new-tokens 64`)
ANSWER_START_TOKENS = 64


@dataclass(frozen=True)
class Eagle3LossOptions:
    """The recipe's ``loss`` section of EAGLE-3 and FSPAD-3 (see :func:`eagle3_step_losses`)."""

    decay: float = 0.8
    teacher_chunk_rows: int = 1024
    topk_distill: int = 0
    topk_weight: float = 1.0
    align_mask: bool = False
    align_topk: int = 3
    answer_start_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.align_mask and self.align_topk < 1:
            raise RecipeError(f"loss.align_topk must be >= 1 with loss.align_mask, got {self.align_topk}")


def eagle3_step_losses(model, batch: TrainBatch, frozen: FrozenTarget, options: Eagle3LossOptions) -> LossOutput:
    """EAGLE-3 / FSPAD-3: the training-time test, ``sum_i decay^i * CE_i`` over ``drafter.ttt_steps`` steps.

    Step 0: position t reads the fused target states at t and ``x_{t+1}`` (causal attention) and
    predicts ``x_{t+2}``. Step i: position t reads step i-1's fed-back hidden at t and ``x_{t+1+i}``
    (rotary position t + i) and predicts ``x_{t+2+i}``, attending causally to step 0's keys plus only
    its own position's keys of steps 1..i (:func:`~draftsmith.train.losses.ttt.ttt_mask`): the chain the
    runtime drafts, one step per depth. ``CE_i`` is the soft cross-entropy to the target's distribution
    restricted to the draft vocabulary, at positions whose label is an assistant token and whose target
    argmax is drafted. The teacher's full-vocabulary logits (no gradient) are made only where they teach
    a supervised token, ``teacher_chunk_rows`` rows at a time.

    Three objectives found after EAGLE-3, each a small term of its own and off by default:
    :class:`TopKDistill` (HASS, ``topk_distill``, ``topk_weight``), :class:`AlignMask` (GRIFFIN,
    ``align_mask``, ``align_topk``) and :class:`AnswerStartWeight` (``answer_start_weight``).

    Metrics: ``loss/step{i}`` (CE_i over the positions step i trains) and :class:`ChainMetrics`' (the
    masks above change no metric but ``loss/*``); with ``topk_distill``, ``loss/topk{i}``; with
    ``align_mask``, ``align/step{i}``, the share of labelled positions step i trains."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the drafter; compute goes through model()
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    needed = shift_left(supervised, 1)  # f_s teaches x_{s+1}: needed where that is an assistant token
    teacher = draft_vocab_teacher(frozen, core, batch, needed, options.teacher_chunk_rows)
    drafted = needed & core.t2d[teacher.argmax]  # (B, T): the target's argmax at f_s is in the draft vocabulary
    labels = [shift_left(supervised, 2 + step) for step in range(core.config.ttt_steps)]  # x_{t+2+i} supervised
    read = read_rows(labels) if core.feeds_back else labels
    steps = ttt_unroll(model, frozen, batch.input_ids, batch.attention_mask, batch.drafter_states.float(), read=read)
    answer_start = answer_starts(supervised, ANSWER_START_TOKENS)
    align = AlignMask(options.align_topk, batch.input_ids, supervised) if options.align_mask else None
    topk = TopKDistill(options.topk_distill, options.topk_weight)
    weigh = AnswerStartWeight(options.answer_start_weight, answer_start)
    chain = ChainMetrics(supervised, answer_start, teacher.argmax)
    total, metrics = 0.0, {}
    for step, out in enumerate(steps):
        labelled = labels[step]
        # the head only where a label is: its logits over the draft vocabulary are the step's largest tensor
        logits = core.logits(out.token_features[labelled])
        taught_at = labelled & shift_left(drafted, 1 + step)  # (B, T): the positions this step's CE teaches
        if align is not None:
            taught_at = taught_at & align.keep(core, logits, labelled, step, metrics)
        # the taught rows of the logits and their teachers go by index: a gathered copy is as large as the logits
        taught, teachers = taught_at[labelled].nonzero().squeeze(1), teacher.rows(taught_at, 1 + step)
        ce, topk_ce = soft_cross_entropies(logits, teacher.logits, topk.k, taught, teachers)
        weights = weigh.rows(taught_at, step)
        step_loss = weighted_mean(ce, weights)
        metrics[f"loss/step{step}"] = float(step_loss.detach())
        if topk_ce is not None:
            step_loss = step_loss + topk.term(topk_ce, weights, step, metrics)
        total = total + options.decay**step * step_loss
        chain.observe(core, logits, labelled, step)
    return LossOutput(total, {**metrics, **chain.metrics(core.config.ttt_steps)})


def weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(values * weights) / sum(weights)``; the floor only keeps a step without rows at 0 (weights
    below 1 may sum under 1)."""
    return (values * weights).sum() / weights.sum().clamp_min(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class TopKDistill:
    """HASS's harmonized objective distillation (Zhang et al., ICLR 2025): with ``k`` > 0 each step adds
    ``weight * TopK_i``, ``TopK_i = -sum_{k in top-K of p} p_k log q_k``: the CE_i sum over only the
    teacher's K most likely draft tokens, ``p`` not renormalized (HASS's ``compute_loss``; its default
    weight 1.0, K 10; its script adds it in a fine-tuning stage after training without it). A draft tree
    holds the drafter's few best tokens and verification accepts only the target's likeliest ones, so HASS
    weighs ranking those right over fitting the tail of ``p``, which a one-layer drafter spends capacity
    on. K = the draft vocabulary makes TopK_i = CE_i. The CE's own pass computes it (``k`` columns)."""

    k: int
    weight: float

    def term(self, topk_ce: torch.Tensor, weights: torch.Tensor, step: int, metrics: dict[str, float]) -> torch.Tensor:
        """``weight * TopK_i`` as the step's weighted mean; logs ``loss/topk{i}``."""
        loss = weighted_mean(topk_ce, weights)
        metrics[f"loss/topk{step}"] = float(loss.detach())
        return self.weight * loss


class AlignMask:
    """GRIFFIN's token-alignment loss masking (Hu et al., 2025). Step i >= 1 feeds the drafter the data
    tokens ``x_{t+2..t+1+i}``, but at serve time a chain reaches depth i only through tokens the drafter
    proposed; so position t trains step i only if at every step j < i the drafter's ``top_k`` best columns
    (GRIFFIN's ``--topk_train``, 3: the tree's branches; 1 is a top-1 chain) held the token step j + 1
    reads, ``x_{t+2+j}``. A step j without a label there (the chain would cross a prompt token) breaks the
    chain too. Step 0 is never masked, and each step's CE is the mean over the positions it keeps, as in
    GRIFFIN. GRIFFIN masks only in its later stages, each started from the previous stage's drafter
    (``train.init_from``): an untrained drafter proposes almost nothing right, so from scratch the deeper
    steps get next to no positions, each weighing the whole step's mean."""

    def __init__(self, top_k: int, input_ids: torch.Tensor, supervised: torch.Tensor) -> None:
        self.top_k, self.input_ids = top_k, input_ids
        self.on_chain = torch.ones_like(supervised)  # (B, T): the drafter proposed every token step i at t read

    def keep(self, core, logits: torch.Tensor, labelled: torch.Tensor, step: int, metrics: dict[str, float]):
        """(B, T) bool: the positions step ``step`` may train; logs ``align/step{i}``, their share of the
        labelled ones, and narrows the chain for the next step by this step's proposals."""
        kept = self.on_chain
        if labelled.any():
            metrics[f"align/step{step}"] = float(kept[labelled].float().mean())
        self.on_chain = kept & _proposed_next_input(core, logits, labelled, self.input_ids, step, self.top_k)
        return kept


@dataclass(frozen=True)
class AnswerStartWeight:
    """With ``weight`` w != 1, a position whose label is among the first ``ANSWER_START_TOKENS`` tokens of
    its answer (``answer_start``, (B, T)) weighs w in each step's mean (CE and TopK), the rest 1. An
    answer's start reads the least context and is where a short decode spends its rounds
    (``sim/answer_start_tau``)."""

    weight: float
    answer_start: torch.Tensor

    def rows(self, taught_at: torch.Tensor, step: int) -> torch.Tensor:
        """(N,) float32, one per taught position of step ``step``, whose label is ``x_{t+2+step}``."""
        return _row_weights(shift_left(self.answer_start, 2 + step)[taught_at], self.weight)


class ChainMetrics:
    """The training-time test's accuracy metrics: ``acc/step{i+1}`` (top-1 agreement with the target's
    argmax over its whole vocabulary at every labelled position, a token outside the draft vocabulary a
    miss) and ``sim/accept_length`` = ``1 + sum_k prod_{j<=k} acc_j``, the top-1 chain length they imply;
    ``sim/answer_start_accept_length``, the same over the first ``ANSWER_START_TOKENS`` tokens of every
    answer only (what a bench of that many new tokens per turn decodes: the hardest stretch of an answer,
    where the whole-answer figure, lifted by long predictable answers, overstates the runtime's τ), and
    ``sim/answer_start_tau``, :func:`walked_tau` of those tokens (what a 64-token bench with a chain of
    ``ttt_steps`` drafts measures)."""

    def __init__(self, supervised: torch.Tensor, answer_start: torch.Tensor, target_argmax: torch.Tensor) -> None:
        self.supervised, self.answer_start, self.target_argmax = supervised, answer_start, target_argmax
        self.accuracies: dict[int, float] = {}  # per step with a label
        self.start_accuracies: list[float] = []
        self.hit_grids: list[torch.Tensor] = []

    def observe(self, core, logits: torch.Tensor, labelled: torch.Tensor, step: int) -> None:
        """Step ``step``'s top-1 hits at its ``labelled`` positions (its ``logits``, one row each)."""
        if not labelled.any():
            return
        hits = core.token_ids(logits.detach().argmax(-1)) == shift_left(self.target_argmax, 1 + step)[labelled]
        self.accuracies[step] = float(hits.float().mean())
        self.hit_grids.append(torch.zeros_like(self.supervised).masked_scatter(labelled, hits))
        early = shift_left(self.answer_start, 2 + step)[labelled]  # the token step i predicts is x_{t+2+i}
        if early.any():
            self.start_accuracies.append(float(hits[early].float().mean()))

    def metrics(self, steps: int) -> dict[str, float]:
        metrics = {f"acc/step{step + 1}": accuracy for step, accuracy in self.accuracies.items()}
        if self.accuracies:
            metrics["sim/accept_length"] = chain_length(list(self.accuracies.values()))
        if self.start_accuracies and len(self.start_accuracies) == len(self.accuracies):
            metrics["sim/answer_start_accept_length"] = chain_length(self.start_accuracies)
        if len(self.hit_grids) == steps and self.answer_start.any():
            metrics["sim/answer_start_tau"] = walked_tau(self.hit_grids, self.answer_start)
        return metrics


eagle3_loss = Loss(eagle3_step_losses, Eagle3LossOptions)


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
    proposed[labelled] = (best == shift_left(input_ids, 2 + step)[labelled][:, None]).any(-1)
    return proposed
