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
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.drafters.vocab import DraftHead, most_frequent_tokens

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


class EagleConfigError(ValueError):
    """Drafter options that cannot describe an EAGLE/FSPAD drafter; the message names the recipe key."""


class EagleConfig(PretrainedConfig):
    """Shape and options of an EAGLE/FSPAD drafter, plus the tree it drafts by default.

    ``layer`` holds the target's decoder-layer settings (hidden size, heads, RoPE), so the drafter's
    positions and attention match the target exactly."""

    model_type = "draftsmith_eagle"

    def __init__(
        self,
        layer: dict[str, Any] | None = None,
        feature_sampler: bool = False,
        partial_alignment: bool = False,
        tree_depth: int = 5,
        tree_top_k: int = 4,
        tree_total_tokens: int = 12,
        draft_vocab_size: int = 0,
        drafter_family: str = "eagle",
        target_identity: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.layer = dict(layer or {})
        self.feature_sampler = feature_sampler
        self.partial_alignment = partial_alignment
        self.tree_depth = tree_depth
        self.tree_top_k = tree_top_k
        self.tree_total_tokens = tree_total_tokens
        self.draft_vocab_size = draft_vocab_size
        self.drafter_family = drafter_family
        self.target_identity = target_identity
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        feature_sampler: bool = False,
        partial_alignment: bool = False,
        tree_depth: int = 5,
        tree_top_k: int = 4,
        tree_total_tokens: int = 12,
        draft_vocab_size: int = 0,
    ) -> EagleConfig:
        """A drafter for ``target_config`` (a Llama-architecture config). The tree defaults suit a CPU,
        where verifying 16 tokens costs ~2x one token; GPU users raise them (EAGLE-2: 6 / 10 / 60).

        ``draft_vocab_size`` > 0 drafts only from that many tokens, the most frequent in the training
        data (EAGLE-3's reduced draft vocabulary): the target's lm_head over its full vocabulary is
        the drafter's largest cost per step, and verification stays lossless whatever is proposed."""
        source = target_config.to_dict()
        if min(tree_depth, tree_top_k, tree_total_tokens) < 1:
            raise EagleConfigError("drafter.tree_depth, tree_top_k and tree_total_tokens must all be >= 1")
        if not 0 <= draft_vocab_size <= source["vocab_size"]:
            raise EagleConfigError(
                f"drafter.draft_vocab_size must be between 0 (whole vocabulary) and the target's "
                f"{source['vocab_size']}, got {draft_vocab_size}"
            )
        layer = {key: source[key] for key in _LAYER_KEYS if key in source}
        layer.setdefault("head_dim", source["hidden_size"] // source["num_attention_heads"])
        return cls(
            layer=layer,
            feature_sampler=feature_sampler,
            partial_alignment=partial_alignment,
            tree_depth=tree_depth,
            tree_top_k=tree_top_k,
            tree_total_tokens=tree_total_tokens,
            draft_vocab_size=draft_vocab_size,
        )

    def layer_config(self) -> LlamaConfig:
        config = LlamaConfig(**self.layer, num_hidden_layers=1)
        config._attn_implementation = "sdpa"
        return config

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


@dataclass
class DrafterOutput:
    token_features: torch.Tensor  # (B, T, h): what goes to lm_head (f~ with partial alignment)
    next_features: torch.Tensor  # (B, T, h): the predicted f_{t+1}, fed back when drafting


class EagleDrafter(nn.Module):
    """``forward(embeds, features, position_ids, attention_mask)``: position t reads ``e_{t+1}`` and ``f_t``
    and predicts ``f_{t+1}``."""

    config_class = EagleConfig

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
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
        # Token ids the drafter may propose, most frequent first (empty = the whole vocabulary).
        self.register_buffer("draft_vocab", torch.zeros(config.draft_vocab_size, dtype=torch.long))

    def fit_data(self, token_counts: torch.Tensor) -> None:
        """Choose the draft vocabulary from the training data's token counts (a (V,) tensor)."""
        if self.config.draft_vocab_size:
            self.draft_vocab.copy_(most_frequent_tokens(token_counts, self.config.draft_vocab_size))

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
    ) -> DrafterOutput:
        """``attention_mask``: a 4D additive mask ``(B, 1, T, past + T)``; None = causal over the inputs."""
        x = self.fc(torch.cat([embeds, features], dim=-1))  # (B, T, h)
        if self.feature_sampler is not None:
            x = self.feature_sampler(x, embeds)
        if attention_mask is None:
            attention_mask = causal_mask(x.shape[1], x.dtype, x.device)
        attended, _ = self.self_attn(
            x,
            position_embeddings=self.rotary_emb(x, position_ids),
            attention_mask=attention_mask,
            past_key_values=past_key_values,
        )
        residual = x + attended
        out = self.mlp(self.post_attention_layernorm(residual))
        if self.config.partial_alignment:
            out = torch.cat([residual, residual], dim=-1) + out
            h = residual.shape[-1]
            return DrafterOutput(token_features=out[..., :h], next_features=out[..., h:])
        out = residual + out
        return DrafterOutput(token_features=out, next_features=out)

    def save_pretrained(self, directory: str) -> None:
        from draftsmith.drafters.io import save_drafter_weights

        save_drafter_weights(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str) -> EagleDrafter:
        from draftsmith.drafters.io import load_drafter_weights

        return load_drafter_weights(cls, directory)


def causal_mask(length: int, dtype: torch.dtype, device: torch.device | str, padding: torch.Tensor | None = None):
    """``(B or 1, 1, T, T)`` additive causal mask; ``padding`` (B, T) 1/0 also hides padded keys."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
        # A padded query row with no visible key would give NaN under softmax; let it see itself.
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)[None, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)


class EagleTreeDrafter:
    """Drafts an EAGLE-2 dynamic tree for the runtime.

    The drafter keeps its own KV cache over committed positions only, fed with the target's true
    features of accepted tokens (from the verification forward). Each round it expands the root's
    ``top_k`` children, then at every depth the ``top_k`` best nodes by cumulative log-probability,
    each expansion one drafter forward; finally the best ``total_tokens`` nodes form the tree. The
    tree's KV is dropped from the drafter's cache after every round."""

    wants_features = True

    def __init__(
        self,
        model: EagleDrafter,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        depth: int | None = None,
        top_k: int | None = None,
        total_tokens: int | None = None,
        name: str = "eagle",
    ) -> None:
        self.model = model.eval()
        self.embed_tokens = embed_tokens
        self.head = DraftHead(lm_head, model.draft_vocab)
        self.depth = depth or model.config.tree_depth
        self.top_k = top_k or model.config.tree_top_k
        self.total_tokens = total_tokens or model.config.tree_total_tokens
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self._cache = DynamicCache()
        self._fed: list[int] = []  # tokens[: positions in cache + 1]
        self._last_feature: torch.Tensor | None = None  # predicted feature at the root position

    @torch.no_grad()
    def propose(self, context) -> Any:
        from draftsmith.inference.tree import best_first_tree

        tokens, features = context.tokens, context.features
        if features is None or features.shape[0] != len(tokens) - 1:
            raise ValueError("EAGLE drafting needs the target's features of every committed token but the root")
        self._catch_up(tokens, features)
        parents, node_tokens, scores = [], [], []
        values, ids = self._top(self._root_token_features)
        for logp, token in zip(values.tolist(), ids.tolist()):
            parents.append(-1), node_tokens.append(token), scores.append(logp)
        frontier = list(range(len(node_tokens)))
        inputs = {i: self._last_feature for i in frontier}  # feature each frontier node reads
        columns: dict[int, int] = {}  # candidate -> its column in the drafter cache
        for depth in range(2, self.depth + 1):
            out = self._expand(frontier, parents, node_tokens, inputs, columns, position=len(tokens) - 3 + depth)
            values, ids = self._top(out.token_features[0])
            children = []
            for row, node in enumerate(frontier):
                for value, token in zip(values[row].tolist(), ids[row].tolist()):
                    children.append(len(node_tokens))
                    parents.append(node), node_tokens.append(token), scores.append(scores[node] + value)
                    inputs[children[-1]] = out.next_features[0, row]
            frontier = sorted(children, key=lambda i: -scores[i])[: self.top_k]
        self._drop_tree_kv(len(tokens) - 1)
        tree, _ = best_first_tree(parents, node_tokens, scores, self.total_tokens)
        return tree

    def _catch_up(self, tokens: list[int], features: torch.Tensor) -> None:
        """Feed ``(f_t, x_{t+1})`` for every committed position the cache lacks."""
        if tokens[: len(self._fed)] != self._fed or not self._fed:
            self._reset()
        start, end = max(len(self._fed) - 1, 0), len(tokens) - 1
        if start == end:
            return
        device = features.device
        ids = torch.tensor(tokens[start + 1 : end + 1], device=device)
        embeds = self.embed_tokens(ids)[None].to(features.dtype)
        positions = torch.arange(start, end, device=device)[None]
        mask = torch.zeros(1, 1, end - start, end, dtype=features.dtype, device=device)
        mask[..., start:] = causal_mask(end - start, features.dtype, device)
        out = self.model(embeds, features[start:end][None], positions, mask, self._cache)
        self._fed = list(tokens)
        self._root_token_features = out.token_features[0, -1]
        self._last_feature = out.next_features[0, -1]

    def _expand(self, frontier, parents, node_tokens, inputs, columns, position: int) -> DrafterOutput:
        """One drafter forward over the frontier nodes, each attending to the committed cache, its
        ancestors' columns and itself."""
        committed = len(self._fed) - 1
        past = committed + len(columns)
        dtype = self._last_feature.dtype
        device = self._last_feature.device
        mask = torch.full((1, 1, len(frontier), past + len(frontier)), torch.finfo(dtype).min, dtype=dtype)
        mask[..., :committed] = 0
        for row, node in enumerate(frontier):
            ancestor = parents[node]
            while ancestor >= 0:
                mask[0, 0, row, columns[ancestor]] = 0
                ancestor = parents[ancestor]
            mask[0, 0, row, past + row] = 0
        for row, node in enumerate(frontier):
            columns[node] = past + row
        ids = torch.tensor([node_tokens[i] for i in frontier], device=device)
        embeds = self.embed_tokens(ids)[None].to(dtype)
        feats = torch.stack([inputs[i] for i in frontier])[None]
        positions = torch.full((1, len(frontier)), position, device=device)
        return self.model(embeds, feats, positions, mask.to(device), self._cache)

    def _top(self, token_features: torch.Tensor):
        """Top-k (log-probability, token id) pairs of the draft head; rows are (k,) or (n, k)."""
        top = self.head(token_features).float().log_softmax(-1).topk(self.top_k)
        return top.values, self.head.token_ids(top.indices)

    def _drop_tree_kv(self, committed: int) -> None:
        from draftsmith.inference.cache import cache_length, keep_positions

        if cache_length(self._cache) > committed:
            keep_positions(self._cache, torch.arange(committed))


SPECULATORS_VERSION = "0.1.0"  # the config layout of vLLM's `speculators` EAGLE models this export follows


def speculators_layout(model: EagleDrafter, verifier_name: str, speculative_tokens: int = 5):
    """``(config, state_dict)`` in the layout vLLM's ``speculators`` documents for EAGLE-1/2 models
    (``EagleSpeculator``: ``fusion_fc`` + one ``LlamaDecoderLayer`` called ``transformer`` whose input
    norm is an identity; embedding and lm_head come from the verifier).

    Only plain EAGLE fits that layout: FSPAD's feature sampler and two-feature MLP have no place in it."""
    config = model.config
    if config.feature_sampler or config.partial_alignment:
        raise ValueError(
            "the speculators EAGLE layout has no feature sampler or partial alignment; "
            "export an eagle drafter (drafter.feature_sampler=false drafter.partial_alignment=false) for vLLM"
        )
    layer = {**config.layer_config().to_diff_dict(), "num_hidden_layers": 1, "model_type": "llama"}
    layer.pop("_attn_implementation_autoset", None)
    speculators_config = {
        "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
        "speculators_model_type": "eagle",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_architecture": "LlamaDecoderLayer",
        "transformer_layer_config": layer,
        "layernorms": False,
        "fusion_bias": True,
        "speculators_config": {
            "algorithm": "eagle",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": verifier_name, "architectures": ["LlamaForCausalLM"]},
        },
    }
    rename = {"fc.": "fusion_fc.", "self_attn.": "transformer.self_attn.", "mlp.": "transformer.mlp."}
    rename["post_attention_layernorm."] = "transformer.post_attention_layernorm."
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "draft_vocab":  # speculators' EAGLE drafts over the verifier's whole vocabulary
            continue
        prefix = next(p for p in rename if name.startswith(p))
        state[rename[prefix] + name[len(prefix) :]] = tensor.detach().contiguous().cpu()
    return speculators_config, state
