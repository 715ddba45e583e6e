"""Exports for serving engines (vLLM speculators / EAGLE-1 / Medusa, SGLang EAGLE-3): names, shapes,
required config fields, refusals; and vLLM as a bench method (the live tests skip without vLLM)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import tiny_llama, vllm_python, vllm_sized_llama
from draftsmith.drafters.engine_layouts import (
    EAGLE3_SPECULATORS_REQUIRED,
    SPECULATORS_REQUIRED,
    EngineLayoutError,
    Verifier,
    check_engine_export,
)
from draftsmith.drafters.io import export_drafter, export_for_engine, is_exported_drafter, read_engine_export
from draftsmith.drafters.registry import get_family

VOCAB = 97
AUX = [1, 2, 3]  # the states entering layers 1, 2 and 3 of the 5-layer target
H, FF, KV = 64, 128, 2 * 16  # hidden, intermediate, key/value width of the tiny target


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=5)


@pytest.fixture(scope="module")
def verifier(target):
    return Verifier("/models/tiny", embed_tokens=lambda: target.get_input_embeddings().weight.detach().clone())


def eagle3(target, draft_vocab_size=40, **options):
    torch.manual_seed(0)
    model = get_family(options.pop("family", "eagle3")).build(
        target.config, {"aux_layer_ids": AUX, "draft_vocab_size": draft_vocab_size, **options}
    )
    if draft_vocab_size:
        model.fit_vocab(torch.arange(0, 2 * draft_vocab_size, 2))  # every other token: offsets d2t[i] = i
    return model


LAYER_SHAPES = {
    "self_attn.q_proj.weight": (H, 2 * H),
    "self_attn.k_proj.weight": (KV, 2 * H),
    "self_attn.v_proj.weight": (KV, 2 * H),
    "self_attn.o_proj.weight": (H, H),
    "hidden_norm.weight": (H,),
    "input_layernorm.weight": (H,),
    "post_attention_layernorm.weight": (H,),
    "mlp.gate_proj.weight": (FF, H),
    "mlp.up_proj.weight": (FF, H),
    "mlp.down_proj.weight": (H, FF),
}


def test_eagle3_speculators_layout_is_what_vllm_reads(target, verifier):
    model = eagle3(target)
    export = model.engine_layout("speculators", verifier, None)
    config, tensors = export.config, export.tensors
    assert config["architectures"] == ["Eagle3DraftModel"] and config["speculators_model_type"] == "eagle3"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == model.config.depth
    assert config["eagle_aux_hidden_state_layer_ids"] == AUX and config["draft_vocab_size"] == 40
    assert config["norm_before_residual"] is True  # vLLM reads true when absent, speculators false: always written
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == VOCAB
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "embed_tokens.weight": (VOCAB, H),
        "fc.weight": (H, 3 * H),
        **{f"layers.0.{k}": v for k, v in LAYER_SHAPES.items()},
        "norm.weight": (H,),
        "lm_head.weight": (40, H),
        "d2t": (40,),
        "t2d": (VOCAB,),
    }
    assert torch.equal(tensors["embed_tokens.weight"], target.get_input_embeddings().weight)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(40) + tensors["d2t"], torch.arange(0, 80, 2))  # target id = i + d2t[i]
    assert torch.equal(tensors["t2d"].nonzero().flatten(), torch.arange(0, 80, 2))
    check_engine_export(export, "speculators")


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
def test_aux_layers_out_of_layer_order_are_refused_for_vllm(target, verifier, family):
    """vLLM concatenates the states in layer order: an fc trained on [3, 1, 2] would read the wrong blocks."""
    model = eagle3(target, family=family, aux_layer_ids=[3, 1, 2])
    with pytest.raises(EngineLayoutError, match=r"aux_layer_ids=\[3, 1, 2\] cannot be served as trained"):
        model.engine_layout("vllm", verifier, 3)


def test_eagle3_over_the_whole_vocabulary_has_no_vocabulary_maps(target, verifier):
    """vLLM keeps no d2t buffer when the draft vocabulary is the target's: one in the file fails to load."""
    export = eagle3(target, draft_vocab_size=0).engine_layout("vllm", verifier, 3)
    assert export.config["draft_vocab_size"] == VOCAB and "d2t" not in export.tensors and "t2d" not in export.tensors
    assert export.config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3


@pytest.mark.parametrize(
    "path", SPECULATORS_REQUIRED + EAGLE3_SPECULATORS_REQUIRED, ids=lambda p: ".".join(map(str, p))
)
def test_a_speculators_config_missing_a_required_field_is_refused(target, verifier, tmp_path, path):
    export = eagle3(target).engine_layout("speculators", verifier, None)
    node = export.config
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(EngineLayoutError, match="which the engine requires"):
        check_engine_export(export, "speculators")


def test_a_missing_required_tensor_is_refused_before_anything_is_written(target, verifier, tmp_path, monkeypatch):
    model = eagle3(target)
    original = type(model).engine_layout

    def without_d2t(self, *args):
        export = original(self, *args)
        del export.tensors["d2t"]
        return export

    monkeypatch.setattr(type(model), "engine_layout", without_d2t)
    with pytest.raises(EngineLayoutError, match="lacks the tensor"):
        export_for_engine(model, "speculators", verifier, None, {"name": "tiny"}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_eagle3_sglang_layout_names_layer_outputs_and_has_no_embedding(target, verifier):
    export = eagle3(target).engine_layout("sglang", verifier, None)
    config, tensors = export.config, export.tensors
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]
    assert config["vocab_size"] == VOCAB and config["draft_vocab_size"] == 40 and config["tie_word_embeddings"] is False
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "fc.weight": (H, 3 * H),
        **{f"midlayer.{k}": v for k, v in LAYER_SHAPES.items()},
        "norm.weight": (H,),
        "lm_head.weight": (40, H),
        "d2t": (40,),
        "t2d": (VOCAB,),
    }
    assert "norm_before_residual" in export.caveat  # SGLang cannot express it: said, not hidden
    with pytest.raises(EngineLayoutError, match="cannot take the embedding"):
        eagle3(target, aux_layer_ids=[0, 2, 3]).engine_layout("sglang", verifier, None)
    with pytest.raises(EngineLayoutError, match="each layer's state once"):
        eagle3(target, aux_layer_ids=[2, 2, 3]).engine_layout("vllm", verifier, None)


def test_peagle_speculators_layout_carries_its_placeholders_where_vllm_reads_them(target, verifier):
    model = eagle3(target, family="peagle", ttt_steps=4, depth=3)
    export = model.engine_layout("vllm", verifier, None)
    config, tensors = export.config, export.tensors
    assert config["speculators_model_type"] == "peagle" and config["speculators_config"]["algorithm"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3  # one forward drafts 3
    # the draft vocabulary is every other id below 80: the highest id outside it is the target's last one
    assert config["mask_token_id"] == VOCAB - 1 == model.placeholder_token_id()
    embedding = target.get_input_embeddings().weight
    assert torch.equal(tensors["embed_tokens.weight"][VOCAB - 1], model.mask_embedding.detach())
    assert torch.equal(tensors["embed_tokens.weight"][: VOCAB - 1], embedding[: VOCAB - 1])
    assert not torch.equal(embedding[VOCAB - 1], model.mask_embedding.detach())  # the verifier's own table is intact
    assert torch.equal(tensors["mask_hidden"], model.mask_hidden.detach()) and tensors["mask_hidden"].shape == (3 * H,)
    assert "mask_embedding" not in tensors  # vLLM would refuse an unknown weight
    check_engine_export(export, "vllm")
    with pytest.raises(EngineLayoutError, match="drafts past the 4 depths it was trained for"):
        model.engine_layout("vllm", verifier, 5)
    with pytest.raises(EngineLayoutError, match="SGLang's P-EAGLE layout is not written here"):
        model.engine_layout("sglang", verifier, None)


def test_fspad3_and_fspad_have_no_engine_layout(target, verifier):
    with pytest.raises(EngineLayoutError, match="FSPAD-3 has no serving-engine layout"):
        eagle3(target, family="fspad3").engine_layout("speculators", verifier, None)
    for family in ("medusa2", "streaming"):
        model = get_family(family).build(target.config, {})
        with pytest.raises(EngineLayoutError, match=f"a '{family}' drafter has no vllm layout"):
            model.engine_layout("vllm", verifier, None)


def test_an_engine_export_without_a_local_verifier_refuses_to_guess_the_embedding(target):
    with pytest.raises(EngineLayoutError, match="not a local model directory; pass --verifier DIR"):
        eagle3(target).engine_layout("speculators", Verifier("org/model"), None)


def test_medusa_vllm_layout(target, verifier, tmp_path):
    torch.manual_seed(0)
    model = get_family("medusa").build(target.config, {"num_heads": 3, "num_layers": 1})
    export = model.engine_layout("vllm", verifier, None)
    assert export.config["model_type"] == "medusa" and export.config["num_heads"] == 3
    assert export.config["medusa_fc_bias"] is True and export.speculative_tokens == 3
    assert {k: tuple(v.shape) for k, v in export.tensors.items()} == {
        **{f"blocks.{k}.layers.0.weight": (H, H) for k in range(3)},
        **{f"blocks.{k}.layers.0.bias": (H,) for k in range(3)},
        **{f"lm_heads.{k}.weight": (VOCAB, H) for k in range(3)},
    }
    with pytest.raises(EngineLayoutError, match="whole vocabulary; train with drafter.draft_vocab_size=0"):
        get_family("medusa").build(target.config, {"draft_vocab_size": 8}).engine_layout("vllm", verifier, None)
    with pytest.raises(EngineLayoutError, match="no sglang layout"):
        model.engine_layout("sglang", verifier, None)


# DFlash's layer reads the block (width H), not EAGLE's [embedding | feature], and normalises q and k per head
DFLASH_LAYER_SHAPES = {
    **{k: v for k, v in LAYER_SHAPES.items() if k.startswith(("input_", "post_", "mlp."))},
    "self_attn.q_proj.weight": (H, H),
    "self_attn.k_proj.weight": (KV, H),
    "self_attn.v_proj.weight": (KV, H),
    "self_attn.o_proj.weight": (H, H),
    "self_attn.q_norm.weight": (16,),
    "self_attn.k_norm.weight": (16,),
}


def dflash(target, **options):
    """A DFlash drafter for vLLM (Qwen3's layer: ``qk_norm``), fusing ``AUX`` out of order by default."""
    torch.manual_seed(0)
    return get_family("dflash").build(target.config, {"aux_layer_ids": [3, 1, 2], "qk_norm": True, **options})


def test_dflash_vllm_layout_is_what_vllm_reads(target, verifier, tmp_path):
    model = dflash(target, num_layers=2)
    export = model.engine_layout("vllm", verifier, None)
    config, tensors = export.config, export.tensors
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["head_dim"] == 16 and config["vocab_size"] == VOCAB
    # layer outputs, ascending (vLLM concatenates the states by layer); the mask stands in for the last id
    assert config["dflash_config"] == {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1, 2], "causal": False}
    assert export.speculative_tokens == 7  # the block's 7 masks: vLLM drafts the whole block
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        "fc.weight": (H, 3 * H),
        "hidden_norm.weight": (H,),
        **{f"layers.{i}.{k}": v for i in range(2) for k, v in DFLASH_LAYER_SHAPES.items()},
        "norm.weight": (H,),
    }  # no embedding, no lm_head: vLLM shares the target's
    fc = model.fc.weight.detach()  # column blocks of the states entering layers 3, 1, 2 -> 1, 2, 3
    assert torch.equal(tensors["fc.weight"], torch.cat([fc[:, H : 2 * H], fc[:, 2 * H :], fc[:, :H]], dim=1))
    check_engine_export(export, "vllm")
    out = export_for_engine(model, "vllm", verifier, None, {"name": "tiny"}, tmp_path / "dflash")
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)  # as vLLM reads it
    assert mask["mask_token_id"] == VOCAB - 1 and torch.equal(mask["embedding"], model.mask_embedding.detach())
    assert read_engine_export(out)["speculative_tokens"] == 7


def test_dflash_vllm_export_refuses_what_vllm_would_run_differently(target, verifier):
    refusals = {
        "drafter.qk_norm=true": dflash(target, qk_norm=False),
        "train with drafter.draft_vocab_size=0": dflash(target, draft_vocab_size=40),
        "must lie in 1..4: 0 is the embedding": dflash(target, aux_layer_ids=[0, 2, 3]),
        "5 the final norm's output": dflash(target, aux_layer_ids=[1, 2, 5]),
        "each layer's state once": dflash(target, aux_layer_ids=[1, 1, 3]),
    }
    for message, model in refusals.items():
        with pytest.raises(EngineLayoutError, match=message):
            model.engine_layout("vllm", verifier, None)
    with pytest.raises(EngineLayoutError, match="as trained only with 7 speculative tokens, not 4"):
        dflash(target).engine_layout("vllm", verifier, 4)
    for fmt in ("speculators", "sglang"):
        with pytest.raises(EngineLayoutError, match=f"--format vllm, not {fmt}"):
            dflash(target).engine_layout(fmt, verifier, None)
    gelu = tiny_llama(VOCAB, num_hidden_layers=5, hidden_act="gelu")
    with pytest.raises(EngineLayoutError, match="SiLU without biases; the target's layers have hidden_act='gelu'"):
        dflash(gelu).engine_layout("vllm", verifier, None)


def test_engine_export_records_what_it_is(target, verifier, tmp_path):
    out = export_for_engine(eagle3(target), "vllm", verifier, 4, {"name": "tiny"}, tmp_path / "e3")
    record = read_engine_export(out)
    assert record == {
        "family": "eagle3",
        "format": "vllm",
        "speculative_tokens": 4,
        "target_identity": {"name": "tiny"},
    }
    assert is_exported_drafter(out) and set(load_file(str(out / "model.safetensors"))) >= {"fc.weight", "d2t"}
    with pytest.raises(FileExistsError):  # never replaced without --overwrite
        export_for_engine(eagle3(target), "vllm", verifier, 4, {"name": "tiny"}, out)


def test_an_exported_drafter_converts_to_an_engine_layout_as_its_run_would(tmp_path, tiny_target_dir):
    """`draftsmith export EXPORT --format vllm`: the layout written from an export equals the one written
    from the model itself, for the export's own target by default; the draftsmith layout and checkpoint
    choices are refused (an export has neither)."""
    from transformers import AutoConfig

    from draftsmith.core.target import load_tokenizer
    from draftsmith.train.checkpoint import CheckpointError
    from draftsmith.train.export import ExportLayout, engine_verifier, export_run

    _, identity = load_tokenizer(str(tiny_target_dir))
    torch.manual_seed(0)
    options = {"draft_vocab_size": 40, "aux_layer_ids": [0, 1]}
    model = get_family("eagle3").build(AutoConfig.from_pretrained(tiny_target_dir), options)
    exported = export_drafter(model, identity.to_dict(), tmp_path / "export")
    converted = export_run(exported, tmp_path / "vllm", ExportLayout("vllm"))  # no --verifier: the export's target
    direct = export_for_engine(
        model,
        "vllm",
        engine_verifier(str(tiny_target_dir), identity.to_dict()),
        None,
        identity.to_dict(),
        tmp_path / "direct",
    )
    a, b = load_file(str(converted / "model.safetensors")), load_file(str(direct / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)
    assert json.loads((converted / "config.json").read_text()) == json.loads((direct / "config.json").read_text())
    with pytest.raises(CheckpointError, match="already in draftsmith's layout"):
        export_run(exported, tmp_path / "again")
    with pytest.raises(CheckpointError, match="no checkpoints to choose from"):
        export_run(exported, tmp_path / "again", ExportLayout("vllm"), checkpoint="step-1")
    with pytest.raises(CheckpointError, match="nor an exported drafter"):
        export_run(tmp_path / "nothing-here", tmp_path / "again", ExportLayout("vllm"))


# ---- vLLM as a bench method ----------------------------------------------------------------------


def test_vllm_methods_are_checked_before_anything_runs(tmp_path, tiny_target_dir, other_target_dir, monkeypatch):
    from draftsmith.core.target import TargetError, load_target
    from draftsmith.core.vllm_env import VllmError, find_vllm_python
    from draftsmith.drafters.io import export_drafter
    from draftsmith.inference.measure.vllm_engine import parse_vllm_method

    tiny = load_target(str(tiny_target_dir))
    assert parse_vllm_method("vllm", tiny).speculative_config() is None
    with pytest.raises(VllmError, match="not a drafter exported for vLLM; make one with"):
        parse_vllm_method(f"vllm={tmp_path}", tiny)
    model = get_family("eagle").build(tiny.model.config, {})
    export_drafter(model, tiny.identity.to_dict(), tmp_path / "ours")
    with pytest.raises(VllmError, match="not a drafter exported for vLLM"):
        parse_vllm_method(f"vllm={tmp_path / 'ours'}", tiny)
    verifier = Verifier(str(tiny_target_dir), embed_tokens=lambda: tiny.model.get_input_embeddings().weight)
    export_for_engine(model, "vllm", verifier, None, tiny.identity.to_dict(), tmp_path / "eagle")
    method = parse_vllm_method(f"vllm={tmp_path / 'eagle'}:tokens=2", tiny)
    assert method.speculative_config() == {
        "method": "eagle",
        "model": str(tmp_path / "eagle"),
        "num_speculative_tokens": 2,
    }
    with pytest.raises(TargetError, match="not this target"):
        parse_vllm_method(f"vllm={tmp_path / 'eagle'}", load_target(str(other_target_dir)))
    e3 = get_family("eagle3").build(tiny.model.config, {"aux_layer_ids": [1, 1, 1]})
    export_for_engine(e3, "sglang", verifier, None, tiny.identity.to_dict(), tmp_path / "sglang")
    with pytest.raises(VllmError, match="which vLLM does not serve; export it with --format vllm"):
        parse_vllm_method(f"vllm={tmp_path / 'sglang'}", tiny)
    monkeypatch.delenv("DRAFTSMITH_VLLM_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(VllmError, match="vLLM is not installed here; install it in its own venv"):
        find_vllm_python(None)
    with pytest.raises(VllmError, match="does not exist"):
        find_vllm_python(str(tmp_path / "nope"))


def test_a_failed_vllm_run_is_reported_by_its_error_line():
    from draftsmith.core.vllm_env import last_error_line

    stderr = "INFO starting\nTraceback (most recent call last):\n  File x\nValueError: Invalid speculators config\n"
    assert last_error_line(stderr) == "ValueError: Invalid speculators config"
    worker = (
        "(Worker pid=1) ERROR 11-23 [executor.py:1] RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    )
    dead = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace"
    assert (
        last_error_line(f"{worker}\n{dead}\n") == "RuntimeError: Unsupported CPU attention configuration: head_dim=16"
    )


def test_vllm_computes_on_as_many_cores_as_the_runtime_it_is_compared_with(monkeypatch):
    from draftsmith.core.vllm_env import THREADS_BIND, VllmError, vllm_environment

    monkeypatch.delenv(THREADS_BIND, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7, 3, 5})
    assert vllm_environment(2)[THREADS_BIND] == "3,5"
    assert vllm_environment(8)[THREADS_BIND] == "3,5,7"
    assert THREADS_BIND not in vllm_environment(None)  # vLLM's own binding
    with pytest.raises(VllmError, match="at least one thread"):
        vllm_environment(0)
    monkeypatch.setenv(THREADS_BIND, "0-15")
    assert vllm_environment(2)[THREADS_BIND] == "0-15"  # the user's choice wins


def vllm_tiny_target(tmp_path, tokenizer, monkeypatch, architecture: str = "llama"):
    """A tiny target saved where vLLM can open it, its verifier, and two chat prompts."""
    from draftsmith.core.target import load_target

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    target_dir = tmp_path / "target"
    vllm_sized_llama(len(tokenizer), architecture).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    tiny = load_target(str(target_dir))
    verifier = Verifier(str(target_dir), embed_tokens=lambda: tiny.model.get_input_embeddings().weight)
    prompts = [tiny.encode_chat([{"role": "user", "content": text}]) for text in ("Hello there", "What is 3 plus 4?")]
    return target_dir, tiny, verifier, prompts


def served_by_vllm(spec: str, target_dir, tiny, prompts) -> list[dict]:
    """vLLM's greedy results for ``prompts``, after checking its tokens are HF generate's."""
    from draftsmith.inference.measure.bench import hf_greedy
    from draftsmith.inference.measure.vllm_engine import parse_vllm_method, run_vllm

    run = run_vllm(
        vllm_python(), parse_vllm_method(spec, tiny), target_dir, prompts, 12, [], torch.get_num_threads(), eager=True
    )
    assert [r["tokens"] for r in run["results"]] == [hf_greedy(tiny.model, p, 12, [])[0] for p in prompts], spec
    return run["results"]


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (set DRAFTSMITH_VLLM_PYTHON)")
def test_vllm_serves_an_eagle3_export_losslessly(tmp_path, tokenizer, monkeypatch):
    """vLLM plain and with a (random) eagle3 export give HF generate's greedy tokens on a tiny target."""
    target_dir, tiny, verifier, prompts = vllm_tiny_target(tmp_path, tokenizer, monkeypatch)
    model = get_family("eagle3").build(tiny.model.config, {"aux_layer_ids": [1, 2, 3]})
    export_for_engine(model, "speculators", verifier, 2, tiny.identity.to_dict(), tmp_path / "e3")
    served_by_vllm("vllm", target_dir, tiny, prompts)
    results = served_by_vllm(f"vllm={tmp_path / 'e3'}", target_dir, tiny, prompts)
    assert sum(r["drafts"] for r in results) > 0  # the drafter did draft


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (set DRAFTSMITH_VLLM_PYTHON)")
def test_vllm_serves_an_eagle3_export_for_a_gemma3_target_losslessly(tmp_path, tokenizer, monkeypatch):
    """On a Gemma-3 target (sliding-window layers, one RoPE per layer type) the export's Llama layer says
    the activation and RoPE it computes with, and vLLM serves it through its Transformers backend (its
    own Gemma-3 class has no EAGLE-3 interface) with HF generate's tokens."""
    target_dir, tiny, verifier, prompts = vllm_tiny_target(tmp_path, tokenizer, monkeypatch, "gemma3")
    model = get_family("eagle3").build(tiny.model.config, {"aux_layer_ids": [1, 2, 3]})
    export_for_engine(model, "speculators", verifier, 2, tiny.identity.to_dict(), tmp_path / "e3")
    layer = json.loads((tmp_path / "e3" / "config.json").read_text())["transformer_layer_config"]
    assert layer["hidden_act"] == "silu" and not any(isinstance(v, dict) for v in layer["rope_parameters"].values())
    served_by_vllm("vllm", target_dir, tiny, prompts)
    results = served_by_vllm(f"vllm={tmp_path / 'e3'}", target_dir, tiny, prompts)
    assert sum(r["drafts"] for r in results) > 0


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (set DRAFTSMITH_VLLM_PYTHON)")
def test_vllm_serves_a_peagle_export_with_parallel_drafting_losslessly(tmp_path, tokenizer, monkeypatch):
    """vLLM loads a (random) peagle export as eagle3 with parallel drafting and gives HF generate's tokens."""
    from draftsmith.inference.measure.vllm_engine import parse_vllm_method

    target_dir, tiny, verifier, prompts = vllm_tiny_target(tmp_path, tokenizer, monkeypatch)
    model = get_family("peagle").build(tiny.model.config, {"aux_layer_ids": [1, 2, 3], "ttt_steps": 3, "depth": 3})
    export_for_engine(model, "vllm", verifier, None, tiny.identity.to_dict(), tmp_path / "pe")
    method = parse_vllm_method(f"vllm={tmp_path / 'pe'}", tiny)
    assert method.speculative_config()["parallel_drafting"] is True and method.speculative_tokens == 3
    results = served_by_vllm(f"vllm={tmp_path / 'pe'}", target_dir, tiny, prompts)
    assert sum(r["draft_tokens"] for r in results) == 3 * sum(r["drafts"] for r in results) > 0


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (set DRAFTSMITH_VLLM_PYTHON)")
def test_vllm_serves_a_dflash_export_losslessly(tmp_path, tokenizer, monkeypatch):
    """vLLM's dflash method loads a (random, qk_norm, out-of-order aux layers) export with its
    mask_embedding.pt, drafts the whole block (7 tokens) in every step and gives HF generate's tokens."""
    target_dir, tiny, verifier, prompts = vllm_tiny_target(tmp_path, tokenizer, monkeypatch)
    model = dflash(tiny.model, num_layers=2)
    export_for_engine(model, "vllm", verifier, None, tiny.identity.to_dict(), tmp_path / "dflash")
    results = served_by_vllm(f"vllm={tmp_path / 'dflash'}", target_dir, tiny, prompts)
    assert sum(r["draft_tokens"] for r in results) == 7 * sum(r["drafts"] for r in results) > 0


STUB_ENGINE = """#!/bin/sh
# Stands in for vLLM's python: '$0 WORKER REQUEST RESULT'. Fails when the request names a drafter;
# otherwise 'generates' each prompt's last three tokens in one speculative step with one accepted token.
exec {python} - "$@" <<'PY'
import json, sys
request = json.load(open(sys.argv[2]))
if request["speculative_config"]:
    sys.stderr.write("INFO loading\\nTraceback (most recent call last):\\nValueError: no drafter today\\n")
    sys.exit(1)
step = {{"seconds": 0.5, "drafts": 1, "draft_tokens": 2, "accepted": 1}}
results = [{{"tokens": p[-3:], **step}} for p in request["prompts"]]
json.dump({{"vllm_version": "stub", "startup_seconds": 1.0, "results": results}}, open(sys.argv[3], "w"))
PY
"""


def test_bench_accounts_for_vllm_runs_and_keeps_results_when_one_fails(tmp_path, tiny_target_dir):
    """The bench's bookkeeping of vLLM methods, with a stand-in engine (not vLLM): tau = tokens /
    (speculative steps + prefill), vLLM's acceptance length, identity against HF generate; a method
    whose engine fails is reported by its error line and the others' results are kept."""
    import sys

    from draftsmith.core.target import load_target
    from draftsmith.inference.measure.bench import ExternalEngines, Question, run_bench
    from draftsmith.inference.measure.bench_report import markdown_table

    stub = tmp_path / "python"
    stub.write_text(STUB_ENGINE.format(python=sys.executable))
    stub.chmod(0o755)
    tiny = load_target(str(tiny_target_dir))
    model = get_family("eagle").build(tiny.model.config, {})
    verifier = Verifier(str(tiny_target_dir))
    export_for_engine(model, "vllm", verifier, 2, tiny.identity.to_dict(), tmp_path / "eagle")
    questions = [Question("q1", "writing", ["Hello there", "And again?"])]
    methods = ["vllm", f"vllm={tmp_path / 'eagle'}"]
    results = run_bench(tiny, questions, methods, 4, engines=ExternalEngines(str(stub), Path(tiny_target_dir)))
    plain = results["methods"]["vllm"]["overall"]
    assert plain["total"] == 2 and plain["tokens"] == 6 and plain["target_forwards"] == 4  # (1 step + prefill) x 2
    assert plain["tau"] == 1.5 and plain["engine_acceptance_length"] == 2.0 and plain["identical"] == 0
    assert f"vllm={tmp_path / 'eagle'}" not in results["methods"]
    assert results["vllm"][f"vllm={tmp_path / 'eagle'}"]["error"].endswith("ValueError: no drafter today")
    assert "did not run: vLLM" in markdown_table(results) and "- vllm: 2.00" in markdown_table(results)


# ---- the speculators library reads the eagle3 export ---------------------------------------------

SPECULATORS_PYTHON = os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON")


@pytest.mark.skipif(
    not SPECULATORS_PYTHON, reason="set DRAFTSMITH_SPECULATORS_PYTHON to a python with speculators 0.9 installed"
)
@pytest.mark.parametrize("draft_vocab_size", [40, 0], ids=["draft-vocab", "whole-vocab"])
def test_speculators_loads_the_eagle3_export_and_drafts_what_the_drafter_drafts(tmp_path, target, draft_vocab_size):
    """speculators' own ``Eagle3DraftModel.from_pretrained`` builds the drafter from a ``--format
    speculators`` export (every weight from the file, none left to its verifier fallback) and its
    training-time-test forward gives our drafter's draft-head logits at every step, with a reduced
    draft vocabulary (``d2t``/``t2d``) and over the whole one (no maps)."""
    from draftsmith.drafters.base import FrozenTarget
    from draftsmith.train.losses.ttt import ttt_unroll

    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)  # the verifier speculators reads its layer count and embedding from
    model = eagle3(target, draft_vocab_size, ttt_steps=3).eval()
    with torch.no_grad():  # every weight away from its initial value, so a swapped or dropped tensor shows
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    verifier = Verifier(str(target_dir), embed_tokens=lambda: target.get_input_embeddings().weight.detach().clone())
    export_for_engine(model, "speculators", verifier, None, {"name": "tiny"}, tmp_path / "e3")

    torch.manual_seed(1)
    ids = torch.randint(4, VOCAB, (1, 12))
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        states = torch.cat([hidden[i] for i in AUX], dim=-1)
        frozen = FrozenTarget.from_model(target)
        ours = [
            model.logits(out.token_features) for out in ttt_unroll(model, frozen, ids, torch.ones_like(ids), states)
        ]
    # speculators' inputs are pre-shifted (position t reads x_{t+1}); the last position has no x_{t+1}
    inputs = {
        "hidden_states": states[:, :-1].contiguous(),
        "input_ids": ids[:, 1:].contiguous(),
        "position_ids": torch.arange(ids.shape[1] - 1)[None],
        "ttt_steps": torch.tensor(3),
    }
    save_file(inputs, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "result").mkdir()
    worker = Path(__file__).with_name("speculators_worker.py")
    run = subprocess.run(
        [
            SPECULATORS_PYTHON,
            str(worker),
            str(tmp_path / "e3"),
            str(tmp_path / "inputs.safetensors"),
            str(tmp_path / "result"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "result/result.json").read_text())
    assert result["config_class"] == "Eagle3SpeculatorConfig" and result["model_class"] == "Eagle3DraftModel"
    assert result["norm_before_residual"] is True and result["draft_vocab_size"] == (draft_vocab_size or VOCAB)
    assert result["eagle_aux_hidden_state_layer_ids"] == AUX and result["verifier"] == str(target_dir)
    assert result["speculative_tokens"] == model.config.depth
    assert result["missing_keys"] == [] and result["unexpected_keys"] == [] and result["nan_parameters"] == []
    theirs = load_file(str(tmp_path / "result/logits.safetensors"))
    if draft_vocab_size:
        assert torch.equal(theirs["d2t"], model.d2t) and torch.equal(theirs["t2d"], model.t2d)
    else:
        assert "d2t" not in theirs and "t2d" not in theirs  # speculators keeps no maps for the whole vocabulary
    for step in range(3):
        torch.testing.assert_close(theirs[f"step{step}"], ours[step][:, :-1], rtol=1e-4, atol=1e-4)
