"""Hostile outputs (issue 30): one output rule for every command that writes, one writer per output, and
integrity records that vouch only for what they checked.

Every refusal is exit status 2 with one ``draftsmith: error:`` line (``refused``), and every test checks
that the user's files around it are still there, byte for byte (``snapshot``).
"""

# ruff: noqa: F811  (the fixtures imported from test_hostile and test_trainer are test arguments by design)
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from draftsmith.cli import main
from draftsmith.core.io import write_files_manifest
from draftsmith.core.lock import OutputInUseError, exclusive_output, lock_path
from helpers import generate_argv, refused, snapshot, write_recipe

# ---- --overwrite replaces only what the command wrote ---------------------------------------------------


def test_prepare_overwrite_refuses_a_folder_holding_the_users_files(
    tmp_path,
    data_dir,
    tiny_target_dir,
    capsys,
):
    out = tmp_path / "prepared"
    argv = ["data", "prepare", data_dir / "mydata.jsonl", "--out", out, "--target", tiny_target_dir]
    main([str(a) for a in argv])
    (out / "notes.txt").write_text("my notes\n")
    (out / "sub").mkdir()
    (out / "sub" / "keep.txt").write_text("keep me\n")
    before = snapshot(out)
    line = refused([*argv, "--overwrite"], capsys)
    assert "holds files that are not part of a prepared dataset" in line
    assert "notes.txt" in line and "sub/keep.txt" in line
    assert snapshot(out) == before


def folder_with(folder: Path, files: dict[str, str]) -> Path:
    """A new folder holding ``files`` (name: text): a look-alike of a command's output beside the user's files."""
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_a_fake_manifest_does_not_make_a_folder_ours(tmp_path, data_dir, tiny_target_dir, no_model_loads, capsys):
    folder = folder_with(
        tmp_path / "mine", {"manifest.json": '{"format": "draftsmith.prepared/1"}', "thesis.tex": "years of work\n"}
    )
    before = snapshot(folder)
    argv = ["data", "prepare", data_dir / "mydata.jsonl", "--out", folder, "--target", tiny_target_dir, "--overwrite"]
    assert "thesis.tex" in refused(argv, capsys)
    assert snapshot(folder) == before


def test_export_overwrite_refuses_the_users_files_and_keeps_fitted_trees(runs, tmp_path, capsys):
    from draftsmith.core.io import record_rewritten_file

    exported = tmp_path / "drafter"
    main(["export", str(runs / "run"), "--out", str(exported)])
    (exported / "tuned_trees.json").write_text('{"format": "draftsmith.tuned_trees/1", "entries": {}}\n')
    record_rewritten_file(exported, "tuned_trees.json")  # as `draftsmith tune` leaves it
    main(["export", str(runs / "run"), "--out", str(exported), "--overwrite"])  # the same weights again
    assert (exported / "tuned_trees.json").is_file()
    assert "tuned_trees.json" in json.loads((exported / "files.json").read_text())["files"]
    (exported / "NOTES.md").write_text("my notes\n")
    line = refused(["export", runs / "run", "--out", exported, "--overwrite"], capsys)
    assert "NOTES.md" in line and (exported / "NOTES.md").read_text() == "my notes\n"


def test_bench_overwrite_refuses_the_users_files(tmp_path, questions, tiny_target_dir, no_model_loads, capsys):
    out = folder_with(tmp_path / "bench", {"results.json": '{"methods": {}}', "analysis.tex": "my analysis\n"})
    before = snapshot(out)
    argv = ["bench", "--questions", questions, "--out", out, "--target", tiny_target_dir, "--overwrite"]
    assert "analysis.tex" in refused(argv, capsys)
    assert snapshot(out) == before


@pytest.mark.parametrize("out", ["corpus.txt", "note.txt", "."], ids=["the-corpus", "a-user-file", "corpus-folder"])
def test_spectra_index_never_writes_over_a_file_it_did_not_write(tmp_path, no_model_loads, capsys, out):
    (tmp_path / "corpus.txt").write_text("one document\nanother document\n")
    (tmp_path / "note.txt").write_text("my note\n")
    before = snapshot(tmp_path)
    line = refused(["spectra-index", tmp_path / "corpus.txt", "--out", tmp_path / out, "--overwrite"], capsys)
    assert "--out" in line and ("corpus" in line or "is not a SPECTRA index" in line)
    assert snapshot(tmp_path) == before


def test_medusa_calibrate_never_writes_over_a_file_it_did_not_write(tmp_path, no_model_loads, capsys):
    (tmp_path / "note.json").write_text('{"mine": true}\n')
    argv = ["medusa", "calibrate", tmp_path / "drafter", "--data", tmp_path / "data", "--nodes", "4"]
    line = refused([*argv, "--out", tmp_path / "note.json", "--overwrite"], capsys)
    assert "exists and is not a tree file written by `draftsmith medusa calibrate`" in line
    assert (tmp_path / "note.json").read_text() == '{"mine": true}\n'


@pytest.mark.parametrize("flags", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_bench_tree_checks_its_out_before_the_model_loads(tmp_path, no_model_loads, capsys, flags):
    out = tmp_path / "timings"
    out.mkdir()
    (out / "bench_tree.json").write_text("{}")
    (out / "paper.md").write_text("my paper\n")
    before = snapshot(out)
    refused(["bench-tree", "--out", out, "--sizes", "1,2", *flags], capsys)
    assert snapshot(out) == before


def test_cache_features_refuses_its_own_input_as_out(prepared_dir, no_model_loads, capsys):
    before = snapshot(prepared_dir)
    line = refused(["data", "cache-features", prepared_dir, "--out", prepared_dir, "--overwrite"], capsys)
    assert "is the prepared dataset" in line
    assert snapshot(prepared_dir) == before


def test_regenerate_refuses_its_own_input_as_out(tmp_path, chat_records, no_model_loads, capsys):
    from conftest import write_jsonl

    source = write_jsonl(tmp_path / "chats.jsonl", chat_records)
    before = snapshot(tmp_path)
    assert "is the input" in refused(["data", "regenerate", source, "--out", source], capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["prepared", "user-folder", "inside-prepared"])
def test_train_refuses_an_output_dir_that_is_not_a_run(
    tmp_path,
    tiny_target_dir,
    prepared_dir,
    no_model_loads,
    capsys,
    kind,
):
    folder = {"prepared": prepared_dir, "inside-prepared": prepared_dir / "run", "user-folder": tmp_path / "mine"}[kind]
    if kind == "user-folder":
        folder.mkdir()
        (folder / "notes.txt").write_text("my notes\n")
    watched = folder if folder.exists() else prepared_dir
    before = snapshot(watched)
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir, output_dir=str(folder))
    line = refused(["train", recipe], capsys)
    expected = {"prepared": "is the prepared dataset", "user-folder": "notes.txt", "inside-prepared": "lies inside"}
    assert expected[kind] in line and "output_dir" in line
    assert snapshot(watched) == before


# ---- one writer per output --------------------------------------------------------------------------------


def test_a_held_output_refuses_a_second_writer_naming_the_first(tmp_path):
    out = tmp_path / "out"
    with exclusive_output(out):
        with pytest.raises(OutputInUseError, match=f"pid {os.getpid()}"):
            with exclusive_output(tmp_path / "." / "out"):  # another spelling of the same output
                pass
    assert not lock_path(out).exists()  # released: the next command proceeds
    with exclusive_output(out):
        pass


def test_a_stale_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = tmp_path / "out"
    lock_path(out).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    with exclusive_output(out):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()


def wait_for(condition, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the first command never took its lock"
        time.sleep(0.02)


def test_two_trains_on_one_output_dir_the_second_refuses_the_first_completes(
    tmp_path,
    tiny_target_dir,
    prepared_dir,
    capsys,
):
    first = write_recipe(tmp_path / "a", tiny_target_dir, prepared_dir, output_dir=str(tmp_path / "run"))
    second = write_recipe(
        tmp_path / "b", tiny_target_dir, prepared_dir, output_dir=str(tmp_path / "run"), train={"seed": 7}
    )
    command = [sys.executable, "-c", "from draftsmith.cli import main; main()", "train", str(first)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lock_path(tmp_path / "run").exists, process)
    line = refused(["train", second], capsys)
    assert f"is being written by another draftsmith command (pid {process.pid}" in line
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records if "loss" in record] == [1, 2, 3, 4]  # each step once
    assert yaml.safe_load((tmp_path / "run" / "recipe.resolved.yaml").read_text())["train"]["seed"] == 0
    assert not lock_path(tmp_path / "run").exists()


def test_two_benches_on_one_out_the_second_refuses(tmp_path, questions, tiny_target_dir, capsys):
    out = tmp_path / "bench"
    argv = ["bench", "--questions", questions, "--out", out, "--target", tiny_target_dir, "--max-new-tokens", "4"]
    command = [sys.executable, "-c", "from draftsmith.cli import main; main()", *map(str, argv)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lock_path(out).exists, process)
    assert f"pid {process.pid}" in refused(argv, capsys)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    assert json.loads((out / "results.json").read_text())["questions"] == 1


# ---- integrity: a record vouches only for what was checked -------------------------------------------------


def test_export_of_a_checkpoint_without_its_record_is_refused(runs, tmp_path, capsys):
    (runs / "run" / "checkpoints" / "step-2" / "files.json").unlink()
    line = refused(["export", runs / "run", "--out", tmp_path / "drafter"], capsys)
    assert "files.json is missing" in line
    assert not (tmp_path / "drafter").exists()  # nothing exported, nothing vouched for


def test_a_record_naming_a_file_outside_its_folder_is_refused(runs, tmp_path, capsys):
    record = runs / "run" / "checkpoints" / "step-2" / "files.json"
    manifest = json.loads(record.read_text())
    manifest["files"]["../../../../etc/passwd"] = {"size": 1, "sha256": "0" * 64}
    record.write_text(json.dumps(manifest))
    line = refused(["export", runs / "run", "--out", tmp_path / "drafter"], capsys)
    assert "'../../../../etc/passwd', which is not a file inside" in line


def poison(weights: Path) -> None:
    tensors = load_file(str(weights))
    name = next(n for n, t in tensors.items() if t.is_floating_point())
    tensors[name][0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_export_refuses_non_finite_weights(runs, tmp_path, capsys):
    checkpoint = runs / "run" / "checkpoints" / "step-2"
    poison(checkpoint / "drafter" / "model.safetensors")
    write_files_manifest(checkpoint)  # recorded as they are: the record alone cannot catch a diverged run
    assert "holds non-finite weights" in refused(["export", runs / "run", "--out", tmp_path / "drafter"], capsys)
    assert not (tmp_path / "drafter").exists()


def test_loading_non_finite_weights_is_one_line(runs, tmp_path, tiny_target_dir, capsys):
    drafter = tmp_path / "drafter"
    main(["export", str(runs / "run"), "--out", str(drafter)])
    poison(drafter / "model.safetensors")
    write_files_manifest(drafter)
    assert "holds non-finite weights" in refused(generate_argv(drafter, tiny_target_dir), capsys)


def test_an_export_made_before_records_loads_with_one_warning(runs, tmp_path, tiny_target_dir, capsys):
    drafter = tmp_path / "drafter"
    main(["export", str(runs / "run"), "--out", str(drafter)])
    (drafter / "files.json").unlink()
    capsys.readouterr()
    main([str(a) for a in generate_argv(drafter, tiny_target_dir)])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftsmith: warning:")]
    assert len(warnings) == 1 and "records no files.json" in warnings[0]
    assert not (drafter / "files.json").exists()  # never re-vouched


def test_tuned_trees_are_dropped_when_the_weights_change(runs, tmp_path):
    exported = tmp_path / "drafter"
    main(["export", str(runs / "run"), "--out", str(exported)])
    (exported / "tuned_trees.json").write_text('{"format": "draftsmith.tuned_trees/1", "entries": {}}\n')
    write_files_manifest(exported)
    checkpoint = runs / "run" / "checkpoints" / "step-2"
    weights = load_file(str(checkpoint / "drafter" / "model.safetensors"))
    changed = {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in weights.items()}
    save_file(changed, str(checkpoint / "drafter" / "model.safetensors"), metadata={"format": "pt"})
    write_files_manifest(checkpoint)  # as if training had gone on: other weights, the same run
    main(["export", str(runs / "run"), "--out", str(exported), "--overwrite"])
    assert not (exported / "tuned_trees.json").exists()  # fitted for weights that are gone


# ---- numbers and recipes as data ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--temperature", "-1", "temperature must be 0 (greedy) or at least 1e-4"),
        ("--temperature", "inf", "temperature must be a finite number"),
        ("--temperature", "nan", "temperature must be a finite number"),
        ("--temperature", "1e-300", "temperature must be 0 (greedy) or at least 1e-4"),
        ("--top-p", "2", "top-p must be in (0, 1]"),
        ("--top-p", "0", "top-p must be in (0, 1]"),
        ("--top-k", "-1", "must be an integer >= 0"),
        ("--seed", str(10**30), "seed must be at most"),
        ("--threads", "10000", "(the cores available)"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "regenerate"])
def test_decoding_options_are_checked_once_for_every_command(command, option, value, message, no_model_loads, capsys):
    argv = ["generate", "hello"] if command == "generate" else ["data", "regenerate", "x.jsonl", "--out", "y.jsonl"]
    line = refused([*argv, option, value], capsys)
    assert message in line and option in line


def test_a_recipe_with_a_repeated_key_or_section_is_refused(
    tmp_path, tiny_target_dir, prepared_dir, no_model_loads, capsys
):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir)
    text = recipe.read_text()
    recipe.write_text(text + "train:\n  epochs: 1\n")  # a second train: section would replace the first
    assert "key 'train' appears twice" in refused(["train", recipe], capsys)
    recipe.write_text(text.replace("warmup_steps: 1", "warmup_steps: 1\n  warmup_steps: 0"))
    assert "key 'warmup_steps' appears twice" in refused(["train", recipe], capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["train.weight_decay=nan", "train.lr=.inf"])
def test_recipe_numbers_must_be_finite(tmp_path, tiny_target_dir, prepared_dir, no_model_loads, capsys, override):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir)
    assert "must be a finite number" in refused(["train", recipe, override], capsys)


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_a_training_seed_outside_numpys_range_is_refused(
    tmp_path, tiny_target_dir, prepared_dir, no_model_loads, capsys, seed
):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir)
    line = refused(["train", recipe, f"train.seed={seed}"], capsys)
    assert f"train.seed must be a whole number from 0 to 4294967295, got {seed}" in line
