"""What serving engines load: the parts every family's engine layout shares, and their checks.

A family writes its own layout in its :meth:`DrafterModel.engine_layout` hook (EAGLE: vLLM's EAGLE-1
``EagleLlamaForCausalLM``; Medusa: vLLM's ``MedusaModel``; EAGLE-3: vLLM ``speculators`` and SGLang;
DFlash: vLLM's ``DFlashDraftModel``);
this module holds what those share: the :class:`Verifier` an export is made for, the decoder-layer
config engines read, the ``speculators_config`` block, and :func:`check_engine_export`, which refuses
a config missing a field the engine requires instead of writing it.

Formats (``draftsmith export --format``): ``vllm`` is whatever vLLM loads for the family,
``speculators`` the layout vLLM's ``speculators`` library writes (EAGLE-3 only in vLLM 0.32, which
dropped the speculators EAGLE-1 type), ``sglang`` SGLang's EAGLE-3 layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from draftsmith.core.errors import DraftsmithError
from draftsmith.drafters import ttt_attention

ENGINE_FORMATS = ("vllm", "speculators", "sglang")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 config this export follows (vLLM 0.32 loads it)

# What vLLM 0.32 reads from a speculators config.json before anything else
# (SpeculatorsConfig.validate_speculators_config; a missing one is "Invalid speculators config structure").
SPECULATORS_REQUIRED: tuple[tuple[str | int, ...], ...] = (
    ("speculators_model_type",),
    ("speculators_config", "verifier", "name_or_path"),
    ("speculators_config", "proposal_methods", 0, "speculative_tokens"),
    ("transformer_layer_config",),
)
# EAGLE-3 fields vLLM reads with a default that would silently change the model when absent:
# ``norm_before_residual`` defaults to true in vLLM and false in the speculators library.
EAGLE3_SPECULATORS_REQUIRED: tuple[tuple[str | int, ...], ...] = (
    ("draft_vocab_size",),
    ("eagle_aux_hidden_state_layer_ids",),
    ("norm_before_residual",),
    ("transformer_layer_config", "hidden_size"),
    ("transformer_layer_config", "vocab_size"),
)
SGLANG_EAGLE3_REQUIRED: tuple[tuple[str | int, ...], ...] = (
    ("architectures",),
    ("eagle_config", "eagle_aux_hidden_state_layer_ids"),
    ("draft_vocab_size",),
    ("vocab_size",),
    ("hidden_size",),
    ("num_hidden_layers",),
)

# vLLM's dflash method (DFlashDraftModel): without mask_token_id it refuses to start; without
# target_layer_ids it would fuse every target layer; causal is written so that no default decides it.
VLLM_DFLASH_REQUIRED: tuple[tuple[str | int, ...], ...] = (
    ("architectures",),
    ("dflash_config", "mask_token_id"),
    ("dflash_config", "target_layer_ids"),
    ("dflash_config", "causal"),
)


class EngineLayoutError(DraftsmithError, ValueError):
    """A drafter (or an option of it) that a serving engine's layout cannot express, or an export
    missing what the engine requires."""


@dataclass(frozen=True)
class Verifier:
    """The target an engine export drafts for: the name the engine opens it by, and (when the export
    must carry part of the target, e.g. EAGLE-3's token embedding for vLLM) its weights."""

    name_or_path: str
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    embed_tokens: Callable[[], torch.Tensor] | None = field(default=None, compare=False)

    def embedding(self) -> torch.Tensor:
        if self.embed_tokens is None:
            raise EngineLayoutError(
                f"this layout carries the target's token embedding, but {self.name_or_path!r} is not a local "
                "model directory; pass --verifier DIR (the target's safetensors directory)"
            )
        return self.embed_tokens()


@dataclass
class EngineExport:
    """``config.json``, the tensors of ``model.safetensors`` and any other files (by name) in an engine's layout."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    files: dict[str, bytes] = field(default_factory=dict)  # e.g. DFlash's mask_embedding.pt
    required: tuple[tuple[str | int, ...], ...] = ()  # config paths the engine cannot do without
    required_tensors: tuple[str, ...] = ()
    speculative_tokens: int = 0  # tokens the engine drafts per step when serving it (``bench`` vllm=DIR)
    caveat: str = ""  # what the engine is known to do differently with it, shown by ``draftsmith export``


def decoder_config(layer: dict[str, Any], model_type: str, num_hidden_layers: int, **extra: Any) -> dict[str, Any]:
    """A drafter's decoder-layer settings (a target-shaped ``layer``) as engines read them. The activation
    and RoPE settings are the ones the drafter's Llama-shaped layers compute with: a target of another
    architecture (Gemma-3) may name its activation otherwise, which leaves a Llama layer on its default,
    and give one RoPE per layer type, nested entries a Llama layer ignores and engines cannot read."""
    config = {key: value for key, value in layer.items() if not key.startswith("_")}
    computed = llama_layers(layer, 1)
    config["rope_parameters"] = computed.rope_parameters
    config["hidden_act"] = computed.hidden_act
    config.update(model_type=model_type, num_hidden_layers=num_hidden_layers, **extra)
    return config


def llama_layers(layer: dict[str, Any], num_hidden_layers: int) -> LlamaConfig:
    """The config of a drafter's Llama-shaped decoder layers built from a target-shaped ``layer``. A target
    with one RoPE per layer type (Gemma-3: ``full_attention`` / ``sliding_attention``) gives nested entries a
    Llama layer ignores (it computes with the top-level ones, Llama's defaults where there are none):
    dropped here, so transformers does not warn about them at every load and the config says what runs."""
    settings = {key: value for key, value in layer.items() if not key.startswith("_")}
    rope = settings.get("rope_parameters")
    if isinstance(rope, dict):
        flat = {key: value for key, value in rope.items() if not isinstance(value, dict)}
        settings["rope_parameters"] = flat or None
    config = LlamaConfig(**settings, num_hidden_layers=num_hidden_layers)
    config._attn_implementation = ttt_attention.ATTENTION  # SDPA, but for the training-time test's masks
    return config


# The decoder-layer settings every target-shaped ``layer`` section holds, each a whole number >= 1.
LAYER_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")


def layer_settings_problem(layer: Any) -> str | None:
    """Why a drafter config's ``layer`` section (the target's decoder-layer settings, copied into a recipe's
    drafter and its export's config.json) cannot build a decoder layer, naming the key, or None: the one
    check a training run, an export and every load go through before a module is built."""
    if not isinstance(layer, dict) or not layer:
        return "it has no layer section (the target's decoder-layer settings)"
    for key in LAYER_SIZES:
        value = layer.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"layer.{key} must be a whole number >= 1, got {value!r}"
    heads, kv_heads = layer["num_attention_heads"], layer["num_key_value_heads"]
    if layer["hidden_size"] % heads or heads % kv_heads:
        return (
            f"layer.hidden_size {layer['hidden_size']}, num_attention_heads {heads} and num_key_value_heads "
            f"{kv_heads} do not fit: the hidden size must be a multiple of the heads, the heads of the key-value heads"
        )
    head_dim = layer.get("head_dim", layer["hidden_size"] // heads)  # absent in a config: Llama's default
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        return f"layer.head_dim must be an even whole number (rotary embeddings turn pairs), got {head_dim!r}"
    eps = layer.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        return f"layer.rms_norm_eps must be a finite number > 0, got {eps!r}"
    act = layer.get("hidden_act", "silu")
    if not isinstance(act, str) or act not in ACT2FN:
        return f"layer.hidden_act {act!r} is no activation transformers knows"
    rope = layer.get("rope_parameters")
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
        return f"layer.rope_parameters.rope_type {rope_type!r} is none of default, {', '.join(ROPE_INIT_FUNCTIONS)}"
    return None


def llama_layer_config(layer: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """One Llama decoder layer's settings as engines read them (``model_type: llama``, one layer)."""
    return decoder_config(layer, "llama", 1, **extra)


def engine_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as an export file holds it: detached, on the CPU, contiguous, floating point as float32."""
    tensor = tensor.detach().cpu().contiguous()
    return tensor.float() if tensor.is_floating_point() else tensor


def check_ascending_aux_layers(aux_layer_ids: list[int]) -> None:
    """vLLM concatenates the target's states in layer order whatever order the config lists them in, so an
    EAGLE-3 ``fc`` trained on another order would read each block as another layer's state."""
    check_distinct_aux_layers(aux_layer_ids)
    if list(aux_layer_ids) != sorted(aux_layer_ids):
        raise EngineLayoutError(
            f"vLLM feeds the drafter the target's states in ascending layer order, so drafter.aux_layer_ids="
            f"{list(aux_layer_ids)} cannot be served as trained; train with them in ascending order"
        )


def check_distinct_aux_layers(aux_layer_ids: list[int]) -> None:
    """vLLM keeps one state per target layer (a set), so a layer named twice has no column block to read."""
    if len(set(aux_layer_ids)) < len(aux_layer_ids):
        raise EngineLayoutError(
            f"vLLM collects each layer's state once, so drafter.aux_layer_ids={aux_layer_ids} "
            "(a layer named twice) cannot be served; train with distinct layers"
        )


def speculators_block(algorithm: str, verifier: Verifier, speculative_tokens: int) -> dict[str, Any]:
    """The ``speculators_config`` entry: the verifier and one greedy proposal method."""
    if speculative_tokens < 1:
        raise EngineLayoutError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": int(speculative_tokens),
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "verifier": {"name_or_path": verifier.name_or_path, "architectures": list(verifier.architectures)},
    }


def missing_field(config: dict[str, Any], path: tuple[str | int, ...]) -> bool:
    node: Any = config
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return True
    return node is None


def check_engine_export(export: EngineExport, fmt: str) -> None:
    """Refuse an export that lacks a config field or tensor its engine requires (one line naming it)."""
    for path in export.required:
        if missing_field(export.config, path):
            name = ".".join(str(key) if isinstance(key, str) else f"[{key}]" for key in path).replace(".[", "[")
            raise EngineLayoutError(f"the {fmt} export lacks {name}, which the engine requires; this is a bug")
    absent = [name for name in export.required_tensors if name not in export.tensors]
    if absent:
        raise EngineLayoutError(f"the {fmt} export lacks the tensor(s) {', '.join(absent)}; this is a bug")
