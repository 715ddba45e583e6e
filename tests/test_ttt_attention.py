"""The training-time test's attention without its dense mask (drafters/ttt_attention.py): the same outputs and
gradients as SDPA under the dense mask, chunk by chunk, through the drafters' layers and under bf16 autocast;
every other mask takes SDPA itself."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import draftsmith.drafters.ttt_attention as ttt_attention
import draftsmith.train.losses.ttt as losses
from conftest import tiny_llama
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.registry import get_family
from draftsmith.drafters.ttt_attention import TTTMask, ttt_attention_forward

VOCAB = 97


class _Attention(torch.nn.Module):
    """What transformers' attention functions read of their module."""

    is_causal = False

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _inputs(batch, heads, kv_heads, length, dim, step, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    keys = (step + 1) * length
    return [
        torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype),
        torch.randn(batch, kv_heads, keys, dim, generator=generator, dtype=dtype),
        torch.randn(batch, kv_heads, keys, dim, generator=generator, dtype=dtype),
    ]


def _padding(batch, length):
    padding = torch.ones(batch, length, dtype=torch.long)
    padding[1, length - 7 :] = 0
    padding[-1, 1:] = 0  # one real key: padded rows see their own key only
    return padding


def _out_and_grads(mask, inputs, weights):
    leaves = [tensor.detach().clone().requires_grad_() for tensor in inputs]
    heads, kv_heads = leaves[0].shape[1], leaves[1].shape[1]
    out, _ = ttt_attention_forward(_Attention(heads // kv_heads), *leaves, mask, scaling=0.25)
    (out.double() * weights).sum().backward()
    return [out.detach(), *(leaf.grad for leaf in leaves)]


@pytest.mark.parametrize("step", [0, 1, 2])
@pytest.mark.parametrize("tile", [300, 1 << 23])  # query rows in chunks of 16, or all at once
def test_skipping_what_the_mask_hides_equals_sdpa_under_the_dense_mask(monkeypatch, step, tile):
    monkeypatch.setattr(ttt_attention, "_TILE_ELEMENTS", tile)
    batch, heads, kv_heads, length = 3, 6, 2, 37
    mask = TTTMask(_padding(batch, length), step)
    inputs = _inputs(batch, heads, kv_heads, length, 16, step)
    weights = torch.randn(batch, length, heads, 16, dtype=torch.float64)
    expected = _out_and_grads(mask.dense(torch.float64), inputs, weights)  # SDPA, float64
    got = _out_and_grads(mask, [tensor.float() for tensor in inputs], weights)
    for name, a, b in zip(("output", "query", "key", "value"), got, expected):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=name)


def test_the_dense_mask_is_the_training_time_test_mask():
    padding = torch.tensor([[1, 1, 1, 0]])
    dense = TTTMask(padding, 2).dense(torch.float32)
    seen = dense == 0
    assert dense.shape == (1, 1, 4, 12)
    assert seen[0, 0, 3, :4].tolist() == [True, True, True, True]  # the padded row also sees itself
    assert seen[0, 0, 2, :4].tolist() == [True, True, True, False]
    assert seen[0, 0, 1, 4:8].tolist() == [False, True, False, False]  # its own position of steps 1 and 2
    assert seen[0, 0, 1, 8:].tolist() == [False, True, False, False]


def test_other_masks_take_sdpa_itself():
    query, key, value = _inputs(2, 4, 2, 5, 8, 0, dtype=torch.float32)
    mask = torch.zeros(2, 1, 5, 5).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -1e9)
    module = _Attention(2)
    for attention_mask in (mask, None):
        got, _ = ttt_attention_forward(module, query, key, value, attention_mask, scaling=0.3)
        expected, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=0.3)
        assert torch.equal(got, expected)


def test_under_bf16_autocast_mixed_input_dtypes_run_as_sdpa_runs_them():
    """Rotary embeddings leave queries and keys float32 under autocast while values are bf16."""
    query, key, value = _inputs(2, 4, 2, 9, 8, 1, dtype=torch.float32)
    mask = TTTMask(torch.ones(2, 9, dtype=torch.long), 1)
    module = _Attention(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = ttt_attention_forward(module, query, key, value.bfloat16(), mask, scaling=0.3)
        dense = mask.dense(torch.float32)
        expected, _ = sdpa_attention_forward(module, query, key, value.bfloat16(), dense, scaling=0.3)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
def test_the_training_time_test_through_the_drafters_equals_the_dense_mask(monkeypatch, family):
    target = tiny_llama(VOCAB, seed=0, num_hidden_layers=5)
    torch.manual_seed(0)
    model = get_family(family).build(target.config, {"aux_layer_ids": [0, 2, 3], "ttt_steps": 3, "depth": 3})
    frozen = FrozenTarget.from_model(target)
    ids, states = torch.randint(4, VOCAB, (2, 12)), torch.randn(2, 12, 3 * 64)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0

    def unrolled():
        model.zero_grad()
        steps = list(losses.ttt_unroll(model, frozen, ids, attention, states))
        sum(model.logits(step.token_features).square().mean() for step in steps).backward()
        named = model.named_parameters()
        grads = {name: parameter.grad.clone() for name, parameter in named if parameter.grad is not None}
        return [step.token_features.detach() for step in steps], grads

    skipping = unrolled()
    monkeypatch.setattr(losses, "TTTMask", lambda padding, step: TTTMask(padding, step).dense(torch.float32))
    dense = unrolled()
    for a, b in zip(skipping[0], dense[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert skipping[1].keys() == dense[1].keys() and skipping[1]
    for name in dense[1]:
        torch.testing.assert_close(skipping[1][name], dense[1][name], atol=1e-5, rtol=1e-4, msg=name)
