"""``draftsmith bench``: every method against plain decoding on the same prompts, in one process.

For each question turn, HF ``generate`` (greedy) runs first and defines both the reference output
and the baseline time; then each method runs on the same prompt. Multi-turn questions ask the second
turn after the model's own first answer (the reference one, so every method sees the same prompt).
Methods run interleaved prompt by prompt, so machine noise hits all of them alike; ``vllm`` and
``vllm=DIR`` (vLLM in its own environment, see ``vllm_engine.py``) run afterwards on the same prompts.
Each finished question is appended to ``OUT/progress.jsonl`` (:class:`BenchProgress`), so a bench
that stops (a whole dev file takes hours on a CPU) continues with ``--resume`` where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import OutputRules, atomic_directory, atomic_write_bytes, atomic_write_json
from draftsmith.core.target import Target
from draftsmith.core.vllm_env import VllmError, find_vllm_python
from draftsmith.inference.context import check_fits_context
from draftsmith.inference.kernels.compiled import CompiledTarget
from draftsmith.inference.kernels.direct_forward import direct_forward_for, direct_forward_supported
from draftsmith.inference.kernels.greedy_head import GreedyHead, greedy_head_for
from draftsmith.inference.kernels.packed_gemm import packed_gemm_for
from draftsmith.inference.measure.hf_compiled import NAME as HF_STATIC_COMPILE
from draftsmith.inference.measure.hf_compiled import StaticCompiledGenerate, greedy_settings
from draftsmith.inference.measure.vllm_engine import is_vllm_method, parse_vllm_method, run_vllm
from draftsmith.inference.methods.table import build_drafter
from draftsmith.inference.runtime import generate

BASELINE = "hf-generate"
# Spec-Bench files label MT-bench questions either "mt_bench" or by MT-bench's own eight categories;
# the latter also count towards an "mt_bench" scope, so results compare with Spec-Bench's table.
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def scopes_of(category: str) -> tuple[str, ...]:
    return ("overall", category, "mt_bench") if category in MT_BENCH_CATEGORIES else ("overall", category)


class BenchError(DraftsmithError, ValueError):
    """A question file that cannot be benchmarked."""


PROGRESS = "progress.jsonl"
PROGRESS_FORMAT = "draftsmith.bench_progress/1"


class BenchProgress:
    """The questions a bench has finished, in order: ``OUT/progress.jsonl``, a header line with the
    settings every measurement depends on, then one line per finished question (its tokens and
    timings), flushed to disk as each finishes. ``bench --resume`` replays them and goes on from the
    first unfinished question; a torn last line (the process killed mid-write) is dropped. The
    finished results replace the directory, progress file included."""

    def __init__(self, path: Path, records: list[dict[str, Any]], header: dict[str, Any] | None = None) -> None:
        self.path = path
        self.records = records
        self._header = header  # written with the first finished question: a refused run leaves nothing

    @classmethod
    def start(cls, out: Path, settings: dict[str, Any]) -> BenchProgress:
        return cls(out / PROGRESS, [], {"format": PROGRESS_FORMAT, "settings": settings})

    @classmethod
    def resume(cls, out: Path, settings: dict[str, Any]) -> BenchProgress:
        path = out / PROGRESS
        header, records, intact = read_progress(path)
        if header is None:
            raise BenchError(f"--resume: {out} holds no unfinished bench ({PROGRESS}); run without --resume")
        differ = sorted(
            key
            for key in settings.keys() | header["settings"].keys()
            if settings.get(key) != header["settings"].get(key)
        )
        if differ:
            raise BenchError(
                f"--resume: the unfinished bench in {out} ran with other {', '.join(differ)}; resume it with "
                "the same options, or start over with --overwrite"
            )
        if len(intact) < len(path.read_bytes()):  # drop the torn line, so appends start on a line of their own
            with open(path, "r+b") as handle:
                handle.truncate(len(intact))
        return cls(path, records)

    def append(self, record: dict[str, Any]) -> None:
        if self._header is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "w") as handle:
                handle.write(json.dumps(self._header) + "\n")
            self._header = None
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records.append(record)


def read_progress(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bytes]:
    """(header or None, finished question records, the bytes of the intact lines) of a progress file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None, [], b""
    lines, intact, header = [], 0, None
    for line in data.splitlines(keepends=True):
        try:
            obj = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            break
        if header is None:
            if obj.get("format") != PROGRESS_FORMAT or not isinstance(obj.get("settings"), dict):
                return None, [], b""
            header = obj
        else:
            lines.append(obj)
        intact += len(line)
    return header, lines, data[:intact]


def bench_settings(
    target: Target, questions: list[Question], methods: list[str], max_new_tokens: int, **kernels: Any
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
        **kernels,
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

    def add(
        self,
        tokens: list[int],
        forwards: int,
        seconds: float,
        baseline_seconds: float,
        reference: list[int],
        where: str,
    ) -> None:
        self.tokens += len(tokens)
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
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
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


@torch.no_grad()
def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: list[int]
) -> tuple[list[int], float]:
    """Plain greedy decoding by HF ``generate`` (the reference every method must reproduce); the tokens
    and the seconds it took. No EOS ids: it stops at the token budget only."""
    start = time.perf_counter()
    out = model.generate(
        torch.tensor([prompt], device=model.device), max_new_tokens=max_new_tokens, **greedy_settings(eos)
    )
    tokens = out[0, len(prompt) :].tolist()  # waits for the device, so the clock stops after the last token
    return tokens, time.perf_counter() - start


def _served_reference(target: Target, drafter, prompt: list[int], max_new_tokens: int, eos: list[int]):
    """For a drafter that serves an adapted model (:meth:`Drafter.reference_model`, e.g. Speculative
    Streaming's LoRA target), lossless means identical to *that* model's plain decoding, which is also
    its baseline: its HF greedy tokens and time; None for drafters that serve the target itself."""
    reference = drafter.reference_model() if drafter is not None else None
    if reference is None:
        return None, 0.0
    with reference as model:
        return hf_greedy(model, prompt, max_new_tokens, eos)


def _run_question(
    target: Target,
    question: Question,
    plain: dict[str, StaticCompiledGenerate],
    drafters: dict[str, Any],
    max_new_tokens: int,
    decode_options: dict[str, Any],
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
            own_reference, own_seconds = _served_reference(target, drafter, prompt, max_new_tokens, eos)
            result = generate(
                target.model, prompt, drafter, max_new_tokens=max_new_tokens, eos_token_ids=eos, **decode_options
            )
            record["methods"][name] = {
                "tokens": result.tokens,
                "forwards": result.target_forwards,
                "seconds": result.seconds,
                "pack_seconds": result.pack_seconds,
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
                if run["own_reference"] is None:
                    tally.add(run["tokens"], run["forwards"], run["seconds"], base_seconds, reference, where)
                else:
                    tally.add(
                        run["tokens"], run["forwards"], run["seconds"], run["own_seconds"], run["own_reference"], where
                    )
                    tally.add_agreement(run["own_reference"], reference)
        turns.append(Turn(turn["prompt"], reference, base_seconds, category, where))
    return turns


def run_bench(
    target: Target,
    questions: list[Question],
    methods: list[str],
    max_new_tokens: int,
    *,
    compiled: CompiledTarget | None = None,
    packed_gemm: bool = True,
    greedy_head: bool = True,
    native: bool = True,
    vllm_python: str | None = None,
    target_dir: Path | None = None,
    progress: BenchProgress | None = None,
) -> dict[str, Any]:
    """Per method, overall and per category: tau, speedup, tokens_per_s, identical, total. With
    ``compiled``, every runtime method verifies through it (compile time is kept out of the timings
    and reported as ``compile_seconds``). ``packed_gemm``: the runtime's eager verification forwards use
    MKL's packed GEMM where it applies (packing time is kept out of the timings too). ``greedy_head``:
    greedy verification computes the target's argmax through the screened head where it applies.
    ``native``: verification forwards run the C++ decoder layers and contender search where they apply
    (built before any timing).

    ``vllm`` / ``vllm=DIR`` methods run after the others, in vLLM (``vllm_python``'s environment, the
    target opened from ``target_dir``), on the same prompts, each prompt timed alone.

    ``progress``: each finished question is appended to it, and the questions it already holds (from a
    run that stopped) are taken from it instead of decoded again."""
    eos = target.eos_token_ids
    for question in questions:  # later turns depend on earlier answers: they are checked when they are asked
        prompt = target.encode_chat([{"role": "user", "content": question.turns[0]}])
        check_fits_context(target.model, len(prompt), max_new_tokens, f"question {question.id} turn 1")
    engine_methods = [parse_vllm_method(m, target) for m in methods if is_vllm_method(m)]
    if engine_methods:
        vllm_python = find_vllm_python(vllm_python)  # before any decoding, so a missing vLLM costs nothing
        if target_dir is None:
            raise BenchError("vLLM opens the target as a safetensors model directory; give --target DIR")
    methods = ["none"] + [m for m in methods if m != "none" and not is_vllm_method(m)]  # overhead always shown
    plain = {name: StaticCompiledGenerate(target.model) for name in methods if name == HF_STATIC_COMPILE}
    drafters = {name: build_drafter(name, target) for name in methods if name not in plain}
    names = [BASELINE, *methods, *(m.name for m in engine_methods)]
    tallies: dict[str, dict[str, Tally]] = {name: defaultdict(Tally) for name in names}
    turns: list[Turn] = []
    pack_seconds = 0.0
    screened = greedy_head and compiled is None and direct_forward_supported(target.model)
    head = greedy_head_for(target.model) if screened else None  # built here, outside every timing
    head_rows = (head.rows, head.fallback_rows) if head is not None else (0, 0)
    direct = direct_forward_for(target.model) if native and compiled is None else None
    native_used = direct is not None and direct.native  # built here, outside every timing
    hf_greedy(target.model, target.encode_chat([{"role": "user", "content": "Hi"}]), 4, eos)  # warm-up
    finished = list(progress.records) if progress is not None else []  # from the run this one resumes
    for record, question in zip(finished, questions):
        if record.get("question") != question.id:
            raise BenchError(f"{progress.path} does not follow these questions (at {question.id}); use --overwrite")
    resumed_turns = sum(len(q.turns) for q in questions[: len(finished)])  # counted, but not in the rate
    total_turns = sum(len(q.turns) for q in questions)
    bar = tqdm(total=total_turns, initial=resumed_turns, desc="bench", unit="turn", dynamic_ncols=True)
    decode_options = {"compiled": compiled, "packed_gemm": packed_gemm, "greedy_head": greedy_head, "native": native}
    for index, question in enumerate(questions):
        if index < len(finished):
            record = finished[index]
        else:
            record = _run_question(target, question, plain, drafters, max_new_tokens, decode_options, bar)
            if progress is not None:
                progress.append(record)
        turns += _tally_question(tallies, record, question.category)
        pack_seconds += sum(m["pack_seconds"] for turn in record["turns"] for m in turn["methods"].values())
    bar.close()
    engine_info = {}
    for method in engine_methods:
        print(f"bench: {method.name} in vLLM ({len(turns)} prompts; it compiles for a minute or two first)", flush=True)
        try:
            run = run_vllm(
                vllm_python, method, target_dir, [t.prompt for t in turns], max_new_tokens, eos, torch.get_num_threads()
            )
        except VllmError as error:  # the other methods' measurements are kept; the error is reported
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
    return {
        "target": target.identity.to_dict(),
        "max_new_tokens": max_new_tokens,
        "threads": torch.get_num_threads(),
        "device": str(target.model.device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "questions": len(questions),
        **({"resumed_questions": len(finished)} if finished else {}),
        "compiled": compiled is not None,
        **({"compile_seconds": round(compiled.compile_seconds, 1)} if compiled is not None else {}),
        **{f"{name}_compile_seconds": round(decode.compile_seconds, 1) for name, decode in plain.items()},
        "packed_gemm": _packed_gemm_summary(target.model, packed_gemm and compiled is None, pack_seconds),
        "direct_forward": compiled is None and direct_forward_supported(target.model),
        "native": native_used,
        "greedy_head": _greedy_head_summary(head, head_rows),
        "baseline": BASELINE,
        "methods": {name: {scope: t.summary() for scope, t in scopes.items()} for name, scopes in tallies.items()},
        **({"vllm": engine_info} if engine_info else {}),
    }


def markdown_table(results: dict[str, Any]) -> str:
    scopes = ["overall"] + sorted(s for s in results["methods"][BASELINE] if s != "overall")
    lines = [
        f"Greedy, max {results['max_new_tokens']} new tokens, {results.get('dtype', 'float32')} on "
        f"{results.get('device', 'cpu')}, {results['threads']} threads{_forward_note(results)}; "
        f"speedup = {BASELINE} time / method time on the same prompts.",
        "",
        "| method | scope | tau | speedup | tokens/s | identical |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, by_scope in results["methods"].items():
        for scope in scopes:
            s = by_scope.get(scope)
            if s:
                lines.append(
                    f"| {name} | {scope} | {s['tau']:.2f} | {s['speedup']:.2f}x | {s['tokens_per_s']:.1f} | "
                    f"{s['identical']}/{s['total']} |"
                )
    failed = {name: info["error"] for name, info in results.get("vllm", {}).items() if "error" in info}
    lines += [f"{name} did not run: {error}" for name, error in failed.items()]
    engines = {name: s["overall"] for name, s in results["methods"].items() if name.startswith("vllm")}
    if engines:
        lines += ["", "vLLM methods: tau = tokens / (speculative steps + 1 prefill); vLLM's own acceptance length:"]
        lines += [
            f"- {name}: {s['engine_acceptance_length']:.2f}"
            for name, s in engines.items()
            if "engine_acceptance_length" in s
        ]
    return "\n".join(lines) + "\n"


def _packed_gemm_summary(model, enabled: bool, pack_seconds: float) -> dict[str, Any] | None:
    """The row buckets packed for the runtime's verification forwards, or None when none were."""
    gemm = packed_gemm_for(model) if enabled else None
    if gemm is None or not gemm.buckets:
        return None
    return {"buckets": gemm.buckets, "pack_seconds": round(pack_seconds, 1)}


def _greedy_head_summary(head: GreedyHead | None, before: tuple[int, int]) -> dict[str, int] | None:
    """How many verification rows the screened head served in this run, and how many of them the
    proof left to the float32 head."""
    if head is None or head.rows == before[0]:
        return None
    return {"rows": head.rows - before[0], "fallback_rows": head.fallback_rows - before[1]}


def _forward_note(results: dict[str, Any]) -> str:
    """How the runtime's forwards ran, for the table's header."""
    notes = []
    if results.get("compiled"):
        notes.append(f"runtime forwards compiled ({results['compile_seconds']} s compiling, not counted)")
    if results.get("direct_forward"):
        notes.append("verification forwards direct (bitwise the model's, without its per-call machinery)")
    if results.get("native"):
        notes.append("decoder layers and contender search in C++ (bitwise the same)")
    head = results.get("greedy_head")
    if head:
        notes.append(
            f"greedy tokens through the screened int8 head, exact ({head['fallback_rows']} of {head['rows']} rows "
            "left to the float32 head by the proof)"
        )
    packed = results.get("packed_gemm")
    if packed:
        notes.append(
            f"tree forwards through MKL packed GEMM (row buckets {packed['buckets']}, {packed['pack_seconds']} s "
            "packing, not counted)"
        )
    return "".join(f"; {note}" for note in notes)


def write_chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results["methods"] if n != BASELINE]
    scopes = ["overall"] + sorted(s for s in results["methods"][BASELINE] if s != "overall")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(scopes))]
        axes[0].bar(xs, [results["methods"][name][s]["tau"] for s in scopes], width, label=name)
        axes[1].bar(xs, [results["methods"][name][s]["speedup"] for s in scopes], width, label=name)
    for axis, title in zip(axes, ["tau (tokens per target forward)", f"speedup vs {BASELINE}"]):
        axis.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(scopes))], scopes, rotation=20)
        axis.set_title(title)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def is_bench_results(path: Path) -> bool:
    """Whether ``path`` holds what :func:`write_results` writes (a results.json with its methods), or an
    unfinished bench's progress file."""
    if read_progress(Path(path) / PROGRESS)[0] is not None:
        return True
    try:
        results = json.loads((Path(path) / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(results, dict) and "methods" in results


def bench_output_rules(keep: tuple[tuple[str, Path], ...] = ()) -> OutputRules:
    """``bench --out`` replaces only earlier bench results, never one of ``keep`` (its inputs)."""
    return OutputRules("bench results written by `draftsmith bench`", is_bench_results, keep)


def write_results(
    results: dict[str, Any], out: Path, overwrite: bool = False, rules: OutputRules | None = None
) -> None:
    """results.json, results.md and chart.png, all or none, replacing ``out`` as ``rules`` allow."""
    with atomic_directory(Path(out), overwrite, rules or bench_output_rules()) as staging:
        atomic_write_json(staging / "results.json", results)
        atomic_write_bytes(staging / "results.md", markdown_table(results).encode())
        write_chart(results, staging / "chart.png")
