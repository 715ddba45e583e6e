"""The target's context window: a prompt that cannot fit is refused in one line before decoding.

Past ``max_position_embeddings`` the runtime can no longer speculate (and the target itself was never
trained there), so a prompt whose tokens plus ``--max-new-tokens`` exceed it used to run with
speculation silently switched off; now it is a user error naming both numbers and the fix.
"""

from __future__ import annotations

from typing import Any

from draftsmith.core.errors import DraftsmithError


class ContextLengthError(DraftsmithError, ValueError):
    """A prompt that, with the tokens asked for, does not fit the target's context window."""


def context_limit(model: Any) -> int | None:
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_fits_context(model: Any, prompt_tokens: int, max_new_tokens: int, what: str = "the prompt") -> None:
    """Refuse ``what`` when it has no token (decoding continues from the last one) or when its
    ``prompt_tokens`` plus ``max_new_tokens`` exceed the model's context."""
    if prompt_tokens == 0:
        raise ContextLengthError(f"{what} is empty, so there is no token to continue from; give some text")
    limit = context_limit(model)
    if limit is None or prompt_tokens + max_new_tokens <= limit:
        return
    if prompt_tokens >= limit:
        raise ContextLengthError(
            f"{what} is {prompt_tokens:,} tokens but the target's context is {limit:,}; shorten it"
        )
    raise ContextLengthError(
        f"{what} ({prompt_tokens:,} tokens) plus --max-new-tokens {max_new_tokens} exceeds the target's context of "
        f"{limit:,} tokens; shorten it or pass --max-new-tokens {limit - prompt_tokens} or less"
    )
