"""Training data for the generic trainer: which samples each rank reads at each step, deterministically.

The sample order depends only on ``(seed, epoch)``, never on the number of processes: optimizer step
``s`` reads global batch ``s`` of the epoch's order (``batch_size x world x grad_accum`` samples),
and micro-batch ``m`` of rank ``r`` is its chunk ``m * world + r``. So a run resumed at step ``k``
reads exactly what the uninterrupted run read, and one process with ``grad_accum=2`` reads the same
micro-batches as two processes with ``grad_accum=1``.

Offline (feature cache), samples are shuffled shard by shard (shard order, then order within the
shard), so a rank keeps one shard in memory instead of reading one per sample.

With ``length_group`` (the micro-batch size; ``data.group_by_length``), each micro-batch holds samples
of similar length, so right-padding wastes little compute: windows of ``LENGTH_WINDOW`` micro-batches of
the shuffled order are sorted by length and cut into micro-batches, which are then shuffled (HF's
``group_by_length``). It stays a function of ``(seed, epoch)`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from draftsmith.core.target import TargetIdentity
from draftsmith.data.features import FeatureCache, FeatureCacheError, _dataset_fingerprint
from draftsmith.data.prepared import PreparedDataError, PreparedDataset, sample_digest, training_order
from draftsmith.train.batch import TrainBatch

# Micro-batches sorted together by length: more means less padding but batches less mixed in length.
LENGTH_WINDOW = 32


@dataclass(frozen=True)
class BatchPlan:
    """Sizes of one optimizer step."""

    batch_size: int  # samples per micro-batch per rank
    world_size: int
    grad_accum: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.grad_accum

    def micro_batch(self, global_indices: list[int], micro: int, rank: int) -> list[int]:
        chunk = micro * self.world_size + rank
        return global_indices[chunk * self.batch_size : (chunk + 1) * self.batch_size]


def open_prepared(path: str, identity: TargetIdentity) -> PreparedDataset:
    """The recipe's prepared dataset, checked against the target it will be trained for."""
    directory = Path(path)
    if not directory.exists():
        raise PreparedDataError(
            f"data.prepared: {directory} does not exist; make it with "
            f"`draftsmith data prepare [INPUT] --out {directory} --target {identity.name}` "
            "(INPUT defaults to the bundled dataset)"
        )
    dataset = PreparedDataset(directory)
    dataset.check_target(identity)
    return dataset


def open_feature_cache(
    path: str, prepared: PreparedDataset, identity: TargetIdentity, hidden: int, layers: tuple[int, ...] = (-1,)
) -> FeatureCache:
    """The recipe's feature cache: for this target, for this prepared dataset, this hidden
    size, holding the target states ``layers`` (``hidden_states`` indices; -1 = the feature)."""
    cache = FeatureCache(Path(path), require_complete=False)  # TrainData checks it holds the samples a run uses
    cache.check_target(identity)
    if cache.manifest["dataset"]["fingerprint"] != _dataset_fingerprint(prepared):
        raise FeatureCacheError(
            f"data.features: {path} was cached from another prepared dataset than {prepared.path}; "
            f"run `draftsmith data cache-features {prepared.path} --out {path} --overwrite`"
        )
    if int(cache.manifest["hidden_size"]) != hidden:
        raise FeatureCacheError(
            f"data.features: {path} holds features of size {cache.manifest['hidden_size']}, "
            f"the target's hidden size is {hidden}; cache features again"
        )
    missing = [layer for layer in layers if layer != -1 and layer not in cache.manifest["layers"]]
    if missing:
        wanted = ",".join(str(layer) for layer in layers if layer != -1)
        raise FeatureCacheError(
            f"data.features: {path} lacks the target states {missing} this drafter reads; run "
            f"`draftsmith data cache-features {prepared.path} --out {path} --layers {wanted} --overwrite`"
        )
    return cache


def state_key(layer: int) -> str:
    """The feature cache's name for ``hidden_states[layer]`` (-1 is the feature itself)."""
    return "feature" if layer == -1 else f"hidden_states.{layer}"


def drafter_states(states: dict[int, torch.Tensor], layers: tuple[int, ...]) -> torch.Tensor:
    """``layers``' states concatenated on the last axis (the one tensor itself when there is one)."""
    return states[layers[0]] if len(layers) == 1 else torch.cat([states[layer] for layer in layers], dim=-1)


@dataclass
class TrainData:
    """Samples of a prepared dataset (online) or of its feature cache (offline), split and ordered."""

    prepared: PreparedDataset
    cache: FeatureCache | None = None
    max_length: int | None = None
    eval_samples: int = 0
    layers: tuple[int, ...] = (-1,)  # the target states the drafter reads (its config's feature_layers())
    length_group: int = 0  # micro-batch size whose samples are grouped by length (0: plain shuffle)
    train_samples: int | None = None  # train on this many of the training samples (None: all)
    train_indices: list[int] = field(init=False)
    eval_indices: list[int] = field(init=False)
    _order: tuple[int, list[int]] | None = field(default=None, init=False, repr=False)
    _cache_rows: list[int | None] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        n = len(self.prepared)
        if self.eval_samples >= n:
            raise PreparedDataError(f"data.eval_samples={self.eval_samples} leaves no training sample ({n} in total)")
        self.eval_indices, order = training_order(n, self.eval_samples)
        count = len(order) if self.train_samples is None else self.train_samples
        if not 0 < count <= len(order):
            raise PreparedDataError(
                f"data.train_samples={count}: choose from 1 to the {len(order)} training samples of this prepared set"
            )
        # one prepared set and one feature cache serve a whole data-scaling study (see training_order)
        self.train_indices = sorted(order[:count])
        if self.cache is not None:
            self._cache_rows = self.cache.rows(n)
            self._check_cached(self.eval_indices + self.train_indices, count)

    def _check_cached(self, needed: list[int], count: int) -> None:
        missing = sum(self._cache_rows[i] is None for i in needed)
        if not missing:
            return
        command = f"draftsmith data cache-features {self.prepared.path} --out {self.cache.path}"
        order = self.cache.eval_order
        if order is None:
            fix = "run the cache-features command that made it again to finish it"
        elif order != self.eval_samples:
            fix = (
                f"it was cached in the order of data.eval_samples={order}: train with that, or finish it with "
                f"`{command} --eval-samples {order}` and its other options"
            )
        else:
            subset = f" --train-samples {count}" if self.train_samples is not None else ""
            fix = f"add them with `{command} --eval-samples {order}{subset}` and the cache's other options"
        raise FeatureCacheError(
            f"data.features: {self.cache.path} lacks the features of {missing:,} of the {len(needed):,} samples "
            f"this run uses; {fix}"
        )

    @property
    def offline(self) -> bool:
        return self.cache is not None

    def held_out_copies(self) -> int:
        """Held-out samples whose tokens and loss mask equal a training sample's. `data prepare` drops
        such copies now; a set prepared before it did keeps them, and self-distilled data repeats
        wherever its prompts do, so a drafter is scored on answers it trained on."""

        def key(index: int) -> bytes:
            sample = self.prepared[index]
            return sample_digest(sample.input_ids, sample.loss_mask)

        if not self.eval_indices:
            return 0
        trained = {key(i) for i in self.train_indices}
        return sum(key(i) in trained for i in self.eval_indices)

    def steps_per_epoch(self, plan: BatchPlan) -> int:
        steps = len(self.train_indices) // plan.global_batch
        if steps == 0:
            raise PreparedDataError(
                f"{len(self.train_indices)} training samples are fewer than one global batch "
                f"(batch_size {plan.batch_size} x {plan.world_size} processes x grad_accum {plan.grad_accum}); "
                "lower train.batch_size or train.grad_accum, or prepare more data"
            )
        return steps

    def epoch_order(self, seed: int, epoch: int) -> list[int]:
        """The training samples in the order epoch ``epoch`` reads them (memoised for the current epoch)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        rng = np.random.default_rng([seed, epoch])
        groups = self._shard_groups()
        order = [
            index
            for g in rng.permutation(len(groups))
            for index in self._grouped_by_length([groups[g][i] for i in rng.permutation(len(groups[g]))], rng)
        ]
        self._order = (epoch, order)
        return order

    def _grouped_by_length(self, shuffled: list[int], rng: np.random.Generator) -> list[int]:
        """``shuffled`` with every micro-batch of similar lengths (see the module doc); unchanged when
        ``length_group`` is 0."""
        size = self.length_group
        if not size:
            return shuffled
        window = size * LENGTH_WINDOW
        batches = []
        for start in range(0, len(shuffled), window):
            ordered = sorted(shuffled[start : start + window], key=self._length)
            batches += [ordered[i : i + size] for i in range(0, len(ordered), size)]
        return [index for b in rng.permutation(len(batches)) for index in batches[b]]

    def _length(self, index: int) -> int:
        length = self.prepared.sample_length(index)
        return length if self.max_length is None else min(length, self.max_length)

    def _shard_groups(self) -> list[list[int]]:
        if self.cache is None:
            return [self.train_indices]
        groups: dict[int, list[int]] = {}
        for index in self.train_indices:
            groups.setdefault(self.cache.shard_of(self._cache_rows[index]), []).append(index)
        return [groups[k] for k in sorted(groups)]

    def global_batch(self, step: int, plan: BatchPlan, seed: int) -> list[int]:
        """Sample indices of optimizer step ``step`` (0-based), over all ranks and micro-batches."""
        per_epoch = self.steps_per_epoch(plan)
        epoch, position = divmod(step, per_epoch)
        order = self.epoch_order(seed, epoch)
        return order[position * plan.global_batch : (position + 1) * plan.global_batch]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token is supervised in the training samples: (vocab_size,) long."""
        if self.train_samples is not None:
            return self._supervised_counts(self.train_indices, vocab_size)
        ids, mask = self.prepared.input_ids.long(), self.prepared.loss_mask.bool()
        # held-out samples must not shape the drafter
        return torch.bincount(ids[mask], minlength=vocab_size) - self._supervised_counts(self.eval_indices, vocab_size)

    def _supervised_counts(self, indices: list[int], vocab_size: int) -> torch.Tensor:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for index in indices:
            sample = self.prepared[index]
            counts += torch.bincount(sample.input_ids[sample.loss_mask.bool()].long(), minlength=vocab_size)
        return counts

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor, dict[int | str, torch.Tensor] | None]:
        """(input_ids, loss_mask, {layer: cached state} or None) of one sample, cut to ``max_length``;
        the states are the feature (-1) and :attr:`layers`, and ``"target_argmax"`` where the cache
        holds the target's greedy tokens."""
        if self.cache is not None:
            item = self.cache[self._cache_rows[index]]
            ids, mask = item["input_ids"], item["loss_mask"]
            states = {layer: item[state_key(layer)] for layer in {-1, *self.layers}}
            if "target_argmax" in item:
                states["target_argmax"] = item["target_argmax"]
        else:
            item = self.prepared[index]
            ids, mask, states = item.input_ids, item.loss_mask, None
        if self.max_length is not None:
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            states = None if states is None else {k: v[: self.max_length] for k, v in states.items()}
        return ids, mask, states

    def collate(self, indices: list[int]) -> TrainBatch:
        """A right-padded batch; offline batches carry the cached states as float32."""
        samples = [self.sample(i) for i in indices]
        width = max(len(ids) for ids, _, _ in samples)
        input_ids = torch.zeros(len(samples), width, dtype=torch.long)
        loss_mask = torch.zeros(len(samples), width, dtype=torch.float32)
        attention_mask = torch.zeros(len(samples), width, dtype=torch.long)
        padded = None
        if self.offline:
            shapes = {key: state.shape[1:] for key, state in samples[0][2].items()}  # () for target_argmax
            padded = {key: torch.zeros(len(samples), width, *shape) for key, shape in shapes.items()}
        for row, (ids, mask, states) in enumerate(samples):
            length = len(ids)
            input_ids[row, :length] = ids
            loss_mask[row, :length] = mask.float()
            attention_mask[row, :length] = 1
            for key, state in (states or {}).items():
                padded[key][row, :length] = state.float()
        if padded is None:
            return TrainBatch(input_ids, loss_mask, attention_mask)
        argmax = padded.pop("target_argmax", None)
        return TrainBatch(
            input_ids,
            loss_mask,
            attention_mask,
            padded[-1],
            drafter_states(padded, self.layers),
            None if argmax is None else argmax.long(),
        )


@torch.no_grad()
def online_features(
    target_model: torch.nn.Module, batch: TrainBatch, layers: tuple[int, ...] = (-1,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The feature ``hidden_states[-1]`` (input of ``lm_head``) of a right-padded batch and the
    states ``layers`` concatenated (:attr:`TrainBatch.drafter_states`), float32.

    The base model only: its ``last_hidden_state`` is the feature, and the ``lm_head`` logits would
    cost more than the rest of the forward on small targets (same definition as the feature cache)."""
    extra = any(layer != -1 for layer in layers)
    out = target_model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=extra
    )
    feature = out.last_hidden_state.float()
    states = {layer: feature if layer == -1 else out.hidden_states[layer].float() for layer in layers}
    return feature, drafter_states(states, layers)
