"""Every instruction-set path of the C++ kernels this CPU runs (AVX2 everywhere, AVX-512 where the CPU has it),
forced in turn as ``DRAFTSMITH_ISA`` forces one: each is row-invariant, a plain step is bitwise a tree's root
row, and greedy decoding through it is plain decoding's, on packs of exact 4-bit and 8-bit codes."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.cache import preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import TreeInputBuffers
from draftsmith.inference.backends import Backends, FastPaths, verification_forward
from draftsmith.inference.kernels import linear_choice
from draftsmith.inference.kernels.attention import model_attention
from draftsmith.inference.kernels.direct import direct_forward_for
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import PackedGemm, linear_kernel_available
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, q4_1_dequantised, q8_0_dequantised, seeded_random_tree

VOCAB = 97
PROMPT = [5, 17, 33, 2, 61, 8, 40, 17, 33]
ISAS = ("avx2", "avx512")


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    """``request.param`` forced for every kernel, as ``DRAFTSMITH_ISA`` forces it; the choice forgotten after."""
    if not linear_kernel_available("stream"):
        pytest.skip("the C++ kernels do not run here")
    if request.param not in native_extension().isas_available():
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    monkeypatch.setenv(linear_choice.FORCED_ISA, request.param)
    linear_choice.use_isa(None)
    yield request.param
    linear_choice.use_isa(None)


def coded_llama(seed: int):
    """The tiny Llama with its projections' weights as GGUF Q4_1 blocks hold them (the down projections as
    Q8_0's): its stream packs hold exact 4-bit and 8-bit codes."""
    model = tiny_llama(VOCAB, seed=seed)
    with torch.no_grad():
        for name, module in model.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                blocks = q8_0_dequantised if name.endswith("down_proj") else q4_1_dequantised
                module.weight.copy_(blocks(module.weight))
    return model


def test_a_forced_path_runs_in_every_kernel(isa):
    """``DRAFTSMITH_ISA`` is taken without timing, and ``auto`` in every kernel follows it; a path the CPU
    does not run is refused in one line."""
    assert linear_choice.choose_isa(tiny_llama(VOCAB)) == isa
    assert native_extension().isa_in_use() == isa
    with pytest.raises(RuntimeError, match="does not run on this CPU"):
        native_extension().set_isa("avx1024")


@pytest.mark.parametrize("blocks", [q4_1_dequantised, q8_0_dequantised], ids=["q4_1", "q8_0"])
def test_each_path_is_row_invariant_and_computes_the_float32_packs_floats(isa, blocks):
    """Any row's output is the same float whichever rows come with it (passes of 1 to 8 rows, and more),
    and the code pack's floats are the float32 pack's."""
    native = native_extension()
    generator = torch.Generator().manual_seed(7)
    weight = blocks(torch.randn(80, 96, generator=generator))
    rows = torch.randn(19, 96, generator=generator)
    codes, wide = native.stream_pack(weight), native.stream_pack(weight, codes=False)
    assert codes.dtype in (torch.uint8, torch.int8)
    everything = native.stream_linear(rows, codes)
    for count in range(1, rows.shape[0]):
        assert torch.equal(native.stream_linear(rows[:count], codes), everything[:count])
        assert torch.equal(native.stream_linear(rows[count : count + 1], codes), everything[count : count + 1])
    assert torch.equal(everything, native.stream_linear(rows, wide))


@pytest.mark.parametrize("nodes", [1, 6])
def test_a_plain_step_is_bitwise_a_trees_root_row(isa, nodes):
    """A one-token step's logits are the root row's of a tree forward over the same cache, through the C++
    layers and the code packs of this path."""
    model = coded_llama(seed=nodes)
    gemm = PackedGemm(model, "stream")
    direct = direct_forward_for(model)
    tree = seeded_random_tree(nodes, nodes, VOCAB)
    logits = []
    for forward_tree in (seeded_random_tree(0, 0, VOCAB), tree):
        cache = preallocated_cache_for(model.config, 64)
        with torch.no_grad(), model_attention(model):
            model(torch.tensor([PROMPT[:-1]]), **cache_kwargs(cache), use_cache=True)
            inputs = TreeInputBuffers(8, 64, torch.float32)
            past = len(PROMPT) - 1
            paths = FastPaths(gemm=gemm, direct=direct)
            out = verification_forward(model, cache, inputs, PROMPT[-1], forward_tree, past, False, paths)
        logits.append(out.logits.reshape(-1, VOCAB))
    assert "exact 4-bit codes" in gemm.pack_forms() and "exact 8-bit codes" in gemm.pack_forms()
    assert torch.equal(logits[0][0], logits[1][0])


def test_greedy_decoding_through_each_path_is_plain_decoding(isa):
    model = coded_llama(seed=2)
    backends = Backends(KernelOptions(linear="stream"))
    with backends.reference_forwards(model):
        reference = hf_greedy(model, PROMPT, 24)
    for drafter in (None, PromptLookupDrafter(num_draft=4)):
        result = generate(model, PROMPT, drafter, max_new_tokens=24, eos_token_ids=[2], backends=backends)
        assert result.tokens == reference
    assert native_extension().isa_in_use() == isa


def test_the_screens_amx_tiles_follow_the_path(isa, monkeypatch, tmp_path):
    """The screen's sums go on AMX tiles only beside the AVX-512 path (its VNNI sums the tiles' tails), so a
    process on the AVX2 path neither times them nor names them in its records."""
    from draftsmith.inference.kernels.context import TILES_CANDIDATES, KernelContext

    monkeypatch.setattr(linear_choice, "choices_path", lambda: tmp_path / "choices.json")
    timed = TILES_CANDIDATES[2]  # what the timing would find: a tiny model's screen gives no stable answer
    monkeypatch.setattr(KernelContext, "_time_tiles_from", lambda self, screened, native: timed)
    context = KernelContext(coded_llama(seed=3), KernelOptions(linear="stream"))
    tiles_from = context.greedy_head().tiles_from
    built = native_extension()
    assert tiles_from == (timed if isa == "avx512" and built.amx_available() and built.vnni_available() else None)
    assert context.linear_record()["screen_tiles_from"] == tiles_from


def test_the_widest_path_is_kept_unless_a_narrower_one_is_clearly_faster():
    """The choice is process-wide (the head's VNNI screen, the attention and the proof follow it), so a
    tie of the stream kernel's timings keeps the widest path; a narrower one needs a clear margin."""
    assert linear_choice.isa_from_timings({"avx2": 4.0, "avx512": 4.1}) == "avx512"
    assert linear_choice.isa_from_timings({"avx2": 3.0, "avx512": 4.1}) == "avx2"
    assert linear_choice.isa_from_timings({"avx2": 4.0, "avx512": 3.0}) == "avx512"
    assert linear_choice.isa_from_timings({"avx2": 4.0}) == "avx2"
