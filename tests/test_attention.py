"""The row-invariant attention (``native.attend`` and its transformers registration): softmax attention
to float32 accuracy; each row bitwise the same alone, among other rows, on any thread count and under
any mask that lets it see the same keys; the model's own forwards run through it inside
``model_attention`` and get their configuration back after it."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_llama
from draftsmith.inference.kernels.attention import ATTENTION, model_attention
from draftsmith.inference.kernels.native import native_extension
from helpers import skip_without_avx512

LOWEST = torch.finfo(torch.float32).min


@pytest.fixture(scope="module")
def attend():
    extension = native_extension()
    assert extension is not None, "the C++ kernels should build here (g++ and ninja are set-up requirements)"
    return extension.attend


def qkv(heads, kv_heads, rows, length, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, rows, head_dim, generator=generator)
    k = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    v = torch.randn(1, kv_heads, length, head_dim, generator=generator)
    return q, k, v


def float64_attention(q, k, v, seen, scale):
    """The exact result for a (rows, length) bool mask of seen keys, in float64, as (1, rows, heads, dim)."""
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=seen, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("head_dim", [64, 40, 12])  # whole vectors, a tail of 8-lane vectors, a short head
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1), (6, 2)])
def test_attend_is_softmax_attention_to_float32_accuracy(attend, head_dim, heads, kv_heads):
    rows, length = 5, 37
    q, k, v = qkv(heads, kv_heads, rows, length, head_dim)
    seen = torch.rand(rows, length, generator=torch.Generator().manual_seed(1)) < 0.6
    seen[:, 0] = True
    ours = attend(q, k, v, seen[None, None], 0.3, False)
    torch.testing.assert_close(ours.double(), float64_attention(q, k, v, seen, 0.3), rtol=0, atol=2e-6)
    every = attend(q, k, v, None, 0.3, False)
    torch.testing.assert_close(every.double(), float64_attention(q, k, v, None, 0.3), rtol=0, atol=2e-6)
    causal = attend(q, k, v, None, 0.3, True)  # row r sees the first length - rows + r + 1 keys
    lower_right = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)
    torch.testing.assert_close(causal.double(), float64_attention(q, k, v, lower_right, 0.3), rtol=0, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_the_same_alone_among_rows_and_under_any_mask_that_shows_it_the_same_keys(attend, threads):
    """A tree's row r sees the prefix and its own ancestors; the same row decoded alone sees exactly those
    keys, stored contiguously: bitwise the same result, whatever the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prefix, rows = 29, 7
        q, k, v = qkv(9, 3, rows, prefix + rows, 64, seed=threads)
        parents = [-1, 0, 0, 1, 3, 2, 4]  # a tree over the rows: each row's parent row (-1: the root)
        additive = torch.full((1, 1, rows, prefix + rows), LOWEST)
        additive[..., :prefix] = 0
        paths = []
        for r in range(rows):
            path, node = [], r
            while node >= 0:
                path.insert(0, node)
                node = parents[node]
            paths.append(path)
            additive[0, 0, r, [prefix + n for n in path]] = 0
        tree = attend(q, k, v, additive, 0.125, False)
        assert torch.equal(tree, attend(q, k, v, additive == 0, 0.125, False))  # bool mask: the same
        for r, path in enumerate(paths):
            keys = list(range(prefix)) + [prefix + n for n in path]
            alone = attend(q[:, :, r : r + 1], k[:, :, keys], v[:, :, keys], None, 0.125, False)
            assert torch.equal(alone[:, 0], tree[:, r])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("common", [0, 20, 50])  # keys every row sees first: none, a prefix, all of them
@pytest.mark.parametrize("head_dim", [64, 40, 12])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_that_share_their_first_keys_compute_what_each_computes_alone(attend, common, head_dim, threads):
    """Rows read the keys they all see once for all of them; each row's result is still bitwise its own
    (the same keys, stored contiguously, one row alone), whatever the shared part and the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows, length = 9, 50
        q, k, v = qkv(6, 2, rows, length, head_dim, seed=common + head_dim)
        seen = torch.rand(rows, length, generator=torch.Generator().manual_seed(common)) < 0.5
        seen[:, :common] = True
        seen[:, 0] = True
        together = attend(q, k, v, seen[None, None], 0.2, False)
        for r in range(rows):
            keys = seen[r].nonzero().flatten()
            alone = attend(q[:, :, r : r + 1], k[:, :, keys], v[:, :, keys], None, 0.2, False)
            assert torch.equal(alone[:, 0], together[:, r])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim", [64, 40, 12, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 2), (4, 2), (4, 4)])  # 3, 4, 2 and 1 queries a K/V head
def test_the_avx512_attention_gives_the_avx2_attentions_floats(attend, head_dim, heads, kv_heads):
    """With AVX-512 the scores take two queries a vector and the weighted values 16 lanes a vector: each
    lane's sum is the same fused multiply-adds in the same order, and the scores' lane sums are added
    in four_sums' order, so the two codes give bitwise the same output."""
    q, k, v = qkv(heads, kv_heads, 6, 41, head_dim, seed=head_dim)
    seen = torch.rand(6, 41, generator=torch.Generator().manual_seed(2)) < 0.7
    seen[:, 0] = True
    skip_without_avx512()
    wide = attend(q, k, v, seen[None, None], 0.2, False, isa="avx512")
    assert torch.equal(wide, attend(q, k, v, seen[None, None], 0.2, False, isa="avx2"))
    assert torch.equal(attend(q, k, v, None, 0.2, True, isa="avx512"), attend(q, k, v, None, 0.2, True, isa="avx2"))


def test_a_float_mask_must_only_hide_or_show(attend):
    q, k, v = qkv(4, 2, 2, 6, 16)
    biased = torch.zeros(1, 1, 2, 6)
    biased[..., 3] = -1.5  # an additive bias (ALiBi-like): not a mask this attention reads
    with pytest.raises(RuntimeError, match="only 0"):
        attend(q, k, v, biased, 0.25, False)


def test_the_models_own_forward_attends_through_it_inside_model_attention(attend, monkeypatch):
    model = tiny_llama(97, seed=3, num_key_value_heads=2)
    ids = torch.tensor([[5, 17, 33, 2, 61, 8, 40]])
    calls = []
    from draftsmith.inference.kernels import attention

    real = attention.rows_attention_forward
    monkeypatch.setattr(attention, "rows_attention_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention.rows_attention_forward)
    before = model.config._attn_implementation
    with torch.no_grad():
        sdpa = model(ids).logits
        with model_attention(model):
            assert model.config._attn_implementation == ATTENTION
            ours = model(ids).logits
    AttentionInterface.register(ATTENTION, real)
    assert model.config._attn_implementation == before
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [{"softcap": 30.0}, {"position_bias": torch.zeros(1, 2, 3, 3)}])
def test_what_the_attention_does_not_compute_is_refused_in_one_line(extra):
    """A model that asks for a softcap or a position bias through the registered attention gets one line
    naming the attention to use instead, not a silently different result."""
    from draftsmith.inference.kernels.attention import rows_attention_forward

    module = torch.nn.Module()
    q, k, v = qkv(2, 2, 3, 3, 8)
    with pytest.raises(ValueError, match="use 'sdpa' or 'eager'"):
        rows_attention_forward(module, q, k, v, None, **extra)
