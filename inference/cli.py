"""``draftsmith generate`` and ``draftsmith bench``."""

from __future__ import annotations

import argparse
from typing import Any

PENDING = {
    "generate": "decode with a drafter, streaming tokens",
    "bench": "benchmark drafters against plain decoding on Spec-Bench-format questions",
}


def _pending(name: str):
    def run(_args: argparse.Namespace) -> None:
        raise SystemExit(f"draftsmith {name}: not implemented yet; it arrives with the tree-decoding runtime issue")
    return run


def add_inference_commands(subparsers: Any) -> None:
    for name, help_text in PENDING.items():
        subparsers.add_parser(name, help=f"{help_text} (not implemented yet)").set_defaults(func=_pending(name))
