"""llama.cpp as a ``draftsmith bench`` method: ``llamacpp`` (plain, ``llama-completion``) and ``llamacpp=DIR``
(``llama-speculative-simple --spec-type draft-eagle3`` with a drafter exported by ``draftsmith export
--format gguf``; ``:depth=N`` its draft length), on the same prompts as the runtime's methods.

llama.cpp runs as its own processes, one per prompt and method, from the binaries in ``--llamacpp-bin``
(built from the ``llama-cpp-python`` sdist, see docs/engines.md), on the target's GGUF (the embedded
target's own, or ``--llamacpp-model``). Each prompt is the text the target's chat template renders,
which llama.cpp tokenizes itself: its prompt token ids are read back (``--verbose-prompt``) and compared
with the runtime's. Its outputs are text; they are compared as the target's tokenizer encodes them.
Timings are llama.cpp's own (model loading and warm-up excluded): the prompt's forward, the decoding
after it, and for a drafter its drafted and accepted tokens.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftsmith.inference.measure.engine_specs import EngineMethodSpelling
from draftsmith.inference.measure.errors import BenchError

LLAMACPP = "llamacpp"
COMPLETION, SPECULATIVE = "llama-completion", "llama-speculative-simple"
END_OF_TEXT = " [end of text]\n"  # what llama-completion prints where generation meets an end-of-generation token
TRAILER = "\n\n"  # what both tools print after the generated text


class LlamaCppError(BenchError):
    """llama.cpp's tools missing or failing, or a ``llamacpp`` method spec that cannot run."""


@dataclass(frozen=True)
class LlamaCppMethod:
    """One llama.cpp bench method: plain (``draft`` None) or with a GGUF drafter drafting ``depth`` tokens."""

    name: str
    draft: Path | None = None
    depth: int = 0


@dataclass(frozen=True)
class LlamaCppRun:
    """One prompt decoded by llama.cpp: the generated text, its prompt token ids (plain runs), its timings
    in seconds, and for a drafter its verification steps and accepted draft tokens."""

    text: str
    prompt_seconds: float
    decode_seconds: float
    generated: int  # tokens it decoded after the prompt's forward (a drafter's run: all it committed)
    prompt_ids: tuple[int, ...] = ()
    steps: int = 0
    accepted: int = 0
    llamafile: bool = False  # its build runs llamafile's matrix products (plain runs read it from system_info)


SPELLING = EngineMethodSpelling(LLAMACPP, "depth", "llama.cpp", LlamaCppError)


def is_llamacpp_method(spec: str) -> bool:
    return SPELLING.matches(spec)


def parse_llamacpp_method(spec: str, target) -> LlamaCppMethod:
    """``llamacpp`` or ``llamacpp=DIR[:depth=N]``: DIR a ``--format gguf`` export made for ``target``
    (default depth: the one it was exported with)."""
    from draftsmith.drafters.gguf_layout import GGUF_FILE, read_gguf_record
    from draftsmith.drafters.io import check_drafter_target

    if spec == LLAMACPP:
        return LlamaCppMethod(spec)
    directory, depth = SPELLING.split(spec)
    record = read_gguf_record(directory / GGUF_FILE) if (directory / GGUF_FILE).is_file() else None
    if record is None:
        raise LlamaCppError(
            f"{directory} holds no drafter exported for llama.cpp; make one with "
            "`draftsmith export RUN --format gguf --out DIR`"
        )
    check_drafter_target(record, target, directory)
    return LlamaCppMethod(spec, (directory / GGUF_FILE).resolve(), SPELLING.draft_length(spec, depth, record))


def find_llamacpp_tools(directory: str | None) -> Path:
    """The directory holding llama.cpp's ``llama-completion`` and ``llama-speculative-simple``."""
    if directory is None:
        raise LlamaCppError(
            "llamacpp methods run llama.cpp's tools: build them (docs/engines.md) and pass --llamacpp-bin DIR"
        )
    missing = [name for name in (COMPLETION, SPECULATIVE) if not (Path(directory) / name).is_file()]
    if missing:
        raise LlamaCppError(
            f"--llamacpp-bin {directory} lacks {' and '.join(missing)}; build them with `cmake --build build "
            f"--target {COMPLETION} {SPECULATIVE}` (docs/engines.md) and pass that build's bin directory"
        )
    return Path(directory)


def common_arguments(model: Path, prompt: str, max_new_tokens: int, threads: int, context: int) -> list[str]:
    """Greedy decoding of ``prompt`` as given (no template of llama.cpp's own), on ``threads`` cores.

    Without flash attention (``-fa off``): with it (llama.cpp's default here) a verification batch of
    several rows rounds attention otherwise than one-token decoding, so drafted and plain outputs part on
    long prompts (with llama.cpp built ``-DGGML_LLAMAFILE=OFF``, whose matrix products otherwise differ by
    batch shape too: docs/engines.md). The weights stay in the file's own layout (``--no-repack``): the AMX
    kernels its repacking picks where the CPU reports AMX stop with an illegal instruction in VMs that do
    not give guests AMX's state (this project's Sapphire Rapids VMs)."""
    return [
        "-m", str(model), "-p", prompt, "-n", str(max_new_tokens), "-c", str(context), "--no-repack", "-fa", "off",
        "--temp", "0", "--top-k", "1", "--seed", "0", "-t", str(threads), "-tb", str(threads),
    ]  # fmt: skip


def run_tool(arguments: list[str], method: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        done = subprocess.run(arguments, capture_output=True, text=True, timeout=timeout, errors="replace")
    except subprocess.TimeoutExpired:
        raise LlamaCppError(f"llama.cpp ({method}) did not finish within {timeout:.0f} s") from None
    except OSError as error:
        raise LlamaCppError(f"llama.cpp ({method}) did not start: {error}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise LlamaCppError(f"llama.cpp ({method}) failed: {lines[-1] if lines else f'exit {done.returncode}'}")
    return done


def number(pattern: str, log: str, method: str) -> float:
    found = re.search(pattern, log, re.MULTILINE)
    if found is None:
        raise LlamaCppError(f"llama.cpp ({method}) printed no {pattern!r}; is it the version docs/engines.md builds?")
    return float(found.group(1))


def run_plain(tools: Path, model: Path, prompt: str, max_new_tokens: int, threads: int, context: int) -> LlamaCppRun:
    """``llama-completion``: the generated text (the prompt not echoed), its prompt ids and timings."""
    arguments = [str(tools / COMPLETION), *common_arguments(model, prompt, max_new_tokens, threads, context)]
    done = run_tool([*arguments, "-no-cnv", "--no-display-prompt", "--verbose-prompt"], LLAMACPP, 600)
    text = done.stdout.removesuffix(TRAILER).removesuffix(END_OF_TEXT)
    log = done.stderr
    prompt_ms = number(r"prompt eval time =\s*([\d.]+) ms", log, LLAMACPP)
    decode_ms = number(r"\beval time =\s*([\d.]+) ms", log.split("prompt eval time", 1)[-1], LLAMACPP)
    runs = number(r"\beval time =\s*[\d.]+ ms /\s*(\d+) runs", log.split("prompt eval time", 1)[-1], LLAMACPP)
    return LlamaCppRun(text, prompt_ms / 1000, decode_ms / 1000, int(runs), prompt_ids(log), llamafile=llamafile(log))


def llamafile(log: str) -> bool:
    """Whether the tool's ``system_info`` line says it was built with llamafile's matrix products (llama.cpp's
    default, ``-DGGML_LLAMAFILE=OFF`` turns them off), whose batches round otherwise than one-row decoding."""
    return re.search(r"system_info:.*\bLLAMAFILE = 1\b", log) is not None


def prompt_ids(log: str) -> tuple[int, ...]:
    """The prompt's token ids as ``--verbose-prompt`` lists them: their count, then one ``ID -> 'piece'``
    line each (after the log's time and level prefix; a piece may hold line breaks)."""
    count = int(number(r"number of tokens in prompt = (\d+)", log, LLAMACPP))
    listing = log.split("number of tokens in prompt", 1)[1]
    return tuple(int(i) for i in re.findall(r"^(?:\S+ [A-Z] )?\s*(\d+) -> '", listing, re.MULTILINE)[:count])


def run_speculative(
    tools: Path, model: Path, method: LlamaCppMethod, prompt: str, max_new_tokens: int, threads: int, context: int
) -> LlamaCppRun:
    """``llama-speculative-simple`` with the method's drafter: the generated text (after the echoed
    prompt), its timings and its drafting counters."""
    arguments = [str(tools / SPECULATIVE), *common_arguments(model, prompt, max_new_tokens, threads, context)]
    arguments += ["-md", str(method.draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(method.depth)]
    done = run_tool([*arguments, "-td", str(threads), "-tbd", str(threads)], method.name, 600)
    text = done.stdout.removeprefix(TRAILER)
    if not text.startswith(prompt):
        raise LlamaCppError(f"llama.cpp ({method.name}) echoed another prompt than it was given; its output is unread")
    text = text[len(prompt) :].removesuffix(TRAILER).removesuffix(TRAILER)
    log = done.stderr
    generated = int(number(r"n_predict\s*=\s*(\d+)", log, method.name))
    accepted = int(number(r"n_accept\s*=\s*(\d+)", log, method.name))
    return LlamaCppRun(
        text,
        number(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log, method.name),
        number(r"decoded\s+\d+ tokens in\s+([\d.]+) seconds", log, method.name),
        generated,
        steps=generated - accepted,  # each target forward commits its accepted drafts and one token of its own
        accepted=accepted,
    )
