"""Speculative Streaming: the main stream, the future streams and the tree-pruning adapter."""

from __future__ import annotations

import torch

from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.streaming import StreamingPass
from draftsmith.train.batch import LossOutput, TrainBatch
from draftsmith.train.losses.chunked import chunked_ce, distillation_metrics, next_token_terms
from draftsmith.train.losses.offsets import per_offset_ce


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
    at a time (0 = all at once; see :func:`chunked_terms`): the same loss and gradients, without the
    (rows x (γ + 2) x V) logits in memory. ``frozen`` is unused: the model runs the target itself.

    Metrics: ``loss/main``, ``loss/stream{j}``, ``acc/stream{j}`` (top-1 against the label),
    ``loss/kl`` and ``agree/original`` (with the KL), ``loss/pruning``, ``acc/pruning`` and
    ``sim/accept_length`` = 1 + the mean number of leading streams that are all right at a position."""
    core = getattr(model, "module", model)  # DDP / DeepSpeed wrap the model; compute still goes through model()
    mode = StreamingPass(original=kl_weight > 0, logits=False)
    out = model(batch.input_ids, attention_mask=batch.attention_mask, mode=mode)
    supervised = (batch.loss_mask * batch.attention_mask).bool()
    streams = out.stream_hidden.shape[2]
    main_rows = supervised[:, 1:]
    main = next_token_terms(core, out, batch.input_ids, main_rows, logit_chunk_rows)
    loss, metrics = main_weight * main.ce, {"loss/main": float(main.ce.detach())}
    if out.original_features is not None:
        loss = loss + kl_weight * main.kl
        metrics.update(distillation_metrics(main))
    if out.pruning_hidden is not None:
        pruning_ce, pruning_metrics = _pruning_ce(
            core, out.pruning_hidden, batch.input_ids, main_rows, logit_chunk_rows
        )
        loss = loss + pruning_weight * pruning_ce
        metrics.update(pruning_metrics)

    def stream_ce(j: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = out.stream_hidden[:, : rows.shape[1], j - 1][rows]
        return chunked_ce(hidden, batch.input_ids[:, j + 1 :][rows], core.next_token_logits, logit_chunk_rows)

    ces, stream_metrics = per_offset_ce(batch, streams, stream_ce, "stream")
    metrics.update(stream_metrics)
    loss = loss + stream_weight * sum(ces)
    return LossOutput(loss, metrics)


def _pruning_ce(
    core, pruning_hidden: torch.Tensor, input_ids: torch.Tensor, rows: torch.Tensor, chunk_rows: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """The tree-pruning adapter's next-token CE: ``lm_head(o_θ(M_t))`` against ``x_{t+1}`` at ``rows``."""
    labels = input_ids[:, 1:][rows]
    ce, hits = chunked_ce(pruning_hidden[:, :-1][rows], labels, core.next_token_logits, chunk_rows)
    metrics = {"loss/pruning": float(ce.detach())}
    if labels.numel():
        metrics["acc/pruning"] = float(hits.float().mean())
    return ce, metrics
