"""Speculative Streaming (Bhendawade et al. 2024): drafting fused into the target by multi-stream attention.

The target itself (a Llama or Gemma-3 causal LM) is the model; nothing of it is copied:

- LoRA adapters are injected into the chosen projections through ``peft``; their weights (and the
  stream embeddings) are this module's own parameters, so a checkpoint holds only them.
- Forward hooks on the top ``Ns`` decoder layers add the speculative streams: at layer ``L - Ns``
  stream j at position t starts as ``f(M_t) + P_j`` (``f`` = identity, or identity plus a low-rank
  map), then in each hooked layer it attends, in one softmax, to the main stream's keys/values
  ``<= t`` (read from the layer's KV cache after HF wrote them) and to streams ``1..j`` at t; in a
  sliding-window layer (Gemma-3's local layers) only to the main keys the main stream at t sees there.
  Stream states never enter the cache. Stream j's last state through the final norm and lm_head
  predicts ``x_{t+j+1}`` (the main stream at t predicts ``x_{t+1}``).
- The main stream is the unchanged HF computation (the hooks only read), so its logits are exactly
  the LoRA-adapted model's: verification against them is lossless with respect to that model.
- Optionally (``pruning_rank`` > 0) a tree-pruning adapter estimates, at layer ``L - Ns``, each draft
  node's probability given its parent; with a threshold, pre-hooks on the top ``Ns`` layers drop the
  unlikely sub-trees before the streams are inserted (see ``tree_pruning``): fewer rows, same result.

The adapters are active only inside :meth:`StreamingModel.forward` (or :meth:`adapted`), so the
shared target object still behaves as the original model for every other user.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from draftsmith.core.cache import keep_positions
from draftsmith.core.cache_kwarg import cache_in, cache_kwargs, takes_cache_kwarg
from draftsmith.core.drafting import INERT_OUTSIDE_OWNER, DraftContext, Drafter
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.tree import DraftTree, cartesian_tree, outside_sliding_window
from draftsmith.core.verify import Verdict
from draftsmith.drafters.base import DrafterModel, TreeOptions
from draftsmith.drafters.lora import AdaptsTargetConfig, AdaptsTargetMixin, VerifiesAdaptedTarget
from draftsmith.drafters.tree_pruning import (
    TreePruning,
    build_pruning_adapter,
    kept_columns,
    select_rows,
    surviving_rows,
    transition_probabilities,
)


class StreamingConfigError(DraftsmithError, ValueError):
    """Speculative Streaming options or a target that do not fit together."""


PRUNING_EXITS = ("lens", "linear")  # the tree-pruning adapter's early exit (StreamingConfig.pruning_exit)
# Transformers' names of the decoder layer types (``config.layer_types``); a target that declares none is
# all full attention.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


class StreamingConfig(AdaptsTargetConfig):
    """The MSA layout (streams, MSA layers), the LoRA adapters and the default draft tree.

    Options: ``num_streams`` = γ speculative streams; ``num_stream_layers`` = Ns top layers made MSA;
    the LoRA (``lora_*``, see :class:`AdaptsTargetConfig`); ``stream_init_rank`` > 0 adds a low-rank map
    to the identity stream init (the paper found identity as good). ``pruning_rank`` > 0 adds the
    tree-pruning adapter of that rank (paper: 8; see ``tree_pruning``), trained with the streams;
    ``prune`` is the serve-time default threshold below which it prunes a sub-tree (0 = none;
    ``streaming=DIR:prune=P`` overrides it); ``train_pruning_only`` freezes the LoRA and the streams so
    that only the adapter trains (after the streams: with ``train.init_from`` an exported run).
    ``pruning_exit`` is the adapter's early exit ``o_θ`` (see ``tree_pruning``): ``"lens"`` (default)
    ``N(M) + B(A(N(M)))`` with ``N`` the target's final norm, which starts as the target's own logit lens;
    ``"linear"`` ``B(A(M))``, the paper's formula, which starts uniform (exports made before the option
    existed lack the key and load as ``"linear"``)."""

    model_type = "draftsmith_streaming"
    TREE_OPTIONS = ("top_k", "total_tokens", "prune")
    error = StreamingConfigError

    def __init__(
        self,
        num_streams: int = 4,
        num_stream_layers: int = 4,
        stream_init_rank: int = 0,
        pruning_rank: int = 0,
        prune: float = 0.0,
        train_pruning_only: bool = False,
        pruning_exit: str = "lens",
        top_k: int = 3,
        total_tokens: int = 12,
        **kwargs: Any,
    ) -> None:
        self.num_streams = num_streams
        self.num_stream_layers = num_stream_layers
        self.stream_init_rank = stream_init_rank
        self.pruning_rank = pruning_rank
        self.prune = prune
        self.train_pruning_only = train_pruning_only
        self.pruning_exit = pruning_exit
        self.top_k = top_k
        self.total_tokens = total_tokens
        kwargs.setdefault("drafter_family", "streaming")
        super().__init__(**kwargs)

    def check(self) -> None:
        """Refuse options that cannot work, with the key to change."""
        super().check()
        layers = int(self.target["num_hidden_layers"])
        if not 1 <= self.num_stream_layers <= layers:
            raise StreamingConfigError(
                f"drafter.num_stream_layers must be in 1..{layers}, got {self.num_stream_layers}"
            )
        if self.num_streams < 1 or self.stream_init_rank < 0:
            raise StreamingConfigError("drafter.num_streams must be >= 1, stream_init_rank >= 0")
        if self.pruning_exit not in PRUNING_EXITS:
            raise StreamingConfigError(
                f"drafter.pruning_exit must be one of {', '.join(PRUNING_EXITS)}, got {self.pruning_exit!r}"
            )
        if self.pruning_rank < 0 or not 0.0 <= self.prune < 1.0:
            raise StreamingConfigError("drafter.pruning_rank must be >= 0 and drafter.prune in [0, 1)")
        if (self.prune or self.train_pruning_only) and not self.pruning_rank:
            raise StreamingConfigError(
                "drafter.prune and drafter.train_pruning_only need the adapter: set drafter.pruning_rank=8"
            )

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        # A config.json written before ``pruning_exit`` existed describes the paper's linear exit.
        return super().from_dict({"pruning_exit": "linear", **config_dict}, **kwargs)

    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def first_stream_layer(self) -> int:
        """0-based index of the first MSA layer, L - Ns: its input state M^{L-Ns} seeds the streams."""
        return int(self.target["num_hidden_layers"]) - self.num_stream_layers


@dataclass
class StreamingOutput:
    logits: torch.Tensor | None  # (B, q, V): the main stream, exactly the adapted HF model's (None: logits=False)
    stream_hidden: torch.Tensor | None  # (B, R, γ, h): streams after the final norm (lm_head gives their logits)
    cache: Any = None  # the target's KV cache after this forward
    hidden_states: tuple[torch.Tensor, ...] | None = None
    pruning_hidden: torch.Tensor | None = None  # (B, q', h): o_θ(M^{L-Ns}) (early_exit); lm_head gives its logits
    kept_rows: torch.Tensor | None = None  # (q',): rows of input_ids that tree pruning kept (None = all)
    original_features: torch.Tensor | None = None  # (B, q, h): the target with the adapters off, no gradient
    features: torch.Tensor | None = None  # (B, q, h): the main stream's last features (the input of lm_head)


@dataclass(frozen=True)
class StreamingPass:
    """What one :meth:`StreamingModel.forward` computes besides the adapted target's main stream.

    ``streams``: every stream too, at the query rows ``stream_rows`` (None = all). ``prune_threshold`` > 0
    (a tree mask, batch 1) drops the tree's sub-trees whose estimated transition probability is under it
    after layer L - Ns: the output then covers ``kept_rows`` only, and so does the KV cache of every
    layer. ``original`` (training, no cache) adds the unadapted target's last features, the
    self-distillation teacher; the streams are off in that forward (its hooks see no run). ``logits``
    False (training) skips the main stream's (B, q, V) logits and returns its ``features``: the loss
    projects the rows it needs in chunks."""

    streams: bool = True
    stream_rows: torch.Tensor | None = None
    prune_threshold: float = 0.0
    original: bool = False
    logits: bool = True


MAIN_STREAM_ONLY = StreamingPass(streams=False)


@dataclass
class _StreamRun:
    """State of the streams during one forward."""

    rows: torch.Tensor | None  # query rows that carry streams (None = all)
    allowed: dict[str, torch.Tensor]  # per layer type, (B, R, S) bool: main-stream keys each stream row may see
    states: torch.Tensor | None = None  # (B, R, γ, h)
    pruning: TreePruning | None = None  # set when this forward prunes its draft tree
    kept: torch.Tensor | None = None  # rows that survived pruning (None = all)
    fork: torch.Tensor | None = None  # (B, q', h): the main stream entering layer L - Ns


class StreamingModel(AdaptsTargetMixin, DrafterModel):
    """Stream embeddings + LoRA weights, and the forward of the target they adapt.

    Built from the config alone (so checkpoints load without a target); :meth:`attach_target` binds
    the weights into a target model. ``forward`` needs an attached target."""

    config_class = StreamingConfig
    adapter_prefix = "streaming"  # unique adapter names: two models may share a target
    PARAMETER_GROUPS = ("streams", "pruning", "lora")
    STREAM_ROW_CHUNK = 256  # query rows whose stream attention is computed (and kept for backward) at once

    def __init__(self, config: StreamingConfig) -> None:
        super().__init__(config)
        h = config.hidden_size
        self.stream_embeddings = nn.Parameter(torch.randn(config.num_streams, h) * 0.02)  # P_j
        self.stream_init = None
        if config.stream_init_rank:  # f(M) = M + up(down(M)), up = 0: starts as the identity
            self.stream_init = nn.Sequential(
                nn.Linear(h, config.stream_init_rank, bias=False), nn.Linear(config.stream_init_rank, h, bias=False)
            )
            nn.init.zeros_(self.stream_init[1].weight)
        self._init_target_lora()
        # o_θ of the tree-pruning adapter: early exit from layer L - Ns through the target's lm_head.
        self.pruning = build_pruning_adapter(h, config.pruning_rank) if config.pruning_rank else None
        if config.train_pruning_only:  # trained after the streams: the LoRA and the streams stay as they are
            for name, parameter in self.named_parameters():
                parameter.requires_grad_(name.startswith("pruning."))
        self._hooks: list[Any] = []
        self._run: _StreamRun | None = None

    # ---- binding to the target ---------------------------------------------------------------
    def attach_target(self, target_model: nn.Module) -> None:
        """Inject this model's LoRA weights into ``target_model`` (through peft, in place, inactive
        outside :meth:`forward`) and hook its top ``Ns`` decoder layers. Called once per target."""
        super().attach_target(target_model)
        layers = target_model.model.layers
        for index in range(self.config.first_stream_layer, len(layers)):
            _refuse_what_streams_cannot_compute(layers[index])
            layer_hook = self._make_layer_hook(index, _layer_type(target_model.config, index))
            hook = layers[index].register_forward_hook(layer_hook, with_kwargs=True)
            self._hooks.append(hook)
            if self.pruning is not None:
                prune = layers[index].register_forward_pre_hook(self._make_prune_hook(index), with_kwargs=True)
                self._hooks.append(prune)

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        output_hidden_states: bool = False,
        mode: StreamingPass = StreamingPass(),
    ) -> StreamingOutput:
        """The adapted target over ``input_ids`` (B, q), and what ``mode`` adds (:class:`StreamingPass`:
        the streams, tree pruning, the original target's features). ``attention_mask`` is a 2D padding
        mask (B, past + q), a 4D additive mask (B or 1, 1, q, past + q) such as a tree mask, or None
        (causal)."""
        original_features = self.original_features(input_ids, attention_mask) if mode.original else None
        if mode.streams and cache is None:
            # The hooks read main keys/values from it, every row of them: not ``DynamicCache(config=...)``,
            # whose sliding-window layers keep only the last window of rows.
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        run = self._stream_run(input_ids, attention_mask, past, mode) if mode.streams else None
        with self._streaming(run), self.adapted():
            out = (self.target if mode.logits else self.target.model)(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                **cache_kwargs(cache),
                use_cache=cache is not None if use_cache is None else use_cache,
                output_hidden_states=output_hidden_states,
            )
        main = {"original_features": original_features, "features": None if mode.logits else out.last_hidden_state}
        main_logits = out.logits if mode.logits else None
        if run is None:
            return StreamingOutput(main_logits, None, cache_in(out), out.hidden_states, **main)
        if run.kept is not None:  # the pruned rows left keys/values in the layers below L - Ns
            layers = slice(0, self.config.first_stream_layer)
            keep_positions(cache_in(out), kept_columns(run.kept, past), layers)
        stream_hidden = self.target.model.norm(run.states)
        pruning_hidden = None if self.pruning is None else self.early_exit(run.fork.detach())  # trains o_θ alone
        return StreamingOutput(
            main_logits, stream_hidden, cache_in(out), out.hidden_states, pruning_hidden, run.kept, **main
        )

    def _stream_run(self, input_ids: torch.Tensor, attention_mask: Any, past: int, mode: StreamingPass) -> _StreamRun:
        """The streams' state for one forward: the main keys each stream row may see, and the tree's
        pruning where ``mode`` asks for it."""
        allowed = _main_stream_allowed(self.target.config, attention_mask, input_ids.shape, past, input_ids.device)
        if mode.stream_rows is not None:
            allowed = {kind: seen[:, mode.stream_rows] for kind, seen in allowed.items()}
        run = _StreamRun(mode.stream_rows, allowed)
        if mode.prune_threshold > 0 and input_ids.shape[1] > 1:
            run.pruning = self._tree_pruning(input_ids, attention_mask, run, past, mode.prune_threshold)
        return run

    @contextmanager
    def _streaming(self, run: _StreamRun | None) -> Iterator[None]:
        """The layer hooks (registered once, in :meth:`attach_target`) advance ``run`` during this block
        only; None: they do nothing (streams off, or the target used by someone else)."""
        self._run = run
        try:
            yield
        finally:
            self._run = None

    def _tree_pruning(
        self, input_ids: torch.Tensor, attention_mask: Any, run: _StreamRun, past: int, threshold: float
    ) -> TreePruning:
        if self.pruning is None:
            raise StreamingConfigError("this model has no tree-pruning adapter (drafter.pruning_rank was 0)")
        tree_mask = isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() == 4)
        if not tree_mask or input_ids.shape[0] != 1 or run.rows is not None:
            raise ValueError("tree pruning needs one draft tree: batch 1, its 4D tree mask, streams on every row")
        # The tree's shape from the full-attention mask: a sliding window may hide a deep node's ancestors.
        return TreePruning.from_mask(run.allowed[FULL_ATTENTION][0], input_ids[0], past, threshold)

    def _make_layer_hook(self, index: int, layer_type: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            run = self._run
            if run is None:  # streams off, or the target used by someone else
                return None
            if index == self.config.first_stream_layer:
                hidden = args[0] if args else kwargs["hidden_states"]
                run.fork = hidden
                run.states = self._init_streams(hidden if run.rows is None else hidden[:, run.rows])
            allowed = run.allowed[layer_type]
            main = _cached_rows(cache_in(kwargs).layers[module.self_attn.layer_idx], allowed.shape[-1])
            # HF hands each layer the RoPE table of its own layer type (Gemma-3: local or global base).
            cos, sin = kwargs["position_embeddings"]
            if run.rows is not None:
                cos, sin = cos[:, run.rows], sin[:, run.rows]
            self._advance_streams(module, run, main, (cos, sin), allowed)
            return None  # the main stream's output is left exactly as HF computed it

        setattr(hook, INERT_OUTSIDE_OWNER, True)  # a no-op without a stream run: others may skip it
        return hook

    def _advance_streams(
        self,
        layer: nn.Module,
        run: _StreamRun,
        main: tuple[torch.Tensor, torch.Tensor],
        rope: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
    ) -> None:
        """``run.states`` through one MSA layer: :func:`stream_layer` against the main stream's cached
        (keys, values), the stream rows' (cos, sin) and the main keys they may see in this layer
        (``allowed``), over chunks of :attr:`STREAM_ROW_CHUNK` query rows. Rows are independent (each
        sees its allowed main keys and its own streams), and a row's attention scores cover every main key
        for every stream and head, so a long training sequence's (rows x γ x heads x keys) scores would
        otherwise all sit in memory, in every MSA layer, until the backward (Ns 8 at batch 2 ran out of
        24 GiB). Under autograd each chunk is checkpointed and recomputed in the backward, with this
        model's LoRA on again (the recompute runs outside :meth:`forward`)."""
        (main_keys, main_values), (cos, sin), states = main, rope, run.states
        rows = states.shape[1]
        if rows <= self.STREAM_ROW_CHUNK:
            run.states = stream_layer(layer, states, main_keys, main_values, cos, sin, allowed)
            return

        def chunk(part_states, part_cos, part_sin, part_allowed):
            with self.lora.enabled():
                return stream_layer(layer, part_states, main_keys, main_values, part_cos, part_sin, part_allowed)

        pieces, grad = [], torch.is_grad_enabled()
        for start in range(0, rows, self.STREAM_ROW_CHUNK):
            part = slice(start, start + self.STREAM_ROW_CHUNK)
            args = (states[:, part], cos[:, part], sin[:, part], allowed[:, part])
            pieces.append(checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
        run.states = torch.cat(pieces, 1)

    def _make_prune_hook(self, index: int):
        """Pre-hook of an MSA layer: at L - Ns choose the rows that survive tree pruning; then give
        each MSA layer only those rows (HF hands every layer the full mask and RoPE tables)."""
        first = index == self.config.first_stream_layer

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            run = self._run
            if run is None or run.pruning is None:
                return None
            if first:
                run.kept = self._surviving_rows(args[0] if args else kwargs["hidden_states"], run)
            if run.kept is None:  # nothing pruned: the layers run as they are
                return None
            return select_rows(args, kwargs, run.kept, run.pruning.past, hidden_too=first)

        setattr(hook, INERT_OUTSIDE_OWNER, True)
        return hook

    def _surviving_rows(self, hidden: torch.Tensor, run: _StreamRun) -> torch.Tensor | None:
        """The rows of the tree forward that survive pruning (None = all), given the main stream
        (1, q, h) entering layer L - Ns; narrows the streams' key mask to them."""
        pruning = run.pruning
        probs = transition_probabilities(self.early_exit_logits, hidden[0], pruning)
        rows = surviving_rows(probs, pruning.parents, pruning.threshold)
        if len(rows) == hidden.shape[1]:
            return None
        kept = torch.tensor(rows, device=hidden.device)
        columns = kept_columns(kept, pruning.past)
        run.allowed = {kind: seen[:, kept][:, :, columns] for kind, seen in run.allowed.items()}
        return kept

    def early_exit(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """``o_θ(M)`` over main-stream states (..., h) at L - Ns: the input of ``lm_head``."""
        if self.config.pruning_exit == "linear":
            return self.pruning(main_hidden)
        normed = self.target.model.norm(main_hidden)
        return normed + self.pruning(normed)

    def early_exit_logits(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """The pruning adapter's logits ``lm_head(o_θ(M))`` over main-stream states (..., h) at L - Ns."""
        return self.target.get_output_embeddings()(self.early_exit(main_hidden))

    def _init_streams(self, main: torch.Tensor) -> torch.Tensor:
        """S_{t,j} = f(M_t) + P_j: (B, R, h) -> (B, R, γ, h)."""
        if self.stream_init is not None:
            main = main + self.stream_init(main)
        return main[:, :, None, :] + self.stream_embeddings.to(main.dtype)

    # ---- parameters and saving --------------------------------------------------------------
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Stream embeddings (+ stream init map), the pruning adapter (when there is one) and, apart,
        the LoRA (which adapts the served model rather than drafting)."""
        streams = [self.stream_embeddings]
        if self.stream_init is not None:
            streams += list(self.stream_init.parameters())
        groups = {"streams": streams}
        if self.pruning is not None:
            groups["pruning"] = list(self.pruning.parameters())
        return {**groups, "lora": list(self.lora.parameters())}

    def runtime_drafter(self, target_model: nn.Module, tree: TreeOptions) -> StreamingTreeDrafter:
        """The runtime drafter: this model bound into ``target_model`` (whose weights it adapts)."""
        self.bind_target(target_model)
        return StreamingTreeDrafter(self, tree.over(self.config.tree_options()), name=self.config.drafter_family)


def _main_stream_allowed(
    config: Any, attention_mask: Any, shape: torch.Size, past: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Per layer type of the target (``config.layer_types``; all full attention when it declares none),
    (B, q, past + q) bool: the main-stream keys a query row sees in such a layer (a stream row sees the
    same). ``attention_mask`` as :meth:`StreamingModel.forward` takes it, or one 4D mask per layer type
    (the runtime's tree masks on a sliding-window target, see ``masks_per_layer_type``)."""
    batch, q = shape
    if isinstance(attention_mask, dict):  # HF uses each as it is, in the layers of its type
        return {kind: _allowed_by_4d_mask(mask, batch) for kind, mask in attention_mask.items()}
    if attention_mask is not None and attention_mask.dim() == 4:  # HF uses it as it is in every layer, sliding too
        return dict.fromkeys(_layer_types(config), _allowed_by_4d_mask(attention_mask, batch))
    columns = torch.arange(past + q, device=device)
    allowed = (columns[None, :] <= past + torch.arange(q, device=device)[:, None])[None].expand(batch, -1, -1)
    if attention_mask is not None:  # 2D padding mask over past + q
        allowed = allowed & attention_mask.bool()[:, None, :]
    per_type = {FULL_ATTENTION: allowed}
    if SLIDING_ATTENTION in _layer_types(config):
        # HF's own sliding mask counts a row's position as its column (its cache position), whatever the
        # position ids say: so do the windows here.
        positions = past + torch.arange(q, device=device)[None]
        window = config.get_text_config(decoder=True).sliding_window
        per_type[SLIDING_ATTENTION] = allowed & ~outside_sliding_window(window, positions, past)
    return per_type


def _allowed_by_4d_mask(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, q, S) bool from a 4D additive or bool mask (B or 1, 1, q, S)."""
    mask = mask[:, 0]
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return allowed.expand(batch, -1, -1)


def _layer_types(config: Any) -> tuple[str, ...]:
    """The distinct decoder layer types of the target (transformers' ``layer_types``)."""
    declared = getattr(config.get_text_config(decoder=True), "layer_types", None)
    return tuple(dict.fromkeys(declared or (FULL_ATTENTION,)))


def _layer_type(config: Any, index: int) -> str:
    """The type of decoder layer ``index``: the key by which HF picks its mask and RoPE table."""
    declared = getattr(config.get_text_config(decoder=True), "layer_types", None)
    return declared[index] if declared else FULL_ATTENTION


def _cached_rows(cache_layer: Any, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The main stream's (keys, values) in one layer's cache, which must hold every row the streams may see."""
    if cache_layer.keys.shape[-2] != columns:
        raise ValueError(
            f"the streams read all {columns} cached rows of each MSA layer, the cache holds "
            f"{cache_layer.keys.shape[-2]}: use a cache that keeps every row (a DynamicCache without config)"
        )
    return cache_layer.keys, cache_layer.values


def _refuse_what_streams_cannot_compute(layer: nn.Module) -> None:
    """:func:`stream_layer` has no attention-logit softcap (Gemma-2's; Gemma-3 sets none): refuse one."""
    if getattr(layer.self_attn, "attn_logit_softcapping", None) is not None:
        raise StreamingConfigError("the stream attention has no logit softcap: this target sets attn_logit_softcapping")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def _normed_heads(attn: nn.Module, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key heads (..., d) through the layer's per-head RMS norms before RoPE, where it has
    them (Gemma-3's QK-norm ``q_norm`` / ``k_norm``); as they are otherwise (Llama)."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return (query if q_norm is None else q_norm(query)), (key if k_norm is None else k_norm(key))


def _has_sandwich_norms(layer: nn.Module) -> bool:
    """Whether the layer normalises around its MLP as well as before it (Gemma-3's four norms per layer)."""
    return getattr(layer, "pre_feedforward_layernorm", None) is not None


def _attention_update(layer: nn.Module, attended: torch.Tensor) -> torch.Tensor:
    """What the attention adds to the residual: Gemma-3 normalises the attention output first (its
    ``post_attention_layernorm``); Llama adds it as it is (its ``post_attention_layernorm`` is the MLP's)."""
    return layer.post_attention_layernorm(attended) if _has_sandwich_norms(layer) else attended


def _mlp_update(layer: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """What the MLP adds to the residual: ``post_ff(mlp(pre_ff(x)))`` on Gemma-3, ``mlp(norm(x))`` on Llama."""
    if _has_sandwich_norms(layer):
        return layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(states)))
    return layer.mlp(layer.post_attention_layernorm(states))


def stream_layer(
    layer: nn.Module,
    states: torch.Tensor,
    main_keys: torch.Tensor,
    main_values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """One MSA layer for the streams, with the decoder layer's own (LoRA-adapted) modules: a Llama
    decoder layer, or a Gemma-3 one (QK-norm, its scaling, the norms around attention and MLP).

    states (B, R, γ, h); main_keys / main_values (B, kvH, S, d), normed and RoPE applied, as in the KV
    cache; cos / sin (B, R, d) of each stream row's position (a stream sits at its main row's position),
    the layer's own RoPE; allowed (B, R, S), the main keys each row sees in this layer (a sliding window
    included). Stream j attends to the allowed main keys and to streams 1..j of its row, all in one softmax."""
    attn = layer.self_attn
    batch, rows, streams, _ = states.shape
    kv_heads, head_dim = main_keys.shape[1], main_keys.shape[-1]
    groups = attn.config.num_attention_heads // kv_heads
    x = layer.input_layernorm(states)
    query = attn.q_proj(x).view(batch, rows, streams, kv_heads, groups, head_dim)
    key = attn.k_proj(x).view(batch, rows, streams, kv_heads, head_dim)
    value = attn.v_proj(x).view(batch, rows, streams, kv_heads, head_dim)
    query, key = _normed_heads(attn, query, key)
    cos, sin = cos[:, :, None, None, :].to(x.dtype), sin[:, :, None, None, :].to(x.dtype)
    query = _rope(query, cos[..., None, :], sin[..., None, :])  # (B, R, γ, kvH, g, d)
    key = _rope(key, cos, sin)  # (B, R, γ, kvH, d)
    to_main = torch.einsum("brjkgd,bksd->brjkgs", query, main_keys) * attn.scaling
    to_streams = torch.einsum("brjkgd,brikd->brjkgi", query, key) * attn.scaling
    earlier = torch.ones(streams, streams, dtype=torch.bool, device=x.device).tril()  # [j, i]: i <= j
    to_main = to_main.masked_fill(~allowed[:, :, None, None, None, :], float("-inf"))
    to_streams = to_streams.masked_fill(~earlier[None, None, :, None, None, :], float("-inf"))
    weights = torch.cat([to_main, to_streams], dim=-1).float().softmax(-1).to(x.dtype)
    width = main_keys.shape[-2]
    mixed = torch.einsum("brjkgs,bksd->brjkgd", weights[..., :width], main_values)
    mixed = mixed + torch.einsum("brjkgi,brikd->brjkgd", weights[..., width:], value)
    states = states + _attention_update(layer, attn.o_proj(mixed.reshape(batch, rows, streams, -1)))
    return states + _mlp_update(layer, states)


# ---- decoding ---------------------------------------------------------------------------------
class StreamingVerifier(nn.Module):
    """The model the runtime verifies with when it decodes with Speculative Streaming: the adapted
    target, whose every forward also runs the streams. It keeps the last forward's stream states for
    the drafter. A forward without a tree mask (the prompt) needs the streams of its last token only."""

    def __init__(self, model: StreamingModel, prune: float = 0.0) -> None:
        super().__init__()
        self.streaming = model
        self.prune = prune  # tree-pruning threshold for every tree forward (0 = none)
        self.config = model.target.config  # the runtime sizes its KV cache and context limit from it
        self.stream_hidden: torch.Tensor | None = None  # (R, γ, h) of the last forward
        self.calls = 0

    @takes_cache_kwarg
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = None,
        output_hidden_states: bool = False,
    ) -> StreamingOutput:
        rows = None
        if attention_mask is None:
            rows = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
        out = self.streaming(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            # a tree (not the prompt): prune it
            mode=StreamingPass(stream_rows=rows, prune_threshold=self.prune if rows is None else 0.0),
        )
        self.stream_hidden = out.stream_hidden[0]
        self.calls += 1
        return out


class StreamingTreeDrafter(VerifiesAdaptedTarget, Drafter):
    """Drafts from the streams of the last committed token, computed by the verification forward itself.

    The runtime verifies with a :class:`StreamingVerifier` instead of the bare target. After each
    verification, ``observe`` notes the row of the last accepted token (the root if none); ``propose``
    turns that row's γ stream distributions into a tree: the ``top_k`` tokens of stream n are the
    parents of those of stream n + 1, and the ``total_tokens`` paths with the highest summed
    log-probability are kept. After the prompt forward the row is the prompt's last token. With
    ``prune`` every verification forward first drops the sub-trees its pruning adapter deems under that
    probability; the runtime verifies what is left (:meth:`verified_rows`)."""

    def __init__(self, model: StreamingModel, tree: TreeOptions, name: str = "streaming") -> None:
        self.adapting = model.eval()
        self.prune = float(tree.prune or 0.0)
        if self.prune and model.pruning is None:
            raise StreamingConfigError("this streaming model has no tree-pruning adapter (pruning_rank 0): no :prune=")
        self.verifier = StreamingVerifier(model, self.prune)
        self.top_k, self.total_tokens = tree.top_k, tree.total_tokens
        self.name = name
        self._row_call = (-1, -1)  # (forward number, row) noted by observe

    def observe(self, tree: DraftTree, logits: torch.Tensor, verdict: Verdict) -> None:
        row = 1 + verdict.accepted_nodes[-1] if verdict.accepted_nodes else 0
        self._row_call = (self.verifier.calls, row)

    def verified_rows(self, output: StreamingOutput) -> torch.Tensor | None:
        return output.kept_rows

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        verifier = self.verifier
        if verifier.stream_hidden is None:
            raise RuntimeError("the streaming drafter drafts from its verifier's forward; run it through generate")
        calls, row = self._row_call
        hidden = verifier.stream_hidden[row if calls == verifier.calls else -1]  # (γ, h)
        return cartesian_tree(self.adapting.next_token_logits(hidden), self.top_k, self.total_tokens)
