"""Plain decoding by transformers ``generate``: the reference of ``bench`` (:func:`hf_greedy`, run there
on the runtime's kernels) and, by name in ``bench --methods``, two more baselines:

- ``hf-stock``: ``generate`` as transformers runs it, with PyTorch's own linears and SDPA, the plain
  decoding a transformers user has today;
- ``hf-static-compile``: the fastest plain decoding a transformers user gets without another engine,
  ``generate`` with a static KV cache and its decoding step compiled by ``torch.compile``
  (transformers' own ``compile_config``; inductor on CPU, CUDA graphs on a GPU). The static cache is
  sized by :func:`~draftsmith.inference.kernels.compiled.context_bucket`, so few shapes are ever
  compiled; the first prompt of each size is decoded once untimed to compile (that time is reported
  as ``compile_seconds``), then timed like HF ``generate``.
"""

from __future__ import annotations

import time

import torch
from transformers import CompileConfig, StaticCache

from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.inference.kernels.compiled import context_bucket

NAME = "hf-static-compile"
STOCK_NAME = "hf-stock"


def greedy_settings(eos: list[int]) -> dict:
    """``generate`` arguments for plain greedy decoding to the token budget, shared by every HF
    baseline so they decode exactly alike (sampling settings of the model's generation config cleared)."""
    eos = list(eos)
    return {
        "do_sample": False,
        "eos_token_id": eos or None,
        "pad_token_id": eos[0] if eos else 0,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }


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


class StockGenerate:
    """``bench --methods hf-stock``: greedy ``generate`` as transformers runs it with nothing of draftsmith's
    (PyTorch's own linears and SDPA), the plain decoding a transformers user has today. The reference
    every method is checked against runs on the runtime's kernels instead (its numerical model); this
    one's tokens are compared with it too, so float32 rounding differences between the two show."""

    name = STOCK_NAME
    compile_seconds = 0.0

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, prompt: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
        return hf_greedy(self.model, prompt, max_new_tokens, eos)


class StaticCompiledGenerate:
    """Greedy ``generate`` with a bucketed ``StaticCache`` and a compiled decoding step."""

    name = NAME

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        cuda = model.device.type == "cuda"
        self.config = CompileConfig(fullgraph=True, mode="reduce-overhead" if cuda else "default")
        self.config._compile_all_devices = True  # transformers compiles only on accelerators unless told
        self.compile_seconds = 0.0
        self._warm: set[int] = set()

    def __call__(self, prompt: list[int], max_new_tokens: int, eos: list[int]) -> tuple[list[int], float]:
        """The greedy tokens (no EOS stop, like ``hf_greedy``) and the seconds they took."""
        rows = context_bucket(len(prompt) + max_new_tokens)
        if rows not in self._warm:
            start = time.perf_counter()
            self._generate(prompt, min(3, max_new_tokens), eos, rows)
            self.compile_seconds += time.perf_counter() - start
            self._warm.add(rows)
        start = time.perf_counter()
        tokens = self._generate(prompt, max_new_tokens, eos, rows)
        return tokens, time.perf_counter() - start

    @torch.no_grad()
    def _generate(self, prompt: list[int], max_new_tokens: int, eos: list[int], rows: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([prompt], device=self.model.device),
            **cache_kwargs(StaticCache(config=self.model.config, max_cache_len=rows)),
            compile_config=self.config,
            max_new_tokens=max_new_tokens,
            **greedy_settings(eos),
        )
        return out[0, len(prompt) :].tolist()  # waits for the device


# The plain decoders ``bench --methods`` takes by name besides the reference, each made for the target.
PLAIN_BASELINES = {NAME: StaticCompiledGenerate, STOCK_NAME: StockGenerate}
