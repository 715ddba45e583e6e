"""SPECTRA-RETRIEVAL: guesses looked up in a perplexity-refined corpus (seed 000, section 4.2.2).

``draftsmith spectra-index CORPUS --out INDEX`` scores every document of a corpus (the assistant turns
of a ShareGPT / OpenAI-messages / UltraChat file, or the lines of a ``.txt`` file) with the target's
perplexity, keeps the lowest-perplexity fraction, tokenises it with the target's tokenizer and writes
one safetensors file: the kept documents' tokens (``-1`` between documents), a suffix array over them
(sorted by their first ``DEPTH`` tokens) and the target's identity. At decode time the longest suffix of
the context found in the index (``DEPTH`` tokens down to ``MIN_MATCH``) gives the most frequent
continuations as guesses, which fill what is left of SPECTRA's guess budget after its own guesses.

Scoring is the long part: it shows progress and keeps finished scores beside the output
(``INDEX.scores.partial.jsonl``), so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from draftsmith.core.io import atomic_write_bytes, check_output_file, jsonl_lines
from draftsmith.core.target import TargetError, TargetIdentity
from draftsmith.core.text import read_text_file
from draftsmith.data.formats import DataError, ReadStats, read_conversations

INDEX_FORMAT = "draftsmith-spectra-index"
INDEX_VERSION = 1
DEPTH = 8  # suffixes are sorted by their first DEPTH tokens: the longest context suffix matched
MIN_MATCH = 2  # a single shared token says too little about what follows
MAX_CANDIDATES = 256  # matches sampled from one suffix-array range to count continuations
SEPARATOR = -1  # between documents: never equal to a token, so no match or continuation crosses it


class SpectraIndexError(DataError):
    """An index file that cannot be used (missing, not an index, built for another target)."""


# ----------------------------------------------------------------------------- reading the corpus
def read_documents(corpus: Path, limit: int | None = None) -> list[str]:
    """Texts to score: each line of a ``.txt`` file, else each assistant turn of a chat dataset
    (the first ``limit`` documents with ``limit``)."""
    corpus = Path(corpus)
    if corpus.suffix == ".txt":
        if not corpus.exists():
            raise DataError(f"{corpus} does not exist; give a .txt, .json or .jsonl corpus")
        documents = [line.strip() for line in jsonl_lines(read_text_file(corpus, DataError)) if line.strip()]
    else:
        stats = ReadStats()
        documents = [
            turn["content"]
            for conversation in read_conversations(str(corpus), stats)
            for turn in conversation.turns
            if turn["role"] == "assistant"
        ]
    if not documents:
        raise DataError(f"{corpus} has no documents to index (no assistant turns or non-empty lines)")
    return documents[:limit]


# ----------------------------------------------------------------------------- perplexity
def _score_batch(model, batch: list[list[int]], pad_id: int) -> list[float]:
    """Perplexity of each token list, ``exp(mean NLL of tokens 1..t)``, in one padded forward."""
    import torch

    width = max(len(ids) for ids in batch)
    device = next(model.parameters()).device
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
    with torch.no_grad():
        logits = model(input_ids.to(device), attention_mask=attention_mask.to(device)).logits
    scores = []
    for row, ids in enumerate(batch):  # one row at a time keeps the log-softmax copy small
        nll = torch.nn.functional.cross_entropy(logits[row, : len(ids) - 1].float(), input_ids[row, 1 : len(ids)])
        scores.append(math.exp(min(float(nll), 50.0)))
    return scores


def _partial_path(out: Path) -> Path:
    return out.with_name(out.name + ".scores.partial.jsonl")


def _load_partial(path: Path, header: dict[str, Any]) -> dict[int, float]:
    """Scores of an interrupted run with the same corpus, target and settings; otherwise none."""
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines()
    try:
        if not lines or json.loads(lines[0]) != header:
            return {}
        scores = {}
        for line in lines[1:]:
            record = json.loads(line)
            scores[int(record["i"])] = float(record["ppl"])
        return scores
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return {}  # a line cut by a crash: rescoring is cheaper than guessing


def score_documents(
    model, tokenized: list[list[int]], pad_id: int, partial: Path, header: dict[str, Any], batch_size: int = 4
) -> list[float]:
    """Perplexity per document (``inf`` for documents under two tokens), resuming from ``partial``."""
    from tqdm.auto import tqdm

    scores = _load_partial(partial, header)
    todo = sorted(
        (i for i in range(len(tokenized)) if i not in scores and len(tokenized[i]) >= 2),
        key=lambda i: len(tokenized[i]),
    )  # similar lengths together: little padding
    mode = "a" if scores else "w"
    with open(partial, mode, encoding="utf-8") as handle:
        if mode == "w":
            handle.write(json.dumps(header) + "\n")
        with tqdm(total=len(tokenized), initial=len(tokenized) - len(todo), desc="perplexity", unit="doc") as bar:
            for start in range(0, len(todo), batch_size):
                chunk = todo[start : start + batch_size]
                for i, ppl in zip(chunk, _score_batch(model, [tokenized[i] for i in chunk], pad_id)):
                    scores[i] = ppl
                    handle.write(json.dumps({"i": i, "ppl": ppl}) + "\n")
                handle.flush()
                bar.update(len(chunk))
    return [scores.get(i, math.inf) for i in range(len(tokenized))]


# ----------------------------------------------------------------------------- the index file
def build_suffix_array(tokens: np.ndarray, depth: int = DEPTH) -> np.ndarray:
    """Positions of every token, sorted by the ``depth`` tokens starting there (separators sort first)."""
    padded = np.concatenate([tokens, np.full(depth, SEPARATOR, dtype=tokens.dtype)])
    positions = np.flatnonzero(tokens != SEPARATOR)
    keys = [padded[positions + d] for d in reversed(range(depth))]  # lexsort: last key is primary
    return positions[np.lexsort(keys)].astype(np.int64)


def write_index(path: Path, documents: list[list[int]], meta: dict[str, Any]) -> None:
    """One safetensors file: ``tokens`` (documents joined by -1), ``suffixes`` and the JSON ``meta``."""
    from safetensors.numpy import save

    joined: list[int] = []
    for ids in documents:
        joined.extend(ids)
        joined.append(SEPARATOR)
    tokens = np.asarray(joined, dtype=np.int32)
    suffixes = build_suffix_array(tokens)
    header = {"format": INDEX_FORMAT, "version": str(INDEX_VERSION), "meta": json.dumps(meta)}
    atomic_write_bytes(path, save({"tokens": tokens, "suffixes": suffixes}, metadata=header))


def is_spectra_index(path: Path) -> bool:
    """Whether ``path`` is an index :func:`write_index` wrote (read from its header alone)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as handle:
            return (handle.metadata() or {}).get("format") == INDEX_FORMAT
    except Exception:  # safetensors raises its own error types for a file that is not one of its own
        return False


class RetrievalIndex:
    """A loaded index: suffix-array lookups of the context's suffix."""

    def __init__(self, tokens: np.ndarray, suffixes: np.ndarray, meta: dict[str, Any]) -> None:
        self.tokens = tokens
        self.padded = np.concatenate([tokens, np.full(DEPTH + 64, SEPARATOR, dtype=tokens.dtype)])
        self.suffixes = suffixes
        self.meta = meta
        self.identity = TargetIdentity.from_dict(meta["target"])

    @classmethod
    def load(cls, path: Path | str, target_identity: TargetIdentity | None = None) -> RetrievalIndex:
        """Read an index; with ``target_identity``, refuse one built for another target."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise SpectraIndexError(f"SPECTRA index {path} does not exist; build one with `draftsmith spectra-index`")
        try:
            with safe_open(str(path), framework="np") as handle:
                header = handle.metadata() or {}
                arrays = {name: handle.get_tensor(name) for name in handle.keys()}
        except (SafetensorError, OSError, ValueError):
            header, arrays = {}, {}
        if header.get("format") != INDEX_FORMAT or "tokens" not in arrays or "suffixes" not in arrays:
            raise SpectraIndexError(f"{path} is not a SPECTRA index; build one with `draftsmith spectra-index`")
        index = cls(arrays["tokens"], arrays["suffixes"], json.loads(header["meta"]))
        if target_identity is not None:
            problem = index.identity.mismatch(target_identity)
            if problem:
                raise TargetError(
                    f"SPECTRA index {path} was built for another target: {problem}; "
                    f"rebuild it with `draftsmith spectra-index ... --target <this target>`"
                )
        return index

    def _window(self, position: int, length: int) -> list[int]:
        return self.padded[position : position + length].tolist()

    def match_range(self, pattern: list[int]) -> tuple[int, int]:
        """Suffix-array range ``[lo, hi)`` of suffixes starting with ``pattern`` (``len <= DEPTH``)."""
        k, suffixes = len(pattern), self.suffixes
        lo, hi = 0, len(suffixes)
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            if self._window(int(suffixes[mid]), k) < pattern:
                lo = mid + 1
            else:
                hi = mid
        start, hi = lo, len(suffixes)
        while lo < hi:  # first suffix > pattern (on its first k tokens)
            mid = (lo + hi) // 2
            if self._window(int(suffixes[mid]), k) <= pattern:
                lo = mid + 1
            else:
                hi = mid
        return start, lo

    def guesses(self, tokens: list[int], count: int, length: int) -> list[list[int]]:
        """Up to ``count`` continuations (``length`` tokens at most) of the longest context suffix found
        in the index, most frequent first."""
        if count <= 0:
            return []
        for k in range(min(DEPTH, len(tokens)), MIN_MATCH - 1, -1):
            lo, hi = self.match_range(tokens[-k:])
            if hi > lo:
                return self._continuations(lo, hi, k, count, length)
        return []

    def _continuations(self, lo: int, hi: int, k: int, count: int, length: int) -> list[list[int]]:
        picks = np.linspace(lo, hi - 1, num=min(hi - lo, MAX_CANDIDATES)).astype(np.int64)
        counts: Counter[tuple[int, ...]] = Counter()
        for position in self.suffixes[picks].tolist():
            continuation = self._window(position + k, length)
            if SEPARATOR in continuation:
                continuation = continuation[: continuation.index(SEPARATOR)]
            if continuation:
                counts[tuple(continuation)] += 1
        return [list(c) for c, _ in counts.most_common(count)]


# ----------------------------------------------------------------------------- the command
def build_index(
    corpus: Path,
    out: Path,
    target_name: str | None = None,
    keep: float = 0.5,
    max_length: int = 512,
    batch_size: int = 4,
    limit: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Score, filter, tokenise and write the index (replacing an earlier index only with ``overwrite``);
    returns its meta (also stored in the file)."""
    from draftsmith.core.target import load_target

    if not 0.0 < keep <= 1.0:
        raise DataError(f"--keep must be in (0, 1], got {keep}")
    what = "a SPECTRA index written by `draftsmith spectra-index`"
    check_output_file(Path(out), overwrite, what, is_spectra_index, (("the corpus", Path(corpus)),))
    documents = read_documents(Path(corpus), limit)
    target = load_target(target_name)
    tokenizer = target.tokenizer
    tokenized = [tokenizer(text, add_special_tokens=False)["input_ids"][:max_length] for text in documents]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    header = {
        "corpus": str(Path(corpus).resolve()),
        "documents": len(documents),
        "max_length": max_length,
        "target": target.identity.to_dict(),
    }
    partial = _partial_path(Path(out))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    scores = score_documents(target.model, tokenized, pad_id, partial, header, batch_size)
    scored = [i for i in range(len(documents)) if math.isfinite(scores[i])]
    if not scored:
        raise DataError(f"{corpus}: every document is shorter than two tokens; nothing to score")
    ranked = sorted(scored, key=lambda i: scores[i])
    kept = sorted(ranked[: max(1, math.ceil(keep * len(scored)))])
    meta = {
        "target": target.identity.to_dict(),
        "corpus": str(corpus),
        "documents": len(documents),
        "kept": len(kept),
        "keep": keep,
        "max_length": max_length,
        "tokens": sum(len(tokenized[i]) for i in kept),
        "perplexity_threshold": scores[ranked[len(kept) - 1]],
    }
    write_index(Path(out), [tokenized[i] for i in kept], meta)
    partial.unlink(missing_ok=True)
    return meta
