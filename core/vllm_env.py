"""Reaching vLLM, which lives in its own Python environment.

vLLM's CPU build pins torch, transformers and a CUDA torchvision that clash with draftsmith's
environment, so draftsmith runs vLLM as a subprocess of that environment's interpreter
(``--vllm-python PATH`` or ``$DRAFTSMITH_VLLM_PYTHON``; without either, the current interpreter when
it has vLLM), executing ``vllm_worker.py`` by path. ``bench`` uses it to decode one prompt at a time
(``inference/measure/vllm_engine.py``); ``data regenerate --engine vllm`` keeps one engine running and sends
it batches (``data/regenerate.py``, ``VllmEngine``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from draftsmith.core.arguments import usable_cpus
from draftsmith.core.errors import DraftsmithError

VLLM_PYTHON_ENV = "DRAFTSMITH_VLLM_PYTHON"
WORKER = Path(__file__).with_name("vllm_worker.py")
ERROR_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): .+")
GENERIC_ERRORS = ("EngineDeadError", "RuntimeError: Worker failed", "RuntimeError: Engine core initialization failed")
DEFAULT_KVCACHE_GIB = "2"


class VllmError(DraftsmithError, RuntimeError):
    """vLLM is missing, refused a model, or failed while generating."""


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter of the environment that has vLLM, or one line saying how to provide it."""
    chosen = explicit or os.environ.get(VLLM_PYTHON_ENV)
    if chosen:
        if not Path(chosen).is_file():
            raise VllmError(
                f"--vllm-python {chosen} does not exist; give the python of the venv where vLLM is installed"
            )
        return chosen
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmError(
        "vLLM is not installed here; install it in its own venv (see README, 'vLLM') and pass --vllm-python "
        f"VENV/bin/python (or set {VLLM_PYTHON_ENV})"
    )


def vllm_environment(threads: int | None = None) -> dict[str, str]:
    """The worker's environment: the user's, with a KV-cache size that suits a shared CPU machine
    unless the user chose one (vLLM's CPU default reserves more memory than small runs need).

    ``threads``: how many cores vLLM's CPU build may compute on, bound to the first ones this process
    may use. Its own default (``auto``) keeps one core for its front end, which on a small machine
    halves its speed against a transformers baseline given every core. A binding the user set wins."""
    environment = {"VLLM_CPU_KVCACHE_SPACE": DEFAULT_KVCACHE_GIB, **os.environ}
    if threads is not None and THREADS_BIND not in os.environ:
        environment[THREADS_BIND] = cpu_binding(threads)
    return environment


THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_binding(threads: int) -> str:
    """vLLM's CPU list (``"0,1"``) for the first ``threads`` cores this process may run on."""
    if threads < 1:
        raise VllmError(f"vLLM needs at least one thread, got {threads}")
    return ",".join(str(cpu) for cpu in usable_cpus()[:threads])


def last_error_line(stderr: str) -> str:
    """What went wrong in a failed run's stderr: the first exception line (``SomeError: message``) that
    is not vLLM's generic "engine died" one, else the last line."""
    errors = [match.group(0) for match in ERROR_LINE.finditer(stderr) if not match.group(0).startswith(GENERIC_ERRORS)]
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return (errors[:1] or lines[-1:] or ["no output"])[0][:500]


class VllmServer:
    """One vLLM engine kept running in its own environment (``vllm_worker.py --serve``), answering
    batches of token prompts; vLLM batches each request's prompts itself. Use as a context manager.
    ``threads``: see :func:`vllm_environment` (None: vLLM's own binding)."""

    def __init__(self, python: str, engine: dict[str, Any], threads: int | None = None) -> None:
        self._work = tempfile.TemporaryDirectory(prefix="draftsmith-vllm-")
        work = Path(self._work.name)
        (work / "engine.json").write_text(json.dumps(engine))
        self._log_path = work / "vllm.log"
        read_fd, write_fd = os.pipe()
        with open(self._log_path, "w") as log:
            self._process = subprocess.Popen(
                [python, str(WORKER), "--serve", str(work / "engine.json"), str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=vllm_environment(threads),
                pass_fds=(write_fd,),
                text=True,
                # its own process group, so that stopping it also stops the engine processes vLLM spawns
                start_new_session=True,
            )
        os.close(write_fd)  # the worker holds the only write end, so its exit reads as EOF here
        self._replies = os.fdopen(read_fd, "r")
        try:
            hello = self._read()
        except BaseException:
            self.close()
            raise
        self.version: str = hello["vllm_version"]
        self.startup_seconds: float = hello["startup_seconds"]

    def generate(self, prompts: list[list[int]], sampling: dict[str, Any]) -> list[dict[str, Any]]:
        """Per prompt, in order: the generated ``tokens`` and vLLM's ``finish_reason`` ("stop"/"length")."""
        try:
            self._process.stdin.write(json.dumps({"prompts": prompts, "sampling": sampling}) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the worker died; _read reports why
        return self._read()["outputs"]

    def _read(self) -> dict[str, Any]:
        line = self._replies.readline()
        if not line:
            self._process.wait(timeout=120)
            raise VllmError(f"vLLM failed: {last_error_line(self._log_path.read_text(errors='replace'))}")
        return json.loads(line)

    def close(self, wait_seconds: float = 120.0) -> None:
        """Let the worker finish its request and exit; after ``wait_seconds`` (0: at once) stop it and
        every engine process it spawned."""
        if self._process.stdin and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._process.wait(timeout=wait_seconds)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self._process.pid, signal.SIGKILL)  # vLLM's engine processes outlive their parent
        except ProcessLookupError:
            pass
        self._process.wait()
        self._replies.close()
        self._work.cleanup()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(wait_seconds=0 if exc_type is not None else 120.0)  # interrupted: do not finish the batch
