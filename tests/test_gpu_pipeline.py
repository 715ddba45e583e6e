"""cli/gpu_pipeline.py in its tiny mode on a CPU: every stage runs, lands in --out and resumes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import sharegpt, write_jsonl

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_pipeline(out, target, source, *extra):
    tiny = ["--device", "cpu", "--target", str(target), "--source", str(source), "--shards", "0,1", "--n-shards", "2"]
    tiny += ["--max-new-tokens", "4", "--regen-batch-size", "2", "--train-steps", "3", "--train-batch-size", "2"]
    tiny += ["--bench-max-new-tokens", "4", "--extra-data", str(source)]
    tiny += ["--set", "drafter.draft_vocab_size=64", "--set", "data.eval_samples=2", "--set", "drafter.ttt_steps=2"]
    command = [sys.executable, str(REPO / "cli/gpu_pipeline.py"), "--out", str(out), *tiny, *extra]
    subprocess.run(command, check=True, cwd=out.parent, timeout=600)
    return json.loads((out / "summary.json").read_text())


def test_tiny_pipeline_regenerates_trains_exports_and_benches(tmp_path, tiny_target_dir):
    questions = [
        sharegpt(("human", f"Question {i}: say something about the number {i}."), id=f"q{i}") for i in range(8)
    ]
    source = write_jsonl(tmp_path / "prompts.jsonl", questions)
    out = tmp_path / "results"
    summary = run_pipeline(out, tiny_target_dir, source)
    stages = summary["stages"]
    assert all(c["exit"] == 0 for stage in stages.values() for c in stage.get("commands", [])), stages
    assert sum(stages["regenerate"]["conversations"].values()) == 8  # the two shards hold every record
    assert stages["prepare"]["records"] == 16  # the regenerated shards and the extra data
    assert json.loads((out / "drafter/config.json").read_text())["drafter_family"] == "eagle3"
    for dtype in ("float32", "bfloat16"):
        assert list((out / f"bench-{dtype}").glob("*.json")), dtype
    # a rerun finds every shard done and the training run finished: it resumes, it does not start over
    again = run_pipeline(out, tiny_target_dir, source, "--skip", "bench", "--scaling-samples", "4")
    assert all(", 0 written now" in log.read_text().split("$ draftsmith")[-1] for log in (out / "data").glob("*.log"))
    assert again["stages"]["train"]["commands"][0]["command"].endswith("--resume --resume-new-data")
    # the scaling stage: the same steps on 4 of the training samples, plotted beside the full run
    assert [c["exit"] for c in again["stages"]["scaling"]["commands"]] == [0, 0]
    curves = json.loads((out / "scaling/curves.json").read_text())
    whole = json.loads((out / "work/run/run_info.json").read_text())["train_samples"]
    assert [run["label"] for run in curves["runs"]] == ["4 training samples", f"{whole} training samples"] and whole > 4


def test_scaling_samples_are_checked_when_the_command_is_parsed(capsys):
    from draftsmith.cli.gpu_pipeline import parse_args

    assert parse_args(["--out", "o", "--scaling-samples", "1700,5000"]).scaling_samples == [1700, 5000]
    for bad in ("x", "0,5", ""):
        with pytest.raises(SystemExit):
            parse_args(["--out", "o", "--scaling-samples", bad])
    assert "sample counts >= 1" in capsys.readouterr().err
