"""``draftsmith generate`` and ``draftsmith bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _stream_printer(tokenizer) -> Any:
    """Print the text of new tokens as they are committed (decoding the whole answer each time,
    so multi-token characters and spaces come out right)."""
    printed = ""

    def show(tokens: list[int]) -> None:
        nonlocal printed
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if text.startswith(printed):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text

    return show


def cmd_generate(args: argparse.Namespace) -> None:
    import torch

    from draftsmith.inference.methods import build_drafter
    from draftsmith.inference.runtime import generate
    from draftsmith.inference.target import load_target
    from draftsmith.inference.verify import SamplingConfig

    target = load_target(args.target)
    drafter = build_drafter(args.method, target)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if args.raw:
        ids = target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = target.encode_chat([{"role": "user", "content": prompt}])
    sampling = None if args.temperature <= 0 else SamplingConfig(args.temperature, args.top_k, args.top_p)
    result = generate(
        target.model,
        ids,
        drafter,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=target.eos_token_ids,
        sampling=sampling,
        generator=torch.Generator().manual_seed(args.seed),
        on_tokens=_stream_printer(target.tokenizer),
    )
    print()
    print(
        f"[{args.method}] {len(result.tokens)} tokens, {result.target_forwards} target forwards, "
        f"tau {result.tau:.2f}, {len(result.tokens) / result.seconds:.1f} tokens/s",
        file=sys.stderr,
    )


def cmd_bench(args: argparse.Namespace) -> None:
    import torch

    from draftsmith.inference.bench import markdown_table, read_questions, run_bench, write_results
    from draftsmith.inference.target import load_target

    if args.threads:
        torch.set_num_threads(args.threads)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    questions = read_questions(Path(args.questions), categories, args.limit)
    target = load_target(args.target)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    results = run_bench(target, questions, methods, args.max_new_tokens)
    write_results(results, Path(args.out))
    print(markdown_table(results))
    print(f"results in {args.out}/results.json, results.md, chart.png")


def add_inference_commands(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate",
        help="decode a prompt with a drafter (lossless), streaming tokens",
        description="Generate with the target, drafting with METHOD and verifying every draft; "
        "greedy output is token-identical to plain greedy decoding, sampled output "
        "is distributed exactly as plain sampling.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="the user message (default: read stdin)")
    p.add_argument("--method", default="pld", help="drafting method: none (plain decoding) or pld (default)")
    p.add_argument("--target", default=None, help="target model (default: the embedded SmolLM2)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--raw", action="store_true", help="use the prompt as raw text, without the chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples, losslessly")
    p.add_argument("--top-k", type=int, default=0, help="with sampling: keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="with sampling: nucleus mass to keep")
    p.add_argument("--seed", type=int, default=0, help="with sampling: random seed")
    p.set_defaults(func=cmd_generate)
    p = subparsers.add_parser(
        "bench",
        help="benchmark methods against plain decoding on Spec-Bench-format questions",
        description="Run HF generate (greedy), the runtime without a drafter and each method on "
        "the same prompts, interleaved; report tau, speedup, tokens/s and whether "
        "outputs are identical to plain decoding, overall and per category.",
    )
    p.add_argument("--questions", required=True, help="Spec-Bench-format .jsonl (question_id, category, turns)")
    p.add_argument("--methods", default="pld", help="comma-separated methods, e.g. pld (none is always included)")
    p.add_argument("--limit", type=int, default=None, help="at most N questions, spread over categories")
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default=None, help="target model (default: the embedded SmolLM2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--out", required=True, help="output directory for results.json, results.md, chart.png")
    p.set_defaults(func=cmd_bench)
