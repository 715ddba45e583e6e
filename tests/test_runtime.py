"""Tree-decoding runtime (greedy): trees, masks, KV compaction and token identity with HF generate."""

import dataclasses
import random

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_llama
from draftsmith.core.cache import cache_length, commit_tree_path
from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree, tree_attention_inputs
from draftsmith.core.verify import verify_greedy
from draftsmith.inference.measure.floor import REPEATS
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate
from helpers import hf_greedy, prefill_and_verify, repetitive_prompts

VOCAB = 97


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=0)


def prompts(n, seed=0):
    return repetitive_prompts(n, seed, VOCAB)


class OracleDrafter(Drafter):
    """Knows the true greedy continuation; proposes the true path cut at a chosen length (cycling
    0..depth, so every acceptance length happens) plus a wrong sibling at every level."""

    name = "oracle"

    def __init__(self, truth, prompt_length, depth=5):
        self.truth, self.prompt_length, self.depth, self.round = truth, prompt_length, depth, 0

    def propose(self, context: DraftContext) -> DraftTree:
        done = len(context.tokens) - self.prompt_length
        upcoming = self.truth[done:]
        k = self.round % (self.depth + 1)
        self.round += 1
        paths = [upcoming[:d] for d in range(1, min(k, len(upcoming)) + 1)]
        paths += [upcoming[: d - 1] + [(upcoming[d - 1] + 1) % VOCAB] for d in range(1, min(k + 1, len(upcoming)) + 1)]
        return DraftTree.from_paths(paths) if paths else DraftTree.empty()


class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, seed=0):
        self.rng = random.Random(seed)

    def propose(self, context):
        return DraftTree.from_paths(
            [[self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 4))] for _ in range(self.rng.randint(0, 4))]
        )


def test_tree_from_paths_and_masks():
    tree = DraftTree.from_paths([[5, 6, 7], [5, 8], [9]])
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9] and tree.parents.tolist() == [-1, 0, 1, 0, -1]
    assert tree.depths().tolist() == [1, 2, 3, 2, 1]
    expected = torch.tensor(
        [  # rows/cols: root, 5, 6, 7, 8, 9
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask(), expected)
    mask, positions = tree_attention_inputs(tree, past_length=4, dtype=torch.float32)
    assert mask.shape == (1, 1, 6, 10) and positions.tolist() == [[4, 5, 6, 7, 6, 5]]
    assert (mask[0, 0, :, :4] == 0).all() and torch.equal(mask[0, 0, :, 4:] == 0, expected)
    with pytest.raises(ValueError, match="parents must come before"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))


def test_greedy_verdict_follows_the_argmax():
    tree = DraftTree.from_paths([[5, 6, 7], [5, 8], [9]])  # nodes 0..4: 5, 6, 7, 8, 9
    logits = torch.zeros(6, 10)
    for row, best in enumerate([5, 8, 0, 0, 2, 0]):  # row 0 = root, row i + 1 = node i
        logits[row, best] = 1
    verdict = verify_greedy(tree, logits)
    assert verdict.accepted_nodes == [0, 3] and verdict.next_token == 2  # 5 then 8 accepted; node 8 says 2
    logits[0] = 0
    logits[0, 3] = 1
    assert verify_greedy(tree, logits).accepted_nodes == [] and verify_greedy(tree, logits).next_token == 3


def test_compacted_cache_equals_plain_cache(model):
    torch.manual_seed(0)
    prefix = torch.randint(4, VOCAB, (1, 9))
    cache = DynamicCache(config=model.config)
    tree = DraftTree.from_paths([[11, 12, 13], [11, 14], [15, 16]])  # nodes: 11, 12, 13, 14, 15, 16
    prefill_and_verify(model, prefix, tree, cache)
    commit_tree_path(cache, 8, [0, 3])  # the non-contiguous path 11 -> 14
    plain = DynamicCache(config=model.config)
    model(torch.cat([prefix, torch.tensor([[11, 14]])], 1), **cache_kwargs(plain), use_cache=True)
    assert cache_length(cache) == cache_length(plain) == 11
    for ours, theirs in zip(cache.layers, plain.layers):
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.values, theirs.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("drafter_name", ["none", "pld", "oracle", "random"])
def test_greedy_output_is_identical_to_hf_generate(model, drafter_name):
    for prompt in prompts(6, seed=hash(drafter_name) % 100):
        truth = hf_greedy(model, prompt, 48, eos=())
        drafter = {
            "none": None,
            "pld": PromptLookupDrafter(),
            "random": RandomDrafter(),
            "oracle": OracleDrafter(truth, len(prompt)),
        }[drafter_name]
        result = generate(model, prompt, drafter, max_new_tokens=48)
        assert result.tokens == truth
        assert_bookkeeping(result, max_new_tokens=48)


def assert_bookkeeping(result, max_new_tokens):
    """One forward per accepted-length entry plus the prefill; the prefill commits one token and each
    verification forward its accepted length, except that the last one may be cut by the budget."""
    assert result.target_forwards == len(result.accept_lengths) + 1
    committed = 1 + sum(result.accept_lengths)
    cut = committed - len(result.tokens)
    assert cut == 0 or (len(result.tokens) == max_new_tokens and 0 < cut < result.accept_lengths[-1])


def test_bookkeeping_check_fails_on_a_wrong_count(model):
    prompt = prompts(1)[0]
    result = generate(
        model, prompt, OracleDrafter(hf_greedy(model, prompt, 40, eos=()), len(prompt)), max_new_tokens=40
    )
    assert_bookkeeping(result, max_new_tokens=40)
    # a forward that claims more tokens than a budget cut can explain (the oracle accepts at most 6)
    more = dataclasses.replace(result, accept_lengths=[result.accept_lengths[0] + 10, *result.accept_lengths[1:]])
    missing = dataclasses.replace(result, accept_lengths=result.accept_lengths[1:])  # a forward not recorded
    for wrong in (more, missing):
        with pytest.raises(AssertionError):
            assert_bookkeeping(wrong, max_new_tokens=40)


def test_oracle_reaches_every_acceptance_length(model):
    prompt = prompts(1)[0]
    truth = hf_greedy(model, prompt, 60, eos=())
    result = generate(model, prompt, OracleDrafter(truth, len(prompt), depth=5), max_new_tokens=60)
    assert result.tokens == truth
    assert set(result.accept_lengths) >= {1, 2, 3, 4, 5, 6}
    assert result.tau > 1.5 and result.target_forwards < len(truth)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_eos_inside_an_accepted_span_and_the_token_budget(model, max_new_tokens):
    prompt = prompts(2)[1]
    truth = hf_greedy(model, prompt, 30, eos=())
    eos = truth[9]  # a token the target really produces: generation must stop right after it
    expected = hf_greedy(model, prompt, max_new_tokens, eos=[eos])
    oracle = OracleDrafter(truth, len(prompt), depth=8)
    oracle.round = 8  # propose the full depth at once, so EOS falls inside an accepted span
    result = generate(model, prompt, oracle, max_new_tokens=max_new_tokens, eos_token_ids=[eos])
    assert result.tokens == expected
    assert len(result.tokens) <= max_new_tokens


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
    drafter = PromptLookupDrafter(max_ngram=2, num_draft=3)
    tree = drafter.propose(DraftContext([1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3], 0))
    assert tree.tokens.tolist() == [5, 6, 2] and tree.parents.tolist() == [-1, 0, 1]
    assert len(drafter.propose(DraftContext([1, 2, 3], 0))) == 0


def test_generate_command_streams_the_same_text_with_and_without_a_drafter(tiny_target_dir, capsys):
    from draftsmith.cli import main

    outputs = {}
    for method in ["none", "pld"]:
        main(
            [
                "generate",
                "Hello! How can I help you today?",
                "--method",
                method,
                "--target",
                str(tiny_target_dir),
                "--max-new-tokens",
                "24",
            ]
        )
        captured = capsys.readouterr()
        outputs[method] = captured.out
        assert f"[{method}]" in captured.err and "tau" in captured.err
    assert outputs["none"] == outputs["pld"] and outputs["none"].strip()


def test_unknown_method_is_a_clear_error(tiny_target_dir):
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftsmith.cli",
            "generate",
            "hi",
            "--method",
            "magic",
            "--target",
            str(tiny_target_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "unknown method 'magic'; available: none, pld" in result.stderr


def test_a_family_served_under_another_method_name_is_named_in_the_refusal(tiny_target_dir):
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.errors import MethodError
    from draftsmith.inference.methods.table import build_drafter

    with pytest.raises(MethodError, match=r"unknown method 'medusa2' \(a medusa2 export is served as medusa=DIR\)"):
        build_drafter("medusa2=somewhere", load_target(str(tiny_target_dir)))


def test_pld_takes_its_options_in_the_method_spec_and_drafts_short_chains_on_a_cpu():
    from types import SimpleNamespace

    from draftsmith.inference.methods.errors import MethodError
    from draftsmith.inference.methods.pld import CPU_NUM_DRAFT, GPU_NUM_DRAFT
    from draftsmith.inference.methods.table import build_drafter

    target = SimpleNamespace(model=tiny_llama(97))
    assert build_drafter("pld", target) == PromptLookupDrafter(num_draft=CPU_NUM_DRAFT)
    assert build_drafter("pld:num_draft=7:max_ngram=4", target) == PromptLookupDrafter(num_draft=7, max_ngram=4)
    on_a_gpu = SimpleNamespace(model=SimpleNamespace(device=torch.device("cuda")))  # nothing runs there
    assert build_drafter("pld", on_a_gpu).num_draft == GPU_NUM_DRAFT
    with pytest.raises(MethodError, match="pld takes the options num_draft, max_ngram"):
        build_drafter("pld:depth=3", target)
    with pytest.raises(MethodError, match="num_draft takes a whole number >= 1"):
        build_drafter("pld:num_draft=0", target)
    context = DraftContext(list(range(20)) + [3, 4], 0)  # "3 4" occurred before, followed by 5, 6, ...
    assert build_drafter("pld", target).propose(context).tokens.tolist() == [5, 6, 7]


def test_bench_writes_the_contract(tmp_path, tiny_target_dir):
    import json

    from draftsmith.cli import main

    questions = tmp_path / "q.jsonl"
    questions.write_text(
        "".join(
            json.dumps(q) + "\n"
            for q in [
                {"question_id": 1, "category": "writing", "turns": ["Write a poem about snow.", "Make it shorter."]},
                {"question_id": 2, "category": "math", "turns": ["Two plus two?"]},
                {"question_id": 3, "category": "math", "turns": ["Three times three?"]},
            ]
        )
    )
    out = tmp_path / "bench"
    main(
        [
            "bench",
            "--questions",
            str(questions),
            "--methods",
            "pld",
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--target",
            str(tiny_target_dir),
            "--out",
            str(out),
        ]
    )
    results = json.loads((out / "results.json").read_text())
    assert results["questions"] == 2  # one per category, spread
    for method in ["hf-generate", "none", "pld"]:
        overall = results["methods"][method]["overall"]
        assert {"tau", "speedup", "tokens_per_s", "identical", "total"} <= set(overall)
        assert overall["total"] == 3 and overall["identical"] == 3  # two turns + one turn, all lossless
        # writing and math are MT-bench categories, so they also add up to an mt_bench scope
        assert set(results["methods"][method]) == {"overall", "writing", "math", "mt_bench"}
        assert results["methods"][method]["mt_bench"]["total"] == 3
    assert results["methods"]["none"]["overall"]["tau"] == 1.0
    assert (out / "results.md").read_text().count("| pld |") == 4
    assert results["direct_forward"] is True  # the tiny Llama target: said in the table's header too
    assert "verification forwards direct" in (out / "results.md").read_text()
    head = results["greedy_head"]  # none and pld verify greedily through the screened head
    assert head["rows"] >= 2 * 3 * 11 and 0 <= head["fallback_rows"] <= head["rows"]
    assert "screened int8 head" in (out / "results.md").read_text()
    assert results["native"] is True  # the C++ kernels, said in the header
    assert "contender search in C++" in (out / "results.md").read_text()
    speed = results["read_gb_per_s"]  # passes before the warm-up and after the last question, none between
    assert speed["passes"] == 2 * REPEATS and 0 < speed["min"] <= speed["median"] <= speed["max"]
    assert f"memory read at {speed['median']} GB/s" in (out / "results.md").read_text()
    assert (out / "chart.png").read_bytes()[:4] == b"\x89PNG"
    for method in ["none", "pld"]:  # the runtime's methods time their prompts' forwards; HF generate does not
        overall = results["methods"][method]["overall"]
        assert 0 < overall["prompt_seconds"] < overall["seconds"]
    assert "prompt_seconds" not in results["methods"]["hf-generate"]["overall"]
    assert "After the prompt: the speedup over none" in (out / "results.md").read_text()


def test_the_speedup_after_the_prompt_leaves_out_each_methods_prompt_forwards():
    from draftsmith.inference.measure.bench import BASELINE, RUNTIME_ALONE
    from draftsmith.inference.measure.bench_report import after_the_prompt, markdown_table

    row = {"tau": 1.0, "speedup": 1.0, "tokens_per_s": 10.0, "identical": 1, "total": 1}
    alone = {**row, "seconds": 10.0, "prompt_seconds": 4.0}
    drafted = {**row, "seconds": 7.0, "prompt_seconds": 4.0}
    assert after_the_prompt(alone, drafted) == 2.0  # 6 s of decoding against 3 s: 10/7 = 1.43x overall
    assert after_the_prompt(alone, {**row, "seconds": 7.0}) is None  # a method that did not time its prompts
    assert after_the_prompt(None, drafted) is None
    results = {
        "max_new_tokens": 8,
        "threads": 1,
        "methods": {BASELINE: {"overall": row}, RUNTIME_ALONE: {"overall": alone}, "pld": {"overall": drafted}},
    }
    table = markdown_table(results)
    assert "| pld | overall | 1.00 | 1.00x | 10.0 | 2.00x | 1/1 |" in table
    assert f"| {BASELINE} | overall | 1.00 | 1.00x | 10.0 | - | 1/1 |" in table
    assert "took 40% of none's time" in table


def test_bench_hf_stock_decodes_with_transformers_own_kernels(tmp_path, tiny_target_dir, monkeypatch):
    """The reference runs on the runtime's kernels; hf-stock is generate as transformers ships it: its
    attention is the model's own while it decodes, and it is tallied like every method."""
    import json

    from draftsmith.cli import main
    from draftsmith.inference.kernels.attention import ATTENTION
    from draftsmith.inference.measure import hf_baselines

    seen = []
    stock_call = hf_baselines.StockGenerate.__call__

    def spy(self, prompt, max_new_tokens, eos):
        seen.append(self.model.config._attn_implementation)
        return stock_call(self, prompt, max_new_tokens, eos)

    monkeypatch.setattr(hf_baselines.StockGenerate, "__call__", spy)
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["A poem.", "Shorter."]}) + "\n")
    out = tmp_path / "bench"
    main(["bench", "--questions", str(questions), "--methods", "hf-stock", "--max-new-tokens", "8"]
         + ["--target", str(tiny_target_dir), "--out", str(out)])
    results = json.loads((out / "results.json").read_text())
    assert len(seen) == 2 and ATTENTION not in seen  # one call per turn, never on the runtime's attention
    stock = results["methods"]["hf-stock"]["overall"]
    assert stock["total"] == 2 and stock["tau"] == 1.0 and 0 <= stock["identical"] <= 2
    assert results["native"] is True  # so the reference did run on the runtime's kernels
    assert "hf-stock_compile_seconds" not in results


def test_bench_rejects_a_bad_question_file(tmp_path, tiny_target_dir):
    from draftsmith.inference.measure.bench import read_questions
    from draftsmith.inference.measure.errors import BenchError

    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "turns": ["x"]}\n')
    with pytest.raises(BenchError, match="line 1 is not a Spec-Bench question"):
        read_questions(bad, None, None)
