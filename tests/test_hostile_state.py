"""Hostile cases of round three (issue 75): no silent wrong state, every value checked where it is read,
records that vouch only for what is on disk, and lines that name the real cause.

Every refusal is exit status 2 with one ``draftsmith: error:`` line (``refused``), and every test checks
that the user's files around it are still there (``snapshot``).
"""

# ruff: noqa: F811  (fixtures imported from other test modules are test arguments by design)
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import sharegpt, write_jsonl
from draftsmith.core.io import write_files_manifest
from draftsmith.train.checkpoint import read_run_info
from draftsmith.train.cli import main
from helpers import refused, snapshot, write_recipe

# ---- resume checks the data by content, not by path ------------------------------------------------------


@pytest.fixture()
def run_on_own_data(tmp_path, chat_records, tiny_target_dir) -> tuple[Path, list[str]]:
    """A two-step run on a prepared set of its own (so the test may replace it); returns the recipe and
    the `data prepare` command line that wrote the set."""
    source = write_jsonl(tmp_path / "chats.jsonl", chat_records * 4)
    prepared = tmp_path / "prepared"
    prepare = ["data", "prepare", str(source), "--out", str(prepared), "--target", str(tiny_target_dir)]
    main(prepare)
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared, train={"max_steps": 2, "save_every": 2})
    main(["train", str(recipe)])
    return recipe, prepare


def replace_with_other_data(tmp_path: Path, prepare: list[str]) -> None:
    """`data prepare OTHER --out P --overwrite`: the same path, other conversations."""
    chats = [sharegpt(("human", f"Hi {n}?"), ("gpt", f"Hello {n}."), id=f"o{n}") for n in range(2)]
    other = write_jsonl(tmp_path / "other.jsonl", chats)
    main([prepare[0], prepare[1], str(other), *prepare[3:], "--overwrite"])


def test_resume_refuses_other_data_at_the_same_path(tmp_path, run_on_own_data, capsys):
    recipe, prepare = run_on_own_data
    run = tmp_path / "run"
    started = read_run_info(run)["data"]
    replace_with_other_data(tmp_path, prepare)
    before = snapshot(run)
    line = refused(["train", recipe, "train.max_steps=4", "--resume"], capsys)
    prepared = tmp_path / "prepared"
    assert f"cannot resume {run}: data.prepared {prepared} holds other data than the run started on" in line
    assert "tokens.safetensors" in line and "--resume-new-data" in line
    assert snapshot(run) == before and read_run_info(run)["data"] == started


def test_resume_on_new_data_when_asked_is_recorded(tmp_path, run_on_own_data, capsys):
    recipe, prepare = run_on_own_data
    started = read_run_info(tmp_path / "run")["data"]
    replace_with_other_data(tmp_path, prepare)
    main(["train", str(recipe), "train.max_steps=4", "--resume", "--resume-new-data"])
    info = read_run_info(tmp_path / "run")
    assert info["data"] != started and info["train_samples"] == 2
    [change] = info["data_changes"]
    assert change["at"] == "step-2" and change["before"] == started and "tokens.safetensors" in change["change"]


def test_resume_on_the_same_data_moved_elsewhere_goes_on(tmp_path, run_on_own_data):
    """The content decides, not the path: a copy of the same prepared set elsewhere is the same data."""
    recipe, _ = run_on_own_data
    shutil.copytree(tmp_path / "prepared", tmp_path / "moved")
    main(["train", str(recipe), "train.max_steps=4", f"data.prepared={tmp_path / 'moved'}", "--resume"])
    assert "data_changes" not in read_run_info(tmp_path / "run")


# ---- recipe and config values: typed and ranged where they are read ---------------------------------------


@pytest.mark.parametrize(
    "family, override, message",
    [
        ("fspad3", "drafter.feature_sampler=maybe", "drafter.feature_sampler must be true or false, got 'maybe'"),
        ("eagle", "drafter.partial_alignment=perhaps", "drafter.partial_alignment must be true or false"),
        ("eagle3", "drafter.ttt_steps=100000", "drafter.ttt_steps must be from 1 to 64 (a step per draft depth)"),
        ("fspad", "drafter.draft_vocab_size=-1", "drafter.draft_vocab_size must be a whole number >= 0"),
        ("fspad", "train.warmup_steps=1000000000000", "train.warmup_steps=1000000000000 is longer than the run's 2"),
    ],
    ids=["bool-text", "bool-text-eagle", "ttt-steps", "draft-vocab-negative", "warmup-beyond-the-run"],
)
def test_a_recipe_value_of_the_wrong_type_or_range_is_one_line(
    tmp_path, tiny_target_dir, prepared_dir, capsys, family, override, message
):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir, drafter={"family": family})
    recipe.write_text(recipe.read_text().replace("metric_steps: 2", "{}"))  # a loss option every family has
    line = refused(["train", recipe, "train.max_steps=2", "drafter.draft_vocab_size=0", override], capsys)
    assert message in line and "top_k" not in line
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def plain_export(tmp_path_factory, tiny_target_dir, prepared_dir) -> Path:
    root = tmp_path_factory.mktemp("plain-export")
    recipe = write_recipe(root, tiny_target_dir, prepared_dir, drafter={"family": "eagle"}, train={"max_steps": 2})
    main(["train", str(recipe)])
    main(["export", str(root / "run"), "--out", str(root / "drafter")])
    return root / "drafter"


def edited_export(source: Path, folder: Path, edit) -> Path:
    """A copy of ``source`` whose config.json ``edit`` changed, its files.json re-vouched as an editing tool
    that knows the format would leave it."""
    drafter = Path(shutil.copytree(source, folder))
    config = json.loads((drafter / "config.json").read_text())
    edit(config)
    (drafter / "config.json").write_text(json.dumps(config))
    write_files_manifest(drafter)
    return drafter


def set_layer(**values):
    return lambda config: config["layer"].update(values)


LAYER_EDITS = {
    "heads-7": (set_layer(num_attention_heads=7), "the hidden size must be a multiple of the heads"),
    "hidden-66": (set_layer(hidden_size=66), "the hidden size must be a multiple of the heads"),
    "head-dim-7": (set_layer(head_dim=7), "layer.head_dim must be even"),
    "eps-negative": (set_layer(rms_norm_eps=-1.0), "layer.rms_norm_eps must be a finite number > 0, got -1.0"),
    "act-bogus": (set_layer(hidden_act="bogus_act"), "layer.hidden_act 'bogus_act' is no activation"),
    "rope-bogus": (set_layer(rope_parameters={"rope_type": "bogus"}), "rope_type 'bogus' is none of default"),
    "no-layer": (lambda config: config.pop("layer"), "it has no layer section"),
    "bool-text": (lambda config: config.update(feature_sampler="maybe"), "feature_sampler must be true or false"),
}


@pytest.mark.parametrize("command", ["generate", "tune", "export-vllm"])
@pytest.mark.parametrize("edit", list(LAYER_EDITS))
def test_an_export_config_with_inconsistent_layer_settings_is_one_line(
    plain_export, tmp_path, tiny_target_dir, capsys, command, edit
):
    change, message = LAYER_EDITS[edit]
    drafter = edited_export(plain_export, tmp_path / "drafter", change)
    argv = {
        "generate": ["generate", "Hi", "--target", tiny_target_dir, "--method", f"eagle={drafter}"],
        "tune": ["tune", drafter, "--target", tiny_target_dir, "--limit", "1", "--max-new-tokens", "4"],
        "export-vllm": ["export", drafter, "--format", "vllm", "--out", tmp_path / "vllm"],
    }[command]
    line = refused(argv, capsys)
    assert f"{drafter}/config.json is invalid (" in line and message in line and "export it again" in line


# ---- one output rule: quickstart, export --checkpoint, records that vouch only for what is on disk -------


def test_quickstart_refuses_a_folder_holding_the_users_files(tmp_path, no_model_loads, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work\n")
    before = snapshot(folder)
    line = refused(["quickstart", "--out", folder, "--steps", "2"], capsys)
    assert f"--out {folder} holds files that are not part of a quickstart's working directory (thesis.tex)" in line
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == ["thesis.tex"]


def test_quickstart_refuses_zero_steps_up_front(tmp_path, no_model_loads, capsys):
    line = refused(["quickstart", "--out", tmp_path / "qs", "--steps", "0"], capsys)
    assert "--steps" in line and not (tmp_path / "qs").exists()


def test_export_checkpoint_takes_only_a_name_among_the_runs_checkpoints(runs, tmp_path, capsys):
    other = Path(shutil.copytree(runs / "run", runs / "other"))
    before = snapshot(other)
    outside = "../../other/checkpoints/step-2"
    line = refused(["export", runs / "run", "--checkpoint", outside, "--out", tmp_path / "x"], capsys)
    assert "--checkpoint '../../other/checkpoints/step-2' is not one of the complete checkpoints of" in line
    assert "(step-2); give one of their names" in line
    assert not (tmp_path / "x").exists() and snapshot(other) == before
    main(["export", str(runs / "run"), "--checkpoint", "step-2", "--out", str(tmp_path / "x")])  # a name of its own
    assert (tmp_path / "x" / "model.safetensors").is_file()


def test_a_forged_record_does_not_make_a_folder_the_commands(
    tmp_path, data_dir, tiny_target_dir, no_model_loads, capsys
):
    """A fake manifest and a files.json listing the user's index.html with a wrong sha256 vouch for nothing."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "manifest.json").write_text('{"format": "draftsmith.prepared/1"}')
    (folder / "index.html").write_text("<h1>my site</h1>\n")
    record = {"format": "draftsmith.files/1", "files": {"index.html": {"size": 17, "sha256": "0" * 64}}}
    (folder / "files.json").write_text(json.dumps(record))
    before = snapshot(folder)
    argv = ["data", "prepare", data_dir / "mydata.jsonl", "--out", folder, "--target", tiny_target_dir, "--overwrite"]
    line = refused(argv, capsys)
    assert "holds files that are not part of a prepared dataset" in line
    assert "index.html (not as files.json records it)" in line
    assert snapshot(folder) == before
