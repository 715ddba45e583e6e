"""Which direct forward serves a model: one per architecture, found in :data:`DIRECT_FORWARDS` by the
model's class (a Llama's :class:`~draftsmith.inference.kernels.direct_forward.DirectForward`, a Gemma-3's
:class:`~draftsmith.inference.kernels.gemma_forward.GemmaDirectForward`). Each computes bitwise what the
model's own forward computes for the runtime's verification forwards; other architectures, attention
implementations, training mode or modules with hooks (accelerate's offloading, a user's forward hooks)
take the model's forward."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from transformers import Gemma3ForCausalLM, LlamaForCausalLM

from draftsmith.core.drafting import INERT_OUTSIDE_OWNER
from draftsmith.inference.kernels.attention import ATTENTION
from draftsmith.inference.kernels.direct_forward import DirectForward
from draftsmith.inference.kernels.gemma_forward import GemmaDirectForward

AnyDirectForward = DirectForward | GemmaDirectForward
# by the model's exact class: a subclass may compute something else
DIRECT_FORWARDS: dict[type[nn.Module], type[AnyDirectForward]] = {
    LlamaForCausalLM: DirectForward,
    Gemma3ForCausalLM: GemmaDirectForward,
}


def direct_forward_architecture(model: nn.Module) -> bool:
    """Whether a direct forward reimplements this model's architecture at all (others differ in norms,
    masks and scaling it would not compute)."""
    return type(model) in DIRECT_FORWARDS


def direct_forward_supported(model: nn.Module) -> bool:
    """A model of a served architecture and configuration with SDPA attention (or the runtime's
    row-invariant one) in inference mode, whose modules carry no hooks."""
    if not direct_forward_architecture(model) or model.training:
        return False
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", ATTENTION):
        return False
    if not DIRECT_FORWARDS[type(model)].serves(model):
        return False
    return not any(has_foreign_hooks(module) for module in model.modules())


def has_foreign_hooks(module: nn.Module) -> bool:
    """Hooks the direct forward would skip: accelerate's, or anyone's but transformers' own output
    capturing (installed on the decoder layers by the first ``output_hidden_states`` call, and only
    active inside the model's forward) and hooks marked :data:`INERT_OUTSIDE_OWNER` (Speculative
    Streaming's stream layers: they act only inside that drafter's own forward, which runs the model's
    forward, so every other user of a shared target keeps the direct forward)."""
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    foreign = [hook for hook in hooks if not _inert(hook)]
    return hasattr(module, "_hf_hook") or bool(foreign)


def _inert(hook: Callable) -> bool:
    return getattr(hook, "__name__", "") == "output_capturing_hook" or getattr(hook, INERT_OUTSIDE_OWNER, False)


def direct_forward_for(
    model: nn.Module, native: bool = True, rows_attention: bool | None = None
) -> AnyDirectForward | None:
    """The model's direct forward (``native``, ``rows_attention``: see its constructor), or None where the
    model's own forward must run."""
    if not direct_forward_supported(model):
        return None
    return DIRECT_FORWARDS[type(model)](model, native, rows_attention)
