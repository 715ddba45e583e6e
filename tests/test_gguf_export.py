"""``draftsmith export --format gguf``: llama.cpp's ``eagle3`` GGUF, read back with the gguf package's reader
(every tensor, shape, dtype and metadata key llama.cpp's eagle3 loader asks for), refusals in one line;
and, where ``LLAMACPP_BIN`` names a directory of llama.cpp's tools, a live run of the shipped drafter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_named_targets import write_tiny_gguf

from conftest import make_tokenizer, tiny_llama
from draftsmith.drafters.eagle3 import LLAMACPP_EAGLE3_KEYS
from draftsmith.drafters.engine_layouts import EngineLayoutError
from draftsmith.drafters.gguf_layout import RECORD_KEY, export_gguf, llama_rope_rows
from draftsmith.drafters.io import export_drafter, is_exported_drafter
from draftsmith.drafters.registry import get_family
from helpers import refused

LAYERS = 5
AUX = [1, 3, 4]  # llama.cpp's eagle3 reads exactly three target layers
H, FF, KV = 64, 128, 2 * 16
IDENTITY = {"name": "tiny", "revision": "r", "config_hash": "c", "tokenizer_hash": "t"}
F32, F16, BF16, I64 = (gguf.GGMLQuantizationType[name] for name in ("F32", "F16", "BF16", "I64"))


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("target") / "tiny.gguf", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(len(make_tokenizer()), num_hidden_layers=LAYERS)


def eagle3(target, draft_vocab_size: int = 40, **options):
    torch.manual_seed(0)
    model = get_family(options.pop("family", "eagle3")).build(
        target.config, {"aux_layer_ids": AUX, "draft_vocab_size": draft_vocab_size, **options}
    )
    if draft_vocab_size:
        model.fit_vocab(torch.arange(0, 2 * draft_vocab_size, 2))  # every other token
    return model


def read_back(path: Path) -> tuple[dict[str, object], dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items()}, {t.name: t for t in reader.tensors}


def test_an_eagle3_gguf_holds_every_tensor_and_key_llamacpps_eagle3_loader_reads(tmp_path, target, target_gguf):
    model = eagle3(target)
    out = export_gguf(model, target_gguf, None, "float32", IDENTITY, tmp_path / "g")
    assert is_exported_drafter(out) and json.loads((out / "files.json").read_text())["files"].keys() == {"model.gguf"}
    fields, tensors = read_back(out / "model.gguf")
    vocab = len(make_tokenizer())
    # ggml lists dimensions innermost first: (in, out) for a matrix, as eagle3.cpp's create_tensor asks
    assert {name: (tuple(int(n) for n in t.shape), t.tensor_type) for name, t in tensors.items()} == {
        "fc.weight": ((3 * H, H), F32),
        "blk.0.attn_norm.weight": ((H,), F32),
        "blk.0.attn_norm_2.weight": ((H,), F32),
        "blk.0.attn_q.weight": ((2 * H, H), F32),
        "blk.0.attn_k.weight": ((2 * H, KV), F32),
        "blk.0.attn_v.weight": ((2 * H, KV), F32),
        "blk.0.attn_output.weight": ((H, H), F32),
        "blk.0.ffn_norm.weight": ((H,), F32),
        "blk.0.ffn_gate.weight": ((H, FF), F32),
        "blk.0.ffn_up.weight": ((H, FF), F32),
        "blk.0.ffn_down.weight": ((FF, H), F32),
        "output_norm.weight": ((H,), F32),
        "output.weight": ((H, 40), F32),
        "d2t": ((40,), I64),
    }
    assert fields["general.architecture"] == "eagle3"
    assert all(f"eagle3.{key}" in fields for key in LLAMACPP_EAGLE3_KEYS)
    assert list(fields["eagle3.target_layers"]) == AUX and fields["eagle3.target_hidden_size"] == H
    assert fields["eagle3.norm_before_residual"] is True and fields["eagle3.block_count"] == 1
    assert fields["eagle3.embedding_length"] == H and fields["eagle3.feed_forward_length"] == FF
    assert (fields["eagle3.attention.head_count"], fields["eagle3.attention.head_count_kv"]) == (4, 2)
    assert fields["eagle3.rope.dimension_count"] == H // 4 and fields["eagle3.vocab_size"] == vocab
    target_fields, _ = read_back(target_gguf)
    tokenizer_keys = {key for key in target_fields if key.startswith("tokenizer.")}
    assert tokenizer_keys and all(fields[key] == target_fields[key] for key in tokenizer_keys)
    assert len(fields["tokenizer.ggml.tokens"]) == vocab
    d2t = np.asarray(tensors["d2t"].data)
    assert d2t.tolist() == list(range(0, 80, 2))  # absolute target ids, as llama.cpp's set_rows reads them
    record = json.loads(fields[RECORD_KEY])
    assert record == {
        "family": "eagle3",
        "format": "gguf",
        "dtype": "float32",
        "speculative_tokens": model.config.depth,
        "target_identity": IDENTITY,
    }
    state = model.state_dict()
    np.testing.assert_array_equal(tensors["output.weight"].data, state["lm_head.weight"].numpy())
    np.testing.assert_array_equal(tensors["blk.0.attn_norm_2.weight"].data, state["layer.hidden_norm.weight"].numpy())


def test_the_whole_vocabulary_has_no_d2t(tmp_path, target, target_gguf):
    """llama.cpp drafts over the target's vocabulary when d2t is absent: an identity map would only cost."""
    out = export_gguf(eagle3(target, draft_vocab_size=0), target_gguf, 2, "float32", IDENTITY, tmp_path / "g")
    fields, tensors = read_back(out / "model.gguf")
    assert "d2t" not in tensors and tuple(tensors["output.weight"].shape) == (H, len(make_tokenizer()))
    assert json.loads(fields[RECORD_KEY])["speculative_tokens"] == 2


def rope_hf(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE on (heads, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * torch.cat([cos, cos]) + rotated * torch.cat([sin, sin])


def rope_ggml(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ggml's LLAMA_ROPE_TYPE_NORM on (heads, head_dim): adjacent pairs (2i, 2i+1) rotate by angle i."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def test_the_q_and_k_rows_are_permuted_so_ggml_rope_gives_what_transformers_rope_gives():
    """After the permutation, ggml's pairwise RoPE of the permuted projection is transformers' RoPE of the
    original, in the same permuted order: attention scores (dot products per head) are unchanged."""
    torch.manual_seed(0)
    heads, head_dim = 3, 8
    weight, x = torch.randn(heads * head_dim, 2 * 12), torch.randn(2 * 12)
    angle = 0.7 * torch.arange(head_dim // 2)
    cos, sin = angle.cos(), angle.sin()
    hf = rope_hf((weight @ x).view(heads, head_dim), cos, sin)
    ggml = rope_ggml((llama_rope_rows(weight, heads) @ x).view(heads, head_dim), cos, sin)
    permuted_hf = llama_rope_rows(hf.reshape(-1, 1), heads).view(heads, head_dim)
    torch.testing.assert_close(ggml, permuted_hf)
    assert not torch.allclose(rope_ggml((weight @ x).view(heads, head_dim), cos, sin), permuted_hf)


@pytest.mark.parametrize(("dtype", "kind", "torch_dtype"), [("float16", F16, torch.float16), ("bfloat16", BF16, None)])
def test_float16_and_bfloat16_store_the_matrices_so_and_keep_the_norms_float32(
    tmp_path, target, target_gguf, dtype, kind, torch_dtype
):
    model = eagle3(target)
    out = export_gguf(model, target_gguf, None, dtype, IDENTITY, tmp_path / dtype)
    _, tensors = read_back(out / "model.gguf")
    assert tensors["fc.weight"].tensor_type == kind and tensors["output.weight"].tensor_type == kind
    assert tensors["blk.0.ffn_norm.weight"].tensor_type == F32 and tensors["d2t"].tensor_type == I64
    stored = np.asarray(tensors["fc.weight"].data)
    fc = model.state_dict()["fc.weight"]
    if torch_dtype is None:  # bfloat16's raw bits
        stored = torch.from_numpy(stored.copy()).view(torch.int16).view(torch.bfloat16).float()
        expected = fc.to(torch.bfloat16).float()
    else:
        stored, expected = torch.from_numpy(stored.astype(np.float32)), fc.to(torch_dtype).float()
    torch.testing.assert_close(stored.reshape(expected.shape), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("family", "options", "said"),
    [
        ("fspad3", {"aux_layer_ids": AUX}, "FSPAD-3 has no gguf layout"),
        ("eagle", {}, "'eagle' drafter has no gguf layout"),
        ("dflash", {"aux_layer_ids": [1, 3], "block_size": 4}, "llama.cpp's dflash graph"),
        ("eagle3", {"aux_layer_ids": [1, 3]}, "len(drafter.aux_layer_ids) != 3"),
    ],
)
def test_families_and_drafters_llamacpp_cannot_run_are_refused_in_one_line(
    tmp_path, target, target_gguf, family, options, said
):
    model = get_family(family).build(target.config, options)
    with pytest.raises(EngineLayoutError) as info:
        export_gguf(model, target_gguf, None, "float32", IDENTITY, tmp_path / "g")
    assert said in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "g").exists()


def test_the_cli_exports_an_exported_drafter_and_refuses_another_targets_gguf(tmp_path, target, target_gguf, capsys):
    from draftsmith.cli import main

    exported = export_drafter(eagle3(target), IDENTITY, tmp_path / "drafter")
    out = tmp_path / "gguf"
    argv = ["export", exported, "--format", "gguf", "--verifier", target_gguf, "--out", out, "--dtype", "bfloat16"]
    main([str(a) for a in argv])
    assert "--spec-type draft-eagle3" in capsys.readouterr().out
    assert read_back(out / "model.gguf")[1]["fc.weight"].tensor_type == BF16
    main([str(a) for a in argv] + ["--overwrite"])  # its own earlier export is replaced
    other = write_tiny_gguf(tmp_path / "other.gguf", num_hidden_layers=2)
    line = refused([*argv[:5], other, "--out", tmp_path / "x"], capsys)
    assert "is not the drafter's target" in line and "2 layers, the drafter reads layer 4" in line
    line = refused([*argv[:4], "--out", tmp_path / "y"], capsys)  # its target is no named one: no GGUF to copy
    assert "pass --verifier TARGET.gguf" in line
    line = refused(["export", exported, "--out", tmp_path / "z", "--dtype", "float16"], capsys)
    assert "--dtype float16 with --format draftsmith" in line
    line = refused(["export", exported, "--format", "vllm", "--out", tmp_path / "w", "--dtype", "float16"], capsys)
    assert "--dtype float16 with --format vllm" in line


def llamacpp_bin() -> Path | None:
    value = os.environ.get("LLAMACPP_BIN")
    return Path(value) if value else None


@pytest.mark.slow
@pytest.mark.skipif(llamacpp_bin() is None, reason="LLAMACPP_BIN is not set (a directory of llama.cpp's tools)")
def test_llamacpp_serves_the_shipped_eagle3_exported_as_gguf_and_decodes_as_without_it(tmp_path):
    """The shipped EAGLE-3 in llama.cpp: its drafts are accepted, and the output is llama.cpp's plain one."""
    from draftsmith.cli import main
    from draftsmith.core.target import load_tokenizer, target_gguf_file
    from draftsmith.inference.measure.llamacpp_engine import (
        LlamaCppMethod,
        find_llamacpp_tools,
        run_plain,
        run_speculative,
    )

    main(["export", "eagle3-smollm2", "--format", "gguf", "--out", str(tmp_path / "e3")])
    tokenizer, _ = load_tokenizer("smollm2")
    messages = [{"role": "user", "content": "Translate to French: the cat sleeps on the warm windowsill."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tools, model = find_llamacpp_tools(str(llamacpp_bin())), target_gguf_file("smollm2")
    plain = run_plain(tools, model, prompt, 32, 1, 512)
    assert list(plain.prompt_ids) == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    method = LlamaCppMethod("llamacpp=e3", tmp_path / "e3" / "model.gguf", 3)
    drafted = run_speculative(tools, model, method, prompt, 32, 1, 512)
    assert drafted.accepted > 0 and drafted.steps < drafted.generated
    # the same tokens: it may commit a few past -n, and the plain run may stop inside a character (U+FFFD)
    assert drafted.text.startswith(plain.text.rstrip("\ufffd")), (
        "llama.cpp's speculative tokens left its plain ones: build its tools with -DGGML_LLAMAFILE=OFF, whose batch "
        "kernels otherwise round a verification's rows differently from one-row decoding (docs/engines.md)"
    )
