"""Number types for ``argparse``: a bad value is refused while the command line is parsed, before any
file is read or any model is loaded, with the option's allowed range in the message."""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
from collections.abc import Callable, Sequence


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


def comma_list(text: str) -> list[str]:
    """``a,b`` -> [a, b]; an entry that holds a comma itself (a folder ``a,b``) is given in double quotes,
    as in a CSV line: ``pld,"fspad=runs/a,b/drafter"``. Blank entries are dropped."""
    try:
        entries = next(csv.reader([text], skipinitialspace=True), [])
    except csv.Error as error:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as comma-separated entries ({error})") from None
    return [entry.strip() for entry in entries if entry.strip()]


def comma_joined(entries: Sequence[str]) -> str:
    """The text :func:`comma_list` reads back as ``entries`` (an entry holding a comma is quoted)."""
    line = io.StringIO()
    csv.writer(line, lineterminator="").writerow(entries)
    return line.getvalue()


# torch.manual_seed takes any 64-bit integer; a seed is recorded and compared, so keep it non-negative
MAX_SEED = 2**63 - 1


def _float(text: str, option: str, allowed: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{option} must be a number {allowed}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{option} must be a finite number {allowed}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _float(text, "the value", "> 0")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def temperature(text: str) -> float:
    """0 decodes greedily; a positive temperature samples. Negative, NaN and infinite ones are refused
    (they decoded greedily, or sampled uniform noise, without a word)."""
    value = _float(text, "temperature", ">= 0 (0 = greedy)")
    if value < 0 or 0 < value < 1e-4:  # a vanishing temperature overflows the logits it divides
        raise argparse.ArgumentTypeError(f"temperature must be 0 (greedy) or at least 1e-4, got {text!r}")
    return value


def top_p(text: str) -> float:
    value = _float(text, "top-p", "in (0, 1]")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"top-p must be in (0, 1] (1 keeps every token), got {text!r}")
    return value


def seed(text: str) -> int:
    value = int_at_least(0)(text)
    if value > MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed must be at most {MAX_SEED}, got {text}")
    return value


def usable_cpus() -> list[int]:
    """The CPU cores this process may run on (its affinity where the OS has one), in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def thread_count(text: str) -> int:
    """1 up to the cores this process may use: more threads than cores only wait on each other."""
    value = positive_int(text)
    cores = len(usable_cpus())
    if value > cores:
        raise argparse.ArgumentTypeError(f"must be from 1 to {cores} (the cores available), got {value}")
    return value


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p and --seed, checked the same way by every command that decodes."""
    parser.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument(
        "--top-k", type=non_negative_int, default=0, help="with sampling: keep the k most likely tokens (0 = all)"
    )
    parser.add_argument("--top-p", type=top_p, default=1.0, help="with sampling: nucleus mass to keep, in (0, 1]")
    parser.add_argument("--seed", type=seed, default=0, help=f"with sampling: random seed, 0..{MAX_SEED}")


def add_target_argument(parser: argparse.ArgumentParser) -> None:
    """--target, described the same way by every command that loads the target."""
    from draftsmith.core.target import DEFAULT_TARGET, EMBEDDED_TARGETS

    named = " or ".join(repr(name) for name in EMBEDDED_TARGETS)
    parser.add_argument(
        "--target",
        default=None,
        help=f"target model: a named one, {named} (default: {DEFAULT_TARGET!r}), a model directory, a .gguf file "
        "or a hub id",
    )
