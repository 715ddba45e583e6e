"""``draftsmith bench``: every method against plain decoding on the same prompts, in one process.

For each question turn, HF ``generate`` (greedy) runs first and defines both the reference output
and the baseline time (its linears through the runtime's kernel, so the reference is the numerical
model the runtime decodes: see ``kernels/packed_gemm.py``); then each method runs on the same prompt.
Multi-turn questions ask the second turn after the model's own first answer (the reference one, so
every method sees the same prompt).
Methods run interleaved prompt by prompt, so machine noise hits all of them alike; ``vllm`` and
``vllm=DIR`` (vLLM in its own environment, see ``vllm_engine.py``) and ``llamacpp`` and ``llamacpp=DIR``
(llama.cpp's tools, see ``llamacpp_engine.py``) run afterwards on the same prompts.
Each finished question is appended to ``OUT/progress.jsonl`` (:mod:`bench_resume`), so a bench that
stops continues with ``--resume`` where it stopped; :mod:`bench_report` writes the table and the chart.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.core.io import jsonl_lines
from draftsmith.core.target import Target
from draftsmith.core.text import check_json_surrogates, parse_json, read_text_file
from draftsmith.core.vllm_env import VllmError, find_vllm_python
from draftsmith.inference.backends import Backends
from draftsmith.inference.context import check_fits_context
from draftsmith.inference.kernels.context import KernelContext
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.measure.bench_resume import BenchProgress
from draftsmith.inference.measure.errors import BenchError
from draftsmith.inference.measure.floor import ReadSpeed
from draftsmith.inference.measure.hf_baselines import PLAIN_BASELINES, hf_greedy
from draftsmith.inference.measure.llamacpp_engine import (
    LLAMACPP,
    LlamaCppError,
    LlamaCppMethod,
    find_llamacpp_tools,
    is_llamacpp_method,
    parse_llamacpp_method,
    run_plain,
    run_speculative,
)
from draftsmith.inference.measure.vllm_engine import VllmMethod, is_vllm_method, parse_vllm_method, run_vllm
from draftsmith.inference.methods.table import build_drafter
from draftsmith.inference.runtime import generate

BASELINE = "hf-generate"
RUNTIME_ALONE = "none"  # the runtime without a drafter: always benched, the reference a drafter has to beat
# Spec-Bench files label MT-bench questions either "mt_bench" or by MT-bench's own eight categories;
# the latter also count towards an "mt_bench" scope, so results compare with Spec-Bench's table.
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def scopes_of(category: str) -> tuple[str, ...]:
    return ("overall", category, "mt_bench") if category in MT_BENCH_CATEGORIES else ("overall", category)


def bench_settings(
    target: Target, questions: list[Question], methods: list[str], max_new_tokens: int, options: KernelOptions
) -> dict[str, Any]:
    """What a resumed bench must share with the run it continues (JSON values)."""
    asked = json.dumps([[q.id, q.category, q.turns] for q in questions]).encode()
    return {
        "questions_sha256": hashlib.sha256(asked).hexdigest(),
        "methods": methods,
        "max_new_tokens": max_new_tokens,
        "target": target.identity.to_dict() if target.identity else None,
        "device": str(target.model.device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        **options.settings(),
    }


@dataclass
class Question:
    id: str
    category: str
    turns: list[str]


@dataclass
class Turn:
    """One benchmarked prompt, kept for the methods that run after the interleaved loop (vLLM)."""

    prompt: list[int]
    reference: list[int]
    base_seconds: float
    category: str
    where: str


@dataclass
class Tally:
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    baseline_seconds: float = 0.0
    identical: int = 0
    total: int = 0
    first_differences: list[dict[str, Any]] = field(default_factory=list)
    engine_drafts: int = 0  # vLLM methods: the engine's speculative steps and tokens accepted in them
    engine_accepted: int = 0
    agreeing_tokens: int = 0  # adapted-model methods: positions where its output equals the target's
    compared_tokens: int = 0
    prompt_seconds: float = 0.0  # runtime methods: their prompts' forwards (prefill and first token)
    prompts_timed: int = 0

    def add(
        self,
        tokens: list[int],
        forwards: int,
        seconds: float,
        baseline_seconds: float,
        reference: list[int],
        where: str,
        prompt_seconds: float | None = None,
    ) -> None:
        self.tokens += len(tokens)
        if prompt_seconds is not None:
            self.prompt_seconds += prompt_seconds
            self.prompts_timed += 1
        self.forwards += forwards
        self.seconds += seconds
        self.baseline_seconds += baseline_seconds
        self.total += 1
        if tokens == reference:
            self.identical += 1
        else:
            position = next(
                (i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference))
            )
            self.first_differences.append({"turn": where, "position": position})

    def add_engine_counters(self, drafts: int, accepted: int) -> None:
        self.engine_drafts += drafts
        self.engine_accepted += accepted

    def add_agreement(self, served: list[int], original: list[int]) -> None:
        """How far an adapted served model drifts from the original target (position-wise token agreement)."""
        self.agreeing_tokens += sum(a == b for a, b in zip(served, original))
        self.compared_tokens += max(len(served), len(original))

    def summary(self) -> dict[str, Any]:
        return {
            "tau": self.tokens / self.forwards if self.forwards else 0.0,
            "speedup": self.baseline_seconds / self.seconds if self.seconds else 0.0,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "identical": self.identical,
            "total": self.total,
            "tokens": self.tokens,
            "target_forwards": self.forwards,
            "seconds": round(self.seconds, 3),
            "first_differences": self.first_differences[:10],
            **({"prompt_seconds": round(self.prompt_seconds, 3)} if 0 < self.total == self.prompts_timed else {}),
            # vLLM's mean acceptance length: accepted draft tokens per speculative step + 1
            **(
                {"engine_acceptance_length": 1 + self.engine_accepted / self.engine_drafts}
                if self.engine_drafts
                else {}
            ),
            **(
                {"agreement_with_target": self.agreeing_tokens / self.compared_tokens, "reference": "served model"}
                if self.compared_tokens
                else {}
            ),
        }


def read_questions(path: Path, categories: list[str] | None, limit: int | None) -> list[Question]:
    """Spec-Bench format: one JSON object per line with ``question_id``, ``category`` and ``turns``."""
    questions = []
    text = read_text_file(Path(path), BenchError)
    check_json_surrogates(text, path, BenchError)
    for number, line in enumerate(jsonl_lines(text), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, path, BenchError, number)
            question = Question(str(record["question_id"]), str(record["category"]), [str(t) for t in record["turns"]])
        except (json.JSONDecodeError, KeyError, TypeError, RecursionError) as exc:
            raise BenchError(
                f"{path} line {number} is not a Spec-Bench question (question_id, category, turns): "
                f"{type(exc).__name__}"
            ) from None
        if not isinstance(record["turns"], list) or not question.turns:
            raise BenchError(
                f"{path} line {number}: 'turns' must be a list of at least one user message, got {record['turns']!r}"
            )
        if categories is None or question.category in categories:
            questions.append(question)
    if limit is not None:
        questions = _spread(questions, limit)
    if not questions:
        raise BenchError(f"no questions in {path} for categories {categories}")
    return questions


def _spread(questions: list[Question], limit: int) -> list[Question]:
    """At most ``limit`` questions, taken round-robin across categories so each one is represented."""
    by_category: dict[str, list[Question]] = defaultdict(list)
    for question in questions:
        by_category[question.category].append(question)
    picked: list[Question] = []
    while len(picked) < limit and any(by_category.values()):
        for category in list(by_category):
            if by_category[category] and len(picked) < limit:
                picked.append(by_category[category].pop(0))
    return picked


def _served_reference(drafter, prompt: list[int], max_new_tokens: int, eos: list[int], backends: Backends):
    """For a drafter that serves an adapted model (:meth:`Drafter.reference_model`, e.g. Speculative
    Streaming's LoRA target), lossless means identical to *that* model's plain decoding, which is also
    its baseline: its HF greedy tokens and time; None for drafters that serve the target itself."""
    reference = drafter.reference_model() if drafter is not None else None
    if reference is None:
        return None, 0.0
    with reference as model:
        served = drafter.served_model() is model  # decoded through the runtime's kernels: same numerics
        with backends.reference_forwards(model) if served else nullcontext():
            return hf_greedy(model, prompt, max_new_tokens, eos)


def _run_question(
    target: Target,
    question: Question,
    plain: dict[str, Any],
    drafters: dict[str, Any],
    max_new_tokens: int,
    backends: Backends,
    bar: tqdm,
) -> dict[str, Any]:
    """Every turn of one question, HF ``generate`` first and then each method: what was decoded and how
    long it took (a :class:`BenchProgress` record)."""
    eos = target.eos_token_ids
    messages: list[dict[str, str]] = []
    turns = []
    for turn_index, turn in enumerate(question.turns):
        messages.append({"role": "user", "content": turn})
        prompt = target.encode_chat(messages)
        check_fits_context(target.model, len(prompt), max_new_tokens, f"question {question.id} turn {turn_index + 1}")
        with backends.reference_forwards(target.model):
            reference, base_seconds = hf_greedy(target.model, prompt, max_new_tokens, eos)
        record: dict[str, Any] = {
            "where": f"{question.id}/{turn_index}",
            "prompt": prompt,
            "reference": reference,
            "base_seconds": base_seconds,
            "plain": {},
            "methods": {},
        }
        for name, decode in plain.items():  # other plain decoders: same tokens, their own time
            tokens, seconds = decode(prompt, max_new_tokens, eos)
            record["plain"][name] = {"tokens": tokens, "seconds": seconds}
        for name, drafter in drafters.items():
            own_reference, own_seconds = _served_reference(drafter, prompt, max_new_tokens, eos, backends)
            result = generate(
                target.model, prompt, drafter, max_new_tokens=max_new_tokens, eos_token_ids=eos, backends=backends
            )
            record["methods"][name] = {
                "tokens": result.tokens,
                "forwards": result.target_forwards,
                "seconds": result.seconds,
                "pack_seconds": result.pack_seconds,
                "prompt_seconds": result.prompt_seconds,
                "own_reference": own_reference,
                "own_seconds": own_seconds,
            }
        turns.append(record)
        messages.append({"role": "assistant", "content": target.tokenizer.decode(reference, skip_special_tokens=True)})
        bar.update(1)
    return {"question": question.id, "turns": turns}


def _tally_question(tallies: dict[str, dict[str, Tally]], record: dict[str, Any], category: str) -> list[Turn]:
    """Add one question's record to every method's tallies; its turns, for the methods run afterwards."""
    turns = []
    for turn in record["turns"]:
        reference, base_seconds, where = turn["reference"], turn["base_seconds"], turn["where"]
        for scope in scopes_of(category):
            tallies[BASELINE][scope].add(reference, len(reference), base_seconds, base_seconds, reference, where)
            for name, run in turn["plain"].items():
                tallies[name][scope].add(
                    run["tokens"], len(run["tokens"]), run["seconds"], base_seconds, reference, where
                )
            for name, run in turn["methods"].items():
                tally = tallies[name][scope]
                adapted = run["own_reference"] is not None  # compared with its own served model's generate
                tally.add(
                    run["tokens"],
                    run["forwards"],
                    run["seconds"],
                    run["own_seconds"] if adapted else base_seconds,
                    run["own_reference"] if adapted else reference,
                    where,
                    run.get("prompt_seconds"),  # absent from a progress file written before it was recorded
                )
                if adapted:
                    tally.add_agreement(run["own_reference"], reference)
        turns.append(Turn(turn["prompt"], reference, base_seconds, category, where))
    return turns


@dataclass(frozen=True)
class ExternalEngines:
    """Where the ``vllm`` and ``llamacpp`` methods find what they run: vLLM in ``vllm_python``'s environment
    (None: :func:`find_vllm_python`'s choice) opening the target from ``target_dir`` (a safetensors
    directory), and llama.cpp's tools in ``llamacpp_bin`` serving the target's GGUF ``llamacpp_model``."""

    vllm_python: str | None = None
    target_dir: Path | None = None
    llamacpp_bin: str | None = None
    llamacpp_model: Path | None = None


def run_bench(
    target: Target,
    questions: list[Question],
    methods: list[str],
    max_new_tokens: int,
    backends: Backends | None = None,
    *,
    engines: ExternalEngines = ExternalEngines(),
    progress: BenchProgress | None = None,
) -> dict[str, Any]:
    """Per method, overall and per category: tau, speedup, tokens_per_s, identical, total. Every runtime
    method verifies through ``backends`` (default: the default kernel options); its kernels are built
    before any timing, and compile and packing time are kept out of the timings (reported apart).

    ``vllm`` / ``vllm=DIR`` methods run after the others, in vLLM, on the same prompts, each prompt timed
    alone; ``llamacpp`` / ``llamacpp=DIR`` after them, in llama.cpp's tools: as ``engines`` says.

    ``progress``: each finished question is appended to it, and the questions it already holds (from a
    run that stopped) are taken from it instead of decoded again."""
    backends = backends or Backends()
    eos = target.eos_token_ids
    for question in questions:  # later turns depend on earlier answers: they are checked when they are asked
        prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
        check_fits_context(target.model, len(prompt), max_new_tokens, f"question {question.id} turn 1")
    engine_methods, llama_methods, engines = _external_methods(methods, target, engines)
    engine_specs = [m.name for m in engine_methods] + [m.name for m in llama_methods]
    methods = [RUNTIME_ALONE] + [m for m in methods if m != RUNTIME_ALONE and m not in engine_specs]
    plain = {name: PLAIN_BASELINES[name](target.model) for name in methods if name in PLAIN_BASELINES}
    drafters = {name: build_drafter(name, target) for name in methods if name not in plain}
    names = [BASELINE, *methods, *engine_specs]
    tallies: dict[str, dict[str, Tally]] = {name: defaultdict(Tally) for name in names}
    backends.prepare(target.model)  # kernels built here, outside every timing
    kernels = None if backends.options.compiled else backends.kernels(target.model)
    head_before = _head_rows(kernels)
    # This machine's read speed, before the warm-up and after the last question (never between timed
    # decodes: ReadSpeed). Two runs' tokens/s differ by it; the ratios inside one run do not.
    read_speed = ReadSpeed() if kernels is not None else None
    if read_speed is not None:
        read_speed.passes()
    with backends.reference_forwards(target.model):
        hf_greedy(target.model, target.encode_chat([{"role": "user", "content": "Hi"}]), 4, eos)  # warm-up
    finished = _resumed_records(progress, questions)

    def decode(question: Question, bar: tqdm) -> dict[str, Any]:
        return _run_question(target, question, plain, drafters, max_new_tokens, backends, bar)

    turns = _bench_questions(questions, finished, decode, progress, tallies)
    if read_speed is not None:
        read_speed.passes()
    engine_info = _run_engines(engine_methods, turns, tallies, engines, max_new_tokens, eos)
    llama = LlamaCppBench(Path(engines.llamacpp_bin or "."), engines.llamacpp_model, target.tokenizer, max_new_tokens)
    llamacpp_info = llama.run(llama_methods, turns, tallies) if llama_methods else {}
    return {
        "target": target.identity.to_dict(),
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
        "device": str(target.model.device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "questions": len(questions),
        **({"resumed_questions": len(finished)} if finished else {}),
        **_kernel_summary(backends, target.model, kernels, head_before),
        **({"read_gb_per_s": read_speed.summary()} if read_speed is not None and read_speed.seconds else {}),
        **{f"{n}_compile_seconds": round(d.compile_seconds, 1) for n, d in plain.items() if d.compile_seconds},
        "baseline": BASELINE,
        "methods": {name: {scope: t.summary() for scope, t in scopes.items()} for name, scopes in tallies.items()},
        **({"vllm": engine_info} if engine_info else {}),
        **({"llamacpp": llamacpp_info} if llamacpp_info else {}),
    }


def _external_methods(
    methods: list[str], target: Target, engines: ExternalEngines
) -> tuple[list[VllmMethod], list[LlamaCppMethod], ExternalEngines]:
    """The vLLM and the llama.cpp methods among ``methods``, and ``engines`` with the interpreter and the tools
    they run in found: all checked before any decoding, so a missing engine costs nothing."""
    vllm_methods = [parse_vllm_method(m, target) for m in methods if is_vllm_method(m)]
    if vllm_methods:
        engines = replace(engines, vllm_python=find_vllm_python(engines.vllm_python))
        if engines.target_dir is None:
            raise BenchError("vLLM opens the target as a safetensors model directory; give --target DIR")
    llama_methods = [parse_llamacpp_method(m, target) for m in methods if is_llamacpp_method(m)]
    if llama_methods:
        engines = replace(engines, llamacpp_bin=str(find_llamacpp_tools(engines.llamacpp_bin)))
        if engines.llamacpp_model is None:
            raise BenchError("llama.cpp serves the target from its GGUF: give --llamacpp-model FILE.gguf")
    return vllm_methods, llama_methods, engines


def _resumed_records(progress: BenchProgress | None, questions: list[Question]) -> list[dict[str, Any]]:
    """The records of the questions the run this one resumes finished, checked to be these questions'."""
    finished = list(progress.records) if progress is not None else []
    for record, question in zip(finished, questions):
        if record.get("question") != question.id:
            raise BenchError(f"{progress.path} does not follow these questions (at {question.id}); use --overwrite")
    return finished


def _bench_questions(
    questions: list[Question],
    finished: list[dict[str, Any]],
    decode: Callable[[Question, tqdm], dict[str, Any]],
    progress: BenchProgress | None,
    tallies: dict[str, dict[str, Tally]],
) -> list[Turn]:
    """Every question's record, ``finished`` for those a stopped run decoded, else decoded now and appended
    to ``progress``, tallied in order; the turns asked, for the engines that run after."""
    resumed_turns = sum(len(q.turns) for q in questions[: len(finished)])  # counted, but not in the rate
    total_turns = sum(len(q.turns) for q in questions)
    bar = tqdm(total=total_turns, initial=resumed_turns, desc="bench", unit="turn", dynamic_ncols=True)
    turns: list[Turn] = []
    for index, question in enumerate(questions):
        if index < len(finished):
            record = finished[index]
        else:
            record = decode(question, bar)
            if progress is not None:
                progress.append(record)
        turns += _tally_question(tallies, record, question.category)
    bar.close()
    return turns


def _run_engines(
    engine_methods: list[VllmMethod],
    turns: list[Turn],
    tallies: dict[str, dict[str, Tally]],
    engines: ExternalEngines,
    max_new_tokens: int,
    eos: list[int],
) -> dict[str, Any]:
    """Each vLLM method over every benchmarked turn, tallied; per method its version and startup time,
    or the error that stopped it (the other methods' measurements are kept)."""
    engine_info = {}
    prompts = [t.prompt for t in turns]
    for method in engine_methods:
        print(f"bench: {method.name} in vLLM ({len(turns)} prompts; it compiles for a minute or two first)", flush=True)
        try:
            run = run_vllm(
                engines.vllm_python, method, engines.target_dir, prompts, max_new_tokens, eos, torch.get_num_threads()
            )
        except VllmError as error:
            print(f"bench: {error}", flush=True)
            engine_info[method.name] = {"error": str(error)}
            del tallies[method.name]
            continue
        engine_info[method.name] = {key: run[key] for key in ("vllm_version", "startup_seconds")}
        for turn, result in zip(turns, run["results"]):
            for scope in scopes_of(turn.category):
                tally = tallies[method.name][scope]
                forwards = 1 + result["drafts"] if result["drafts"] else len(result["tokens"])
                tally.add(result["tokens"], forwards, result["seconds"], turn.base_seconds, turn.reference, turn.where)
                tally.add_engine_counters(result["drafts"], result["accepted"])
    return engine_info


@dataclass
class LlamaCppSums:
    """One llama.cpp method's totals over the prompts: llama.cpp's own token counts and seconds, and how
    its tokens compare with the runtime's."""

    generated: int = 0  # tokens llama.cpp decoded (the plain tool's after the prompt's forward)
    prompt_seconds: float = 0.0
    decode_seconds: float = 0.0
    agreeing: int = 0  # positions where its tokens equal the runtime's reference
    compared: int = 0
    identical_to_runtime: int = 0

    def add(self, run, tokens: list[int], runtime: list[int]) -> None:
        self.generated += run.generated
        self.prompt_seconds += run.prompt_seconds
        self.decode_seconds += run.decode_seconds
        self.agreeing += sum(a == b for a, b in zip(tokens, runtime))
        self.compared += max(len(tokens), len(runtime))
        self.identical_to_runtime += tokens == runtime

    def summary(self, plain: LlamaCppSums | None) -> dict[str, Any]:
        seconds = self.prompt_seconds + self.decode_seconds
        after = self.generated / self.decode_seconds if self.decode_seconds else 0.0
        summary = {
            "tokens_per_s_after_prompt": round(after, 2),
            "tokens_per_s": round(self.generated / seconds, 2) if seconds else 0.0,
            "prompt_share": round(self.prompt_seconds / seconds, 3) if seconds else 0.0,
            "agreement_with_runtime": round(self.agreeing / self.compared, 4) if self.compared else 0.0,
            "identical_to_runtime": self.identical_to_runtime,
        }
        if plain is not None and plain is not self and plain.decode_seconds and plain.generated:
            plain_after = plain.generated / plain.decode_seconds
            plain_overall = plain.generated / (plain.prompt_seconds + plain.decode_seconds)
            summary["speedup_after_prompt_vs_llamacpp"] = round(after / plain_after, 3)
            summary["speedup_vs_llamacpp"] = round(summary["tokens_per_s"] / plain_overall, 3)
        return summary


LLAMAFILE_BUILD = (
    "this llama.cpp was built with llamafile's matrix products (LLAMAFILE = 1 in its system info), whose batches "
    "round otherwise than one-row decoding: its drafted runs may leave its plain tokens, which their `identical` "
    "column counts; build it with -DGGML_LLAMAFILE=OFF for that comparison (docs/engines.md)"
)


@dataclass
class LlamaCppBench:
    """The ``llamacpp`` methods over every benchmarked turn: llama.cpp's plain decoding of each prompt first
    (every llama.cpp row's reference: llama.cpp rounds activations to 8 bits, so the runtime's tokens are
    compared apart), then each drafter method; a method that fails is reported and left out."""

    tools: Path
    model: Path | None
    tokenizer: Any
    max_new_tokens: int

    def encoded(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_new_tokens]

    def run(self, methods: list[LlamaCppMethod], turns: list[Turn], tallies: dict[str, dict[str, Tally]]) -> dict:
        threads = torch.get_num_threads()
        print(f"bench: {', '.join(m.name for m in methods)} in llama.cpp ({len(turns)} prompts)", flush=True)
        prompts = [self.tokenizer.decode(t.prompt, skip_special_tokens=False) for t in turns]
        context = max(len(t.prompt) for t in turns) + self.max_new_tokens + 64
        try:
            bar = tqdm(prompts, desc=LLAMACPP, unit="turn", dynamic_ncols=True)
            plains = [run_plain(self.tools, self.model, p, self.max_new_tokens, threads, context) for p in bar]
        except LlamaCppError as error:
            print(f"bench: {error}", flush=True)
            for method in methods:
                del tallies[method.name]
            return {"error": str(error)}
        references = [self.encoded(run.text) for run in plains]
        matching = sum(list(run.prompt_ids) == turn.prompt for run, turn in zip(plains, turns))
        info: dict[str, Any] = {"model": str(self.model), "prompt_ids_match": f"{matching}/{len(turns)}"}
        if any(run.llamafile for run in plains):
            info["llamafile"] = True
            if any(method.draft is not None for method in methods):
                print(f"bench: {LLAMAFILE_BUILD}", flush=True)
        sums = {}
        for method in methods:
            try:
                runs = plains if method.draft is None else self.drafted(method, prompts, threads, context)
            except LlamaCppError as error:
                print(f"bench: {error}", flush=True)
                info[method.name] = {"error": str(error)}
                del tallies[method.name]
                continue
            sums[method.name] = self.tally(runs, plains, references, turns, tallies[method.name])
        plain_sums = sums.get(next((m.name for m in methods if m.draft is None), ""), None)
        for method in methods:
            if method.name in sums:
                info[method.name] = {"depth": method.depth, **sums[method.name].summary(plain_sums)}
        return info

    def drafted(self, method: LlamaCppMethod, prompts: list[str], threads: int, context: int) -> list:
        bar = tqdm(prompts, desc=method.name, unit="turn", dynamic_ncols=True)
        return [run_speculative(self.tools, self.model, method, p, self.max_new_tokens, threads, context) for p in bar]

    def tally(self, runs, plains, references, turns, tallies: dict[str, Tally]) -> LlamaCppSums:
        sums = LlamaCppSums()
        for run, plain, reference, turn in zip(runs, plains, references, turns):
            # a drafted run commits up to its draft length past -n; where its text extends the plain run's, it
            # committed the plain tokens (encoding the longer text could merge the last ones otherwise; the plain
            # run's last token may end inside a character, printed as U+FFFD)
            extends = run.text.startswith(plain.text.rstrip("\ufffd"))
            tokens = reference if extends else self.encoded(run.text)
            sums.add(run, tokens, turn.reference)
            seconds = run.prompt_seconds + run.decode_seconds
            for scope in scopes_of(turn.category):
                tally = tallies[scope]
                # as the runtime counts: the prompt's forward and, with a drafter, each verification forward
                forwards = run.steps + 1 if run.steps else len(tokens)
                tally.add(tokens, forwards, seconds, turn.base_seconds, reference, turn.where, run.prompt_seconds)
                if run.steps:
                    tally.add_engine_counters(run.steps, run.accepted)
        return sums


def _head_rows(kernels: KernelContext | None) -> tuple[int, int]:
    head = kernels.greedy_head() if kernels is not None else None
    return (head.rows, head.fallback_rows) if head is not None else (0, 0)


def _kernel_summary(
    backends: Backends, model, kernels: KernelContext | None, head_before: tuple[int, int]
) -> dict[str, Any]:
    """How the runtime's forwards ran, for results.json: compiled (and how long compiling took), or
    which eager fast paths served the target."""
    if backends.options.compiled:
        compiled = {"compiled": True, "compile_seconds": round(backends.compiled(model).compile_seconds, 1)}
        return {**compiled, "linear": None, "direct_forward": False, "native": False, "greedy_head": None}
    direct = kernels.direct()
    return {
        "compiled": False,
        "linear": kernels.linear_record(),
        "direct_forward": direct is not None,
        "native": direct is not None and direct.native,
        "greedy_head": _greedy_head_summary(kernels, head_before),
    }


def _greedy_head_summary(kernels: KernelContext, before: tuple[int, int]) -> dict[str, int] | None:
    """How many verification rows the screened head served in this run, and how many of them the
    proof left to the float32 head."""
    rows, fallback_rows = _head_rows(kernels)
    if rows == before[0]:
        return None
    return {"rows": rows - before[0], "fallback_rows": fallback_rows - before[1]}
