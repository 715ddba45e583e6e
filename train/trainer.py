"""The one training loop, shared by every drafter family.

A family contributes its model (``family.build``) and its loss (``train.losses.family_loss``); the loop
owns everything else: accelerate (one CPU, DDP, or DeepSpeed ZeRO through ``accelerate launch``),
AdamW with warmup and decay, gradient accumulation and clipping, online or offline features, the
NaN guard, tracking, held-out evaluation and exact resume from atomic checkpoints.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_write_json, check_apart_from_inputs, check_creatable_directory
from draftsmith.core.lock import exclusive_output
from draftsmith.core.malloc import return_freed_memory_if_low
from draftsmith.core.target import TargetIdentity, load_target
from draftsmith.core.versions import warn_about_untested_versions
from draftsmith.drafters.base import DrafterModel, FrozenTarget
from draftsmith.drafters.io import check_drafter_target, read_drafter_config
from draftsmith.drafters.registry import get_family
from draftsmith.train.batch import TrainBatch
from draftsmith.train.checkpoint import (
    RESOLVED_RECIPE,
    RUN_INFO,
    TrainingError,
    checkpoints_dir,
    complete_checkpoints,
    load_checkpoint,
    read_run_info,
    read_state,
    save_checkpoint,
)
from draftsmith.train.data_identity import data_change, data_identity
from draftsmith.train.loader import BatchPlan, TrainData, online_features, open_feature_cache, open_prepared
from draftsmith.train.losses import family_loss
from draftsmith.train.recipe import TrainRecipe, TrainSection
from draftsmith.train.recipe_loader import RecipeError, save_resolved, to_tree
from draftsmith.train.resume import ResumeCandidates, next_intact_checkpoint, report_resume_point, starting_checkpoint
from draftsmith.train.tracking import Tracker

warn_about_untested_versions()


@dataclass
class TrainResult:
    output_dir: Path
    step: int  # optimizer steps done
    checkpoint: Path | None  # the last complete checkpoint
    metrics: dict[str, float]  # the last logged figures


def uses_deepspeed() -> bool:
    """``accelerate launch`` with a DeepSpeed config says so in the environment."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in {"1", "true", "yes"}


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


BF16_HINT = (
    "note: this CPU multiplies bfloat16 in hardware; train.mixed_precision=bf16 trained 1.2-1.6x faster on such "
    "a CPU (a Zen 4 EPYC) at equal held-out acceptance (docs/training.md#throughput); auto keeps float32 on a CPU"
)


def build_accelerator(train: TrainSection) -> Any:
    """An ``Accelerator`` for this machine. On a CPU-only machine DeepSpeed needs its CPU accelerator
    and the gloo backend named before the accelerator exists, else accelerate runs it as one process."""
    from accelerate import Accelerator, PartialState

    on_cpu = not torch.cuda.is_available()
    if uses_deepspeed() and on_cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        PartialState(backend="gloo")
    precision = train.mixed_precision
    if precision == "auto":
        precision = "no" if on_cpu else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        if on_cpu and native_bf16_cpu() and is_launch_main_process():
            print(BF16_HINT, file=sys.stderr)
    accelerator = Accelerator(
        mixed_precision=precision,
        gradient_accumulation_steps=train.grad_accum,
        step_scheduler_with_optimizer=False,  # the loop steps the scheduler once per optimizer step
    )
    accelerator.gradient_accumulation_steps = train.grad_accum  # the launcher's env may have said otherwise
    return accelerator


def _configure_deepspeed(accelerator: Any, train: TrainSection, plan: BatchPlan) -> None:
    """The recipe decides batch sizes, accumulation and clipping; the accelerate config only ZeRO."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = plan.batch_size
    config["gradient_accumulation_steps"] = plan.grad_accum
    config["train_batch_size"] = plan.global_batch
    config["gradient_clipping"] = float(train.grad_clip or 0.0)


@contextmanager
def _not_partitioned(accelerator: Any) -> Iterator[None]:
    """Loads the frozen target whole on every rank. Under ZeRO-3 transformers' ``from_pretrained``
    partitions every model it builds (``deepspeed.zero.Init``) while accelerate's DeepSpeed config is
    registered with it, and only the model handed to DeepSpeed is gathered back for its forward: the
    frozen target, outside the engine, would keep empty weights. accelerate 1.15's own switch
    (``zero3_init_context_manager(enable=False)``) registers the config again, so it is unregistered
    here, the transformers way, and restored after."""
    from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

    plugin = accelerator.state.deepspeed_plugin
    registered = getattr(plugin, "dschf", None)  # accelerate keeps the registered config alive here
    if registered is None:
        yield
        return
    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        set_hf_deepspeed_config(registered)


def warmup_limit(total_steps: int) -> int:
    """The longest warm-up a run of ``total_steps`` takes: one that ends before its last step, so the last
    trains at train.lr (a longer one never reaches it: 10**12 steps of it train 2 steps at 1e-16 of it)."""
    return max(total_steps - 1, 0)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSection, total_steps: int) -> Any:
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    warmup = min(train.warmup_steps, warmup_limit(total_steps))
    if train.scheduler == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    schedule = get_linear_schedule_with_warmup if train.scheduler == "linear" else get_cosine_schedule_with_warmup
    return schedule(optimizer, warmup, total_steps)


def optimizer_groups(model: DrafterModel, train: TrainSection) -> list[dict[str, Any]]:
    """AdamW's parameter groups: the drafter's :meth:`~DrafterModel.parameter_groups` in their declared
    order (a resumed run's saved optimizer state is matched to groups by position), trainable
    parameters only, each at ``train.lr`` times its ``train.lr_scale``; groups left empty are dropped."""
    declared = model.parameter_groups()
    seen: set[int] = set()
    groups = []
    for name, params in declared.items():
        # A family's own mistake, not the user's: say which hook to fix.
        if name not in model.PARAMETER_GROUPS:
            raise TrainingError(f"{type(model).__name__}.parameter_groups() gives {name!r}, not in PARAMETER_GROUPS")
        if any(id(p) in seen for p in params):
            raise TrainingError(f"{type(model).__name__}.parameter_groups() puts a parameter in two groups")
        seen.update(id(p) for p in params)
        trainable = [p for p in params if p.requires_grad]
        if trainable:
            scale = float(train.lr_scale.get(name, 1.0))
            groups.append({"params": trainable, "lr": train.lr * scale, "name": name, "lr_scale": scale})
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise TrainingError(f"{type(model).__name__}.parameter_groups() leaves out {', '.join(missing[:3])}")
    return groups


@contextmanager
def _preserved_rng() -> Iterator[None]:
    """Evaluation must not move the training RNG, or a resumed run would draw different noise."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class Trainer:
    """One run of a recipe; ``run()`` trains to ``train.max_steps`` (or ``train.epochs``)."""

    def __init__(self, recipe: TrainRecipe, resume: bool = False, resume_inexact: bool = False) -> None:
        self.recipe = recipe
        self.output_dir = Path(recipe.output_dir)
        self.accelerator = build_accelerator(recipe.train)
        self.is_main = self.accelerator.is_main_process
        self.checkpoint = starting_checkpoint(recipe, self.output_dir, resume or recipe.train.resume, self.is_main)
        self.inexact = resume_inexact or recipe.train.resume_inexact
        # an output_dir that cannot take a checkpoint fails now, before the target loads, not at the first save
        check_creatable_directory(self.output_dir, inside=True, option="output_dir")
        self.data_identity = data_identity(recipe.data)
        self.data_changes = self._check_same_data() if self.checkpoint is not None else []
        if self.checkpoint is not None:  # before the target loads: a refused resume costs nothing
            self.candidates = ResumeCandidates(list(reversed(complete_checkpoints(self.output_dir))))
            self.checkpoint = self._next_checkpoint()
        self._load_target_and_data()
        self._build_model()
        # real (unpadded) tokens of every step so far, over all ranks: what a scaling curve is plotted against;
        # None after resuming a checkpoint written before it was recorded
        self.tokens_seen: int | None = 0
        self.start_step = self._restore() if self.checkpoint else 0
        if self.is_main:
            save_resolved(recipe, self.output_dir, RESOLVED_RECIPE)
            atomic_write_json(self.output_dir / RUN_INFO, self.run_info())
        self.accelerator.wait_for_everyone()

    # ---- setup -----------------------------------------------------------------------------
    def _check_same_data(self) -> list[dict[str, Any]]:
        """A resume goes on with the data the run started on (compared by content, not path), or with
        train.resume_new_data; returns the run's record of changed data, this one added."""
        try:
            earlier = read_run_info(self.output_dir)
        except (OSError, ValueError):  # a damaged record vouches for nothing: the run is resumed as before records
            earlier = {}
        started, changes = earlier.get("data"), list(earlier.get("data_changes", []))
        change = data_change(started, self.data_identity) if started else None  # a run from before records
        if change is None:
            return changes
        if not self.recipe.train.resume_new_data:
            raise TrainingError(
                f"cannot resume {self.output_dir}: {change}; resume with the data it started on, pass "
                "--resume-new-data (train.resume_new_data=true) to go on with this data, or use another output_dir"
            )
        if self.is_main:
            tqdm.write(f"draftsmith: going on with new data: {change}")
        return [*changes, {"at": self.checkpoint.name, "change": change, "before": started}]

    def _load_target_and_data(self) -> None:
        recipe, device = self.recipe, self.accelerator.device
        self.family = get_family(recipe.family_name)
        self.loss = family_loss(self.family)
        with _not_partitioned(self.accelerator):
            self.target = load_target(recipe.target.name, dtype=recipe.target.dtype)
        self.target.model.requires_grad_(False)
        prepared = open_prepared(recipe.data.prepared, self.target.identity)
        # the target states the drafter reads: its config's one declaration
        self.layers = recipe.feature_layers(self.target.model.config)
        cache = None
        if recipe.data.features:
            cache = open_feature_cache(
                recipe.data.features, prepared, self.target.identity, self.target.hidden_size, self.layers
            )
        elif self.family.needs_features:
            self.target.model.to(device)  # online: the frozen target computes features inside the step
        length_group = recipe.train.batch_size if recipe.data.group_by_length else 0
        self.data = TrainData(
            prepared,
            cache,
            recipe.data.max_length,
            recipe.data.eval_samples,
            self.layers,
            length_group,
            recipe.data.train_samples,
        )
        self._warn_about_held_out_copies()
        self.frozen = FrozenTarget.from_model(self.target.model)
        self.frozen.embed_tokens.to(device)
        self.frozen.lm_head.to(device)
        self.plan = BatchPlan(recipe.train.batch_size, self.accelerator.num_processes, recipe.train.grad_accum)
        self.steps_per_epoch = self.data.steps_per_epoch(self.plan)
        self.total_steps = recipe.train.max_steps or recipe.train.epochs * self.steps_per_epoch
        if recipe.train.warmup_steps > warmup_limit(self.total_steps) and self.is_main:
            tqdm.write(
                f"draftsmith: note: train.warmup_steps={recipe.train.warmup_steps} is longer than the run's "
                f"{self.total_steps} steps; it warms up over {warmup_limit(self.total_steps)}, so that the last "
                "step trains at train.lr",
                file=sys.stderr,
            )

    def _warn_about_held_out_copies(self) -> None:
        copies = self.data.held_out_copies() if self.accelerator.is_main_process else 0
        if copies:
            tqdm.write(
                f"draftsmith: warning: {copies} of the {len(self.data.eval_indices)} held-out samples have an exact "
                f"copy among the training samples, so held-out acceptance is inflated; run `draftsmith data prepare` "
                f"again (it now drops duplicates)",
                file=sys.stderr,
            )

    def _build_model(self) -> None:
        from accelerate.utils import set_seed

        train = self.recipe.train
        set_seed(train.seed)  # the same initial weights on every rank
        target_weights = sum(p.numel() for p in self.target.model.parameters())  # an absurd size: one line, first
        model = self.family.build(self.target.model.config, self.recipe.drafter_options, target_weights)
        model.fit_data(self.data.token_counts(int(self.target.model.config.vocab_size)))  # e.g. a draft vocabulary
        model.init_from_target(self.frozen)  # after fit_data: Medusa heads copy lm_head's draft-vocabulary rows
        if train.init_from:  # a finished run's weights (a resumed run's checkpoint still overrides them)
            self._load_initial_weights(model, Path(train.init_from))
        if model.runs_inside_target:  # LoRA families train inside the target, on the run's device
            model.attach_target(self.target.model.to(self.accelerator.device))
        groups = optimizer_groups(model, train)
        # by position: loading a checkpoint's optimizer state replaces the group dicts with the saved ones
        self.group_scales = [(group["name"], group["lr_scale"]) for group in groups]
        self.n_trainable = sum(p.numel() for group in groups for p in group["params"])
        optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay)
        scheduler = build_scheduler(optimizer, train, self.total_steps)
        _configure_deepspeed(self.accelerator, train, self.plan)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        for group in self.optimizer.param_groups:  # accelerate's CPU-offload optimizer swap drops the betas
            group["betas"] = tuple(train.betas)
        self.model.train()
        set_seed(train.seed + self.accelerator.process_index)  # per-rank stream for noise in the loss

    def _load_initial_weights(self, model: torch.nn.Module, directory: Path) -> None:
        """``train.init_from``: an exported drafter of this family (or one it starts from), made for this target."""
        config = read_drafter_config(directory)
        accepted = (self.family.name, *self.family.starts_from)
        if config["drafter_family"] not in accepted:
            raise RecipeError(
                f"train.init_from: {directory} holds a {config['drafter_family']!r} drafter; "
                f"a {self.family.name!r} run starts from {' or '.join(map(repr, accepted))}"
            )
        check_drafter_target(config, self.target, directory)
        fresh = model.load_initial_weights(directory)
        if fresh and self.is_main:
            shown = ", ".join(fresh[:3]) + (f" and {len(fresh) - 3} more" if len(fresh) > 3 else "")
            tqdm.write(f"draftsmith: started from {directory}; {len(fresh)} tensors start fresh: {shown}")

    def _next_checkpoint(self) -> Path:
        process = self.accelerator.process_index
        checkpoint = next_intact_checkpoint(self.candidates, self.output_dir, process, self.inexact)
        if self.is_main:
            report_resume_point(checkpoint, self.candidates, self.output_dir, self.inexact)
        return checkpoint

    def _restore(self) -> int:
        """Load the chosen checkpoint; one that fails to load (a file damaged in a way its recorded
        sizes and hashes cannot tell, or a checkpoint saved before they were recorded) gives way to
        the previous intact one, said in one line."""
        while True:
            try:
                return self._restore_from(self.checkpoint)
            except DraftsmithError:
                raise
            except Exception as error:  # torch / accelerate / safetensors errors of a damaged file
                detail = str(error).splitlines()[0].split(". ")[0] if str(error) else ""
                self.candidates.skipped.append(f"{self.checkpoint} cannot be loaded ({type(error).__name__}: {detail})")
                self.checkpoint = self._next_checkpoint()

    def _restore_from(self, checkpoint: Path) -> int:
        state = read_state(checkpoint)
        if state["world_size"] != self.plan.world_size or state["global_batch"] != self.plan.global_batch:
            raise TrainingError(
                f"{self.checkpoint} was written by {state['world_size']} processes with global batch "
                f"{state['global_batch']}; resume with the same number of processes "
                f"(now {self.plan.world_size}, global batch {self.plan.global_batch})"
            )
        problem = TargetIdentity.from_dict(state["target_identity"]).mismatch(self.target.identity)
        if problem:
            raise TrainingError(f"{self.checkpoint} was trained for another target: {problem}")
        try:
            load_checkpoint(self.accelerator, self.checkpoint)
        except ValueError as error:  # torch's words for an optimizer state of other parameter groups
            if "parameter group" not in str(error):
                raise
            raise TrainingError(
                f"{self.checkpoint} holds an optimizer state for other parameter groups than this drafter's "
                f"({', '.join(name for name, _ in self.group_scales)}); it was written by an older draftsmith: "
                "start a new run, e.g. with train.init_from an export of it"
            ) from None
        if self.is_main:
            tqdm.write(f"draftsmith: resumed from {self.checkpoint} (step {state['step']})")
        self.tokens_seen = state.get("tokens_seen")
        return int(state["step"])

    @property
    def deepspeed(self) -> bool:
        return self.accelerator.state.deepspeed_plugin is not None

    def run_info(self) -> dict[str, Any]:
        plugin = self.accelerator.state.deepspeed_plugin
        return {
            "family": self.family.name,
            "world_size": self.plan.world_size,
            "distributed_type": str(self.accelerator.distributed_type),
            "deepspeed_zero_stage": plugin.zero_stage if plugin else None,
            "mixed_precision": str(self.accelerator.mixed_precision),
            "device": str(self.accelerator.device),
            "features": "offline" if self.data.offline else "online",
            "global_batch": self.plan.global_batch,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "train_samples": len(self.data.train_indices),
            "eval_samples": len(self.data.eval_indices),
            "trainable_parameters": self.n_trainable,
            "target_identity": self.target.identity.to_dict(),
            "data": self.data_identity,
            **({"data_changes": self.data_changes} if self.data_changes else {}),
        }

    # ---- one step --------------------------------------------------------------------------
    def _batch(self, indices: list[int]) -> TrainBatch:
        batch = self.data.collate(indices).to(self.accelerator.device)
        if batch.hidden_states is None and self.family.needs_features:
            batch.hidden_states, batch.drafter_states = online_features(self.target.model, batch, self.layers)
        return batch

    def _autocast(self) -> Any:
        precision = str(self.accelerator.mixed_precision)
        if precision not in {"bf16", "fp16"}:
            return nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.accelerator.device.type, dtype=dtype)

    def _global_mean(self, loss: torch.Tensor, tokens: int) -> tuple[float, int]:
        """The loss averaged over ranks and the tokens summed over ranks (one all-reduce)."""
        device = self.accelerator.device
        values = torch.tensor([float(loss.detach()), float(tokens)], dtype=torch.float64, device=device)
        total = self.accelerator.reduce(values, reduction="sum")
        return float(total[0]) / self.plan.world_size, int(total[1])

    def train_step(self, step: int) -> dict[str, float]:
        """Optimizer step ``step`` (0-based) over its global batch; returns the figures to log."""
        indices = self.data.global_batch(step, self.plan, self.recipe.train.seed)
        losses, tokens, metrics = [], 0, defaultdict(list)
        for micro in range(self.plan.grad_accum):
            batch = self._batch(self.plan.micro_batch(indices, micro, self.accelerator.process_index))
            with self.accelerator.accumulate(self.model):
                with self._autocast():
                    out = self.loss(self.model, batch, self.frozen, **self.recipe.loss)
                loss, micro_tokens = self._global_mean(out.loss, int(batch.attention_mask.sum()))
                if not math.isfinite(loss):
                    raise TrainingError(
                        f"the loss is {loss} at step {step + 1} (micro-batch {micro + 1}); stopped before the "
                        "update, so the last checkpoint is intact: lower train.lr or check the data"
                    )
                self.accelerator.backward(out.loss)
                if self.accelerator.sync_gradients and self.recipe.train.grad_clip and not self.deepspeed:
                    self.accelerator.clip_grad_norm_(self.model.parameters(), self.recipe.train.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad()
            losses.append(loss)
            tokens += micro_tokens
            for key, value in out.metrics.items():
                metrics[key].append(float(value))
        figures = {"loss": sum(losses) / len(losses), **self._learning_rates(), "tokens": tokens}
        self.scheduler.step()
        figures.update({key: sum(values) / len(values) for key, values in metrics.items()})
        return figures

    def _learning_rates(self) -> dict[str, float]:
        """``lr`` (the schedule's rate for ``train.lr``) and ``lr/{group}`` for each optimizer group."""
        current = [float(group["lr"]) for group in self.optimizer.param_groups]
        rates = {f"lr/{name}": lr for (name, _), lr in zip(self.group_scales, current)}
        return {"lr": current[0] / self.group_scales[0][1], **rates}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and metrics over the held-out samples, averaged over ranks weighted by samples."""
        indices, per_round = self.data.eval_indices, self.plan.batch_size * self.plan.world_size
        if not indices:
            return {}
        self.model.eval()
        sums: dict[str, float] = defaultdict(float)
        with _preserved_rng():
            for start in range(0, len(indices), per_round):
                chunk = indices[start : start + per_round]
                mine = chunk[self.accelerator.process_index :: self.plan.world_size]
                weight = len(mine)  # a rank with nothing left runs a dummy batch (ZeRO-3 needs every rank)
                with self._autocast():
                    out = self.loss(self.model, self._batch(mine or chunk[:1]), self.frozen, **self.recipe.loss)
                sums["eval/loss"] += weight * float(out.loss)
                for key, value in out.metrics.items():
                    sums[f"eval/{key}"] += weight * float(value)
                sums["_n"] += weight
        self.model.train()
        keys = sorted(sums)
        totals = self.accelerator.reduce(
            torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.accelerator.device), reduction="sum"
        )
        values = dict(zip(keys, totals.tolist()))
        n = values.pop("_n")
        return {key: value / n for key, value in values.items()}

    # ---- the loop --------------------------------------------------------------------------
    def _state(self, step: int) -> dict[str, Any]:
        epoch, position = divmod(step, self.steps_per_epoch)
        return {
            "step": step,
            "epoch": epoch,
            "batch_in_epoch": position,
            "samples_seen": step * self.plan.global_batch,
            "tokens_seen": self.tokens_seen,
            "world_size": self.plan.world_size,
            "global_batch": self.plan.global_batch,
            "family": self.family.name,
            "target_identity": self.target.identity.to_dict(),
        }

    def _save(self, step: int, tracker: Tracker) -> Path:
        """Evaluate, then write the checkpoint with its held-out figures (which rank it for ``--best``)."""
        evaluation = self.evaluate()  # leaves the RNG and train mode as they were: the saved state is unchanged
        if evaluation:
            tracker.log(step, {**evaluation, **self._tokens_seen()})
        state = {**self._state(step), "eval": evaluation}
        return save_checkpoint(self.accelerator, self.model, self.output_dir, state, self.recipe.train.keep_last)

    def run(self) -> TrainResult:
        train = self.recipe.train
        config = {**to_tree(self.recipe), "run": self.run_info()}
        tracker = Tracker(self.recipe.tracking, self.output_dir, config, self.is_main, self.start_step)
        progress = tqdm(
            total=self.total_steps,
            initial=self.start_step,
            desc="training",
            unit="step",
            dynamic_ncols=True,
            disable=not self.is_main,
        )
        window: dict[str, list[float]] = defaultdict(list)
        started = window_start = time.perf_counter()
        last, checkpoint, done = {}, self.checkpoint, self.start_step
        try:
            for step in range(self.start_step, self.total_steps):
                figures = self.train_step(step)
                if self.tokens_seen is not None:
                    self.tokens_seen += int(figures["tokens"])
                for key, value in figures.items():
                    window[key].append(value)
                progress.update(1)
                done = step + 1
                if done % train.log_every == 0 or done == self.total_steps:
                    elapsed = time.perf_counter() - window_start
                    last = {k: sum(v) / len(v) for k, v in window.items() if k != "tokens"}
                    last["tokens_per_s"] = sum(window["tokens"]) / max(elapsed, 1e-9)
                    last["epoch"] = done / self.steps_per_epoch
                    last.update(self._tokens_seen())
                    tracker.log(done, last)
                    progress.set_postfix(loss=f"{last['loss']:.4g}", tok_s=f"{last['tokens_per_s']:.0f}")
                    window, window_start = defaultdict(list), time.perf_counter()
                saved = done % train.save_every == 0 or done == self.total_steps
                if saved:
                    checkpoint = self._save(done, tracker)
                return_freed_memory_if_low()  # after the step and any evaluation: see core/malloc.py
                if done < self.total_steps and done % train.log_every == 0 and self._out_of_time(started):
                    if not saved:
                        checkpoint = self._save(done, tracker)
                    if self.is_main:
                        tqdm.write(
                            f"draftsmith: stopped after train.max_minutes={train.max_minutes:g} at step {done} of "
                            f"{self.total_steps}, checkpoint {checkpoint}; rerun with --resume to go on"
                        )
                    break
        finally:
            progress.close()
            tracker.close()
        return TrainResult(self.output_dir, max(done, self.start_step), checkpoint, last)

    def _tokens_seen(self) -> dict[str, int]:
        return {} if self.tokens_seen is None else {"tokens_seen": self.tokens_seen}

    def _out_of_time(self, started: float) -> bool:
        """Has this sitting used ``train.max_minutes``? Asked of every rank at once (one all-reduce), so
        all stop at the same step even though their clocks differ."""
        limit = self.recipe.train.max_minutes
        if limit is None:
            return False
        over = float(time.perf_counter() - started >= 60 * limit)
        flag = torch.tensor([over], dtype=torch.float64, device=self.accelerator.device)
        return float(self.accelerator.reduce(flag, reduction="sum")) > 0


def is_launch_main_process() -> bool:
    """Whether this process is rank 0 of its launch (``accelerate launch`` sets RANK in every process it
    starts; a plain ``draftsmith train`` is rank 0 alone), known before the accelerator is built."""
    return os.environ.get("RANK", "0") == "0"


def check_run_directory(recipe: TrainRecipe) -> None:
    """Refuse, before anything is written, an output_dir that is, holds or lies inside one of the run's
    inputs, or a folder that is not a run (a prepared dataset, a feature cache, an export, the user's
    files): checkpoints written into it would mix with them, and cleaning either would lose the other."""
    output_dir = Path(recipe.output_dir)
    inputs = [("the prepared dataset", recipe.data.prepared), ("the feature cache", recipe.data.features)]
    inputs += [("the target", recipe.target.name), ("train.init_from", recipe.train.init_from)]
    check_apart_from_inputs(
        output_dir, tuple((what, Path(path)) for what, path in inputs if path and Path(path).exists()), "output_dir"
    )
    if not output_dir.is_dir() or not any(output_dir.iterdir()) or is_training_run(output_dir):
        return
    raise TrainingError(
        f"output_dir {output_dir} is {_what_folder_holds(output_dir)}, not a training run; choose a new or empty "
        "output_dir"
    )


def is_training_run(path: Path) -> bool:
    return (path / RESOLVED_RECIPE).is_file() or checkpoints_dir(path).is_dir()


def _what_folder_holds(path: Path) -> str:
    from draftsmith.data.features import is_feature_cache
    from draftsmith.data.prepared import is_prepared_directory
    from draftsmith.drafters.io import is_exported_drafter

    for is_kind, kind in (
        (is_prepared_directory, "a prepared dataset"),
        (is_feature_cache, "a feature cache"),
        (is_exported_drafter, "an exported drafter"),
    ):
        if is_kind(path):
            return kind
    names = sorted(entry.name for entry in path.iterdir())
    return f"a folder holding other files ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"


def train(recipe: TrainRecipe, resume: bool = False, resume_inexact: bool = False) -> TrainResult:
    """Train ``recipe`` (in this process, or in each process of ``accelerate launch``). Rank 0 holds the
    output_dir's lock for the whole run: the ranks of one run share it, a second run is refused."""
    with ExitStack() as lock:
        if is_launch_main_process():
            lock.enter_context(exclusive_output(Path(recipe.output_dir), "output_dir"))
        check_run_directory(recipe)
        trainer = Trainer(recipe, resume=resume, resume_inexact=resume_inexact)
        try:
            return trainer.run()
        finally:
            # A process that exits with its gloo group alive can abort in the group's threads at interpreter
            # exit ("terminate called without an active exception"), failing a run whose every step succeeded.
            trainer.accelerator.end_training()
