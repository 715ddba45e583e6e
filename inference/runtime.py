"""The tree-decoding loop: draft, verify in one target forward, commit exactly what the target says.

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
from transformers import DynamicCache

from draftsmith.core.cache import commit_tree_path
from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree, tree_attention_inputs
from draftsmith.core.verify import SamplingConfig, sample, verify_greedy, verify_sampling


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens, EOS included if it was produced
    target_forwards: int  # prefill included: plain decoding has tau == 1
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verification forward
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        return len(self.tokens) / self.target_forwards if self.target_forwards else 0.0


def _finish(tokens: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) or at the token budget; True when generation is over."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in eos:
            return tokens[: i + 1], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


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
) -> GenerationResult:
    """Speculative decoding of one prompt, greedy (``sampling=None``) or sampled; ``drafter=None`` is
    plain decoding through the runtime. ``on_tokens`` receives all new tokens so far after every commit."""
    start = time.perf_counter()
    verifier = drafter.verifier_model() if drafter is not None else None
    model = model if verifier is None else verifier
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    eos = set(eos_token_ids)
    cache = DynamicCache(config=model.config)
    wants_features = drafter is not None and drafter.wants_features
    out = model(
        torch.tensor([prompt_ids], device=device),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=wants_features,
    )
    logits = out.logits
    features = out.hidden_states[-1][0] if wants_features else None
    first = int(logits[0, -1].argmax()) if sampling is None else sample(sampling.probs(logits[0, -1]), generator)
    new, done = _finish([first], max_new_tokens, eos)
    result = GenerationResult(new, target_forwards=1)
    if on_tokens:
        on_tokens(new)
    limit = getattr(model.config, "max_position_embeddings", None)
    while not done:
        committed = prompt_ids + new
        past = len(committed) - 1
        context = DraftContext(committed, len(prompt_ids), sampling, generator, features)
        tree = drafter.propose(context) if drafter else DraftTree.empty()
        if limit is not None and past + 1 + len(tree) > limit:
            tree = DraftTree.empty()  # no speculation past the model's context window
        mask, positions = tree_attention_inputs(tree, past, dtype, device)
        input_ids = torch.cat([torch.tensor([committed[-1]]), tree.tokens]).to(device)[None]
        out = model(
            input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=wants_features,
        )
        kept = drafter.verified_rows(out) if drafter is not None else None
        if kept is not None:  # the verifier pruned the tree inside its forward: verify what is left
            tree = tree.subtree(kept[1:] - 1)
        logits = out.logits[0]
        verdict = (
            verify_greedy(tree, logits) if sampling is None else verify_sampling(tree, logits, sampling, generator)
        )
        if drafter is not None:
            drafter.observe(tree, logits, verdict)
        commit_tree_path(cache, past, verdict.accepted_nodes)
        if wants_features:  # the root's row and the accepted nodes' rows, in commit order
            rows = torch.tensor([0] + [i + 1 for i in verdict.accepted_nodes], device=device)
            features = torch.cat([features, out.hidden_states[-1][0].index_select(0, rows)])
        step = [int(tree.tokens[i]) for i in verdict.accepted_nodes] + [verdict.next_token]
        result.target_forwards += 1
        result.accept_lengths.append(len(step))
        new, done = _finish(new + step, max_new_tokens, eos)
        if on_tokens:
            on_tokens(new)
    result.tokens = new
    result.seconds = time.perf_counter() - start
    return result
