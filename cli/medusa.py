"""``draftsmith medusa ...``: the command-line side of the Medusa tools (imports stay lazy, so
``draftsmith --help`` does not load torch)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draftsmith.core.arguments import add_target_argument


def cmd_calibrate(args: argparse.Namespace) -> None:
    from draftsmith.train.medusa_calibrate import calibrate

    out = Path(args.out) if args.out else None
    result = calibrate(
        Path(args.drafter), Path(args.data), args.nodes, args.target, args.samples, args.max_rank, out, args.overwrite
    )
    top1 = ", ".join(f"head{k} {row[0]:.2f}" for k, row in enumerate(result["head_accuracy"], start=1))
    where = f"tree file {out}" if out else f"{args.drafter}/config.json (used by --method medusa={args.drafter})"
    print(f"top-1 accuracy: {top1}")
    print(
        f"{result['nodes']}-node tree, expected acceptance length {result['expected_accept_length']:.2f}; "
        f"written to {where}"
    )


def add_medusa_commands(subparsers: Any) -> None:
    p = subparsers.add_parser("medusa", help="Medusa tools: calibrate a static tree for trained heads")
    commands = p.add_subparsers(dest="medusa_command", required=True, metavar="COMMAND")
    c = commands.add_parser(
        "calibrate",
        help="measure each head's top-k accuracy on held-out data and build the best N-node tree",
        description="Measure each Medusa head's top-k accuracy (agreement with the target's greedy token) on "
        "held-out samples and build the N-node tree maximising the expected acceptance length. Without --out "
        "the tree is written into the drafter's config.json, which `--method medusa=DIR` then uses.",
    )
    c.add_argument(
        "drafter",
        help="a Medusa-1 or Medusa-2 directory written by `draftsmith export` (Medusa-2: measured on the model it "
        "serves, the target with its LoRA merged)",
    )
    c.add_argument("--data", required=True, help="a prepared dataset or its feature cache")
    c.add_argument("--nodes", type=int, required=True, help="tree size (draft tokens verified per round)")
    add_target_argument(c)
    c.add_argument(
        "--samples",
        type=int,
        default=64,
        help="held-out samples: the ones a recipe with data.eval_samples=N keeps out of training",
    )
    c.add_argument("--max-rank", type=int, default=10, help="candidates per head to measure")
    c.add_argument("--out", default=None, help="write a tree file here instead of into the drafter's config.json")
    c.add_argument("--overwrite", action="store_true", help="replace a tree file an earlier calibrate wrote at --out")
    c.set_defaults(func=cmd_calibrate, output_args=("out", "drafter"))
