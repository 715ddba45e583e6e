"""Medusa-2: Medusa heads trained jointly with a LoRA on the target (through ``peft``).

The served model is the LoRA-adapted target: its features feed the heads and its logits are what
verification compares against, so decoding is lossless with respect to the adapted model (not the
original). The loss (``train.losses.medusa2_loss``) keeps the adapted model close to the original
by self-distillation: a KL against the same target with the adapters switched off, no second copy.

- The heads are a :class:`~draftsmith.drafters.medusa.MedusaHeads` (same options, trees, drafting);
  the adapter is a :class:`~draftsmith.drafters.lora.TargetLora`, active only inside :meth:`Medusa2Model.forward`,
  :meth:`Medusa2Model.adapted` and the runtime's serving model.
- Exported (``draftsmith export``): ``config.json`` + ``model.safetensors`` holding the heads in the
  Medusa-1 layout (``medusa_head.{k}...``), and the adapter in peft's format (``adapter_config.json`` +
  ``adapter_model.safetensors``, named after the target), which ``PeftModel.from_pretrained`` loads.
  A training checkpoint's ``drafter/`` holds one state dict (``heads.*`` + ``lora.*``) instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from draftsmith.drafters.lora import (
    DEFAULT_LORA_MODULES,
    PEFT_CONFIG_NAME,
    AdaptedTarget,
    TargetLora,
    check_lora_options,
    check_target,
    target_summary,
)
from draftsmith.drafters.medusa import MedusaConfig, MedusaHeads, MedusaTreeDrafter


class Medusa2ConfigError(ValueError):
    """Medusa-2 options or a target that do not fit together."""


class Medusa2Config(MedusaConfig):
    """Medusa-1's head and tree options plus the LoRA on the target and the target's shape."""

    model_type = "draftsmith_medusa2"

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
        kwargs.setdefault("drafter_family", "medusa2")
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        num_heads: int = 4,
        num_layers: int = 1,
        tree: str | list[list[int]] = "medusa-16",
        tree_top_k: int = 4,
        tree_total_tokens: int = 16,
        draft_vocab_size: int = 0,
        lora_rank: int = 32,
        lora_alpha: float = 64.0,
        lora_target_modules: list[str] | None = None,
        lora_layers: list[int] | None = None,
    ) -> Medusa2Config:
        """Medusa-1's heads (see :meth:`MedusaConfig.for_target`) plus a LoRA of ``lora_rank`` /
        ``lora_alpha`` on ``lora_target_modules`` of ``lora_layers`` (None = every layer)."""
        config = super().for_target(
            target_config,
            num_heads=num_heads,
            num_layers=num_layers,
            tree=tree,
            tree_top_k=tree_top_k,
            tree_total_tokens=tree_total_tokens,
            draft_vocab_size=draft_vocab_size,
        )
        config.target = target_summary(target_config)
        config.lora_rank, config.lora_alpha = lora_rank, lora_alpha
        config.lora_target_modules = list(lora_target_modules or DEFAULT_LORA_MODULES)
        config.lora_layers = None if lora_layers is None else [int(i) for i in lora_layers]
        config.check()
        return config

    def check(self) -> None:
        """Refuse options that cannot work, with the key to change."""
        kind = self.target.get("model_type")
        if kind not in ("llama", None):  # the adapter's layer names (peft format) assume a Llama
            raise Medusa2ConfigError(f"Medusa-2's LoRA fits Llama-architecture targets; this one is {kind!r}")
        if self.lora_rank < 1:
            raise Medusa2ConfigError("drafter.lora_rank must be >= 1 (heads on a frozen target are family 'medusa')")
        check_lora_options(self.target, self.lora_rank, self.lora_target_modules, self.lora_layers, Medusa2ConfigError)


@dataclass
class Medusa2Output:
    logits: torch.Tensor  # (B, T, V): the adapted model's next-token logits
    head_logits: list[torch.Tensor]  # head k (0-based): (N_k, V') at the positions head_rows[k] selected
    features: torch.Tensor  # (B, T, h): the adapted model's last feature (what the heads read)
    original_logits: torch.Tensor | None = None  # (B, T, V): the target with the adapters off, no gradient


class Medusa2Model(nn.Module):
    """Medusa heads + the LoRA they are trained with; built from the config alone (checkpoints load
    without a target). :meth:`attach_target` binds the LoRA into a target; ``forward`` needs one."""

    config_class = Medusa2Config

    def __init__(self, config: Medusa2Config) -> None:
        super().__init__()
        self.config = config
        self.heads = MedusaHeads(config)
        self.lora = TargetLora(
            config.target, config.lora_rank, config.lora_alpha, config.lora_target_modules, config.lora_layers
        )
        # The target is held outside the module tree: its weights are never trained, moved or saved here.
        self.__dict__["_target"] = None

    # ---- data, initialisation and the target -----------------------------------------------
    def fit_data(self, token_counts: torch.Tensor) -> None:
        """The heads' draft vocabulary (see :meth:`MedusaHeads.fit_data`)."""
        self.heads.fit_data(token_counts)

    def init_from_target(self, frozen: Any) -> None:
        """Every head starts as the target's ``lm_head``; the LoRA starts at zero (the original model)."""
        self.heads.init_from_target(frozen)

    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("attach_target(target_model) first: Medusa-2 trains and serves the adapted target")
        return self._target

    def attach_target(self, target_model: nn.Module) -> None:
        """Inject this model's LoRA into ``target_model`` (in place, inactive outside :meth:`adapted`)."""
        if self._target is not None:
            raise RuntimeError("this Medusa-2 model is already attached to a target")
        check_target(self.config.target, target_model, "Medusa-2 model", Medusa2ConfigError)
        self.lora.inject(target_model, prefix="medusa2")
        self.__dict__["_target"] = target_model
        self.to(target_model.get_input_embeddings().weight.device)

    @contextmanager
    def adapted(self) -> Iterator[nn.Module]:
        """The target with this model's LoRA active: the served model (e.g. for ``generate``)."""
        target = self.target
        with self.lora.enabled():
            yield target

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        head_rows: Sequence[torch.Tensor] = (),
        original: bool = True,
    ) -> Medusa2Output:
        """The adapted target over ``input_ids`` (B, T) and head k's logits at the positions ``head_rows[k]``
        (B, T_k) bool selects among the first T_k; with ``original`` also the unadapted target's logits
        (the self-distillation teacher). One call, so DDP / DeepSpeed see every trained weight used."""
        target = self.target
        original_logits = None
        if original:
            with torch.no_grad():
                original_logits = target(input_ids=input_ids, attention_mask=attention_mask).logits
        with self.adapted():
            out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        features = out.hidden_states[-1]  # the input of lm_head, as the runtime hands it to the heads
        head_logits = self.heads([features[:, : rows.shape[1]][rows] for rows in head_rows]) if head_rows else []
        return Medusa2Output(out.logits, head_logits, features, original_logits)

    # ---- parameters and saving --------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """Extra parameters by kind: the heads vs the LoRA on the target."""
        return {
            "heads": sum(p.numel() for p in self.heads.parameters()),
            "lora": sum(p.numel() for p in self.lora.parameters()),
        }

    def save_pretrained(self, directory: str | Path) -> None:
        """The exported layout: heads as Medusa-1 writes them, the adapter in peft's format."""
        self.heads.save_pretrained(str(directory))
        identity = self.config.target_identity or {}
        self.lora.save_peft(directory, base_model=identity.get("name"))

    def load_initial_weights(self, directory: str | Path) -> list[str]:
        """``train.init_from``: the heads of a Medusa-1 or Medusa-2 export (the same layout) and, from a
        Medusa-2 export, its adapter; returns what starts fresh (a Medusa-1 export has no LoRA)."""
        from draftsmith.drafters.io import DrafterCheckpointError, load_weights_into

        fresh = [f"heads.{name}" for name in load_weights_into(self.heads, directory)]
        if (Path(directory) / PEFT_CONFIG_NAME).is_file():
            self.lora.load_peft(directory, DrafterCheckpointError)
        else:
            fresh += [f"lora.{name}" for name in self.lora.state_dict()]
        return fresh

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Medusa2Model:
        """An exported directory, or a training checkpoint's ``drafter/`` (one state dict, no peft files)."""
        from safetensors.torch import load_file

        from draftsmith.drafters.io import WEIGHTS_NAME, DrafterCheckpointError, load_drafter_weights

        directory = Path(directory)
        if not (directory / PEFT_CONFIG_NAME).is_file():
            return load_drafter_weights(cls, directory)
        model = cls(Medusa2Config.from_pretrained(directory))
        missing, unexpected = model.heads.load_state_dict(load_file(str(directory / WEIGHTS_NAME)), strict=False)
        if missing or unexpected:
            raise DrafterCheckpointError(
                f"{directory}/{WEIGHTS_NAME} does not hold the heads its config.json describes "
                f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); export it again"
            )
        model.lora.load_peft(directory, DrafterCheckpointError)
        return model


class Medusa2TreeDrafter(MedusaTreeDrafter):
    """Medusa's tree drafting over the adapted target: the runtime calls ``serving_model`` (the target
    with the LoRA on) for every forward, whose features feed the heads and whose logits verify."""

    def __init__(self, model: Medusa2Model, **tree: Any) -> None:
        super().__init__(model.heads, name=model.config.drafter_family, **tree)
        self.medusa2 = model.eval()
        self.serving_model = AdaptedTarget(model.target, model.lora)

    def served_model(self):
        """The model this drafter's output is lossless against (the LoRA-adapted target), for references."""
        return self.medusa2.adapted()


def serve_medusa2(model: Medusa2Model, target_model: nn.Module, **tree: Any) -> Medusa2TreeDrafter:
    """The runtime drafter: ``model``'s LoRA bound into ``target_model`` (whose weights it adapts)."""
    if model._target is None:
        model.attach_target(target_model)
    elif model._target is not target_model:
        raise Medusa2ConfigError("this Medusa-2 model is attached to another target model")
    return Medusa2TreeDrafter(model, **tree)
