"""Number types for ``argparse``: a bad value is refused while the command line is parsed, before any
file is read or any model is loaded, with the option's allowed range in the message."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` ``type=`` that accepts integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in its own messages
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
