"""A user's text files read strictly: UTF-8 text, or one line saying what is wrong and where.

Every file a user hands draftsmith as text (a dataset, Spec-Bench questions, a recipe, a chat template, a
corpus) goes through :func:`read_text_file`: it is refused before it is opened when it is not a regular
file (a FIFO would block the read forever, a device never ends), and after reading when its bytes are
not UTF-8 (another encoding, a binary file). A UTF-8 byte-order mark, which some editors write, is
accepted and dropped. JSON readers also refuse escapes that decode to a lone surrogate (no tokenizer or
file write takes one) and integers too long for Python to convert. Each refusal names the file and the
line, so the user can find it.
"""

from __future__ import annotations

import codecs
import json
import re
import stat
import sys
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError


class TextFileError(DraftsmithError, ValueError):
    """An input file that is not UTF-8 text, holds what is not text, or is not a regular file."""


# UTF-16 and UTF-32 files (Windows' "Unicode" text) start with one of these marks.
_WIDE_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
_SAVE_AS_UTF8 = "save it as UTF-8 text"
# A \uD800-\uDFFF escape and the backslashes before it: a high one may be followed by its low half.
_SURROGATE_ESCAPE = re.compile(
    r"(?P<slashes>\\+)u(?P<high>[dD][89abAB][0-9a-fA-F]{2})(?P<low>\\u[dD][c-fC-F][0-9a-fA-F]{2})?"
    r"|(?P<lone_slashes>\\+)u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def line_at(text: str | bytes, offset: int) -> int:
    """The 1-based line of ``offset`` in ``text`` (only a newline ends a line)."""
    return text.count("\n" if isinstance(text, str) else b"\n", 0, offset) + 1


def check_regular_file(path: Path, error: type[DraftsmithError] = TextFileError) -> None:
    """Refuse, before it is opened, an input that is a FIFO, socket or device: opening a FIFO waits for a
    writer that may never come, and a device such as /dev/zero never ends. A missing file or a folder is
    left to the caller, which names it in its own words."""
    try:
        mode = Path(path).stat().st_mode
    except OSError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise error(
            f"{path} is not a regular file (a pipe, socket or device, which could block the read forever); "
            "save its content to a file and give that file"
        )


def decode_text(data: bytes, path: Path, error: type[DraftsmithError] = TextFileError) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped), else ``error`` naming the line."""
    if data.startswith(_WIDE_BOMS):
        raise error(f"{path} is UTF-16 or UTF-32 text, not UTF-8; {_SAVE_AS_UTF8}")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(
            f"{path} line {line_at(data, exc.start)} is not UTF-8 text (byte {exc.start:,} is "
            f"{data[exc.start]:#04x}); {_SAVE_AS_UTF8}"
        ) from None
    nul = text.find("\0")
    if nul >= 0:  # valid UTF-8, but no text holds one: a binary file (or UTF-16 without its mark)
        raise error(f"{path} line {line_at(text, nul)} holds a NUL byte, so it is binary, not text; {_SAVE_AS_UTF8}")
    return text


def read_text_file(path: Path, error: type[DraftsmithError] = TextFileError) -> str:
    """The text of the user's file ``path``, strictly: see the module's docstring."""
    check_regular_file(path, error)
    return decode_text(Path(path).read_bytes(), path, error)


def check_json_surrogates(text: str, path: Path, error: type[DraftsmithError] = TextFileError) -> None:
    """Refuse JSON text with an escape such as ``\\ud800`` that is not half of a surrogate pair: ``json``
    decodes it to a lone surrogate, which is no character, and the tokenizer fails on it far later."""
    for match in _SURROGATE_ESCAPE.finditer(text):
        slashes = match["slashes"] or match["lone_slashes"]
        if len(slashes) % 2 == 0 or match["low"]:  # an escaped backslash before "u...", or a whole pair
            continue
        escape = match.group()[len(slashes) - 1 :][:6]
        raise error(
            f"{path} line {line_at(text, match.start())} holds {escape}, half of a UTF-16 surrogate pair "
            "with no other half (not a character); fix or remove that text"
        )


def parse_json(text: str, path: Path, error: type[DraftsmithError] = TextFileError, line: int = 1) -> Any:
    """``json.loads(text)`` (text from line ``line`` of ``path``) with a number too long for Python to
    convert refused in one line; the decoder's own errors (``JSONDecodeError``, ``RecursionError``) pass
    through, for each reader to word in its terms."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # only int() of a digit run over sys.get_int_max_str_digits() raises a bare ValueError
        raise too_long_number(path, error, line + _long_number_line(text) - 1) from None


def too_long_number(path: Path, error: type[DraftsmithError] = TextFileError, line: int | None = None) -> Exception:
    """The error for an integer of more digits than Python converts (``sys.get_int_max_str_digits()``)."""
    where = f" line {line}" if line is not None else ""
    return error(
        f"{path}{where} holds an integer of over {sys.get_int_max_str_digits():,} digits, too long to read; "
        "shorten it or write it as a string"
    )


def _long_number_line(text: str) -> int:
    """The line of the first run of digits too long to convert (1 if none is found)."""
    found = re.search(rf"\d{{{sys.get_int_max_str_digits() + 1},}}", text)
    return line_at(text, found.start()) if found else 1
