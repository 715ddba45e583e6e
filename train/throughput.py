"""Training throughput of a recipe's step, measured: ``python -m draftsmith.train.throughput RECIPE PREPARED``.

Builds the recipe's Trainer on a prepared dataset, computes the target's features for the first
``--steps + 2`` global batches before the timer (as offline training reads them from a feature
cache, with the target's greedy tokens), then times loss + backward + optimizer step over ``--steps``
of them after two untimed ones. Prints real (unpadded) tokens per second and the padding overhead.
Nothing is written but a scratch run directory, removed first.
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch

from draftsmith.core.malloc import keep_freed_memory
from draftsmith.data.features import target_argmax
from draftsmith.train.loader import online_features
from draftsmith.train.recipe import load_train_recipe
from draftsmith.train.trainer import Trainer

WARMUP_STEPS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="a training recipe (YAML)")
    parser.add_argument("prepared", help="a prepared dataset directory (`draftsmith data prepare`)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps (default 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--scratch", default="runs/throughput-scratch", help="scratch output_dir, removed first")
    parser.add_argument(
        "--without-greedy-tokens",
        action="store_true",
        help="leave out the target's greedy tokens that a feature cache keeps (as caches made before they were "
        "kept): the loss then computes them from the full vocabulary in every step",
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keep_freed_memory()  # as every draftsmith command does
    if args.threads:
        torch.set_num_threads(args.threads)
    shutil.rmtree(args.scratch, ignore_errors=True)
    overrides = [f"data.prepared={args.prepared}", "data.features=null", "data.eval_samples=0"]
    overrides += ["tracking.wandb=false", f"output_dir={args.scratch}", *args.overrides]
    recipe = load_train_recipe(args.recipe, overrides)
    trainer = Trainer(recipe)
    batches = []
    for step in range(args.steps + WARMUP_STEPS):
        batch = trainer.data.collate(trainer.data.global_batch(step, trainer.plan, recipe.train.seed))
        with torch.no_grad():
            batch.hidden_states, batch.drafter_states = online_features(trainer.target.model, batch, trainer.layers)
        if not args.without_greedy_tokens:
            batch.target_argmax = target_argmax(trainer.frozen.lm_head, batch.hidden_states).long()
        batches.append(batch)

    def step(batch) -> None:
        with trainer._autocast():
            out = trainer.loss(trainer.model, batch, trainer.frozen, **recipe.loss)
        out.loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    for batch in batches[:WARMUP_STEPS]:
        step(batch)
    timed = batches[WARMUP_STEPS:]
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    seconds = time.perf_counter() - start
    real = sum(int(b.attention_mask.sum()) for b in timed)
    padded = sum(b.attention_mask.numel() for b in timed)
    print(
        f"{recipe.family_name}: {real / seconds:.0f} tokens/s ({real} real tokens, padded/real {padded / real:.2f}, "
        f"{seconds:.1f} s for {args.steps} steps, {torch.get_num_threads()} threads, "
        f"mixed_precision={trainer.accelerator.mixed_precision})"
    )
    shutil.rmtree(args.scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
