"""The feature cache: the target's hidden states over a prepared dataset, for offline training.

The feature is the hidden state that enters ``lm_head`` (``hidden_states[-1]``, after the final
norm); extra layers (indices into ``hidden_states``, 0 = embeddings) are optional. Storage is
sharded safetensors (bf16 by default) plus a manifest; each shard is written atomically and listed
in the manifest only when complete, so an interrupted run resumes at the first missing shard. Each
shard's sha256 is checked when it is read, so a truncated or tampered shard is reported, not used.

Layout::

    manifest.json              target, dataset, dtype, layers, target_argmax, shards (file, ids, tokens, sha256, bytes)
    shard-00000.safetensors    input_ids, loss_mask, offsets, feature, target_argmax, hidden_states.<layer> ...

``target_argmax`` (int32 a token) is the target's greedy token at every position: ``lm_head``'s argmax
over the whole vocabulary, from the feature as stored. The EAGLE-3 losses need it at every position
they teach, and computing it there means a full-vocabulary product at every step of every epoch (on
a small target, a quarter of an EAGLE-3 step's arithmetic); cached, a step computes only the draft
vocabulary's columns. Caches written before it was kept have none, and their losses compute it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from tqdm.auto import tqdm

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_write_bytes, atomic_write_json, check_apart_from_inputs
from draftsmith.core.target import Target, TargetIdentity
from draftsmith.data.prepared import PreparedDataset, training_order

CACHE_FORMAT = "draftsmith.features/1"
MANIFEST = "manifest.json"
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


class FeatureCacheError(DraftsmithError, RuntimeError):
    """A feature cache that is damaged, incomplete or made for something else."""


@dataclass
class CacheSettings:
    dtype: str = "bf16"
    layers: tuple[int, ...] = ()  # extra hidden_states indices besides the feature
    shard_tokens: int = 1 << 17  # small enough that an interrupted CPU run loses minutes, not hours
    batch_tokens: int = 4096
    # None: the samples in their prepared order. E: in the order a run with data.eval_samples=E uses them (its
    # held-out samples, then its training ones in the order data.train_samples takes them), so that the cache
    # can stop after ``train_samples`` of them and serve every run on up to that many before it is finished.
    eval_samples: int | None = None
    train_samples: int | None = None  # stop once the held-out samples and this many training ones are cached


def _dataset_fingerprint(dataset: PreparedDataset) -> str:
    return hashlib.sha256(json.dumps(dataset.manifest, sort_keys=True).encode()).hexdigest()


def cache_order(n_samples: int, eval_samples: int | None) -> list[int]:
    """The sample indices in the order a cache made with ``CacheSettings.eval_samples`` holds them."""
    if eval_samples is None:
        return list(range(n_samples))
    held_out, training = training_order(n_samples, eval_samples)
    return held_out + training


def _plan_shards(dataset: PreparedDataset, settings: CacheSettings) -> list[list[int]]:
    """Sample indices per shard, in :func:`cache_order`; deterministic, so a resumed or extended run plans
    the same shards."""
    shards, current, tokens = [], [], 0
    shard_tokens = settings.shard_tokens
    for index in cache_order(len(dataset), settings.eval_samples):
        length = dataset.sample_length(index)
        if current and tokens + length > shard_tokens:
            shards.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += length
    if current:
        shards.append(current)
    return shards


def _shards_to_cache(dataset: PreparedDataset, plan: list[list[int]], settings: CacheSettings) -> int:
    """How many of ``plan``'s shards hold the held-out samples and the first ``train_samples`` training ones."""
    if settings.eval_samples is not None and not 0 <= settings.eval_samples < len(dataset):
        raise FeatureCacheError(
            f"--eval-samples {settings.eval_samples}: choose from 0 to {len(dataset) - 1} (the prepared set holds "
            f"{len(dataset)} samples)"
        )
    if settings.train_samples is None:
        return len(plan)
    if settings.eval_samples is None:
        raise FeatureCacheError("--train-samples needs --eval-samples (the data.eval_samples of the runs it serves)")
    n_training = len(dataset) - settings.eval_samples
    if not 0 < settings.train_samples <= n_training:
        raise FeatureCacheError(
            f"--train-samples {settings.train_samples}: choose from 1 to the {n_training} training samples "
            f"that --eval-samples {settings.eval_samples} leaves"
        )
    wanted, held = settings.eval_samples + settings.train_samples, 0
    for count, shard in enumerate(plan, start=1):
        held += len(shard)
        if held >= wanted:
            return count
    return len(plan)


def _batches(dataset: PreparedDataset, indices: list[int], batch_tokens: int) -> list[list[int]]:
    """Group samples so that batch size x longest sample stays within ``batch_tokens``."""
    by_length = sorted(indices, key=dataset.sample_length)
    batches, current = [], []
    for index in by_length:
        length = dataset.sample_length(index)
        if current and length * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


ARGMAX_CHUNK_ROWS = 512  # rows of full-vocabulary logits at a time (a 2,048-token sample's would be ~0.4 GB)
SCREEN_CANDIDATES = 8  # tokens a bfloat16 screen hands to the float64 check per row (more: that row in float64)
_BF16_HALF_ULP = 2.0**-8  # rounding to bfloat16 (8 significant bits) moves a value by at most this share of it
_FLOAT32_UNIT = 2.0**-24
_SMALLEST_NORMAL = 2.0**-126  # products and sums below it may be flushed to zero by bfloat16 dot products


class HeadArgmax:
    """``lm_head``'s argmax over its whole vocabulary (the first of equal maxima) for rows of features,
    ``chunk_rows`` rows at a time. Made once per batch of sequences: it may hold a float32 copy of the head.

    A float32 head, or features that are not bfloat16 values: the float32 logits' argmax (a target loaded in
    bf16 gets the tokens a float32 step computes from the stored features). A bfloat16 head on the CPU with
    bfloat16 features (``--model-dtype bfloat16`` with a bf16 cache) is screened instead, in about half the
    time: the bfloat16 product (float32 sums of exact products, rounded once; what every CPU bf16 GEMM
    computes) puts every logit within a proven distance ``D`` of its exact value, so only tokens within
    ``2D`` of the screen's best can be the argmax; their logits are then summed in float64 (exact products)
    and the largest wins. A row with more such tokens than :data:`SCREEN_CANDIDATES`, or a non-finite one,
    is computed in float64 whole. The tokens are the exact logits' argmax, which the float32 one matches
    except where two logits lie closer than float32's rounding."""

    def __init__(self, lm_head: torch.nn.Module, chunk_rows: int = ARGMAX_CHUNK_ROWS) -> None:
        self.head = lm_head
        self.chunk_rows = chunk_rows
        self._float32: torch.nn.Module | None = None
        self._largest_row_norm: float | None = None

    @torch.no_grad()
    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """(..., h) features -> (...) int32 tokens."""
        rows = features.reshape(-1, features.shape[-1])
        pick = self._screened if self._screens(rows) else self._float32_argmax
        tops = [torch.zeros(0, dtype=torch.long, device=rows.device)]
        tops += [pick(rows[start : start + self.chunk_rows]) for start in range(0, rows.shape[0], self.chunk_rows)]
        return torch.cat(tops).to(torch.int32).reshape(features.shape[:-1])

    def _screens(self, rows: torch.Tensor) -> bool:
        weight = self.head.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or rows.device.type != "cpu":
            return False  # GPU bf16 GEMMs may sum in reduced precision: the screen's bound would not hold
        return rows.dtype == torch.bfloat16 or torch.equal(rows.bfloat16().to(rows.dtype), rows)

    def _float32_argmax(self, rows: torch.Tensor) -> torch.Tensor:
        if self._float32 is None:
            is_float32 = self.head.weight.dtype == torch.float32
            self._float32 = self.head if is_float32 else copy.deepcopy(self.head).float()
        return self._float32(rows.float()).argmax(-1)

    def _screened(self, rows: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        rows = rows.bfloat16()
        screen = torch.nn.functional.linear(rows, weight)  # (R, V) bfloat16
        top = screen.topk(min(SCREEN_CANDIDATES, screen.shape[-1]), dim=-1)
        distance = self._screen_distance(rows, screen)
        best = top.values[:, 0].float()
        decided = (top.values[:, -1].float() < best - 2 * distance) & best.isfinite() & distance.isfinite()
        candidates = top.indices.sort(dim=-1).values  # ascending ids: argmax keeps the first of equal maxima
        exact = torch.einsum("rk,rck->rc", rows.double(), weight[candidates].double())
        tokens = candidates.gather(1, exact.argmax(-1, keepdim=True)).squeeze(1)
        undecided = (~decided).nonzero().squeeze(1)
        if undecided.numel():
            tokens[undecided] = (rows[undecided].double() @ weight.double().T).argmax(-1)
        return tokens

    def _screen_distance(self, rows: torch.Tensor, screen: torch.Tensor) -> torch.Tensor:
        """(R,) a bound on |screen - exact logit| over each row: its bfloat16 rounding (at most 2^-8 of
        the float32 sum, so 2^-8 / (1 - 2^-8) of the row's largest |screen|), the float32 sum's error
        (gamma_K * sum |w x| <= gamma_K * max ||w|| * ||x||, Cauchy-Schwarz) and what flushing tiny
        values to zero can lose; 1% to spare for the norms' own rounding."""
        inputs = rows.shape[-1]
        if self._largest_row_norm is None:
            self._largest_row_norm = self.head.weight.float().norm(dim=1).max().item()
        magnitude = torch.maximum(screen.amax(-1), -screen.amin(-1)).float()
        gamma = inputs * _FLOAT32_UNIT / (1 - inputs * _FLOAT32_UNIT)
        summing = gamma * self._largest_row_norm * rows.float().norm(dim=1)
        rounding = _BF16_HALF_ULP / (1 - _BF16_HALF_ULP) * magnitude
        return 1.01 * (rounding + summing) + (inputs + 1) * _SMALLEST_NORMAL


def target_argmax(
    lm_head: torch.nn.Module, features: torch.Tensor, chunk_rows: int = ARGMAX_CHUNK_ROWS
) -> torch.Tensor:
    """(..., h) features -> (...) int32: ``lm_head``'s argmax over its whole vocabulary (:class:`HeadArgmax`)."""
    return HeadArgmax(lm_head, chunk_rows)(features)


@torch.no_grad()
def target_features(
    target: Target, input_ids: list[torch.Tensor], layers: tuple[int, ...], argmax_dtype: torch.dtype | None = None
) -> list[dict[str, torch.Tensor]]:
    """Run the target over right-padded sequences; per sequence, ``feature`` (T, h) and extra layers; with
    ``argmax_dtype``, also ``target_argmax`` (T,): :func:`target_argmax` of the feature as stored in that
    dtype (what a training step reads back)."""
    model = target.model
    device = next(model.parameters()).device
    lengths = [len(ids) for ids in input_ids]
    batch = torch.zeros(len(input_ids), max(lengths), dtype=torch.long)
    attention = torch.zeros_like(batch)
    for row, ids in enumerate(input_ids):
        batch[row, : len(ids)] = ids
        attention[row, : len(ids)] = 1
    # The base model (no lm_head): its last_hidden_state is the feature, and computing V logits
    # per token would cost more than the rest of the forward on small targets.
    out = model.base_model(
        input_ids=batch.to(device), attention_mask=attention.to(device), output_hidden_states=bool(layers)
    )
    hidden = out.hidden_states
    results = []
    head = HeadArgmax(model.get_output_embeddings()) if argmax_dtype is not None else None
    for row, length in enumerate(lengths):
        item = {"feature": out.last_hidden_state[row, :length].float().cpu()}
        if head is not None:
            stored = out.last_hidden_state[row, :length].to(argmax_dtype)
            item["target_argmax"] = head(stored).cpu()
        for layer in layers:
            item[f"hidden_states.{layer}"] = hidden[layer][row, :length].float().cpu()
        results.append(item)
    return results


def _shard_bytes(
    dataset: PreparedDataset, indices: list[int], features: dict[int, dict[str, torch.Tensor]], dtype: torch.dtype
) -> bytes:
    samples = [dataset[i] for i in indices]
    offsets = [0]
    for sample in samples:
        offsets.append(offsets[-1] + len(sample.input_ids))
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in samples]).to(torch.uint8),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
    }
    for key in features[indices[0]]:
        kept = dtype if features[indices[0]][key].is_floating_point() else None  # target_argmax stays int32
        tensors[key] = torch.cat([features[i][key] for i in indices]).to(kept).contiguous()
    return save_safetensors(tensors)


def _new_manifest(dataset: PreparedDataset, target: Target, settings: CacheSettings) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "target": target.identity.to_dict(),
        "dataset": {"path": str(dataset.path), "fingerprint": _dataset_fingerprint(dataset)},
        "feature": "hidden_states[-1] (input of lm_head, after the final norm)",
        "hidden_size": target.hidden_size,
        "dtype": settings.dtype,
        "layers": list(settings.layers),
        "target_argmax": True,
        "shard_tokens": settings.shard_tokens,
        "order": {"eval_samples": settings.eval_samples},
        "shards": [],
        "complete": False,
    }


def _check_resumable(manifest: dict[str, Any], fresh: dict[str, Any], out: Path) -> None:
    for key, what in (
        ("target", "target"),
        ("dataset", "prepared dataset"),
        ("dtype", "dtype"),
        ("layers", "layers"),
        ("shard_tokens", "shard size"),
        ("order", "sample order (--eval-samples)"),
    ):
        if key == "dataset":
            same = manifest[key]["fingerprint"] == fresh[key]["fingerprint"]
        else:
            same = manifest.get(key) == fresh[key]
        if not same:
            raise FeatureCacheError(
                f"{out} holds a feature cache for another {what}; "
                "choose another --out or pass --overwrite to rebuild it"
            )


CONSECUTIVE = {"eval_samples": None}  # the order of caches written before the order was chosen


def _with_defaults(manifest: dict[str, Any]) -> dict[str, Any]:
    """A manifest as this version writes it: older caches lack ``order`` and hold the prepared order."""
    manifest.setdefault("order", dict(CONSECUTIVE))
    return manifest


def is_feature_cache(path: Path) -> bool:
    """Whether ``path`` holds a (possibly partial) cache :func:`build_feature_cache` wrote."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text(encoding="utf-8")).get("format") == CACHE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_cache_output(out: Path, prepared: Path) -> None:
    """Before the target loads: ``--out`` is never the prepared dataset (or around or inside it), and a
    non-empty one must be a feature cache (it is resumed, or with --overwrite rebuilt, in place)."""
    out = Path(out)
    check_apart_from_inputs(out, (("the prepared dataset", Path(prepared)),))
    if out.is_dir() and any(out.iterdir()) and not is_feature_cache(out):
        raise FeatureCacheError(
            f"--out {out} is not empty and is not a feature cache written by `draftsmith data cache-features`; "
            "choose another --out (--overwrite never deletes what the command did not write)"
        )


def build_feature_cache(
    dataset: PreparedDataset,
    target: Target,
    out: Path,
    settings: CacheSettings,
    overwrite: bool = False,
    on_shard: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Compute (or resume computing) the feature cache of ``dataset`` in ``out``; returns the manifest."""
    dataset.check_target(target.identity)
    out = Path(out)
    manifest = _new_manifest(dataset, target, settings)
    manifest_path = out / MANIFEST
    if manifest_path.is_file() and not overwrite:
        existing = _with_defaults(json.loads(manifest_path.read_text()))
        _check_resumable(existing, manifest, out)
        manifest["shards"] = existing["shards"]
        manifest["target_argmax"] = bool(existing.get("target_argmax"))  # its shards all have it, or none
    elif out.exists() and any(out.iterdir()) and not overwrite and not manifest_path.is_file():
        raise FeatureCacheError(f"{out} is not empty and holds no feature cache; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan_shards(dataset, settings)
    done, stop = len(manifest["shards"]), _shards_to_cache(dataset, plan, settings)
    remaining = sum(dataset.sample_length(i) for shard in plan[done:stop] for i in shard)
    _check_free_space(out, remaining, target.hidden_size, settings)
    total_tokens = sum(dataset.sample_length(i) for shard in plan[:stop] for i in shard)
    progress = tqdm(total=total_tokens, unit="tok", desc="caching features", dynamic_ncols=True)
    progress.update(min(total_tokens, int(sum(s["n_tokens"] for s in manifest["shards"]))))
    argmax_dtype = DTYPES[settings.dtype] if manifest["target_argmax"] else None
    for shard_index in range(done, stop):
        indices = plan[shard_index]
        features: dict[int, dict[str, torch.Tensor]] = {}
        for batch in _batches(dataset, indices, settings.batch_tokens):
            outputs = target_features(target, [dataset[i].input_ids for i in batch], settings.layers, argmax_dtype)
            features.update(zip(batch, outputs))
            progress.update(sum(map(dataset.sample_length, batch)))
        blob = _shard_bytes(dataset, indices, features, DTYPES[settings.dtype])
        name = f"shard-{shard_index:05d}.safetensors"
        atomic_write_bytes(out / name, blob)
        manifest["shards"].append(
            {
                "file": name,
                "sample_ids": [dataset.sample_ids[i] for i in indices],
                "n_tokens": sum(map(dataset.sample_length, indices)),
                "sha256": hashlib.sha256(blob).hexdigest(),
                "bytes": len(blob),
            }
        )
        manifest["complete"] = shard_index + 1 == len(plan)
        atomic_write_json(manifest_path, manifest)
        if on_shard:
            on_shard(shard_index)
    progress.close()
    if not plan:
        manifest["complete"] = True
        atomic_write_json(manifest_path, manifest)
    return manifest


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.1f} MB"


def _check_free_space(out: Path, tokens: int, hidden: int, settings: CacheSettings) -> None:
    """Refuse, before the first forward, a cache the disk under ``out`` cannot hold: each token stores
    (1 + extra layers) hidden vectors plus its id, mask bit and greedy token; 5% is added for headers and
    offsets."""
    per_token = (1 + len(settings.layers)) * hidden * DTYPES[settings.dtype].itemsize + 9
    needed, free = int(tokens * per_token * 1.05), shutil.disk_usage(out).free
    if needed > free:
        raise FeatureCacheError(
            f"the feature cache needs about {_size(needed)} more ({tokens:,} tokens x {per_token:,} bytes) "
            f"but {out} has {_size(free)} free; free space, store --dtype bf16 or fewer --layers, or choose "
            "another --out"
        )


class FeatureCache:
    """Read access to a feature cache; each shard is checked against its manifest checksum when read."""

    def __init__(self, path: Path, require_complete: bool = True) -> None:
        self.path = Path(path)
        try:
            self.manifest = _with_defaults(json.loads((self.path / MANIFEST).read_text()))
        except FileNotFoundError:
            raise FeatureCacheError(
                f"{self.path} is not a feature cache (no {MANIFEST}); make one with "
                "`draftsmith data cache-features PREPARED_DIR --out DIR`"
            ) from None
        except json.JSONDecodeError as exc:
            raise FeatureCacheError(
                f"{self.path}/{MANIFEST} is damaged ({exc.msg}); rebuild with --overwrite"
            ) from None
        if self.manifest.get("format") != CACHE_FORMAT:
            raise FeatureCacheError(f"{self.path} has format {self.manifest.get('format')!r}, expected {CACHE_FORMAT}")
        if require_complete and not self.manifest["complete"]:
            raise FeatureCacheError(
                f"{self.path} is incomplete ({len(self.manifest['shards'])} shards); "
                "run the same cache-features command again to finish it"
            )
        self._index = [
            (s, k) for s, shard in enumerate(self.manifest["shards"]) for k in range(len(shard["sample_ids"]))
        ]
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None

    @property
    def identity(self) -> TargetIdentity:
        return TargetIdentity.from_dict(self.manifest["target"])

    @property
    def n_tokens(self) -> int:
        return int(sum(s["n_tokens"] for s in self.manifest["shards"]))

    @property
    def eval_order(self) -> int | None:
        """The ``--eval-samples`` this cache was made in the order of (None: the prepared order)."""
        return self.manifest["order"]["eval_samples"]

    @property
    def n_bytes(self) -> int:
        return int(sum(s["bytes"] for s in self.manifest["shards"]))

    def check_target(self, identity: TargetIdentity) -> None:
        problem = self.identity.mismatch(identity)
        if problem:
            raise FeatureCacheError(f"{self.path} was cached for another target: {problem}; cache features again")

    def load_shard(self, shard_index: int) -> dict[str, torch.Tensor]:
        entry = self.manifest["shards"][shard_index]
        path = self.path / entry["file"]
        if not path.is_file():
            raise FeatureCacheError(f"{path} is missing; run cache-features again with --overwrite")
        blob = path.read_bytes()
        if len(blob) != entry["bytes"]:
            raise FeatureCacheError(
                f"{path} is truncated or padded ({len(blob)} bytes, manifest says {entry['bytes']}); "
                "rebuild the cache with --overwrite"
            )
        if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
            raise FeatureCacheError(
                f"{path} does not match its checksum (modified after writing); rebuild with --overwrite"
            )
        return load_safetensors(blob)

    def verify(self) -> None:
        """Read and check every shard (what ``draftsmith data cache-features --verify`` does)."""
        for shard_index in range(len(self.manifest["shards"])):
            self.load_shard(shard_index)

    def __len__(self) -> int:
        return len(self._index)

    def rows(self, n_samples: int) -> list[int | None]:
        """The row holding each of the prepared dataset's ``n_samples`` samples (by index), None where the cache
        does not (yet) hold it: a cache made with ``--eval-samples`` holds them in :func:`cache_order`."""
        rows: list[int | None] = [None] * n_samples
        order = cache_order(n_samples, self.eval_order)
        for row, index in enumerate(order[: len(self)]):
            rows[index] = row
        return rows

    def shard_of(self, row: int) -> int:
        return self._index[row][0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        shard_index, k = self._index[index]
        if self._loaded is None or self._loaded[0] != shard_index:
            self._loaded = (shard_index, self.load_shard(shard_index))
        tensors = self._loaded[1]
        start, end = int(tensors["offsets"][k]), int(tensors["offsets"][k + 1])
        item: dict[str, Any] = {"id": self.manifest["shards"][shard_index]["sample_ids"][k]}
        for key, value in tensors.items():
            if key != "offsets":
                item[key] = value[start:end]
        item["input_ids"] = item["input_ids"].long()
        item["loss_mask"] = item["loss_mask"].long()
        return item
