"""Speculative Streaming (Bhendawade et al. 2024): drafting fused into the target by multi-stream attention.

The target itself (a Llama-architecture ``LlamaForCausalLM``) is the model; nothing of it is copied:

- LoRA adapters are injected into the chosen projections through ``peft``; their weights (and the
  stream embeddings) are this module's own parameters, so a checkpoint holds only them.
- Forward hooks on the top ``Ns`` decoder layers add the speculative streams: at layer ``L - Ns``
  stream j at position t starts as ``f(M_t) + P_j`` (``f`` = identity, or identity plus a low-rank
  map), then in each hooked layer it attends, in one softmax, to the main stream's keys/values
  ``<= t`` (read from the layer's KV cache after HF wrote them) and to streams ``1..j`` at t.
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
from transformers import DynamicCache, PretrainedConfig
from transformers.models.llama.modeling_llama import rotate_half

from draftsmith.drafters.lora import (
    DEFAULT_LORA_MODULES,
    TargetLora,
    check_lora_options,
    check_target,
    target_summary,
)
from draftsmith.drafters.tree_pruning import (
    TreePruning,
    build_pruning_adapter,
    kept_columns,
    select_rows,
    surviving_rows,
    transition_probabilities,
)
from draftsmith.inference.cache import keep_positions


class StreamingConfigError(ValueError):
    """Speculative Streaming options or a target that do not fit together."""


class StreamingConfig(PretrainedConfig):
    """The MSA layout (streams, MSA layers), the LoRA adapters and the default draft tree."""

    model_type = "draftsmith_streaming"

    def __init__(
        self,
        target: dict[str, Any] | None = None,
        num_streams: int = 4,
        num_stream_layers: int = 4,
        lora_rank: int = 32,
        lora_alpha: float = 64.0,
        lora_target_modules: list[str] | None = None,
        lora_layers: list[int] | None = None,
        stream_init_rank: int = 0,
        pruning_rank: int = 0,
        pruning_threshold: float = 0.0,
        train_pruning_only: bool = False,
        tree_top_k: int = 3,
        tree_total_tokens: int = 12,
        drafter_family: str = "streaming",
        target_identity: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        self.target = dict(target or {})
        self.num_streams = num_streams
        self.num_stream_layers = num_stream_layers
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha
        self.lora_target_modules = list(lora_target_modules or DEFAULT_LORA_MODULES)
        self.lora_layers = None if lora_layers is None else [int(i) for i in lora_layers]
        self.stream_init_rank = stream_init_rank
        self.pruning_rank = pruning_rank
        self.pruning_threshold = pruning_threshold
        self.train_pruning_only = train_pruning_only
        self.tree_top_k = tree_top_k
        self.tree_total_tokens = tree_total_tokens
        self.drafter_family = drafter_family
        self.target_identity = target_identity
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        num_streams: int = 4,
        num_stream_layers: int = 4,
        lora_rank: int = 32,
        lora_alpha: float = 64.0,
        lora_target_modules: list[str] | None = None,
        lora_layers: list[int] | None = None,
        stream_init_rank: int = 0,
        pruning_rank: int = 0,
        pruning_threshold: float = 0.0,
        train_pruning_only: bool = False,
        tree_top_k: int = 3,
        tree_total_tokens: int = 12,
    ) -> StreamingConfig:
        """Speculative Streaming for ``target_config`` (Llama architecture).

        ``num_streams`` = γ speculative streams; ``num_stream_layers`` = Ns top layers made MSA;
        LoRA of ``lora_rank``/``lora_alpha`` on ``lora_target_modules`` of ``lora_layers`` (None =
        every layer); ``stream_init_rank`` > 0 adds a low-rank map to the identity stream init
        (the paper found identity as good). ``pruning_rank`` > 0 adds the tree-pruning adapter of that
        rank (paper: 8; see ``tree_pruning``), trained with the streams; ``pruning_threshold`` is the
        serve-time default below which it prunes a sub-tree (0 = none; ``streaming=DIR:prune=P``
        overrides it); ``train_pruning_only`` freezes the LoRA and the streams so that only the adapter
        trains (after the streams: with ``train.init_from`` an exported run)."""
        config = cls(
            target=target_summary(target_config),
            num_streams=num_streams,
            num_stream_layers=num_stream_layers,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_target_modules=lora_target_modules,
            lora_layers=lora_layers,
            stream_init_rank=stream_init_rank,
            pruning_rank=pruning_rank,
            pruning_threshold=pruning_threshold,
            train_pruning_only=train_pruning_only,
            tree_top_k=tree_top_k,
            tree_total_tokens=tree_total_tokens,
        )
        config.check()
        return config

    def check(self) -> None:
        """Refuse options that cannot work, with the key to change."""
        layers = int(self.target["num_hidden_layers"])
        if self.target.get("model_type") not in ("llama", None):
            raise StreamingConfigError(
                f"Speculative Streaming wraps Llama-architecture targets; this one is {self.target['model_type']!r}"
            )
        if not 1 <= self.num_stream_layers <= layers:
            raise StreamingConfigError(
                f"drafter.num_stream_layers must be in 1..{layers}, got {self.num_stream_layers}"
            )
        if self.num_streams < 1 or self.lora_rank < 0 or self.stream_init_rank < 0:
            raise StreamingConfigError("drafter.num_streams must be >= 1, lora_rank and stream_init_rank >= 0")
        check_lora_options(
            self.target, self.lora_rank, self.lora_target_modules, self.lora_layers, StreamingConfigError
        )
        if self.pruning_rank < 0 or not 0.0 <= self.pruning_threshold < 1.0:
            raise StreamingConfigError("drafter.pruning_rank must be >= 0 and drafter.pruning_threshold in [0, 1)")
        if (self.pruning_threshold or self.train_pruning_only) and not self.pruning_rank:
            raise StreamingConfigError(
                "drafter.pruning_threshold and drafter.train_pruning_only need the adapter: set drafter.pruning_rank=8"
            )
        if self.tree_top_k < 1 or self.tree_total_tokens < 1:
            raise StreamingConfigError("drafter.tree_top_k and drafter.tree_total_tokens must be >= 1")

    @property
    def hidden_size(self) -> int:
        return int(self.target["hidden_size"])

    @property
    def first_stream_layer(self) -> int:
        """0-based index of the first MSA layer, L - Ns: its input state M^{L-Ns} seeds the streams."""
        return int(self.target["num_hidden_layers"]) - self.num_stream_layers


@dataclass
class StreamingOutput:
    logits: torch.Tensor  # (B, q, V): the main stream, exactly the adapted HF model's logits
    stream_hidden: torch.Tensor | None  # (B, R, γ, h): streams after the final norm (lm_head gives their logits)
    past_key_values: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    pruning_hidden: torch.Tensor | None = None  # (B, q', h): o_θ(M^{L-Ns}); lm_head gives the pruning adapter's logits
    kept_rows: torch.Tensor | None = None  # (q',): rows of input_ids that tree pruning kept (None = all)


@dataclass
class _StreamRun:
    """State of the streams during one forward."""

    rows: torch.Tensor | None  # query rows that carry streams (None = all)
    allowed: torch.Tensor  # (B, R, S) bool: main-stream keys each stream row may see
    states: torch.Tensor | None = None  # (B, R, γ, h)
    pruning: TreePruning | None = None  # set when this forward prunes its draft tree
    kept: torch.Tensor | None = None  # rows that survived pruning (None = all)
    fork: torch.Tensor | None = None  # (B, q', h): the main stream entering layer L - Ns


class StreamingModel(nn.Module):
    """Stream embeddings + LoRA weights, and the forward of the target they adapt.

    Built from the config alone (so checkpoints load without a target); :meth:`attach_target` binds
    the weights into a target model. ``forward`` needs an attached target."""

    config_class = StreamingConfig

    def __init__(self, config: StreamingConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.stream_embeddings = nn.Parameter(torch.randn(config.num_streams, h) * 0.02)  # P_j
        self.stream_init = None
        if config.stream_init_rank:  # f(M) = M + up(down(M)), up = 0: starts as the identity
            self.stream_init = nn.Sequential(
                nn.Linear(h, config.stream_init_rank, bias=False), nn.Linear(config.stream_init_rank, h, bias=False)
            )
            nn.init.zeros_(self.stream_init[1].weight)
        self.lora = TargetLora(
            config.target, config.lora_rank, config.lora_alpha, config.lora_target_modules, config.lora_layers
        )
        # o_θ of the tree-pruning adapter: early exit from layer L - Ns through the target's lm_head.
        self.pruning = build_pruning_adapter(h, config.pruning_rank) if config.pruning_rank else None
        if config.train_pruning_only:  # trained after the streams: the LoRA and the streams stay as they are
            for name, parameter in self.named_parameters():
                parameter.requires_grad_(name.startswith("pruning."))
        # The target is held outside the module tree: its weights are never trained, moved or saved here.
        self.__dict__["_target"] = None
        self._hooks: list[Any] = []
        self._run: _StreamRun | None = None

    # ---- binding to the target ---------------------------------------------------------------
    @property
    def target(self) -> nn.Module:
        if self._target is None:
            raise RuntimeError("attach_target(target_model) first: Speculative Streaming runs inside the target")
        return self._target

    def attach_target(self, target_model: nn.Module) -> None:
        """Inject this model's LoRA weights into ``target_model`` (through peft, in place, inactive
        outside :meth:`forward`) and hook its top ``Ns`` decoder layers. Called once per target."""
        if self._target is not None:
            raise RuntimeError("this StreamingModel is already attached to a target")
        check_target(self.config.target, target_model, "Speculative Streaming model", StreamingConfigError)
        self.lora.inject(target_model, prefix="streaming")  # unique adapter name: two models may share a target
        layers = target_model.model.layers
        for index in range(self.config.first_stream_layer, len(layers)):
            hook = layers[index].register_forward_hook(self._make_layer_hook(index), with_kwargs=True)
            self._hooks.append(hook)
            if self.pruning is not None:
                prune = layers[index].register_forward_pre_hook(self._make_prune_hook(index), with_kwargs=True)
                self._hooks.append(prune)
        self.__dict__["_target"] = target_model
        self.to(target_model.get_input_embeddings().weight.device)

    @contextmanager
    def adapted(self) -> Iterator[nn.Module]:
        """The target with this model's LoRA active (e.g. for ``target.generate``: the served model's
        plain decoding, the reference that speculative output must equal)."""
        target = self.target
        with self.lora.enabled():
            yield target

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool | None = None,
        streams: bool = True,
        stream_rows: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        prune_threshold: float = 0.0,
    ) -> StreamingOutput:
        """The adapted target over ``input_ids`` (B, q); with ``streams`` also every stream at the
        query rows ``stream_rows`` (None = all). ``attention_mask`` is a 2D padding mask (B, past + q),
        a 4D additive mask (B or 1, 1, q, past + q) such as a tree mask, or None (causal).

        ``prune_threshold`` > 0 (a tree mask, batch 1) drops the tree's sub-trees whose estimated
        transition probability is under it after layer L - Ns: the output then covers ``kept_rows``
        only, and so does the KV cache of every layer."""
        target = self.target
        if streams and past_key_values is None:
            past_key_values = DynamicCache(config=target.config)  # the hooks read main keys/values from it
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        run = None
        if streams:
            allowed = _main_stream_allowed(attention_mask, input_ids.shape, past, input_ids.device)
            run = _StreamRun(stream_rows, allowed if stream_rows is None else allowed[:, stream_rows])
            if prune_threshold > 0 and input_ids.shape[1] > 1:
                run.pruning = self._tree_pruning(input_ids, attention_mask, run, past, prune_threshold)
        self._run = run
        try:
            with self.adapted():
                out = target(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    past_key_values=past_key_values,
                    use_cache=past_key_values is not None if use_cache is None else use_cache,
                    output_hidden_states=output_hidden_states,
                )
        finally:
            self._run = None
        if run is None:
            return StreamingOutput(out.logits, None, out.past_key_values, out.hidden_states)
        if run.kept is not None:  # the pruned rows left keys/values in the layers below L - Ns
            layers = slice(0, self.config.first_stream_layer)
            keep_positions(out.past_key_values, kept_columns(run.kept, past), layers)
        stream_hidden = target.model.norm(run.states)
        pruning_hidden = None if self.pruning is None else self.pruning(run.fork.detach())  # trains o_θ alone
        return StreamingOutput(
            out.logits, stream_hidden, out.past_key_values, out.hidden_states, pruning_hidden, run.kept
        )

    def _tree_pruning(
        self, input_ids: torch.Tensor, attention_mask: Any, run: _StreamRun, past: int, threshold: float
    ) -> TreePruning:
        if self.pruning is None:
            raise StreamingConfigError("this model has no tree-pruning adapter (drafter.pruning_rank was 0)")
        if attention_mask is None or attention_mask.dim() != 4 or input_ids.shape[0] != 1 or run.rows is not None:
            raise ValueError("tree pruning needs one draft tree: batch 1, its 4D tree mask, streams on every row")
        return TreePruning.from_mask(run.allowed[0], input_ids[0], past, threshold)

    def stream_logits(self, stream_hidden: torch.Tensor) -> torch.Tensor:
        """The target's lm_head over stream states (..., γ, h) -> (..., γ, V)."""
        return self.target.get_output_embeddings()(stream_hidden)

    def _make_layer_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            run = self._run
            if run is None:  # streams off, or the target used by someone else
                return None
            if index == self.config.first_stream_layer:
                hidden = args[0] if args else kwargs["hidden_states"]
                run.fork = hidden
                run.states = self._init_streams(hidden if run.rows is None else hidden[:, run.rows])
            layer = kwargs["past_key_values"].layers[module.self_attn.layer_idx]
            cos, sin = kwargs["position_embeddings"]
            if run.rows is not None:
                cos, sin = cos[:, run.rows], sin[:, run.rows]
            run.states = stream_layer(module, run.states, layer.keys, layer.values, cos, sin, run.allowed)
            return None  # the main stream's output is left exactly as HF computed it

        return hook

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
        run.allowed = run.allowed[:, kept][:, :, kept_columns(kept, pruning.past)]
        return kept

    def early_exit_logits(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """The pruning adapter's logits ``lm_head(o_θ(M))`` over main-stream states (..., h) at L - Ns."""
        return self.target.get_output_embeddings()(self.pruning(main_hidden))

    def _init_streams(self, main: torch.Tensor) -> torch.Tensor:
        """S_{t,j} = f(M_t) + P_j: (B, R, h) -> (B, R, γ, h)."""
        if self.stream_init is not None:
            main = main + self.stream_init(main)
        return main[:, :, None, :] + self.stream_embeddings.to(main.dtype)

    # ---- parameters and saving --------------------------------------------------------------
    def parameter_counts(self) -> dict[str, int]:
        """Extra parameters by kind: stream embeddings (+ stream init map), the pruning adapter (when
        there is one) and, apart, the LoRA (which adapts the served model rather than drafting)."""
        streams = self.stream_embeddings.numel()
        if self.stream_init is not None:
            streams += sum(p.numel() for p in self.stream_init.parameters())
        counts = {"streams": streams}
        if self.pruning is not None:
            counts["pruning"] = sum(p.numel() for p in self.pruning.parameters())
        return {**counts, "lora": sum(p.numel() for p in self.lora.parameters())}

    def save_pretrained(self, directory: str) -> None:
        from draftsmith.drafters.io import save_drafter_weights

        save_drafter_weights(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str) -> StreamingModel:
        from draftsmith.drafters.io import load_drafter_weights

        return load_drafter_weights(cls, directory)


def _main_stream_allowed(
    attention_mask: torch.Tensor | None, shape: torch.Size, past: int, device: torch.device
) -> torch.Tensor:
    """(B, q, past + q) bool: the main-stream keys a query row sees (a stream row sees the same)."""
    batch, q = shape
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask[:, 0]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        return allowed.expand(batch, -1, -1)
    columns = torch.arange(past + q, device=device)
    allowed = (columns[None, :] <= past + torch.arange(q, device=device)[:, None])[None].expand(batch, -1, -1)
    if attention_mask is not None:  # 2D padding mask over past + q
        allowed = allowed & attention_mask.bool()[:, None, :]
    return allowed


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def stream_layer(
    layer: nn.Module,
    states: torch.Tensor,
    main_keys: torch.Tensor,
    main_values: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    allowed: torch.Tensor,
) -> torch.Tensor:
    """One MSA layer for the streams, with the decoder layer's own (LoRA-adapted) modules.

    states (B, R, γ, h); main_keys / main_values (B, kvH, S, d), RoPE applied, as in the KV cache;
    cos / sin (B, R, d) of each stream row's position (a stream sits at its main row's position);
    allowed (B, R, S). Stream j attends to the allowed main keys and to streams 1..j of its row,
    all in one softmax."""
    attn = layer.self_attn
    batch, rows, streams, _ = states.shape
    kv_heads, head_dim = main_keys.shape[1], main_keys.shape[-1]
    groups = attn.config.num_attention_heads // kv_heads
    x = layer.input_layernorm(states)
    query = attn.q_proj(x).view(batch, rows, streams, kv_heads, groups, head_dim)
    key = attn.k_proj(x).view(batch, rows, streams, kv_heads, head_dim)
    value = attn.v_proj(x).view(batch, rows, streams, kv_heads, head_dim)
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
    states = states + attn.o_proj(mixed.reshape(batch, rows, streams, -1))
    return states + layer.mlp(layer.post_attention_layernorm(states))


# ---- decoding ---------------------------------------------------------------------------------
class StreamingServer(nn.Module):
    """The model the runtime calls when it decodes with Speculative Streaming: the adapted target,
    whose every forward also runs the streams. It keeps the last forward's stream states for the
    drafter. A forward without a tree mask (the prompt) needs the streams of its last token only."""

    def __init__(self, model: StreamingModel, prune: float = 0.0) -> None:
        super().__init__()
        self.streaming = model
        self.prune = prune  # tree-pruning threshold for every tree forward (0 = none)
        self.config = model.target.config  # the runtime sizes its KV cache and context limit from it
        self.stream_hidden: torch.Tensor | None = None  # (R, γ, h) of the last forward
        self.calls = 0

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
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
            past_key_values=past_key_values,
            use_cache=use_cache,
            stream_rows=rows,
            output_hidden_states=output_hidden_states,
            prune_threshold=self.prune if rows is None else 0.0,  # a tree (not the prompt): prune it
        )
        self.stream_hidden = out.stream_hidden[0]
        self.calls += 1
        return out


class StreamingTreeDrafter:
    """Drafts from the streams of the last committed token, computed by the verification forward itself.

    The runtime calls ``serving_model`` instead of the bare target. After each verification,
    ``observe`` notes the row of the last accepted token (the root if none); ``propose`` turns that
    row's γ stream distributions into a tree: the ``top_k`` tokens of stream n are the parents of
    those of stream n + 1, and the ``total_tokens`` paths with the highest summed log-probability are
    kept. After the prompt forward the row is the prompt's last token. With ``prune`` (default: the
    config's ``pruning_threshold``) every verification forward first drops the sub-trees its pruning
    adapter deems under that probability; the runtime verifies what is left."""

    def __init__(
        self,
        model: StreamingModel,
        top_k: int | None = None,
        total_tokens: int | None = None,
        prune: float | None = None,
        name: str = "streaming",
    ) -> None:
        self.model = model.eval()
        self.prune = model.config.pruning_threshold if prune is None else float(prune)
        if self.prune and model.pruning is None:
            raise StreamingConfigError("this streaming model has no tree-pruning adapter (pruning_rank 0): no :prune=")
        self.serving_model = StreamingServer(self.model, self.prune)
        self.top_k = top_k or model.config.tree_top_k
        self.total_tokens = total_tokens or model.config.tree_total_tokens
        self.name = name
        self._row_call = (-1, -1)  # (forward number, row) noted by observe

    def served_model(self):
        """The model this drafter's output is lossless against (the LoRA-adapted target), for references."""
        return self.model.adapted()

    def observe(self, tree: Any, logits: torch.Tensor, verdict: Any) -> None:
        row = 1 + verdict.accepted_nodes[-1] if verdict.accepted_nodes else 0
        self._row_call = (self.serving_model.calls, row)

    @torch.no_grad()
    def propose(self, context: Any) -> Any:
        server = self.serving_model
        if server.stream_hidden is None:
            raise RuntimeError("the streaming drafter drafts from its serving_model's forward; run it through generate")
        calls, row = self._row_call
        hidden = server.stream_hidden[row if calls == server.calls else -1]  # (γ, h)
        logprobs = self.model.stream_logits(hidden).float().log_softmax(-1)  # (γ, V)
        return stream_tree(logprobs, self.top_k, self.total_tokens)


def stream_tree(logprobs: torch.Tensor, top_k: int, total_tokens: int) -> Any:
    """The best ``total_tokens`` nodes of the tree whose depth-n nodes are stream n's ``top_k`` tokens
    under every depth-(n-1) node, scored by summed log-probability. Only the ``total_tokens`` best
    nodes of a depth are expanded: a node of the final tree has fewer better nodes at its depth."""
    from draftsmith.inference.tree import best_first_tree

    values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    parents, tokens, scores = [], [], []
    frontier = [-1]
    for depth in range(logprobs.shape[0]):
        children = []
        for parent in frontier:
            base = scores[parent] if parent >= 0 else 0.0
            for value, token in zip(values[depth].tolist(), ids[depth].tolist()):
                children.append(len(tokens))
                parents.append(parent), tokens.append(token), scores.append(base + value)
        frontier = sorted(children, key=lambda i: -scores[i])[:total_tokens]
    tree, _ = best_first_tree(parents, tokens, scores, total_tokens)
    return tree


def serve_streaming(model: StreamingModel, target_model: nn.Module, **tree: Any) -> StreamingTreeDrafter:
    """The runtime drafter: ``model`` bound into ``target_model`` (whose weights it adapts)."""
    if model._target is None:
        model.attach_target(target_model)
    elif model._target is not target_model:
        raise StreamingConfigError("this StreamingModel is attached to another target model")
    return StreamingTreeDrafter(model, name=model.config.drafter_family, **tree)
