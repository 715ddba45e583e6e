"""P-EAGLE: an EAGLE-3 drafter that drafts all of a round's tokens in one forward (arXiv 2602.01469).

EAGLE-3 drafts depth by depth, each depth one drafter forward that reads the previous depth's token and
fed-back hidden. P-EAGLE reads neither: after the position of the last committed token (depth 0, which
reads the target's fused states as EAGLE-3's first step does) it appends K-1 *placeholder* positions,
each reading two learned vectors instead of the unknown token and target states:

- ``mask_embedding`` (h) in place of the token embedding,
- ``mask_hidden`` (len(aux_layer_ids) x h) in place of the target's layer states, fused by ``fc``
  like them (speculators' and vLLM's ``mask_hidden``).

Placeholder j sits at the rotary position j past the last committed one and attends, causally, to the
committed positions and to the placeholders before it; trained so that it predicts the token j + 1
ahead of that position. All K distributions come out of one forward: a chain of their argmaxes, or a
tree of their top-k (each depth's guess does not depend on the one before, as with Medusa's heads).

Training is EAGLE-3's training-time test with the placeholders as the inputs of steps 1..K-1 (the
drafter's ``ttt_step_inputs``): the same masks, positions and loss, so the two families compare on
equal terms. Everything else (fused layers, one decoder layer, draft vocabulary d2t/t2d) is EAGLE-3's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from draftsmith.core.cache import cache_length, keep_positions
from draftsmith.core.drafting import DraftContext, Drafter, committed_features
from draftsmith.core.tree import DraftTree, cartesian_tree, causal_mask_after
from draftsmith.drafters.base import FrozenTarget, TreeOptionError, TreeOptions
from draftsmith.drafters.eagle import EagleConfigError, write_context
from draftsmith.drafters.eagle3 import Eagle3Config, Eagle3Model, speculators_eagle3_layout
from draftsmith.drafters.engine_layouts import EngineExport, EngineLayoutError, Verifier, speculators_block
from draftsmith.drafters.vocab import unused_token_id


class PEagleConfig(Eagle3Config):
    """Shape and options of a P-EAGLE drafter: EAGLE-3's, read as follows.

    ``ttt_steps``: K, the depths trained per position: depth 0 reads the target's states at the last
    committed token, depths 1..K-1 are placeholders (the paper trains 8 on a GPU). ``depth``: the
    tokens drafted per round (at most K), all from one drafter forward. ``top_k`` 1 drafts a chain (what
    vLLM's parallel drafting proposes); more drafts a tree of each depth's ``top_k`` tokens, the
    ``total_tokens`` best by summed log-probability."""

    model_type = "draftsmith_peagle"

    def __init__(
        self, ttt_steps: int = 4, depth: int = 4, top_k: int = 1, total_tokens: int = 4, **kwargs: Any
    ) -> None:
        kwargs.setdefault("drafter_family", "peagle")
        super().__init__(ttt_steps=ttt_steps, depth=depth, top_k=top_k, total_tokens=total_tokens, **kwargs)

    def check(self) -> None:
        super().check()
        for option in ("feature_sampler", "partial_alignment"):
            if getattr(self, option):
                raise EagleConfigError(
                    f"drafter.{option}: P-EAGLE has no FSPAD parts (fspad3 is EAGLE-3 with them); set it to false"
                )
        check_depth(self.depth, self.ttt_steps, EagleConfigError)

    def parallel_depths(self) -> int:
        return self.ttt_steps


def check_depth(depth: int, trained: int, error: type[Exception]) -> None:
    """A placeholder past the trained depths was never taught to predict anything."""
    if depth > trained:
        raise error(f"drafter.depth={depth} drafts past the {trained} depths it was trained for (drafter.ttt_steps)")


class PEagleModel(Eagle3Model):
    """EAGLE-3's model with P-EAGLE's two learned placeholders; ``forward(..., placeholders=rows)``
    reads them at the rows marked instead of the given token embeddings and target states."""

    config_class = PEagleConfig
    feeds_back = False  # a depth reads placeholders, never the previous depth's output

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.mask_embedding = nn.Parameter(torch.randn(h) * 0.02)  # until init_from_target
        self.mask_hidden = nn.Parameter(torch.randn(len(config.aux_layer_ids) * h))

    @torch.no_grad()
    def init_from_target(self, frozen: FrozenTarget) -> None:
        """EAGLE-3's head, and a placeholder token that starts as the average drafted token (as the target
        embeds it: Gemma scales its embeddings)."""
        super().init_from_target(frozen)
        ids = self.draft_token_ids().to(frozen.embed_tokens.weight.device)
        self.mask_embedding.copy_(frozen.embed_tokens(ids).float().mean(0).to(self.mask_embedding))

    def ttt_step_inputs(
        self, step: int, token_embeds: torch.Tensor, target_states: torch.Tensor, fed_back: torch.Tensor
    ) -> dict[str, Any]:
        """Step 0 reads the target, as EAGLE-3's; every later step the placeholders, everywhere."""
        inputs = super().ttt_step_inputs(0, token_embeds, target_states, fed_back)
        if step > 0:
            inputs["placeholders"] = torch.ones(target_states.shape[:2], dtype=torch.bool, device=target_states.device)
        return inputs

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, *args: Any, placeholders=None, **kwargs: Any):
        """EAGLE-3's step (same arguments); ``placeholders`` (B, T) bool marks the rows whose token and
        target states are not known yet: they read ``mask_embedding`` and ``mask_hidden`` (``hidden``
        then holds target layer states, ``from_target``). The substitution happens inside the forward
        so that DDP and DeepSpeed see the placeholders used like every other parameter."""
        if placeholders is not None:
            unknown = placeholders[..., None]
            embeds = torch.where(unknown, self.mask_embedding.to(embeds.dtype), embeds)
            hidden = torch.where(unknown, self.mask_hidden.to(hidden.dtype), hidden)
        return super().forward(embeds, hidden, *args, **kwargs)

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> PEagleDrafter:
        frozen = FrozenTarget.from_model(target_model)
        options = tree.over(self.config.tree_options())
        check_depth(options.depth, self.config.ttt_steps, TreeOptionError)
        return PEagleDrafter(self, frozen.embed_tokens, options, name=self.config.drafter_family)

    def engine_layout(self, fmt: str, verifier: Verifier, speculative_tokens: int | None) -> EngineExport:
        if fmt == "sglang":
            raise EngineLayoutError(
                "SGLang's P-EAGLE layout is not written here; export --format vllm (vLLM serves it as eagle3 "
                "with parallel drafting) or serve it with `draftsmith generate`"
            )
        depth = speculative_tokens or self.config.depth
        check_depth(depth, self.config.ttt_steps, EngineLayoutError)
        return speculators_peagle_layout(self, verifier, depth)

    def placeholder_token_id(self) -> int:
        """The token id whose row of an export's embedding table holds ``mask_embedding``: vLLM looks the
        placeholder's embedding up by id (``mask_token_id``) in the drafter's own table. The highest id
        outside the draft vocabulary: a token the target rarely writes (where it does, vLLM's drafter
        reads the placeholder for it, which can only cost acceptance, never change an output)."""
        return unused_token_id(self.draft_token_ids(), int(self.config.layer["vocab_size"]))


def speculators_peagle_layout(model: PEagleModel, verifier: Verifier, depth: int) -> EngineExport:
    """vLLM's speculators P-EAGLE (``speculators_model_type: peagle``, served as ``eagle3`` with
    ``parallel_drafting``): EAGLE-3's layout plus ``mask_hidden`` (the placeholder's target states,
    fused by ``fc`` as vLLM does) and ``mask_token_id``, whose row of the exported ``embed_tokens`` is
    ``mask_embedding``. vLLM then drafts ``depth`` tokens per step in one forward, as the runtime's chain."""
    export = speculators_eagle3_layout(model, verifier, depth)
    token = model.placeholder_token_id()
    embedding = export.tensors["embed_tokens.weight"].clone()  # never the verifier's own tensor
    embedding[token] = model.mask_embedding.detach().float().cpu()
    export.tensors["embed_tokens.weight"] = embedding
    export.tensors.pop("mask_embedding")
    export.config.update(
        speculators_model_type="peagle",
        mask_token_id=token,
        speculators_config=speculators_block("peagle", verifier, depth),
    )
    export.required = export.required + (("mask_token_id",),)
    export.required_tensors = export.required_tensors + ("mask_hidden",)
    return export


class PEagleDrafter(Drafter):
    """Drafts a round's tokens for the runtime from ONE forward of a :class:`PEagleModel`.

    The drafter keeps a KV cache over committed positions. Each round's forward reads the committed
    positions the cache lacks (the target's states of the tokens accepted last round, from the
    verification forward) and then ``depth - 1`` placeholders; the last committed position and the
    placeholders give the ``depth`` distributions, and the placeholders' keys are dropped again. A
    budget of ``total_tokens`` nodes never reaches deeper than ``total_tokens``, so no more depths are
    drafted than that."""

    wants_features = True

    def __init__(self, model: PEagleModel, embed_tokens: nn.Module, tree: TreeOptions, name: str = "peagle") -> None:
        self.model = model.eval()
        self.feature_layers = model.config.feature_layers()
        self.embed_tokens = embed_tokens
        self.depth, self.top_k, self.total_tokens = tree.depth, tree.top_k, tree.total_tokens
        self.name = name
        self._cache = DynamicCache()
        self._fed: list[int] = []  # the tokens the cache was fed, the last one not yet read

    def own_modules(self) -> nn.Module:
        return self.model

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        tokens, features = context.tokens, committed_features(context, "P-EAGLE")
        if len(tokens) < 2:
            return DraftTree.empty()  # no committed position to read the root at
        levels = self.depth_logits(tokens, features, min(self.depth, self.total_tokens))
        return cartesian_tree(levels, self.top_k, self.total_tokens, self.model.token_ids)

    def depth_logits(self, tokens: list[int], features: torch.Tensor, depths: int) -> torch.Tensor:
        """(depths, draft vocabulary) logits of the ``depths`` tokens after the root, in one forward."""
        start, end = self._reusable_positions(tokens), len(tokens) - 1
        start = write_context(self.model, self.embed_tokens, tokens, features, start, self._cache)
        committed, placeholders = end - start, depths - 1
        device, dtype = features.device, features.dtype
        ids = torch.tensor(tokens[start + 1 : end + 1] + [0] * placeholders, device=device)  # placeholders: any id
        hidden = torch.cat([features[start:end], features.new_zeros(placeholders, features.shape[-1])])
        rows = torch.arange(committed + placeholders, device=device)[None]
        out = self.model(
            self.embed_tokens(ids)[None].to(dtype),
            hidden[None],
            rows + start,
            causal_mask_after(start, committed + placeholders, dtype, device),
            self._cache,
            from_target=True,
            rows=rows >= committed - 1,  # only the last committed position and the placeholders are read
            placeholders=rows >= committed,
        )
        keep_positions(self._cache, torch.arange(end))  # the placeholders' keys serve this round only
        self._fed = list(tokens)
        return self.model.logits(out.token_features[0, committed - 1 :])

    def _reusable_positions(self, tokens: list[int]) -> int:
        """How many cached positions this round reuses: those of tokens still committed, but never the
        last committed position, which this round must read (it gives the first depth) even when the
        context did not grow since the last round."""
        if tokens[: len(self._fed)] != self._fed:
            self._cache, self._fed = DynamicCache(), []
        keep = max(min(len(self._fed) - 1, len(tokens) - 2), 0)
        if cache_length(self._cache) > keep:
            keep_positions(self._cache, torch.arange(keep))
        return keep
