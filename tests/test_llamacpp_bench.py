"""llama.cpp as a ``draftsmith bench`` method (``llamacpp``, ``llamacpp=DIR[:depth=N]``): its specs, its
one-line refusals before anything decodes, and the bench's bookkeeping of its runs with stand-in tools
that print what llama.cpp's print (no llama.cpp needed)."""

from __future__ import annotations

import sys
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


# Stand-ins for llama-completion and llama-speculative-simple: what they print is what llama.cpp's tools
# (llama-cpp-python 0.3.36's vendored copy) print, text on stdout, a time-and-level-prefixed log on stderr.
# The drafter run with `--spec-draft-n-max 1` fails as a broken draft would.
STAND_IN = """#!{python}
import os, sys
args = sys.argv[1:]
prompt = args[args.index("-p") + 1]
answer = "Paris is the capital."
if "-md" in args:
    if args[args.index("--spec-draft-n-max") + 1] == "1":
        sys.stderr.write("0.00.010.000 E llama_model_load: error loading model: tensor 'fc.weight' is missing\\n")
        sys.exit(1)
    sys.stdout.write("\\n\\n" + prompt + answer + " It" + "\\n\\n\\n\\n")  # past -n: its last step's tokens
    sys.stderr.write(
        "0.00.500.000 I encoded   12 tokens in    0.200 seconds, speed:   60.000 t/s\\n"
        "0.00.500.001 I decoded    6 tokens in    0.100 seconds, speed:   60.000 t/s\\n"
        "0.00.500.002 I n_draft   = 3\\n0.00.500.003 I n_predict = 6\\n0.00.500.004 I n_drafted = 6\\n"
        "0.00.500.005 I n_accept  = 4\\n0.00.500.006 I accept    = 66.667%\\n"
    )
else:
    sys.stdout.write(answer + " [end of text]\\n\\n\\n")
    built = " LLAMAFILE = 1 |" if os.environ.get("STAND_IN_LLAMAFILE") else ""
    sys.stderr.write("0.00.050.000 I system_info: n_threads = 2 | CPU : AVX2 = 1 | OPENMP = 1 |" + built + "\\n")
    sys.stderr.write("0.00.100.000 I main: prompt: '" + prompt + "'\\n")
    sys.stderr.write("0.00.100.001 I main: number of tokens in prompt = 2\\n")
    sys.stderr.write("0.00.100.002 I      7 -> 'a\\n'\\n0.00.100.003 I      9 -> 'b'\\n0.00.100.004 I \\n")
    sys.stderr.write(
        "0.00.900.000 I common_perf_print: prompt eval time =     100.00 ms /    12 tokens\\n"
        "0.00.900.001 I common_perf_print:        eval time =     200.00 ms /     5 runs   (40.00 ms per token)\\n"
    )
"""


def test_bench_accounts_for_llamacpp_runs_and_keeps_results_when_one_fails(tmp_path, tiny, gguf_export):
    """The bench's bookkeeping of llama.cpp methods with stand-in tools (not llama.cpp): its text read after
    the echoed prompt, tau = tokens / (verification forwards + the prompt's), its own tau from its counters,
    identical against llama.cpp's plain decoding, the prompt ids compared with the runtime's, rates from its
    own timings; a method whose run fails is reported by its error line and the others are kept."""
    from draftsmith.inference.measure.bench import ExternalEngines, Question, run_bench
    from draftsmith.inference.measure.bench_report import markdown_table
    from draftsmith.inference.measure.llamacpp_engine import COMPLETION, SPECULATIVE

    tools = tmp_path / "bin"
    tools.mkdir()
    for name in (COMPLETION, SPECULATIVE):
        (tools / name).write_text(STAND_IN.format(python=sys.executable))
        (tools / name).chmod(0o755)
    drafted, broken = f"llamacpp={gguf_export}:depth=3", f"llamacpp={gguf_export}:depth=1"
    questions = [Question("q1", "qa", ["Hello there"]), Question("q2", "qa", ["And again?"])]
    engines = ExternalEngines(llamacpp_bin=str(tools), llamacpp_model=tmp_path / "t.gguf")
    results = run_bench(tiny, questions, ["llamacpp", drafted, broken], 4, engines=engines)
    answer = tiny.tokenizer("Paris is the capital.", add_special_tokens=False)["input_ids"][:4]
    plain, spec = results["methods"]["llamacpp"]["overall"], results["methods"][drafted]["overall"]
    assert plain["tokens"] == spec["tokens"] == 2 * len(answer) and plain["identical"] == spec["identical"] == 2
    assert plain["target_forwards"] == 2 * len(answer) and spec["target_forwards"] == 2 * 3  # (6 - 4) + 1 each
    assert spec["engine_acceptance_length"] == 3.0 and spec["prompt_seconds"] == 0.4 and spec["seconds"] == 0.6
    assert broken not in results["methods"] and "tensor 'fc.weight' is missing" in results["llamacpp"][broken]["error"]
    info = results["llamacpp"]
    assert info["prompt_ids_match"] == "0/2"  # the stand-in's ids are not the tiny tokenizer's
    assert info["llamacpp"]["tokens_per_s_after_prompt"] == 25.0 and info["llamacpp"]["prompt_share"] == 0.333
    mine = info[drafted]
    assert mine["tokens_per_s_after_prompt"] == 60.0 and mine["speedup_after_prompt_vs_llamacpp"] == 2.4
    assert mine["tokens_per_s"] == 20.0 and mine["speedup_vs_llamacpp"] == round(20.0 / (10 / 0.6), 3)
    table = markdown_table(results)
    assert f"| {drafted} | 3 | 3.00 | 60.0 | 20.0 | 67% | 2.40x | 1.20x |" in table
    assert "did not run: llama.cpp" in table
    assert "llamafile" not in info


def test_bench_says_when_llama_cpp_was_built_with_llamafiles_products(tmp_path, tiny, gguf_export, monkeypatch, capsys):
    """llama.cpp's default build (llamafile's matrix products) rounds a verification's batch otherwise than one-row
    decoding, so its drafted runs may leave its plain tokens: the bench reads its system_info and says so in one
    line where a drafter runs, and records it."""
    from draftsmith.inference.measure.bench import LLAMAFILE_BUILD, ExternalEngines, Question, run_bench
    from draftsmith.inference.measure.llamacpp_engine import COMPLETION, SPECULATIVE

    tools = tmp_path / "bin"
    tools.mkdir()
    for name in (COMPLETION, SPECULATIVE):
        (tools / name).write_text(STAND_IN.format(python=sys.executable))
        (tools / name).chmod(0o755)
    engines = ExternalEngines(llamacpp_bin=str(tools), llamacpp_model=tmp_path / "t.gguf")
    questions = [Question("q1", "qa", ["Hello there"])]
    monkeypatch.setenv("STAND_IN_LLAMAFILE", "1")
    results = run_bench(tiny, questions, ["llamacpp", f"llamacpp={gguf_export}:depth=3"], 4, engines=engines)
    assert results["llamacpp"]["llamafile"] is True
    assert capsys.readouterr().out.count(LLAMAFILE_BUILD) == 1
    run_bench(tiny, questions, ["llamacpp"], 4, engines=engines)  # no drafter: nothing to compare, nothing said
    assert LLAMAFILE_BUILD not in capsys.readouterr().out
