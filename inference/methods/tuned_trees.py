"""``tuned_trees.json``: the draft trees ``draftsmith tune`` fitted to devices, kept inside an export.

One entry per (device, dtype, CPU threads), because the cost of a verification forward, and so the
tree that pays, depends on all three. Each entry records the sha256 of the drafter's weights it was
fitted with and the kernels whose forwards it timed (``kernels``: C++ decoder layers, packed GEMM): an
entry from before the drafter was exported again, or from before the kernels were recorded (a runtime
whose cost curve has changed since), is stale and ignored. The file is
JSON (loading it runs no code), written atomically and recorded in the export's ``files.json``, so
the export still verifies after a tune.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.devices import device_name
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import FILES_MANIFEST, atomic_write_json, record_rewritten_file, sha256_file
from draftsmith.drafters.base import TreeOptions
from draftsmith.drafters.io import TUNED_TREES, WEIGHTS_NAME

TUNED_FORMAT = "draftsmith.tuned_trees/1"


class TunedTreesError(DraftsmithError, ValueError):
    """A ``tuned_trees.json`` that cannot be read or updated."""


@dataclass(frozen=True)
class DeviceKey:
    device: str  # device_name()
    dtype: str  # "float32", "bfloat16", ...
    threads: int  # torch's CPU threads

    @classmethod
    def current(cls, model: torch.nn.Module) -> DeviceKey:
        parameter = next(model.parameters())
        return cls(device_name(parameter.device), str(parameter.dtype).removeprefix("torch."), torch.get_num_threads())

    def text(self) -> str:
        return f"{self.device} | {self.dtype} | {self.threads} threads"


def weights_sha256(directory: Path) -> str:
    """The drafter weights' sha256, from the export's manifest when it has one (already verified by
    the loader) or from the file."""
    manifest = directory / FILES_MANIFEST
    if manifest.is_file():
        try:
            return str(json.loads(manifest.read_text())["files"][WEIGHTS_NAME]["sha256"])
        except (ValueError, KeyError, TypeError):
            pass
    return sha256_file(directory / WEIGHTS_NAME)


def read_tuned_trees(directory: Path) -> dict[str, Any]:
    """The file's entries by key text; {} when there is none."""
    path = Path(directory) / TUNED_TREES
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        entries = data["entries"] if data.get("format") == TUNED_FORMAT else None
    except (ValueError, AttributeError, KeyError, TypeError):
        entries = None
    if not isinstance(entries, dict):
        raise TunedTreesError(f"{path} is damaged; delete it and run `draftsmith tune {directory}` again")
    return entries


def write_tuned_tree(directory: Path, key: DeviceKey, entry: dict[str, Any]) -> Path:
    """Add (or replace) the entry for ``key``, keeping every other device's; atomic, and recorded in
    the export's ``files.json``."""
    directory = Path(directory)
    entries = read_tuned_trees(directory)
    entries[key.text()] = {**entry, "device": key.device, "dtype": key.dtype, "threads": key.threads}  # the key wins
    atomic_write_json(directory / TUNED_TREES, {"format": TUNED_FORMAT, "entries": entries})
    record_rewritten_file(directory, TUNED_TREES)
    return directory / TUNED_TREES


@dataclass(frozen=True)
class FittedTree:
    tree: TreeOptions | None  # None: no usable entry
    note: str  # one line saying what was found and used
    lookup: int = 0  # the prompt-lookup chain fitted with the tree (lookup=N), 0: none


def fitted_tree(directory: Path, key: DeviceKey) -> FittedTree:
    """The tree ``draftsmith tune`` fitted for ``key`` in this export, if it is there and not stale. Where
    this device has none, the nearest one fitted for the same kind of device and dtype (the same CPU
    model first, then the closest thread count) stands in, said as such: a tree another CPU chose is a
    better guess than the export's default (for a shipped drafter, often a single-token chain)."""
    directory = Path(directory)
    try:
        entries = read_tuned_trees(directory)
    except TunedTreesError as error:
        return FittedTree(None, f"[tune] ignoring a fitted tree: {error}")
    if not entries:
        return FittedTree(None, "")
    entry = entries.get(key.text())
    if entry is not None:
        tree, problem = _usable_tree(directory, entry)
        if tree is None:
            return FittedTree(None, f"[tune] ignoring the tree fitted for {key.text()}: {problem}")
        note = f"[tune] using the tree fitted for {key.text()} {_described(entry)}"
        return FittedTree(tree, note, _lookup(entry))
    stand_in = _nearest_usable(directory, entries, key)
    if stand_in is None:
        return FittedTree(
            None,
            f"[tune] {directory} has no tree fitted for {key.text()} (only for: {'; '.join(entries)}); "
            "using its default tree",
        )
    text, tree = stand_in
    return FittedTree(
        tree,
        f"[tune] {directory} has no tree fitted for {key.text()}; using the one fitted for {text} "
        f"{_described(entries[text], 'there')}; `draftsmith tune {directory}` fits one for this device",
        _lookup(entries[text]),
    )


def _usable_tree(directory: Path, entry: dict[str, Any]) -> tuple[TreeOptions | None, str]:
    """The entry's tree, or None and why it is not used."""
    if entry.get("weights_sha256") != weights_sha256(directory):
        return None, f"the drafter was exported again since; run `draftsmith tune {directory}` again"
    if not isinstance(entry.get("kernels"), dict):
        return None, (
            f"it was timed before the runtime's kernels were recorded (they have changed since); "
            f"run `draftsmith tune {directory}` again"
        )
    tree = TreeOptions(**_tree_shape(entry))
    if tree.problem():  # a hand-edited file: its numbers get the checks a command line's do
        return None, f"{tree.problem()}; run `draftsmith tune {directory}` again"
    return tree, ""


def _nearest_usable(directory: Path, entries: dict[str, Any], key: DeviceKey) -> tuple[str, TreeOptions] | None:
    """The usable entry nearest to ``key`` among those for the same kind of device and dtype."""
    kind = key.device.split(":")[0]
    candidates = []
    for text, entry in entries.items():
        if str(entry.get("device", "")).split(":")[0] != kind or entry.get("dtype") != key.dtype:
            continue
        tree, _ = _usable_tree(directory, entry)
        threads = entry.get("threads")
        if tree is not None and isinstance(threads, int):
            distance = (entry.get("device") != key.device, abs(threads - key.threads))
            candidates.append((distance, text, tree))
    if not candidates:
        return None
    _, text, tree = min(candidates, key=lambda candidate: candidate[:2])
    return text, tree


def _lookup(entry: dict[str, Any]) -> int:
    """The entry's prompt-lookup chain length (trees fitted before tune tried lookup have none)."""
    value = entry["tree"].get("lookup", 0) if isinstance(entry.get("tree"), dict) else 0
    return value if isinstance(value, int) and value > 0 else 0


def _tree_shape(entry: dict[str, Any]) -> dict[str, Any]:
    recorded = entry.get("tree") if isinstance(entry.get("tree"), dict) else {}
    return {name: value for name, value in recorded.items() if name in TreeOptions.names()}


def _described(entry: dict[str, Any], where: str = "here") -> str:
    """"(timed with ...): depth=2 top_k=2 total_tokens=3" and whether tune predicted drafting to pay."""
    pays = "" if entry.get("drafting_pays", True) else f" (tune found plain decoding faster {where}: --method none)"
    lookup = _lookup(entry)
    shape = _tree_shape(entry) | ({"lookup": lookup} if lookup else {})
    options = " ".join(f"{name}={value}" for name, value in shape.items())
    return f"({kernels_text(entry['kernels'])}): {options}{pays}"


def kernels_text(kernels: dict[str, Any]) -> str:
    """``{"native": true, "linear": "onednn"}`` -> "timed with C++ decoder layers, oneDNN linears": a tree
    fitted with other kernels than the serving run's (``--no-native``, ``--linear``, ``--compile``) may
    not be the best. (Trees fitted before ``linear`` was recorded say ``packed_gemm``: MKL's.)"""
    names = [name for flag, name in _KERNEL_NAMES.items() if kernels.get(flag)]
    linear = kernels.get("linear", "mkl" if kernels.get("packed_gemm") else "default")
    codes = ""
    if kernels.get("weight_codes"):
        codes = " (weight codes, the drafter's rounded)" if kernels.get("drafter_codes") else " (weight codes)"
    path = f" ({_ISA_NAMES[kernels['isa']]} path)" if kernels.get("isa") in _ISA_NAMES else ""
    names += [_LINEAR_NAMES[linear] + path + codes] if linear in _LINEAR_NAMES else []
    return "timed with " + (", ".join(names) if names else "the Python forward")


_KERNEL_NAMES = {"native": "C++ decoder layers", "greedy_head": "screened head"}
_LINEAR_NAMES = {"stream": "stream linears", "onednn": "oneDNN linears", "mkl": "packed GEMM"}
_ISA_NAMES = {"avx2": "AVX2", "avx512": "AVX-512"}  # the stream kernel's instruction set (tune records it)
