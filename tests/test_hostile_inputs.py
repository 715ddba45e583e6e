"""Hostile inputs (issue 30): text and numbers as data, pipes as inputs, method options for every method,
and Ctrl-C at any moment.

Every refusal is exit status 2 with one ``draftsmith: error:`` line naming the file and the line
(``refused``); nothing is written before it.
"""

from __future__ import annotations

import codecs
import json
import math
import shutil
from pathlib import Path

import pytest

from conftest import sharegpt, write_jsonl
from draftsmith.cli import main
from draftsmith.core.io import write_files_manifest
from draftsmith.data.formats import read_conversations
from draftsmith.inference.measure.bench import read_questions
from helpers import refused, write_recipe

GOOD_RECORD = json.dumps(sharegpt(("human", "Hi there."), ("gpt", "Hello! How can I help you today?")))
QUESTION = {"question_id": "q1", "category": "writing", "turns": ["Write a poem about snow."]}

# What a second line of JSON Lines text may hold that is not text, and the words of its refusal.
NOT_TEXT = {
    "invalid-utf8": (b'{"conversations": "\xff\xfe"}', "line 2 is not UTF-8 text (byte"),
    "lone-surrogate": (rb'{"conversations": [{"from": "human", "value": "a \ud800 b"}]}', "line 2 holds \\ud800"),
    "nul-byte": (b'{"conversations": []}\x00\x00', "line 2 holds a NUL byte, so it is binary"),
    "long-integer": (b'{"id": ' + b"7" * 5001 + b"}", "line 2 holds an integer of over 4,300 digits"),
}


def two_lines(path: Path, second: bytes, first: bytes = GOOD_RECORD.encode()) -> Path:
    path.write_bytes(first + b"\n" + second + b"\n")
    return path


# ---- strict text readers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", NOT_TEXT)
def test_a_dataset_that_is_not_text_is_one_line_naming_the_line(tmp_path, tiny_target_dir, capsys, kind):
    second, message = NOT_TEXT[kind]
    data = two_lines(tmp_path / "chats.jsonl", second)
    line = refused(["data", "prepare", data, "--out", tmp_path / "out", "--target", tiny_target_dir], capsys)
    assert f"{data} {message}" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", NOT_TEXT)
def test_questions_that_are_not_text_are_one_line_naming_the_line(tmp_path, no_model_loads, capsys, kind):
    second, message = NOT_TEXT[kind]
    questions = two_lines(tmp_path / "questions.jsonl", second, json.dumps(QUESTION).encode())
    assert f"{questions} {message}" in refused(["bench", "--questions", questions, "--out", tmp_path / "o"], capsys)


def test_a_regeneration_refused_for_its_input_leaves_nothing_to_block_the_rerun(tmp_path, tiny_target_dir, capsys):
    second, message = NOT_TEXT["lone-surrogate"]
    data, out = two_lines(tmp_path / "chats.jsonl", second), tmp_path / "answers.jsonl"
    line = refused(["data", "regenerate", data, "--out", out, "--target", tiny_target_dir], capsys)
    assert f"{data} {message}" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chats.jsonl"]  # no empty answers, no .meta.json


def test_a_surrogate_pair_and_escaped_backslashes_are_text(tmp_path):
    """Only a lone half is refused: a whole pair is one character, and ``\\\\ud800`` is a backslash and text."""
    record = sharegpt(("human", "Smile \U0001f600 and a path C:\\ud800"), ("gpt", "Done."))
    data = write_jsonl(tmp_path / "chats.jsonl", [record])
    assert "\\ud83d\\ude00" in data.read_text() and "\\\\ud800" in data.read_text()
    [conversation] = read_conversations(str(data))
    assert conversation.turns[0]["content"] == "Smile \U0001f600 and a path C:\\ud800"


def test_a_utf8_byte_order_mark_is_accepted(tmp_path):
    data = tmp_path / "chats.json"
    data.write_bytes(codecs.BOM_UTF8 + f"[{GOOD_RECORD}]".encode())
    assert len(list(read_conversations(str(data)))) == 1
    questions = tmp_path / "questions.jsonl"
    questions.write_bytes(codecs.BOM_UTF8 + json.dumps(QUESTION).encode() + b"\n")
    assert [q.id for q in read_questions(questions, None, None)] == ["q1"]


def test_a_long_integer_in_a_json_array_names_its_line(tmp_path, no_model_loads, capsys):
    data = tmp_path / "chats.json"
    data.write_text(f"[\n{GOOD_RECORD},\n" + '{"id": ' + "9" * 5001 + "}\n]\n")
    line = refused(["data", "show", data], capsys)
    assert f"{data} line 3 holds an integer of over 4,300 digits, too long to read" in line


@pytest.mark.parametrize(
    "content, message",
    [
        (codecs.BOM_UTF16_LE + "train:\n  lr: 1\n".encode("utf-16-le"), "is UTF-16 or UTF-32 text, not UTF-8; save it"),
        (b"train:\n  lr: 1\n  name: \x89PNG\n", "line 3 is not UTF-8 text (byte 23 is 0x89); save it as UTF-8"),
        (b"train:\n  seed: " + b"1" * 5001 + b"\n", "holds a value YAML cannot convert (Exceeds the limit"),
    ],
    ids=["utf-16", "binary", "long-integer"],
)
def test_a_recipe_that_is_not_utf8_text_is_one_line(tmp_path, no_model_loads, capsys, content, message):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(content)
    line = refused(["train", recipe], capsys)
    assert message in line and str(recipe) in line


def test_a_binary_chat_template_is_refused_before_the_tokenizer_loads(tmp_path, chat_records, no_model_loads, capsys):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records)
    template = tmp_path / "template.jinja"
    template.write_bytes(b"{{ messages }}\n\x00\x01\x02")
    line = refused(["data", "prepare", data, "--out", tmp_path / "out", "--chat-template", template], capsys)
    assert f"{template} line 2 holds a NUL byte" in line


def test_a_corpus_that_is_not_utf8_is_refused_before_the_target_loads(tmp_path, no_model_loads, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes("first document\nsecond \u00e9\n".encode("latin-1"))
    line = refused(["spectra-index", corpus, "--out", tmp_path / "index"], capsys)
    assert f"{corpus} line 2 is not UTF-8 text" in line and "save it as UTF-8" in line


def test_a_prompt_that_is_not_utf8_is_one_line(no_model_loads, capsys):
    # bytes that are not UTF-8 on a command line reach Python as lone surrogates (surrogateescape)
    line = refused(["generate", "caf" + b"\xe9".decode("utf-8", "surrogateescape")], capsys)
    assert "the prompt is not UTF-8 text" in line


def test_an_empty_raw_prompt_is_one_line(tiny_target_dir, capsys):
    line = refused(["generate", "", "--raw", "--target", tiny_target_dir, "--max-new-tokens", "2"], capsys)
    assert "the prompt is empty, so there is no token to continue from" in line


# ---- a pipe as an input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["prepare", "bench", "train", "spectra-index"])
def test_a_fifo_as_input_is_refused_before_it_is_read(tmp_path, tiny_target_dir, fifo, capsys, command):
    argv = {
        "prepare": ["data", "prepare", fifo, "--out", tmp_path / "out", "--target", tiny_target_dir],
        "bench": ["bench", "--questions", fifo, "--out", tmp_path / "out"],
        "train": ["train", fifo],
        "spectra-index": ["spectra-index", fifo, "--out", tmp_path / "out"],
    }[command]
    line = refused(argv, capsys)
    assert "is not a regular file (a pipe, socket or device" in line
    assert not (tmp_path / "out").exists()


# ---- method options, for every method --------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_export(tmp_path_factory, tiny_target_dir, prepared_dir) -> Path:
    """An FSPAD drafter that drafts from four tokens only (``drafter.draft_vocab_size=4``), exported."""
    root = tmp_path_factory.mktemp("small-vocab")
    drafter = {"family": "fspad", "draft_vocab_size": 4}
    recipe = write_recipe(root, tiny_target_dir, prepared_dir, drafter=drafter, train={"max_steps": 2})
    main(["train", str(recipe)])
    main(["export", str(root / "run"), "--out", str(root / "drafter")])
    return root / "drafter"


@pytest.fixture()
def export_copy(tmp_path, small_vocab_export) -> Path:
    """This test's own copy of the export, to edit."""
    return Path(shutil.copytree(small_vocab_export, tmp_path / "drafter"))


def generate_with(method: str, target: Path) -> list:
    return ["generate", "Write a poem about snow.", "--target", target, "--method", method, "--max-new-tokens", "4"]


@pytest.mark.parametrize(
    "method, message",
    [
        ("none:x=1", "none (plain decoding) takes no argument or option; got none:x=1"),
        ("none=fast", "none (plain decoding) takes no argument or option; got none=fast"),
        ("spectra:depth=3", "spectra takes no options, only an index: spectra=INDEX"),
        ("pld:num_draft=2:num_draft=3", "option num_draft is given twice in pld:num_draft=2:num_draft=3"),
        ("fspad={drafter}:depth=2:depth=3", "option depth is given twice in"),
        ("fspad={drafter}:depth=1000", "fspad tree option depth=1000: depth takes a whole number from 1 to 64"),
        ("fspad={drafter}:total_tokens=99999", "total_tokens takes a whole number from 1 to 1024"),
        ("fspad={drafter}:top_k=5", "top_k=5 is more than the drafter's draft vocabulary of 4 tokens"),
    ],
    ids=lambda value: value.split(":", 1)[-1] if "{drafter}" in value else value,
)
def test_method_options_are_checked_for_every_method(small_vocab_export, tiny_target_dir, capsys, method, message):
    line = refused(generate_with(method.format(drafter=small_vocab_export), tiny_target_dir), capsys)
    assert message in line


def test_a_recipe_whose_top_k_exceeds_its_draft_vocabulary_is_refused(tmp_path, tiny_target_dir, prepared_dir, capsys):
    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir)
    line = refused(["train", recipe, "drafter.draft_vocab_size=1"], capsys)
    assert "drafter.top_k=4 is more than the drafter's draft vocabulary of 1 tokens" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"depth": 1000}, "drafter.depth is 1000, but depth takes a whole number from 1 to 64"),
        ({"top_k": "many"}, "drafter.top_k is 'many', but top_k takes a whole number"),
        ({"draft_vocab_size": 8}, "config.json is invalid ("),
        ({"layer": {"hidden_size": 80}}, "config.json is invalid ("),
    ],
    ids=["absurd-depth", "wrong-type", "vocab-size-changed", "hidden-size-changed"],
)
def test_an_edited_export_config_is_one_line(export_copy, tiny_target_dir, capsys, edit, message):
    """Edited by hand, with files.json updated to match: the family config's checks still hold."""
    config = json.loads((export_copy / "config.json").read_text())
    for key, value in edit.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (export_copy / "config.json").write_text(json.dumps(config))
    write_files_manifest(export_copy)
    line = refused(generate_with(f"fspad={export_copy}", tiny_target_dir), capsys)
    assert message in line and "export it again" in line


def test_an_absurd_tuned_tree_is_ignored_in_one_line(export_copy, tiny_target_dir, capsys, monkeypatch):
    from draftsmith.inference.methods import tuned_trees

    entry = {"weights_sha256": tuned_trees.weights_sha256(export_copy), "kernels": {}, "tree": {"depth": 1000}}
    monkeypatch.setattr(tuned_trees, "read_tuned_trees", lambda directory: {"any": entry})
    monkeypatch.setattr(tuned_trees.DeviceKey, "text", lambda self: "any")
    main([str(a) for a in generate_with(f"fspad={export_copy}", tiny_target_dir)])
    err = capsys.readouterr().err
    assert "[tune] ignoring the tree fitted for any: depth=1000: depth takes a whole number from 1 to 64" in err


def test_an_export_config_edited_to_an_absurd_size_is_refused_before_it_is_allocated(
    export_copy, tiny_target_dir, capsys, monkeypatch
):
    """The model a config.json describes is counted on the meta device against the weights its files hold:
    an edited size is one line before anything is allocated (never an allocation of many GB)."""
    import torch

    config = json.loads((export_copy / "config.json").read_text())
    config["layer"].update(hidden_size=100_000, intermediate_size=100_000)  # 80 GB of fc alone
    (export_copy / "config.json").write_text(json.dumps(config))
    write_files_manifest(export_copy)
    real_empty = torch.empty

    def small_only(*size, **kwargs):  # what nn.Linear allocates its weights with
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        meta = torch.get_default_device().type == "meta" or str(kwargs.get("device")) == "meta"
        assert meta or math.prod(shape) < 10**7, f"allocating {math.prod(shape):,} numbers for an edited config"
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", small_only)
    line = refused(generate_with(f"fspad={export_copy}", tiny_target_dir), capsys)
    assert "config.json is invalid (it describes a drafter of" in line and "its weight files hold" in line


# ---- loss options, drafter sizes, results tables and Ctrl-C ---------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("loss.ce_weight=nan", "loss.ce_weight must be a finite number >= 0, got 'nan'"),
        ("loss.ce_weight=.inf", "loss.ce_weight must be a finite number >= 0, got inf"),
        ("loss.feature_noise=-0.5", "loss.feature_noise must be a finite number >= 0, got -0.5"),
        ("loss.ce_weight=heavy", "loss.ce_weight must be a finite number >= 0, got 'heavy'"),
        ("loss.metric_steps=1.5", "loss.metric_steps must be a whole number >= 0, got 1.5"),
    ],
)
def test_a_loss_option_that_is_no_sane_number_is_refused_before_training(
    tmp_path, no_model_loads, capsys, override, message
):
    recipe = write_recipe(tmp_path, tmp_path / "target", tmp_path / "prepared")
    assert message in refused(["train", recipe, override], capsys)
    assert not (tmp_path / "run").exists()


def test_loss_options_given_as_text_become_numbers():
    from draftsmith.drafters.registry import get_family
    from draftsmith.train.losses import check_loss_options

    options = check_loss_options(get_family("eagle"), {"ce_weight": "5e-2", "feature_noise": 0, "metric_steps": 2})
    assert options == {"ce_weight": 0.05, "feature_noise": 0.0, "metric_steps": 2}


def tiny_llama_config():
    from transformers import LlamaConfig

    from conftest import TINY_LLAMA

    return LlamaConfig(vocab_size=512, **TINY_LLAMA)


def test_a_drafter_far_larger_than_its_target_is_refused_before_it_is_allocated():
    from draftsmith.drafters.medusa import MedusaTreeError
    from draftsmith.drafters.registry import DrafterSizeError, get_family

    options = {"lora_rank": 100_000, "num_heads": 3}
    with pytest.raises(DrafterSizeError) as info:
        get_family("medusa2").build(tiny_llama_config(), options, target_weights=150_000)
    message = str(info.value)
    assert message.startswith("drafter.lora_rank=100000 would make a medusa2 drafter of ")
    assert "more than 10 times the target's 150,000" in message and message.endswith("lower drafter.lora_rank")
    with pytest.raises(MedusaTreeError, match="drafter.num_heads must be from 1 to 64"):  # before counting heads
        get_family("medusa").build(tiny_llama_config(), {"num_heads": 10**7}, target_weights=150_000)


def test_a_recipe_for_a_drafter_far_larger_than_its_target_is_one_line(tmp_path, tiny_target_dir, prepared_dir, capsys):
    import yaml

    recipe = write_recipe(tmp_path, tiny_target_dir, prepared_dir, drafter={"family": "medusa2"})
    tree = yaml.safe_load(recipe.read_text())
    tree["loss"] = {}
    recipe.write_text(yaml.safe_dump(tree))
    line = refused(["train", recipe, "drafter.lora_rank=5000"], capsys)
    assert "drafter.lora_rank=5000 would make a medusa2 drafter of" in line and "lower drafter.lora_rank" in line
    assert not list((tmp_path / "run").glob("checkpoint*"))


def test_a_category_with_a_pipe_or_a_line_break_keeps_the_results_table_one_row_per_line():
    from draftsmith.inference.measure.bench import BASELINE
    from draftsmith.inference.measure.bench_report import markdown_table

    row = {"tau": 1.5, "speedup": 1.2, "tokens_per_s": 10.0, "identical": 1, "total": 1}
    scopes = {"overall": row, "math | logic": row, "two\nlines": row, "C:\\|x": row}
    results = {"max_new_tokens": 8, "threads": 1, "methods": {BASELINE: scopes, "pld": scopes}}
    table = [line for line in markdown_table(results).splitlines() if line.startswith("|")]
    assert len(table) == 2 + 2 * 4  # header, rule, then one line per method and scope
    for line in table:
        assert line.replace("\\\\", "").replace("\\|", "").count("|") == 8, line  # seven cells, whatever they hold
    pld = [line.split(" | 1.50 |")[0] for line in table if line.startswith("| pld |")]
    assert pld == ["| pld | overall", "| pld | C:\\\\\\|x", "| pld | math \\| logic", "| pld | two lines"]


def test_ctrl_c_while_the_parser_is_built_is_one_line(monkeypatch, capsys):
    """Building the parser imports torch and transformers (seconds): a Ctrl-C then is one line, status 130."""
    import draftsmith.cli.commands as cli

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupt)
    with pytest.raises(SystemExit) as info:
        main(["data", "prepare", "x", "--out", "y"])
    err = capsys.readouterr().err
    assert (
        info.value.code == 130 and err == "draftsmith: interrupted; rerun the same command to resume where supported\n"
    )


def test_ctrl_c_while_python_m_draftsmith_train_starts_is_one_line(monkeypatch, capsys):
    import draftsmith.train.commands as commands
    from draftsmith.train.__main__ import main as launch_main

    def interrupt(parser):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "add_train_arguments", interrupt)
    with pytest.raises(SystemExit) as info:
        launch_main(["recipe.yaml"])
    assert info.value.code == 130 and capsys.readouterr().err.startswith("draftsmith: interrupted;")


def test_the_draftsmith_command_imports_no_torch_before_main_runs():
    """What the entry point imports before main() (and its Ctrl-C handling) runs is light: no torch."""
    import subprocess
    import sys

    imports = "import sys, draftsmith.cli.commands, draftsmith.train.__main__"
    code = f"{imports}; print(sorted({{'torch', 'transformers'}} & {{*sys.modules}}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
