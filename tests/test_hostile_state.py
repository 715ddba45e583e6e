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
from test_hostile import read_only

from conftest import sharegpt, write_jsonl
from draftsmith.cli import main
from draftsmith.core.io import write_files_manifest
from draftsmith.train.checkpoint import read_run_info
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
        ("eagle3", "drafter.ttt_steps=100000", "drafter.ttt_steps must be >= 1 and <= 64 (a step per draft depth)"),
        ("fspad", "drafter.draft_vocab_size=-1", "drafter.draft_vocab_size must be a whole number >= 0"),
    ],
    ids=["bool-text", "bool-text-eagle", "ttt-steps", "draft-vocab-negative"],
)
def test_a_recipe_value_of_the_wrong_type_or_range_is_one_line(
    tmp_path, tiny_target_dir, prepared_dir, capsys, family, override, message
):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir, drafter={"family": family})
    recipe.write_text(recipe.read_text().replace("metric_steps: 2", "{}"))  # a loss option every family has
    line = refused(["train", recipe, "train.max_steps=2", "drafter.draft_vocab_size=0", override], capsys)
    assert message in line and "top_k" not in line
    assert not (tmp_path / "run").exists()


def test_a_warm_up_longer_than_the_run_takes_the_run_and_reaches_the_learning_rate(
    tmp_path, tiny_target_dir, prepared_dir, capsys
):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir, train={"max_steps": 2, "scheduler": "constant"})
    main(["train", str(recipe), "train.warmup_steps=1000000000000"])
    assert "train.warmup_steps=1000000000000 is longer than the run's 2 steps" in capsys.readouterr().err
    rates = [json.loads(line).get("lr") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(rate for rate in rates if rate is not None) == pytest.approx(1e-3)  # not 1e-3 * 2e-12


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
    "head-dim-7": (set_layer(head_dim=7), "layer.head_dim must be an even whole number"),
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
    assert "--checkpoint '../../other/checkpoints/step-2' is not the name of a complete checkpoint of" in line
    assert line.endswith("; complete ones: step-2")
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


# ---- write checks before any model loads, in words that name the cause --------------------------------------


def test_tune_on_a_read_only_export_is_refused_before_the_target_loads(
    plain_export, tmp_path, no_model_loads, monkeypatch, capsys
):
    drafter = Path(shutil.copytree(plain_export, tmp_path / "drafter"))
    before = snapshot(drafter)
    read_only(monkeypatch)
    line = refused(["tune", drafter, "--limit", "1"], capsys)
    assert f"EXPORT {drafter} cannot be written (Read-only file system in {drafter})" in line
    assert "copy the export somewhere writable" in line and "free space" not in line
    assert snapshot(drafter) == before


@pytest.mark.parametrize("option, value", [("--top-k", "100000"), ("--total-tokens", "1,99999")])
def test_tune_numbers_beyond_a_trees_limits_are_one_line(plain_export, no_model_loads, capsys, option, value):
    line = refused(["tune", plain_export, option, value], capsys)
    assert f"{option} takes comma-separated whole numbers from 1 to" in line


@pytest.mark.parametrize("problem", ["a-file", "read-only"])
def test_a_target_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys, problem):
    cache = tmp_path / "cache"
    if problem == "a-file":
        cache.write_text("not a folder\n")
    else:
        read_only(monkeypatch)
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(cache))
    monkeypatch.setattr("draftsmith.core.target._build_embedded_cache", lambda *a: pytest.fail("converting"))
    line = refused(["generate", "Hi", "--target", "smollm2", "--max-new-tokens", "2"], capsys)
    expected = f"{cache} is a file" if problem == "a-file" else "cannot be written (Read-only file system in"
    assert "the target cache" in line and expected in line and "set DRAFTSMITH_CACHE to a folder you can write" in line


def test_a_write_refused_by_a_read_only_disk_does_not_say_free_space():
    import errno

    from draftsmith.core.io import disk_failure, disk_fix

    assert disk_fix(disk_failure(OSError(errno.EROFS, "Read-only file system"))) == "make it writable"
    assert disk_fix(disk_failure(OSError(errno.ENOSPC, "No space left on device"))) == "free space"


# ---- lines that name the real cause -------------------------------------------------------------------------


def test_a_recipe_that_is_a_folder_is_one_line(tmp_path, no_model_loads, capsys):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "fspad.yaml").write_text("{}\n")
    line = refused(["train", folder], capsys)
    assert f"recipe {folder} is a folder, not a YAML file; give the recipe file, e.g. {folder / 'fspad.yaml'}" in line
    assert "Errno" not in line


def test_a_missing_drafter_folder_is_not_called_an_unknown_method(tmp_path, tiny_target_dir, capsys):
    missing = tmp_path / "run" / "drafter"  # what an export killed before its final rename leaves: nothing
    line = refused(["generate", "Hi", "--method", missing, "--target", tiny_target_dir], capsys)
    assert f"{missing} does not exist: no drafter folder there" in line and "unknown method" not in line


def test_overrides_may_follow_the_options(runs, capsys):
    main(["train", str(runs / "recipe.yaml"), "--resume", "train.max_steps=3"])
    assert read_run_info(runs / "run")["total_steps"] == 3
    line = refused(["train", runs / "recipe.yaml", "--resume", "--no-such-option"], capsys)
    assert "unrecognized arguments: --no-such-option" in line


def test_bench_methods_take_a_quoted_entry_holding_a_comma(tmp_path, plain_export, monkeypatch):
    from draftsmith.inference import cli as inference_cli

    drafter = Path(shutil.copytree(plain_export, tmp_path / "a,b" / "drafter"))
    parser = inference_cli.argparse.ArgumentParser()
    commands = parser.add_subparsers()
    inference_cli.add_inference_commands(commands)
    methods = f'pld,"eagle={drafter}:depth=2"'
    args = parser.parse_args(["bench", "--questions", "q.jsonl", "--out", "out", "--methods", methods])
    assert args.methods == ["pld", f"eagle={drafter}:depth=2"]


# ---- under accelerate launch: one line, the launcher's summary names it --------------------------------------


@pytest.mark.parametrize("rank", ["0", "1"])
def test_each_rank_hands_a_user_error_to_the_launcher_and_rank_0_prints_it(tmp_path, monkeypatch, capsys, rank):
    from draftsmith.train.__main__ import main as launched_main

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as info:
        launched_main([str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err
    line = f"draftsmith: error: recipe {tmp_path / 'missing.yaml'} does not exist"
    assert info.value.code == 2 and "Traceback" not in err
    assert err.splitlines() == ([line] if rank == "0" else [])
    assert json.loads(error_file.read_text())["message"] == line  # torchrun's failure summary shows it


def test_python_m_draftsmith_train_reports_a_bad_option_in_one_line(tmp_path, capsys):
    from draftsmith.train.__main__ import main as launched_main

    with pytest.raises(SystemExit) as info:
        launched_main([str(tmp_path / "recipe.yaml"), "--no-such-option"])
    lines = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(lines) == 1 and "unrecognized arguments: --no-such-option" in lines[0]


@pytest.mark.slow
def test_two_launched_processes_end_a_user_error_in_one_line(tmp_path):
    """`accelerate launch --quiet` of two processes: the one line, no traceback (without --quiet the launcher
    adds its own, whatever the status: docs/reliability.md)."""
    import os
    import subprocess
    import sys

    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or "accelerate"
    config = Path(__file__).resolve().parents[1] / "recipes" / "accelerate" / "zero2.yaml"
    command = [accelerate, "launch", "--quiet", "--config_file", str(config), "--num_processes", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "WANDB_MODE": "disabled"}
    missing = tmp_path / "missing.yaml"
    result = subprocess.run(
        [*command, "-m", "draftsmith.train", str(missing)], capture_output=True, text=True, timeout=600, env=env
    )
    line = f"draftsmith: error: recipe {missing} does not exist"
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [text for text in result.stderr.splitlines() if text.startswith("draftsmith: error:")] == [line]


@pytest.mark.parametrize("command", ["generate", "tune", "export-vllm"])
def test_an_export_of_an_unknown_family_is_one_line(plain_export, tmp_path, tiny_target_dir, capsys, command):
    drafter = edited_export(plain_export, tmp_path / "drafter", lambda config: config.update(drafter_family="bogus"))
    argv = {
        "generate": ["generate", "Hi", "--target", tiny_target_dir, "--method", drafter],
        "tune": ["tune", drafter, "--target", tiny_target_dir, "--limit", "1"],
        "export-vllm": ["export", drafter, "--format", "vllm", "--out", tmp_path / "vllm"],
    }[command]
    line = refused(argv, capsys)
    assert "'bogus'" in line and ("does not know" in line or "unknown drafter family" in line)
