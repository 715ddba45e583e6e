"""LoRA adapters on a Llama-architecture target through ``peft``, for the families that adapt the target
(Speculative Streaming, Medusa-2).

The adapter weights are the drafter's own parameters (a :class:`TargetLora`, saved with the drafter);
:meth:`TargetLora.inject` makes peft's LoRA layers in the target use them. They are active only inside
:meth:`TargetLora.enabled`, so the shared target object stays the original model for every other user
(the baseline, other drafters, the self-distillation teacher): no second copy of the target is needed.
:meth:`TargetLora.save_peft` / :meth:`TargetLora.load_peft` read and write peft's own adapter format
(``adapter_config.json`` + ``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from draftsmith.core.drafting import INERT_OUTSIDE_OWNER
from draftsmith.core.weight_copies import CopySource
from draftsmith.drafters.base import DrafterConfig

DEFAULT_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Target config keys the LoRA shapes (and the drafters built on them) depend on; recorded in the
# drafter's config so that a mismatched target is refused.
TARGET_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
PEFT_CONFIG_NAME = "adapter_config.json"
PEFT_WEIGHTS_NAME = "adapter_model.safetensors"
_adapter_names = itertools.count()


def target_summary(target_config: PretrainedConfig) -> dict[str, Any]:
    """The :data:`TARGET_KEYS` of a target config (``head_dim`` filled in when the config leaves it out)."""
    source = target_config.to_dict()
    target = {key: source.get(key) for key in TARGET_KEYS}
    target["head_dim"] = target["head_dim"] or source["hidden_size"] // source["num_attention_heads"]
    return target


def check_target(expected: dict[str, Any], target_model: nn.Module, what: str, error: type[Exception]) -> None:
    """Refuse a target whose config differs from the recorded ``expected`` summary."""
    actual = target_model.config.to_dict()
    actual["head_dim"] = actual.get("head_dim") or actual["hidden_size"] // actual["num_attention_heads"]
    for key in TARGET_KEYS:
        if expected.get(key) is not None and actual.get(key) != expected[key]:
            raise error(
                f"this {what} was built for a target with {key}={expected[key]}, "
                f"the given one has {actual.get(key)}; use the target it was trained for"
            )


def check_lora_options(
    target: dict[str, Any], rank: int, modules: Sequence[str], layers: Sequence[int] | None, error: type[Exception]
) -> None:
    """Refuse LoRA options that cannot fit ``target``, naming the recipe key to change."""
    num_layers = int(target["num_hidden_layers"])
    if rank < 0:
        raise error(f"drafter.lora_rank must be >= 0, got {rank}")
    unknown = sorted(set(modules) - set(ATTENTION_MODULES + MLP_MODULES))
    if unknown:
        raise error(
            f"drafter.lora_target_modules has unknown modules {unknown}; "
            f"choose from {list(ATTENTION_MODULES + MLP_MODULES)}"
        )
    if layers is not None and any(not 0 <= i < num_layers for i in layers):
        raise error(f"drafter.lora_layers must be layer indices in 0..{num_layers - 1}")


def adapted_layers(target: dict[str, Any], layers: Sequence[int] | None) -> list[int]:
    """The decoder layers that carry adapters (``None`` = every layer)."""
    return list(range(int(target["num_hidden_layers"]))) if layers is None else [int(i) for i in layers]


def lora_shape(target: dict[str, Any], module: str) -> tuple[int, int]:
    """(in_features, out_features) of a target projection."""
    h, d = int(target["hidden_size"]), int(target["head_dim"])
    heads, kv_heads = int(target["num_attention_heads"]), int(target["num_key_value_heads"])
    inter = int(target["intermediate_size"])
    return {
        "q_proj": (h, heads * d),
        "k_proj": (h, kv_heads * d),
        "v_proj": (h, kv_heads * d),
        "o_proj": (heads * d, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }[module]


@dataclass(frozen=True)
class LoraOptions:
    """A LoRA on the target: rank, alpha, which projections (``q_proj`` ... ``down_proj``) of which
    decoder layers (None = every layer). Recipes set them as ``drafter.lora_rank`` and so on."""

    rank: int = 32
    alpha: float = 64.0
    target_modules: tuple[str, ...] = DEFAULT_LORA_MODULES
    layers: tuple[int, ...] | None = None


class LoraPair(nn.Module):
    """One adapter's ``A`` (in -> r) and ``B`` (r -> out), initialised as peft does (B = 0: no change)."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.A = nn.Linear(in_features, rank, bias=False)
        self.B = nn.Linear(rank, out_features, bias=False)
        nn.init.kaiming_uniform_(self.A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.B.weight)


def lora_key(layer: int, module: str) -> str:
    return f"layers_{layer}_{module}"


def _parent_name(module: str) -> str:
    return "self_attn" if module in ATTENTION_MODULES else "mlp"


class TargetLora(nn.ModuleDict):
    """The LoRA pairs of one adapter, keyed ``layers_{i}_{module}``; empty when ``rank`` is 0.

    A ``ModuleDict`` itself (not a module holding one), so a drafter's ``lora.layers_3_v_proj.A.weight``
    state-dict keys, and the checkpoints written with them, stay as they were before this was shared."""

    def __init__(self, target: dict[str, Any], options: LoraOptions) -> None:
        rank, alpha, target_modules = options.rank, options.alpha, options.target_modules
        indices = adapted_layers(target, options.layers)
        pairs = {
            lora_key(layer, module): LoraPair(*lora_shape(target, module), int(rank))
            for layer in indices
            for module in target_modules
        }
        super().__init__(pairs if rank else {})
        self.rank, self.alpha = int(rank), float(alpha)
        self.target_modules, self.layer_indices = list(target_modules), indices
        self.adapter_name: str | None = None
        self._peft_layers: list[nn.Module] = []  # peft's LoRA layers in the target (not submodules of ours)
        self._enabled_depth = 0  # nested enabled() blocks (a checkpointed recompute enters its own)

    def peft_config(self, base_model: str | None = None, inference_mode: bool = False) -> Any:
        """The ``peft.LoraConfig`` of this adapter."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            target_modules=list(self.target_modules),
            layers_to_transform=list(self.layer_indices),
            layers_pattern="layers",
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=base_model,
            inference_mode=inference_mode,
        )

    def inject(self, target_model: nn.Module, prefix: str) -> None:
        """Add peft LoRA layers to ``target_model`` (in place) whose weights are this module's pairs,
        inactive until :meth:`enabled`. The adapter name is ``prefix`` + a process-unique number, so
        several drafters may adapt one target."""
        from peft import inject_adapter_in_model

        if not len(self):
            return
        if self.adapter_name is not None:
            raise RuntimeError("this LoRA is already injected into a target")
        self.adapter_name = f"{prefix}{next(_adapter_names)}"
        inject_adapter_in_model(
            self.peft_config(), target_model, adapter_name=self.adapter_name, low_cpu_mem_usage=True
        )
        for layer in self.layer_indices:
            decoder_layer = target_model.model.layers[layer]
            for module in self.target_modules:
                peft_layer = getattr(getattr(decoder_layer, _parent_name(module)), module)
                pair = self[lora_key(layer, module)]
                # peft's modules become ours: the weights live (and are saved) in this module.
                peft_layer.lora_A[self.adapter_name] = pair.A
                peft_layer.lora_B[self.adapter_name] = pair.B
                self._peft_layers.append(peft_layer)
        self.set_enabled(False)

    def set_enabled(self, enabled: bool) -> None:
        # peft's switches also set requires_grad on the adapter weights; trainability is the drafter's
        # own business (the optimizer and autograd must see the LoRA weights as trainable throughout).
        trainable = [p.requires_grad for p in self.parameters()]
        for peft_layer in self._peft_layers:
            if enabled:
                peft_layer.set_adapter(self.adapter_name)
            peft_layer.enable_adapters(enabled)
        for parameter, flag in zip(self.parameters(), trainable):
            parameter.requires_grad_(flag)

    @contextmanager
    def enabled(self) -> Iterator[None]:
        """The adapters active in the target for the duration of the block; blocks nest (the outermost
        one switches them off again)."""
        if not self._enabled_depth:
            self.set_enabled(True)
        self._enabled_depth += 1
        try:
            yield
        finally:
            self._enabled_depth -= 1
            if not self._enabled_depth:
                self.set_enabled(False)

    # ---- peft's saved format -------------------------------------------------------------------
    def _peft_name(self, key: str, part: str) -> str:
        layer, module = key.removeprefix("layers_").split("_", 1)
        return f"base_model.model.model.layers.{layer}.{_parent_name(module)}.{module}.lora_{part}.weight"

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter under the names ``PeftModel.save_pretrained`` writes for a ``LlamaForCausalLM``."""
        return {
            self._peft_name(key, part): getattr(pair, part).weight.detach().contiguous().cpu()
            for key, pair in self.items()
            for part in ("A", "B")
        }

    def save_peft(self, directory: str | Path, base_model: str | None = None) -> None:
        """``adapter_config.json`` + ``adapter_model.safetensors``: ``PeftModel.from_pretrained(target, directory)``
        gives the adapted model without draftsmith."""
        from safetensors.torch import save_file

        directory = Path(directory)
        self.peft_config(base_model, inference_mode=True).save_pretrained(str(directory))
        save_file(self.peft_state_dict(), str(directory / PEFT_WEIGHTS_NAME), metadata={"format": "pt"})

    def load_peft(self, directory: str | Path, error: type[Exception] = ValueError) -> None:
        """Read an adapter written by :meth:`save_peft`; it must have exactly this module's shape."""
        from safetensors.torch import load_file

        directory = Path(directory)
        saved = json.loads((directory / PEFT_CONFIG_NAME).read_text())
        mine = {"r": self.rank, "lora_alpha": self.alpha, "target_modules": sorted(self.target_modules)}
        found = {"r": saved.get("r"), "lora_alpha": saved.get("lora_alpha")}
        found["target_modules"] = sorted(saved.get("target_modules") or [])
        if found != mine:
            raise error(f"{directory}/{PEFT_CONFIG_NAME} holds {found}, its config.json says {mine}; export it again")
        state = load_file(str(directory / PEFT_WEIGHTS_NAME))
        expected = self.peft_state_dict()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            raise error(f"{directory}/{PEFT_WEIGHTS_NAME} does not match the adapter in config.json; export it again")
        with torch.no_grad():
            for key, pair in self.items():
                for part in ("A", "B"):
                    getattr(pair, part).weight.copy_(state[self._peft_name(key, part)])


class AdaptedTarget(nn.Module):
    """The target with a LoRA active in every forward: the model the runtime verifies with
    (:meth:`Drafter.verifier_model`) for a drafter whose served model is the adapted target. Same call
    signature as the target."""

    def __init__(self, target_model: nn.Module, lora: TargetLora) -> None:
        super().__init__()
        self.target = target_model
        self.lora = lora
        self.config = target_model.config  # the runtime sizes its KV cache and context limit from it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.lora.enabled():
            return self.target(*args, **kwargs)


# The hook dictionaries of an ``nn.Module`` a private copy gets its own of (torch's attribute names).
_HOOK_DICTS = (
    "_backward_pre_hooks",
    "_backward_hooks",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def mergeable(target_model: nn.Module) -> bool:
    """Whether a private copy can stand for ``target_model``: not dispatched by accelerate, whose hooks
    patch each module's own ``forward`` (a copy would call the original's)."""
    return not any(hasattr(module, "_hf_hook") or "forward" in vars(module) for module in target_model.modules())


def shared_copy(module: nn.Module, substitute: Callable[[nn.Module], nn.Module | None]) -> nn.Module:
    """A copy of ``module``'s tree that shares every parameter and buffer but has its own submodules
    (``substitute`` returns a replacement for one, or None) and hooks. Hooks marked
    :data:`INERT_OUTSIDE_OWNER` (another drafter's, which act only in that drafter's own forward of the
    original) are left out of the copy."""
    replacement = substitute(module)
    if replacement is not None:
        return replacement
    clone = copy.copy(module)
    state = clone.__dict__
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    state["_modules"] = {
        name: None if child is None else shared_copy(child, substitute) for name, child in module._modules.items()
    }
    for name in _HOOK_DICTS:
        hooks = getattr(module, name, None)
        if isinstance(hooks, dict):
            state[name] = OrderedDict(
                (key, hook) for key, hook in hooks.items() if not getattr(hook, INERT_OUTSIDE_OWNER, False)
            )
    return clone


class MergedAdapter:
    """The target with a LoRA merged into its weights, as peft's ``merge_and_unload`` makes it
    (``W + B @ A * scaling``, peft's own delta), for serving: a plain model of the target's class, so
    the runtime's fast paths (direct forward, C++ layers, packed GEMM, screened head) apply, which
    peft's wrapped linears keep out. A private copy, not an in-place merge: the shared target stays
    the original for every other user, and only the adapted projections take new memory (every other
    weight is shared, so it sees in-place changes to them). The copy is remade when a LoRA weight or
    an adapted base weight is changed in place or replaced; a replaced shared parameter is not tracked."""

    def __init__(self, target_model: nn.Module, lora: TargetLora) -> None:
        self.target, self.lora = target_model, lora
        self._model: nn.Module | None = None
        self._sources: list[tuple[nn.Module, str, CopySource]] = []

    def model(self) -> nn.Module:
        """The merged copy, remade if a weight it was made from has changed since."""
        if self._model is None or not self._sources_unchanged():
            self._model = self._merge()
        return self._model

    def _sources_unchanged(self) -> bool:
        return all(source.still(owner._parameters[name]) for owner, name, source in self._sources)

    @torch.no_grad()
    def _merge(self) -> nn.Module:
        from peft.tuners.lora import LoraLayer

        sources: list[tuple[nn.Module, str, CopySource]] = []
        adapter = self.lora.adapter_name

        def substitute(module: nn.Module) -> nn.Module | None:
            if not isinstance(module, LoraLayer):
                return None
            base = module.get_base_layer()
            linear = shared_copy(base, lambda _: None)
            if adapter in module.lora_A:
                pieces = (base, module.lora_A[adapter], module.lora_B[adapter])
                sources.extend((owner, "weight", CopySource(owner.weight)) for owner in pieces)
                merged = base.weight + module.get_delta_weight(adapter)  # what peft's unsafe merge adds
                linear._parameters["weight"] = nn.Parameter(merged, requires_grad=False)
            return linear

        model = shared_copy(self.target, substitute)
        self._sources = sources
        return model


class AdaptsTargetConfig(DrafterConfig):
    """Config of a family that puts a LoRA on the target (Medusa-2, Speculative Streaming): the
    target's shape (``target``, recorded so that another target is refused) and the LoRA's options."""

    DERIVED = ("target",)
    # The target architectures (``model_type``) this family adapts: the adapter's module names (peft
    # format) are Llama's ``model.layers.N.self_attn.q_proj`` ..., which Gemma-3's decoder layers share.
    ADAPTS: tuple[str, ...] = ("llama", "gemma3_text")

    def __init__(
        self,
        target: dict[str, Any] | None = None,
        lora_rank: int = 32,
        lora_alpha: float = 64.0,
        lora_target_modules: list[str] | None = None,
        lora_layers: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        self.target = dict(target or {})
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_target_modules = list(lora_target_modules or DEFAULT_LORA_MODULES)
        self.lora_layers = None if lora_layers is None else [int(i) for i in lora_layers]
        super().__init__(**kwargs)

    @classmethod
    def from_target_config(cls, target_config: PretrainedConfig) -> dict[str, Any]:
        return {**super().from_target_config(target_config), "target": target_summary(target_config)}

    def check(self) -> None:
        super().check()
        kind = self.target.get("model_type")
        if kind is not None and kind not in self.ADAPTS:
            raise self.error(
                f"{self.drafter_family}'s LoRA fits {' and '.join(self.ADAPTS)} targets; this one is {kind!r}"
            )
        check_lora_options(self.target, self.lora_rank, self.lora_target_modules, self.lora_layers, self.error)

    def lora_options(self) -> LoraOptions:
        layers = None if self.lora_layers is None else tuple(self.lora_layers)
        return LoraOptions(self.lora_rank, self.lora_alpha, tuple(self.lora_target_modules), layers)


class AdaptsTargetMixin:
    """For drafter models that adapt the target with a LoRA and run inside it. The target is held
    outside the module tree (its weights are never trained, moved or saved with the drafter); the
    LoRA is active only inside :meth:`adapted`, so the shared target object stays the original model
    for every other user (the baseline, other drafters, the self-distillation teacher)."""

    config: AdaptsTargetConfig
    lora: TargetLora
    adapter_prefix: str = "adapter"  # peft adapter names: prefix + a process-unique number
    runs_inside_target = True

    def _init_target_lora(self) -> None:
        self.lora = TargetLora(self.config.target, self.config.lora_options())
        self.__dict__["_target"] = None

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError(
                f"attach_target(target_model) first: a {self.config.drafter_family} model runs inside it"
            )
        return self._target

    def attach_target(self, target_model: nn.Module) -> None:
        """Inject this model's LoRA into ``target_model`` (in place, inactive outside :meth:`adapted`)."""
        if self._target is not None:
            raise RuntimeError(f"this {self.config.drafter_family} model is already attached to a target")
        check_target(self.config.target, target_model, f"{self.config.drafter_family} model", self.config.error)
        self.lora.inject(target_model, prefix=self.adapter_prefix)
        self.__dict__["_target"] = target_model
        self.to(target_model.get_input_embeddings().weight.device)

    def bind_target(self, target_model: nn.Module) -> None:
        """Attach to ``target_model`` unless already attached to it (serving)."""
        if self._target is None:
            self.attach_target(target_model)
        elif self._target is not target_model:
            raise self.config.error(f"this {self.config.drafter_family} model is attached to another target model")

    @contextmanager
    def adapted(self) -> Iterator[nn.Module]:
        """The target with this model's LoRA active: the served model (e.g. for ``generate``)."""
        target = self.target
        with self.lora.enabled():
            yield target

    @torch.no_grad()
    def original_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, h) last features (the input of ``lm_head``) of the target with the adapters off: the
        self-distillation teacher, from the same target object (no second copy), without gradient.
        Features, not (B, T, V) logits: the loss projects them a chunk of rows at a time."""
        return self.target.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def next_token_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The target's ``lm_head`` (never adapted) over last features (..., h) -> (..., V)."""
        return self.target.get_output_embeddings()(features)


class VerifiesAdaptedTarget:
    """Runtime-drafter mixin for the LoRA families: output is lossless with respect to the adapted
    target, which the runtime verifies with and ``bench`` takes as reference and baseline."""

    adapting: AdaptsTargetMixin
    verifier: nn.Module

    def verifier_model(self) -> nn.Module:
        return self.verifier

    def reference_model(self) -> AbstractContextManager[nn.Module]:
        return self.adapting.adapted()


class ServesMergedAdapter(VerifiesAdaptedTarget):
    """Runtime-drafter mixin for a LoRA family whose verification is a plain forward of the adapted
    target (Medusa-2): it serves the target with the LoRA merged (:class:`MergedAdapter`), which is then
    also the reference, so output is identical to what peft's ``merge_and_unload`` model decodes. A target
    a copy cannot stand for (:func:`mergeable`) is served through peft's wrapped linears instead."""

    merged: MergedAdapter | None

    def serve_merged(self) -> None:
        target = self.adapting.target
        self.merged = MergedAdapter(target, self.adapting.lora) if mergeable(target) else None

    def served_model(self) -> nn.Module | None:
        return None if self.merged is None else self.merged.model()

    def verifier_model(self) -> nn.Module | None:
        return super().verifier_model() if self.merged is None else None

    def reference_model(self) -> AbstractContextManager[nn.Module]:
        return super().reference_model() if self.merged is None else nullcontext(self.merged.model())
