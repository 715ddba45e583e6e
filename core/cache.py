"""KV-cache compaction after verification: keep exactly the committed tokens, nothing from the tree."""

from __future__ import annotations

import torch


def cache_length(cache) -> int:
    return 0 if not cache.layers else int(cache.layers[0].keys.shape[-2])


def keep_positions(cache, keep: torch.Tensor, layers: slice = slice(None)) -> None:
    """Keep only sequence positions ``keep`` (ascending) in every layer of a transformers cache (or in
    the ``layers`` slice of them: Speculative Streaming's tree pruning trims the layers below it).

    ``index_select`` copies into new storage, so source and destination never overlap (in-place
    shifting of an accepted path onto itself corrupts entries when the path is non-contiguous)."""
    for layer in cache.layers[layers]:
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def commit_tree_path(cache, past_length: int, accepted_nodes: list[int]) -> None:
    """After a forward over ``[root, tree]`` on top of ``past_length`` cached tokens, keep the prefix,
    the root and the accepted nodes (tree node i sits at ``past_length + 1 + i``)."""
    nodes = torch.tensor(accepted_nodes, dtype=torch.long) + past_length + 1
    keep = torch.cat([torch.arange(past_length + 1), nodes])
    if keep.numel() != cache_length(cache):  # equal only when a whole chain was accepted: nothing to drop
        keep_positions(cache, keep)
