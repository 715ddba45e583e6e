"""EAGLE-3 and FSPAD-3 drafters: config, model, and the EAGLE-2 dynamic trees they draft.

EAGLE-3 drops EAGLE's feature regression and reads more of the target:

- input: the target's hidden states *entering* three of its layers (low, mid, high; ``aux_layer_ids``
  in vLLM's convention, i.e. indices into HF's ``hidden_states``), concatenated and fused by
  ``fc: Linear(3h, h, bias=False)``;
- one decoder layer whose attention reads ``cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))``
  (q/k/v take 2h); the residual stream starts from the *normed* hidden (vLLM's
  ``norm_before_residual=true``); ``norm`` then its own ``lm_head`` over a reduced draft vocabulary
  (``d2t``: target id = i + d2t[i]; ``t2d``: which target tokens are drafted);
- the layer's pre-norm output is fed back as the next step's hidden, in training (the
  training-time test, :func:`draftsmith.train.losses.eagle3_loss`) as at decode time.

FSPAD-3 adds FSPAD's two parts: the feature sampler on the fused input (``fc``'s output, gated by
the token embedding) and partial alignment (the MLP's output is two features wide: the first half
goes to the token head, the second is fed back as the next step's hidden).

Parameter names follow vLLM's Eagle-3 layout under ``layer.`` (exporters rely on them); the target's
embedding is used frozen and never saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRMSNorm, LlamaRotaryEmbedding

from draftsmith.core.drafting import DraftingStep, LayerKernel
from draftsmith.core.tree import causal_mask
from draftsmith.drafters.base import TREE_LIMITS, DrafterModel, FrozenTarget, TreeOptions
from draftsmith.drafters.eagle import (
    DrafterMLP,
    DrafterOutput,
    EagleConfig,
    EagleConfigError,
    EagleTreeDrafter,
    FeatureSampler,
    attention_and_mlp,
    write_keys_values,
)
from draftsmith.drafters.engine_layouts import (
    EAGLE3_SPECULATORS_REQUIRED,
    SGLANG_EAGLE3_REQUIRED,
    SPECULATORS_REQUIRED,
    SPECULATORS_VERSION,
    EngineExport,
    EngineLayoutError,
    Verifier,
    check_ascending_aux_layers,
    engine_tensor,
    llama_layer_config,
    llama_layers,
    speculators_block,
)
from draftsmith.drafters.gguf_layout import LlamaCppDraft, llama_rope_rows
from draftsmith.drafters.io import load_weights_into
from draftsmith.drafters.vocab import draft_vocab_maps, most_frequent_tokens

# Training-time-test steps are draft depths trained (EAGLE-3: 7, P-EAGLE: 8 on a GPU); each adds a drafter
# forward and its activations to every batch, so no more than a tree's deepest draft.
MAX_TTT_STEPS = TREE_LIMITS["depth"]


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default fused layers for an L-layer target: the states entering layers 2, L//2 and L-3."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


class Eagle3Config(EagleConfig):
    """Shape and options of an EAGLE-3 / FSPAD-3 drafter (EAGLE's options plus the ones below).

    ``aux_layer_ids``: the target layers whose *input* hidden states are fused (vLLM's convention;
    SGLang names the same tensors as outputs of the layer before). Default [2, L//2, L-3].
    ``ttt_steps``: steps of the training-time test unrolled per batch (EAGLE-3 uses 7 on a GPU).
    ``draft_vocab_size``: 0 = the target's whole vocabulary; otherwise the drafter's own ``lm_head``
    covers that many tokens, the most frequent supervised tokens of the training data."""

    model_type = "draftsmith_eagle3"
    DERIVED = ("layer", "target_num_layers")

    def __init__(
        self,
        layer: dict[str, Any] | None = None,
        target_num_layers: int = 0,
        aux_layer_ids: list[int] | None = None,
        ttt_steps: int = 3,
        **kwargs: Any,
    ) -> None:
        self.target_num_layers = target_num_layers
        self.aux_layer_ids = list(aux_layer_ids) if aux_layer_ids else default_aux_layer_ids(target_num_layers or 1)
        self.ttt_steps = ttt_steps
        kwargs.setdefault("drafter_family", "eagle3")
        super().__init__(layer=layer, **kwargs)
        if not self.draft_vocab_size and self.layer:  # the whole vocabulary, written explicitly for exporters
            self.draft_vocab_size = int(self.layer["vocab_size"])

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        return {**super().from_target_config(target_config), "target_num_layers": target_config.num_hidden_layers}

    def check(self) -> None:
        super().check()
        layers = self.target_num_layers
        if len(self.aux_layer_ids) < 2 or not all(0 <= i < layers for i in self.aux_layer_ids):
            raise EagleConfigError(
                f"drafter.aux_layer_ids must name at least two of the target's layers 0..{layers - 1} "
                f"(the states entering them), got {self.aux_layer_ids}; the default is {default_aux_layer_ids(layers)}"
            )
        if not 1 <= self.ttt_steps <= MAX_TTT_STEPS:  # each step adds a forward and its activations to a batch
            raise EagleConfigError(
                f"drafter.ttt_steps must be >= 1 and <= {MAX_TTT_STEPS} (a step per draft depth), got {self.ttt_steps}"
            )

    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.aux_layer_ids)


class Eagle3DecoderLayer(nn.Module):
    """One Llama decoder layer whose attention reads the normed token embedding and the normed hidden."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        layer = config.layer_config()
        h, eps = layer.hidden_size, layer.rms_norm_eps
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.self_attn = LlamaAttention(layer, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # q/k/v read [embedding, hidden]: 2h wide
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = DrafterMLP(layer, 2 if config.partial_alignment else 1)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        cache: DynamicCache | None,
        rows: torch.Tensor | None = None,
        kernel: LayerKernel | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual after attention, MLP output) for the caller to combine; the MLP only at ``rows``
        (:func:`~draftsmith.drafters.eagle.attention_and_mlp`)."""
        attention_input, residual = self.attention_input(embeds, hidden)
        return attention_and_mlp(
            self, attention_input, residual, position_embeddings, attention_mask, cache, rows, kernel
        )

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what q, k and v read, the residual)."""
        residual = self.hidden_norm(hidden)  # norm_before_residual: the residual is the normed hidden
        return torch.cat([self.input_layernorm(embeds), residual], dim=-1), residual


class Eagle3Model(DrafterModel):
    """``forward(embeds, hidden, position_ids, attention_mask, cache)``: position t reads
    ``e_{t+1}`` and a hidden ``h_t`` (the fused target states, see :meth:`read_target`, or the previous
    step's ``next_features``) and predicts ``x_{t+2}`` (:meth:`logits` of ``token_features``)."""

    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        layer = config.layer_config()
        h = layer.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * h, h, bias=False)
        self.feature_sampler = (
            FeatureSampler(h, layer.intermediate_size, layer.rms_norm_eps) if config.feature_sampler else None
        )
        self.layer = Eagle3DecoderLayer(config)
        self.norm = LlamaRMSNorm(h, eps=layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(layer)
        vocab = int(config.layer["vocab_size"])
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.fit_vocab(torch.arange(config.draft_vocab_size))  # until fit_data: the lowest ids

    # ---- the draft vocabulary ----------------------------------------------------------------
    def fit_vocab(self, token_ids: torch.Tensor) -> None:
        if self.t2d.is_meta:  # a skeleton built on the meta device to count its weights holds no values
            return
        d2t, t2d = draft_vocab_maps(token_ids, self.t2d.numel())
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def fit_data(self, token_counts: torch.Tensor) -> None:
        self.fit_vocab(most_frequent_tokens(token_counts, self.config.draft_vocab_size))

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """Target token ids of ``lm_head`` columns."""
        return columns + self.d2t[columns]

    def stored_token_ids(self) -> dict[str, torch.Tensor]:
        return {"d2t": self.draft_token_ids()}  # d2t holds offsets: the ids are column + offset

    def draft_token_ids(self) -> torch.Tensor:
        """(N,) the target ids of the draft vocabulary, ascending."""
        return self.token_ids(torch.arange(self.d2t.numel(), device=self.d2t.device))

    @torch.no_grad()
    def init_from_target(self, frozen: FrozenTarget) -> None:
        """The draft ``lm_head`` starts as the target's rows of the draft vocabulary."""
        weight = frozen.lm_head.weight
        self.lm_head.weight.copy_(weight[self.draft_token_ids().to(weight.device)].to(self.lm_head.weight))

    def load_initial_weights(self, directory: str | Path) -> list[str]:
        """``train.init_from``. A drafter whose draft vocabulary has another size (a run with a larger
        ``draft_vocab_size``) starts this one's head: each token both vocabularies hold keeps its trained
        row, the others keep their rows from :meth:`init_from_target`, and this run's vocabulary stays.
        One of the same size is loaded whole, its vocabulary included (the same drafter trained on)."""
        return load_weights_into(self, directory, adapt=self._head_rows_by_token)

    @torch.no_grad()
    def _head_rows_by_token(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        head, offsets = state.get("lm_head.weight"), state.get("d2t")
        if head is None or offsets is None or head.shape == self.lm_head.weight.shape:
            return state, []
        theirs = {token: row for row, token in enumerate((torch.arange(offsets.numel()) + offsets).tolist())}
        mine = self.draft_token_ids().tolist()
        kept = [(row, theirs[token]) for row, token in enumerate(mine) if token in theirs]
        weight = self.lm_head.weight.detach().clone()
        if kept:
            rows, sources = (torch.tensor(side) for side in zip(*kept))
            weight[rows] = head[sources].to(weight)
        state = {name: tensor for name, tensor in state.items() if name not in ("d2t", "t2d")}
        state["lm_head.weight"] = weight
        new = len(mine) - len(kept)
        fresh = f"lm_head.weight's rows of the {new} of {len(mine)} draft tokens it had no row for"
        return state, [fresh] if new else []

    # ---- one step ------------------------------------------------------------------------------
    def read_target(self, *args: Any, **kwargs: Any) -> DrafterOutput:
        """A step whose hidden is the target's (len(aux_layer_ids) x h) concatenated layer states."""
        return self(*args, from_target=True, **kwargs)

    def read_target_context(
        self, embeds: torch.Tensor, layer_states: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache
    ) -> None:
        """What :meth:`read_target` writes into ``cache`` for these positions, without their outputs."""
        hidden = self.fuse(layer_states, embeds)
        attention_input, _ = self.layer.attention_input(embeds, hidden)
        rotary = self.rotary_emb(hidden, position_ids)
        write_keys_values(self.layer.self_attn, attention_input, rotary, cache)

    # Step i of the training-time test reads step i-1's output, so a step's MLP runs wherever a later
    # step has a label (see ``draftsmith.train.losses.read_rows``).
    feeds_back = True

    def ttt_step_inputs(
        self, step: int, token_embeds: torch.Tensor, target_states: torch.Tensor, fed_back: torch.Tensor
    ) -> dict[str, Any]:
        """The keywords of training-time-test step ``step``'s forward besides positions, mask and cache:
        the embeddings of the tokens it reads and the previous step's fed-back hidden (step 0: the
        target's layer states)."""
        if step == 0:
            return {"embeds": token_embeds, "hidden": target_states, "from_target": True}
        return {"embeds": token_embeds, "hidden": fed_back, "from_target": False}

    def fuse(self, layer_states: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        fused = self.fc(layer_states)
        return fused if self.feature_sampler is None else self.feature_sampler(fused, embeds)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: DynamicCache | None = None,
        from_target: bool = False,
        rows: torch.Tensor | None = None,
        kernel: LayerKernel | None = None,
    ) -> DrafterOutput:
        """``attention_mask``: a 4D additive mask ``(B, 1, T, past + T)``; None = causal over the inputs.
        ``from_target``: ``hidden`` is the target's concatenated layer states, fused first. ``rows``
        (B, T) bool: the positions whose outputs are read (the MLP runs there only); None = all."""
        if from_target:
            hidden = self.fuse(hidden, embeds)
        if attention_mask is None:
            attention_mask = causal_mask(hidden.shape[1], hidden.dtype, hidden.device)
        rotary = self.rotary_emb(hidden, position_ids)
        residual, out = self.layer(embeds, hidden, rotary, attention_mask, cache, rows, kernel)
        if self.config.partial_alignment:  # [token half | fed-back half] over a duplicated residual
            out = torch.cat([residual, residual], dim=-1) + out
            h = residual.shape[-1]
            return DrafterOutput(token_features=out[..., :h], next_features=out[..., h:])
        out = residual + out
        return DrafterOutput(token_features=out, next_features=out)

    def logits(self, token_features: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (column i is target token ``i + d2t[i]``)."""
        return self.lm_head(self.norm(token_features))

    def drafting_step(self, from_target: bool) -> DraftingStep | None:
        """EAGLE-3's forward as :class:`DraftingStep` describes it (FSPAD-3's sampler and partial alignment
        are not): :meth:`forward` and :meth:`logits`."""
        if self.feature_sampler is not None or self.config.partial_alignment:
            return None
        layer = self.layer
        return DraftingStep(
            fc=self.fc if from_target else None,
            hidden_norm=layer.hidden_norm,
            input_norm=layer.input_layernorm,
            attention=layer.self_attn,
            post_norm=layer.post_attention_layernorm,
            mlp=layer.mlp,
            norm=self.norm,
            lm_head=self.lm_head,
            rotary=self.rotary_emb,
        )

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> EagleTreeDrafter:
        frozen = FrozenTarget.from_model(target_model)
        options = tree.over(self.config.tree_options())
        return EagleTreeDrafter(self, frozen.embed_tokens, Eagle3Head(self), options, name=self.config.drafter_family)

    def engine_layout(self, fmt: str, verifier: Verifier, speculative_tokens: int | None) -> EngineExport:
        if self.config.feature_sampler or self.config.partial_alignment:
            raise EngineLayoutError(
                "FSPAD-3 has no serving-engine layout (no engine's EAGLE-3 model has a feature sampler or partial "
                "alignment); serve it with `draftsmith generate`, or export an eagle3 drafter"
            )
        if fmt == "sglang":
            return sglang_eagle3_layout(self, speculative_tokens or self.config.depth)
        return speculators_eagle3_layout(self, verifier, speculative_tokens or self.config.depth)

    def llamacpp_layout(self, speculative_tokens: int | None) -> LlamaCppDraft:
        if self.config.feature_sampler or self.config.partial_alignment:
            raise EngineLayoutError(
                "FSPAD-3 has no gguf layout: llama.cpp's eagle3 graph has no feature sampler and feeds back the "
                "token head's own input (no partial alignment); serve it with `draftsmith generate`, or export "
                "an eagle3 drafter"
            )
        return llamacpp_eagle3_layout(self, speculative_tokens or self.config.depth)


# How the engines' EAGLE-3 models take this drafter: vLLM reads ``norm_before_residual`` (true here:
# the residual starts from the normed hidden) and defaults it to true, the speculators library to false,
# so it is always written. SGLang's LlamaForCausalLMEagle3 (sgl-project/sglang@03d5a77) has no such
# switch and starts the residual from the un-normed hidden: it would serve a slightly different drafter.
SGLANG_RESIDUAL_CAVEAT = (
    "SGLang's LlamaForCausalLMEagle3 starts the residual before hidden_norm (norm_before_residual=false) and "
    "has no switch for it; this drafter was trained with true (vLLM's default), so SGLang would draft with a "
    "slightly different model (outputs stay lossless, acceptance may drop). Not run here."
)


def _eagle3_tensors(model: Eagle3Model, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The drafter's weights under an engine's names (``layer.*`` -> ``layer_prefix*``), float32 on CPU."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("layer."):
            name = layer_prefix + name[len("layer.") :]
        tensors[name] = engine_tensor(tensor)
    return tensors


def speculators_eagle3_layout(model: Eagle3Model, verifier: Verifier, speculative_tokens: int) -> EngineExport:
    """vLLM's ``speculators`` EAGLE-3 layout (what ``speculators`` 0.9.0 writes, vLLM 0.32 loads):
    ``Eagle3DraftModel`` with ``embed_tokens`` (the target's, copied: vLLM reads the drafter's own),
    ``fc``, ``layers.0.*``, ``norm``, ``lm_head`` and, for a reduced vocabulary, ``d2t``/``t2d`` (vLLM
    has no place for them when the draft vocabulary is the whole one)."""
    config = model.config
    check_ascending_aux_layers(config.aux_layer_ids)
    vocab, draft_vocab = int(config.layer["vocab_size"]), int(config.draft_vocab_size)
    tensors = _eagle3_tensors(model, "layers.0.")
    embedding = verifier.embedding()
    if tuple(embedding.shape) != (vocab, config.hidden_size):
        raise EngineLayoutError(
            f"the verifier's embedding is {tuple(embedding.shape)}, the drafter expects "
            f"({vocab}, {config.hidden_size}); pass --verifier with the target it was trained for"
        )
    tensors["embed_tokens.weight"] = embedding.float().contiguous()
    if draft_vocab == vocab:
        tensors.pop("d2t"), tensors.pop("t2d")
    exported = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_residual": True,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "speculators_config": speculators_block("eagle3", verifier, speculative_tokens),
        "transformer_layer_config": llama_layer_config(config.layer),
    }
    return EngineExport(
        config=exported,
        tensors=tensors,
        required=SPECULATORS_REQUIRED + EAGLE3_SPECULATORS_REQUIRED,
        required_tensors=("embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight")
        + (("d2t", "t2d") if draft_vocab < vocab else ()),
        speculative_tokens=speculative_tokens,
    )


def sglang_eagle3_layout(model: Eagle3Model, speculative_tokens: int) -> EngineExport:
    """SGLang's ``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``, ``lm_head`` over the draft
    vocabulary, ``d2t``, ``t2d``, no embedding (SGLang shares the target's). SGLang names the fused
    states as layer *outputs*: its ids are vLLM's minus one."""
    config = model.config
    if min(config.aux_layer_ids) < 1:
        raise EngineLayoutError(
            f"SGLang names fused states as layer outputs and cannot take the embedding (aux layer 0) of "
            f"drafter.aux_layer_ids={config.aux_layer_ids}"
        )
    exported = {
        **llama_layer_config(config.layer),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": int(config.draft_vocab_size),
        "target_hidden_size": config.hidden_size,
        "tie_word_embeddings": False,  # SGLang would otherwise use the embedding as the draft lm_head
        "norm_before_residual": True,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layer_ids]},
    }
    return EngineExport(
        config=exported,
        tensors=_eagle3_tensors(model, "midlayer."),
        required=SGLANG_EAGLE3_REQUIRED,
        required_tensors=("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"),
        speculative_tokens=speculative_tokens,
        caveat=SGLANG_RESIDUAL_CAVEAT,
    )


# llama.cpp's eagle3 tensors (src/models/eagle3.cpp) by this drafter's parameter names; ``d2t`` is written
# as absolute target ids and ``t2d`` (target -> draft) has no use there.
LLAMACPP_EAGLE3_TENSORS = {
    "fc.weight": "fc.weight",
    "layer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# What llama.cpp reads without a default (llama_model_base::load_hparams and the eagle3 loader).
LLAMACPP_EAGLE3_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "target_layers",
    "target_hidden_size",
    "norm_before_residual",
)


def llamacpp_eagle3_layout(model: Eagle3Model, speculative_tokens: int) -> LlamaCppDraft:
    """llama.cpp's ``eagle3`` GGUF: one Llama layer (q/k rows in ggml's RoPE order), ``fc``, ``output``
    over the draft vocabulary and ``d2t`` as absolute target ids (absent for the whole vocabulary, which
    llama.cpp then assumes); no token embedding (llama.cpp reads the target's). ``norm_before_residual``
    is true, as this drafter trains."""
    config = model.config
    layer = llama_layers(config.layer, 1)
    rope_type = (layer.rope_parameters or {}).get("rope_type", "default")
    unsupported = {
        "len(drafter.aux_layer_ids) != 3": len(config.aux_layer_ids) != 3,
        f"the activation {layer.hidden_act}": layer.hidden_act != "silu",
        f"RoPE scaling {rope_type!r}": rope_type != "default",
        "attention or MLP biases": bool(layer.attention_bias or layer.mlp_bias),
    }
    for what, present in unsupported.items():
        if present:
            raise EngineLayoutError(f"llama.cpp's eagle3 graph cannot run this drafter: {what}")
    heads, kv_heads = layer.num_attention_heads, layer.num_key_value_heads
    head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // heads
    state = model.state_dict()
    unmapped = sorted(set(state) - set(LLAMACPP_EAGLE3_TENSORS) - {"d2t", "t2d"})
    if unmapped:
        raise EngineLayoutError(f"llama.cpp's eagle3 graph has no place for {', '.join(unmapped)}")
    tensors = {gguf_name: state[name] for name, gguf_name in LLAMACPP_EAGLE3_TENSORS.items()}
    tensors["blk.0.attn_q.weight"] = llama_rope_rows(tensors["blk.0.attn_q.weight"], heads)
    tensors["blk.0.attn_k.weight"] = llama_rope_rows(tensors["blk.0.attn_k.weight"], kv_heads)
    vocab = int(config.layer["vocab_size"])
    if int(config.draft_vocab_size) < vocab:
        tensors["d2t"] = model.draft_token_ids().to(torch.int64)
    metadata = {
        "context_length": int(layer.max_position_embeddings),
        "embedding_length": int(layer.hidden_size),
        "block_count": 1,
        "feed_forward_length": int(layer.intermediate_size),
        "attention.head_count": int(heads),
        "attention.head_count_kv": int(kv_heads),
        "attention.key_length": int(head_dim),
        "attention.value_length": int(head_dim),
        "attention.layer_norm_rms_epsilon": float(layer.rms_norm_eps),
        "rope.freq_base": float(layer.rope_parameters["rope_theta"]),
        "rope.dimension_count": int(head_dim),
        "vocab_size": vocab,
        "target_layers": [int(i) for i in config.aux_layer_ids],
        "target_hidden_size": int(config.hidden_size),
        "norm_before_residual": True,
        "norm_before_fc": False,
    }
    return LlamaCppDraft(
        architecture="eagle3",
        metadata=metadata,
        tensors=tensors,
        target_vocab_size=vocab,
        target_hidden_size=int(config.hidden_size),
        target_layers=list(config.aux_layer_ids),
        speculative_tokens=speculative_tokens,
        required_keys=LLAMACPP_EAGLE3_KEYS,
        required_tensors=tuple(LLAMACPP_EAGLE3_TENSORS.values()),
    )


class Eagle3Head:
    """The drafter's own token head for :class:`EagleTreeDrafter`: logits over the draft vocabulary
    and their columns' target ids (the counterpart of :class:`~draftsmith.drafters.vocab.DraftHead`)."""

    def __init__(self, model: Eagle3Model) -> None:
        self.model = model

    def __call__(self, token_features: torch.Tensor) -> torch.Tensor:
        return self.model.logits(token_features)

    def token_ids(self, columns: torch.Tensor) -> torch.Tensor:
        return self.model.token_ids(columns)

    def runtime_module(self) -> None:
        """None: the head is one of the drafter's own modules already."""
        return None
