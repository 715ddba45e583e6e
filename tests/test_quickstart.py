"""The quickstart's held-out bench prompts and its command line."""

from pathlib import Path

from draftsmith.cli.quickstart import held_out_questions
from draftsmith.data.default_prompts import build_prompts


def test_held_out_questions_are_new_prompts_in_spec_bench_format():
    questions = held_out_questions(per_category=2)
    training = {r["conversations"][0]["value"] for r in build_prompts(0)}
    assert questions and all(q["turns"][0] not in training for q in questions)
    categories = [q["category"] for q in questions]
    assert all(c.startswith("default/") and categories.count(c) <= 2 for c in categories)
    assert {"question_id", "category", "turns"} == set(questions[0])
    assert held_out_questions(per_category=2) == questions  # deterministic


def test_quickstart_help_explains_itself(capsys):
    import pytest

    from draftsmith.cli import main

    with pytest.raises(SystemExit):
        main(["quickstart", "--help"])
    out = capsys.readouterr().out
    assert "--steps" in out and "resumes" in out


def test_tune_calibrates_on_other_prompts_than_the_bench():
    bench = held_out_questions(per_category=1)
    calibration = held_out_questions(1, seed=2, exclude=(q["turns"][0] for q in bench))
    assert calibration and not {q["turns"][0] for q in calibration} & {q["turns"][0] for q in bench}
    assert held_out_questions(1, seed=1, exclude=[bench[0]["turns"][0]])[0] != bench[0]


def test_the_quickstart_benches_the_drafter_shipped_for_smollm2():
    from draftsmith.cli.quickstart import _shipped_methods
    from draftsmith.drafters.pretrained import bundled_families_for

    assert _shipped_methods() == ["eagle3"]  # drafters/pretrained/eagle3-smollm2
    assert _shipped_methods("gemma3") == []
    assert bundled_families_for("some other target") == []


def _quickstart_commands(monkeypatch, tmp_path, *options: str) -> list[list[str]]:
    """The ``draftsmith`` commands the quickstart runs, recorded instead of run (an export's config.json is
    what the bench reads back from the steps)."""
    import json

    import draftsmith.cli.quickstart as quickstart
    from draftsmith.cli import main

    commands: list[list[str]] = []

    def record(build_parser, argv):
        commands.append(argv)
        if argv[0] == "export":
            export = Path(argv[argv.index("--out") + 1])
            export.mkdir(parents=True)
            (export / "config.json").write_text(json.dumps({"depth": 3, "top_k": 2, "total_tokens": 4}))

    monkeypatch.setattr(quickstart, "_run", record)
    monkeypatch.chdir(tmp_path)
    main(["quickstart", *options])
    return commands


def _loads_the_target(argv: list[str]) -> bool:
    return argv[:2] in (["data", "regenerate"], ["data", "prepare"], ["data", "cache-features"]) or argv[0] in (
        "tune",
        "bench",
    )


def test_quickstart_on_gemma3_trains_on_gemma3s_own_answers(monkeypatch, tmp_path):
    commands = _quickstart_commands(monkeypatch, tmp_path, "--target", "gemma-3-270m", "--distill-prompts", "12")
    regenerate, prepare = commands[0], commands[1]
    assert regenerate[:3] == ["data", "regenerate", "default"] and "--limit" in regenerate
    assert regenerate[regenerate.index("--limit") + 1] == "12"
    assert prepare[:3] == ["data", "prepare", regenerate[regenerate.index("--out") + 1]]  # its own answers
    loading = [argv for argv in commands if _loads_the_target(argv)]
    assert len(loading) == 5 and all(argv[argv.index("--target") + 1] == "gemma3" for argv in loading)
    train = next(argv for argv in commands if argv[0] == "train")
    assert Path(train[1]).name == "fspad-gemma3.yaml" and "data.eval_samples=2" in train
    methods = next(argv for argv in commands if argv[0] == "bench")[4].split(",")
    assert "eagle3" not in methods  # the shipped EAGLE-3 is SmolLM2's
    # its own working directory: a quickstart of the default target never resumes Gemma's data, nor the reverse
    outs = [Path(argv[argv.index("--out") + 1]) for argv in commands if "--out" in argv]
    assert outs and all(out.parts[:2] == ("runs", "quickstart-gemma3") for out in outs)


def test_quickstart_on_the_default_target_runs_the_commands_a_user_of_the_default_types(monkeypatch, tmp_path):
    commands = _quickstart_commands(monkeypatch, tmp_path)
    assert [argv[0] for argv in commands] == ["data", "data", "train", "export", "tune", "bench"]
    assert not any("--target" in argv for argv in commands)
    assert Path(commands[0][commands[0].index("--out") + 1]).parts[:2] == ("runs", "quickstart")
    train = next(argv for argv in commands if argv[0] == "train")
    assert Path(train[1]).name == "fspad-smollm2.yaml" and not any("eval_samples" in a for a in train)
    assert next(argv for argv in commands if argv[0] == "bench")[4].split(",")[-1] == "eagle3"


def test_quickstart_refuses_a_target_it_has_no_recipe_for_in_one_line(capsys):
    import pytest

    from draftsmith.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["quickstart", "--target", "some/hub-model"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "'some/hub-model' is not a named target" in err and "gemma3" in err
