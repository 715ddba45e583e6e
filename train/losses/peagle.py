"""P-EAGLE: EAGLE-3's loss over depths drafted in one forward."""

from __future__ import annotations

from draftsmith.drafters.base import FrozenTarget
from draftsmith.train.batch import TrainBatch
from draftsmith.train.losses.eagle3 import eagle3_loss


def peagle_loss(model, batch: TrainBatch, frozen: FrozenTarget, decay: float = 1.0, teacher_chunk_rows: int = 1024):
    """P-EAGLE: :func:`eagle3_loss` over ``drafter.ttt_steps`` depths, the depths after the first reading
    the drafter's placeholders (``PEagleModel.ttt_step_inputs``) rather than the previous depth's token
    and hidden: depth i at position t, rotary position t + i, predicts ``x_{t+2+i}``, supervised by the
    target's distribution over the draft vocabulary where that token is an assistant token. The depths
    weigh alike by default (``decay`` 1, as the paper's per-depth mean); the metrics are EAGLE-3's, and
    ``sim/accept_length`` is the top-1 chain's length, what one forward per round drafts."""
    return eagle3_loss(model, batch, frozen, decay=decay, teacher_chunk_rows=teacher_chunk_rows)
