"""The training-time test: the drafter unrolled over its draft steps, as it drafts at decode time."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.ttt_attention import TTTMask
from draftsmith.train.losses.offsets import shift_left


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
    key_padding = shift_left(attention_mask, 1)  # position s reads x_{s+1}: real when x_{s+1} is
    cache, hidden = DynamicCache(), states
    for step in range(core.config.ttt_steps):
        tokens = frozen.embed_tokens(shift_left(input_ids, 1 + step)).to(states.dtype)
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
