"""``draftsmith medusa calibrate``: a Medusa tree fitted to a trained drafter's measured head accuracies.

Each head's top-k accuracy is measured on held-out samples: rank r of head k is right at position t
when it equals the target's own greedy token for ``x_{t+k+1}`` (``argmax lm_head(f_{t+k})``, what
verification compares against), counted where ``x_{t+k+1}`` is an assistant token. The tree of N
nodes is then grown best-first by path probability (:func:`calibrated_paths`), which maximises the
expected acceptance length under independent per-head accuracies.

A Medusa-2 drafter's heads read the model it serves (the target with its LoRA merged), so both the
features and the greedy tokens they are scored against come from that model, computed from the samples'
tokens (a feature cache holds the original target's features: only its tokens are read then).

Held-out means the samples ``data.eval_samples=N`` keeps out of training (the same split as the
trainer's), so calibrating with ``--samples`` equal to the recipe's ``data.eval_samples`` never
reads a training sample.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.core import target as targets
from draftsmith.core.io import atomic_write_json, check_output_file, record_rewritten_file
from draftsmith.data.features import CACHE_FORMAT, FeatureCache, target_features
from draftsmith.data.prepared import PreparedDataset, training_order
from draftsmith.drafters.base import TreeOptions
from draftsmith.drafters.io import check_drafter_target, read_drafter_config
from draftsmith.drafters.medusa import MedusaHeads, MedusaTreeError, calibrated_paths, expected_accept_length
from draftsmith.drafters.registry import FAMILIES, get_family

TREE_FORMAT = "draftsmith.medusa_tree/1"


def is_tree_file(path: Path) -> bool:
    """Whether ``path`` holds a tree file that ``calibrate`` wrote."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("format") == TREE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def held_out_indices(n_samples: int, count: int) -> list[int]:
    """The samples the trainer holds out with ``data.eval_samples=count`` (``TrainData``'s split)."""
    if not 0 < count < n_samples:
        raise MedusaTreeError(f"--samples must be between 1 and {n_samples - 1} (the data holds {n_samples} samples)")
    return training_order(n_samples, count)[0]


def iter_samples(
    data_dir: Path, target, count: int, cached_features: bool = True
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(input_ids, loss_mask, feature)`` of the held-out samples of a prepared dataset (features
    computed by ``target``) or of a feature cache (features read; computed by ``target`` from the cached
    tokens when not ``cached_features``, for a model other than the one the cache was made with)."""
    manifest = data_dir / "manifest.json"
    is_cache = manifest.is_file() and json.loads(manifest.read_text()).get("format") == CACHE_FORMAT
    if is_cache:
        cache = FeatureCache(data_dir)
        cache.check_target(target.identity)
        rows = cache.rows(len(cache))
        for index in held_out_indices(len(cache), count):
            item = cache[rows[index]]
            ids = item["input_ids"]
            yield ids, item["loss_mask"], item["feature"].float() if cached_features else _features(target, ids)
        return
    prepared = PreparedDataset(data_dir)
    prepared.check_target(target.identity)
    for index in held_out_indices(len(prepared), count):
        sample = prepared[index]
        yield sample.input_ids, sample.loss_mask, _features(target, sample.input_ids)


@torch.no_grad()
def _features(target, input_ids: torch.Tensor) -> torch.Tensor:
    return target_features(target, [input_ids], ())[0]["feature"]


@torch.no_grad()
def rank_counts(
    model: MedusaHeads,
    lm_head: torch.nn.Module,
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    feature: torch.Tensor,
    max_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For one sample: hits (K, max_rank) of rank r of head k, and positions (K,) counted per head."""
    heads = model.config.num_heads
    device = next(model.parameters()).device
    feature = feature.to(device, next(model.parameters()).dtype)
    greedy = lm_head(feature.to(lm_head.weight.dtype)).argmax(-1).cpu()  # greedy[s]: the target's x_{s+1}
    hits, positions = torch.zeros(heads, max_rank), torch.zeros(heads)
    for k in range(1, heads + 1):
        span = len(ids) - k - 1
        if span <= 0:
            continue
        rows = loss_mask[k + 1 :].bool()  # x_{t+k+1} is an assistant token
        if not rows.any():
            continue
        logits = model.medusa_head[k - 1](feature[:span][rows.to(device)])
        ranked = model.token_ids(logits.topk(min(max_rank, logits.shape[-1])).indices).cpu()  # (N, R)
        labels = greedy[k : k + span][rows]
        hits[k - 1, : ranked.shape[1]] += (ranked == labels[:, None]).float().sum(0)
        positions[k - 1] += int(rows.sum())
    return hits, positions


def measure_head_accuracy(
    model: MedusaHeads, target, samples, max_rank: int, total: int | None = None
) -> dict[str, Any]:
    """Per-head top-k accuracies ``accuracy[k-1][r]`` over the samples."""
    lm_head = target.model.get_output_embeddings()
    hits, positions = torch.zeros(model.config.num_heads, max_rank), torch.zeros(model.config.num_heads)
    for ids, mask, feature in tqdm(samples, total=total, desc="measuring heads", unit="sample", dynamic_ncols=True):
        sample_hits, sample_positions = rank_counts(model, lm_head, ids, mask, feature, max_rank)
        hits += sample_hits
        positions += sample_positions
    if not positions.any():
        raise MedusaTreeError("the held-out samples hold no assistant token to measure the heads on; raise --samples")
    accuracy = hits / positions.clamp_min(1)[:, None]
    return {"accuracy": [[round(float(a), 6) for a in row] for row in accuracy], "positions": positions.int().tolist()}


def calibrate(
    directory: Path,
    data_dir: Path,
    nodes: int,
    target_name: str | None,
    samples: int = 64,
    max_rank: int = 10,
    out: Path | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Measure, build the tree and write it: into ``directory/config.json`` (what ``--method medusa=DIR``
    reads), or to ``out`` as a tree file when given (replacing an earlier one only with ``overwrite``).
    Returns the written record."""
    if nodes < 1 or max_rank < 1:
        raise MedusaTreeError("--nodes and --max-rank must be >= 1")
    directory = Path(directory)
    if out is not None:
        inputs = (("the drafter", directory), ("the data", Path(data_dir)))
        what = "a tree file written by `draftsmith medusa calibrate`"
        check_output_file(Path(out), overwrite, what, is_tree_file, inputs)
    config = read_drafter_config(directory)
    family = config["drafter_family"]
    calibrated = [name for name, entry in FAMILIES.items() if entry.calibrated_tree]
    if family not in calibrated:
        raise MedusaTreeError(f"{directory} holds a {family!r} drafter; calibrate works on {' and '.join(calibrated)}")
    target = targets.load_target(target_name)
    check_drafter_target(config, target, directory)
    model = get_family(family).model_class.from_pretrained(directory).to(target.model.device, target.model.dtype)
    drafter = model.eval().runtime_drafter(target.model, TreeOptions())
    with drafter.reference_model() or nullcontext(target.model) as served:  # Medusa-2: the merged model
        scorer = target.with_model(served)
        held_out = iter_samples(Path(data_dir), scorer, samples, cached_features=scorer is target)
        measured = measure_head_accuracy(drafter.model, scorer, held_out, max_rank, samples)
    paths = calibrated_paths(measured["accuracy"], nodes)
    record = {
        "nodes": len(paths),
        "expected_accept_length": round(expected_accept_length(paths, measured["accuracy"]), 4),
        "head_accuracy": measured["accuracy"],
        "positions": measured["positions"],
        "samples": samples,
        "data": str(data_dir),
    }
    if out is not None:
        atomic_write_json(Path(out), {"format": TREE_FORMAT, "paths": paths, **record})
    else:
        atomic_write_json(directory / "config.json", {**config, "tree": paths, "tree_calibration": record})
        record_rewritten_file(directory, "config.json")
    return {"paths": paths, **record}
