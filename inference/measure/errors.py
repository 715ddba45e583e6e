"""Errors of the measuring commands that several of their modules raise."""

from __future__ import annotations

from draftsmith.core.errors import DraftsmithError


class BenchError(DraftsmithError, ValueError):
    """A question file or option that cannot be benchmarked."""
