"""``draftsmith tune``: acceptance read from one record equals real decoding with each smaller tree; the
fitted tree lives in the export (manifest still valid), and generate/bench use it unless told otherwise."""

import json

import pytest
import torch

from draftsmith.cli import main
from draftsmith.core.io import FILES_MANIFEST, file_problems
from draftsmith.core.target import load_target
from draftsmith.drafters.base import FrozenTarget
from draftsmith.drafters.io import export_drafter
from draftsmith.drafters.registry import get_family
from draftsmith.inference.measure.tune import (
    Shape,
    TuneOptions,
    record_counted_prompt,
    record_prompt,
    round_rows,
    run_tune,
    runtime_drafter_for_tune,
    serving_target,
    simulate_rounds,
    tune_base,
)
from draftsmith.inference.methods.learned import load_drafter
from draftsmith.inference.methods.lookup import WithPromptLookup
from draftsmith.inference.methods.table import build_drafter
from draftsmith.inference.methods.tuned_trees import (
    TUNED_TREES,
    DeviceKey,
    fitted_tree,
    read_tuned_trees,
    weights_sha256,
    write_tuned_tree,
)
from draftsmith.inference.runtime import generate
from draftsmith.train.losses import family_loss
from draftsmith.train.losses.medusa import medusa_loss
from draftsmith.train.losses.medusa2 import medusa2_loss
from helpers import (
    fit,
    fused_batch,
    hf_greedy,
    random_prompts,
    row_invariant_backends,
    self_distilled_batch,
    train_from_target,
)


@pytest.fixture(scope="module")
def tiny(tiny_target_dir):
    return load_target(str(tiny_target_dir))


@pytest.fixture(scope="module")
def trained_export(tiny, tmp_path_factory):
    """An FSPAD drafter trained briefly on the tiny target's own greedy continuations, exported."""
    vocab = int(tiny.model.config.vocab_size)
    batch = self_distilled_batch(tiny.model, vocab, n=16, new_tokens=40, seed=0)
    torch.manual_seed(0)
    family = get_family("fspad")
    model = family.build(tiny.model.config, {})
    frozen = FrozenTarget.from_model(tiny.model)
    fit(model, lambda m: family_loss(family)(m, batch, frozen, feature_noise=0.0), 150)
    return export_drafter(model.eval(), tiny.identity.to_dict(), tmp_path_factory.mktemp("tune") / "fspad")


def copied_export(source, tmp_path):
    """A private copy of the export (tune writes into it)."""
    import shutil

    return shutil.copytree(source, tmp_path / "fspad")


def test_acceptance_read_from_the_record_equals_decoding_with_each_smaller_tree(tiny, trained_export):
    """The key claim: from one record (max depth 4, per top_k) the accepted length of every round of a
    decode with a smaller tree (depth, top_k, total_tokens) is exactly what decoding with it gives."""
    max_depth, max_new = 4, 24
    drafters = {k: runtime_drafter_for_tune(trained_export, tiny, max_depth, k) for k in (1, 2, 3)}
    eos = tiny.eos_token_ids
    shapes = [Shape(4, 3, 12), Shape(2, 3, 4), Shape(3, 2, 3), Shape(4, 1, 4), Shape(1, 3, 2), Shape(3, 3, 1)]
    drafted, backends = 0, row_invariant_backends()
    for prompt in random_prompts(4, seed=0, vocab=int(tiny.model.config.vocab_size)):
        record = record_prompt(tiny, drafters, prompt, max_new, max_depth, backends)
        for shape in shapes:
            drafter = drafters[1].model.runtime_drafter(tiny.model, shape.options())
            real = generate(tiny.model, prompt, drafter, max_new_tokens=max_new, eos_token_ids=eos, backends=backends)
            assert simulate_rounds(record, shape, max_new, set(eos)) == real.accept_lengths, shape
            drafted += sum(n - 1 for n in real.accept_lengths)
        assert simulate_rounds(record, None, max_new, set(eos)) == [1] * (max_new - 1)
    assert drafted > 20  # draft tokens were accepted, so the comparison says something


def test_acceptance_and_rows_with_a_grafted_lookup_chain_equal_decoding_with_it(tiny, trained_export):
    """With prompt lookup's chain grafted on (lookup=N), the record gives every round's accepted length
    and verified rows exactly as decoding with the grafted trees does, for chains shorter than the one
    recorded too."""
    max_depth, max_new = 3, 24
    drafters = {k: runtime_drafter_for_tune(trained_export, tiny, max_depth, k) for k in (1, 2)}
    eos = tiny.eos_token_ids
    shapes = [Shape(3, 2, 4, lookup=4), Shape(2, 1, 2, lookup=2), Shape(1, 2, 1, lookup=1), Shape(2, 2, 3)]
    chain_wins = grafted = 0
    backends = row_invariant_backends()
    for prompt in random_prompts(4, seed=3, vocab=int(tiny.model.config.vocab_size)):
        record = record_prompt(tiny, drafters, prompt, max_new, max_depth, backends, lookup=4)
        for shape in shapes:
            drafter = drafters[1].model.runtime_drafter(tiny.model, shape.options())
            if shape.lookup:
                drafter = WithPromptLookup(drafter, shape.lookup)
            rows = []
            propose = drafter.propose
            drafter.propose = lambda context: rows.append(1 + len(tree := propose(context))) or tree
            real = generate(tiny.model, prompt, drafter, max_new_tokens=max_new, eos_token_ids=eos, backends=backends)
            assert simulate_rounds(record, shape, max_new, set(eos)) == real.accept_lengths, shape
            assert round_rows(record, shape, real.accept_lengths) == rows, shape
            plain = Shape(shape.depth, shape.top_k, shape.total_tokens)
            chain_wins += sum(record.accepted(shape, t) > record.accepted(plain, t) for t in range(1, max_new))
            grafted += sum(rows) - len(rows) * (1 + shape.total_tokens)
    assert chain_wins > 20 and grafted > 40  # chains ran past the trees and added rows: the check says something


def test_tune_writes_a_tree_the_export_still_verifies_and_generate_uses(
    tiny, tiny_target_dir, trained_export, tmp_path, capsys
):
    export = copied_export(trained_export, tmp_path)
    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
            for i, (c, t) in enumerate([("a", "What is the capital of France?"), ("b", "Two plus two?")])
        )
    )
    argv = ["tune", str(export), "--target", str(tiny_target_dir), "--questions", str(questions), "--limit", "2"]
    main(argv + ["--max-new-tokens", "12", "--max-depth", "3", "--top-k", "1,2", "--total-tokens", "1,2,4,8"])
    out = capsys.readouterr().out
    assert "| tree | τ (tokens/round) |" in out and "plain decoding (no drafter)" in out
    assert "chosen depth=" in out and "rounds as predicted on" in out
    assert file_problems(export) == {}  # the manifest records tuned_trees.json, and everything verifies
    assert TUNED_TREES in json.loads((export / FILES_MANIFEST).read_text())["files"]
    key = DeviceKey.current(tiny.model)
    entry = read_tuned_trees(export)[key.text()]
    chosen = entry["tree"]
    assert chosen["depth"] <= 3 and chosen["top_k"] in (1, 2) and chosen["total_tokens"] in (1, 2, 4, 8)
    assert chosen.get("lookup", 0) in (0, 3) and entry["calibration"]["search"]["lookup"] == [0, 3]
    assert entry["measured"]["prompts"] == 2 and entry["threads"] == torch.get_num_threads()
    kernels = {"native", "linear", "greedy_head", "weight_codes", "drafter_codes"}
    kernels |= {"isa"} if entry["kernels"]["linear"] == "stream" else set()  # the stream kernel's path
    assert set(entry["kernels"]) == kernels  # what bench-tree timed with

    # generate and bench build drafters through build_drafter: the fitted tree and chain, said in one line
    drafter = build_drafter(f"fspad={export}", tiny)
    assert (drafter.lookup.num_draft if isinstance(drafter, WithPromptLookup) else 0) == chosen.get("lookup", 0)
    tree_drafter = getattr(drafter, "inner", drafter)
    assert (tree_drafter.depth, tree_drafter.top_k, tree_drafter.total_tokens) == (
        chosen["depth"],
        chosen["top_k"],
        chosen["total_tokens"],
    )
    assert "[tune] using the tree fitted for" in capsys.readouterr().err
    prompt = random_prompts(1, seed=1, vocab=int(tiny.model.config.vocab_size))[0]
    assert generate(tiny.model, prompt, drafter, max_new_tokens=24, eos_token_ids=[2]).tokens == hf_greedy(
        tiny.model, prompt, 24
    )
    # an explicit serve-time option replaces the fitted tree
    explicit = build_drafter(f"fspad={export}:depth=2", tiny)
    assert (explicit.depth, explicit.top_k, explicit.total_tokens) == (2, 4, 12)  # the export's own defaults else
    assert "[tune]" not in capsys.readouterr().err
    # a fitted chain is served with the fitted tree; lookup=0 turns it off
    write_tuned_tree(export, key, {**entry, "tree": {**chosen, "lookup": 2}})
    served = build_drafter(f"fspad={export}", tiny)
    assert isinstance(served, WithPromptLookup) and served.lookup.num_draft == 2
    assert "lookup=2" in capsys.readouterr().err
    assert not isinstance(build_drafter(f"fspad={export}:lookup=0", tiny), WithPromptLookup)
    write_tuned_tree(export, key, entry)

    # a tune for another device adds to the file; this device's entry is kept and still used
    other = DeviceKey("cuda:Some GPU", "bfloat16", 8)
    write_tuned_tree(export, other, {**entry, "tree": {"depth": 5, "top_k": 5, "total_tokens": 20}})
    assert set(read_tuned_trees(export)) == {key.text(), other.text()} and file_problems(export) == {}
    assert fitted_tree(export, key).tree.depth == chosen["depth"]
    # another thread count or CPU model: the nearest entry of the same kind of device and dtype stands in
    nearest_first = DeviceKey(key.device, key.dtype, key.threads + 1)
    write_tuned_tree(export, DeviceKey(key.device, key.dtype, key.threads + 3), {**entry, "tree": {"depth": 6}})
    write_tuned_tree(export, DeviceKey("cpu:Another CPU", key.dtype, key.threads + 1), {**entry, "tree": {"depth": 7}})
    stand_in = fitted_tree(export, nearest_first)
    assert stand_in.tree.depth == chosen["depth"]  # same CPU model and the closest threads, not the exact threads
    assert f"no tree fitted for {nearest_first.text()}; using the one fitted for {key.text()}" in stand_in.note
    assert fitted_tree(export, DeviceKey("cpu:Third CPU", key.dtype, key.threads + 1)).tree.depth == 7
    # no entry of the same kind of device and dtype: the export's default tree, said so
    for alone in (DeviceKey("cuda:Some other GPU", key.dtype, key.threads), DeviceKey(key.device, "float16", 1)):
        missing = fitted_tree(export, alone)
        assert missing.tree is None and "no tree fitted for" in missing.note and "default tree" in missing.note


def test_a_stale_entry_is_ignored(tiny, trained_export, tmp_path, capsys):
    """Re-exporting the drafter (other weights) makes the fitted tree stale: ignored, said in one line."""
    export = copied_export(trained_export, tmp_path)
    key = DeviceKey.current(tiny.model)
    write_tuned_tree(export, key, {"tree": {"depth": 1, "top_k": 1, "total_tokens": 1}, "weights_sha256": "0" * 64})
    assert file_problems(export) == {}
    drafter = build_drafter(f"fspad={export}", tiny)
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (5, 4, 12)  # the export's defaults
    assert "exported again since" in capsys.readouterr().err


def test_an_entry_without_its_kernels_is_stale(tiny, trained_export, tmp_path, capsys):
    """An entry timed before the runtime recorded its kernels (an older cost curve) is not used; with
    the kernels recorded, the same entry is, and the note names them."""
    export = copied_export(trained_export, tmp_path)
    key = DeviceKey.current(tiny.model)
    entry = {"tree": {"depth": 1, "top_k": 1, "total_tokens": 1}, "weights_sha256": weights_sha256(export)}
    write_tuned_tree(export, key, entry)
    stale = fitted_tree(export, key)
    assert stale.tree is None and "before the runtime's kernels were recorded" in stale.note
    write_tuned_tree(export, key, {**entry, "kernels": {"native": True, "packed_gemm": True}})  # before "linear"
    used = fitted_tree(export, key)
    assert used.tree.depth == 1 and "timed with C++ decoder layers, packed GEMM" in used.note
    write_tuned_tree(export, key, {**entry, "kernels": {"native": True, "linear": "onednn"}})
    assert "timed with C++ decoder layers, oneDNN linears" in fitted_tree(export, key).note
    codes = {"linear": "stream", "weight_codes": True}
    write_tuned_tree(export, key, {**entry, "kernels": {**codes, "drafter_codes": True}})
    assert "stream linears (weight codes, the drafter's rounded)" in fitted_tree(export, key).note
    write_tuned_tree(export, key, {**entry, "kernels": codes})
    assert "stream linears (weight codes))" in fitted_tree(export, key).note
    write_tuned_tree(export, key, {**entry, "kernels": {**codes, "isa": "avx2"}})  # the path tune timed
    assert "stream linears (AVX2 path) (weight codes))" in fitted_tree(export, key).note


@pytest.fixture(scope="module")
def medusa_export(tiny, tmp_path_factory):
    """Medusa-1 heads trained briefly on the tiny target's own greedy continuations, exported."""
    vocab = int(tiny.model.config.vocab_size)
    batch = self_distilled_batch(tiny.model, vocab, n=16, new_tokens=40, seed=0)
    torch.manual_seed(0)
    model = get_family("medusa").build(tiny.model.config, {"num_heads": 3})
    frozen = FrozenTarget.from_model(tiny.model)
    model.init_from_target(frozen)
    fit(model, lambda m: medusa_loss(m, batch, frozen), 150, 3e-3)
    return export_drafter(model.eval(), tiny.identity.to_dict(), tmp_path_factory.mktemp("tune") / "medusa")


def assert_counted_rounds_are_real_rounds(tiny, export, shapes: list[Shape]) -> None:
    """Each tree's accepted lengths as tune counts them equal decoding with that tree."""
    base = tune_base(export, tiny)
    eos, max_new, drafted = tiny.eos_token_ids, 24, 0
    backends = row_invariant_backends()
    for prompt in random_prompts(4, seed=0, vocab=int(tiny.model.config.vocab_size)):
        record = record_counted_prompt(tiny, base, prompt, max_new, shapes, backends)
        for shape in shapes:
            drafter = base.model.runtime_drafter(tiny.model, shape.options())
            real = generate(tiny.model, prompt, drafter, max_new_tokens=max_new, eos_token_ids=eos, backends=backends)
            assert simulate_rounds(record, shape, max_new, set(eos)) == real.accept_lengths, shape
            drafted += sum(n - 1 for n in real.accept_lengths)
    assert drafted > 10  # draft tokens were accepted, so the comparison says something


def test_medusa_acceptance_recorded_per_tree_equals_decoding_with_it(tiny, medusa_export):
    shapes = [Shape(3, 1, 3, medusa=True), Shape(3, 2, 2, medusa=True), Shape(3, 3, 6, medusa=True)]
    assert_counted_rounds_are_real_rounds(tiny, medusa_export, shapes)


def test_tune_fits_a_dynamic_medusa_tree_that_generate_uses(tiny, tiny_target_dir, medusa_export, tmp_path, capsys):
    import shutil

    export = shutil.copytree(medusa_export, tmp_path / "medusa")
    argv = ["tune", str(export), "--target", str(tiny_target_dir), "--limit", "2", "--max-new-tokens", "12"]
    main(argv + ["--top-k", "1,2", "--total-tokens", "1,2,4"])
    assert "chosen tree=dynamic top_k=" in capsys.readouterr().out
    assert file_problems(export) == {}
    entry = read_tuned_trees(export)[DeviceKey.current(tiny.model).text()]
    chosen = entry["tree"]
    assert chosen["tree"] == "dynamic" and chosen["top_k"] in (1, 2) and chosen["total_tokens"] in (1, 2, 4)
    assert entry["calibration"]["search"]["heads"] == 3
    drafter = build_drafter(f"medusa={export}", tiny)
    assert drafter.static is None and (drafter.top_k, drafter.total_tokens) == (chosen["top_k"], chosen["total_tokens"])
    assert "[tune] using the tree fitted for" in capsys.readouterr().err
    prompt = random_prompts(1, seed=1, vocab=int(tiny.model.config.vocab_size))[0]
    assert generate(tiny.model, prompt, drafter, max_new_tokens=24, eos_token_ids=[2]).tokens == hf_greedy(
        tiny.model, prompt, 24
    )
    static = build_drafter(f"medusa={export}:tree=medusa-8", tiny)  # a serve-time option replaces it
    assert static.static is not None


PEAGLE_LAYERS = [0, 1]  # the states entering the tiny target's two layers


@pytest.fixture(scope="module")
def peagle_export(tiny, tmp_path_factory):
    """A P-EAGLE drafter of 3 depths trained briefly on the tiny target's greedy continuations, exported."""
    batch = fused_batch(tiny.model, int(tiny.model.config.vocab_size), PEAGLE_LAYERS, n=16, new_tokens=40)
    options = {"aux_layer_ids": PEAGLE_LAYERS, "ttt_steps": 3, "depth": 3, "total_tokens": 3}
    model, _ = train_from_target("peagle", tiny.model, batch, 100, **options)
    return export_drafter(model, tiny.identity.to_dict(), tmp_path_factory.mktemp("tune") / "peagle")


def test_peagle_acceptance_recorded_per_tree_equals_decoding_with_it(tiny, peagle_export):
    assert_counted_rounds_are_real_rounds(
        tiny, peagle_export, [Shape(1, 1, 1), Shape(3, 1, 3), Shape(2, 2, 4), Shape(3, 3, 6)]
    )


def test_tune_fits_a_peagle_tree_that_generate_uses(tiny, tiny_target_dir, peagle_export, tmp_path, capsys):
    import shutil

    export = shutil.copytree(peagle_export, tmp_path / "peagle")
    argv = ["tune", str(export), "--target", str(tiny_target_dir), "--limit", "2", "--max-new-tokens", "12"]
    main(argv + ["--top-k", "1,2", "--total-tokens", "1,2,4"])
    entry = read_tuned_trees(export)[DeviceKey.current(tiny.model).text()]
    chosen = entry["tree"]
    assert entry["calibration"]["search"]["max_depth"] == 3  # the depths it was trained for, not --max-depth 6
    assert chosen["depth"] <= min(3, chosen["total_tokens"]) and chosen["top_k"] in (1, 2)
    drafter = build_drafter(f"peagle={export}", tiny)
    assert (drafter.depth, drafter.top_k, drafter.total_tokens) == (
        chosen["depth"],
        chosen["top_k"],
        chosen["total_tokens"],
    )
    prompt = random_prompts(1, seed=1, vocab=int(tiny.model.config.vocab_size))[0]
    assert generate(tiny.model, prompt, drafter, max_new_tokens=24, eos_token_ids=[2]).tokens == hf_greedy(
        tiny.model, prompt, 24
    )


@pytest.fixture(scope="module")
def medusa2_export(tiny_target_dir, tmp_path_factory):
    """Medusa-2 (heads and a non-zero LoRA) trained briefly on the tiny target's greedy continuations,
    exported. Its own copy of the target: a Medusa-2 model puts its LoRA into the target it adapts."""
    target = load_target(str(tiny_target_dir))
    target.model.requires_grad_(False)
    batch = self_distilled_batch(target.model, int(target.model.config.vocab_size), n=16, new_tokens=40, seed=0)
    torch.manual_seed(0)
    model = get_family("medusa2").build(target.model.config, {"num_heads": 3, "lora_rank": 4, "lora_alpha": 8})
    frozen = FrozenTarget.from_model(target.model)
    model.init_from_target(frozen)
    with torch.no_grad():
        for pair in model.lora.values():
            pair.B.weight.normal_(std=0.01)
    model.attach_target(target.model)
    fit(model, lambda m: medusa2_loss(m, batch, frozen), 120, 3e-3)
    return export_drafter(model.eval(), target.identity.to_dict(), tmp_path_factory.mktemp("tune") / "medusa2")


def test_medusa2_acceptance_is_recorded_on_the_model_it_serves(tiny_target_dir, medusa2_export):
    """Tune decodes, records and times the merged model Medusa-2 serves, so its simulated rounds are
    the real ones of the drafter `generate` loads, whose output is the merged model's, not the original's."""
    target = load_target(str(tiny_target_dir))
    base = tune_base(medusa2_export, target)
    served = serving_target(base, target)
    assert served.model is base.served_model() and served.model is not target.model
    shapes = [Shape(3, 1, 3, medusa=True), Shape(3, 2, 4, medusa=True)]
    eos, max_new, drafted, differs = target.eos_token_ids, 24, 0, 0
    backends = row_invariant_backends()
    for prompt in random_prompts(6, seed=3, vocab=int(target.model.config.vocab_size)):
        record = record_counted_prompt(served, base, prompt, max_new, shapes, backends)
        differs += hf_greedy(served.model, prompt, max_new) != hf_greedy(target.model, prompt, max_new)
        for shape in shapes:
            drafter = load_drafter(medusa2_export, target, tree=shape.options())
            real = generate(target.model, prompt, drafter, max_new_tokens=max_new, eos_token_ids=eos, backends=backends)
            assert real.tokens == hf_greedy(drafter.served_model(), prompt, max_new)[: len(real.tokens)]
            assert simulate_rounds(record, shape, max_new, set(eos)) == real.accept_lengths, shape
            drafted += sum(n - 1 for n in real.accept_lengths)
    assert drafted > 10 and differs > 0, (drafted, differs)  # drafts accepted; the served model is not the original


def test_tune_fits_medusa2_and_generate_uses_the_tree(tiny_target_dir, medusa2_export, tmp_path, capsys):
    import shutil

    export = shutil.copytree(medusa2_export, tmp_path / "medusa2")
    argv = ["tune", str(export), "--target", str(tiny_target_dir), "--limit", "2", "--max-new-tokens", "12"]
    main(argv + ["--top-k", "1,2", "--total-tokens", "1,2,4"])
    assert "chosen tree=dynamic top_k=" in capsys.readouterr().out
    assert file_problems(export) == {}
    target = load_target(str(tiny_target_dir))
    chosen = read_tuned_trees(export)[DeviceKey.current(target.model).text()]["tree"]
    drafter = build_drafter(f"medusa={export}", target)
    assert (drafter.top_k, drafter.total_tokens) == (chosen["top_k"], chosen["total_tokens"])
    prompt = random_prompts(1, seed=1, vocab=int(target.model.config.vocab_size))[0]
    result = generate(target.model, prompt, drafter, max_new_tokens=24, eos_token_ids=[2])
    assert result.tokens == hf_greedy(drafter.served_model(), prompt, 24)


def test_tune_refuses_drafters_inside_the_target_and_bad_options(tiny, tiny_target_dir, tmp_path, capsys):
    streaming = get_family("streaming").build(tiny.model.config, {"num_stream_layers": 1, "lora_rank": 2})
    export_drafter(streaming, tiny.identity.to_dict(), tmp_path / "streaming")
    with pytest.raises(SystemExit):
        main(["tune", str(tmp_path / "streaming"), "--target", str(tiny_target_dir)])
    err = capsys.readouterr().err
    assert "tune fits EAGLE-2 dynamic trees" in err and "streaming" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["tune", str(tmp_path / "streaming"), "--target", str(tiny_target_dir), "--top-k", "two"])
    assert "--top-k takes comma-separated whole numbers" in capsys.readouterr().err


def test_run_tune_says_when_plain_decoding_wins(tiny, tmp_path, monkeypatch):
    """An untrained drafter's guesses are (almost) never accepted, while a drafting round costs a drafter
    forward on top of a verification forward: no tree beats plain decoding, said and recorded. Also
    the default calibration prompts (no --questions). The verification costs are a fixed curve (a
    wider forward costs more, as everywhere): the tiny model's real ones are fractions of a
    millisecond, which a busy machine reorders at random."""
    from draftsmith.inference.measure import tune

    def cost_curve(target, sizes, prefix, repeats, backends):
        rows = [{"size": size, "median_ms": 10.0 + size} for size in sizes]
        return {"rows": rows, "native": False, "linear": {"kernel": "default"}, "greedy_head": False}

    monkeypatch.setattr(tune, "run_tree_bench", cost_curve)
    model = get_family("fspad").build(tiny.model.config, {})
    export = export_drafter(model, tiny.identity.to_dict(), tmp_path / "untrained")
    lines = []
    options = TuneOptions(None, 1, 6, max_depth=2, top_ks=(2,), totals=(2, 4), repeats=5, measure_choice=False)
    # the prediction alone: the tiny model's real decodes take fractions of a millisecond a round, which a
    # busy machine reorders (test_tune_keeps_the_finalist_that_decodes_fastest checks the decodes' verdict)
    entry = run_tune(export, tiny, options, say=lines.append)
    assert entry["predicted"]["tokens_per_round"] < 1.5 and not entry["drafting_pays"]
    assert any("no tree beats plain decoding" in line for line in lines)
    assert file_problems(export) == {}


@pytest.mark.parametrize("speedups, chosen, pays", [((0.9, 1.2, 1.1), 1, True), ((0.9, 0.8, 0.95), 2, False)])
def test_tune_keeps_the_finalist_that_decodes_fastest(tiny, tmp_path, monkeypatch, speedups, chosen, pays):
    """The best predicted trees are decoded, and the fastest in decoding is recorded, whatever the prediction
    said; drafting pays only where a decode beat the decodes without a drafter (the measurements are fixed
    here, as a machine could report them)."""
    from draftsmith.inference.measure import tune

    def measured(target, base, records, finalists, plain, max_new_tokens, say, backends):
        return {
            p.shape: {"tokens_per_s": 100.0 * speedup, "speedup_vs_plain": speedup}
            for p, speedup in zip(finalists, speedups, strict=True)
        }

    monkeypatch.setattr(tune, "measure_finalists", measured)
    model = get_family("fspad").build(tiny.model.config, {})
    export = export_drafter(model, tiny.identity.to_dict(), tmp_path / "untrained")
    lines = []
    options = TuneOptions(None, 1, 6, max_depth=2, top_ks=(2,), totals=(1, 2, 4))
    entry = run_tune(export, tiny, options, say=lines.append)
    finalists = entry["finalists"]
    assert len(finalists) == tune.FINALISTS and entry["tree"] == finalists[chosen]["tree"]
    assert entry["measured"]["speedup_vs_plain"] == speedups[chosen] and entry["drafting_pays"] is pays
    assert any("no tree beats plain decoding" in line for line in lines) is not pays


def test_finalists_are_decoded_once_untimed_then_in_a_rotating_order_timed_after_the_prompt(monkeypatch):
    """Each finalist's drafter (and plain decoding) decodes the first prompt once untimed; then every prompt
    is decoded by all of them, each prompt starting one place further along; speeds count the decoding
    after the prompt's forward, as the predictions do."""
    from types import SimpleNamespace

    from draftsmith.inference.measure import tune
    from draftsmith.inference.runtime import GenerationResult

    calls = []

    def fake_generate(model, prompt, drafter, **kwargs):
        calls.append((prompt[0], drafter))
        after = 1.0 if drafter is None else 0.5  # the prompt's forward: 0.5 s for every method
        return GenerationResult([1, 2], target_forwards=2, accept_lengths=[2], seconds=0.5 + after, prompt_seconds=0.5)

    monkeypatch.setattr(tune, "generate", fake_generate)
    monkeypatch.setattr(tune, "simulate_rounds", lambda record, shape, budget, eos: [2])
    base = SimpleNamespace(model=SimpleNamespace(runtime_drafter=lambda model, options: ("tree", options.total_tokens)))
    shapes = [tune.Shape(1, 1, tokens) for tokens in (1, 2)]
    finalists = [tune.Prediction(shape, 2.0, 10.0) for shape in shapes]
    records = [SimpleNamespace(prompt=[i]) for i in range(3)]
    target = SimpleNamespace(model=None, eos_token_ids=[0])
    found = tune.measure_finalists(
        target, base, records, finalists, tune.Prediction(None, 1.0, 10.0), 2, lambda line: None, None
    )
    order = [None, ("tree", 1), ("tree", 2)]
    assert calls[:3] == [(0, method) for method in order]  # the untimed decodes
    assert [method for _, method in calls[3:]] == order + order[1:] + order[:1] + order[2:] + order[:2]
    assert [prompt for prompt, _ in calls[3:]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for shape in shapes:  # 1 s against 0.5 s after the prompt (1.5 s against 1 s over whole decodes)
        assert found[shape]["speedup_vs_plain"] == 2.0
