"""DFlash: a block-diffusion drafter that drafts a whole block of tokens in one forward (arXiv 2602.06036).

A few decoder layers shaped like the target's read the target's states at several of its layers,
concatenated and fused once: ``context = hidden_norm(fc(cat(states)))``. Every drafter layer injects
that context as extra keys and values (its own ``k_proj`` / ``v_proj`` of the context rows, at the
context's rotary positions); the queries come from a *block* of ``block_size`` positions only:

- block position 0 reads the embedding of the last committed token (the root, whose target states are
  not known yet: it is verified next), position j > 0 reads the learned ``mask_embedding``;
- the block attends to the context of every committed token before the root and, bidirectionally, to
  itself; position j (rotary position root + j) predicts the token j after the root through the
  target's ``lm_head`` (frozen, restricted to a draft vocabulary when ``draft_vocab_size`` > 0).

One forward denoises the block: a chain of its ``block_size - 1`` argmaxes (or a Cartesian tree of each
position's top-k, as P-EAGLE's), verified losslessly by the runtime. The context's keys and values are
cached across rounds; the block's are dropped after each. Training (:func:`draftsmith.train.losses.
dflash_loss`) builds many blocks per sequence at random anchors, each seeing only the context before
its anchor. Parameter names follow z-lab/dflash (``fc``, ``hidden_norm``, ``layers.i.*``, ``norm``); the
reference reads a reserved mask token's (frozen) embedding where this drafter learns ``mask_embedding``.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, LlamaConfig, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from draftsmith.core.cache import cache_length, keep_positions
from draftsmith.core.drafting import DraftContext, Drafter, committed_features
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.tree import DraftTree, cartesian_tree
from draftsmith.drafters.base import (
    DrafterConfig,
    DrafterModel,
    DraftVocabMixin,
    FrozenTarget,
    TreeOptionError,
    TreeOptions,
)
from draftsmith.drafters.eagle import EagleConfig
from draftsmith.drafters.eagle3 import default_aux_layer_ids
from draftsmith.drafters.engine_layouts import (
    VLLM_DFLASH_REQUIRED,
    EngineExport,
    EngineLayoutError,
    Verifier,
    check_distinct_aux_layers,
    decoder_config,
    engine_tensor,
    layer_settings_problem,
    llama_layers,
)
from draftsmith.drafters.vocab import DraftHead, modules_with_head, unused_token_id

if TYPE_CHECKING:
    from draftsmith.drafters.gguf_layout import LlamaCppDraft


class DFlashConfigError(DraftsmithError, ValueError):
    """Drafter options that cannot describe a DFlash drafter; the message names the recipe key."""


class DFlashConfig(DrafterConfig):
    """Shape and options of a DFlash drafter.

    ``num_layers``: drafter decoder layers, each shaped like one of the target's (the paper: 5 on an 8B
    target; 1-2 on a CPU). ``block_size``: positions denoised per forward, the root and
    ``block_size - 1`` masked ones (the paper: 16; 8 here). ``aux_layer_ids``: the target's
    ``hidden_states`` indices fused into the context (EAGLE-3's default, so its feature cache is shared;
    the reference spreads one per drafter layer). ``depth`` (<= ``block_size - 1``, default all),
    ``top_k`` (1: a chain) and ``total_tokens`` shape what one forward proposes. ``draft_vocab_size`` > 0
    restricts the target's ``lm_head`` to that many of the training data's most frequent tokens.
    ``qk_norm``: RMS-normalise each head's queries and keys before their rotation (Qwen3's layer, the one
    vLLM's ``dflash`` method runs); off by default, the target-shaped Llama layer."""

    model_type = "draftsmith_dflash"
    TREE_OPTIONS = ("depth", "top_k", "total_tokens")
    DERIVED = ("layer", "target_num_layers")
    error = DFlashConfigError

    def __init__(
        self,
        layer: dict[str, Any] | None = None,
        target_num_layers: int = 0,
        num_layers: int = 1,
        block_size: int = 8,
        aux_layer_ids: list[int] | None = None,
        depth: int | None = None,
        top_k: int = 1,
        total_tokens: int | None = None,
        draft_vocab_size: int = 0,
        qk_norm: bool = False,
        **kwargs: Any,
    ) -> None:
        self.layer = dict(layer or {})
        self.target_num_layers = target_num_layers
        self.num_layers = num_layers
        self.block_size = block_size
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(target_num_layers or 1)
        self.depth = block_size - 1 if depth is None else depth
        self.top_k = top_k
        self.total_tokens = self.depth if total_tokens is None else total_tokens
        self.draft_vocab_size = draft_vocab_size
        self.qk_norm = qk_norm
        kwargs.setdefault("drafter_family", "dflash")
        super().__init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        layer = EagleConfig.from_target_config(target_config)["layer"]
        return {"layer": layer, "target_num_layers": target_config.num_hidden_layers}

    def check(self) -> None:
        if not isinstance(self.block_size, int) or not 2 <= self.block_size <= 64:
            raise DFlashConfigError(f"drafter.block_size takes a whole number from 2 to 64, got {self.block_size!r}")
        if not isinstance(self.num_layers, int) or not 1 <= self.num_layers <= 64:
            raise DFlashConfigError(f"drafter.num_layers takes a whole number from 1 to 64, got {self.num_layers!r}")
        if not isinstance(self.qk_norm, bool):
            raise DFlashConfigError(f"drafter.qk_norm takes true or false, got {self.qk_norm!r}")
        if problem := layer_settings_problem(self.layer):
            raise DFlashConfigError(problem)
        super().check()
        check_depth(self.depth, self.block_size, DFlashConfigError)
        layers = self.target_num_layers
        if not self.aux_layer_ids or not all(0 <= i <= layers for i in self.aux_layer_ids):
            raise DFlashConfigError(
                f"drafter.aux_layer_ids must name target states 0..{layers} (hidden_states indices), "
                f"got {self.aux_layer_ids}; the default is {default_aux_layer_ids(layers)}"
            )
        vocab = self.layer.get("vocab_size", 0)
        if not 0 <= self.draft_vocab_size <= vocab:
            raise DFlashConfigError(
                f"drafter.draft_vocab_size must be between 0 (whole vocabulary) and the target's {vocab}, "
                f"got {self.draft_vocab_size}"
            )

    def parallel_depths(self) -> int:
        return self.block_size - 1

    def layer_config(self) -> LlamaConfig:
        return llama_layers(self.layer, self.num_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layer_ids)


def check_depth(depth: int, block_size: int, error: type[Exception]) -> None:
    """A block drafts at most its ``block_size - 1`` masked positions."""
    if depth > block_size - 1:
        raise error(f"drafter.depth={depth} drafts past the {block_size - 1} masked positions of a block (block_size)")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` (B, H, T, D) at the positions of ``cos`` / ``sin`` (B, T, D)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Attention whose queries are the block's and whose keys and values are the context's and the
    block's: ``k_proj`` / ``v_proj`` of ``cat(context, block)`` (context KV injection). With ``qk_norm``
    each head's queries and keys are RMS-normalised (``q_norm`` / ``k_norm``) before the rotation."""

    def __init__(self, config: LlamaConfig, layer_idx: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)
        # absent (not identity weights) without qk_norm: the Llama layer's checkpoints and numbers stay as they were
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if qk_norm else None

    def forward(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor | None,
        cache: DynamicCache | None,
    ) -> torch.Tensor:
        """``block`` (B, T, h) normed, ``context`` (B, C, h) fused context rows not in ``cache`` yet,
        ``rotary`` at the C + T positions of context then block, ``allowed`` (B or 1, 1, T, past + C + T)
        bool (None: every key); the new keys and values are appended to ``cache``."""
        b, t, _ = block.shape
        cos, sin = rotary
        rows = torch.cat([context, block], dim=1)
        q = self.q_proj(block).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(rows).view(b, rows.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(rows).view(b, rows.shape[1], self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos[:, -t:], sin[:, -t:]), _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    """One pre-norm decoder layer (the target's shape) over the block, the context injected in attention."""

    def __init__(self, config: LlamaConfig, layer_idx: int, qk_norm: bool = False) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = DFlashAttention(config, layer_idx, qk_norm)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, block, context, rotary, allowed, cache) -> torch.Tensor:
        block = block + self.self_attn(self.input_layernorm(block), context, rotary, allowed, cache)
        return block + self.mlp(self.post_attention_layernorm(block))


class DFlashModel(DraftVocabMixin, DrafterModel):
    """``forward(embeds, masked, context_states, position_ids, allowed, cache)``: the block's output
    features (normed); :meth:`head` of them are the logits over the draft vocabulary."""

    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        layer = config.layer_config()
        h = layer.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        self.hidden_norm = LlamaRMSNorm(h, eps=layer.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer, i, config.qk_norm) for i in range(config.num_layers))
        self.norm = LlamaRMSNorm(h, eps=layer.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(layer)
        self.mask_embedding = nn.Parameter(torch.randn(h) * 0.02)  # until init_from_target
        self._register_draft_vocab(config.draft_vocab_size)  # token ids it may propose (empty = all)

    @torch.no_grad()
    def init_from_target(self, frozen: FrozenTarget) -> None:
        """The mask starts as the average drafted token, as the target embeds it (Gemma scales embeddings)."""
        weight = frozen.embed_tokens.weight
        ids = self.draft_vocab if self.draft_vocab.numel() else torch.arange(weight.shape[0])
        self.mask_embedding.copy_(frozen.embed_tokens(ids.to(weight.device)).float().mean(0).to(self.mask_embedding))

    def draft_token_ids(self) -> torch.Tensor:
        """(N,) the target ids the drafter may propose, ascending."""
        if self.draft_vocab.numel():
            return self.draft_vocab
        return torch.arange(int(self.config.layer["vocab_size"]), device=self.draft_vocab.device)

    def head(self, frozen: FrozenTarget) -> DraftHead:
        """The target's ``lm_head`` over the draft vocabulary (the drafter owns no head)."""
        return DraftHead(frozen.lm_head, self.draft_vocab)

    def forward(
        self,
        embeds: torch.Tensor,
        masked: torch.Tensor,
        context_states: torch.Tensor,
        position_ids: torch.Tensor,
        allowed: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """``embeds`` (B, T, h) the block's token embeddings, read where ``masked`` (B, T) is False (the
        mask embedding elsewhere; substituted here so that DDP sees the parameter used);
        ``context_states`` (B, C, layers x h) the target's states of context rows not yet in ``cache``;
        ``position_ids`` (B, C + T); ``allowed`` see :meth:`DFlashAttention.forward`. Returns (B, T, h)."""
        block = torch.where(masked[..., None], self.mask_embedding.to(embeds.dtype), embeds)
        context = self.hidden_norm(self.fc(context_states.to(block.dtype)))
        rotary = self.rotary_emb(block, position_ids)
        for layer in self.layers:
            block = layer(block, context, rotary, allowed, cache)
        return self.norm(block)

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> DFlashDrafter:
        frozen = FrozenTarget.from_model(target_model)
        options = tree.over(self.config.tree_options())
        check_depth(options.depth, self.config.block_size, TreeOptionError)
        return DFlashDrafter(self, frozen, options, name=self.config.drafter_family)

    def engine_layout(self, fmt: str, verifier: Verifier, speculative_tokens: int | None) -> EngineExport:
        if fmt != "vllm":
            raise EngineLayoutError(f"DFlash's only engine layout is vLLM's dflash method: --format vllm, not {fmt}")
        return vllm_dflash_layout(self, speculative_tokens)

    def llamacpp_layout(self, speculative_tokens: int | None) -> LlamaCppDraft:
        raise EngineLayoutError(
            "DFlash has no gguf layout yet: llama.cpp's dflash graph requires Qwen3's q/k norms (drafter.qk_norm="
            "true) and drafts its masks with a vocabulary token's embedding, where this drafter learned its own "
            "mask_embedding, so its GGUF would carry the target's embedding with that row replaced, which has not "
            "been checked against llama.cpp; serve it with `draftsmith generate` or --format vllm"
        )


# vLLM 0.32's ``dflash`` method (model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py) runs this
# drafter with ``qk_norm``: Qwen3 layers whose context keys and values are ``k_proj`` / ``v_proj`` of
# ``hidden_norm(fc(states))`` (keys ``k_norm``-ed, rotated at the context's positions), whose queries are the
# block ``[root, mask x K]`` at the K + 1 positions after the context, attending to the whole context and,
# with ``dflash_config.causal`` false, to the whole block; the logits are the target's ``lm_head``. A mask
# reads ``embed_tokens[mask_token_id]`` unless ``mask_embedding.pt`` replaces that row for the drafter.
MASK_EMBEDDING_FILE = "mask_embedding.pt"


def vllm_dflash_layout(model: DFlashModel, speculative_tokens: int | None) -> EngineExport:
    """vLLM's ``DFlashDraftModel`` (method ``dflash``): a Qwen3 config with ``dflash_config``
    (``mask_token_id``, ``target_layer_ids`` in DFlash's convention, layer outputs, ``causal: false``),
    the drafter's weights under its own names (vLLM's: ``fc``, ``hidden_norm``, ``layers.i.*``, ``norm``),
    no embedding and no ``lm_head`` (vLLM shares the target's), and ``mask_embedding.pt``, the learned mask
    vLLM substitutes for the mask token's embedding. vLLM drafts ``block_size - 1`` tokens per step."""
    config = model.config
    check_vllm_dflash(config, speculative_tokens)
    mask_token = unused_token_id(model.draft_token_ids(), int(config.layer["vocab_size"]))
    exported = decoder_config(
        config.layer,
        "qwen3",
        config.num_layers,
        architectures=["DFlashDraftModel"],
        tie_word_embeddings=False,
        block_size=config.block_size,
        dflash_config={
            "mask_token_id": mask_token,
            "target_layer_ids": [i - 1 for i in sorted(config.aux_layer_ids)],
            "causal": False,
        },
    )
    own = {name: t for name, t in model.state_dict().items() if name not in ("mask_embedding", "draft_vocab")}
    tensors = {name: engine_tensor(t) for name, t in own.items()}
    tensors["fc.weight"] = columns_by_layer(tensors["fc.weight"], config.aux_layer_ids)
    return EngineExport(
        config=exported,
        tensors=tensors,
        files={MASK_EMBEDDING_FILE: mask_embedding_file(model.mask_embedding, mask_token)},
        required=VLLM_DFLASH_REQUIRED,
        required_tensors=("fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_norm.weight"),
        speculative_tokens=config.block_size - 1,
    )


def check_vllm_dflash(config: DFlashConfig, speculative_tokens: int | None) -> None:
    """Refuse, in one line, a drafter or a step size that vLLM's dflash method would run differently."""
    layers, aux, act = config.target_num_layers, config.aux_layer_ids, config.layer.get("hidden_act", "silu")
    if not config.qk_norm:
        raise EngineLayoutError(
            "vLLM's dflash drafter is Qwen3's layer, which RMS-normalises each head's queries and keys, and this "
            "drafter has no such norms: train one with drafter.qk_norm=true"
        )
    if config.draft_vocab_size:
        raise EngineLayoutError(
            "a reduced draft vocabulary is not exported for vLLM's dflash yet (it needs the target's lm_head rows "
            "over it and d2t); train with drafter.draft_vocab_size=0"
        )
    if act != "silu" or config.layer.get("mlp_bias"):
        raise EngineLayoutError(
            f"vLLM's dflash MLP is SiLU without biases; the target's layers have hidden_act={act!r}, "
            f"mlp_bias={bool(config.layer.get('mlp_bias'))}"
        )
    check_distinct_aux_layers(aux)
    if min(aux) < 1 or max(aux) >= layers:
        raise EngineLayoutError(
            f"vLLM's dflash_config.target_layer_ids name layer outputs, so drafter.aux_layer_ids={aux} must lie in "
            f"1..{layers - 1}: 0 is the embedding and {layers} the final norm's output (vLLM would read the last "
            "layer's, before the norm)"
        )
    if speculative_tokens is not None and speculative_tokens != config.block_size - 1:
        raise EngineLayoutError(
            f"vLLM's dflash block is the root and one mask per speculative token, all attending to each other, so "
            f"a block_size={config.block_size} drafter drafts as trained only with {config.block_size - 1} "
            f"speculative tokens, not {speculative_tokens}"
        )


def columns_by_layer(fc: torch.Tensor, aux_layer_ids: list[int]) -> torch.Tensor:
    """``fc``'s input column blocks in ascending target layer order: vLLM concatenates the target's
    states by layer, draftsmith in ``aux_layer_ids`` order."""
    blocks = fc.chunk(len(aux_layer_ids), dim=1)
    order = sorted(range(len(aux_layer_ids)), key=aux_layer_ids.__getitem__)
    return torch.cat([blocks[i] for i in order], dim=1).contiguous()


def mask_embedding_file(mask_embedding: torch.Tensor, mask_token: int) -> bytes:
    """``mask_embedding.pt`` as vLLM reads it: the mask token id it stands for and the embedding."""
    buffer = io.BytesIO()
    torch.save({"mask_token_id": mask_token, "embedding": engine_tensor(mask_embedding)}, buffer)
    return buffer.getvalue()


class DFlashDrafter(Drafter):
    """Drafts a round's tokens for the runtime from ONE forward of a :class:`DFlashModel`.

    The drafter's KV cache holds the context of committed tokens (all but the root). Each round's
    forward appends the context rows the cache lacks (the target's states of the tokens accepted last
    round, from the verification forward) and denoises the block ``[root, mask, ...]``; the block's
    keys are dropped again. Its first ``depth`` masked positions give a chain of argmaxes (``top_k``
    1) or a Cartesian tree of their ``top_k`` tokens, the ``total_tokens`` best."""

    wants_features = True

    def __init__(self, model: DFlashModel, frozen: FrozenTarget, tree: TreeOptions, name: str = "dflash") -> None:
        self.model = model.eval()
        self.feature_layers = model.config.feature_layers()
        self.embed_tokens = frozen.embed_tokens
        self.head = model.head(frozen)
        self._own_modules = modules_with_head(self.model, self.head)
        self.block_size = model.config.block_size
        self.depth, self.top_k, self.total_tokens = tree.depth, tree.top_k, tree.total_tokens
        self.name = name
        self._cache = DynamicCache()
        self._fed: list[int] = []  # the tokens whose context rows the cache holds

    def own_modules(self) -> nn.Module:
        return self._own_modules

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        tokens, features = context.tokens, committed_features(context, "DFlash")
        logits = self.block_logits(tokens, features)[: min(self.depth, self.total_tokens)]
        return cartesian_tree(logits, self.top_k, self.total_tokens, self.head.token_ids)

    def block_logits(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        """(block_size - 1, draft vocabulary) logits of the tokens after the root, from one forward."""
        start, root = self._reusable_rows(tokens), len(tokens) - 1
        device, dtype = features.device, features.dtype
        ids = torch.tensor(tokens[-1:] * self.block_size, device=device)  # masked positions read no token
        masked = torch.arange(self.block_size, device=device) > 0
        positions = torch.arange(start, root + self.block_size, device=device)
        out = self.model(
            self.embed_tokens(ids)[None].to(dtype),
            masked[None],
            features[start:root][None],
            positions[None],
            None,  # the block sees the whole context and itself
            self._cache,
        )
        keep_positions(self._cache, torch.arange(root))  # the block's keys serve this round only
        self._fed = tokens[:root]
        return self.head(out[0, 1:]).float()

    def _reusable_rows(self, tokens: list[int]) -> int:
        """How many cached context rows this round reuses: those of tokens still committed (a row depends
        on its token and the ones before)."""
        if tokens[: len(self._fed)] != self._fed:
            self._cache, self._fed = DynamicCache(), []
        keep = min(len(self._fed), len(tokens) - 1)
        if cache_length(self._cache) > keep:
            keep_positions(self._cache, torch.arange(keep))
        return keep
