"""The C++ decoder layers: bitwise the Python loop and the model's own forward (logits, every hidden
state, the cache) on one-token steps and tree forwards, packed or not; used only where that holds; a
failed build leaves decoding to the Python loop with one line saying so."""

import os
import shutil
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.cache import preallocated_cache_for
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import TreeInputBuffers
from draftsmith.inference.backends import Backends, FastPaths, verification_forward
from draftsmith.inference.kernels import native, native_layers
from draftsmith.inference.kernels.attention import model_attention
from draftsmith.inference.kernels.direct import direct_forward_for
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import PackedGemm, linear_kernel_available
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, seeded_random_tree

VOCAB = 97
PROMPT = [5, 17, 33, 2, 61, 8, 40, 17, 33]
STEPS = [12, 40, 7, 88, 3, 19]


def decode_steps(model, forward, rows_attention=None):
    """The prompt through the model's forward, then one-token steps through ``forward`` (None: the
    model's own): every step's logits and hidden states, and the cache at the end. The model's own
    forwards attend as ``forward`` does (or through the row-invariant attention, as ``rows_attention``
    says)."""
    cache = preallocated_cache_for(model.config, 32)
    outputs = []
    rows = forward.rows_attention if forward is not None else rows_attention
    with torch.no_grad(), model_attention(model) if rows else nullcontext():
        model(torch.tensor([PROMPT]), **cache_kwargs(cache), use_cache=True)
        for offset, token in enumerate(STEPS):
            ids, positions = torch.tensor([[token]]), torch.tensor([[len(PROMPT) + offset]])
            if forward is None:
                out = model(
                    ids, position_ids=positions, **cache_kwargs(cache), use_cache=True, output_hidden_states=True
                )
            else:
                out = forward(ids, positions, None, cache, True)
            outputs.append(out)
    return outputs, cache


def assert_same_steps(ours, theirs):
    (our_steps, our_cache), (their_steps, their_cache) = ours, theirs
    for mine, reference in zip(our_steps, their_steps, strict=True):
        assert torch.equal(mine.logits, reference.logits)
        assert len(mine.hidden_states) == len(reference.hidden_states)
        for a, b in zip(mine.hidden_states, reference.hidden_states):
            assert torch.equal(a, b)
    for a, b in zip(our_cache.layers, their_cache.layers, strict=True):
        assert a.length == b.length
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize(
    "config",
    [{}, {"num_key_value_heads": 4}, {"num_hidden_layers": 3, "seed": 5}, {"hidden_size": 72, "head_dim": 18}],
)
def test_the_native_layers_are_bitwise_the_python_loop_and_the_model(config):
    """Grouped and ungrouped K/V heads; a width that is not a power of two (a norm's mean divides by it:
    a product by its reciprocal would round differently); the Python loop and the model's forward are
    the references."""
    seed = config.pop("seed", 0)
    model = tiny_llama(VOCAB, seed=seed, **config)
    for rows_attention in (True, False):  # the row-invariant attention, or SDPA as transformers calls it
        native = direct_forward_for(model, rows_attention=rows_attention)
        assert native.native, "the C++ layers should build here (g++ and ninja are set-up requirements of the tests)"
        assert native.rows_attention == rows_attention
        python = direct_forward_for(model, native=False, rows_attention=rows_attention)
        assert not python.native
        ours = decode_steps(model, native)
        assert_same_steps(ours, decode_steps(model, python))
        assert_same_steps(ours, decode_steps(model, None, rows_attention))


def test_the_native_layers_run_with_gradients_enabled():
    """A caller outside ``torch.no_grad`` (a user's script) gets the same steps, and no ATen call inside
    the layers refuses the weights that require a gradient (an out= call would)."""
    model = tiny_llama(VOCAB)
    native = direct_forward_for(model)
    assert native.native
    reference = decode_steps(model, native)
    cache = preallocated_cache_for(model.config, 32)
    with model_attention(model):
        with torch.no_grad():
            model(torch.tensor([PROMPT]), **cache_kwargs(cache), use_cache=True)
        steps = []
        for offset, token in enumerate(STEPS):
            ids, positions = torch.tensor([[token]]), torch.tensor([[len(PROMPT) + offset]])
            steps.append(native(ids, positions, None, cache, True))
    assert_same_steps((steps, cache), reference)


@pytest.mark.parametrize("packed", [None, "mkl", "onednn", "stream"])
@pytest.mark.parametrize("nodes", [0, 1, 3, 6])
def test_tree_forwards_through_the_native_layers_are_bitwise_the_models(nodes, packed, monkeypatch):
    """The runtime's tree verification (its grouped-K/V switch on, padded to a packed row bucket or
    not): logits, hidden states and cache as the model's own forward computes them, and the C++ layers
    did run."""
    if packed and not linear_kernel_available(packed):
        pytest.skip(f"the {packed} kernel does not run here")
    calls = []
    real = native_layers.native_decoder_layers
    monkeypatch.setattr(native_layers, "native_decoder_layers", lambda *a: calls.append(a[2].shape[1]) or real(*a))
    monkeypatch.setattr(
        "draftsmith.inference.kernels.direct_forward.native_decoder_layers", native_layers.native_decoder_layers
    )
    model = tiny_llama(VOCAB, seed=nodes)
    gemm = PackedGemm(model, packed) if packed else None
    tree = seeded_random_tree(nodes, nodes, VOCAB)
    results = []
    for direct in (None, direct_forward_for(model)):
        cache = preallocated_cache_for(model.config, 64)
        with torch.no_grad(), model_attention(model):  # the runtime's attention for the model's own forwards
            model(torch.tensor([PROMPT[:-1]]), **cache_kwargs(cache), use_cache=True)
            inputs = TreeInputBuffers(8, 64, torch.float32)
            out = verification_forward(
                model, cache, inputs, PROMPT[-1], tree, len(PROMPT) - 1, True, FastPaths(gemm, direct)
            )
        results.append((out, cache))
    (theirs, their_cache), (ours, our_cache) = results
    assert calls and calls[0] >= 1 + nodes
    if packed in ("onednn", "stream"):  # q|k|v and gate|up as one product each, where that keeps columns bitwise
        assert len(gemm._fused) == (2 * model.config.num_hidden_layers if gemm._fusion_exact else 0)
        assert gemm._fusion_exact or packed != "stream"  # it computes each output column alone
    assert torch.equal(ours.logits, theirs.logits)
    for a, b in zip(ours.hidden_states, theirs.hidden_states, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(our_cache.layers, their_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("packed", ["stream", "onednn"])
def test_tree_forwards_read_the_packs_again_after_a_weight_changes(packed):
    """The packs a forward passes to the C++ layers are read once per state of the packs: a weight changed
    in place is repacked before the next verification, and the C++ layers multiply by the new pack."""
    if not linear_kernel_available(packed):
        pytest.skip(f"the {packed} kernel does not run here")
    model = tiny_llama(VOCAB, seed=11)
    gemm = PackedGemm(model, packed)
    direct = direct_forward_for(model)
    tree = seeded_random_tree(3, 11, VOCAB)

    def verify(forward):
        cache = preallocated_cache_for(model.config, 64)
        with torch.no_grad(), model_attention(model), gemm.model_forwards():
            model(torch.tensor([PROMPT[:-1]]), **cache_kwargs(cache), use_cache=True)
        with torch.no_grad(), model_attention(model):
            inputs = TreeInputBuffers(8, 64, torch.float32)
            return verification_forward(
                model, cache, inputs, PROMPT[-1], tree, len(PROMPT) - 1, False, FastPaths(gemm, forward)
            )

    verify(direct)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-2.0)
    assert torch.equal(verify(direct).logits, verify(None).logits)


def test_the_native_layers_follow_replaced_and_updated_weights():
    model = tiny_llama(VOCAB, seed=3)
    native = direct_forward_for(model)
    decode_steps(model, native)
    layer = model.model.layers[1].mlp.gate_proj
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))  # a new parameter: a new plan
    assert_same_steps(decode_steps(model, native), decode_steps(model, None, True))
    attention = model.model.layers[0].self_attn
    attention.o_proj = torch.nn.Linear(attention.o_proj.in_features, attention.o_proj.out_features, bias=False)
    assert_same_steps(decode_steps(model, native), decode_steps(model, None, True))  # a new submodule too
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)  # in place: the plan's views see it
    assert_same_steps(decode_steps(model, native), decode_steps(model, None, True))


def test_generation_with_the_native_layers_equals_plain_decoding():
    model = tiny_llama(VOCAB, seed=2)
    for use_native in (True, False):
        backends = Backends(KernelOptions(native=use_native))
        with backends.reference_forwards(model):
            reference = hf_greedy(model, PROMPT, 24)
        for drafter in (None, PromptLookupDrafter(num_draft=4)):
            result = generate(model, PROMPT, drafter, max_new_tokens=24, eos_token_ids=[2], backends=backends)
            assert result.tokens == reference


@pytest.mark.parametrize(
    "change",
    [
        lambda model: model.to(torch.bfloat16),  # its norms cast to float32 and back: the C++ ones do not
        lambda model: setattr(model.model.layers[1].mlp, "act_fn", torch.nn.GELU()),
    ],
    ids=["bfloat16", "another-activation"],
)
def test_targets_the_native_layers_do_not_compute_keep_the_python_loop(change):
    model = tiny_llama(VOCAB, seed=4)
    change(model)
    direct = direct_forward_for(model)
    assert direct is not None and not direct.native
    assert_same_steps(decode_steps(model, direct), decode_steps(model, None, direct.rows_attention))


def test_a_failed_build_says_so_once_and_decodes_the_same(tmp_path):
    """No working compiler (CXX=/bin/false, an empty extensions folder): one line on stderr, and plain
    and prompt-lookup decoding give the same tokens through the Python loop."""
    script = """
import torch
from conftest import tiny_llama
from helpers import hf_greedy
from draftsmith.inference.kernels.direct import direct_forward_for
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
model = tiny_llama(97, seed=2)
prompt = [5, 17, 33, 2, 61, 8, 40, 17, 33]
reference = hf_greedy(model, prompt, 16)
for drafter in (None, PromptLookupDrafter(num_draft=4)):
    assert generate(model, prompt, drafter, max_new_tokens=16, eos_token_ids=[2]).tokens == reference
assert not direct_forward_for(model).native
print("decoded the same")
"""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    env["PYTHONPATH"] = os.pathsep.join([str(tests), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "decoded the same" in run.stdout
    assert run.stderr.count("could not build the runtime's C++ kernels") == 1
    assert "--no-native" in run.stderr


LOAD_THE_EXTENSION = """
import sys
import torch.utils.cpp_extension
from draftsmith.inference.kernels import native
if sys.argv[1] == "without-load":
    def refuse(*args, **kwargs):
        raise RuntimeError("torch's load was called")
    torch.utils.cpp_extension.load = refuse
print("loaded" if native.native_extension() is not None else "none")
"""


def load_from_a_copy_of_this_build(tmp_path, mode, prepare):
    """A fresh process's ``native_extension()`` with its extensions folder holding a copy of this
    process's finished build, changed first by ``prepare(build_folder)``."""
    if native.native_extension() is None:
        pytest.skip("the C++ kernels cannot be built here")
    root = tmp_path / "extensions"
    copy = root / native.extension_name()
    shutil.copytree(native.build_directory(), copy)
    prepare(copy)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    run = subprocess.run(
        [sys.executable, "-c", LOAD_THE_EXTENSION, mode], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run, copy


def test_a_finished_build_loads_without_torchs_build_lock(tmp_path):
    """torch's ``load`` takes its build lock even to import a finished build, and a process stopped at
    that moment (a test's timeout, Ctrl-C twice) left the lock for every later process to wait on forever."""
    run, copy = load_from_a_copy_of_this_build(tmp_path, "without-load", lambda copy: None)
    assert run.stdout.strip() == "loaded", run.stderr[-3000:]
    assert not (copy / "lock").exists()


def test_a_build_lock_left_by_a_stopped_process_is_removed_in_one_line(tmp_path):
    def leave_an_old_lock(copy):
        lock = copy / "lock"
        lock.touch()
        an_hour_ago = time.time() - 3600
        os.utime(lock, (an_hour_ago, an_hour_ago))

    run, copy = load_from_a_copy_of_this_build(tmp_path, "with-load", leave_an_old_lock)
    assert run.stdout.strip() == "loaded", run.stderr[-3000:]
    assert not (copy / "lock").exists()
    assert run.stderr.count("a build lock left by a process that was stopped") == 1
