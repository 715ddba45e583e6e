"""Regeneration: turn-by-turn conditioning, resume after an interruption, and refusals."""

import json
from dataclasses import replace

import pytest

from conftest import sharegpt, vllm_python, vllm_sized_llama, write_jsonl
from draftsmith.core.target import load_target
from draftsmith.data.regenerate import (
    RegenerateError,
    RegenerateRun,
    RegenerateSettings,
    TransformersEngine,
    generate_answers,
    meta_path,
    regenerate,
)


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir):
    return load_target(str(tiny_target_dir))


@pytest.fixture()
def source(tmp_path):
    records = [
        sharegpt(
            ("human", "What is the capital of France?"),
            ("gpt", "old answer"),
            ("human", "And a poem?"),
            ("gpt", "old poem"),
            id="two-turns",
        ),
        sharegpt(("human", "Two plus two?"), id="prompt-only"),
        sharegpt(("system", "Be brief."), ("human", "Hello!"), ("gpt", "old"), id="with-system"),
        sharegpt(("human", "Summarise the passage."), ("gpt", "old"), id="d"),
        sharegpt(("gpt", "assistant first"), ("human", "x"), id="bad"),
        sharegpt(("human", "Two plus two?"), id="prompt-only"),
    ]
    return write_jsonl(tmp_path / "src.jsonl", records)


SETTINGS = RegenerateSettings(max_new_tokens=6, batch_size=1)


def read_out(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_every_turn_is_regenerated_from_the_regenerated_history(tmp_path, source, tiny_target):
    out = tmp_path / "out.jsonl"
    report = regenerate(str(source), out, tiny_target, SETTINGS)
    assert report.stats.read == 6 and report.written == 4
    assert dict(report.stats.skipped) == {"assistant_first": 1, "duplicate_id": 1}
    records = read_out(out)
    assert set(records) == {"two-turns", "prompt-only", "with-system", "d"}
    turns = records["two-turns"]["conversations"]
    assert [t["from"] for t in turns] == ["human", "gpt", "human", "gpt"]
    assert "old" not in turns[1]["value"] and "old" not in turns[3]["value"]
    history = [{"role": "user", "content": turns[0]["value"]}]
    engine = TransformersEngine(tiny_target, SETTINGS)
    first = generate_answers(engine, tiny_target, [history])[0].text
    assert turns[1]["value"] == first
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": turns[2]["value"]}]
    assert turns[3]["value"] == generate_answers(engine, tiny_target, [history])[0].text
    assert records["prompt-only"]["conversations"][1]["from"] == "gpt"  # a reply was added to the prompt
    meta = json.loads(meta_path(out).read_text())
    assert meta["target"] == tiny_target.identity.to_dict()


def test_interrupted_run_resumes_and_matches_an_uninterrupted_one(tmp_path, source, tiny_target):
    whole = tmp_path / "whole.jsonl"
    regenerate(str(source), whole, tiny_target, SETTINGS)
    part = tmp_path / "part.jsonl"
    first = regenerate(str(source), part, tiny_target, SETTINGS, RegenerateRun(limit=2))
    assert first.written == 2
    with open(part, "a") as handle:  # the process died while writing the next record
        handle.write('{"id": "with-system", "conversa')
    second = regenerate(str(source), part, tiny_target, SETTINGS)
    assert second.already_done == 2 and second.written == 2
    assert second.stats.used + second.stats.n_skipped == second.stats.read
    assert read_out(part) == read_out(whole)
    third = regenerate(str(source), part, tiny_target, SETTINGS)
    assert third.written == 0 and third.already_done == 4


def test_batched_generation_writes_every_conversation(tmp_path, source, tiny_target):
    out = tmp_path / "batched.jsonl"
    report = regenerate(str(source), out, tiny_target, RegenerateSettings(max_new_tokens=4, batch_size=3))
    assert report.written == 4 and len(read_out(out)) == 4 and report.new_tokens > 0


def test_time_limit_stops_between_windows_and_a_rerun_goes_on(tmp_path, source, tiny_target, monkeypatch):
    import draftsmith.data.regenerate as module

    out = tmp_path / "timed.jsonl"
    clock = iter(range(0, 10_000, 10))  # every reading of the clock is 10 s later
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    first = regenerate(str(source), out, tiny_target, SETTINGS, RegenerateRun(time_limit_s=25, window_batches=1))
    assert first.stopped_early and 1 <= first.written < 4
    assert first.stats.used + first.stats.n_skipped == first.stats.read  # nothing read was left unwritten
    rest = regenerate(str(source), out, tiny_target, SETTINGS)
    assert not rest.stopped_early and rest.already_done == first.written
    assert read_out(out) == read_out(regenerate_whole(tmp_path, source, tiny_target))


def regenerate_whole(tmp_path, source, tiny_target):
    whole = tmp_path / "whole.jsonl"
    regenerate(str(source), whole, tiny_target, SETTINGS)
    return whole


def test_a_token_budget_splits_batches_into_the_calls_one_by_one_would_make(source, tiny_target):
    settings = RegenerateSettings(max_new_tokens=4, batch_size=4)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    calls = []
    split = TransformersEngine(tiny_target, settings, batch_tokens=8)  # one row of 4 prompt + 4 new tokens
    original = split._generate
    split._generate = lambda batch: calls.append(len(batch)) or original(batch)
    rows = split.generate(prompts)
    assert calls == [1, 1, 1, 1]
    single = TransformersEngine(tiny_target, settings)
    assert rows == [single.generate([prompt])[0] for prompt in prompts]


def test_a_static_cache_gives_the_same_answers(source, tiny_target):
    settings = RegenerateSettings(max_new_tokens=6, batch_size=3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    dynamic = TransformersEngine(tiny_target, settings).generate(prompts)
    assert TransformersEngine(tiny_target, settings, static_cache=True).generate(prompts) == dynamic


def test_sampled_regeneration_is_reproducible_with_a_seed(tmp_path, source, tiny_target):
    sampled = RegenerateSettings(max_new_tokens=8, batch_size=1, temperature=1.0, seed=3)
    regenerate(str(source), tmp_path / "a.jsonl", tiny_target, sampled)
    regenerate(str(source), tmp_path / "b.jsonl", tiny_target, sampled)
    assert read_out(tmp_path / "a.jsonl") == read_out(tmp_path / "b.jsonl")


def test_resume_with_other_settings_or_target_is_refused(tmp_path, source, tiny_target, other_target_dir):
    out = tmp_path / "out.jsonl"
    regenerate(str(source), out, tiny_target, SETTINGS, RegenerateRun(limit=1))
    with pytest.raises(RegenerateError, match="another settings"):
        regenerate(str(source), out, tiny_target, RegenerateSettings(max_new_tokens=9, batch_size=1))
    with pytest.raises(RegenerateError, match="another target"):
        regenerate(str(source), out, load_target(str(other_target_dir)), SETTINGS)


def test_resume_in_another_dtype_is_refused_and_the_meta_keeps_its_note(tmp_path, source, tiny_target_dir):
    """Answers of two numerical models never mix in one output; a resume keeps what only the old
    .meta.json said (a maintainer's note, the earlier command) and records the new command."""
    out = tmp_path / "out.jsonl"
    regenerate(str(source), out, load_target(str(tiny_target_dir)), SETTINGS, RegenerateRun(limit=1, command="first"))
    meta = json.loads(meta_path(out).read_text())
    assert meta["dtype"] == "float32"
    meta_path(out).write_text(json.dumps({**meta, "note": "made on a GPU"}))
    bf16 = load_target(str(tiny_target_dir), dtype="bfloat16")
    with pytest.raises(RegenerateError, match="regenerated in float32, not bfloat16.*--dtype float32"):
        regenerate(str(source), out, bf16, SETTINGS, RegenerateRun(command="second"))
    regenerate(str(source), out, load_target(str(tiny_target_dir)), SETTINGS, RegenerateRun(limit=2, command="third"))
    meta = json.loads(meta_path(out).read_text())
    assert meta["note"] == "made on a GPU" and meta["command"] == "third" and meta["earlier_commands"] == ["first"]
    assert len(read_out(out)) == 2


def test_greedy_resume_takes_another_batch_size_and_sampled_resume_does_not(tmp_path, source, tiny_target):
    greedy = tmp_path / "greedy.jsonl"
    regenerate(str(source), greedy, tiny_target, SETTINGS, RegenerateRun(limit=1))
    regenerate(str(source), greedy, tiny_target, replace(SETTINGS, batch_size=4))
    assert read_out(greedy) == read_out(regenerate_whole(tmp_path, source, tiny_target))
    sampled = RegenerateSettings(max_new_tokens=6, batch_size=1, temperature=1.0, seed=3)
    regenerate(str(source), tmp_path / "sampled.jsonl", tiny_target, sampled, RegenerateRun(limit=1))
    with pytest.raises(RegenerateError, match="another settings"):
        regenerate(str(source), tmp_path / "sampled.jsonl", tiny_target, replace(sampled, batch_size=4))


def test_output_that_is_not_ours_is_refused(tmp_path, source, tiny_target):
    out = tmp_path / "out.jsonl"
    out.write_text("not json\n")
    with pytest.raises(RegenerateError, match="line 1 is not a regenerated record"):
        regenerate(str(source), out, tiny_target, SETTINGS)
    assert out.read_text() == "not json\n"


def test_named_sharegpt_regenerates_chunks_without_their_leading_answer(tmp_path, tiny_target, fake_sharegpt_package):
    from conftest import cut_json_array

    records = [
        sharegpt(("gpt", "the end of an earlier answer"), ("human", "Two plus two?"), ("gpt", "old"), id="chunk"),
        sharegpt(("human", "Hello!"), id="prompt-only"),
        sharegpt(("human", "cut"), ("gpt", "off"), id="cut"),
    ]
    fake_sharegpt_package(cut_json_array(records, keep=2))
    out = tmp_path / "out.jsonl"
    report = regenerate("sharegpt", out, tiny_target, SETTINGS)
    assert report.written == 2 and report.stats.dropped_leading_assistant == 1
    assert report.stats.truncation.complete_records == 2
    chunk = read_out(out)["chunk"]["conversations"]
    assert [t["from"] for t in chunk] == ["human", "gpt"] and chunk[0]["value"] == "Two plus two?"
    assert json.loads(meta_path(out).read_text())["source"] == "sharegpt"


def test_limit_and_shards_pick_a_spread_subset_and_resume(tmp_path, tiny_target):
    records = [sharegpt(("human", f"Question {i}?"), id=f"q{i}") for i in range(12)]
    source = write_jsonl(tmp_path / "many.jsonl", records)
    out = tmp_path / "sample.jsonl"
    first = regenerate(str(source), out, tiny_target, SETTINGS, RegenerateRun(limit=3))
    assert first.written == 3 and first.stats.sampled_from == 12
    picked = set(read_out(out))
    assert picked != {"q0", "q1", "q2"}
    grown = regenerate(str(source), out, tiny_target, SETTINGS, RegenerateRun(limit=5))  # resumes: the 3 are kept
    assert grown.already_done == 3 and grown.written == 2 and picked < set(read_out(out))
    halves = [tmp_path / "s0.jsonl", tmp_path / "s1.jsonl"]
    for i, half in enumerate(halves):
        regenerate(str(source), half, tiny_target, SETTINGS, RegenerateRun(shard=(i, 2)))
    assert set(read_out(halves[0])) | set(read_out(halves[1])) == {f"q{i}" for i in range(12)}
    assert not set(read_out(halves[0])) & set(read_out(halves[1]))
    assert json.loads(meta_path(halves[1]).read_text())["sample"] == {"limit": None, "shard": 1, "n_shards": 2}


def test_batches_hold_prompts_of_similar_length_first_turns_first(tmp_path, tiny_target):
    records = [
        sharegpt(("human", "x" * length), ("gpt", "old"), ("human", "again?"), ("gpt", "old"), id=f"c{length}")
        for length in (40, 3, 25, 1, 33, 12, 7, 19)
    ]
    source = write_jsonl(tmp_path / "lengths.jsonl", records)
    calls = []

    class Recording(TransformersEngine):
        def generate(self, prompts):
            calls.append([(len(p), "again?" in tiny_target.tokenizer.decode(p)) for p in prompts])
            return super().generate(prompts)

    settings = RegenerateSettings(max_new_tokens=2, batch_size=3)
    report = regenerate(
        str(source), tmp_path / "o.jsonl", tiny_target, settings, engine=Recording(tiny_target, settings)
    )
    assert report.written == 8 and [len(c) for c in calls] == [3, 3, 2, 3, 3, 2]
    first_round = [length for call in calls[:3] for length, _ in call]
    assert first_round == sorted(first_round) and len(set(first_round)) > 4
    assert not any(second for call in calls[:3] for _, second in call)
    assert all(second for call in calls[3:] for _, second in call)  # second turns only after every first one


def test_a_window_is_written_before_the_next_one_starts(tmp_path, tiny_target):
    """With one batch per window, a run that dies in its third window has written the first two."""
    records = [
        sharegpt(("human", f"question {i}"), ("gpt", "old"), ("human", "again?"), ("gpt", "old"), id=f"c{i}")
        for i in range(6)
    ]
    source = write_jsonl(tmp_path / "six.jsonl", records)
    out = tmp_path / "o.jsonl"
    calls = []

    class DiesInTheThirdWindow(TransformersEngine):
        def generate(self, prompts):
            calls.append(len(prompts))
            if len(calls) > 4:  # two calls (first turns, then second turns) per window of 2
                raise KeyboardInterrupt
            return super().generate(prompts)

    settings = RegenerateSettings(max_new_tokens=2, batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        engine = DiesInTheThirdWindow(tiny_target, settings)
        regenerate(str(source), out, tiny_target, settings, RegenerateRun(window_batches=1), engine=engine)
    assert calls == [2, 2, 2, 2, 2] and len(read_out(out)) == 4
    rest = regenerate(str(source), out, tiny_target, settings)  # the default window: all 6 at once
    assert rest.already_done == 4 and rest.written == 2
    whole = tmp_path / "whole.jsonl"
    regenerate(str(source), whole, tiny_target, settings)
    assert read_out(out) == read_out(whole)


def test_max_turns_keeps_the_first_user_turns(tmp_path, source, tiny_target):
    out = tmp_path / "first.jsonl"
    settings = RegenerateSettings(max_new_tokens=3, batch_size=2, max_turns=1)
    report = regenerate(str(source), out, tiny_target, settings)
    records = read_out(out)
    assert report.written == 4 and [t["from"] for t in records["two-turns"]["conversations"]] == ["human", "gpt"]
    assert [t["from"] for t in records["with-system"]["conversations"]] == ["system", "human", "gpt"]


def test_a_turn_that_does_not_fit_the_context_ends_its_conversation(tmp_path, tiny_target):
    """A first prompt too long for the tiny target's context skips the record
    (counted as too_long); a second one ends the conversation after the first answer."""
    context = tiny_target.model.config.max_position_embeddings
    long = " ".join(["word"] * context)
    records = [
        sharegpt(("human", long), id="too-long"),
        sharegpt(("human", "Hi"), ("gpt", "old"), ("human", long), ("gpt", "old"), id="cut"),
        sharegpt(("human", "Hi"), id="fits"),
    ]
    source = write_jsonl(tmp_path / "long.jsonl", records)
    out = tmp_path / "o.jsonl"
    report = regenerate(str(source), out, tiny_target, RegenerateSettings(max_new_tokens=4, batch_size=2))
    assert report.written == 2 and dict(report.stats.skipped) == {"too_long": 1}
    assert report.stats.used + report.stats.n_skipped == report.stats.read
    assert [t["from"] for t in read_out(out)["cut"]["conversations"]] == ["human", "gpt"]


def test_bad_shard_is_one_clear_line(tmp_path, capsys):
    from draftsmith.cli import main

    for bad in ("2/2", "x", "1/0"):
        with pytest.raises(SystemExit) as info:
            main(["data", "regenerate", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o"), "--shard", bad])
        assert info.value.code == 2
        assert f"--shard takes I/N with 0 <= I < N (e.g. 0/4), got {bad!r}" in capsys.readouterr().err


def test_threads_option_sets_torch_threads(tmp_path, source, tiny_target_dir):
    import torch

    from draftsmith.cli import main

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = tmp_path / "o.jsonl"
        args = ["data", "regenerate", str(source), "--out", str(out), "--target", str(tiny_target_dir)]
        main([*args, "--max-new-tokens", "2", "--limit", "1", "--threads", "1"])
        assert torch.get_num_threads() == 1 and len(read_out(out)) == 1
        command = json.loads(meta_path(out).read_text())["command"]  # the meta says how it was made
        assert command.startswith("draftsmith data regenerate ") and command.endswith("--limit 1 --threads 1")
    finally:
        torch.set_num_threads(before)


STUB_VLLM = """import json, os, sys
# Stands in for vLLM's python: 'python WORKER --serve ENGINE.json FD'. Answers each prompt with its
# 7th token from the end (with the tests' chat template: the user's last word) and the first stop
# token; fails on the request [[7, 1]].
engine = json.load(open(sys.argv[3]))
replies = os.fdopen(int(sys.argv[4]), "w")
print("INFO vLLM stand-in starting on", engine["model"])
with open(os.path.join(os.path.dirname(sys.argv[0]), "cores"), "w") as cores:  # the binding it was given
    cores.write(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "vLLM's own"))
replies.write(json.dumps({"vllm_version": "stub", "startup_seconds": 0.1}) + "\\n")
replies.flush()
for line in sys.stdin:
    request = json.loads(line)
    if request["prompts"] == [[7, 1]]:
        print("Traceback (most recent call last):\\nValueError: the stand-in refuses token 7", flush=True)
        sys.exit(1)
    stop = request["sampling"]["stop_token_ids"][0]
    outputs = [{"tokens": [p[-7], stop], "finish_reason": "stop"} for p in request["prompts"]]
    replies.write(json.dumps({"outputs": outputs}) + "\\n")
    replies.flush()
"""


def stub_vllm(tmp_path):
    """An executable standing in for vLLM's python: it runs the stand-in above instead of the worker."""
    import sys

    (tmp_path / "stub_vllm.py").write_text(STUB_VLLM)
    stub = tmp_path / "vllm-python"
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "stub_vllm.py"} "$@"\n')
    stub.chmod(0o755)
    return stub


def test_vllm_engine_plumbing_with_a_stand_in(tmp_path, source, tiny_target, tiny_target_dir, capsys, monkeypatch):
    """The vLLM path's protocol and bookkeeping, with a stand-in engine (not vLLM): prompts go out as the
    target's chat-template tokens, answers come back in order and are decoded here; a worker that dies
    is reported by its error line. vLLM computes on every core unless --threads says otherwise."""
    from draftsmith.cli import main
    from draftsmith.core.arguments import usable_cpus
    from draftsmith.core.vllm_env import THREADS_BIND, VllmError, VllmServer, cpu_binding
    from draftsmith.data.regenerate import VllmEngine, encode_prompt, vllm_server_settings

    monkeypatch.delenv(THREADS_BIND, raising=False)
    out = tmp_path / "out.jsonl"
    args = ["data", "regenerate", str(source), "--out", str(out), "--target", str(tiny_target_dir)]
    main([*args, "--engine", "vllm", "--vllm-python", str(stub_vllm(tmp_path)), "--max-new-tokens", "4"])
    records = read_out(out)
    assert set(records) == {"two-turns", "prompt-only", "with-system", "d"}
    turns = records["two-turns"]["conversations"]
    last_word = encode_prompt(tiny_target, [{"role": "user", "content": turns[0]["value"]}])[-7]
    assert turns[1]["value"] == tiny_target.tokenizer.decode([last_word]).strip() == "?"
    assert json.loads(meta_path(out).read_text())["engine"] == "vllm"
    assert "vLLM stub ready" in capsys.readouterr().err
    assert (tmp_path / "cores").read_text() == cpu_binding(len(usable_cpus()))
    vllm = ["--engine", "vllm", "--vllm-python", str(stub_vllm(tmp_path)), "--max-new-tokens", "4"]
    main([*args, *vllm, "--threads", "1"])
    assert (tmp_path / "cores").read_text() == cpu_binding(1)

    settings = vllm_server_settings(tiny_target_dir, tiny_target, "float32")
    with VllmServer(str(stub_vllm(tmp_path)), settings) as server:
        engine = VllmEngine(server, tiny_target, SETTINGS)
        assert engine.generate([list(range(5, 12)), list(range(20, 30))]) == [([5, 2], False), ([23, 2], False)]
        with pytest.raises(VllmError, match="vLLM failed: ValueError: the stand-in refuses token 7"):
            engine.generate([[7, 1]])


def test_vllm_engine_needs_a_vllm_and_a_safetensors_target(tmp_path, source, capsys):
    from draftsmith.cli import main

    args = ["data", "regenerate", str(source), "--out", str(tmp_path / "o.jsonl"), "--engine", "vllm"]
    with pytest.raises(SystemExit) as info:
        main([*args, "--vllm-python", str(tmp_path / "nope")])
    assert info.value.code != 0 and "give the python of the venv where vLLM is installed" in capsys.readouterr().err
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(SystemExit):
        main([*args, "--vllm-python", str(stub_vllm(tmp_path)), "--target", str(gguf)])
    assert "is not one; give the default target or a saved model directory" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (set DRAFTSMITH_VLLM_PYTHON)")
def test_vllm_regenerates_what_transformers_regenerates(tmp_path, source, tokenizer, monkeypatch):
    """Greedy float32: vLLM's answers equal transformers' (one prompt per batch, so no padding)."""
    from draftsmith.core.vllm_env import VllmServer
    from draftsmith.data.regenerate import VllmEngine, vllm_server_settings

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    target_dir = tmp_path / "target"
    vllm_sized_llama(len(tokenizer)).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    target = load_target(str(target_dir))
    settings = RegenerateSettings(max_new_tokens=12, batch_size=1)
    regenerate(str(source), tmp_path / "hf.jsonl", target, settings)
    with VllmServer(vllm_python(), vllm_server_settings(target_dir, target, "float32")) as server:
        regenerate(str(source), tmp_path / "vllm.jsonl", target, settings, engine=VllmEngine(server, target, settings))
    assert read_out(tmp_path / "vllm.jsonl") == read_out(tmp_path / "hf.jsonl")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as dead)."""
    from pathlib import Path

    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except FileNotFoundError:
        return False


def test_the_vllm_worker_stops_its_engine_processes_when_draftsmith_dies(tmp_path):
    """vLLM's engine processes outlive a killed parent; the worker kills its whole process group when the
    draftsmith process that started it disappears, so nothing keeps the cores busy."""
    import subprocess
    import sys
    import time

    import draftsmith.core.vllm_env as vllm_env

    pids = tmp_path / "pids"
    worker = (
        f"import os, subprocess, sys, time; sys.path.insert(0, {str(vllm_env.WORKER.parent)!r}); import vllm_worker; "
        f"vllm_worker.stop_with_parent(); engine = subprocess.Popen(['sleep', '120']); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{engine.pid}}'); time.sleep(120)"
    )
    draftsmith = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], "
            "start_new_session=True); time.sleep(120)",
        ]
    )
    deadline = time.time() + 60
    while not (pids.is_file() and len(pids.read_text().split()) == 2) and time.time() < deadline:
        time.sleep(0.2)
    worker_pid, engine_pid = map(int, pids.read_text().split())
    assert _alive(worker_pid) and _alive(engine_pid)
    draftsmith.kill()
    draftsmith.wait()
    deadline = time.time() + 15
    while (_alive(worker_pid) or _alive(engine_pid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(worker_pid) and not _alive(engine_pid)
