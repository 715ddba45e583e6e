"""Medusa-2: Medusa heads trained jointly with a LoRA on the target (through ``peft``).

The served model is the LoRA-adapted target: its features feed the heads and its logits are what
verification compares against, so decoding is lossless with respect to the adapted model (not the
original). The runtime serves it merged, as peft's ``merge_and_unload`` would (``W + B @ A * scaling``
in a private copy of the adapted projections), so it decodes through the same fast paths as the target;
the merged model is then the reference. The loss (``train.losses.medusa2_loss``) keeps the adapted
model close to the original by self-distillation: a KL against the same target with the adapters
switched off, no second copy.

- The heads are a :class:`~draftsmith.drafters.medusa.MedusaHeads` (same options, trees, drafting);
  the adapter is a :class:`~draftsmith.drafters.lora.TargetLora`, active only inside :meth:`Medusa2Model.forward`,
  :meth:`Medusa2Model.adapted` and the runtime's serving model.
- Exported (``draftsmith export``): ``config.json`` + ``model.safetensors`` holding the heads in the
  Medusa-1 layout (``medusa_head.{k}...``), and the adapter in peft's format (``adapter_config.json`` +
  ``adapter_model.safetensors``, named after the target), which ``PeftModel.from_pretrained`` loads.
  A training checkpoint's ``drafter/`` holds one state dict (``heads.*`` + ``lora.*``) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from draftsmith.core.errors import DraftsmithError
from draftsmith.drafters.base import DrafterModel, FrozenTarget, TreeOptions
from draftsmith.drafters.io import (
    WEIGHTS_NAME,
    DrafterCheckpointError,
    checked_config,
    load_drafter_weights,
    load_weights_file,
    load_weights_into,
)
from draftsmith.drafters.lora import (
    PEFT_CONFIG_NAME,
    AdaptedTarget,
    AdaptsTargetConfig,
    AdaptsTargetMixin,
    ServesMergedAdapter,
)
from draftsmith.drafters.medusa import MedusaConfig, MedusaHeads, MedusaTreeDrafter


class Medusa2ConfigError(DraftsmithError, ValueError):
    """Medusa-2 options or a target that do not fit together."""


class Medusa2Config(AdaptsTargetConfig, MedusaConfig):
    """Medusa-1's head and tree options plus the LoRA on the target (``lora_rank`` / ``lora_alpha`` on
    ``lora_target_modules`` of ``lora_layers``, None = every layer) and the target's shape."""

    model_type = "draftsmith_medusa2"
    error = Medusa2ConfigError

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("drafter_family", "medusa2")
        super().__init__(**kwargs)

    def check(self) -> None:
        super().check()
        if self.lora_rank < 1:
            raise Medusa2ConfigError("drafter.lora_rank must be >= 1 (heads on a frozen target are family 'medusa')")


@dataclass
class Medusa2Output:
    logits: torch.Tensor | None  # (B, T, V): the adapted model's next-token logits (None with logits=False)
    head_logits: list[torch.Tensor]  # head k (0-based): (N_k, V') at the positions head_rows[k] selected
    features: torch.Tensor  # (B, T, h): the adapted model's last feature (what the heads read)
    original_features: torch.Tensor | None = None  # (B, T, h): the target with the adapters off, no gradient


class Medusa2Model(AdaptsTargetMixin, DrafterModel):
    """Medusa heads + the LoRA they are trained with; built from the config alone (checkpoints load
    without a target). :meth:`attach_target` binds the LoRA into a target; ``forward`` needs one."""

    config_class = Medusa2Config
    adapter_prefix = "medusa2"
    PARAMETER_GROUPS = ("heads", "lora")

    def __init__(self, config: Medusa2Config) -> None:
        super().__init__(config)
        self.heads = MedusaHeads(config)
        self._init_target_lora()

    # ---- data, initialisation and the target -----------------------------------------------
    def fit_data(self, token_counts: torch.Tensor) -> None:
        """The heads' draft vocabulary (see :meth:`MedusaHeads.fit_data`)."""
        self.heads.fit_data(token_counts)

    def init_from_target(self, frozen: FrozenTarget) -> None:
        """Every head starts as the target's ``lm_head``; the LoRA starts at zero (the original model)."""
        self.heads.init_from_target(frozen)

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        head_rows: Sequence[torch.Tensor] = (),
        original: bool = True,
        logits: bool = True,
    ) -> Medusa2Output:
        """The adapted target over ``input_ids`` (B, T) and head k's logits at the positions ``head_rows[k]``
        (B, T_k) bool selects among the first T_k; with ``original`` also the unadapted target's last
        features (the self-distillation teacher). ``logits`` False skips the (B, T, V) logits: the loss
        projects the features it needs in chunks. One call, so DDP / DeepSpeed see every trained weight used."""
        target = self.target
        original_features = self.original_features(input_ids, attention_mask) if original else None
        with self.adapted():
            features = target.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        head_logits = self.heads([features[:, : rows.shape[1]][rows] for rows in head_rows]) if head_rows else []
        full = self.next_token_logits(features) if logits else None
        return Medusa2Output(full, head_logits, features, original_features)

    # ---- parameters and saving --------------------------------------------------------------
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """The heads vs the LoRA on the target (which the recipes train at a lower rate)."""
        return {"heads": list(self.heads.parameters()), "lora": list(self.lora.parameters())}

    def save_pretrained(self, directory: str | Path) -> None:
        """The exported layout: heads as Medusa-1 writes them, the adapter in peft's format."""
        self.heads.save_pretrained(str(directory))
        identity = self.config.target_identity or {}
        self.lora.save_peft(directory, base_model=identity.get("name"))

    def load_initial_weights(self, directory: str | Path) -> list[str]:
        """``train.init_from``: the heads of a Medusa-1 or Medusa-2 export (the same layout) and, from a
        Medusa-2 export, its adapter; returns what starts fresh (a Medusa-1 export has no LoRA)."""
        fresh = [f"heads.{name}" for name in load_weights_into(self.heads, directory)]
        if (Path(directory) / PEFT_CONFIG_NAME).is_file():
            self.lora.load_peft(directory, DrafterCheckpointError)
        else:
            fresh += [f"lora.{name}" for name in self.lora.state_dict()]
        return fresh

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> Medusa2Model:
        """An exported directory, or a training checkpoint's ``drafter/`` (one state dict, no peft files)."""
        directory = Path(directory)
        if not (directory / PEFT_CONFIG_NAME).is_file():
            return load_drafter_weights(cls, directory)
        model = cls(checked_config(cls, directory))
        missing, unexpected = model.heads.load_state_dict(load_weights_file(directory / WEIGHTS_NAME), strict=False)
        if missing or unexpected:
            raise DrafterCheckpointError(
                f"{directory}/{WEIGHTS_NAME} does not hold the heads its config.json describes "
                f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}); export it again"
            )
        model.lora.load_peft(directory, DrafterCheckpointError)
        return model

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> Medusa2TreeDrafter:
        """Medusa's tree drafting with this model's LoRA bound into ``target_model`` (whose weights it adapts)."""
        self.bind_target(target_model)
        return Medusa2TreeDrafter(self, tree)


class Medusa2TreeDrafter(ServesMergedAdapter, MedusaTreeDrafter):
    """Medusa's tree drafting over the adapted target: the runtime decodes with the target with the
    LoRA merged into a private copy of the weights it adapts (or, where no copy can stand for the
    target, with the LoRA on through peft), whose features feed the heads and whose logits are verified."""

    def __init__(self, model: Medusa2Model, tree: TreeOptions) -> None:
        super().__init__(model.heads, tree, name=model.config.drafter_family)
        self.adapting = model.eval()
        self.verifier = AdaptedTarget(model.target, model.lora)
        self.serve_merged()
