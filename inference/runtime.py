"""The tree-decoding loop: the drafter proposes a tree, one target forward verifies it, the drafter
observes the verdict, and exactly what the target says is committed. How the forwards run (eager fast
paths or compiled graphs, which cache) is the verification backend's business (``backends.py``),
chosen once per generation from the kernel options.

Greedy: every committed token is the target's argmax given all tokens before it, so the output is
token-identical to ``model.generate(do_sample=False)`` (checked in float32 by the tests). Sampling:
every committed token is distributed exactly as plain sampling with the same temperature, top-k and
top-p (lossless rules only; see ``verify.verify_sampling``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import SamplingConfig, sample, verify_greedy, verify_greedy_tokens, verify_sampling
from draftsmith.core.versions import warn_about_untested_versions
from draftsmith.inference.backends import DEFAULT_TREE_ROOM, Backends, GreedyForward

warn_about_untested_versions()


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, EOS included if it was produced
    target_forwards: int  # prefill included: plain decoding has tau == 1
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification forward
    seconds: float = 0.0  # compilation excluded
    compile_seconds: float = 0.0  # first calls of a compiled forward's new shapes during this generation
    # setup in this generation: packing the target's weights (a new row bucket, the screened head),
    # loading the native layers
    pack_seconds: float = 0.0
    # the prompt's forward and the first token, setup excluded: the part of ``seconds`` no drafter shortens
    prompt_seconds: float = 0.0

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.target_forwards if self.target_forwards else 0.0


class FeatureRows:
    """The target's features at committed tokens, appended in place to one preallocated buffer (a
    ``torch.cat`` per round would copy every earlier row again); ``view`` is what drafters read."""

    def __init__(self, first: torch.Tensor, capacity: int) -> None:
        self._buffer = first.new_empty(max(capacity, first.shape[0]), first.shape[1])
        self._buffer[: first.shape[0]] = first
        self._length = first.shape[0]

    def append(self, rows: torch.Tensor) -> None:
        end = self._length + rows.shape[0]
        if end > self._buffer.shape[0]:
            grown = self._buffer.new_empty(max(end, 2 * self._buffer.shape[0]), self._buffer.shape[1])
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : end] = rows
        self._length = end

    @property
    def view(self) -> torch.Tensor:
        return self._buffer[: self._length]


def _drafter_states(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """The first sequence's rows of the target states a drafter declares (``Drafter.feature_layers``),
    concatenated: views of what the forward computed anyway, so no extra target work."""
    if len(layers) == 1:
        return hidden_states[layers[0]][0]
    return torch.cat([hidden_states[layer][0] for layer in layers], dim=-1)


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) or at the token budget; True when generation is over."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


class PlainDecoding(Drafter):
    """No drafter: every round verifies the root alone, so the runtime decodes one token per forward."""

    name = "none"

    def propose(self, context: DraftContext) -> DraftTree:
        return DraftTree.empty()


def _first_token(logits: torch.Tensor, sampling: SamplingConfig | None, generator: torch.Generator | None) -> int:
    return int(logits.argmax()) if sampling is None else sample(sampling.probs(logits), generator)


def _judge(drafter: Drafter, tree: DraftTree, out, sampling: SamplingConfig | None, generator: torch.Generator | None):
    """The tree the forward verified (the verifier may prune it inside its forward), the logits over its
    rows (None when the forward computed only greedy tokens) and the verdict on it."""
    queries = 1 + len(tree)  # the forward's real rows; those past them are a bucket's padding
    kept = drafter.verified_rows(out)
    if kept is not None:
        tree = tree.subtree(kept[1:] - 1)
    if isinstance(out, GreedyForward):
        return tree, None, verify_greedy_tokens(tree, out.predictions)
    logits = out.logits[0, :queries]
    if sampling is None:
        return tree, logits, verify_greedy(tree, logits)
    return tree, logits, verify_sampling(tree, logits, sampling, generator)


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding: how the target's logits become the distribution a token is drawn from, and the
    generator every draw takes (seed it for the same tokens each run; drafters that sample their drafts
    draw from it too)."""

    config: SamplingConfig
    generator: torch.Generator | None = None


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    *,
    max_new_tokens: int = 128,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    sampling: Sampling | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    backends: Backends | None = None,
) -> GenerationResult:
    """Speculative decoding of one prompt, greedy (``sampling=None``) or sampled; ``drafter=None`` is
    plain decoding through the runtime. ``on_tokens`` receives all new tokens so far after every commit.
    ``backends`` runs the verification forwards as its :class:`KernelOptions` say (keep one across calls
    so kernels and compiled graphs are built once); by default, one with the default options."""
    start = time.perf_counter()
    sampling, generator = (sampling.config, sampling.generator) if sampling is not None else (None, None)
    drafter = drafter if drafter is not None else PlainDecoding()
    reads_logits = sampling is not None or drafter.reads_logits
    backend = (backends or Backends()).for_generation(model, drafter, reads_logits)
    hidden, layers, eos = drafter.wants_features, drafter.feature_layers, set(eos_token_ids)
    capacity = len(prompt_ids) + max_new_tokens + DEFAULT_TREE_ROOM
    cache = backend.new_cache(capacity)
    out = backend.prefill(cache, prompt_ids, hidden)
    features = FeatureRows(_drafter_states(out.hidden_states, layers), capacity) if hidden else None
    new, done = _finish([_first_token(out.logits[0, -1], sampling, generator)], max_new_tokens, eos)
    result = GenerationResult(new, target_forwards=1)
    result.prompt_seconds = max(0.0, time.perf_counter() - start - backend.compile_seconds() - backend.setup_seconds())
    if on_tokens:
        on_tokens(new)
    while not done:
        committed = prompt_ids + new
        past = len(committed) - 1
        seen = None if features is None else features.view
        with backend.drafting():
            tree = drafter.propose(DraftContext(committed, len(prompt_ids), sampling, generator, seen))
        if not backend.fits(cache, past, tree):
            tree = DraftTree.empty()  # no speculation past the context window or the static cache
        out = backend.verify(cache, committed[-1], tree, past, hidden)
        tree, logits, verdict = _judge(drafter, tree, out, sampling, generator)
        drafter.observe(tree, logits, verdict)
        backend.commit(cache, past, verdict.accepted_nodes)
        if features is not None:  # the root's row and the accepted nodes' rows, in commit order
            rows = torch.tensor([0] + [i + 1 for i in verdict.accepted_nodes], device=backend.device)
            features.append(_drafter_states(out.hidden_states, layers).index_select(0, rows))
        step = [int(tree.tokens[i]) for i in verdict.accepted_nodes] + [verdict.next_token]
        result.target_forwards += 1
        result.accept_lengths.append(len(step))
        new, done = _finish(new + step, max_new_tokens, eos)
        if on_tokens:
            on_tokens(new)
    result.tokens = new
    result.compile_seconds, result.pack_seconds = backend.compile_seconds(), backend.setup_seconds()
    result.seconds = time.perf_counter() - start - result.compile_seconds - result.pack_seconds
    return result
