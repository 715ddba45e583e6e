"""llama.cpp as a ``draftsmith bench`` method (``llamacpp``, ``llamacpp=DIR[:depth=N]``): its specs, its
one-line refusals before anything decodes, and the bench's bookkeeping of its runs with stand-in tools
that print what llama.cpp's print (no llama.cpp needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_named_targets import write_tiny_gguf

from draftsmith.drafters.gguf_layout import export_gguf
from draftsmith.drafters.registry import get_family
from helpers import refused

AUX = [0, 1, 1]  # the tiny target has two layers; llama.cpp's eagle3 reads three states


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    from draftsmith.core.target import load_target

    return load_target(str(tiny_target_dir))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def gguf_export(tmp_path_factory, tiny, tiny_gguf) -> Path:
    model = get_family("eagle3").build(tiny.model.config, {"aux_layer_ids": AUX, "depth": 3})
    return export_gguf(model, tiny_gguf, None, "float32", tiny.identity.to_dict(), tmp_path_factory.mktemp("e3") / "e3")


def test_llamacpp_specs_name_a_gguf_export_for_this_target_and_its_depth(tmp_path, tiny, gguf_export, other_target_dir):
    from draftsmith.core.target import TargetError, load_target
    from draftsmith.inference.measure.llamacpp_engine import LlamaCppError, is_llamacpp_method, parse_llamacpp_method

    assert is_llamacpp_method("llamacpp") and is_llamacpp_method("llamacpp=x") and not is_llamacpp_method("llamacppx")
    assert parse_llamacpp_method("llamacpp", tiny).draft is None
    method = parse_llamacpp_method(f"llamacpp={gguf_export}", tiny)
    assert method.draft == (gguf_export / "model.gguf").resolve() and method.depth == 3  # the export's own
    assert parse_llamacpp_method(f"llamacpp={gguf_export}:depth=1", tiny).depth == 1
    with pytest.raises(LlamaCppError, match="depth= takes a whole number >= 1"):
        parse_llamacpp_method(f"llamacpp={gguf_export}:depth=0", tiny)
    with pytest.raises(LlamaCppError, match="holds no drafter exported for llama.cpp; make one with"):
        parse_llamacpp_method(f"llamacpp={tmp_path}", tiny)
    with pytest.raises(TargetError, match="not this target"):
        parse_llamacpp_method(f"llamacpp={gguf_export}", load_target(str(other_target_dir)))


def test_missing_llamacpp_tools_are_one_line_before_anything_decodes(tmp_path, tiny_target_dir, gguf_export, capsys):
    from draftsmith.inference.measure.llamacpp_engine import (
        COMPLETION,
        SPECULATIVE,
        LlamaCppError,
        find_llamacpp_tools,
    )

    with pytest.raises(LlamaCppError, match="build them .docs/engines.md. and pass --llamacpp-bin DIR"):
        find_llamacpp_tools(None)
    (tmp_path / COMPLETION).write_text("")
    with pytest.raises(LlamaCppError, match="lacks llama-speculative-simple; build them"):
        find_llamacpp_tools(str(tmp_path))
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": "1", "category": "qa", "turns": ["Hi"]}\n')
    argv = ["bench", "--questions", questions, "--target", tiny_target_dir, "--max-new-tokens", "4"]
    argv += ["--methods", f"llamacpp,llamacpp={gguf_export}", "--llamacpp-model", gguf_export / "model.gguf"]
    line = refused([*argv, "--out", tmp_path / "a", "--llamacpp-bin", tmp_path / "none"], capsys)
    assert "--llamacpp-bin" in line and "lacks llama-completion and llama-speculative-simple" in line
    assert not (tmp_path / "a" / "results.json").exists()
    line = refused([*argv, "--out", tmp_path / "b"], capsys)
    assert "pass --llamacpp-bin DIR" in line
    line = refused([*argv[:-1], tmp_path / "model.bin", "--out", tmp_path / "c"], capsys)
    assert "--llamacpp-model" in line and "give the target's .gguf file" in line
    (tmp_path / SPECULATIVE).write_text("")
    line = refused([*argv[:-2], "--out", tmp_path / "d", "--llamacpp-bin", tmp_path], capsys)
    assert "llama.cpp serves the target from its GGUF: give --llamacpp-model FILE.gguf" in line


# Stand-ins for llama.cpp's tools (see STAND_IN): what they print is what llama.cpp 0.3.36's print, on
# stdout (the text) and stderr (the log).
STAND_IN = '''#!{python}
import sys
args = sys.argv[1:]
prompt = args[args.index("-p") + 1]
answer = "Paris is the capital." if "-md" not in args or "depth" not in prompt else "Paris is a city."
if "-md" in args:
    if "fail" in prompt:
        sys.stderr.write("llama_model_load: error loading model\\nmain: failed to load the draft\\n")
        sys.exit(1)
    sys.stdout.write("\\n\\n" + prompt + answer + "\\n\\n")
    sys.stderr.write(
        "encoded   12 tokens in    0.200 seconds, speed:   60.000 t/s\\n"
        "decoded    6 tokens in    0.100 seconds, speed:   60.000 t/s\\n\\n"
        "n_draft   = 3\\nn_predict = 6\\nn_drafted = 6\\nn_accept  = 4\\naccept    = 66.667%\\n"
    )
else:
    sys.stdout.write(answer + " [end of text]\\n\\n\\n")
    sys.stderr.write("main: prompt: '" + prompt + "'\\nmain: number of tokens in prompt = 2\\n")
    sys.stderr.write("     1 -> 'a'\\n     2 -> 'b'\\n\\nsampler seed: 0\\n")
    sys.stderr.write(
        "llama_perf_context_print: prompt eval time =     100.00 ms /    12 tokens\\n"
        "llama_perf_context_print:        eval time =     200.00 ms /     5 runs   (40.00 ms per token)\\n"
    )
'''
