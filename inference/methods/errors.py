"""Errors of the decoding side that several of its modules raise."""

from __future__ import annotations

from draftsmith.core.errors import DraftsmithError


class MethodError(DraftsmithError, ValueError):
    """An unknown method name or a bad method argument."""
