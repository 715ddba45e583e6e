"""``bench --resume``: the questions a bench has finished, kept in ``OUT/progress.jsonl`` as each one
finishes, so a bench that stops (a whole dev file takes hours on a CPU) continues where it stopped."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from draftsmith.inference.measure.errors import BenchError

PROGRESS = "progress.jsonl"
PROGRESS_FORMAT = "draftsmith.bench_progress/1"


class BenchProgress:
    """The questions a bench has finished, in order: ``OUT/progress.jsonl``, a header line with the
    settings every measurement depends on, then one line per finished question (its tokens and
    timings), flushed to disk as each finishes. ``bench --resume`` replays them and goes on from the
    first unfinished question; a torn last line (the process killed mid-write) is dropped. The
    finished results replace the directory, progress file included."""

    def __init__(self, path: Path, records: list[dict[str, Any]], header: dict[str, Any] | None = None) -> None:
        self.path = path
        self.records = records
        self._header = header  # written with the first finished question: a refused run leaves nothing

    @classmethod
    def start(cls, out: Path, settings: dict[str, Any]) -> BenchProgress:
        return cls(out / PROGRESS, [], {"format": PROGRESS_FORMAT, "settings": settings})

    @classmethod
    def resume(cls, out: Path, settings: dict[str, Any]) -> BenchProgress:
        path = out / PROGRESS
        header, records, intact = read_progress(path)
        if header is None:
            raise BenchError(f"--resume: {out} holds no unfinished bench ({PROGRESS}); run without --resume")
        differ = sorted(
            key
            for key in settings.keys() | header["settings"].keys()
            if settings.get(key) != header["settings"].get(key)
        )
        if differ:
            raise BenchError(
                f"--resume: the unfinished bench in {out} ran with other {', '.join(differ)}; resume it with "
                "the same options, or start over with --overwrite"
            )
        if len(intact) < len(path.read_bytes()):  # drop the torn line, so appends start on a line of their own
            with open(path, "r+b") as handle:
                handle.truncate(len(intact))
        return cls(path, records)

    def append(self, record: dict[str, Any]) -> None:
        if self._header is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as handle:
                handle.write(json.dumps(self._header) + "\n")
            self._header = None
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records.append(record)


def read_progress(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bytes]:
    """(header or None, finished question records, the bytes of the intact lines) of a progress file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None, [], b""
    lines, intact, header = [], 0, None
    for line in data.splitlines(keepends=True):
        try:
            obj = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            break
        if header is None:
            if obj.get("format") != PROGRESS_FORMAT or not isinstance(obj.get("settings"), dict):
                return None, [], b""
            header = obj
        else:
            lines.append(obj)
        intact += len(line)
    return header, lines, data[:intact]
