"""``draftsmith curves``: held-out figures of real runs against tokens_seen, one line per data subset."""

import json

from draftsmith.cli import main
from helpers import refused, write_recipe


def test_curves_of_two_data_subsets_from_one_prepared_set(tmp_path, tiny_target_dir, prepared_dir, capsys):
    runs = []
    for samples in (4, 8):
        recipe = write_recipe(tmp_path / f"n{samples}", tiny_target_dir, prepared_dir)
        main(["train", str(recipe), f"data.train_samples={samples}", "data.eval_samples=3"])
        runs.append(tmp_path / f"n{samples}" / "run")
    capsys.readouterr()
    main(["curves", *map(str, runs), "--out", str(tmp_path / "curves")])
    table = capsys.readouterr().out
    assert "| 4 training samples | 2 |" in table and "| 8 training samples | 2 |" in table
    written = json.loads((tmp_path / "curves" / "curves.json").read_text())
    logged = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    evaluations = [(r["tokens_seen"], r["eval/sim/accept_length"]) for r in logged if "eval/sim/accept_length" in r]
    assert [tuple(point) for point in written["runs"][0]["points"]] == evaluations
    assert 0 < evaluations[0][0] < evaluations[1][0]
    assert (tmp_path / "curves" / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_curves_refuse_runs_that_cannot_be_plotted_and_outputs_inside_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "eval/sim/accept_length": 1.2}) + "\n")
    assert "without tokens_seen" in refused(["curves", run, "--out", tmp_path / "c"], capsys)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 3.0, "tokens_seen": 10}) + "\n")
    assert "logged no eval/sim/accept_length; train with data.eval_samples > 0" in refused(
        ["curves", run, "--out", tmp_path / "c"], capsys
    )
    assert "holds no metrics.jsonl" in refused(["curves", tmp_path, "--out", tmp_path / "c"], capsys)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "eval/sim/accept_length": 1.2, "tokens_seen": 10}) + "\n")
    assert "lies inside a run it plots" in refused(["curves", run, "--out", run / "c"], capsys)
    assert not (tmp_path / "c").exists()


def test_runs_of_different_families_are_labelled_by_family(tmp_path, capsys):
    """A same-data comparison of families: the one training-samples label would not tell the lines apart."""
    runs = []
    for family, value in (("eagle3", 1.4), ("dflash", 1.2)):
        run = tmp_path / family
        run.mkdir()
        (run / "run_info.json").write_text(json.dumps({"family": family, "train_samples": 40}))
        (run / "metrics.jsonl").write_text(
            json.dumps({"step": 5, "eval/sim/accept_length": value, "tokens_seen": 100}) + "\n"
        )
        runs.append(run)
    main(["curves", *map(str, runs), "--out", str(tmp_path / "curves")])
    table = capsys.readouterr().out
    assert "| eagle3, 40 training samples |" in table and "| dflash, 40 training samples |" in table


def test_a_goal_says_after_how_many_tokens_each_run_reached_it(tmp_path, capsys):
    runs = []
    for samples, values in ((40, (1.1, 1.25, 1.24)), (80, (1.2, 1.3, 1.4))):
        run = tmp_path / f"n{samples}"
        run.mkdir()
        (run / "run_info.json").write_text(json.dumps({"train_samples": samples}))
        rows = [
            {"step": 5 * (i + 1), "eval/sim/accept_length": v, "tokens_seen": 100 * (i + 1)}
            for i, v in enumerate(values)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        runs.append(run)
    main(["curves", *map(str, runs), "--out", str(tmp_path / "curves"), "--goal", "1.3"])
    table = capsys.readouterr().out
    assert "tokens to reach 1.3 |" in table.splitlines()[0]
    assert table.splitlines()[2].endswith("| not reached |") and table.splitlines()[3].endswith("| 200 |")
    written = json.loads((tmp_path / "curves" / "curves.json").read_text())
    assert written["goal"] == 1.3 and [r["reached_goal_at"] for r in written["runs"]] == [None, 200]
