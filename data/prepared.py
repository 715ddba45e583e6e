"""Prepared (tokenised) datasets: ``input_ids`` and ``loss_mask`` of every usable conversation.

Layout of a prepared directory::

    manifest.json        target identity, template hash, max length, vocabulary size, read/used/skipped
                         counts, ids
    tokens.safetensors   input_ids (int32), loss_mask (uint8), offsets (int64, n + 1)
    files.json           size and sha256 of both, verified on open (then token ids are range-checked)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import OutputRules, atomic_directory, atomic_write_json, verify_files
from draftsmith.core.target import TargetIdentity
from draftsmith.data.formats import ReadStats
from draftsmith.data.templates import TokenizedConversation

PREPARED_FORMAT = "draftsmith.prepared/1"
MANIFEST = "manifest.json"
TOKENS = "tokens.safetensors"


class PreparedDataError(DraftsmithError, RuntimeError):
    """A prepared directory that is missing, damaged or made for another target."""


def is_prepared_directory(path: Path) -> bool:
    """Whether ``path`` holds what :func:`write_prepared` writes (its manifest names the format)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("format") == PREPARED_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def prepared_output_rules(source: str) -> OutputRules:
    """``--out`` of ``data prepare`` replaces only a prepared dataset, and never holds its input."""
    keep = (("the input", Path(source)),) if Path(source).exists() else ()
    what = "a prepared dataset written by `draftsmith data prepare`"
    return OutputRules(what, is_prepared_directory, keep, writes=(MANIFEST, TOKENS))


def template_hash(chat_template: str) -> str:
    return hashlib.sha256(chat_template.encode()).hexdigest()


def sample_digest(input_ids: Any, loss_mask: Any) -> bytes:
    """One sample's identity, its tokens and loss mask (lists or tensors alike): what `data prepare` calls
    a duplicate and what training checks its held-out samples against."""
    ids = np.asarray(input_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(ids + np.asarray(loss_mask, dtype=np.uint8).tobytes()).digest()


EVAL_SPLIT_SEED = 0  # the held-out split does not move when train.seed changes
SUBSET_SEED = 1  # which training samples data.train_samples keeps: nested subsets of one prepared set


def training_order(n_samples: int, eval_samples: int) -> tuple[list[int], list[int]]:
    """(the held-out sample indices, sorted; the training ones in the order ``data.train_samples=N`` takes
    its first N). Fixed by the two numbers alone, so a smaller N keeps a subset of what a larger one keeps,
    the held-out samples stay the same, and a feature cache can be computed in this order and used before
    it is finished."""
    split = np.random.default_rng(EVAL_SPLIT_SEED).permutation(n_samples)
    held_out = sorted(int(i) for i in split[n_samples - eval_samples :]) if eval_samples else []
    excluded = set(held_out)
    training = [i for i in range(n_samples) if i not in excluded]
    return held_out, [training[int(i)] for i in np.random.default_rng(SUBSET_SEED).permutation(len(training))]


@dataclass(frozen=True)
class PreparedOrigin:
    """Where samples come from and what tokenised them, recorded in the manifest: a reader checks its
    target against ``identity`` and, with ``vocab_size`` (the tokenizer's), range-checks every token id."""

    source: str
    identity: TargetIdentity
    chat_template: str
    max_length: int | None
    vocab_size: int | None = None


def write_prepared(
    out: Path,
    samples: Iterable[TokenizedConversation],
    stats: ReadStats,
    origin: PreparedOrigin,
    *,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write samples and a manifest into ``out`` atomically; returns the manifest."""
    ids, masks, offsets, sample_ids = [], [], [0], []
    for sample in samples:
        ids.append(torch.tensor(sample.input_ids, dtype=torch.int32))
        masks.append(torch.tensor(sample.loss_mask, dtype=torch.uint8))
        offsets.append(offsets[-1] + len(sample.input_ids))
        sample_ids.append(sample.id)
    stats.check()
    if not sample_ids:
        raise PreparedDataError(f"no usable conversation in {origin.source}:\n{stats.summary()}")
    tensors = {
        "input_ids": torch.cat(ids),
        "loss_mask": torch.cat(masks),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    manifest = {
        "format": PREPARED_FORMAT,
        "source": origin.source,
        "target": origin.identity.to_dict(),
        "chat_template_sha256": template_hash(origin.chat_template),
        "max_length": origin.max_length,
        "vocab_size": origin.vocab_size,
        "counts": stats.to_dict(),
        "n_samples": len(sample_ids),
        "n_tokens": int(tensors["input_ids"].numel()),
        "n_supervised": int(tensors["loss_mask"].sum()),
        "sample_ids": sample_ids,
    }
    rules = prepared_output_rules(origin.source)
    with atomic_directory(Path(out), overwrite=overwrite, rules=rules, record_files=True) as tmp:
        save_file(tensors, str(tmp / TOKENS))
        atomic_write_json(tmp / MANIFEST, manifest)
    return manifest


@dataclass
class PreparedSample:
    id: str
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) int64, 1 on supervised tokens


class PreparedDataset:
    """Read access to a prepared directory, checked on open."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            raise PreparedDataError(
                f"{self.path} is not a prepared dataset (no {MANIFEST}); "
                "make one with `draftsmith data prepare INPUT --out DIR`"
            )
        verify_files(self.path, self.rebuild, error=PreparedDataError)
        try:
            self.manifest = json.loads(manifest_path.read_text())
            tensors = load_file(str(self.path / TOKENS))
        except Exception as exc:  # json / safetensors errors on damaged files
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise PreparedDataError(
                f"{self.path} is damaged ({type(exc).__name__}: {detail}); {self.rebuild}"
            ) from None
        if self.manifest.get("format") != PREPARED_FORMAT:
            raise PreparedDataError(
                f"{self.path} has format {self.manifest.get('format')!r}, expected {PREPARED_FORMAT}"
            )
        self.input_ids = tensors["input_ids"]
        self.loss_mask = tensors["loss_mask"]
        self.offsets = tensors["offsets"]
        self.sample_ids: list[str] = self.manifest["sample_ids"]
        self._check_ranges()

    @property
    def rebuild(self) -> str:
        """The command that writes this directory again."""
        return f"prepare it again: `draftsmith data prepare INPUT --out {self.path} --overwrite`"

    def _check_ranges(self) -> None:
        """Offsets, token ids and mask values are used as indices: out of range, they would fail (or
        read the wrong rows) deep inside the model, so they are checked here."""
        offsets, n_tokens = self.offsets, self.input_ids.numel()
        if len(offsets) != len(self.sample_ids) + 1 or int(offsets[0]) != 0 or int(offsets[-1]) != n_tokens:
            raise PreparedDataError(f"{self.path} is damaged: offsets do not match the tokens; {self.rebuild}")
        if len(offsets) > 1 and bool((offsets[1:] < offsets[:-1]).any()):
            raise PreparedDataError(f"{self.path} is damaged: offsets go backwards; {self.rebuild}")
        vocab = self.manifest.get("vocab_size")  # None in datasets prepared before it was recorded
        low, high = (int(self.input_ids.min()), int(self.input_ids.max())) if n_tokens else (0, 0)
        if low < 0 or (vocab and high >= vocab):
            raise PreparedDataError(
                f"{self.path} is damaged: token id {low if low < 0 else high} is outside the tokenizer's vocabulary "
                f"0..{(vocab or 0) - 1}; {self.rebuild}"
            )
        if n_tokens and int(self.loss_mask.max()) > 1:
            raise PreparedDataError(
                f"{self.path} is damaged: loss_mask holds values other than 0 and 1; {self.rebuild}"
            )

    @property
    def identity(self) -> TargetIdentity:
        return TargetIdentity.from_dict(self.manifest["target"])

    def check_target(self, identity: TargetIdentity) -> None:
        problem = self.identity.mismatch(identity)
        if problem:
            raise PreparedDataError(
                f"{self.path} was prepared for another target: {problem}; "
                "prepare the data again with --target set to the model you train for"
            )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def sample_length(self, index: int) -> int:
        """Tokens in sample ``index``, without slicing its tensors."""
        return int(self.offsets[index + 1] - self.offsets[index])

    def __getitem__(self, index: int) -> PreparedSample:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return PreparedSample(
            self.sample_ids[index], self.input_ids[start:end].long(), self.loss_mask[start:end].long()
        )
