"""KV caches for tree decoding, and their compaction after verification: keep exactly the committed
tokens, nothing from the tree.

:class:`PreallocatedCache` is what the runtime's target forward uses: each layer's keys and values
live in buffers allocated once, so appending a forward's rows is a slice write and dropping rejected
tree rows only moves a length pointer. Any transformers cache works with :func:`keep_positions` and
:func:`commit_tree_path`; a preallocated one takes their fast path.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in buffers ``(B, H, capacity, D)``; ``keys`` / ``values`` are views
    of the valid rows ``[0, length)``, so code written for a ``DynamicLayer`` reads them unchanged.

    Growing past ``capacity`` reallocates (doubling): correct, only slower, for callers whose budget
    was too small. Assigning ``keys`` / ``values`` (as generic cache code does) copies into the buffer."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a preallocated cache layer needs a positive capacity")
        self.capacity = capacity
        self.length = 0
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        super().__init__()  # assigns keys = values = None: the setters leave the (absent) buffers alone

    # ---- the views that callers read ---------------------------------------------------------
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._key_buffer is None else self._key_buffer[:, :, : self.length]

    @keys.setter
    def keys(self, tensor: torch.Tensor | None) -> None:
        self._assign("_key_buffer", tensor)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._value_buffer is None else self._value_buffer[:, :, : self.length]

    @values.setter
    def values(self, tensor: torch.Tensor | None) -> None:
        self._assign("_value_buffer", tensor)

    def _assign(self, name: str, tensor: torch.Tensor | None) -> None:
        """Whole-tensor assignment from generic code (e.g. ``DynamicLayer.crop``, ``index_select``
        compaction): its rows become the valid rows."""
        if tensor is None:
            self.length = 0
            return
        rows = tensor.shape[-2]
        if getattr(self, name) is None:
            self._allocate(tensor, tensor)
        self._ensure_capacity(rows)
        buffer = getattr(self, name)
        if tensor.data_ptr() != buffer.data_ptr():  # a prefix view of the buffer itself is already in place
            buffer[:, :, :rows].copy_(tensor.clone() if _overlaps(tensor, buffer) else tensor)
        self.length = rows

    # ---- transformers' layer interface ------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's rows after the valid ones (a slice write, no concatenation)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        self._ensure_capacity(end)
        self._key_buffer[:, :, self.length : end].copy_(key_states)
        self._value_buffer[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys, self.values

    def append_rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``rows`` more rows, for a writer that fills them itself (the native decoder layers):
        the key and value buffers and the first new row. The rows are valid from now on."""
        start = self.length
        self._ensure_capacity(start + rows)
        self.length = start + rows
        return self._key_buffer, self._value_buffer, start

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows on demand, like a DynamicLayer

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)

    # ---- moves used by compaction -----------------------------------------------------------
    def truncate(self, length: int) -> None:
        """Keep the first ``length`` rows (rows past it are simply no longer valid)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} cached rows to {length}")
        self.length = length

    def move_rows(self, sources: torch.Tensor, destination: int) -> None:
        """Rows ``sources`` (ascending, all >= ``destination``) become rows ``destination, ...``; the
        valid length ends after them. Source and destination ranges may overlap (an accepted path
        that skips nodes), so the rows are gathered into new storage before they are written."""
        end = destination + sources.numel()
        if sources.numel():
            index = sources.to(self._key_buffer.device)
            self._key_buffer[:, :, destination:end] = self._key_buffer.index_select(2, index)
            self._value_buffer[:, :, destination:end] = self._value_buffer.index_select(2, index)
        self.length = end

    # ---- buffers ----------------------------------------------------------------------------
    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads = key_states.shape[:2]
        # Uninitialised on purpose: rows past ``length`` are never part of a view, so never read.
        self._key_buffer = key_states.new_empty(batch, heads, self.capacity, key_states.shape[-1])
        self._value_buffer = value_states.new_empty(batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _ensure_capacity(self, rows: int) -> None:
        if rows <= self.capacity:
            return
        capacity = max(rows, 2 * self.capacity)
        self._key_buffer = _grown(self._key_buffer, capacity, self.length)
        self._value_buffer = _grown(self._value_buffer, capacity, self.length)
        self.capacity = capacity


def _grown(buffer: torch.Tensor, capacity: int, valid: int) -> torch.Tensor:
    bigger = buffer.new_empty(*buffer.shape[:2], capacity, buffer.shape[-1])
    bigger[:, :, :valid] = buffer[:, :, :valid]
    return bigger


def _overlaps(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


class PreallocatedCache(DynamicCache):
    """A transformers cache (a ``DynamicCache`` to any code that checks) of :class:`PreallocatedLayer`
    layers, each able to hold ``capacity`` rows before it has to grow; for models whose layers all use
    full attention (see :func:`supports_preallocation`)."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        Cache.__init__(self, layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])


# Layer kinds a cache that keeps every row serves: a sliding-window layer keeps them all too, and its
# window is then the attention mask's job (see draftsmith.core.tree.masks_per_layer_type).
KEEPS_EVERY_ROW = ("full_attention", "sliding_attention")


def supports_preallocation(config) -> bool:
    """True when every decoder layer is full attention or a sliding window over a declared layer type
    (Gemma-3's, masked per layer type), the kinds a :class:`PreallocatedLayer` keeping every row serves;
    not linear attention, shared KV, or a window the model applies to every layer alike (a single mask)."""
    text = config.get_text_config(decoder=True)
    declared = getattr(text, "layer_types", None)
    if not declared:
        return not getattr(text, "sliding_window", None)
    return all(kind in KEEPS_EVERY_ROW for kind in declared)


def preallocated_cache_for(config, capacity: int) -> DynamicCache:
    """A :class:`PreallocatedCache` for ``config`` when it supports one, else a plain ``DynamicCache``."""
    if supports_preallocation(config):
        return PreallocatedCache(config.get_text_config(decoder=True).num_hidden_layers, capacity)
    return DynamicCache(config=config)


def cache_length(cache) -> int:
    return 0 if not cache.layers else int(cache.layers[0].keys.shape[-2])


def keep_positions(cache, keep: torch.Tensor, layers: slice = slice(None)) -> None:
    """Keep only sequence positions ``keep`` (ascending) in every layer of a transformers cache (or in
    the ``layers`` slice of them: Speculative Streaming's tree pruning trims the layers below it).

    A preallocated layer moves only the rows after the longest unchanged prefix of ``keep``. Other
    layers copy with ``index_select`` into new storage, so source and destination never overlap
    (in-place shifting of an accepted path onto itself corrupts entries when it is non-contiguous)."""
    keep = keep.cpu()
    unchanged = _unchanged_prefix(keep)
    for layer in cache.layers[layers]:
        if isinstance(layer, PreallocatedLayer):
            layer.move_rows(keep[unchanged:], unchanged)
        elif unchanged == keep.numel():  # a plain prefix: a view, no copy
            layer.keys = layer.keys[:, :, :unchanged]
            layer.values = layer.values[:, :, :unchanged]
        else:
            index = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)


def _unchanged_prefix(keep: torch.Tensor) -> int:
    """How many leading entries of ``keep`` are already in place (``keep[i] == i``)."""
    moved = (keep != torch.arange(keep.numel())).nonzero()
    return int(moved[0]) if moved.numel() else keep.numel()


_NO_ROWS = torch.empty(0, dtype=torch.long)  # a plain step's commit moves no row


def commit_tree_path(cache, past_length: int, accepted_nodes: list[int]) -> None:
    """After a forward over ``[root, tree]`` on top of ``past_length`` cached tokens, keep the prefix,
    the root and the accepted nodes (tree node i sits at ``past_length + 1 + i``)."""
    # Leading accepted nodes that are already where they belong (node j at slot j) never move.
    in_place = next((j for j, node in enumerate(accepted_nodes) if node != j), len(accepted_nodes))
    moving = accepted_nodes[in_place:]
    sources = torch.tensor(moving, dtype=torch.long) + past_length + 1 if moving else _NO_ROWS
    destination = past_length + 1 + in_place
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.move_rows(sources, destination)
    plain = [layer for layer in cache.layers if not isinstance(layer, PreallocatedLayer)]
    if plain and int(plain[0].keys.shape[-2]) != destination + sources.numel():
        keep = torch.cat([torch.arange(destination), sources])
        for layer in plain:
            index = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
