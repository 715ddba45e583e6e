"""Runs vLLM for ``draftsmith bench`` inside vLLM's own Python environment.

vLLM's CPU build pins torch, transformers and a CUDA torchvision that clash with draftsmith's
environment, so ``bench`` runs this file (by path, with the interpreter of a separate vLLM venv):
``VLLM_PYTHON vllm_worker.py REQUEST.json RESULT.json``. It imports nothing of draftsmith.

REQUEST: ``model`` (a safetensors target directory), ``prompts`` (token id lists), ``max_new_tokens``,
``stop_token_ids``, ``speculative_config`` (or null), ``max_model_len``, ``enforce_eager``.
RESULT: per prompt the generated ``tokens``, ``seconds`` and the engine's speculative-decoding
counters (``drafts``, ``draft_tokens``, ``accepted``), plus ``startup_seconds`` and ``vllm_version``.
Prompts run one at a time (batch 1, like draftsmith's runtime), greedy, after one warm-up request.
"""

from __future__ import annotations

import json
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


def main(request_path: str, result_path: str) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    request = json.loads(open(request_path).read())
    start = time.perf_counter()
    llm = LLM(
        model=request["model"],
        dtype=request.get("dtype", "float32"),
        max_model_len=request["max_model_len"],
        seed=0,
        enforce_eager=request.get("enforce_eager", True),
        speculative_config=request.get("speculative_config"),
        disable_log_stats=False,
    )
    startup = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0, max_tokens=request["max_new_tokens"], stop_token_ids=request["stop_token_ids"]
    )
    llm.generate([TokensPrompt(prompt_token_ids=request["prompts"][0])], params, use_tqdm=False)  # warm-up
    results = []
    for prompt in request["prompts"]:
        before = counters(llm)
        begin = time.perf_counter()
        output = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
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


if __name__ == "__main__":  # vLLM spawns its engine process, which re-imports this file
    main(sys.argv[1], sys.argv[2])
