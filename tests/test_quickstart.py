"""The quickstart's held-out bench prompts and its command line."""

from draftsmith.data.default_prompts import build_prompts
from draftsmith.train.quickstart import held_out_questions


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

    from draftsmith.train.cli import main

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
    from draftsmith.drafters.pretrained import bundled_families_for
    from draftsmith.train.quickstart import _shipped_methods

    assert _shipped_methods() == ["eagle3"]  # drafters/pretrained/eagle3-smollm2
    assert bundled_families_for("some other target") == []
