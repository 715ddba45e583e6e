"""The tree-decoding loop: draft, verify in one target forward, commit exactly what the target says.

Greedy: every committed token is the target's argmax given all tokens before it, so the output is
token-identical to ``model.generate(do_sample=False)`` (checked in float32 by the tests). Sampling:
every committed token is distributed exactly as plain sampling with the same temperature, top-k and
top-p (lossless rules only; see ``verify.verify_sampling``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from draftsmith.core.cache import commit_tree_path, preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree, TreeInputBuffers
from draftsmith.core.verify import SamplingConfig, sample, verify_greedy, verify_greedy_tokens, verify_sampling
from draftsmith.core.versions import warn_about_untested_versions
from draftsmith.inference.compiled import CompiledTarget, StaticTreeInputs, commit_static, static_rows, tree_bucket
from draftsmith.inference.direct_forward import DirectForward, direct_forward_for
from draftsmith.inference.greedy_head import GreedyHead, greedy_head_for
from draftsmith.inference.packed_gemm import PackedGemm, packed_gemm_for

warn_about_untested_versions()


@dataclass
class GreedyForward:
    """A verification forward that computed only the target's argmax at its rows (no logits)."""

    predictions: torch.Tensor  # (1 + tree nodes,) token ids over [root, nodes]
    hidden_states: tuple[torch.Tensor, ...] | None


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

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.target_forwards if self.target_forwards else 0.0


# Tree rows the preallocated buffers leave room for beyond the committed tokens; a bigger tree grows them.
DEFAULT_TREE_ROOM = 64


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


def verification_forward(
    model,
    cache,
    tree_inputs: TreeInputBuffers,
    root: int,
    tree: DraftTree,
    past: int,
    hidden: bool,
    gemm: PackedGemm | None = None,
    direct: DirectForward | None = None,
    greedy: GreedyHead | None = None,
):
    """The verification forward over ``[root, tree]`` on top of ``past`` cached rows, uncompiled. With
    ``gemm``, a multi-row forward is padded to its packed row bucket (rows past ``1 + len(tree)`` of
    the output are padding). With ``direct`` (built for ``model``), the forward skips transformers'
    per-call machinery, bitwise the same (``direct_forward.py``); adding ``greedy`` (the model's head),
    it returns a :class:`GreedyForward`: the float32 head's argmax per row, without its logits."""
    device = tree_inputs.device
    if len(tree):
        rows = gemm.padded_rows(1 + len(tree)) if gemm is not None else 0
        mask, positions = tree_inputs.build(tree, past, rows)
    else:  # the root alone sees every cached key: no mask, as in plain decoding
        mask, positions = None, torch.tensor([[past]], device=device)
    input_ids = torch.full((1, positions.shape[1]), root, dtype=torch.long)
    input_ids[0, 1 : 1 + len(tree)] = tree.tokens
    with gemm.rows() if gemm is not None else nullcontext(), _grouped_kv_heads(device):
        if direct is not None and greedy is not None:
            out = direct(input_ids.to(device), positions, mask, cache, hidden, head=False)
            tokens = greedy(out.last_hidden_state[0, : 1 + len(tree)], direct.extension)
            return GreedyForward(tokens, out.hidden_states)
        if direct is not None:
            return direct(input_ids.to(device), positions, mask, cache, hidden)
        return model(
            input_ids.to(device),
            attention_mask=mask,
            position_ids=positions,
            **cache_kwargs(cache),
            use_cache=True,
            output_hidden_states=hidden,
        )


@contextmanager
def _grouped_kv_heads(device: torch.device) -> Iterator[None]:
    """On a CPU, let SDPA read grouped-query K/V heads as they are (``enable_gqa``) under a tree mask too.
    Transformers otherwise copies every cached key and value ``num_key_value_groups`` times per layer
    whenever a mask is given: work that grows with the context (13% of a 4-row forward over a
    1,500-token context on SmolLM2), with bit-identical results on CPU. CUDA keeps the copy (its fused
    kernels take no mask with grouped heads); transformers reads this switch at every attention call."""
    if device.type != "cpu" or os.environ.get(_FORCE_GQA) is not None:
        yield
        return
    os.environ[_FORCE_GQA] = "1"
    try:
        yield
    finally:
        del os.environ[_FORCE_GQA]


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@torch.no_grad()
def generate(
    model,
    prompt_ids: list[int],
    drafter: Drafter | None = None,
    *,
    max_new_tokens: int = 128,
    eos_token_ids: list[int] | tuple[int, ...] = (),
    sampling: SamplingConfig | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    compiled: CompiledTarget | None = None,
    packed_gemm: bool = True,
    direct_forward: bool = True,
    greedy_head: bool = True,
    native: bool = True,
) -> GenerationResult:
    """Speculative decoding of one prompt, greedy (``sampling=None``) or sampled; ``drafter=None`` is
    plain decoding through the runtime. ``on_tokens`` receives all new tokens so far after every commit.
    ``compiled`` (built for ``model``) runs every verification forward through its compiled graphs;
    drafters that serve or verify with their own model (an adapted target) run eagerly. ``packed_gemm``: eager
    multi-row forwards of a float32 CPU target go through MKL's packed GEMM (``packed_gemm.py``).
    ``direct_forward``: eager verification forwards of a supported target (a Llama with SDPA) skip
    transformers' per-call machinery, with bitwise the same results (``direct_forward.py``).
    ``greedy_head``: greedy direct forwards compute only the float32 head's argmax, through a screened
    int8 copy of the head and a proof (``greedy_head.py``), unless the drafter reads the logits.
    ``native``: direct forwards of a float32 CPU target run their layers as one C++ call, bitwise the same,
    and the screened head searches its contenders in C++ (``native.py``; built once per machine, outside
    the timing)."""
    start = time.perf_counter()
    compiled_before = compiled.compile_seconds if compiled is not None else 0.0
    served = drafter.served_model() if drafter is not None else None
    verifier = drafter.verifier_model() if drafter is not None else None
    model = served if served is not None else model
    model = model if verifier is None else verifier
    compiled = compiled if verifier is None and served is None else None
    gemm = packed_gemm_for(model) if packed_gemm and compiled is None and verifier is None else None
    packed_before = gemm.pack_seconds if gemm is not None else 0.0
    setup_start = time.perf_counter()  # a first call loads (or builds) the native layers: setup
    eager_target = compiled is None and verifier is None
    direct = direct_forward_for(model, native) if direct_forward and eager_target else None
    setup_seconds = time.perf_counter() - setup_start
    reads_logits = sampling is not None or (drafter is not None and drafter.reads_logits)
    head_start = time.perf_counter()  # a first call builds the screened head: setup, like packing
    greedy = greedy_head_for(model) if greedy_head and direct is not None and not reads_logits else None
    head_seconds = time.perf_counter() - head_start if greedy is not None and greedy.rows == 0 else 0.0
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    eos = set(eos_token_ids)
    capacity = len(prompt_ids) + max_new_tokens + DEFAULT_TREE_ROOM
    if compiled is None:
        cache = preallocated_cache_for(model.config, capacity)
        tree_inputs = TreeInputBuffers(DEFAULT_TREE_ROOM, capacity, dtype, device)
    else:
        cache = compiled.new_cache(capacity)
        static_inputs = StaticTreeInputs(static_rows(cache), dtype, device)
    wants_features = drafter is not None and drafter.wants_features
    # The prompt's logits matter at its last token only; a bare target (like HF generate) skips the
    # lm_head over every other prompt row. Verifier models keep their own full-logits contract.
    last_logits_only = {"logits_to_keep": 1} if verifier is None else {}
    out = model(
        torch.tensor([prompt_ids], device=device),
        **cache_kwargs(cache),
        use_cache=True,
        output_hidden_states=wants_features,
        **last_logits_only,
    )
    logits = out.logits
    layers = drafter.feature_layers if wants_features else ()
    features = FeatureRows(_drafter_states(out.hidden_states, layers), capacity) if wants_features else None
    first = int(logits[0, -1].argmax()) if sampling is None else sample(sampling.probs(logits[0, -1]), generator)
    new, done = _finish([first], max_new_tokens, eos)
    result = GenerationResult(new, target_forwards=1)
    if on_tokens:
        on_tokens(new)
    limit = getattr(model.config, "max_position_embeddings", None)
    while not done:
        committed = prompt_ids + new
        past = len(committed) - 1
        context = DraftContext(
            committed, len(prompt_ids), sampling, generator, None if features is None else features.view
        )
        tree = drafter.propose(context) if drafter else DraftTree.empty()
        if limit is not None and past + 1 + len(tree) > limit:
            tree = DraftTree.empty()  # no speculation past the model's context window
        if compiled is not None and past + tree_bucket(1 + len(tree)) > static_inputs.columns:
            tree = DraftTree.empty()  # a tree too big for the static cache's spare rows
        if compiled is None:
            out = verification_forward(
                model, cache, tree_inputs, committed[-1], tree, past, wants_features, gemm, direct, greedy
            )
        else:
            out = compiled.verify(*static_inputs.build(committed[-1], tree, past), cache, past, wants_features)
        queries = 1 + len(tree)
        kept = drafter.verified_rows(out) if drafter is not None else None
        if kept is not None:  # the verifier pruned the tree inside its forward: verify what is left
            tree = tree.subtree(kept[1:] - 1)
        if isinstance(out, GreedyForward):
            logits, verdict = None, verify_greedy_tokens(tree, out.predictions)
        else:
            logits = out.logits[0, :queries]  # rows past the queries are a bucket's padding
            verdict = (
                verify_greedy(tree, logits) if sampling is None else verify_sampling(tree, logits, sampling, generator)
            )
        if drafter is not None:
            drafter.observe(tree, logits, verdict)
        if compiled is None:
            commit_tree_path(cache, past, verdict.accepted_nodes)
        else:
            commit_static(cache, past, verdict.accepted_nodes)
        if wants_features:  # the root's row and the accepted nodes' rows, in commit order
            rows = torch.tensor([0] + [i + 1 for i in verdict.accepted_nodes], device=device)
            features.append(_drafter_states(out.hidden_states, layers).index_select(0, rows))
        step = [int(tree.tokens[i]) for i in verdict.accepted_nodes] + [verdict.next_token]
        result.target_forwards += 1
        result.accept_lengths.append(len(step))
        new, done = _finish(new + step, max_new_tokens, eos)
        if on_tokens:
            on_tokens(new)
    result.tokens = new
    if compiled is not None:
        result.compile_seconds = compiled.compile_seconds - compiled_before
    result.pack_seconds = head_seconds + setup_seconds
    if gemm is not None:
        result.pack_seconds += gemm.pack_seconds - packed_before
    result.seconds = time.perf_counter() - start - result.compile_seconds - result.pack_seconds
    return result
