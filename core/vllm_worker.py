"""Runs vLLM for draftsmith inside vLLM's own Python environment (see ``vllm_env.py``).

It imports nothing of draftsmith and is run by path with that environment's interpreter, in one of
two modes:

- ``VLLM_PYTHON vllm_worker.py REQUEST.json RESULT.json`` (``bench``): REQUEST holds ``model`` (a
  safetensors target directory), ``prompts`` (token id lists), ``max_new_tokens``, ``stop_token_ids``,
  ``speculative_config`` (or null), ``max_model_len``, ``enforce_eager``. RESULT holds per prompt the
  generated ``tokens``, ``seconds`` and the engine's speculative-decoding counters (``drafts``,
  ``draft_tokens``, ``accepted``), plus ``startup_seconds`` and ``vllm_version``. Prompts run one at a
  time (batch 1, like draftsmith's runtime), greedy, after one warm-up request.
- ``VLLM_PYTHON vllm_worker.py --serve ENGINE.json REPLY_FD`` (``data regenerate --engine vllm``): one
  engine answers many batches. Each stdin line is a JSON request ``{"prompts": [...], "sampling":
  {SamplingParams keywords}}``; each reply is one JSON line on file descriptor REPLY_FD (vLLM logs to
  stdout, so replies travel apart): first ``{"vllm_version", "startup_seconds"}``, then per request
  ``{"outputs": [{"tokens", "finish_reason"}]}`` in prompt order. EOF on stdin ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time

COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted": "vllm:spec_decode_num_accepted_tokens",
}


def counters(llm) -> dict[str, int]:
    """The engine's speculative-decoding counters so far (0 when it has none: plain decoding)."""
    values = {key: 0 for key in COUNTERS}
    for metric in llm.get_metrics():
        for key, name in COUNTERS.items():
            if metric.name == name:
                values[key] += int(metric.value)
    return values


def start_engine(request: dict):
    """(LLM, seconds it took to start) for the request's model and engine settings."""
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "float32"),
        max_model_len=request["max_model_len"],
        seed=request.get("seed", 0),
        enforce_eager=request.get("enforce_eager", True),
        speculative_config=request.get("speculative_config"),
        model_impl=model_implementation(request["model"], request.get("speculative_config")),
        disable_log_stats=False,
    )
    return llm, time.perf_counter() - start


def model_implementation(model: str, speculative_config: dict | None) -> str:
    """vLLM's own model class where it serves the request, else its Transformers backend: an EAGLE-3
    drafter reads the target's intermediate states, which only classes with vLLM's EAGLE-3 interface
    return (vLLM 0.32's own Gemma3ForCausalLM has none; its Transformers backend has it for every model)."""
    if (speculative_config or {}).get("method") != "eagle3":
        return "auto"
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3

    with open(os.path.join(model, "config.json")) as config:
        architectures = json.load(config).get("architectures") or []
    try:
        own = [ModelRegistry._try_load_model_cls(name) for name in architectures]  # a private helper of vLLM's
    except AttributeError:  # another vLLM release: let it choose
        return "auto"
    return "auto" if any(cls is not None and supports_eagle3(cls) for cls in own) else "transformers"


def token_prompts(prompts: list[list[int]]) -> list:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]


def bench(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import SamplingParams

    request = json.loads(open(request_path).read())
    llm, startup = start_engine(request)
    params = SamplingParams(
        temperature=0.0, max_tokens=request["max_new_tokens"], stop_token_ids=request["stop_token_ids"]
    )
    llm.generate(token_prompts(request["prompts"][:1]), params, use_tqdm=False)  # warm-up
    results = []
    for prompt in request["prompts"]:
        before = counters(llm)
        begin = time.perf_counter()
        output = llm.generate(token_prompts([prompt]), params, use_tqdm=False)[0]
        seconds = time.perf_counter() - begin
        after = counters(llm)
        results.append(
            {
                "tokens": list(output.outputs[0].token_ids),
                "seconds": seconds,
                **{key: after[key] - before[key] for key in COUNTERS},
            }
        )
    result = {"vllm_version": vllm.__version__, "startup_seconds": startup, "results": results}
    with open(result_path, "w") as handle:
        json.dump(result, handle)


def stop_with_parent() -> None:
    """Kill this process group (this worker and vLLM's engine processes, which would otherwise keep
    running) when the draftsmith process that started it dies without closing it (kill, crash)."""
    import signal
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def serve(engine_path: str, reply_fd: int) -> None:
    import vllm
    from vllm import SamplingParams

    stop_with_parent()
    llm, startup = start_engine(json.loads(open(engine_path).read()))
    with os.fdopen(reply_fd, "w") as replies:

        def reply(message: dict) -> None:
            replies.write(json.dumps(message) + "\n")
            replies.flush()

        reply({"vllm_version": vllm.__version__, "startup_seconds": startup})
        for line in sys.stdin:
            request = json.loads(line)
            params = SamplingParams(**request["sampling"])
            outputs = llm.generate(token_prompts(request["prompts"]), params, use_tqdm=False)
            reply(
                {
                    "outputs": [
                        {"tokens": list(out.outputs[0].token_ids), "finish_reason": out.outputs[0].finish_reason}
                        for out in outputs
                    ]
                }
            )


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        bench(sys.argv[1], sys.argv[2])
