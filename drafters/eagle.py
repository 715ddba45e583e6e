"""EAGLE and FSPAD feature drafters: config, model, and how they draft EAGLE-2 dynamic trees.

Both predict the target's next *feature* (the input of its ``lm_head``) from the current feature and
the next token, with one decoder layer shaped like the target's. The target's embedding and
``lm_head`` are used but never owned: a checkpoint holds only the drafter's own weights.

- EAGLE: ``x = fc(cat(e_{t+1}, f_t))`` then the decoder layer (no input norm, no final norm).
- FSPAD ``feature_sampler``: ``u = fc(cat(e, f))``, ``x = u + down(SiLU(gate(e)) * up(RMSNorm(u)))``,
  a gate driven by the token embedding that keeps the feature's scale through the residual.
- FSPAD ``partial_alignment``: the MLP's ``down_proj`` outputs 2h and the residual is duplicated;
  the first half ``f~`` goes to ``lm_head`` (token choice, CE loss), the second ``f`` is the feature
  fed back and aligned to the target (SmoothL1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.core.cache import PreallocatedCache, cache_length, keep_positions
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import DraftContext, Drafter, LayerKernel, committed_features
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.tree import DraftTree, TreeGrowth, causal_mask, causal_mask_after, grow_tree
from draftsmith.drafters.base import DrafterConfig, DrafterModel, DraftVocabMixin, FrozenTarget, TreeOptions
from draftsmith.drafters.engine_layouts import (
    EngineExport,
    EngineLayoutError,
    Verifier,
    layer_settings_problem,
    llama_layer_config,
    llama_layers,
)
from draftsmith.drafters.vocab import DraftHead, modules_with_head

# Target config keys the drafter's layer copies: the shape of one decoder layer and its positions.
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
    "vocab_size",
)


class EagleConfigError(DraftsmithError, ValueError):
    """Drafter options that cannot describe an EAGLE/FSPAD drafter; the message names the recipe key."""


class EagleConfig(DrafterConfig):
    """Shape and options of an EAGLE/FSPAD drafter, plus the tree it drafts by default.

    ``layer`` holds the target's decoder-layer settings (hidden size, heads, RoPE), so the drafter's
    positions and attention match the target exactly.

    Options: ``feature_sampler`` / ``partial_alignment`` switch FSPAD's two parts on. The tree
    defaults (``depth`` / ``top_k`` / ``total_tokens``) suit a CPU, where verifying 16 tokens costs
    ~2x one token; GPU users raise them (EAGLE-2: 6 / 10 / 60). ``draft_vocab_size`` > 0 drafts only
    from that many tokens, the most frequent in the training data (EAGLE-3's reduced draft
    vocabulary): the target's lm_head over its full vocabulary is the drafter's largest cost per
    step, and verification stays lossless whatever is proposed."""

    model_type = "draftsmith_eagle"
    TREE_OPTIONS = ("depth", "top_k", "total_tokens")
    DERIVED = ("layer",)
    error = EagleConfigError

    def __init__(
        self,
        layer: dict[str, Any] | None = None,
        feature_sampler: bool = False,
        partial_alignment: bool = False,
        depth: int = 5,
        top_k: int = 4,
        total_tokens: int = 12,
        draft_vocab_size: int = 0,
        **kwargs: Any,
    ) -> None:
        self.layer = dict(layer or {})
        self.feature_sampler = feature_sampler
        self.partial_alignment = partial_alignment
        self.depth = depth
        self.top_k = top_k
        self.total_tokens = total_tokens
        self.draft_vocab_size = draft_vocab_size
        kwargs.setdefault("drafter_family", "eagle")
        super().__init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        """The decoder-layer settings of ``target_config`` (a Llama-architecture config)."""
        source = target_config.to_dict()
        layer = {key: source[key] for key in _LAYER_KEYS if key in source}
        layer.setdefault("head_dim", source["hidden_size"] // source["num_attention_heads"])
        return {"layer": layer}

    def check(self) -> None:
        if problem := layer_settings_problem(self.layer):  # first: the vocabulary check below reads the layer
            raise EagleConfigError(problem)
        super().check()
        vocab = self.layer.get("vocab_size", 0)
        if not 0 <= self.draft_vocab_size <= vocab:
            raise EagleConfigError(
                f"drafter.draft_vocab_size must be between 0 (whole vocabulary) and the target's "
                f"{vocab}, got {self.draft_vocab_size}"
            )

    def layer_config(self) -> LlamaConfig:
        return llama_layers(self.layer, 1)

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])


class FeatureSampler(nn.Module):
    """FSPAD's replacement for EAGLE's ``fc``: a token-gated MLP on top of the fused input."""

    def __init__(self, hidden: int, intermediate: int, eps: float) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.norm = LlamaRMSNorm(hidden, eps=eps)

    def forward(self, fused: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        return fused + self.down_proj(nn.functional.silu(self.gate_proj(embeds)) * self.up_proj(self.norm(fused)))


class DrafterMLP(nn.Module):
    """The target's gated MLP; with partial alignment its output is two features wide."""

    def __init__(self, config: LlamaConfig, out_factor: int) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h * out_factor, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def attention_and_mlp(
    layer: nn.Module,
    attention_input: torch.Tensor,
    residual: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    cache: DynamicCache | None,
    rows: torch.Tensor | None,
    kernel: LayerKernel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A feature drafter's decoder layer after its input: ``(residual + attention, MLP output)``, the MLP
    only at ``rows`` (:func:`at_rows`). ``layer`` holds ``self_attn``, ``post_attention_layernorm`` and
    ``mlp``; ``kernel`` (the runtime's, :meth:`Drafter.use_layer_kernel`) computes it where it can."""
    if kernel is not None and rows is None:
        done = kernel(
            layer.self_attn,
            layer.post_attention_layernorm,
            layer.mlp,
            attention_input,
            residual,
            position_embeddings,
            attention_mask,
            cache,
        )
        if done is not None:
            return done
    attended, _ = layer.self_attn(
        attention_input,
        position_embeddings=position_embeddings,
        attention_mask=attention_mask,
        **cache_kwargs(cache),
    )
    residual = residual + attended
    return residual, at_rows(lambda r: layer.mlp(layer.post_attention_layernorm(r)), residual, rows)


def write_keys_values(
    attention: nn.Module, attention_input: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], cache
) -> None:
    """Append to ``cache`` the keys and values ``attention`` (a Llama attention) computes for the rows of
    ``attention_input``, and nothing else: no queries, attention, projection or MLP. A drafter reads no
    output at a committed position but the last, while later rows attend to every one's keys and values."""
    shape = (*attention_input.shape[:-1], -1, attention.head_dim)
    keys = attention.k_proj(attention_input).view(shape).transpose(1, 2)
    values = attention.v_proj(attention_input).view(shape).transpose(1, 2)
    cos, sin = (factor.unsqueeze(1) for factor in position_embeddings)
    cache.update(keys * cos + rotate_half(keys) * sin, values, attention.layer_idx)


def at_rows(fn: Any, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """``fn`` (a position-wise map) of ``x`` (B, T, h) only where ``rows`` (B, T) is True, zeros
    elsewhere; everywhere when ``rows`` is None. Training passes the positions its loss reads, so the
    MLP is not run over prompts and padding."""
    if rows is None:
        return fn(x)
    picked = fn(x[rows])
    out = picked.new_zeros(*x.shape[:2], picked.shape[-1])
    out[rows] = picked
    return out


@dataclass
class DrafterOutput:
    token_features: torch.Tensor  # (B, T, h): what goes to lm_head (f~ with partial alignment)
    next_features: torch.Tensor  # (B, T, h): the predicted f_{t+1}, fed back when drafting


class EagleModel(DraftVocabMixin, DrafterModel):
    """``forward(embeds, features, position_ids, attention_mask)``: position t reads ``e_{t+1}`` and ``f_t``
    and predicts ``f_{t+1}``."""

    config_class = EagleConfig

    def __init__(self, config: EagleConfig) -> None:
        super().__init__(config)
        layer = config.layer_config()
        h = layer.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=True)
        self.feature_sampler = (
            FeatureSampler(h, layer.intermediate_size, layer.rms_norm_eps) if config.feature_sampler else None
        )
        self.self_attn = LlamaAttention(layer, layer_idx=0)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=layer.rms_norm_eps)
        self.mlp = DrafterMLP(layer, 2 if config.partial_alignment else 1)
        self.rotary_emb = LlamaRotaryEmbedding(layer)
        self._register_draft_vocab(config.draft_vocab_size)  # token ids it may propose (empty = all)

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        rows: torch.Tensor | None = None,
        kernel: LayerKernel | None = None,
    ) -> DrafterOutput:
        """``attention_mask``: a 4D additive mask ``(B, 1, T, past + T)``; None = causal over the inputs.
        ``rows`` (B, T) bool: the positions whose outputs are read (the MLP runs there only, see
        :func:`at_rows`); None = all. ``kernel``: the runtime's layer forward (:func:`attention_and_mlp`)."""
        x = self._layer_input(embeds, features)
        if attention_mask is None:
            attention_mask = causal_mask(x.shape[1], x.dtype, x.device)
        rotary = self.rotary_emb(x, position_ids)
        residual, out = attention_and_mlp(self, x, x, rotary, attention_mask, cache, rows, kernel)
        if self.config.partial_alignment:
            out = torch.cat([residual, residual], dim=-1) + out
            h = residual.shape[-1]
            return DrafterOutput(token_features=out[..., :h], next_features=out[..., h:])
        out = residual + out
        return DrafterOutput(token_features=out, next_features=out)

    def read_target(self, *args: Any, **kwargs: Any) -> DrafterOutput:
        """A step over the target's own features (:meth:`forward`: EAGLE reads them as they are)."""
        return self(*args, **kwargs)

    def read_target_context(
        self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache
    ) -> None:
        """What :meth:`read_target` writes into ``cache`` for these positions, without their outputs."""
        x = self._layer_input(embeds, features)
        write_keys_values(self.self_attn, x, self.rotary_emb(x, position_ids), cache)

    def _layer_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features], dim=-1))  # (B, T, h)
        return x if self.feature_sampler is None else self.feature_sampler(x, embeds)

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> EagleTreeDrafter:
        frozen = FrozenTarget.from_model(target_model)
        options = tree.over(self.config.tree_options())
        head = DraftHead(frozen.lm_head, self.draft_vocab)
        return EagleTreeDrafter(self, frozen.embed_tokens, head, options, name=self.config.drafter_family)

    def engine_layout(self, fmt: str, verifier: Verifier, speculative_tokens: int | None) -> EngineExport:
        return vllm_eagle_layout(self, fmt, verifier, speculative_tokens or self.config.depth)


_CACHE_ROOM = 1024  # the drafter cache's first capacity in rows (it doubles when a context outgrows it)
_CONTEXT_ONLY_ROWS = 16  # new positions from which write_context writes all but the last into the cache only


def write_context(
    model: DrafterModel, embed_tokens: nn.Module, tokens: list[int], features: torch.Tensor, start: int, cache
) -> int:
    """Where a feature drafter has many committed positions to feed (a prompt: ``start`` up to the last
    committed one, ``len(tokens) - 2``), give all but the last to ``model.read_target_context``, and return
    the first position still to feed through the whole layer. A round reads the outputs of the last
    committed position only, while later rows attend to every one's keys and values: so a long prompt's
    catch-up costs its fused inputs and their keys and values, not a whole layer per position."""
    end = len(tokens) - 2
    if end + 1 - start < _CONTEXT_ONLY_ROWS:
        return start
    embeds, positions = committed_inputs(embed_tokens, tokens, features, start, end)
    model.read_target_context(embeds, features[start:end][None], positions, cache)
    return end


def committed_inputs(
    embed_tokens: nn.Module, tokens: list[int], features: torch.Tensor, start: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token embeddings (1, n, h) and positions (1, n) committed positions ``start``..``end - 1`` read
    beside their features: position t reads ``x_{t+1}``."""
    ids = torch.tensor(tokens[start + 1 : end + 1], device=features.device)
    positions = torch.arange(start, end, device=features.device)[None]
    return embed_tokens(ids)[None].to(features.dtype), positions


class EagleTreeDrafter(Drafter):
    """Drafts an EAGLE-2 dynamic tree for the runtime, from an EAGLE/FSPAD or EAGLE-3/FSPAD-3 model.

    The model reads the target's states at committed tokens through ``read_target`` (the layers its
    config's ``feature_layers()`` names) and its own predicted features everywhere else; ``head`` turns
    token features into logits over the draft vocabulary and columns into token ids
    (:class:`~draftsmith.drafters.vocab.DraftHead` or the drafter's own head).

    The drafter keeps its own KV cache over committed positions only, fed with the target's true
    features of accepted tokens (from the verification forward). Each round it expands the root's
    ``top_k`` children, then at every depth the ``top_k`` best nodes by cumulative log-probability
    (one drafter forward for the whole frontier); finally the best ``total_tokens`` nodes form the
    tree. The tree's KV is dropped from the drafter's cache after every round."""

    wants_features = True

    def __init__(
        self, model: DrafterModel, embed_tokens: nn.Module, head: Any, tree: TreeOptions, name: str = "eagle"
    ) -> None:
        self.model = model.eval()
        self.feature_layers = model.config.feature_layers()
        self.embed_tokens = embed_tokens
        self.head = head
        self._own_modules = modules_with_head(self.model, head)
        self.depth, self.top_k, self.total_tokens = tree.depth, tree.top_k, tree.total_tokens
        self.name = name
        self._kernel: LayerKernel | None = None
        self._reset()

    def use_layer_kernel(self, kernel: LayerKernel | None) -> None:
        self._kernel = kernel

    def _reset(self) -> None:
        # keys and values written in place (no concatenation per forward), as the layer kernel needs them
        self._cache = PreallocatedCache(1, _CACHE_ROOM)
        self._fed: list[int] = []  # tokens[: positions in cache + 1]
        self._last_feature: torch.Tensor | None = None  # predicted feature at the root position
        self._root_top: tuple[torch.Tensor, torch.Tensor] | None = None  # the root's children (_top)

    def own_modules(self) -> nn.Module:
        return self._own_modules

    def propose(self, context: DraftContext) -> DraftTree:
        return self.grow(context)[0]

    @torch.no_grad()
    def grow(self, context: DraftContext) -> tuple[DraftTree, TreeGrowth]:
        """The round's tree and every candidate it was chosen from (``draftsmith tune`` reads the
        candidates: the tree of any smaller depth or budget is a function of them)."""
        tokens, features = context.tokens, committed_features(context, "EAGLE")
        self._catch_up(tokens, features)
        columns: dict[int, int] = {}  # candidate -> its column in the drafter cache
        levels = iter(range(self.depth))  # the frontier's depth in the tree (0 = the root)

        def expand(growth: TreeGrowth, frontier: list[int]) -> list[list[tuple[float, int, torch.Tensor]]]:
            level = next(levels)
            if level == 0:  # the root's children come from the last committed position
                return self._children(self._root_top, self._last_feature[None])
            # a node at depth L holds the token at position len(tokens) - 1 + L, read at the one before
            return self._expand(growth, frontier, columns, position=len(tokens) - 2 + level)

        tree, growth = grow_tree(expand, self.depth, self.top_k, self.total_tokens)
        self._drop_tree_kv(len(tokens) - 1)
        return tree, growth

    def _top(self, token_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``top_k`` log-probabilities and head columns of each row, from one head product over all of
        them (one read of the head's weights)."""
        return tuple(self.head(token_features).float().log_softmax(-1).topk(self.top_k))

    def _children(self, top: tuple[torch.Tensor, torch.Tensor], next_features: torch.Tensor) -> list[list[tuple]]:
        """Each frontier node's ``top_k`` children from its row of ``top``: (log p, token id, the feature
        they read when expanded)."""
        values, columns = top
        ids = self.head.token_ids(columns)
        return [
            [(value, token, next_feature) for value, token in zip(row_values, row_tokens)]
            for row_values, row_tokens, next_feature in zip(values.tolist(), ids.tolist(), next_features)
        ]

    def _forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        from_target: bool,
        positions: torch.Tensor,
        mask: torch.Tensor,
        logit_rows: int,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One drafting forward (its keys and values appended to the cache): the next features of its last
        ``logit_rows`` rows and the :meth:`_top` of their token features. Through the kernel's whole-step
        call where it serves the model (the same floats), else the model's forward and the head."""
        step = self.model.drafting_step(from_target) if self._kernel is not None else None
        done = None
        if step is not None:
            done = self._kernel.step(step, embeds, hidden, positions, mask, self._cache, logit_rows, self.top_k)
        if done is not None:  # a drafting step's token and next features are one
            features, values, columns = done
            return features[-logit_rows:], (values, columns)
        forward = self.model.read_target if from_target else self.model
        out = forward(embeds, hidden, positions, mask, self._cache, kernel=self._kernel)
        return out.next_features[0, -logit_rows:], self._top(out.token_features[0, -logit_rows:])

    def _catch_up(self, tokens: list[int], features: torch.Tensor) -> None:
        """Feed ``(f_t, x_{t+1})`` for every committed position the cache lacks (all but the last only into
        the cache where there are many: :func:`write_context`)."""
        if tokens[: len(self._fed)] != self._fed or not self._fed:
            self._reset()
        start, end = max(len(self._fed) - 1, 0), len(tokens) - 1
        if start == end:
            return
        start = write_context(self.model, self.embed_tokens, tokens, features, start, self._cache)
        embeds, positions = committed_inputs(self.embed_tokens, tokens, features, start, end)
        mask = causal_mask_after(start, end - start, features.dtype, features.device)
        fed = features[start:end][None]
        next_features, self._root_top = self._forward(embeds, fed, True, positions, mask, logit_rows=1)
        self._fed = list(tokens)
        self._last_feature = next_features[-1]

    def _expand(
        self, growth: TreeGrowth, frontier: list[int], columns: dict[int, int], position: int
    ) -> list[list[tuple]]:
        """One drafter forward over the frontier nodes, each attending to the committed cache, its
        ancestors' columns and itself: their children."""
        committed = len(self._fed) - 1
        past = committed + len(columns)
        dtype = self._last_feature.dtype
        device = self._last_feature.device
        rows, seen = [], []  # every (row, tree column) a frontier node sees: its ancestors and itself
        for row, node in enumerate(frontier):
            ancestor = growth.parents[node]
            while ancestor >= 0:
                rows.append(row)
                seen.append(columns[ancestor])
                ancestor = growth.parents[ancestor]
            rows.append(row)
            seen.append(past + row)
        mask = torch.full((1, 1, len(frontier), past + len(frontier)), torch.finfo(dtype).min, dtype=dtype)
        mask[..., :committed] = 0
        mask[0, 0, rows, seen] = 0  # one write: a round's drafting makes many small tensor calls already
        for row, node in enumerate(frontier):
            columns[node] = past + row
        ids = torch.tensor([growth.tokens[i] for i in frontier], device=device)
        embeds = self.embed_tokens(ids)[None].to(dtype)
        feats = torch.stack([growth.payloads[i] for i in frontier])[None]
        positions = torch.full((1, len(frontier)), position, device=device)
        next_features, top = self._forward(embeds, feats, False, positions, mask.to(device), len(frontier))
        return self._children(top, next_features)

    def _drop_tree_kv(self, committed: int) -> None:
        if cache_length(self._cache) > committed:
            keep_positions(self._cache, torch.arange(committed))


def vllm_eagle_layout(model: EagleModel, fmt: str, verifier: Verifier, speculative_tokens: int) -> EngineExport:
    """``(config, tensors)`` of a plain EAGLE drafter in the layout vLLM's ``eagle`` method loads: the
    SafeAILab EAGLE-1 ``EagleLlamaForCausalLM`` checkpoint (a Llama ``config.json`` with one layer,
    ``fc.weight`` and ``layers.0.*``; embedding and lm_head shared from the target).

    vLLM's ``fc`` has no bias and its layer's input norm is an identity, so the drafter's ``fc`` bias
    ``b`` moves, exactly, into attention biases: the layer input ``x + b`` is read by q/k/v (bias
    ``W b`` each) and carried by the residual (``o_proj`` bias ``b``). vLLM drafts over the target's
    whole vocabulary: a reduced draft vocabulary is not carried over (verification stays lossless;
    proposals may differ where the best token lies outside it)."""
    config = model.config
    if config.feature_sampler or config.partial_alignment:
        raise EngineLayoutError(
            "FSPAD has no serving-engine layout (vLLM's EAGLE models have no feature sampler or partial "
            "alignment); serve it with `draftsmith generate`, or export a plain eagle drafter for vLLM"
        )
    if fmt != "vllm":
        raise EngineLayoutError(
            f"an eagle drafter has no {fmt} layout (vLLM 0.32 dropped speculators' EAGLE-1 type; SGLang serves "
            "EAGLE-3 only); use --format vllm"
        )
    state = {name: tensor.detach().float().cpu() for name, tensor in model.state_dict().items()}
    tensors = {"fc.weight": state["fc.weight"]}
    for name, tensor in state.items():
        if name.startswith(("self_attn.", "post_attention_layernorm.", "mlp.")):
            tensors["layers.0." + name] = tensor
    shift = state["fc.bias"]  # x + b enters the layer
    for proj in ("q_proj", "k_proj", "v_proj"):
        key = f"layers.0.self_attn.{proj}"
        tensors[f"{key}.bias"] = tensors.get(f"{key}.bias", 0) + tensors[f"{key}.weight"] @ shift
    key = "layers.0.self_attn.o_proj.bias"
    tensors[key] = tensors.get(key, 0) + shift
    layer = llama_layer_config(config.layer, architectures=["LlamaForCausalLM"], attention_bias=True)
    return EngineExport(
        config=layer,
        tensors={name: tensor.contiguous() for name, tensor in tensors.items()},
        required=(("architectures",), ("hidden_size",), ("vocab_size",), ("num_hidden_layers",)),
        required_tensors=("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"),
        speculative_tokens=speculative_tokens,
    )
