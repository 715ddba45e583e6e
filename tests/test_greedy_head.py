"""The screened greedy head: exactly the float32 head's argmax (random rows, forced near ties, non-finite
rows), a bound that holds for every token of this machine's int8 kernel, a screen that is wrong
without the proof, and the runtime using it only where the logits are not needed."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TINY_TARGETS, tiny_gemma3, tiny_llama
from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree
from draftsmith.inference.backends import Backends
from draftsmith.inference.kernels.greedy_head import _FP32_UNIT, _SAFETY, GreedyHead, _int16_rows, greedy_head_supported
from draftsmith.inference.kernels.native import native_extension
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, skip_without_avx512

VOCAB, HIDDEN = 3000, 64
# the contender search in Python and in the runtime's C++ extension (which the tests expect to build)
SEARCHES = pytest.mark.parametrize(
    "native",
    [False, "avx2", "avx512", "madd", "vnni", "amx"],
    ids=["python", "c++ avx2", "c++ avx512", "c++ int16 avx2", "c++ vnni", "c++ amx"],
)


class FixedInstructions:
    """The C++ extension with its screen, contender search and proof held to one instruction set (``auto``
    picks AVX-512 where the CPU has it, so the other code would otherwise go untested on such a CPU), and
    its screen to torch's int8 product of bfloat16 rows or to the extension's exact one of 16-bit integer rows
    (with ``isa`` ``"avx2"`` AVX2's sums, ``"avx512"`` VNNI's where the CPU has it, ``"amx"`` AMX tiles' at any
    row count)."""

    def __init__(self, built, isa: str, vnni: bool = False) -> None:
        self.built, self.isa, self.vnni = built, isa, vnni

    def __getattr__(self, name: str):
        return getattr(self.built, name)

    def int16_screen_available(self):
        return self.vnni and self.built.int16_screen_available(isa=self.isa)

    def int16_screen(self, *args, tiles_from: int = 0):
        return self.built.int16_screen(*args, isa=self.isa, tiles_from=tiles_from)

    def screen_contenders(self, *args):
        return self.built.screen_contenders(*args, isa=self.isa)

    def proven_argmax(self, *args):
        return self.built.proven_argmax(*args, isa=self.isa)

    def greedy_tokens(self, *args, tiles_from: int = 0):
        return self.built.greedy_tokens(*args, isa=self.isa, tiles_from=tiles_from)


def extension(native: bool | str):
    """None (Python and torch), the C++ extension (``True``), or the extension with its vector code held
    to one instruction set (``"avx2"``, ``"avx512"``; with the 16-bit integer screen: ``"madd"`` its AVX2 sums,
    ``"vnni"`` AVX-512 VNNI's, ``"amx"`` AMX tiles'; skipped where the CPU lacks it)."""
    if not native:
        return None
    built = native_extension()
    assert built is not None, "the C++ extension should build here"
    if native is True:
        return built
    if not built.simd_supported():
        pytest.skip("the C++ kernels need an x86-64 CPU with AVX2 and FMA")
    if native in ("avx512", "vnni", "amx"):
        skip_without_avx512()
    if native in ("vnni", "amx") and not built.vnni_available():
        pytest.skip("this CPU has no AVX-512 VNNI")
    if native == "amx" and not built.amx_available():
        pytest.skip("this CPU (or its OS) has no AMX tiles")
    isa = {"vnni": "avx512", "madd": "avx2"}.get(native, native)
    return FixedInstructions(built, isa, vnni=native in ("madd", "vnni", "amx"))


def head(seed: int, vocab: int = VOCAB, hidden: int = HIDDEN) -> nn.Linear:
    """A head with SmolLM2's scale: rows of norm ~3, inputs of norm ~45."""
    layer = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed)) * 0.4)
    return layer


def rows(n: int, seed: int, hidden: int = HIDDEN) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 5.6


def float32_argmax(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """What plain decoding computes: the float32 head one row at a time."""
    return torch.stack([F.linear(row[None], layer.weight).argmax(-1)[0] for row in x])


@SEARCHES
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_screened_head_returns_the_float32_argmax(batch, native):
    layer = head(0)
    greedy = GreedyHead(layer)
    x = rows(240, 1)
    got = torch.cat([greedy(x[i : i + batch], extension(native)) for i in range(0, len(x), batch)])
    assert torch.equal(got, float32_argmax(layer, x))
    assert greedy.rows == len(x)
    assert greedy.fallback_rows < len(x) // 10  # the proof settles nearly every row by itself


def test_from_full_head_from_rows_on_the_float32_head_takes_over():
    """Forwards of ``full_head_from`` rows or more take the float32 head's argmax (no screen): the same
    tokens; fewer rows keep the screen."""
    layer = head(4)
    greedy = GreedyHead(layer, full_head_from=4)
    x = rows(64, 5)
    screened_before = greedy.fallback_rows
    got = torch.cat([greedy(x[i : i + 8]) for i in range(0, len(x), 8)] + [greedy(x[:3])])
    assert torch.equal(got, float32_argmax(layer, torch.cat([x, x[:3]])))
    assert greedy.rows == len(x) + 3
    calls = []
    greedy.head = lambda rows: calls.append(rows.shape[0]) or layer(rows)
    greedy(x[:8]), greedy(x[:2])
    assert calls == [8]  # 2 rows went through the screen (and, with a clear winner, no fallback)
    assert greedy.fallback_rows == screened_before


def test_a_leading_dimension_is_kept():
    layer = head(2)
    x = rows(6, 3).reshape(2, 3, HIDDEN)
    assert GreedyHead(layer)(x).shape == (2, 3)


# the screen's int8 product: torch's of bfloat16 rows, and the C++ extension's exact one of 16-bit integer rows
# (weights read once for all rows) with each of its instruction sets
SCREENS = pytest.mark.parametrize(
    "native", [False, "madd", "vnni", "amx"], ids=["torch", "c++ int16 avx2", "c++ vnni", "c++ amx"]
)


@SCREENS
@pytest.mark.parametrize("count", [1, 5, 8, 17, 64])
def test_every_token_is_within_its_bound_on_this_machines_kernel(native, count):
    """The bound must hold for the screens that actually run here (torch's float32 sums of bfloat16 rows, the
    extension's exact sums of 16-bit integer rows on each instruction set), for every token of every row
    (counts that take each of the C++ kernels' row groups, and a vocabulary that leaves a remainder of tokens)."""
    layer = head(4, vocab=VOCAB + 3)
    greedy = GreedyHead(layer)
    x = rows(count, 5)
    screen_input, screen = greedy.screen_rows(x, extension(native))
    screen = screen.float()
    bounds = greedy.screen_bounds(x, screen_input, screen.clone())
    exact = (x.double() @ layer.weight.double().T).float()
    assert bool(((exact - screen).abs() <= bounds).all())


def test_the_vnni_screen_is_the_integer_rows_product_to_its_output_rounding():
    """Exact integer sums, then three float32 products and the bfloat16 rounding; and on rows with an
    outlier feature (real hidden states have them) its 16-bit rows are far closer to the float32 ones
    than bfloat16 rows, so its bound is tighter."""
    greedy = GreedyHead(head(11, vocab=VOCAB + 3))
    x = rows(9, 12)
    x[:, 5] *= 30
    screen_input, screen = greedy.screen_rows(x, extension("vnni"))
    exact = screen_input @ (greedy.quantized.double() * greedy.scales.double()[:, None]).T
    assert bool(((screen.double() - exact).abs() <= exact.abs() * (2.0**-8 + 4 * 2.0**-24) + 1e-30).all())
    bfloat16 = greedy.screen_rows(x, extension("avx512"))[0].double()
    assert bool(((x.double() - screen_input).norm(dim=1) < (x.double() - bfloat16).norm(dim=1) / 4).all())


@pytest.mark.parametrize("sums", ["madd", "vnni", "amx"], ids=["avx2", "vnni", "amx"])
@pytest.mark.parametrize(
    ("count", "width", "vocab"),
    [(1, 64, 1000), (3, 576, 1039), (8, 128, 48), (9, 640, 333), (17, 192, 77), (5, 96, 200)],
    ids=["1-row", "3-rows", "8-rows", "9-rows", "17-rows", "width-96"],
)
def test_every_int16_screen_sums_the_exact_integers(sums, count, width, vocab):
    """AVX2's, VNNI's and the AMX tiles' sums (two signed bytes per input there) are the same exact int32, so
    the same screen bitwise: passes of 8 rows, tokens past the last whole tile of 16 (VNNI's), a width that is
    no multiple of 64 (VNNI's alone on AMX), inputs at the ends of the range and one past the tiles' (that row's
    sums through VNNI), each output the product of the exact sum, the row's scale and the token's rounded to
    float32 and then to bfloat16 (NaN where a scale is)."""
    native = extension(sums)
    generator = torch.Generator().manual_seed(count * width)
    quantized = torch.randint(-127, 128, (vocab, width), dtype=torch.int8, generator=generator)
    scales = (torch.rand(vocab, generator=generator) + 0.01).to(torch.bfloat16)
    top = min(127 * 256 + 127, (2**31 - 1) // (127 * width))
    integers = torch.randint(-top, top + 1, (count, width), dtype=torch.int16, generator=generator)
    integers[0, :3] = torch.tensor([top, -top, -32768 if width * 127 * 32768 < 2**31 else -top])
    row_scales = torch.rand(count, generator=generator) * 1e-3
    if count > 1:
        row_scales[1] = float("nan")

    def expected() -> torch.Tensor:
        exact = (integers.double() @ quantized.double().T).float()  # exact: the sums are below 2**31
        return screen_bits(exact * row_scales[:, None] * scales.float()[None])

    assert torch.equal(native.int16_screen(integers, row_scales, quantized, scales).view(torch.int16), expected())
    if sums != "amx":
        return
    auto = native_extension().int16_screen(integers, row_scales, quantized, scales, tiles_from=1)
    assert torch.equal(auto.view(torch.int16), expected())
    if top == 127 * 256 + 127:  # a hand-made input past the tiles' range: its row through VNNI
        integers[-1, -1] = 32767
        assert torch.equal(native.int16_screen(integers, row_scales, quantized, scales).view(torch.int16), expected())


def screen_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to bfloat16 as c10::BFloat16 rounds them (to nearest even; a NaN of either
    sign becomes 0x7FC0), as int16 bits."""
    bits = values.to(torch.bfloat16).view(torch.int16)
    return bits.masked_fill(values.isnan(), 0x7FC0)


def near_tie(margin: float) -> tuple[nn.Linear, torch.Tensor, int, int]:
    """A head whose two best tokens (``low`` first, ``high`` second) are the same int8 row, the second
    ahead in float32 by ``margin`` times the input's norm squared."""
    layer = head(6, vocab=50)
    x = torch.full((HIDDEN,), 1.0)
    low, high = 10, 30
    with torch.no_grad():
        layer.weight[low] = 0.5
        layer.weight[low, 0] = 1.0  # keeps the row's int8 scale where it is
        layer.weight[high] = layer.weight[low]
        layer.weight[high, 1:] += margin  # far below the int8 step: the screen cannot tell them apart
    return layer, x[None], low, high


@SEARCHES
def test_the_screen_alone_picks_the_wrong_token_and_the_proof_does_not(native):
    layer, x, low, high = near_tie(1e-4)
    greedy = GreedyHead(layer)
    screen = torch._weight_int8pack_mm(x.to(torch.bfloat16), greedy.quantized, greedy.scales).float()
    assert int(screen.argmax()) == low  # a lossy rule: trusting the screen commits the wrong token
    assert int(float32_argmax(layer, x)[0]) == high
    assert int(greedy(x, extension(native))[0]) == high


@SEARCHES
def test_a_tie_closer_than_float32_rounding_takes_the_float32_head(native):
    layer, x, _, _ = near_tie(1e-9)
    greedy = GreedyHead(layer)
    assert int(greedy(x, extension(native))[0]) == int(float32_argmax(layer, x)[0])
    assert greedy.fallback_rows == 1


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_the_c_plus_plus_search_finds_the_python_contenders(isa):
    """Same floors (to float32 rounding) and the same contender sets on random rows, and the float32
    argmax always among them."""
    layer = head(9)
    greedy = GreedyHead(layer)
    x = rows(64, 10)
    screen_input = x.to(torch.bfloat16)
    screen = torch._weight_int8pack_mm(screen_input, greedy.quantized, greedy.scales)
    python = greedy._contenders(x, screen_input, screen, None)
    native = greedy._contenders(x, screen_input, screen, extension(isa))
    assert torch.allclose(native[0], python[0], rtol=1e-6, atol=0)
    best = float32_argmax(layer, x)
    for row, (ours, theirs) in enumerate(zip(native[1], python[1], strict=True)):
        assert torch.equal(ours, theirs)
        assert int(best[row]) in ours.tolist()


def test_the_wide_contender_search_computes_the_narrow_ones_floats():
    """AVX-512 and plain code give bitwise the same floors and contenders, over several spans of the
    vocabulary, a remainder of tokens and a row with an infinity."""
    greedy = GreedyHead(head(9, vocab=2 * 8192 + 21))
    x = rows(6, 13)
    x[4, 3] = float("inf")
    screen_input = x.to(torch.bfloat16)
    screen = torch._weight_int8pack_mm(screen_input, greedy.quantized, greedy.scales)
    narrow = greedy._contenders(x, screen_input, screen, extension("avx2"))
    wide = greedy._contenders(x, screen_input, screen, extension("avx512"))
    assert torch.equal(wide[0].isnan(), narrow[0].isnan()) and bool(narrow[0].isnan().any())
    assert torch.equal(wide[0].nan_to_num(), narrow[0].nan_to_num())
    for ours, theirs in zip(wide[1], narrow[1], strict=True):
        assert torch.equal(ours, theirs)


def test_the_extensions_screen_inputs_are_the_pythons():
    """Integer rows and scales bitwise GreedyHead's, the bounds' coefficients to float32 rounding and never
    below them (another summation order of the same float64 norms), over rows of very different ranges."""
    native = extension("vnni")
    greedy = GreedyHead(head(3))
    x = rows(16, 23) * torch.logspace(-6, 6, 16)[:, None]
    x[3, :5] = 0.0
    x[5, 7] = 1e4  # one large value: the int16 rounding of the others is coarse
    integers, scales, coefficients = native.screen_inputs(x, greedy._gamma32, _FP32_UNIT, _SAFETY)
    python_integers, python_scales = _int16_rows(x)
    assert torch.equal(integers, python_integers) and torch.equal(scales, python_scales)
    python = greedy._coefficients(x, python_integers.double() * python_scales.double()[:, None])
    assert torch.allclose(coefficients, python, rtol=1e-6, atol=0)
    assert bool((coefficients >= python * (1 - 2**-23)).all())


@pytest.mark.parametrize("margin", [1e-2, 1e-4, 1e-6, 1e-7, 1e-9])
def test_the_one_call_head_settles_every_row_as_the_step_by_step_one(margin):
    """The extension's greedy_tokens (rounding, screen, bounds, contenders and proofs in one call) against
    the same steps through GreedyHead's Python: the same token for every row and the same rows left to the
    float32 head, on random rows, near ties down to below float32's rounding and a non-finite row."""
    native = extension("vnni")
    layer, tie, _, _ = near_tie(margin)
    x = torch.cat([rows(40, 21), tie, tie * 3.0, rows(1, 22).fill_(float("nan"))])
    one_call, step_by_step = GreedyHead(layer), GreedyHead(layer)
    assert torch.equal(one_call(x, native), torch.tensor(step_by_step._tokens(x, native)))
    assert one_call.fallback_rows == step_by_step.fallback_rows >= 1


@SEARCHES
def test_a_non_finite_row_takes_the_float32_head(native):
    layer = head(7)
    greedy = GreedyHead(layer)
    x = rows(2, 8)
    x[1, 3] = float("inf")
    got = greedy(x, extension(native))
    assert int(got[0]) == int(float32_argmax(layer, x[:1])[0])
    assert int(got[1]) == int(F.linear(x[1:], layer.weight).argmax())
    assert greedy.fallback_rows == 1


@pytest.mark.parametrize(
    "layer",
    [
        nn.Linear(64, 10, bias=True),
        nn.Linear(48, 10, bias=False),  # the int8 kernel reads 16-value blocks past a 48-wide row
        nn.Linear(64, 10, bias=False).double(),
    ],
    ids=["bias", "hidden-48", "float64"],
)
def test_heads_the_screen_cannot_serve_are_refused(layer):
    model = nn.Module()
    model.lm_head = layer
    assert not greedy_head_supported(model)


class _LogitReader(Drafter):
    """A drafter that needs the logits (as SPECTRA does) and records what it got."""

    reads_logits = True

    def __init__(self) -> None:
        self.seen: list[torch.Tensor | None] = []

    def propose(self, context: DraftContext) -> DraftTree:
        return DraftTree.empty()

    def observe(self, tree, logits, verdict) -> None:
        self.seen.append(logits)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_the_runtime_verifies_through_the_screened_head_and_equals_plain_decoding(architecture):
    """Through the direct forward (Llama) or the model's own base model (Gemma-3, whose sliding window
    is shorter than these decodes): the screened head's tokens are plain decoding's."""
    model = TINY_TARGETS[architecture](97, seed=3)
    prompt = [5, 17, 33, 2, 61, 8, 40, 17, 33, 61, 8]
    backends = Backends()
    greedy = backends.kernels(model).greedy_head()
    assert greedy is not None
    reference = hf_greedy(model, prompt, 24)
    for drafter in (None, PromptLookupDrafter()):
        before = greedy.rows
        out = generate(model, prompt, drafter, max_new_tokens=24, eos_token_ids=[2], backends=backends)
        assert out.tokens == reference
        assert greedy.rows > before
    reader = _LogitReader()
    before = greedy.rows
    assert generate(model, prompt, reader, max_new_tokens=24, eos_token_ids=[2], backends=backends).tokens == reference
    assert greedy.rows == before and all(logits is not None for logits in reader.seen)
    unscreened = Backends(KernelOptions(greedy_head=False))
    plain = generate(model, prompt, None, max_new_tokens=24, eos_token_ids=[2], backends=unscreened)
    assert plain.tokens == reference and greedy.rows == before


def test_a_head_changed_after_the_screen_was_built_gets_a_new_screen():
    """A screen built from old weights could miss the new argmax: in-place changes and a replaced
    weight both rebuild it."""
    model = tiny_llama(97, seed=4)
    prompt = [5, 17, 33, 2, 61, 8, 40]
    backends = Backends()
    kernels = backends.kernels(model)

    def decodes_greedily() -> bool:
        decoded = generate(model, prompt, None, max_new_tokens=12, eos_token_ids=[2], backends=backends).tokens
        return decoded == hf_greedy(model, prompt, 12)

    first = kernels.greedy_head()
    assert decodes_greedily()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.flip(0))  # every token's row moves
    second = kernels.greedy_head()
    assert second is not first and kernels.greedy_head() is second
    assert decodes_greedily()
    model.lm_head.weight = nn.Parameter(torch.randn_like(model.lm_head.weight))
    assert kernels.greedy_head() is not second
    assert decodes_greedily()


def test_the_screened_head_stands_in_for_an_own_forward_only_where_the_logits_are_the_plain_head():
    """A final logit softcapping (Gemma-2's) or a hook on the skipped outer forward keeps the logits."""
    assert Backends().kernels(tiny_gemma3(97)).greedy_head() is not None
    assert Backends().kernels(tiny_gemma3(97, final_logit_softcapping=30.0)).greedy_head() is None
    hooked = tiny_gemma3(97)
    hooked.register_forward_hook(lambda module, args, output: None)
    assert Backends().kernels(hooked).greedy_head() is None


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_flat_rows_proof_split_between_threads_settles_as_the_python_proof(isa):
    """A row whose contenders are thousands (flat logits: random tokens on a large vocabulary) has them
    summed by several threads: every contender's sums are its own, so the proof settles (or not) exactly
    as the Python proof does, on near ties too."""
    native = extension(isa)
    layer = head(12, vocab=40000)
    with torch.no_grad():
        layer.weight[7] = layer.weight[5]  # an exact tie: no proof, either way
        layer.weight[9] = layer.weight[11] * (1 + 1e-7)  # a near one
    greedy = GreedyHead(layer)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for x in (rows(1, 13)[0] * 0.01, rows(1, 14)[0], layer.weight[5] * 3.0, layer.weight[11] * 3.0):
            candidates = torch.arange(0, 40000, 3)
            candidates = torch.cat([candidates, torch.tensor([5, 7, 9, 11])]).unique()
            assert greedy._proven_argmax(x, candidates, native) == greedy._proven_argmax(x, candidates, None)
    finally:
        torch.set_num_threads(threads)
