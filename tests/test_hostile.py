"""Hostile inputs (issue 15): ``--overwrite`` never deletes what the command did not write, resume
survives a moved run but not lost random states, and bad numbers are one line before any model loads.

Every refusal is exit status 2 with one ``draftsmith: error:`` line and no traceback, and every test
checks that the good artifacts around it (inputs, runs, siblings, earlier results) are still there.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import sharegpt, write_jsonl
from draftsmith.cli import main
from draftsmith.core.io import write_files_manifest
from draftsmith.train.checkpoint import latest_checkpoint, rng_state_file
from helpers import generate_argv, losses, refused, snapshot, write_recipe

# ---- data prepare --overwrite --------------------------------------------------------------------


@pytest.mark.parametrize(
    "out, flags, message",
    [
        (".", ["--overwrite"], "contains the input"),  # the input's own folder: the old behaviour wiped it
        (".", [], "contains the input"),
        ("mydata.jsonl", ["--overwrite"], "is the input"),
    ],
    ids=["input-folder-overwrite", "input-folder", "input-file"],
)
def test_prepare_never_writes_over_its_input(data_dir, tiny_target_dir, no_model_loads, capsys, out, flags, message):
    before = snapshot(data_dir)
    target = ["--target", tiny_target_dir]
    line = refused(["data", "prepare", data_dir / "mydata.jsonl", "--out", data_dir / out, *target, *flags], capsys)
    assert message in line and "choose an --out outside it" in line
    assert snapshot(data_dir) == before


@pytest.mark.parametrize("flags", [["--overwrite"], []], ids=["overwrite", "plain"])
def test_prepare_refuses_a_folder_it_did_not_write(tmp_path, data_dir, tiny_target_dir, no_model_loads, capsys, flags):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    argv = ["data", "prepare", data_dir / "mydata.jsonl", "--out", foreign, "--target", tiny_target_dir, *flags]
    line = refused(argv, capsys)
    assert "pass --overwrite" not in line  # it would not help: the fix offered is another --out
    assert f"--out {foreign} is not empty and is not a prepared dataset written by `draftsmith data prepare`" in line
    assert (foreign / "cat.jpg").read_bytes() == b"\xff\xd8 a cat"


def test_prepare_overwrite_replaces_its_own_output(tmp_path, data_dir, tiny_target_dir, capsys):
    out = tmp_path / "prepared"
    argv = ["data", "prepare", str(data_dir / "mydata.jsonl"), "--out", str(out), "--target", str(tiny_target_dir)]
    main(argv)
    main([*argv, "--max-length", "64", "--overwrite"])  # documented success: its own earlier output
    assert json.loads((out / "manifest.json").read_text())["max_length"] == 64
    assert (data_dir / "mydata.jsonl").is_file()


# ---- export --overwrite ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "out, flags, message",
    [
        ("run", ["--overwrite"], "is the training run"),
        (".", ["--overwrite"], "contains the training run"),
        ("run/export", [], "lies inside the training run"),
        ("run/checkpoints", ["--overwrite"], "lies inside the training run"),
    ],
    ids=["run-itself", "run-parent", "inside-run", "run-checkpoints"],
)
def test_export_never_writes_over_the_run(runs, capsys, out, flags, message):
    before = snapshot(runs)
    line = refused(["export", runs / "run", "--out", runs / out, *flags], capsys)
    assert message in line and "choose an --out outside it" in line
    assert snapshot(runs) == before


def test_export_overwrite_replaces_only_an_earlier_export(runs, tmp_path, capsys):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work\n")
    line = refused(["export", runs / "run", "--out", foreign, "--overwrite"], capsys)
    assert "is not empty and is not a drafter written by `draftsmith export`" in line
    assert (foreign / "thesis.tex").read_text() == "years of work\n"
    exported = tmp_path / "drafter"
    main(["export", str(runs / "run"), "--out", str(exported)])
    main(["export", str(runs / "run"), "--out", str(exported), "--overwrite"])  # documented success
    assert json.loads((exported / "config.json").read_text())["drafter_family"] == "fspad"


# ---- bench --out ------------------------------------------------------------------------------------


def bench_argv(questions: Path, out: Path, target: Path, *extra: str) -> list:
    return ["bench", "--questions", questions, "--out", out, "--target", target, "--max-new-tokens", "4", *extra]


def test_bench_refuses_earlier_results_before_the_model_loads(tmp_path, questions, tiny_target_dir, capsys):
    out = tmp_path / "bench"
    main([str(a) for a in bench_argv(questions, out, tiny_target_dir)])
    earlier = snapshot(out)
    assert "results.json" in earlier
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patch:  # the refusal must come before the (long) run
        patch.setattr("draftsmith.core.target.load_target", lambda *a, **k: pytest.fail("the model loaded"))
        line = refused(bench_argv(questions, out, tiny_target_dir), capsys)
    assert "already exists and is not empty; choose another --out or pass --overwrite" in line
    assert snapshot(out) == earlier
    main([str(a) for a in bench_argv(questions, out, tiny_target_dir, "--overwrite")])  # documented success
    assert json.loads((out / "results.json").read_text())["questions"] == 1


@pytest.mark.parametrize(
    "out, message",
    [
        ("blocker/bench", "cannot be created: "),  # its parent is a file: the old bench found out after the run
        ("blocker", "is a file, not a directory"),
        (".", "contains the questions file"),
        ("questions.jsonl", "is the questions file"),
    ],
    ids=["under-a-file", "a-file", "questions-folder", "questions-file"],
)
def test_bench_checks_its_out_before_the_model_loads(
    tmp_path, questions, tiny_target_dir, no_model_loads, capsys, out, message
):
    (tmp_path / "blocker").write_text("a file\n")
    before = snapshot(tmp_path)
    line = refused([*bench_argv(questions, tmp_path / out, tiny_target_dir), "--overwrite"], capsys)
    assert message in line and "--out" in line
    assert snapshot(tmp_path) == before


def test_bench_refuses_a_drafter_folder_named_in_methods(tmp_path, questions, no_model_loads, capsys):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"drafter_family": "fspad"}')
    argv = bench_argv(questions, drafter, tmp_path, "--methods", f"pld,fspad={drafter}", "--overwrite")
    assert "is the input of --methods fspad=" in refused(argv, capsys)
    assert (drafter / "config.json").is_file()


def test_an_interrupted_bench_resumes_where_it_stopped(tmp_path, tiny_target_dir, capsys, monkeypatch):
    """A bench killed after two of three questions keeps them in progress.jsonl (a torn line after them
    is dropped); a plain rerun is refused, a resume with other options is refused naming them, and
    --resume decodes only the third question and writes results over all three."""
    from draftsmith.inference.measure import bench

    records = [{"question_id": f"q{i}", "category": "writing", "turns": [f"Write {i} words."]} for i in range(3)]
    questions = write_jsonl(tmp_path / "questions.jsonl", records)
    out = tmp_path / "bench"
    argv = [str(a) for a in bench_argv(questions, out, tiny_target_dir, "--methods", "pld")]
    real, asked = bench._run_question, []

    def crashing(target, question, *args):
        asked.append(question.id)
        if question.id == "q2" and len(asked) == 3:
            raise KeyboardInterrupt  # the user's Ctrl-C, or a killed job
        return real(target, question, *args)

    monkeypatch.setattr(bench, "_run_question", crashing)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 130
    assert sorted(p.name for p in out.iterdir()) == ["progress.jsonl"]
    with open(out / "progress.jsonl", "a") as handle:
        handle.write('{"question": "q2", "tu')  # torn by the kill
    capsys.readouterr()
    assert "holds an unfinished bench (2 questions done); --resume continues it" in refused(argv, capsys)
    other = [*argv[: argv.index("--max-new-tokens")], "--max-new-tokens", "5", "--methods", "pld", "--resume"]
    assert "ran with other max_new_tokens" in refused(other, capsys)
    asked.clear()
    main([*argv, "--resume"])
    assert asked == ["q2"] and "resuming after 2 finished questions of 3" in capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["resumed_questions"] == 2 and not (out / "progress.jsonl").exists()
    for method in ("hf-generate", "none", "pld"):
        assert results["methods"][method]["overall"]["identical"] == results["methods"][method]["overall"]["total"] == 3


# ---- resume -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["trailing-slash", "dot-relative", "moved", "copied"])
def test_resume_accepts_the_same_run_spelt_differently_or_moved(runs, monkeypatch, spelling):
    """Documented success: the run at output_dir resumes wherever it was first written."""
    recipe = runs / "recipe.yaml"
    monkeypatch.chdir(runs)
    run = runs / "run"
    if spelling == "moved":
        run = runs.parent / "elsewhere"
        shutil.move(runs / "run", run)
    elif spelling == "copied":
        run = runs / "copy"
        shutil.copytree(runs / "run", run)
    output_dir = {"trailing-slash": f"{run}/", "dot-relative": "./run"}.get(spelling, str(run))
    main(["train", str(recipe), f"output_dir={output_dir}", "train.max_steps=3", "--resume"])
    assert latest_checkpoint(run).name == "step-3" and sorted(losses(run)) == [1, 2, 3]


@pytest.mark.parametrize("damage", ["missing", "truncated", "not-a-pickle"])
def test_resume_without_random_states_is_refused_unless_inexact(runs, capsys, damage):
    recipe, run = runs / "recipe.yaml", runs / "run"
    states = rng_state_file(latest_checkpoint(run), 0)
    if damage == "missing":
        states.unlink()
    elif damage == "truncated":
        states.write_bytes(states.read_bytes()[:20])
    else:
        states.write_text("hello")
    with pytest.MonkeyPatch.context() as patch:  # refused before the target loads
        patch.setattr("draftsmith.train.trainer.load_target", lambda *a, **k: pytest.fail("the model loaded"))
        line = refused(["train", recipe, "train.max_steps=3", "--resume"], capsys)
    assert f"cannot resume exactly: {states}" in line and "--resume-inexact" in line
    assert latest_checkpoint(run).name == "step-2"
    main(["train", str(recipe), "train.max_steps=3", "--resume", "--resume-inexact"])  # documented success
    assert "resuming inexactly" in capsys.readouterr().err
    assert latest_checkpoint(run).name == "step-3"


# ---- numbers refused before any model loads -----------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got 0"),
        (["generate", "hi", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be an integer >= 1, got -5"),
        (["bench", "--questions", "q", "--out", "o", "--threads", "-1"], "argument --threads: must be an integer >= 1"),
        (["bench", "--questions", "q", "--out", "o", "--max-new-tokens", "0"], "argument --max-new-tokens"),
        (["bench-tree", "--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        (["data", "regenerate", "in", "--out", "o", "--max-new-tokens", "-5"], "argument --max-new-tokens"),
        (["data", "prepare", "--out", "o", "--max-length", "0"], "argument --max-length: must be an integer >= 1"),
        (["data", "show", "--index", "-1"], "argument --index: must be an integer >= 0, got -1"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_numbers_on_the_command_line(argv, message, no_model_loads, capsys):
    assert message in refused(argv, capsys)


def test_cache_features_without_a_prepared_dataset_exits_2(tmp_path, no_model_loads, capsys):
    assert "give the prepared dataset directory" in refused(["data", "cache-features", "--out", tmp_path / "f"], capsys)


def test_show_index_out_of_range(tmp_path, chat_records, tiny_target_dir, no_model_loads, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", chat_records)
    line = refused(["data", "show", data, "--index", "99999", "--target", tiny_target_dir], capsys)
    assert "--index 99999 is out of range" in line and "has 3 usable conversations, so --index must be in 0..2" in line
    line = refused(["data", "show", data, "--id", "nope", "--target", tiny_target_dir], capsys)
    assert "--id 'nope' is not in" in line


def test_show_index_out_of_range_in_a_prepared_dataset(prepared_dir, no_model_loads, capsys):  # noqa: F811
    line = refused(["data", "show", prepared_dir, "--index", "99999"], capsys)
    assert "--index 99999 is out of range" in line and "has 16 samples, so --index must be in 0..15" in line


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=nan", "train.lr must be a finite number, got nan"),
        ("train.lr=inf", "train.lr must be a finite number, got inf"),
        ("train.lr=-inf", "train.lr must be a finite number, got -inf"),
        ("train.betas=[2,3]", "train.betas must each be in [0, 1)"),
        ("train.betas=[0.9,1.0]", "train.betas must each be in [0, 1)"),
        ("train.weight_decay=nan", "train.weight_decay must be a finite number, got nan"),
        ("train.grad_clip=inf", "train.grad_clip must be a finite number, got inf"),
    ],
)
def test_bad_recipe_numbers(tmp_path, override, message, no_model_loads, capsys):
    recipe = write_recipe(tmp_path, tmp_path / "target", tmp_path / "prepared")
    assert message in refused(["train", recipe, override], capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("turns", [[], "just a string", None], ids=["no-turns", "string-turns", "null-turns"])
def test_bench_questions_without_turns(tmp_path, turns, no_model_loads, capsys):
    record = {"question_id": "q1", "category": "writing", "turns": turns}
    questions = write_jsonl(tmp_path / "q.jsonl", [record])
    line = refused(["bench", "--questions", questions, "--out", tmp_path / "out"], capsys)
    assert "line 1" in line and ("'turns' must be a list of at least one user message" in line or "TypeError" in line)
    assert not (tmp_path / "out").exists()


# ---- work bounded by its limits -------------------------------------------------------------------------


def test_a_long_conversation_is_rendered_only_as_far_as_max_length(tokenizer, monkeypatch):
    """10,000 turns took 248 s (every turn rendered the whole prefix again); now rendering stops once the
    token budget is passed, and the sample is exactly the one the first turns alone give."""
    from draftsmith.data.formats import Conversation
    from draftsmith.data.templates import tokenize_conversation

    turns = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"Two plus two equals four, turn {i}."}
        for i in range(10_000)
    ]
    renders = []
    real_render = type(tokenizer).apply_chat_template

    def counted(self, messages, **kwargs):
        renders.append(len(messages))
        return real_render(self, messages, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counted)
    cut = tokenize_conversation(tokenizer, Conversation("long", turns), max_length=256)
    assert sum(renders) < 10_000  # the old loop rendered ~50 million turns
    assert 0 < len(cut.input_ids) <= 256 and cut.dropped_turns == 5_000 - cut.assistant_turns
    alone = tokenize_conversation(tokenizer, Conversation("long", turns[: 2 * cut.assistant_turns]))
    assert (cut.input_ids, cut.loss_mask) == (alone.input_ids, alone.loss_mask)


def test_a_huge_first_turn_is_never_tokenised_whole(tokenizer, monkeypatch):
    from draftsmith.data.formats import Conversation, RecordError
    from draftsmith.data.templates import tokenize_conversation

    tokenised = []
    real_call = type(tokenizer).__call__
    monkeypatch.setattr(
        type(tokenizer), "__call__", lambda self, text, **kw: tokenised.append(len(text)) or real_call(self, text, **kw)
    )
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "four " * 2_000_000}]
    with pytest.raises(RecordError) as info:
        tokenize_conversation(tokenizer, Conversation("huge", turns), max_length=64)
    assert info.value.reason == "too_long" and max(tokenised) <= 64 * 32


def test_prepare_skips_an_oversized_record_without_parsing_it(tmp_path, chat_records, tiny_target_dir, monkeypatch):
    import draftsmith.data.formats as formats

    monkeypatch.setattr(formats, "MAX_RECORD_CHARS", 10_000)  # the real bound is 8 MiB: same path, smaller file
    huge = sharegpt(("human", "Hi"), ("gpt", "four " * 5_000), id="huge")
    data = write_jsonl(tmp_path / "d.jsonl", [*chat_records, huge])
    parsed = []
    real_loads = formats.json.loads
    monkeypatch.setattr(
        formats.json, "loads", lambda text, *a, **k: parsed.append(len(text)) or real_loads(text, *a, **k)
    )
    main(["data", "prepare", str(data), "--out", str(tmp_path / "p"), "--target", str(tiny_target_dir)])
    counts = json.loads((tmp_path / "p" / "manifest.json").read_text())["counts"]
    assert counts["used"] == 3 and counts["skipped"] == {"too_large": 1}
    assert len(json.dumps(huge)) not in parsed  # skipped by its length alone


@pytest.mark.parametrize("suffix", ["jsonl", "json"])
def test_deeply_nested_json_is_one_line(tmp_path, chat_records, tiny_target_dir, capsys, suffix):
    nested = "[" * 200_000 + "]" * 200_000
    path = tmp_path / f"d.{suffix}"
    if suffix == "jsonl":
        path.write_text(json.dumps(chat_records[0]) + "\n" + nested + "\n")
    else:
        path.write_text("[" + json.dumps(chat_records[0]) + "," + nested + "]")
    line = refused(["data", "prepare", path, "--out", tmp_path / "p", "--target", tiny_target_dir], capsys)
    where = " at line 2" if suffix == "jsonl" else ""
    assert f"{path} nests JSON values too deeply{where}" in line
    assert not (tmp_path / "p").exists()


def test_generate_refuses_a_prompt_longer_than_the_context(tiny_target_dir, capsys):
    """The tiny target's context is 512 tokens: speculation used to be switched off silently."""
    line = refused(["generate", "snow " * 600, "--raw", "--target", tiny_target_dir, "--method", "pld"], capsys)
    assert "the prompt is " in line and "tokens but the target's context is 512; shorten it" in line
    line = refused(["generate", "snow " * 200, "--raw", "--target", tiny_target_dir, "--max-new-tokens", "400"], capsys)
    assert "plus --max-new-tokens 400 exceeds the target's context of 512 tokens" in line
    assert "pass --max-new-tokens" in line


def test_bench_refuses_a_question_longer_than_the_context_before_running(tmp_path, tiny_target_dir, capsys):
    short = {"question_id": "q1", "category": "writing", "turns": ["Write a poem about snow."]}
    long = {"question_id": "q2", "category": "writing", "turns": ["snow " * 600]}
    questions = write_jsonl(tmp_path / "q.jsonl", [short, long])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("draftsmith.inference.measure.bench.hf_greedy", lambda *a, **k: pytest.fail("the run started"))
        line = refused(bench_argv(questions, tmp_path / "out", tiny_target_dir), capsys)
    assert "question q2 turn 1 is " in line and "the target's context is 512; shorten it" in line
    assert not (tmp_path / "out").exists()


# ---- resume survives what a crash leaves -----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_checkpoint_run(tmp_path_factory, tiny_target_dir, prepared_dir) -> Path:  # noqa: F811
    """A four-step run with checkpoints step-2 and step-4 (its loss curve is the uninterrupted one)."""
    root = tmp_path_factory.mktemp("two-checkpoints")
    recipe = write_recipe(root, tiny_target_dir, prepared_dir, train={"max_steps": 4, "save_every": 2})
    main(["train", str(recipe)])
    return root / "run"


@pytest.fixture()
def run4(tmp_path, two_checkpoint_run) -> Path:
    """This test's own copy of the four-step run (recipes pointing at the copy)."""
    root = shutil.copytree(two_checkpoint_run.parent, tmp_path / "runs")
    for recipe in (root / "recipe.yaml", root / "run" / "recipe.resolved.yaml"):
        tree = yaml.safe_load(recipe.read_text())
        recipe.write_text(yaml.safe_dump({**tree, "output_dir": str(root / "run")}))
    return root / "run"


def tensor_bytes(path: Path, name: str) -> tuple[int, int]:
    """Where tensor ``name``'s data lies in a safetensors file: (start, end) byte offsets."""
    raw = path.read_bytes()
    header_length = int.from_bytes(raw[:8], "little")
    start, end = json.loads(raw[8 : 8 + header_length])[name]["data_offsets"]
    return 8 + header_length + start, 8 + header_length + end


def flip_byte(path: Path, offset: int, value: int = 0x7F) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= value
    path.write_bytes(bytes(raw))


def truncate(path: Path, keep: float = 0.5) -> None:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])


def damage_latest(run: Path, how: str) -> None:
    latest = run / "checkpoints" / "step-4"
    if how == "optimizer-truncated":
        truncate(latest / "optimizer.bin")
    elif how == "weights-flipped":
        flip_byte(latest / "model.safetensors", latest.joinpath("model.safetensors").stat().st_size - 5)
    elif how == "state-torn":
        (latest / "trainer_state.json").write_text('{"step": 4, "epo')
    elif how == "drafter-missing":
        (latest / "drafter" / "model.safetensors").unlink()
    elif how == "record-missing":  # every checkpoint records its files: one without vouches for nothing
        (latest / "files.json").unlink()


@pytest.mark.parametrize(
    "how, message",
    [
        ("optimizer-truncated", "optimizer.bin has "),
        ("weights-flipped", "model.safetensors is damaged (its sha256 differs"),
        ("state-torn", "trainer_state.json has "),
        ("drafter-missing", "drafter/model.safetensors is missing"),
        ("record-missing", "step-4/files.json is missing, so none of its files can be checked"),
    ],
)
def test_resume_falls_back_to_the_previous_intact_checkpoint(run4, two_checkpoint_run, capsys, how, message):
    damage_latest(run4, how)
    before = snapshot(run4 / "checkpoints" / "step-2")
    main(["train", str(run4.parent / "recipe.yaml"), "train.max_steps=4", "--resume"])
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "resuming from the previous intact checkpoint step-2" in line]
    assert len(warning) == 1 and message in warning[0] and "Traceback" not in err, err
    assert snapshot(run4 / "checkpoints" / "step-2") == before  # the good checkpoint is untouched
    assert losses(run4) == losses(two_checkpoint_run)  # steps 3 and 4 trained again, exactly as before


def test_resume_ignores_a_half_written_checkpoint_and_a_torn_metrics_line(run4, two_checkpoint_run, capsys):
    partial = run4 / "checkpoints" / ".tmp-step-6"
    shutil.copytree(run4 / "checkpoints" / "step-4", partial)
    (partial / "COMPLETE").unlink()
    truncate(partial / "optimizer.bin")
    with open(run4 / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 5, "loss": 1.2')  # the crash cut this line
    main(["train", str(run4.parent / "recipe.yaml"), "train.max_steps=5", "--resume"])
    out, err = capsys.readouterr()
    assert f"resumed from {run4 / 'checkpoints' / 'step-4'}" in out
    assert "ignoring .tmp-step-6" in err and "dropped 1 unreadable line(s) of" in err and "Traceback" not in err
    curve = losses(run4)
    assert sorted(curve) == [1, 2, 3, 4, 5] and {k: curve[k] for k in range(1, 5)} == losses(two_checkpoint_run)


def test_resume_with_every_checkpoint_damaged_is_one_line(run4, capsys):
    for name in ("step-2", "step-4"):
        truncate(run4 / "checkpoints" / name / "optimizer.bin")
    before = snapshot(run4)
    line = refused(["train", run4.parent / "recipe.yaml", "train.max_steps=5", "--resume"], capsys)
    assert "no intact checkpoint to resume" in line and "step-4/optimizer.bin has " in line
    assert "restore the run from a copy" in line
    assert snapshot(run4) == before


def test_a_hostile_random_state_pickle_runs_no_code(runs, tmp_path, capsys):
    import torch

    marker = tmp_path / "pwned"

    class Hostile:
        def __reduce__(self):
            return (Path.touch, (marker,))

    checkpoint = latest_checkpoint(runs / "run")
    states = rng_state_file(checkpoint, 0)
    torch.save({"random_state": Hostile()}, states)
    write_files_manifest(checkpoint)  # recorded as it is now, else its size refuses it before any unpickling
    line = refused(["train", runs / "recipe.yaml", "train.max_steps=3", "--resume"], capsys)
    assert f"cannot resume exactly: {states} is unreadable (UnpicklingError)" in line
    assert not marker.exists()


# ---- integrity of artifacts --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_with_vocab(tmp_path_factory, tiny_target_dir, prepared_dir) -> Path:  # noqa: F811
    """An exported FSPAD drafter with a 32-token draft vocabulary (a tensor of token ids)."""
    root = tmp_path_factory.mktemp("vocab-export")
    recipe = write_recipe(
        root, tiny_target_dir, prepared_dir, train={"max_steps": 1, "save_every": 1}, drafter={"draft_vocab_size": 32}
    )
    main(["train", str(recipe)])
    main(["export", str(root / "run"), "--out", str(root / "drafter")])
    return root / "drafter"


@pytest.fixture()
def drafter_copy(tmp_path, exported_with_vocab) -> Path:
    return shutil.copytree(exported_with_vocab, tmp_path / "drafter")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "model.safetensors has "),
        ("vocab-flipped", "model.safetensors is damaged (its sha256 differs"),
        ("legacy-truncated", "model.safetensors is damaged ("),
        ("legacy-vocab-flipped", "draft_vocab holds token id "),
    ],
)
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_damaged_export_is_one_line(
    drafter_copy, tiny_target_dir, questions, tmp_path, capsys, damage, message, command
):
    weights = drafter_copy / "model.safetensors"
    if damage.startswith("legacy"):  # exported before files were recorded: the loader's own checks
        (drafter_copy / "files.json").unlink()
    if damage.endswith("truncated"):
        truncate(weights)
    else:
        start, _ = tensor_bytes(weights, "draft_vocab")
        flip_byte(weights, start + 5, 0x01)  # a high byte of the first token id: 2**40 more
    if command == "generate":
        line = refused(generate_argv(drafter_copy, tiny_target_dir), capsys)
    else:
        line = refused(
            bench_argv(questions, tmp_path / "b", tiny_target_dir, "--methods", f"fspad={drafter_copy}"), capsys
        )
        assert not (tmp_path / "b").exists()
    assert message in line and f"export it again: `draftsmith export RUN --out {drafter_copy} --overwrite`" in line
    if damage == "legacy-vocab-flipped":
        assert "outside the target's vocabulary 0..399" in line


def test_a_damaged_eagle3_vocabulary_map_is_one_line(tmp_path, tiny_target_dir, capsys):
    """EAGLE-3 stores its draft vocabulary as offsets (d2t: target id = column + offset): a damaged
    offset is caught by the range check of the ids it yields, even in an export without files.json."""
    from draftsmith.core.target import load_target
    from draftsmith.drafters.io import export_drafter
    from draftsmith.drafters.registry import get_family

    target = load_target(str(tiny_target_dir))
    model = get_family("eagle3").build(target.model.config, {"draft_vocab_size": 32})
    drafter = export_drafter(model, target.identity.to_dict(), tmp_path / "eagle3")
    (drafter / "files.json").unlink()  # an export that recorded no sizes: the loader's own checks
    start, _ = tensor_bytes(drafter / "model.safetensors", "d2t")
    flip_byte(drafter / "model.safetensors", start + 5, 0x01)  # the first offset grows by 2**40
    argv = generate_argv(drafter, tiny_target_dir)
    argv[argv.index("--method") + 1] = f"eagle3={drafter}"
    line = refused(argv, capsys)
    assert "d2t holds token id 1099511627776, outside the target's vocabulary 0..399" in line


def test_export_of_a_damaged_checkpoint_is_one_line(run4, tmp_path, capsys):
    truncate(run4 / "checkpoints" / "step-4" / "drafter" / "model.safetensors")
    line = refused(["export", run4, "--out", tmp_path / "drafter"], capsys)
    assert "step-4/drafter/model.safetensors has " in line
    assert "export another checkpoint with --checkpoint NAME (complete ones: step-2)" in line
    main(["export", str(run4), "--out", str(tmp_path / "drafter"), "--checkpoint", "step-2"])  # documented success


@pytest.mark.parametrize("legacy", [False, True], ids=["recorded", "legacy"])
def test_a_prepared_dataset_with_flipped_bytes_is_one_line(tmp_path, prepared_dir, tiny_target_dir, capsys, legacy):  # noqa: F811
    data = shutil.copytree(prepared_dir, tmp_path / "prepared")
    tokens = data / "tokens.safetensors"
    start, _ = tensor_bytes(tokens, "input_ids")
    flip_byte(tokens, start + 2)  # the third byte of the first int32 token id: out of the vocabulary
    if legacy:
        (data / "files.json").unlink()
    recipe = write_recipe(tmp_path, tiny_target_dir, data)
    line = refused(["train", recipe], capsys)
    expected = "is outside the tokenizer's vocabulary 0..399" if legacy else "tokens.safetensors is damaged (its sha256"
    assert expected in line and f"prepare it again: `draftsmith data prepare INPUT --out {data} --overwrite`" in line
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- the disk: checked up front, and a failed write keeps the earlier good state ------------------------------

NO_SPACE = OSError(errno.ENOSPC, "No space left on device")
# how safetensors and torch report a full disk: their own exception types, errno only in the words
SAFETENSORS_NO_SPACE = RuntimeError(
    'Error while serializing: IoError(Os { code: 28, message: "No space left on device" })'
)
TORCH_SHORT_WRITE = RuntimeError(
    "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file data/0"
)


def failing(error: BaseException):
    def write(*args, **kwargs):
        raise error

    return write


def no_staging_left(parent: Path) -> bool:
    return not [p.name for p in parent.iterdir() if ".tmp-" in p.name or p.name.endswith(".old")]


@pytest.mark.parametrize("error", [NO_SPACE, SAFETENSORS_NO_SPACE], ids=["oserror", "safetensors"])
def test_prepare_on_a_full_disk_keeps_the_earlier_dataset(
    tmp_path, data_dir, tiny_target_dir, monkeypatch, capsys, error
):
    out = tmp_path / "prepared"
    argv = ["data", "prepare", data_dir / "mydata.jsonl", "--out", out, "--target", tiny_target_dir]
    main([str(a) for a in argv])
    before = snapshot(out)
    monkeypatch.setattr("draftsmith.data.prepared.save_file", failing(error))
    line = refused([*argv, "--overwrite", "--max-length", "64"], capsys)
    assert f"writing {out} failed (No space left on device); the earlier {out} is intact" in line
    assert snapshot(out) == before and no_staging_left(tmp_path)


@pytest.mark.parametrize("error", [NO_SPACE, SAFETENSORS_NO_SPACE], ids=["oserror", "safetensors"])
def test_export_on_a_full_disk_keeps_the_earlier_export(runs, tmp_path, monkeypatch, capsys, error):
    out = tmp_path / "drafter"
    main(["export", str(runs / "run"), "--out", str(out)])
    before = snapshot(out)
    monkeypatch.setattr("draftsmith.drafters.io.save_file", failing(error))
    line = refused(["export", runs / "run", "--out", out, "--overwrite"], capsys)
    assert f"writing {out} failed (No space left on device); the earlier {out} is intact" in line
    assert snapshot(out) == before and no_staging_left(tmp_path)


@pytest.mark.parametrize(
    "where, error, reason",
    [
        ("draftsmith.train.checkpoint.save_drafter_weights", NO_SPACE, "No space left on device"),
        ("draftsmith.train.checkpoint.save_drafter_weights", SAFETENSORS_NO_SPACE, "No space left on device"),
        ("draftsmith.train.checkpoint.atomic_write_json", TORCH_SHORT_WRITE, "could not be written in full"),
    ],
    ids=["oserror", "safetensors", "torch"],
)
def test_a_checkpoint_save_on_a_full_disk_keeps_the_last_checkpoint(
    run4, two_checkpoint_run, monkeypatch, capsys, where, error, reason
):
    shutil.rmtree(run4 / "checkpoints" / "step-4")  # as if the run had stopped at step 2
    import draftsmith.train.checkpoint as checkpoint

    real = {
        "draftsmith.train.checkpoint.save_drafter_weights": checkpoint.save_drafter_weights,
        "draftsmith.train.checkpoint.atomic_write_json": checkpoint.atomic_write_json,
    }[where]
    with pytest.MonkeyPatch.context() as patch:  # the disk fills up while step 4 is saved
        patch.setattr(
            where,
            lambda *a, **k: failing(error)() if any("step-4" in str(x) for x in a[:2]) else real(*a, **k),
        )
        line = refused(["train", run4.parent / "recipe.yaml", "train.max_steps=4", "--resume"], capsys)
    assert f"saving checkpoint step-4 in {run4 / 'checkpoints'} failed (" in line and reason in line
    assert "the last complete checkpoint step-2 is intact: free space and rerun with --resume" in line
    assert sorted(p.name for p in (run4 / "checkpoints").iterdir()) == ["step-2"]  # no half-written step-4 left
    main(["train", str(run4.parent / "recipe.yaml"), "train.max_steps=4", "--resume"])  # the disk has room again
    assert losses(run4) == losses(two_checkpoint_run)


def read_only(monkeypatch):
    """A read-only file system, as the probe of check_creatable_directory meets it (we run as root, so a
    chmod would not stop us): the probe's mkdtemp fails with EROFS."""
    monkeypatch.setattr("draftsmith.core.io.tempfile.mkdtemp", failing(OSError(errno.EROFS, "Read-only file system")))


@pytest.mark.parametrize("command", ["prepare", "export", "train", "cache-features"])
@pytest.mark.parametrize("problem", ["under-a-file", "read-only"])
def test_outputs_are_checked_before_any_work(
    runs,
    tmp_path,
    data_dir,
    tiny_target_dir,
    prepared_dir,  # noqa: F811
    monkeypatch,
    capsys,
    command,
    problem,
):
    (tmp_path / "blocker").write_text("a file\n")
    out = tmp_path / ("blocker/out" if problem == "under-a-file" else "out")
    argv = {
        "prepare": ["data", "prepare", data_dir / "mydata.jsonl", "--out", out, "--target", tiny_target_dir],
        "export": ["export", runs / "run", "--out", out],
        "train": ["train", runs / "recipe.yaml", f"output_dir={out}"],
        "cache-features": ["data", "cache-features", prepared_dir, "--out", out, "--target", tiny_target_dir],
    }[command]
    before = snapshot(tmp_path)
    if problem == "read-only":
        read_only(monkeypatch)
    for module in ("draftsmith.core.target", "draftsmith.train.trainer"):
        monkeypatch.setattr(f"{module}.load_target", failing(AssertionError("the model loaded")), raising=False)
    monkeypatch.setattr("draftsmith.core.target.load_tokenizer", failing(AssertionError("the tokenizer loaded")))
    line = refused(argv, capsys)
    option = "output_dir" if command == "train" else "--out"
    expected = "is a file" if problem == "under-a-file" else "cannot be written (Read-only file system in"
    assert f"{option} {out} cannot be" in line and expected in line and f"choose another {option}" in line
    assert snapshot(tmp_path) == before


def test_a_feature_cache_the_disk_cannot_hold_is_refused_before_the_first_forward(
    tmp_path,
    prepared_dir,  # noqa: F811
    tiny_target_dir,
    monkeypatch,
    capsys,  # noqa: F811
):
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("draftsmith.data.features.shutil.disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    monkeypatch.setattr("draftsmith.data.features.target_features", failing(AssertionError("a forward ran")))
    out = tmp_path / "cache"
    line = refused(["data", "cache-features", prepared_dir, "--out", out, "--target", tiny_target_dir], capsys)
    assert "the feature cache needs about 0.2 MB more (1,474 tokens x 137 bytes) but" in line
    assert "has 0.0 MB free; free space, store --dtype bf16 or fewer --layers, or choose another --out" in line


# ---- kill -9 at random points, then resume -----------------------------------------------------------------


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(latest_checkpoint(run) / "drafter" / "model.safetensors"))


def kill_at_random_point(recipe: Path, run: Path, delay: float, during_save: int | None = None) -> str:
    """Start ``draftsmith train`` in a process of its own; ``delay`` seconds after its first complete
    checkpoint (or, with ``during_save``, after the save of that step began), SIGKILL it; returns where
    the kill landed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    process = subprocess.Popen(
        [sys.executable, "-m", "draftsmith.train", str(recipe)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120

        def waiting() -> bool:
            if during_save is not None:
                return not (run / "checkpoints" / f".tmp-step-{during_save}").exists()
            return latest_checkpoint(run) is None

        while waiting() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        alive = process.poll() is None
        if alive:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    saving = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    last = latest_checkpoint(run)
    return f"{'killed' if alive else 'finished'} after {last.name if last else 'no checkpoint'}" + (
        f", {saving[0]} half-written" if saving else ""
    )


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_reaches_the_uninterrupted_weights(
    tmp_path,
    tiny_target_dir,
    prepared_dir,  # noqa: F811
):
    """Ten runs with a checkpoint every step, each killed with SIGKILL at a random moment (during a step
    or a save) and resumed: every resume starts from a complete checkpoint, and every run ends with the
    loss curve and final weights of an uninterrupted run, bit for bit."""
    import random

    import torch

    train = {"max_steps": 5, "save_every": 1, "keep_last": 2}
    reference = write_recipe(tmp_path / "reference", tiny_target_dir, prepared_dir, train=train)
    main(["train", str(reference)])
    expected_weights, expected_curve = (
        final_weights(tmp_path / "reference" / "run"),
        losses(tmp_path / "reference" / "run"),
    )
    chooser = random.Random(15)
    landed = []
    for index in range(10):
        root = tmp_path / f"killed-{index}"
        recipe = write_recipe(root, tiny_target_dir, prepared_dir, train=train)
        if index % 2:  # inside a checkpoint save: a few milliseconds after it began
            outcome = kill_at_random_point(recipe, root / "run", chooser.uniform(0.0, 0.03), chooser.randint(2, 4))
        else:  # anywhere in the run after its first checkpoint
            outcome = kill_at_random_point(recipe, root / "run", chooser.uniform(0.0, 1.5))
        landed.append(outcome)
        assert latest_checkpoint(root / "run") is not None
        main(["train", str(recipe), "--resume"])
        weights = final_weights(root / "run")
        assert weights.keys() == expected_weights.keys(), landed[-1]
        assert all(torch.equal(weights[k], expected_weights[k]) for k in weights), landed[-1]
        assert losses(root / "run") == expected_curve, landed[-1]
    assert sum(outcome.startswith("killed") for outcome in landed) >= 5, landed  # most kills landed mid-run
    print("\n".join(landed))


@pytest.mark.parametrize(
    "tree", [[[0], [0, 0, 0]], [[0], [-1]], [[0], [400]]], ids=["deeper-than-heads", "negative-rank", "rank-past-vocab"]
)
def test_a_drafter_whose_tree_indices_do_not_fit_is_one_line(
    tmp_path, tiny_target_dir, exported_with_vocab, capsys, tree
):
    from transformers import AutoConfig

    from draftsmith.drafters.io import export_drafter
    from draftsmith.drafters.registry import get_family

    model = get_family("medusa").build(AutoConfig.from_pretrained(tiny_target_dir), {"num_heads": 2})
    identity = json.loads((exported_with_vocab / "config.json").read_text())["target_identity"]
    out = export_drafter(model, identity, tmp_path / "medusa")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tree": tree}))
    line = refused(["generate", "hi", "--target", tiny_target_dir, "--method", f"medusa={out}"], capsys)
    assert "config.json has " in line and "export it again" in line  # the recorded size says it changed
    (out / "files.json").unlink()  # an export from before files were recorded: the config's own checks
    line = refused(["generate", "hi", "--target", tiny_target_dir, "--method", f"medusa={out}"], capsys)
    assert f"{out}/config.json is invalid (" in line and "export it again" in line
