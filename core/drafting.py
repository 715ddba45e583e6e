"""What the decoding runtime asks of a drafter: one base class with every optional hook declared once.

Training-free drafters (``inference/``) and the runtime drafters of trained families (``drafters/``)
subclass :class:`Drafter`; the runtime (``inference/runtime.py``) and ``bench`` call these methods and
never probe for attributes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import SamplingConfig, Verdict

# Set (to True) on a forward hook a drafter puts on a shared target that does nothing outside the
# drafter's own forward of the model (Speculative Streaming's stream layers): the runtime's direct
# forward, which bypasses module hooks, may then still serve every other user of that target.
INERT_OUTSIDE_OWNER = "draftsmith_inert_outside_owner"


@dataclass
class DraftContext:
    """What a drafter sees each round: all committed tokens (prompt first; the last one is the root
    of the next tree and is not yet in the target's KV cache)."""

    tokens: list[int]
    prompt_length: int
    sampling: SamplingConfig | None = None  # None = greedy
    generator: torch.Generator | None = None  # for drafters that sample their drafts
    # For drafters with ``wants_features = True``: the target's states ``Drafter.feature_layers`` at
    # every committed token but the last, (len(tokens) - 1, layers x h); rows of accepted tokens come from the
    # verification forward itself, so features cost no extra target work.
    features: torch.Tensor | None = None


def committed_features(context: DraftContext, drafter: str) -> torch.Tensor:
    """The target's features of every committed token but the root, as a feature drafter reads them;
    a context without them is a runtime bug, named for ``drafter``."""
    features = context.features
    if features is None or features.shape[0] != len(context.tokens) - 1:
        raise ValueError(f"{drafter} drafting needs the target's features of every committed token but the root")
    return features


@dataclass(frozen=True)
class DraftingStep:
    """The modules of a feature drafter's whole drafting forward as EAGLE-3 makes it, for a kernel that
    computes it and its head in one call (:meth:`LayerKernel.step`): ``fc`` fuses the target's layer
    states (None: the hidden is a fed-back feature); the decoder layer reads ``[input_norm(embeddings),
    hidden_norm(hidden)]`` and adds its attention to ``hidden_norm(hidden)``; the feature is that plus the
    MLP of its ``post_norm``; the logits are ``lm_head(norm(feature))``; ``rotary`` gives the positions'
    rotary embedding."""

    fc: Any
    hidden_norm: Any
    input_norm: Any
    attention: Any
    post_norm: Any
    mlp: Any
    norm: Any
    lm_head: Any
    rotary: Any


class LayerKernel(Protocol):
    """A faster forward of a feature drafter's decoder layer that the runtime may offer (its C++ layers on
    a CPU, ``inference/kernels/native_drafter.py``): given the layer's attention module, post-attention
    norm and MLP, its attention input and the residual that attention adds to, the rotary
    ``position_embeddings``, the additive mask and the drafter's cache (a ``PreallocatedCache``), it
    appends the rows' keys and values to the cache and returns ``(residual + attention, MLP output)``;
    or None, touching nothing, where it cannot serve the layer (the drafter then runs its own forward).
    :meth:`step` does the same for a whole drafting forward and its head."""

    def __call__(
        self,
        attention: torch.nn.Module,
        post_norm: torch.nn.Module,
        mlp: torch.nn.Module,
        attention_input: torch.Tensor,
        residual: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: Any,
    ) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def step(
        self,
        step: DraftingStep,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor | None,
        cache: Any,
        logit_rows: int,
        top_k: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``step``'s forward of ``embeds`` and ``hidden`` (1, rows, ·) at ``position_ids`` (1, rows)
        under ``mask``, its keys and values appended to ``cache``: ``(features (rows, h), the top_k
        log-probabilities and their head columns (logit_rows, top_k) of the last logit_rows rows)``, the
        same floats as the modules' forward, ``log_softmax`` and ``topk``; or None, touching nothing."""


class Drafter:
    """Proposes a token tree from the committed context; the runtime verifies it losslessly.

    Only :meth:`propose` is required. The other hooks default to doing nothing, and a drafter
    overrides the ones it needs."""

    name: str = "drafter"
    # True: the runtime hands the target's features to :meth:`propose` (``DraftContext.features``).
    wants_features: ClassVar[bool] = False
    # Which of the target's ``hidden_states`` (indices; -1 = the input of its lm_head) make up
    # ``DraftContext.features``, concatenated in this order: taken from the verification forward.
    feature_layers: tuple[int, ...] = (-1,)
    # True: :meth:`observe` reads the target's logits. Otherwise greedy decoding may hand it None: the
    # runtime then computes only the target's argmax (``inference/kernels/greedy_head.py``).
    reads_logits: ClassVar[bool] = False

    def propose(self, context: DraftContext) -> DraftTree:
        raise NotImplementedError(f"{type(self).__name__} must define propose()")

    def observe(self, tree: DraftTree, logits: torch.Tensor | None, verdict: Verdict) -> None:
        """Called after every verification forward with the tree it verified (``DraftTree.empty()`` when
        speculation was off), the target's logits over ``[root, nodes]`` (None unless
        :attr:`reads_logits` or sampling) and the verdict: drafters that learn from the target's own
        predictions (SPECTRA's pool) read them here at no extra forward."""

    def own_modules(self) -> torch.nn.Module | None:
        """The drafter's own trained modules (none of the target's), whose linears the runtime may run
        through a faster kernel than PyTorch's default: their rounding changes which tokens are proposed,
        never what verification commits. None: the runtime leaves the drafter as it is."""
        return None

    def use_layer_kernel(self, kernel: LayerKernel | None) -> None:
        """Called by the runtime before a generation with the faster layer forward it offers for the
        drafter's own rounds (None: none); a drafter whose layers it fits runs them through it."""

    def served_model(self) -> torch.nn.Module | None:
        """A plain model of the target's class that the runtime decodes with instead of the target, with
        every fast path of the target (direct forward, C++ layers, packed GEMM, screened head), or None for
        the target itself. Medusa-2 serves its target with the LoRA merged into a private copy of the
        weights it adapts."""
        return None

    def verifier_model(self) -> torch.nn.Module | None:
        """The model the runtime calls for every forward instead of the target (same call signature;
        its ``.logits`` are what is verified), or None for the target itself. Speculative Streaming
        drafts inside that forward; LoRA families verify against the adapted target."""
        return None

    def verified_rows(self, output: Any) -> torch.Tensor | None:
        """The rows of ``[root, nodes]`` that the verifier's forward kept, when it dropped draft nodes
        inside the forward (Speculative Streaming's tree pruning); None = all rows."""
        return None

    def reference_model(self) -> AbstractContextManager[torch.nn.Module] | None:
        """A context giving the model whose plain decoding this drafter's output equals, when that is
        not the target (a LoRA-adapted target); None = the target. ``bench`` uses it as the reference
        and the baseline."""
        return None
