"""The runtime's preallocated KV cache and tree-input buffers: same contents as the reference
``DynamicCache`` + ``index_select`` compaction and the same masks as ``tree_attention_inputs``."""

import random

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from conftest import tiny_gemma3, tiny_llama
from draftsmith.core.cache import (
    PreallocatedCache,
    PreallocatedLayer,
    cache_length,
    commit_tree_path,
    keep_positions,
    preallocated_cache_for,
)
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import Drafter
from draftsmith.core.tree import DraftTree, TreeInputBuffers, ancestry, tree_attention_inputs
from draftsmith.inference.backends import DEFAULT_TREE_ROOM
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, prefill_and_verify

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=0)


def filled_layers(rows: int, capacity: int) -> tuple[PreallocatedLayer, DynamicLayer]:
    """A preallocated layer and a plain one holding the same ``rows`` distinct rows."""
    keys = torch.randn(1, 2, rows, 4)
    values = torch.randn(1, 2, rows, 4)
    ours, reference = PreallocatedLayer(capacity), DynamicLayer()
    ours.update(keys, values)
    reference.update(keys, values)
    return ours, reference


def reference_keep(layer: DynamicLayer, keep: list[int]) -> None:
    index = torch.tensor(keep)
    layer.keys = layer.keys.index_select(-2, index)
    layer.values = layer.values.index_select(-2, index)


def assert_same_rows(ours, reference) -> None:
    assert ours.get_seq_length() == reference.keys.shape[-2]
    assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)


def reference_ancestry(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-node loop the vectorised version replaced."""
    n = len(parents)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    depths = torch.zeros(n + 1, dtype=torch.long)
    for i, parent in enumerate(parents):
        allowed[i + 1] = allowed[parent + 1]
        allowed[i + 1, i + 1] = True
        depths[i + 1] = depths[parent + 1] + 1
    return allowed, depths


def random_tree(rng: random.Random, size: int) -> DraftTree:
    parents = [rng.randrange(-1, i) for i in range(size)]
    return DraftTree(torch.tensor([rng.randrange(VOCAB) for _ in range(size)]), torch.tensor(parents))


def test_overlapping_move_equals_index_select():
    torch.manual_seed(0)
    ours, reference = filled_layers(12, capacity=16)
    # Destination rows 5..8 overlap the source rows 6, 7, 9, 11: a move that writes a row before
    # reading every source (e.g. last row first) clobbers rows 7 and 9.
    keep = [0, 1, 2, 3, 4, 6, 7, 9, 11]
    keep_positions_in(ours, keep)
    reference_keep(reference, keep)
    assert_same_rows(ours, reference)


def keep_positions_in(layer: PreallocatedLayer, keep: list[int]) -> None:
    cache = PreallocatedCache(1, layer.capacity)
    cache.layers[0] = layer
    keep_positions(cache, torch.tensor(keep))


def test_random_compactions_equal_index_select():
    rng = random.Random(0)
    torch.manual_seed(0)
    ours, reference = filled_layers(5, capacity=8)  # small capacity: appends below must grow it
    for _ in range(40):
        rows = rng.randint(1, 9)
        new_keys, new_values = torch.randn(1, 2, rows, 4), torch.randn(1, 2, rows, 4)
        returned = ours.update(new_keys, new_values)
        reference.update(new_keys, new_values)
        assert torch.equal(returned[0], reference.keys) and torch.equal(returned[1], reference.values)
        length = reference.keys.shape[-2]
        keep = sorted(rng.sample(range(length), rng.randint(1, length)))
        keep_positions_in(ours, keep)
        reference_keep(reference, keep)
        assert_same_rows(ours, reference)
    assert ours.capacity > 8


def test_commit_of_a_non_contiguous_path_equals_the_reference(model):
    torch.manual_seed(0)
    prefix = torch.randint(4, VOCAB, (1, 9))
    tree = DraftTree.from_paths([[11, 12, 13], [11, 14], [15, 16]])  # nodes: 11, 12, 13, 14, 15, 16
    caches = {
        "ours": PreallocatedCache(model.config.num_hidden_layers, 32),
        "reference": DynamicCache(config=model.config),
    }
    for cache in caches.values():
        prefill_and_verify(model, prefix, tree, cache)
    commit_tree_path(caches["ours"], 8, [0, 3])  # the non-contiguous path 11 -> 14: row 13 moves to 10
    reference_rows = [*range(9), 9 + 0, 9 + 3]
    for layer in caches["reference"].layers:
        reference_keep(layer, reference_rows)
    plain = DynamicCache(config=model.config)
    model(torch.cat([prefix, torch.tensor([[11, 14]])], 1), **cache_kwargs(plain), use_cache=True)
    assert cache_length(caches["ours"]) == caches["ours"].get_seq_length() == 11
    for ours, reference, fresh in zip(caches["ours"].layers, caches["reference"].layers, plain.layers):
        assert_same_rows(ours, reference)
        torch.testing.assert_close(ours.keys, fresh.keys, rtol=1e-5, atol=1e-6)


def test_commit_of_a_leading_chain_moves_nothing():
    torch.manual_seed(0)
    ours, reference = filled_layers(10, capacity=16)
    cache = PreallocatedCache(1, 16)
    cache.layers[0] = ours
    moved = []
    move_rows = ours.move_rows
    ours.move_rows = lambda sources, destination: (moved.append(sources.tolist()), move_rows(sources, destination))
    commit_tree_path(cache, 4, [0, 1, 2])  # nodes 0..2 already sit at rows 5..7
    reference_keep(reference, list(range(8)))
    assert_same_rows(ours, reference)
    assert moved == [[]]  # only the length pointer moved


def test_generic_assignment_and_crop_keep_working():
    torch.manual_seed(0)
    ours, reference = filled_layers(6, capacity=8)
    ours.crop(-2)
    reference.crop(-2)
    assert_same_rows(ours, reference)
    ours.keys, ours.values = ours.keys.flip(-2), ours.values.flip(-2)  # overlapping storage
    reference.keys, reference.values = reference.keys.flip(-2), reference.values.flip(-2)
    assert_same_rows(ours, reference)


def test_a_window_over_every_layer_alike_gets_no_preallocated_cache(model):
    """A model that windows every layer with one mask (no declared layer types) needs transformers' own
    sliding layers; full-attention models and Gemma-3's declared sliding layers keep every row."""
    assert isinstance(preallocated_cache_for(model.config, 16), PreallocatedCache)
    sliding = type(model.config)(**{**model.config.to_dict(), "sliding_window": 8})
    assert type(preallocated_cache_for(sliding, 16)) is DynamicCache
    assert isinstance(preallocated_cache_for(tiny_gemma3(32).config, 16), PreallocatedCache)


def test_sliding_layers_get_their_own_tree_mask_and_full_layers_the_plain_one(model):
    from draftsmith.core.tree import masks_per_layer_type

    tree, past = DraftTree.from_paths([[5, 6], [7]]), 10
    mask, positions = tree_attention_inputs(tree, past, torch.float32)
    assert masks_per_layer_type(model.config, mask, positions) is mask
    gemma = tiny_gemma3(32, sliding_window=4).config
    masks = masks_per_layer_type(gemma, mask, positions)
    assert masks["full_attention"] is mask
    seen = masks["sliding_attention"][0, 0] == 0
    # the root (position 10) sees 7..10; node [5, 6]'s 6 (position 12) sees 9, 10 and its ancestors
    assert seen[0].nonzero().flatten().tolist() == [7, 8, 9, 10]
    assert seen[2].nonzero().flatten().tolist() == [9, 10, 11, 12]


def test_ancestry_equals_the_per_node_loop():
    """Both ways ``ancestry`` takes: one integer of bits per row (trees of up to 61 nodes), and every row
    climbing a level at once (larger ones)."""
    rng = random.Random(0)
    for size in [0, 1, 2, 5, 17, 60, 61, 62, 63, 100]:
        for _ in range(5):
            tree = random_tree(rng, size)
            allowed, depths = ancestry(tree.parents)
            expected_allowed, expected_depths = reference_ancestry(tree.parents.tolist())
            assert torch.equal(allowed, expected_allowed) and torch.equal(depths, expected_depths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_input_buffers_equal_fresh_masks_round_after_round(dtype):
    """Trees on both sides of the buffers' small-tree path (61 nodes), padded to more rows or not."""
    rng = random.Random(1)
    buffers = TreeInputBuffers(rows=4, columns=24, dtype=dtype)  # small: rounds below outgrow it
    past = 3
    for size in [rng.randint(0, 9) for _ in range(30)] + [60, 61, 62, 70, 5]:
        tree = random_tree(rng, size)
        padded = len(tree) + 1 + rng.choice([0, 0, 1, 3])
        mask, positions = buffers.build(tree, past, padded)
        expected_mask, expected_positions = tree_attention_inputs(tree, past, dtype)
        real = len(tree) + 1
        assert torch.equal(mask[..., :real, : past + real], expected_mask) and torch.equal(
            positions[:, :real], expected_positions
        )
        padding = mask[0, 0, real:]  # padding rows: the committed columns and themselves
        assert torch.equal(padding[:, :past], torch.zeros_like(padding[:, :past]))
        assert torch.equal(padding[:, past:] == 0, torch.eye(padded, dtype=torch.bool)[real:])
        assert bool((mask[0, 0, :real, past + real :] < 0).all())  # no real row sees a padding row
        assert torch.equal(positions[0, real:], torch.full((padded - real,), past))
        past += rng.randint(1, 1 + len(tree))


class WideRandomDrafter(Drafter):
    """Random trees of up to ``2 * DEFAULT_TREE_ROOM`` nodes: bigger than the buffers' tree room."""

    name = "wide-random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def propose(self, context) -> DraftTree:
        return random_tree(self.rng, self.rng.randint(0, 2 * DEFAULT_TREE_ROOM))


class TruthPlusNoiseDrafter(Drafter):
    """The true continuation (so long spans get accepted and moved) under random siblings, with the
    true path placed after them so accepted nodes are never already in place."""

    name = "truth-plus-noise"

    def __init__(self, truth: list[int], prompt_length: int, seed: int = 0) -> None:
        self.truth, self.prompt_length, self.rng = truth, prompt_length, random.Random(seed)

    def propose(self, context) -> DraftTree:
        upcoming = self.truth[len(context.tokens) - self.prompt_length :][: self.rng.randint(0, 6)]
        noise = [[self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 3))] for _ in range(3)]
        return DraftTree.from_paths([path for path in noise if path[:1] != upcoming[:1]] + [upcoming])


def test_long_context_generation_stays_identical_to_hf_generate(model):
    rng = random.Random(2)
    motif = [rng.randrange(4, VOCAB) for _ in range(23)]
    prompt = (motif * 14)[:300]  # long enough that the cache grows well past its first rows
    truth = hf_greedy(model, prompt, 150, eos=())
    for drafter in [None, WideRandomDrafter(), TruthPlusNoiseDrafter(truth, len(prompt))]:
        result = generate(model, prompt, drafter, max_new_tokens=150)
        assert result.tokens == truth, "none" if drafter is None else drafter.name
    assert result.tau > 1.5  # the truth-carrying drafter really had long paths accepted (and moved)
