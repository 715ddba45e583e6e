"""The drafters shipped in the package (``drafters/pretrained``): ``--method NAME`` without a directory
serves the one trained for the loaded target, its options still apply, and every other target or
family is told which drafters are shipped. The shipped folder itself is an intact export."""

import json
from pathlib import Path

import pytest

from draftsmith.core.io import file_problems
from draftsmith.core.target import TargetIdentity, load_target
from draftsmith.drafters import pretrained
from draftsmith.drafters.io import export_drafter
from draftsmith.drafters.registry import get_family
from draftsmith.inference.methods.errors import MethodError
from draftsmith.inference.methods.table import build_drafter


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(str(tiny_target_dir))


@pytest.fixture()
def shipped_for_tiny(tiny, tmp_path, monkeypatch):
    """A shipped-drafter folder holding an EAGLE-3 export for the tiny target."""
    root = tmp_path / "pretrained"
    model = get_family("eagle3").build(tiny.model.config, {"draft_vocab_size": 64, "depth": 2, "top_k": 3})
    export_drafter(model.eval(), tiny.identity.to_dict(), root / "eagle3-tiny")
    monkeypatch.setattr(pretrained, "ROOT", root)
    return root / "eagle3-tiny"


def test_a_method_without_a_directory_serves_the_drafter_shipped_for_the_target(tiny, shipped_for_tiny):
    drafter = build_drafter("eagle3", tiny)
    assert (drafter.depth, drafter.top_k) == (2, 3)  # the shipped config's tree
    assert build_drafter("eagle3:depth=1:top_k=2", tiny).depth == 1  # options without a directory


def test_no_shipped_drafter_for_a_family_or_target_is_one_line_naming_the_shipped_ones(
    tiny, shipped_for_tiny, monkeypatch
):
    with pytest.raises(MethodError, match=r"fspad needs an exported drafter directory.*shipped: eagle3-tiny"):
        build_drafter("fspad", tiny)
    other = TargetIdentity("other", "r", "c" * 64, "t" * 64)
    monkeypatch.setattr(tiny, "identity", other)
    with pytest.raises(MethodError, match="no eagle3 drafter is shipped for this target"):
        build_drafter("eagle3", tiny)


def test_the_shipped_smollm2_drafter_is_an_intact_eagle3_export():
    (directory,) = [d for d in pretrained.bundled_drafters() if d.name == "eagle3-smollm2"]
    assert file_problems(directory) == {}  # files.json vouches for every file, the model card included
    config = json.loads((directory / "config.json").read_text())
    assert config["drafter_family"] == "eagle3" and "SmolLM2-135M-Instruct" in config["target_identity"]["name"]
    model = get_family("eagle3").model_class.from_pretrained(str(directory))
    assert sum(p.numel() for p in model.parameters()) > 9_000_000


@pytest.mark.slow
def test_eagle3_on_smollm2_decodes_with_the_shipped_drafter_as_plain_decoding_does():
    from draftsmith.data.regenerate import encode_prompt
    from draftsmith.inference.runtime import generate

    target = load_target("smollm2")
    drafter = build_drafter("eagle3", target)
    prompt = encode_prompt(target, [{"role": "user", "content": "Name three prime numbers."}])
    plain = generate(target.model, prompt, None, max_new_tokens=24)
    drafted = generate(target.model, prompt, drafter, max_new_tokens=24)
    assert drafted.tokens == plain.tokens
    assert drafted.target_forwards < plain.target_forwards  # it did accept drafts


@pytest.mark.slow
def test_the_shipped_drafter_exports_by_name_to_the_layout_vllm_loads(tmp_path):
    """`draftsmith export eagle3-smollm2 --format vllm`: the shipped weights, widened to float32, for the
    embedded SmolLM2 (the target named by its identity)."""
    import torch
    from safetensors.torch import load_file

    from draftsmith.drafters.io import read_engine_export
    from draftsmith.train.export import ExportLayout, export_run

    out = export_run(Path("eagle3-smollm2"), tmp_path / "vllm", ExportLayout("vllm"))
    record = read_engine_export(out)
    assert record["family"] == "eagle3" and record["format"] == "vllm"
    assert "SmolLM2-135M-Instruct" in record["target_identity"]["name"]
    shipped = load_file(str(pretrained.ROOT / "eagle3-smollm2" / "model.safetensors"))
    layout = load_file(str(out / "model.safetensors"))
    assert layout["fc.weight"].dtype == torch.float32 and torch.equal(layout["fc.weight"], shipped["fc.weight"].float())
