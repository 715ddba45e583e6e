"""Prepacked linears for the runtime's forwards: MKL's padded row buckets that change no real row,
oneDNN's one pack for every forward (row invariance checked, the reference on the same kernel), linears
that behave as before outside the runtime, and the memory guard."""

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.cache import preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import TreeInputBuffers
from draftsmith.inference.backends import Backends, FastPaths, verification_forward
from draftsmith.inference.kernels import attention, context, packed_gemm
from draftsmith.inference.kernels.context import KernelContext
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import (
    ROUNDED_FORM,
    PackedGemm,
    PackedLinear,
    linear_kernel_available,
    rounded_to_four_bit_blocks,
    row_bucket,
)
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import (
    TINY_EOS,
    hf_greedy,
    q4_1_dequantised,
    q8_0_dequantised,
    seeded_random_tree,
    skip_without_avx512,
)

VOCAB = 97
mkl = pytest.mark.skipif(not linear_kernel_available("mkl"), reason="PyTorch built without MKL")


def fresh_model(seed=0):
    return tiny_llama(VOCAB, seed=seed)


def verify_once(model, prompt, tree, gemm):
    cache = preallocated_cache_for(model.config, 64)
    with torch.no_grad():
        model(torch.tensor([prompt[:-1]]), **cache_kwargs(cache), use_cache=True)
        inputs = TreeInputBuffers(8, 64, torch.float32)
        out = verification_forward(model, cache, inputs, prompt[-1], tree, len(prompt) - 1, True, FastPaths(gemm))
    return out, cache


def test_row_buckets():
    assert [row_bucket(r) for r in (1, 2, 3, 4, 5, 9, 32, 33)] == [None, 2, 4, 4, 8, 16, 32, None]


@mkl
@pytest.mark.parametrize("nodes", [1, 2, 4, 6, 13])
def test_padded_packed_forward_keeps_every_real_row(nodes):
    """Real rows of the padded, packed forward equal the plain forward's (up to float32 rounding); a
    padding row that a real row could see would change them by far more."""
    model = fresh_model()
    prompt = [5, 17, 33, 2, 61, 8, 40]
    tree = seeded_random_tree(nodes, nodes, VOCAB)
    plain, plain_cache = verify_once(model, prompt, tree, None)
    gemm = PackedGemm(model)
    packed, packed_cache = verify_once(model, prompt, tree, gemm)
    rows = 1 + nodes
    assert packed.logits.shape[1] == row_bucket(rows)
    assert gemm.buckets == [row_bucket(rows)]
    torch.testing.assert_close(packed.logits[:, :rows], plain.logits, rtol=1e-4, atol=1e-4)
    for plain_states, packed_states in zip(plain.hidden_states, packed.hidden_states):
        torch.testing.assert_close(packed_states[:, :rows], plain_states, rtol=1e-4, atol=1e-4)
    # the prefix and the real rows' keys are the same; the padding's keys lie past them
    past = len(prompt) - 1
    for plain_layer, packed_layer in zip(plain_cache.layers, packed_cache.layers):
        torch.testing.assert_close(packed_layer.keys[:, :, : past + rows], plain_layer.keys, rtol=1e-4, atol=1e-4)


@mkl
def test_greedy_identity_with_packed_gemm():
    model = fresh_model(seed=1)
    rng = random.Random(3)
    backends = Backends(KernelOptions(linear="mkl"))
    for _ in range(4):
        base = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 8))]
        prompt = base * 3
        expected = hf_greedy(model, prompt, 24)
        drafter = PromptLookupDrafter(num_draft=6)
        result = generate(model, prompt, drafter, max_new_tokens=24, eos_token_ids=[TINY_EOS], backends=backends)
        assert result.tokens == expected
    assert backends.kernels(model).gemm.buckets, "the prompt-lookup trees should have used packed buckets"


@mkl
def test_linears_are_unchanged_outside_the_runtime():
    model = fresh_model(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, model.config.hidden_size)
    linear = model.model.layers[0].self_attn.q_proj
    expected = torch.nn.functional.linear(x, linear.weight)
    gemm = PackedGemm(model)
    assert isinstance(linear, PackedLinear) and gemm.padded_rows(4) == 4
    assert torch.equal(linear(x), expected)  # not inside gemm.rows(): the default kernel, bit for bit
    with gemm.rows(), torch.no_grad():
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)
    with gemm.rows():  # gradients on (training): the default kernel, so autograd works
        assert torch.equal(linear(x), expected)
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    again = PackedGemm(model)  # a new owner (another kernel context) takes the linears over, unpacked
    assert linear._owner is again and again.buckets == [] and gemm.buckets == []


@mkl
def test_packs_of_a_changed_weight_are_remade():
    """A pack copies the weight: after an in-place change or a replaced weight, the packed forward must
    multiply by the new values, not the packed old ones."""
    model = fresh_model(seed=5)
    gemm = PackedGemm(model)
    linear = model.model.layers[0].mlp.down_proj
    x = torch.randn(4, linear.in_features)
    assert gemm.padded_rows(4) == 4
    with torch.no_grad():
        linear.weight.mul_(-2.0)
        gemm.padded_rows(4)
        with gemm.rows():
            torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight), rtol=1e-5, atol=1e-5)
    linear.weight = torch.nn.Parameter(torch.randn_like(linear.weight))
    with torch.no_grad():
        gemm.padded_rows(4)
        with gemm.rows():
            torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight), rtol=1e-5, atol=1e-5)


@mkl
def test_memory_guard_refuses_a_bucket(monkeypatch):
    model = fresh_model(seed=3)
    monkeypatch.setattr(packed_gemm, "_available_bytes", lambda: 1024)
    gemm = PackedGemm(model)
    assert gemm.padded_rows(5) == 5  # runs unpadded, unpacked
    assert gemm.buckets == []


def test_half_precision_targets_are_not_packed():
    model = fresh_model(seed=4).to(torch.bfloat16)
    assert KernelContext(model, KernelOptions()).gemm is None


def test_tree_forwards_read_grouped_kv_heads_without_copies(monkeypatch):
    """On CPU the verification forward lets SDPA read grouped K/V heads under the tree mask (no
    ``repeat_kv`` copy of the whole cache per layer), with bit-identical outputs."""
    from transformers.integrations import sdpa_attention

    model = fresh_model(seed=5)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    prompt = [7, 3, 19, 44, 12, 90, 31, 8]
    tree = seeded_random_tree(6, 1, VOCAB)
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")  # set by the caller: left alone
    copied, _ = verify_once(model, prompt, tree, None)
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA")

    def no_copies(*args, **kwargs):
        raise AssertionError("repeat_kv was called")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_copies)
    grouped, _ = verify_once(model, prompt, tree, None)
    assert torch.equal(grouped.logits, copied.logits)
    assert "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ


def one_pack_kernel(kernel: str) -> str:
    """``kernel`` where it runs here (the stream kernel: the C++ extension on an AVX2 and FMA CPU)."""
    if not linear_kernel_available(kernel):
        pytest.skip(f"the {kernel} kernel does not run here")
    return kernel


ONE_PACK = pytest.mark.parametrize("kernel", packed_gemm.ONE_PACK_KERNELS)


@ONE_PACK
def test_one_pack_serves_every_row_count_and_the_models_own_forwards(kernel):
    model = fresh_model(seed=6)
    gemm = PackedGemm(model, one_pack_kernel(kernel))
    linear = model.model.layers[0].self_attn.q_proj
    assert gemm.padded_rows(5) == 5 and gemm.buckets == [packed_gemm.ANY_ROWS]  # unpadded, one pack
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        assert linear.active_pack(1) is None  # outside the runtime: the default kernel
        with gemm.model_forwards():
            assert all(linear.active_pack(rows) is not None for rows in (1, 2, 7, 300))
            torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight), rtol=1e-5, atol=1e-5)
        assert linear.active_pack(1) is None


@ONE_PACK
def test_packing_inside_a_timed_build_counts_once_in_the_setup_time(kernel):
    """The screened head's timing forwards pack the linears inside a timed build, and the gemm's
    ``pack_seconds`` holds that packing already: counted twice, a first generation's setup outgrew its
    wall clock and ``draftsmith generate`` printed negative tokens/s."""
    model = fresh_model(seed=9)
    kernels = KernelContext(model, KernelOptions(linear=one_pack_kernel(kernel)))

    def build_that_packs():
        with torch.no_grad(), kernels.gemm.model_forwards():
            model(torch.tensor([[5, 6, 7]]))

    start = time.perf_counter()
    kernels._timed(build_that_packs)
    wall = time.perf_counter() - start
    assert kernels.gemm.pack_seconds > 0 and kernels.setup_seconds <= wall
    backends = Backends(KernelOptions(linear=one_pack_kernel(kernel)))
    start = time.perf_counter()
    result = generate(model, [5, 6, 7], None, max_new_tokens=4, eos_token_ids=[TINY_EOS], backends=backends)
    wall = time.perf_counter() - start
    assert 0 < result.seconds and result.seconds + result.pack_seconds + result.compile_seconds <= wall


@ONE_PACK
def test_row_invariance_is_checked_not_assumed(kernel, monkeypatch):
    """``row_invariant`` says whether a row's product is the same alone and among others, as measured:
    a kernel whose rounding depends on the row count is caught."""
    model = fresh_model(seed=7)
    gemm = PackedGemm(model, one_pack_kernel(kernel))
    linear = model.model.layers[0].self_attn.q_proj
    rows = torch.randn(8, linear.in_features)
    with torch.no_grad(), gemm.model_forwards():
        measured = torch.equal(linear(rows), torch.cat([linear(rows[i : i + 1]) for i in range(8)]))
    assert gemm.row_invariant() == measured
    assert measured or kernel != "stream"  # the stream kernel sums every output in one order
    real = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: real(self, x) * (1 + 1e-6 * (x.shape[0] > 1)))
    assert not gemm.row_invariant()


@ONE_PACK
def test_greedy_identity_with_one_pack_and_the_reference_on_the_same_kernel(kernel):
    """Plain and speculative decoding through a one-pack kernel's linears equal HF ``generate`` run on the
    same kernel (``Backends.reference_forwards``: bench's reference), for trees of any size."""
    model = fresh_model(seed=8)
    backends = Backends(KernelOptions(linear=one_pack_kernel(kernel)))
    rng = random.Random(4)
    for _ in range(3):
        base = [rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 8))]
        prompt = base * 3
        with backends.reference_forwards(model):
            expected = hf_greedy(model, prompt, 24)
        for drafter in (None, PromptLookupDrafter(num_draft=6)):
            result = generate(model, prompt, drafter, max_new_tokens=24, eos_token_ids=[TINY_EOS], backends=backends)
            assert result.tokens == expected
    assert backends.kernels(model).linear == kernel


@ONE_PACK
def test_a_long_prompt_alone_is_prefilled_by_the_library_kernels(kernel, monkeypatch):
    """From LIBRARY_PROMPT_ROWS rows on, the model's own forwards (a prompt's prefill, the reference's first
    forward) multiply through the default kernel and attend through SDPA, but the output head keeps its
    pack; every other forward keeps the packs and the row-invariant attention, and the runtime still
    decodes exactly what the reference does."""
    monkeypatch.setattr(context, "LIBRARY_PROMPT_ROWS", 8)
    model = fresh_model(seed=11)
    backends = Backends(KernelOptions(linear=one_pack_kernel(kernel)))
    consulted, attended = [], []
    serves, sdpa = PackedGemm.library_serves, attention.sdpa_attention_forward

    def spied_serves(self, linear, rows):
        consulted.append((linear, rows, serves(self, linear, rows)))
        return consulted[-1][2]

    def spied_sdpa(module, query, *args, **kwargs):
        attended.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(PackedGemm, "library_serves", spied_serves)
    monkeypatch.setattr(attention, "sdpa_attention_forward", spied_sdpa)
    prompt = [5, 6, 7, 8, 9, 10] * 4
    with backends.reference_forwards(model):
        expected = hf_greedy(model, prompt, 16)
    for drafter in (None, PromptLookupDrafter(num_draft=12)):
        result = generate(model, prompt, drafter, max_new_tokens=16, eos_token_ids=[TINY_EOS], backends=backends)
        assert result.tokens == expected
    library = [(linear, rows) for linear, rows, served in consulted if served]
    assert library and {rows for _, rows in library} == {len(prompt)}
    assert all(linear is not model.lm_head for linear, _ in library)
    with torch.no_grad(), backends.reference_forwards(model):
        model(torch.tensor([prompt]))  # every row's logits: the head's rows stay on its pack
    assert not any(served for linear, _, served in consulted if linear is model.lm_head)
    if backends.kernels(model).rows_attention:
        assert set(attended) == {len(prompt)}


@ONE_PACK
def test_a_generation_checks_its_packs_at_its_prefill_not_at_every_forward(kernel, monkeypatch):
    """Weights stay put inside one generation: its prefill makes the packs fresh and its verification
    forwards use them without looking at every weight again, while a weight changed between two
    generations is multiplied by its new values in the next one."""
    model = fresh_model(seed=10)
    backends = Backends(KernelOptions(linear=one_pack_kernel(kernel)))
    prompt = [5, 6, 7, 8, 9] * 3
    before = generate(model, prompt, None, max_new_tokens=12, eos_token_ids=[], backends=backends).tokens
    gemm = backends.kernels(model).gemm
    checks = []
    real = PackedGemm._drop_stale_packs
    monkeypatch.setattr(PackedGemm, "_drop_stale_packs", lambda self: (checks.append(self), real(self))[1])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.down_proj.weight.mul_(-3.0)
    changed = generate(model, prompt, None, max_new_tokens=12, eos_token_ids=[], backends=backends)
    assert changed.target_forwards == 12 and checks.count(gemm) == 1  # the prefill's check alone
    with backends.reference_forwards(model):
        expected = hf_greedy(model, prompt, 12, eos=())
    assert changed.tokens == expected != before


def test_a_kernel_this_build_lacks_falls_to_the_next(monkeypatch):
    model = fresh_model(seed=9)
    monkeypatch.setattr(packed_gemm, "linear_kernel_available", lambda kernel, native=True: kernel != "onednn")
    assert packed_gemm.linear_kernel_for(model, "onednn") == "mkl"
    assert packed_gemm.linear_kernel_for(model, "stream") == "stream"
    monkeypatch.setattr(packed_gemm, "linear_kernel_available", lambda kernel, native=True: kernel != "stream")
    assert packed_gemm.linear_kernel_for(model, "stream") == "onednn"
    assert packed_gemm.linear_kernel_for(model.to(torch.bfloat16), "onednn") == "default"
    with pytest.raises(ValueError, match="unknown linear kernel"):
        packed_gemm.linear_kernel_for(model, "fast")


def test_the_stream_kernel_needs_the_cpp_extension_and_takes_any_shape():
    model = fresh_model(seed=9)
    one_pack_kernel("stream")
    assert packed_gemm.linear_kernel_for(model, "stream") == "stream"
    assert packed_gemm.linear_kernel_for(model, "stream", native=False) == packed_gemm.linear_kernel_for(
        model, "onednn"
    )
    odd = torch.nn.Sequential(torch.nn.Linear(13, 5))
    assert packed_gemm.linear_kernel_for(odd, "stream") == "stream"


@pytest.mark.parametrize("outputs, inputs", [(37, 13), (64, 300), (16, 1), (5, 129)])
def test_the_stream_kernel_sums_each_output_alike_for_any_rows_and_threads(outputs, inputs):
    """Blocks of 16 outputs and a tail, tiles of inputs and passes of up to 6 rows: each output's sum is
    the same float alone, among any number of rows and on any thread count, and is the product."""
    one_pack_kernel("stream")
    generator = torch.Generator().manual_seed(outputs * inputs)
    weight = torch.randn(outputs, inputs, generator=generator)
    rows = torch.randn(14, inputs, generator=generator)
    pack = packed_gemm.one_pack("stream", weight)
    together = packed_gemm.one_pack_product("stream", rows, pack)
    torch.testing.assert_close(together.double(), rows.double() @ weight.double().t(), rtol=1e-4, atol=1e-4)
    for count in (1, 2, 5, 7, 8, 13):
        assert torch.equal(packed_gemm.one_pack_product("stream", rows[:count], pack), together[:count])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed_gemm.one_pack_product("stream", rows, pack), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("outputs, inputs", [(37, 13), (80, 300), (16, 1), (96, 129), (112, 64)])
def test_the_stream_kernels_avx512_tiles_give_the_avx2_tiles_floats(outputs, inputs):
    """AVX-512 (four blocks of 16 outputs a tile for up to 4 rows, two blocks and up to 12 rows a pass for
    more, the last blocks alone) computes every sum as the AVX2 tiles do, so which one runs is speed only
    and changes no token."""
    one_pack_kernel("stream")
    native = native_extension()
    generator = torch.Generator().manual_seed(outputs + inputs)
    weight = torch.randn(outputs, inputs, generator=generator)
    rows = torch.randn(30, inputs, generator=generator)
    pack = packed_gemm.one_pack("stream", weight)
    skip_without_avx512()
    for count in (1, 2, 3, 8, 12, 13, 25, 30):
        narrow = native.stream_linear(rows[:count], pack, isa="avx2")
        assert torch.equal(native.stream_linear(rows[:count], pack, isa="avx512"), narrow)
        assert torch.equal(native.stream_linear(rows[:count], pack), narrow)


@pytest.mark.parametrize("outputs, inputs", [(37, 13), (80, 300), (16, 1), (96, 129)])
def test_a_bfloat16_weight_packs_in_half_the_bytes_and_gives_the_same_floats(outputs, inputs):
    """A weight whose values are all bfloat16 (a drafter exported in bfloat16) is packed as bfloat16 and
    widened exactly as it is read: bitwise the float32 pack's products, with both instruction sets; one
    value that is not a bfloat16 keeps the float32 pack."""
    one_pack_kernel("stream")
    native = native_extension()
    generator = torch.Generator().manual_seed(outputs * inputs)
    weight = torch.randn(outputs, inputs, generator=generator).bfloat16().float()
    weight[0, 0] = -0.0
    rows = torch.randn(13, inputs, generator=generator)
    narrow, wide = native.stream_pack(weight), native.stream_pack(weight, narrow=False)
    assert narrow.dtype == torch.bfloat16 and wide.dtype == torch.float32
    for isa in ["avx2"] + (["avx512"] if _has_avx512() else []):
        for count in (1, 4, 13):
            assert torch.equal(
                native.stream_linear(rows[:count], narrow, isa=isa), native.stream_linear(rows[:count], wide, isa=isa)
            )
    weight[-1, -1] = 1.0 + 2.0**-12  # 13 significant bits
    assert native.stream_pack(weight).dtype == torch.float32


CODE_FORMATS = {  # a GGUF block format as gguf-py reads it: its pack's dtype, bytes a weight x 8
    "q4_1": (q4_1_dequantised, torch.uint8, 6),
    "q8_0": (q8_0_dequantised, torch.int8, 9),
}


@pytest.mark.parametrize("blocks", sorted(CODE_FORMATS))
@pytest.mark.parametrize("outputs, inputs", [(16, 32), (48, 96), (80, 320), (576, 64)])
def test_weights_of_gguf_blocks_pack_as_their_codes_and_give_the_float32_packs_floats(outputs, inputs, blocks):
    """A weight dequantised from GGUF Q4_1 or Q8_0 blocks is packed as its 4-bit or 8-bit codes (0.75 or
    1.125 bytes a weight) and rebuilt exactly as it is read: bitwise the float32 pack's products for any
    rows, with both instruction sets. One value off the blocks' grid, a shape the code packs do not tile,
    or ``codes=False`` keep the float32 pack."""
    one_pack_kernel("stream")
    native = native_extension()
    dequantised, dtype, eighths = CODE_FORMATS[blocks]
    generator = torch.Generator().manual_seed(outputs + inputs)
    weight = dequantised(torch.randn(outputs, inputs, generator=generator))
    rows = torch.randn(33, inputs, generator=generator)
    codes, wide = native.stream_pack(weight), native.stream_pack(weight, codes=False)
    assert codes.dtype == dtype and codes.numel() == weight.numel() * eighths // 8 and wide.dtype == torch.float32
    for isa in ["avx2"] + (["avx512"] if _has_avx512() else []):
        for count in (1, 2, 3, 4, 5, 8, 9, 13, 17, 33):
            expected = native.stream_linear(rows[:count], wide, isa=isa)
            assert torch.equal(native.stream_linear(rows[:count], codes, isa=isa), expected)
    assert native.stream_pack(weight[: outputs - 8]).dtype == torch.float32  # not whole blocks of 16 outputs
    assert native.stream_pack(dequantised(torch.randn(16, 64))[:, :48].contiguous()).dtype == torch.float32
    weight[-1, -1] = torch.nextafter(weight[-1, -1], torch.tensor(1.0))
    assert native.stream_pack(weight).dtype == torch.float32


def test_no_weight_codes_reaches_the_drafters_packs_too():
    """``weight_codes=False`` keeps a drafter's own packs in float32 as well (an FSPAD drafts through rows
    of the target's Q8_0 head, which would otherwise pack as 8-bit codes)."""
    one_pack_kernel("stream")
    head = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        head.weight.copy_(q8_0_dequantised(head.weight))

    class Drafter:
        @staticmethod
        def own_modules():
            return head

    for codes, form in ((True, "exact 8-bit codes"), (False, "float32")):
        gemm = Backends(KernelOptions(linear="stream", weight_codes=codes)).drafter_gemm(Drafter())
        gemm.padded_rows(1)
        assert gemm.pack_forms() == {form: 1}


def test_a_drafters_packs_hold_its_weights_rounded_to_4bit_blocks():
    """A drafter's linears whose weights are no exact codes (a bfloat16 checkpoint's) pack as the 4-bit
    codes of their weights rounded to blocks (``drafter_codes``, the default): products bitwise the float32
    pack's of the rounded weights. Exact 8-bit codes stay exact, a width not a multiple of 32 keeps its exact
    pack, and ``drafter_codes=False`` or ``weight_codes=False`` keep every weight as it is."""
    one_pack_kernel("stream")
    native = native_extension()
    layer, head, narrow = (torch.nn.Linear(i, o, bias=False) for i, o in ((64, 48), (64, 32), (40, 16)))
    with torch.no_grad():
        for linear in (layer, narrow):
            linear.weight.copy_(linear.weight.bfloat16().float())
        head.weight.copy_(q8_0_dequantised(head.weight))
    modules = torch.nn.ModuleDict({"layer": layer, "head": head, "narrow": narrow})

    class Drafter:
        @staticmethod
        def own_modules():
            return modules

    expected = {
        (True, True): {ROUNDED_FORM: 1, "exact 8-bit codes": 1, "exact bfloat16": 1},
        (False, True): {"exact bfloat16": 2, "exact 8-bit codes": 1},
        (True, False): {"exact bfloat16": 2, "float32": 1},
    }
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    for (drafter_codes, weight_codes), forms in expected.items():
        options = KernelOptions(linear="stream", weight_codes=weight_codes, drafter_codes=drafter_codes)
        gemm = Backends(options).drafter_gemm(Drafter())
        gemm.padded_rows(1)
        assert gemm.pack_forms() == forms
        with torch.no_grad(), gemm.rows():
            product = layer(rows)
        exact = native.stream_linear(rows, native.stream_pack(layer.weight.detach(), codes=False))
        if ROUNDED_FORM in forms:
            rounded = native.stream_pack(rounded_to_four_bit_blocks(layer.weight.detach()), codes=False)
            assert torch.equal(product, native.stream_linear(rows, rounded)) and not torch.equal(product, exact)
        else:
            assert torch.equal(product, exact)


def test_packs_taken_over_by_a_later_gemm_are_taken_back_when_used_again():
    """Two drafters over one model (tune's record and decoding) each pack its linears; the first, used
    again after the second took them over, multiplies through its own packs again (its rounded codes),
    not through the default kernel."""
    one_pack_kernel("stream")
    layer = torch.nn.Linear(64, 48, bias=False)
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    first = PackedGemm(layer, "stream", round_to_codes=True)
    first.padded_rows(1)
    with torch.no_grad(), first.rows():
        before = layer(rows)
    second = PackedGemm(layer, "stream", round_to_codes=True)
    second.padded_rows(1)
    with torch.no_grad(), first.rows():
        again = layer(rows)
    assert torch.equal(again, before) and not torch.equal(before, layer(rows).detach())
    assert first.pack_forms() == {ROUNDED_FORM: 1}
    with torch.no_grad(), second.rows():
        assert torch.equal(layer(rows), before)


def test_a_target_dequantised_from_4bit_blocks_decodes_the_same_from_its_codes():
    """The tiny Llama with Q4_1-rounded linears (as the embedded GGUF target's): its stream packs hold
    codes, ``bench`` names them, and plain and speculative decoding equal the reference on the same packs,
    with and without codes (``weight_codes=False``)."""
    one_pack_kernel("stream")
    model = fresh_model(seed=9)
    with torch.no_grad():
        for linear in model.model.layers.modules():
            if isinstance(linear, torch.nn.Linear):
                linear.weight.copy_(q4_1_dequantised(linear.weight))
    prompt = [5, 9, 11, 5, 9, 11, 7, 5, 9]
    outputs = {}
    for codes in (True, False):
        backends = Backends(KernelOptions(linear="stream", weight_codes=codes))
        with backends.reference_forwards(model):
            reference = hf_greedy(model, prompt, 24)
        for drafter in (None, PromptLookupDrafter(num_draft=6)):
            result = generate(model, prompt, drafter, max_new_tokens=24, eos_token_ids=[TINY_EOS], backends=backends)
            assert result.tokens == reference
        forms = backends.kernels(model).linear_record()["pack_forms"]
        assert forms.get("exact 4-bit codes", 0) == (14 if codes else 0), forms  # 7 projections x 2 layers
        outputs[codes] = reference
    assert outputs[True] == outputs[False]


def _has_avx512() -> bool:
    try:
        skip_without_avx512()
    except pytest.skip.Exception:
        return False
    return True


@pytest.mark.parametrize(
    "cap, warned", [("avx3", True), ("avx2", False), ("avx512", False), ("amx", False), ("", False)]
)
def test_an_unknown_instruction_set_cap_is_ignored_with_a_warning(cap, warned):
    """``DRAFTSMITH_MAX_CPU_ISA`` (read once per process) names avx2, avx512 or amx; a typo must not silently
    leave a user believing the cap holds. Below amx it keeps the screen off AMX tiles."""
    built = native_extension()
    assert built is not None  # built (cached) before the child process loads it
    code = (
        "import torch; from draftsmith.inference.kernels.native import native_extension as n; e = n(); "
        "e.stream_linear(torch.zeros(1, 16), e.stream_pack(torch.zeros(16, 16))); print(e.amx_available())"
    )
    env = {**os.environ, "DRAFTSMITH_MAX_CPU_ISA": cap}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert ("DRAFTSMITH_MAX_CPU_ISA=avx3 is neither avx2, avx512 nor amx; ignored" in done.stderr) == warned
    assert done.stdout.split()[-1] == str(built.amx_available() and cap not in ("avx2", "avx512"))


@pytest.mark.parametrize("family", ["eagle3", "fspad"])
@pytest.mark.parametrize("linear", ["auto", "stream", "onednn", "default"])
def test_an_eagle_drafter_drafts_through_its_own_packs_and_decodes_the_same(linear, family, monkeypatch):
    """The drafter's own linears run through the options' one-pack kernel during its rounds, and so does
    an EAGLE-1 family's head (the target's lm_head rows over its draft vocabulary, copied); the target
    keeps its own packs, and the tokens stay plain decoding's."""
    from draftsmith.drafters.base import TreeOptions
    from draftsmith.drafters.registry import get_family

    if linear not in ("auto", "default"):
        one_pack_kernel(linear)
    model = fresh_model(seed=2)
    torch.manual_seed(0)
    drafter_model = get_family(family).build(model.config, {"draft_vocab_size": 32}).eval()
    drafter = drafter_model.runtime_drafter(model, TreeOptions(depth=2, top_k=2, total_tokens=3))
    backends = Backends(KernelOptions(linear=linear))
    gemm = backends.drafter_gemm(drafter)
    assert (gemm is not None) == (linear != "default")
    packed_during_rounds = []
    propose = drafter.propose
    monkeypatch.setattr(
        drafter, "propose", lambda c: packed_during_rounds.append(bool(gemm and gemm.active)) or propose(c)
    )
    prompt = [5, 17, 33, 2, 64, 8]
    ours = generate(model, prompt, drafter, max_new_tokens=12, backends=backends)
    assert ours.tokens == generate(model, prompt, None, max_new_tokens=12, backends=backends).tokens
    assert packed_during_rounds and all(packed_during_rounds) == (linear != "default")
    if gemm is not None:
        linears = [m for m in drafter.own_modules().modules() if isinstance(m, torch.nn.Linear)]
        head = drafter.head.runtime_module()  # None: the head is the drafter's own (EAGLE-3)
        assert (head is None) == (family == "eagle3") and (head is None or any(m is head for m in linears))
        assert all(type(m) is PackedLinear and m._owner is gemm and m._packs for m in linears)
        assert backends.kernels(model).gemm is not gemm and model.lm_head._owner is not gemm


def test_auto_times_the_one_pack_kernels_once_per_machine_and_remembers(monkeypatch, tmp_path, capsys):
    """``--linear auto`` takes the faster kernel as timed on this machine, then reads the answer back
    (keyed by CPU, torch release, threads and the model's shapes) instead of timing again."""
    from draftsmith.inference.kernels import linear_choice

    one_pack_kernel("stream")  # the key says what its packs hold
    model = fresh_model(seed=10)
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    monkeypatch.setattr(packed_gemm, "linear_kernel_available", lambda kernel, native=True: True)
    timed = []
    speeds = {"stream": 2.0, "onednn": 1.0}
    monkeypatch.setattr(
        linear_choice, "_seconds", lambda weights, kernels, **packing: [timed.append(k) or speeds[k] for k in kernels]
    )
    assert packed_gemm.linear_kernel_for(model, "auto") == "onednn"
    assert sorted(timed) == ["onednn", "stream"] and "using onednn" in capsys.readouterr().err
    speeds = {"stream": 1.0, "onednn": 2.0}
    assert packed_gemm.linear_kernel_for(model, "auto") == "onednn"  # remembered, not timed again
    assert len(timed) == 2
    other_shapes = tiny_llama(VOCAB, seed=10, hidden_size=96)
    assert packed_gemm.linear_kernel_for(other_shapes, "auto") == "stream"
    assert len(timed) == 4


def test_auto_times_again_where_the_stream_packs_hold_another_form(monkeypatch, tmp_path):
    """The same shapes with weights that are exact 4-bit codes (read in a fraction of float32's time) are
    timed on their own, not given the answer timed on float32 weights (a merged LoRA copy or a fine-tune
    of the target timed first had made every later run of the target take oneDNN); the packs timed are
    those decoding makes, so ``weight_codes=False`` gets the float32 answer."""
    from draftsmith.inference.kernels import linear_choice

    one_pack_kernel("stream")
    one_pack_kernel("onednn")
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    timed = []

    def seconds(weights, kernels, codes, round_to_codes):
        coded = packed_gemm.stream_pack_made(weights[0], codes)[0].dtype in packed_gemm.CODE_DTYPES
        timed.append(coded)
        return [1.0 if (kernel == "stream") == coded else 2.0 for kernel in kernels]

    monkeypatch.setattr(linear_choice, "_seconds", seconds)
    floats = fresh_model(seed=15)
    coded = fresh_model(seed=15)
    with torch.no_grad():
        for module in coded.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.shape[1] % 32 == 0:
                module.weight.copy_(rounded_to_four_bit_blocks(module.weight))
    assert packed_gemm.linear_kernel_for(floats, "auto") == "onednn" and timed == [False]
    assert packed_gemm.linear_kernel_for(coded, "auto") == "stream" and timed == [False, True]
    assert packed_gemm.linear_kernel_for(coded, "auto") == "stream" and len(timed) == 2  # remembered
    assert KernelContext(coded, KernelOptions(weight_codes=False)).linear == "onednn"


def test_timing_the_kernels_leaves_torchs_random_numbers_alone(monkeypatch, tmp_path):
    """The first run on a machine times the kernels on random rows of its own: a user who seeded torch for
    sampling draws the same numbers on that run as on every later one, which reads the remembered choice."""
    from draftsmith.inference.kernels import linear_choice

    one_pack_kernel("stream")
    one_pack_kernel("onednn")
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    model = fresh_model(seed=16)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert packed_gemm.linear_kernel_for(model, "auto") in ("stream", "onednn")
    assert torch.equal(torch.rand(4), expected)


def test_auto_without_a_choice_takes_what_serves(monkeypatch, tmp_path):
    from draftsmith.inference.kernels import linear_choice

    model = fresh_model(seed=11)
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    monkeypatch.setattr(linear_choice, "_seconds", lambda *timed, **packing: pytest.fail("nothing to choose between"))
    monkeypatch.setattr(packed_gemm, "linear_kernel_available", lambda kernel, native=True: kernel != "stream")
    assert packed_gemm.linear_kernel_for(model, "auto") == "onednn"
    monkeypatch.setattr(packed_gemm, "linear_kernel_available", lambda kernel, native=True: kernel == "default")
    assert packed_gemm.linear_kernel_for(model, "auto") == "default"


def test_auto_times_real_packs_of_the_model(tmp_path, monkeypatch):
    """The timing itself on real packs: a kernel that serves here, and the answer on disk."""
    from draftsmith.inference.kernels import linear_choice

    one_pack_kernel("stream")
    one_pack_kernel("onednn")
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    chosen = packed_gemm.linear_kernel_for(fresh_model(seed=12), "auto")
    assert chosen in packed_gemm.ONE_PACK_KERNELS
    assert list(json.loads((tmp_path / "choices.json").read_text()).values()) == [chosen]


def test_the_screened_heads_hand_over_is_timed_once_per_machine_and_remembered(monkeypatch, tmp_path):
    """The row count from which greedy verification takes the float32 head is timed once, read back
    after, and timed again where the remembered value is not one it could be (a hand edit)."""
    from draftsmith.inference.kernels import linear_choice

    one_pack_kernel("stream")
    path = tmp_path / "choices.json"
    monkeypatch.setattr(linear_choice, "choices_path", lambda: path)
    timed = []
    monkeypatch.setattr(KernelContext, "_time_full_head_from", lambda self, screened: timed.append(1) or 8)
    model = fresh_model(seed=13)

    def hand_over():
        return KernelContext(model, KernelOptions(linear="stream")).greedy_head().full_head_from

    assert hand_over() == 8 and hand_over() == 8 and len(timed) == 1
    path.write_text(json.dumps({key: "8 rows" for key in json.loads(path.read_text())}))
    assert hand_over() == 8 and len(timed) == 2


def test_the_hand_over_timing_runs_on_real_kernels(monkeypatch, tmp_path):
    """The timing itself (streaming the layers before each timed head): an answer it can hold."""
    from draftsmith.inference.kernels import context, linear_choice

    one_pack_kernel("stream")
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    head = KernelContext(fresh_model(seed=14), KernelOptions(linear="stream")).greedy_head()
    assert head.full_head_from in (None, *context.FULL_HEAD_CANDIDATES)


def test_the_screens_amx_row_count_is_timed_on_real_kernels_once_per_machine(monkeypatch, tmp_path):
    """Where the CPU has AMX tiles, the row count from which they sum the screen is timed on the head's own
    int8 copy (an answer it can hold), then read back instead of timed again; elsewhere there is none."""
    from draftsmith.inference.kernels import context, linear_choice
    from draftsmith.inference.kernels.native import native_extension

    one_pack_kernel("stream")
    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    model = fresh_model(seed=15)
    first = KernelContext(model, KernelOptions(linear="stream")).greedy_head().tiles_from
    built = native_extension()
    if not (built.vnni_available() and built.amx_available()) or built.isa_in_use() != "avx512":
        assert first is None
        return
    assert first in (None, *context.TILES_CANDIDATES)
    monkeypatch.setattr(KernelContext, "_time_tiles_from", lambda self, screened, native: pytest.fail("timed again"))
    assert KernelContext(model, KernelOptions(linear="stream")).greedy_head().tiles_from == first


def test_huge_page_tensors_hold_their_values_apart():
    """The extension's huge-page tensors (stream packs, the screen's int8 copy, the floor's buffer): many
    of several sizes and dtypes share mappings without overlapping, and one larger than a mapping gets
    its own; each keeps what was written to it after the others are freed."""
    from draftsmith.inference.kernels.native import native_extension

    extension = native_extension()
    sizes = [(3, 5), (1000, 577), (4096, 1024), (17 * 2**20,), (1,), (300, 300)]
    tensors = []
    for i, shape in enumerate(sizes * 3):
        dtype = (torch.float32, torch.int8, torch.bfloat16)[i % 3]
        made = extension.huge_page_empty(list(shape), dtype)
        assert made.shape == shape and made.dtype == dtype and made.is_contiguous()
        made.fill_(i % 100)
        tensors.append((i, made))
    for i, made in tensors[::2]:
        assert torch.all(made == i % 100)
    del tensors[1::2]
    for i, made in tensors:
        assert torch.all(made == i % 100)
