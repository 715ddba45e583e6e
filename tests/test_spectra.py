"""SPECTRA-CORE and SPECTRA-RETRIEVAL: dictionaries, pool, tree budget, index file, and losslessness."""

import json
import math
import random

import numpy as np
import pytest
import torch

from conftest import SHARED_DATA, tiny_llama, write_jsonl
from draftsmith.core.drafting import DraftContext
from draftsmith.core.target import TargetError
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import SamplingConfig, Verdict
from draftsmith.inference.methods.spectra import NgramStore, SpectraConfig, SpectraDrafter, node_of_path
from draftsmith.inference.methods.spectra_retrieval import (
    SEPARATOR,
    RetrievalIndex,
    SpectraIndexError,
    build_suffix_array,
    write_index,
)
from draftsmith.inference.runtime import Sampling, generate
from helpers import hf_greedy

VOCAB = 97
EOS = [2]  # the tiny Llama's EOS: HF generate stops there, so the runtime must too


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=0)


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 12))] * (1 + i % 3) for i in range(n)]


def in_memory_index(documents, identity=None):
    tokens = np.asarray([t for doc in documents for t in [*doc, SEPARATOR]], dtype=np.int32)
    meta = {"target": (identity or {"name": "t", "revision": "r", "config_hash": "c", "tokenizer_hash": "k"})}
    return RetrievalIndex(tokens, build_suffix_array(tokens), meta)


# ----------------------------------------------------------------------------- dictionaries
def test_an_ngram_and_all_its_sub_ngrams_enter_both_dictionaries():
    store = NgramStore()
    store.add_ngram([1, 2, 3, 4])
    assert store.forward == {1: [(2, 3, 4)], 2: [(3, 4)], 3: [(4,)]}
    assert store.backward == {(1,): 2, (1, 2): 3, (2,): 3, (1, 2, 3): 4, (2, 3): 4, (3,): 4}


def test_forward_continuations_merge_prefixes_and_keep_the_most_recent():
    store = NgramStore(max_continuations=2)
    store.add_continuation(5, (6,))
    store.add_continuation(5, (6, 7))  # extends (6,): replaces it
    store.add_continuation(5, (8,))
    store.add_continuation(5, (6,))  # a prefix of (6, 7): refreshes it
    assert store.forward[5] == [(8,), (6, 7)]
    assert store.forward_guesses(5) == [[6, 7], [8]]
    store.add_continuation(5, (9, 9))  # over the limit: the oldest goes
    assert store.forward[5] == [(6, 7), (9, 9)]


def test_backward_guess_prefers_the_longest_key_and_stops_at_the_unknown():
    store = NgramStore()
    store.backward.update({(3,): 40, (2, 3): 10, (3, 10): 11, (11,): 12})
    # context ends 2, 3: the 2-token key (2, 3) wins over (3,); then (3, 10) -> 11, (11,) -> 12, then nothing
    assert store.backward_guess([1, 2, 3], length=5, n=3) == [10, 11, 12]
    assert store.backward_guess([1, 2, 3], length=2, n=3) == [10, 11]
    assert store.backward_guess([7], length=5, n=3) == []


def test_the_committed_context_is_indexed_and_drafted_from():
    drafter = SpectraDrafter(SpectraConfig(pool_width=0, max_tree_tokens=None))
    tree = drafter.propose(DraftContext([5, 6, 7, 5, 6], 5))
    assert drafter.store.forward[5] == [(6, 7, 5, 6)] and drafter.store.forward[6] == [(7, 5, 6)]
    # backward: (5, 6) -> 7, (6, 7) -> 5, (5, 6, 7, 5) -> 6, ...; forward[6] = (7, 5, 6) shares the prefix
    assert tree.tokens.tolist() == [7, 5, 6, 7, 5] and tree.parents.tolist() == [-1, 0, 1, 2, 3]


# ----------------------------------------------------------------------------- candidate pool
def pool_logits(tree, best):
    """Logits over [root, nodes] whose argmax at node i is best[i] (second best: best[i] + 1)."""
    logits = torch.zeros(len(tree) + 1, VOCAB)
    for node, token in enumerate(best):
        logits[node + 1, token] = 2.0
        logits[node + 1, (token + 1) % VOCAB] = 1.0
    return logits


def test_pool_sequences_grow_from_the_verification_logits_and_fill_the_dictionaries():
    config = SpectraConfig.paper(ngram=3, pool_width=2, refine=1.0, index_context=False)
    drafter = SpectraDrafter(config)
    drafter.propose(DraftContext([50, 60], 2))
    drafter.pool = [[50], [60]]  # seeded from the prompt; fixed here so the expectations are hand-written
    context = [50, 60]
    for step, offset in enumerate([0, 1]):
        tree = drafter.propose(DraftContext(context, 2))
        best = [0] * len(tree)
        for sequence, first in zip(drafter.pool, [70, 80]):
            best[node_of_path(tree, sequence)] = first + offset  # refine = 1: the plain argmax is taken
        drafter.observe(DraftTree.empty(), pool_logits(tree, best), Verdict([], 1))  # not our tree: ignored
        assert drafter.pool == ([[50], [60]] if step == 0 else [[50, 70], [60, 80]])
        drafter.observe(tree, pool_logits(tree, best), Verdict([], 1))
        context = context + [1]
    # [50] -> [50, 70] -> the full 3-gram [50, 70, 71]: stored with its sub-n-grams, then slid left
    assert drafter.pool == [[70, 71], [80, 81]]
    assert drafter.store.forward[50] == [(70, 71)] and drafter.store.forward[80] == [(81,)]
    assert drafter.store.backward[(50, 70)] == 71 and drafter.store.backward[(60,)] == 80


def test_refine_prefers_a_likely_token_not_yet_a_forward_key():
    drafter = SpectraDrafter(SpectraConfig(refine=0.0))  # r > 0 always: look for an unseen token
    drafter.store.forward[9] = [(1,)]
    row = torch.zeros(VOCAB)
    row[9], row[8], row[7] = 3.0, 2.0, 1.0
    assert drafter._pick_pool_token(row) == 8
    drafter.store.forward.update({8: [(1,)], 7: [(1,)]})
    drafter.config.refine_top_k = 3
    assert drafter._pick_pool_token(row) == 9  # every top-k token is known: fall back to the argmax
    drafter.config.refine = 1.0
    drafter.store.forward.clear()
    assert drafter._pick_pool_token(row) == 9  # refine = 1: always the argmax


def test_the_tree_cap_holds_and_the_pool_rotates():
    config = SpectraConfig(max_tree_tokens=10)
    drafter = SpectraDrafter(config)
    rng = random.Random(0)
    context = [rng.randrange(4, VOCAB) for _ in range(40)] * 2
    placed = set()
    for _ in range(config.pool_width + 1):
        tree = drafter.propose(DraftContext(context, 40))
        assert 0 < len(tree) <= 10 and len(drafter._pool_nodes) <= config.pool_per_round
        placed.update(i for i, _ in drafter._pool_nodes)
        best = [rng.randrange(VOCAB) for _ in range(len(tree))]
        drafter.observe(tree, pool_logits(tree, best), Verdict([], best[0]))
        context = context + [rng.randrange(4, VOCAB)]
    assert placed == set(range(config.pool_width))  # every sequence got its turn under the cap


def test_state_resets_for_a_new_prompt_and_runs_are_reproducible(model):
    drafter = SpectraDrafter()
    first = [generate(model, p, drafter, max_new_tokens=40, eos_token_ids=EOS) for p in prompts(3, seed=5)]
    again = [generate(model, p, drafter, max_new_tokens=40, eos_token_ids=EOS) for p in prompts(3, seed=5)]
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert [r.accept_lengths for r in first] == [r.accept_lengths for r in again]


# ----------------------------------------------------------------------------- losslessness
@pytest.mark.parametrize(
    "config",
    [SpectraConfig(), SpectraConfig.paper(), SpectraConfig(max_tree_tokens=4, ngram=3, pool_width=3)],
    ids=["cpu-default", "paper", "tiny-cap"],
)
def test_greedy_output_is_identical_to_hf_generate(model, config):
    drafter = SpectraDrafter(config)
    forwards = tokens = 0
    for prompt in prompts(8, seed=1):
        truth = hf_greedy(model, prompt, 64)
        result = generate(model, prompt, drafter, max_new_tokens=64, eos_token_ids=EOS)
        assert result.tokens == truth
        forwards, tokens = forwards + result.target_forwards, tokens + len(result.tokens)
    assert tokens / forwards > 1.2  # the tiny model repeats itself: n-grams must pay off


def test_retrieval_guesses_are_used_and_stay_lossless(model):
    cases = prompts(5, seed=2)
    truths = [hf_greedy(model, p, 48) for p in cases]
    rng = random.Random(3)
    noise = [[rng.randrange(4, VOCAB) for _ in range(30)] for _ in range(20)]
    index = in_memory_index(noise + [p[-3:] + t for p, t in zip(cases, truths)])
    plain, retrieval = SpectraDrafter(), SpectraDrafter(retrieval=index)
    gained = 0
    for prompt, truth in zip(cases, truths):
        with_index = generate(model, prompt, retrieval, max_new_tokens=48, eos_token_ids=EOS)
        without = generate(model, prompt, plain, max_new_tokens=48, eos_token_ids=EOS)
        assert with_index.tokens == truth == without.tokens
        gained += without.target_forwards - with_index.target_forwards
    assert gained > 0  # the index knows the answers: fewer target forwards


def test_sampling_runs_and_is_reproducible_with_a_seed(model):
    config = SamplingConfig(temperature=0.8, top_k=20)
    runs = []
    for _ in range(2):
        drafter = SpectraDrafter()
        runs.append(
            [
                generate(
                    model, p, drafter, max_new_tokens=32, sampling=Sampling(config, torch.Generator().manual_seed(7))
                ).tokens
                for p in prompts(3, seed=4)
            ]
        )
    assert runs[0] == runs[1] and all(len(t) == 32 for t in runs[0])
    assert all(0 <= tok < VOCAB for t in runs[0] for tok in t)


# ----------------------------------------------------------------------------- retrieval index
def test_suffix_array_lookup_finds_the_longest_suffix_and_counts_continuations():
    index = in_memory_index([[1, 2, 3, 4], [2, 3, 5], [9, 2, 3, 4, 7]])
    windows = [index._window(int(p), 8) for p in index.suffixes]
    assert windows == sorted(windows) and len(index.suffixes) == 12  # every token, separators excluded
    assert sorted(index.guesses([8, 2, 3], count=5, length=2)) == [[4], [4, 7], [5]]  # cut at document ends
    assert index.guesses([9, 2, 3], count=5, length=3) == [[4, 7]]  # the 3-token match wins
    assert index.guesses([4, 4], count=5, length=3) == [] and index.guesses([8, 2, 3], count=0, length=2) == []
    more = in_memory_index([[2, 3, 4], [2, 3, 4], [2, 3, 6]])
    assert more.guesses([2, 3], count=1, length=1) == [[4]]  # the most frequent continuation first


def test_index_file_round_trip_and_target_check(tmp_path):
    identity = {"name": "a", "revision": "r", "config_hash": "c1", "tokenizer_hash": "k"}
    write_index(tmp_path / "idx.safetensors", [[1, 2, 3], [4, 5]], {"target": identity})
    index = RetrievalIndex.load(tmp_path / "idx.safetensors")
    assert index.tokens.tolist() == [1, 2, 3, -1, 4, 5, -1] and index.identity.config_hash == "c1"
    with pytest.raises(SpectraIndexError, match="does not exist"):
        RetrievalIndex.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not an index")
    with pytest.raises(SpectraIndexError, match="not a SPECTRA index"):
        RetrievalIndex.load(tmp_path / "junk.safetensors")


def corpus_records():
    answers = [
        "Paris is the capital of France.",
        "The quick brown fox jumps over the lazy dog.",
        "Two plus two equals four. Three times three is nine.",
        "zq xv jj kk qq zz",
        "def add(a, b):\n    return a + b\n",
        "Sure, here is a short poem about snow.",
    ]
    return [
        {"conversations": [{"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": text}]}
        for i, text in enumerate(answers)
    ]


def test_index_command_keeps_the_lowest_perplexity_and_decodes_losslessly(tmp_path, tiny_target_dir, capsys):
    from draftsmith.cli import main
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.spectra_retrieval import read_documents

    corpus = write_jsonl(tmp_path / "chat.jsonl", corpus_records())
    out = tmp_path / "index.safetensors"
    main(["spectra-index", str(corpus), "--out", str(out), "--target", str(tiny_target_dir), "--keep", "0.5"])
    assert "kept 3/6 documents" in capsys.readouterr().out
    assert not (tmp_path / "index.safetensors.scores.partial.jsonl").exists()
    target = load_target(str(tiny_target_dir))
    index = RetrievalIndex.load(out, target.identity)
    # independent perplexities: the three lowest are the ones kept
    docs = read_documents(corpus)
    ppl = []
    for text in docs:
        ids = torch.tensor([target.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            ppl.append(math.exp(float(target.model(ids, labels=ids).loss)))
    kept = sorted(sorted(range(len(docs)), key=ppl.__getitem__)[:3])
    expected = [t for i in kept for t in [*target.tokenizer(docs[i], add_special_tokens=False)["input_ids"], -1]]
    assert index.tokens.tolist() == expected and index.meta["kept"] == 3
    outputs = {}
    for method in ["none", f"spectra={out}"]:
        main(
            [
                "generate",
                "Paris is the capital of",
                "--method",
                method,
                "--target",
                str(tiny_target_dir),
                "--max-new-tokens",
                "24",
            ]
        )
        outputs[method] = capsys.readouterr().out
    assert outputs["none"] == outputs[f"spectra={out}"] and outputs["none"].strip()


def test_index_scoring_resumes_from_finished_scores(tmp_path, tiny_target_dir, capsys):
    from draftsmith.cli import main
    from draftsmith.core.target import load_target

    corpus = tmp_path / "docs.txt"
    corpus.write_text("Paris is the capital of France.\n\nzq xv jj kk qq zz\nHello! How can I help you today?\n")
    out = tmp_path / "index.safetensors"
    identity = load_target(str(tiny_target_dir)).identity.to_dict()
    header = {"corpus": str(corpus.resolve()), "documents": 3, "max_length": 512, "target": identity}
    # an interrupted run already scored document 1 (made to look best): it must be reused, not rescored
    partial = tmp_path / "index.safetensors.scores.partial.jsonl"
    partial.write_text(json.dumps(header) + "\n" + json.dumps({"i": 1, "ppl": 1.0e-3}) + "\n")
    main(["spectra-index", str(corpus), "--out", str(out), "--target", str(tiny_target_dir), "--keep", "0.3"])
    assert "kept 1/3 documents" in capsys.readouterr().out
    tokenizer = load_target(str(tiny_target_dir)).tokenizer
    assert RetrievalIndex.load(out).tokens.tolist() == [*tokenizer("zq xv jj kk qq zz")["input_ids"], -1]


def test_an_index_for_another_target_is_refused_in_one_line(tmp_path, tiny_target_dir, other_target_dir, capsys):
    from draftsmith.cli import main
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter

    corpus = tmp_path / "docs.txt"
    corpus.write_text("Paris is the capital of France.\nHello! How can I help you today?\n")
    out = tmp_path / "index.safetensors"
    main(["spectra-index", str(corpus), "--out", str(out), "--target", str(tiny_target_dir)])
    capsys.readouterr()
    with pytest.raises(TargetError, match="built for another target"):
        build_drafter(f"spectra={out}", load_target(str(other_target_dir)))
    with pytest.raises(SystemExit) as info:
        main(["generate", "Hi", "--method", f"spectra={out}", "--target", str(other_target_dir)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("draftsmith: error:")]
    assert info.value.code == 2 and len(errors) == 1 and "built for another target" in errors[0]
    assert "Traceback" not in err
    with pytest.raises(SystemExit):
        fresh = tmp_path / "fresh.safetensors"
        main(["spectra-index", str(tmp_path / "missing.jsonl"), "--out", str(fresh), "--target", str(tiny_target_dir)])
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real target
@pytest.mark.slow
def test_spectra_on_smollm2_is_identical_to_hf_greedy():
    questions = SHARED_DATA / "spec_bench_dev.jsonl"
    if not questions.is_file():
        pytest.skip("spec_bench_dev.jsonl is not available")
    from draftsmith.core.target import load_target
    from draftsmith.inference.methods.table import build_drafter

    target = load_target()
    drafter = build_drafter("spectra", target)
    records = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()][::48][:5]
    for record in records:
        prompt = target.encode_chat([{"role": "user", "content": record["turns"][0]}])
        out = target.model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=32,
            eos_token_id=target.eos_token_ids,
            pad_token_id=target.eos_token_ids[0],
            temperature=None,
            top_p=None,
            top_k=None,
        )
        result = generate(target.model, prompt, drafter, max_new_tokens=32, eos_token_ids=target.eos_token_ids)
        assert result.tokens == out[0, len(prompt) :].tolist()
