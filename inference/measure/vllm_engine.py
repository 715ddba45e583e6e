"""vLLM as a ``draftsmith bench`` method: ``vllm`` (plain) and ``vllm=DIR`` (with a drafter exported by
``draftsmith export --format vllm``), on the same prompts as the runtime's methods.

vLLM's CPU build pins its own torch and transformers, so it lives in a separate virtual environment
and runs there as a subprocess (``core/vllm_worker.py``, by path; ``core/vllm_env.py`` finds that
environment's interpreter). vLLM opens the target as a safetensors directory (for the embedded
default: draftsmith's dequantised cache) and the drafter directory as exported.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.core.target import Target
from draftsmith.core.vllm_env import WORKER, VllmError, last_error_line, vllm_environment
from draftsmith.drafters.io import check_drafter_target, read_engine_export
from draftsmith.drafters.registry import FAMILIES
from draftsmith.inference.measure.engine_specs import EngineMethodSpelling

VLLM = "vllm"
VLLM_TIMEOUT_S = 3600.0  # a bench's vLLM run (start-up, compiling and every prompt) stopped after this long


@dataclass(frozen=True)
class VllmMethod:
    """One vLLM bench method: plain (``draft`` None) or with an exported drafter."""

    name: str
    draft: Path | None = None
    engine_method: tuple[tuple[str, Any], ...] = ()  # the method's speculative_config entries
    speculative_tokens: int = 0

    def speculative_config(self) -> dict[str, Any] | None:
        if self.draft is None:
            return None
        return {**dict(self.engine_method), "model": str(self.draft), "num_speculative_tokens": self.speculative_tokens}


SPELLING = EngineMethodSpelling(VLLM, "tokens", "vLLM", VllmError)


def is_vllm_method(spec: str) -> bool:
    return SPELLING.matches(spec)


def parse_vllm_method(spec: str, target: Target) -> VllmMethod:
    """``vllm`` or ``vllm=DIR[:tokens=N]``; DIR must be an engine export for vLLM made for ``target``."""
    if spec == VLLM:
        return VllmMethod(spec)
    directory, tokens = SPELLING.split(spec)
    record = read_engine_export(directory)
    if record is None:
        raise VllmError(
            f"{directory} is not a drafter exported for vLLM; make one with `draftsmith export RUN --format vllm`"
        )
    family = FAMILIES.get(record.get("family"))
    if record.get("format") == "sglang" or family is None or not family.vllm_method:
        raise VllmError(
            f"{directory} holds a {record.get('family')!r} drafter in the {record.get('format')} layout, "
            "which vLLM does not serve; export it with --format vllm"
        )
    check_drafter_target(record, target, directory)
    return VllmMethod(spec, directory.resolve(), family.vllm_method, SPELLING.draft_length(spec, tokens, record))


def run_vllm(
    python: str,
    method: VllmMethod,
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_token_ids: list[int],
    threads: int,
    eager: bool = False,
) -> dict[str, Any]:
    """Greedy generations of ``prompts`` one at a time in a vLLM engine (float32) computing on
    ``threads`` cores, with per-prompt seconds and speculative-decoding counters; see
    ``vllm_worker.py``. The engine runs compiled, its fastest mode (its longer start-up is reported
    apart and never timed); ``eager`` skips the
    compiling where start-up matters more than speed (tests). A run past :data:`VLLM_TIMEOUT_S` is stopped."""
    longest = max(len(p) for p in prompts) + max_new_tokens + method.speculative_tokens + 16
    request = {
        "model": str(model_dir),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": stop_token_ids,
        "speculative_config": method.speculative_config(),
        "max_model_len": longest,
        "enforce_eager": eager,
    }
    with tempfile.TemporaryDirectory(prefix="draftsmith-vllm-") as work:
        request_path, result_path = Path(work) / "request.json", Path(work) / "result.json"
        request_path.write_text(json.dumps(request))
        try:
            done = subprocess.run(
                [python, str(WORKER), str(request_path), str(result_path)],
                env=vllm_environment(threads),
                capture_output=True,
                text=True,
                timeout=VLLM_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise VllmError(f"vLLM ({method.name}) did not finish within {VLLM_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0 or not result_path.is_file():
            # vLLM's engine processes log the root cause on stdout, the generic "engine failed" on stderr
            raise VllmError(f"vLLM ({method.name}) failed: {last_error_line(done.stdout + done.stderr)}")
        return json.loads(result_path.read_text())
