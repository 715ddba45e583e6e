"""Draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small causal LM that
shares the target's tokenizer drafts a chain of K tokens, one forward per token, and the target verifies
the chain in one forward.

Greedy: the chain is the draft model's argmax, and greedy verification keeps the output token-identical
to plain greedy decoding. Sampling: each draft token is sampled from ``q`` = the draft model's
distribution processed with the same temperature / top-k / top-p as the target, and the chain carries
``q`` so the runtime applies Leviathan's ``min(1, p/q)`` rule (``verify.verify_sampling``), which is
lossless for any ``q``.

Vocabulary: the draft's and the target's ``lm_head`` may be padded to different sizes for the same
tokenizer. Drafting only uses the first ``min(V_draft, V_target)`` logits (every real token of the shared
tokenizer is below both), and ``q`` is zero-padded to the target's size, so a draft token is always a
valid target id and ``q`` is exactly the distribution the token was sampled from. A draft with fewer
rows than the tokenizer has tokens is refused when it is loaded.

``layers:N`` builds an untrained self-speculative draft from the target's own first N decoder layers,
its final norm and its ``lm_head`` (shared weights, no copy); see :func:`build_truncated_draft`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from draftsmith.core.cache import keep_positions, preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.target import Target, TargetError, load_target, load_tokenizer
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import sample
from draftsmith.inference.methods.errors import MethodError

DEFAULT_NUM_DRAFT = 4  # tokens per chain: a good default for small drafts on a CPU
_K_SUFFIX = re.compile(r"^(?P<spec>.+):k=(?P<k>\d+)$")


def _logits_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


DRAFT_CACHE_ROWS = 1024  # the draft model's cache grows past this (doubling) for longer contexts


@dataclass
class DraftModelDrafter(Drafter):
    """Drafts a chain of ``num_draft`` tokens with ``model`` and its own KV cache.

    The cache holds the draft model's keys/values for ``cached_tokens``. After verification the runtime
    calls ``observe``, which drops the rejected drafts at once. Each round then starts by cutting the
    cache back to the longest common prefix of ``cached_tokens`` and the committed context (everything,
    when a new prompt starts; also the rejected drafts, for a runtime that does not call ``observe``)
    and feeds the committed tokens it has not seen. So no KV of an uncommitted token is ever used: the
    tests compare the cache with a fresh prefill after every round."""

    model: Any
    target_vocab_size: int
    num_draft: int = DEFAULT_NUM_DRAFT
    stop_token_ids: tuple[int, ...] = ()  # no drafting past an end-of-answer token
    name: str = "draft"
    cache: DynamicCache | None = field(default=None, init=False, repr=False)
    cached_tokens: list[int] = field(default_factory=list, init=False, repr=False)
    _context_length: int = field(default=0, init=False, repr=False)  # committed tokens when last proposing

    def __post_init__(self) -> None:
        if self.num_draft < 1:
            raise ValueError("num_draft must be at least 1")
        self.shared_vocab = min(_logits_size(self.model), self.target_vocab_size)
        self.input_vocab = int(self.model.get_input_embeddings().weight.shape[0])
        self.device = next(self.model.parameters()).device
        self.position_limit = getattr(self.model.config, "max_position_embeddings", None)

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        tokens = context.tokens
        self._context_length = len(tokens)
        budget = self.num_draft
        if self.position_limit is not None:
            budget = min(budget, self.position_limit - len(tokens))
        if budget < 1 or max(tokens) >= self.input_vocab:
            # an id the draft cannot embed is lm_head padding (no real token of the shared tokenizer),
            # which only a random model commits: no speculation, plain decoding steps from here on
            return DraftTree.empty()
        logits = self._catch_up(tokens)
        drafted: list[int] = []
        dists: list[torch.Tensor] = []
        while True:
            token, q = self._choose(logits, context)
            drafted.append(token)
            if q is not None:
                dists.append(q)
            if len(drafted) == budget or token in self.stop_token_ids:
                break
            logits = self._forward([token])
        return DraftTree.chain(drafted, torch.stack(dists) if dists else None)

    def observe(self, tree: DraftTree, logits: torch.Tensor, verdict: Any) -> None:
        """Called by the runtime after verification: drop the rejected drafts' KV at once, so only
        committed tokens stay cached between rounds (``_catch_up`` would drop them next round anyway)."""
        committed = self._context_length + len(verdict.accepted_nodes)
        if committed < len(self.cached_tokens):
            self._truncate(committed)

    def reset(self) -> None:
        # Rejected drafts are dropped every round: in a preallocated cache that moves a length pointer.
        self.cache = preallocated_cache_for(self.model.config, DRAFT_CACHE_ROWS)
        self.cached_tokens = []

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Roll the cache back to what it shares with ``tokens`` and feed the rest; the draft's logits
        after the last committed token. At least one token is always fed, to get those logits."""
        keep = 0
        for cached, token in zip(self.cached_tokens, tokens[:-1]):
            if cached != token:
                break
            keep += 1
        if self.cache is None or keep == 0:
            self.reset()
        elif keep < len(self.cached_tokens):
            self._truncate(keep)
        return self._forward(tokens[keep:])

    def _truncate(self, length: int) -> None:
        keep_positions(self.cache, torch.arange(length))
        self.cached_tokens = self.cached_tokens[:length]

    def _forward(self, tokens: list[int]) -> torch.Tensor:
        """Run the draft on ``tokens`` after the cached ones; logits (V_shared,) of the last one."""
        input_ids = torch.tensor([tokens], device=self.device)
        out = self.model(input_ids, **cache_kwargs(self.cache), use_cache=True)
        self.cached_tokens.extend(tokens)
        return out.logits[0, -1, : self.shared_vocab]

    def _choose(self, logits: torch.Tensor, context: DraftContext) -> tuple[int, torch.Tensor | None]:
        """Greedy: the argmax. Sampling: a token from q and q itself, zero-padded to the target's vocab."""
        if context.sampling is None:
            return int(logits.argmax()), None
        q = context.sampling.probs(logits)
        token = sample(q, context.generator)
        padded = torch.zeros(self.target_vocab_size, dtype=q.dtype)
        padded[: self.shared_vocab] = q.cpu()
        return token, padded


def tokenizer_mismatch(target_tokenizer: Any, draft_tokenizer: Any) -> str | None:
    """What makes the draft's token ids mean something else than the target's, or None. The chat
    template may differ (a base model can draft for its instruct sibling)."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sum(1 for piece, i in draft_vocab.items() if target_vocab.get(piece) != i)
        return f"vocabulary differs ({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} ids differ)"
    for key in sorted(set(target_tokenizer.special_tokens_map) | set(draft_tokenizer.special_tokens_map)):
        ours, theirs = draft_tokenizer.special_tokens_map.get(key), target_tokenizer.special_tokens_map.get(key)
        if str(ours) != str(theirs):
            return f"special token {key} differs ({ours!r} vs the target's {theirs!r})"
    return None


def build_truncated_draft(model: Any, num_layers: int) -> Any:
    """An UNTRAINED self-speculative draft: the target's first ``num_layers`` decoder layers, then its
    final norm and ``lm_head``, as a model of the same class. The modules are the target's own (shared
    weights, no copy); only the config says fewer layers. Its acceptance is whatever the truncated
    network happens to agree with the full one; nothing was trained to make the shortcut good."""
    from transformers import AutoModelForCausalLM

    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TargetError(f"layers:N needs a decoder-only model with model.layers; {type(model).__name__} has none")
    total = len(layers)
    if not 1 <= num_layers < total:
        raise MethodError(f"layers:N needs 1 <= N < {total} (the target's layer count); got {num_layers}")
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (sliding windows)
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        draft = AutoModelForCausalLM.from_config(config)
    for name, module in base.named_children():  # embeddings, rotary embedding, norm: the target's own
        setattr(draft.model, name, torch.nn.ModuleList(layers[:num_layers]) if name == "layers" else module)
    for name, module in model.named_children():
        if name != "model":
            setattr(draft, name, module)  # lm_head
    leftover = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:
        raise TargetError(f"layers:N cannot share all of {type(model).__name__}'s modules (unshared: {leftover[:3]})")
    draft.generation_config = model.generation_config
    return draft.eval()


def parse_draft_spec(arg: str | None) -> tuple[str, int]:
    """``SPEC`` or ``SPEC:k=K`` -> (SPEC, K)."""
    if not arg:
        raise MethodError("the draft method needs a model: draft=PATH_OR_NAME or draft=layers:N (optionally :k=K)")
    match = _K_SUFFIX.match(arg)
    spec, k = (match["spec"], int(match["k"])) if match else (arg, DEFAULT_NUM_DRAFT)
    if k < 1:
        raise MethodError(f"draft tokens per round must be at least 1; got k={k}")
    return spec, k


def build_draft_model_drafter(target: Target, arg: str | None) -> DraftModelDrafter:
    """``draft=PATH_OR_NAME`` (anything ``load_target`` accepts) or ``draft=layers:N``; optional ``:k=K``."""
    spec, k = parse_draft_spec(arg)
    if spec.startswith("layers:"):
        count = spec.removeprefix("layers:")
        if not count.isdigit():
            raise MethodError(f"layers:N needs a whole number of layers; got {count!r}")
        draft = build_truncated_draft(target.model, int(count))
    else:
        problem = tokenizer_mismatch(target.tokenizer, load_tokenizer(spec)[0])  # before loading any weights
        if problem:
            raise TargetError(
                f"draft model {spec} cannot draft for this target: its tokenizer's {problem}; "
                "use a draft model trained with the target's tokenizer"
            )
        dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
        draft = load_target(spec, dtype=dtype, device=str(target.model.device)).model
        if min(_logits_size(draft), int(draft.get_input_embeddings().weight.shape[0])) < len(target.tokenizer):
            raise TargetError(
                f"draft model {spec} has fewer vocabulary rows than the tokenizer's {len(target.tokenizer)} tokens"
            )
    return DraftModelDrafter(draft, _logits_size(target.model), k, tuple(target.eos_token_ids), name=f"draft={arg}")
