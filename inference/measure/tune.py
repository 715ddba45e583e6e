"""``draftsmith tune``: the draft tree that decodes fastest on this device, for EAGLE-2 dynamic trees
(depth, top_k, total_tokens of an eagle, fspad, eagle3 or fspad3 drafter), one-forward trees (the
per-position top-k of a peagle or dflash drafter) and Medusa's dynamic trees (top_k per head,
total_tokens) for Medusa-1 and for Medusa-2, whose served model (the target with its LoRA merged) stands
in for the target throughout: decoded, timed and measured.

Predicted tokens/s of a tree = mean tokens committed per round / (drafting cost + verification cost),
with both costs measured here: the target's verification forward per tree size by ``bench-tree``'s
machinery (:func:`~draftsmith.inference.measure.bench_tree.run_tree_bench`), the drafter's round per depth and
top_k by timing its ``propose``. Plain decoding (one token per 1-token forward) is a candidate too.

How acceptance is measured, and what is exact. Greedy verification accepts the longest path of the
tree that spells the target's own greedy continuation, so a round's accepted length needs no target
forward over the tree: only that continuation and the drafter's candidates. Tune therefore decodes
each calibration prompt once without drafting (its greedy continuation ``g`` and the target's features
at every token) and, for each top_k, grows the drafter's LARGEST tree (max depth) at EVERY position
``t`` of ``g``, recording where the path spelling ``g[t:]`` ranks among the candidates. For a given
top_k the first ``d`` levels of growth do not depend on the depth asked for, and the tree for
``total_tokens = N`` is the first ``N`` candidates of EAGLE-2's best-first admission order
(:func:`~draftsmith.core.tree.admission_order`; a parent always comes before its children). So the
accepted length of every (depth <= max depth, top_k in the list, any total_tokens) at every position
is read off the record, and simulating the rounds (each starts where the previous one's commit ended)
gives each tree's exact sequence of accepted lengths, for greedy decoding:

- exact: depth, top_k and total_tokens, and the round boundaries of a decode with that tree (no
  approximation from another tree's rounds), EOS and the token budget included;
- not modelled: floating-point differences between the features the drafter reads here (the target's
  1-token forwards, the drafter fed one position at a time) and in a tree decode (tree forwards,
  several positions at once) can reorder near-tied candidates; costs outside the two forwards (masks,
  commits, Python) are not in the prediction, which is why the chosen tree is also measured;
- sampling (``--temperature``) acceptance is not predicted: the fitted tree is chosen for greedy.

Medusa's heads read only the last committed feature, so there nothing needs the largest-tree trick:
at every position each candidate tree is drafted as the runtime would and its accepted length along
``g[t:]`` recorded (:class:`CountedRecord`); the rounds are then simulated the same way, equally exact.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.target import Target
from draftsmith.data.default_prompts import held_out_questions
from draftsmith.drafters.base import TreeOptions, top_k_problem
from draftsmith.drafters.io import read_drafter_config
from draftsmith.drafters.registry import get_family
from draftsmith.drafters.tree_search import SearchGrid, Shape, TreeSearch
from draftsmith.inference.backends import Backends
from draftsmith.inference.context import check_fits_context
from draftsmith.inference.kernels.packed_gemm import CODE_FORMS
from draftsmith.inference.measure.bench import read_questions
from draftsmith.inference.measure.bench_tree import run_tree_bench
from draftsmith.inference.measure.tune_records import (
    CountedRecord,
    PromptRecord,
    packed_drafter,
    record_counted_prompt,
    record_prompt,
    round_rows,
    simulate_rounds,
)
from draftsmith.inference.methods.learned import load_drafter
from draftsmith.inference.methods.lookup import WithPromptLookup
from draftsmith.inference.methods.tuned_trees import DeviceKey, weights_sha256, write_tuned_tree
from draftsmith.inference.runtime import generate

DEFAULT_TOP_K = (1, 2, 4, 8)
DEFAULT_TOTAL_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_LOOKUP = (0, 3)  # prompt-lookup chains grafted onto EAGLE-2 trees (0: none)
TIMED_POSITIONS = 12  # drafter rounds timed per (depth, top_k), after one untimed warm-up round
# read before each timed drafting round: in decoding, the target's forward has just streamed its
# weights through the caches, so a round finds the drafter's weights in memory, not in the caches
CACHE_EVICTION_BYTES = 128 << 20


class TuneError(DraftsmithError, ValueError):
    """A drafter or option ``draftsmith tune`` cannot work with."""


def drafting_ms(
    drafters: dict[tuple[int, int], Drafter], record: PromptRecord | CountedRecord, backends: Backends | None = None
) -> dict[tuple[int, int], float]:
    """Median milliseconds of one drafting round (the drafter's catch-up and its tree growth) per key
    (depth, top_k), over consecutive positions of a calibration prompt, with the drafter's linears
    through the kernel ``backends`` gives them in decoding and the caches flushed before each round,
    as a verification forward leaves them in decoding."""
    g, prompt, features = record.continuation, record.prompt, record.features
    backends = backends or Backends()
    eviction = torch.ones(CACHE_EVICTION_BYTES // 4)
    costs = {}
    for key, drafter in drafters.items():
        gemm = packed_drafter(backends, drafter)
        times = []
        for t in range(1, min(TIMED_POSITIONS + 2, len(g))):
            tokens = prompt + g[:t]
            context = DraftContext(tokens, len(prompt), features=features[: len(tokens) - 1])
            eviction.sum()
            start = time.perf_counter()
            with gemm.rows() if gemm is not None else nullcontext():
                drafter.propose(context)
            if t > 1:  # the first round feeds the whole prompt
                times.append(time.perf_counter() - start)
        costs[key] = statistics.median(times) * 1e3
    return costs


def eagle_drafters_per_round_shape(
    base: Drafter, target: Target, depths: Sequence[int], top_ks: Sequence[int]
) -> dict[tuple[int, int], Drafter]:
    """One runtime drafter per (depth, top_k): what an EAGLE-2 round costs depends on both."""
    return {(depth, top_k): eagle_growth(base, target, depth, top_k) for top_k in top_ks for depth in depths}


@dataclass
class Prediction:
    shape: Shape | None  # None: plain decoding
    tokens_per_round: float
    round_ms: float
    draft_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.tokens_per_round / self.round_ms


def predictions(
    records: list[PromptRecord] | list[CountedRecord],
    verify_ms: dict[int, float],
    draft_ms: dict[tuple[int, int], float],
    shapes: list[Shape],
    max_new_tokens: int,
    eos: set[int],
) -> list[Prediction]:
    """Every shape's predicted speed, plain decoding first."""
    out = [Prediction(None, 1.0, verify_ms[1])]
    for shape in shapes:
        lengths, verifying = [], []
        for record in records:
            rounds = simulate_rounds(record, shape, max_new_tokens, eos)
            lengths += rounds
            verifying += [verify_ms[rows] for rows in round_rows(record, shape, rounds)]
        if not lengths:
            continue
        drafting = draft_ms[shape.depth, shape.top_k]
        out.append(Prediction(shape, statistics.fmean(lengths), drafting + statistics.fmean(verifying), drafting))
    return out


def verified_sizes(shapes: Sequence[Shape]) -> list[int]:
    """The verification forwards' sizes the shapes' rounds may take (a grafted chain adds 0 to lookup rows)."""
    return sorted({1} | {1 + shape.total_tokens + extra for shape in shapes for extra in range(shape.lookup + 1)})


def parse_numbers(text: str, option: str, least: int = 1, most: int | None = None) -> list[int]:
    """``1,2,4`` -> [1, 2, 4], each >= ``least`` (and <= ``most``: a tree number's limit, TREE_LIMITS)."""
    try:
        numbers = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        numbers = []
    if not numbers or numbers[0] < least or (most is not None and numbers[-1] > most):
        example = "0,3" if least == 0 else "1,2,4"
        allowed = f"from {least} to {most}" if most is not None else f">= {least}"
        raise TuneError(f"{option} takes comma-separated whole numbers {allowed}, e.g. {example}; got {text!r}")
    return numbers


def calibration_prompts(target: Target, questions: Path | None, limit: int) -> list[list[int]]:
    """First turns of a Spec-Bench-format file, or of the quickstart's held-out default prompts."""
    if questions is not None:
        turns = [q.turns[0] for q in read_questions(questions, None, limit)]
    else:
        turns = [q["turns"][0] for q in held_out_questions(per_category=1)][:limit]
    return [target.encode_chat([{"role": "user", "content": turn}]) for turn in turns]


def runtime_drafter_for_tune(directory: Path, target: Target, max_depth: int, top_k: int) -> Drafter:
    """The export's EAGLE-2 drafter growing trees of ``max_depth`` levels with ``top_k``."""
    drafter = tune_base(directory, target)
    search = family_tree_search(directory)
    if search is None or not search.reads_growth:
        raise TuneError(f"{directory} holds a {drafter.name!r} drafter, not an EAGLE-2 one")
    return eagle_growth(drafter, target, max_depth, top_k)


def family_tree_search(directory: Path) -> TreeSearch | None:
    """How tune searches the trees of the export's family (its registry entry's ``tree_search``)."""
    return get_family(read_drafter_config(directory)["drafter_family"]).tree_search


def eagle_growth(base: Drafter, target: Target, depth: int, top_k: int) -> Drafter:
    """``base``'s model drafting trees of ``depth`` levels with ``top_k`` (tune reads its candidates)."""
    return base.model.runtime_drafter(target.model, TreeOptions(depth=depth, top_k=top_k, total_tokens=1))


def tune_base(directory: Path, target: Target) -> Drafter:
    """The export's runtime drafter, if ``tune`` can fit its tree: a family with a tree search, decoding
    the target itself or a model it serves (Medusa-2 merged, whose model a plain forward stands for)."""
    drafter = load_drafter(directory, target, tree=TreeOptions(total_tokens=1))
    decodes_a_plain_model = drafter.reference_model() is None or drafter.served_model() is not None
    if family_tree_search(directory) is not None and decodes_a_plain_model:
        return drafter
    raise TuneError(
        f"draftsmith tune fits EAGLE-2 dynamic trees (eagle, fspad, eagle3, fspad3 drafters), Medusa's "
        f"dynamic trees (medusa, medusa2) and one-forward trees (peagle, dflash); {directory} holds a {drafter.name!r} "
        "drafter whose drafts come from inside the target's forward or from a target that cannot be served merged here"
    )


def serving_target(base: Drafter, target: Target) -> Target:
    """The target ``base`` decodes: ``target`` itself, or the model it serves instead (Medusa-2's target
    with the LoRA merged). Tune times, records and measures that model, and the heads read its features."""
    return target.with_model(base.served_model() or target.model)


@dataclass
class TunePlan:
    """What a family's tune measures: the trees tried, each calibration prompt's record of what they
    accept, one drafter per round cost to time (keyed like ``Prediction``'s drafting costs), and the
    search as recorded in the entry."""

    shapes: list[Shape]
    records: list[PromptRecord] | list[CountedRecord]
    round_drafters: dict[tuple[int, int], Drafter]
    search: dict[str, Any]


def build_plan(
    search: TreeSearch,
    target: Target,
    base: Drafter,
    prompts: list[list[int]],
    options: TuneOptions,
    backends: Backends,
) -> TunePlan:
    """What tune measures for ``base``'s family: the candidate trees its search gives and their records."""
    grid, config = options.grid(), base.model.config
    shapes, recorded = search.candidates(config, grid), search.recorded(config, grid)
    if search.reads_growth:
        return growth_plan(target, base, prompts, options.max_new_tokens, grid, shapes, recorded, backends)
    return counted_plan(target, base, prompts, options.max_new_tokens, shapes, recorded, backends)


def growth_plan(
    target: Target,
    base: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    grid: SearchGrid,
    shapes: list[Shape],
    search: dict[str, Any],
    backends: Backends,
) -> TunePlan:
    """A plan whose trees' acceptance is read off one growth of the largest tree per top_k (EAGLE-2)."""
    drafters = {k: eagle_growth(base, target, grid.max_depth, k) for k in grid.top_ks}
    longest, depth = max(grid.lookups), grid.max_depth
    return TunePlan(
        shapes,
        [record_prompt(target, drafters, prompt, max_new_tokens, depth, backends, longest) for prompt in prompts],
        eagle_drafters_per_round_shape(base, target, range(1, depth + 1), grid.top_ks),
        search,
    )


def counted_plan(
    target: Target,
    base: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    shapes: list[Shape],
    search: dict[str, Any],
    backends: Backends,
) -> TunePlan:
    """A plan whose trees are each drafted at every position of the calibration decodes (their
    acceptance counted, not read from one growth), timed by the costliest tree of each (depth, top_k)."""
    costliest = {(shape.depth, shape.top_k): shape for shape in shapes}  # budgets ascend: the largest wins
    return TunePlan(
        shapes,
        [record_counted_prompt(target, base, prompt, max_new_tokens, shapes, backends) for prompt in prompts],
        {key: base.model.runtime_drafter(target.model, shape.options()) for key, shape in costliest.items()},
        search,
    )


def rotated(items: list, turn: int) -> list:
    """``items`` starting at position ``turn`` (modulo their count), the rest after them in order."""
    start = turn % len(items) if items else 0
    return items[start:] + items[:start]


@dataclass
class Measured:
    """Real decodes of the calibration prompts, summed."""

    tokens: int = 0
    accepted: int = 0  # tokens committed per verification forward, summed (before the budget cuts)
    rounds: int = 0
    seconds: float = 0.0
    as_predicted: int = 0  # prompts whose rounds committed exactly the predicted lengths

    def add(self, result, predicted: list[int]) -> None:
        self.tokens += len(result.tokens)
        self.accepted += sum(result.accept_lengths)
        self.rounds += len(result.accept_lengths)
        self.seconds += result.seconds - result.prompt_seconds  # after the prompt's forward, as predictions count
        self.as_predicted += result.accept_lengths == predicted

    @property
    def tokens_per_round(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def table(ranked: list[Prediction], plain: Prediction, top: int) -> str:
    lines = [
        "| tree | τ (tokens/round) | draft ms | round ms | predicted tokens/s | vs plain |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    shown = ranked[:top] + ([] if plain in ranked[:top] else [plain])
    for p in shown:
        name = p.shape.text() if p.shape else "plain decoding (no drafter)"
        lines.append(
            f"| {name} | {p.tokens_per_round:.2f} | {p.draft_ms:.1f} | {p.round_ms:.1f} | {p.tokens_per_s:.1f} | "
            f"{p.tokens_per_s / plain.tokens_per_s:.2f}x |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class TuneOptions:
    """What ``draftsmith tune`` calibrates on and searches: its command-line options."""

    questions: Path | None = None  # a Spec-Bench-format file (None: the held-out default prompts)
    limit: int = 4  # calibration prompts
    max_new_tokens: int = 64  # tokens decoded per calibration prompt
    max_depth: int = 6
    top_ks: Sequence[int] = DEFAULT_TOP_K
    totals: Sequence[int] = DEFAULT_TOTAL_TOKENS
    repeats: int = 5  # timings per verification forward size (bench-tree)
    measure_choice: bool = True  # decode the best predicted trees and keep the fastest (else the prediction's)
    lookups: Sequence[int] = DEFAULT_LOOKUP

    def checked(self) -> TuneOptions:
        """These options with each list sorted and deduplicated; a :class:`TuneError` for those tune cannot use."""
        top_ks, totals, lookups = sorted(set(self.top_ks)), sorted(set(self.totals)), sorted(set(self.lookups))
        if self.max_depth < 1 or not top_ks or min(top_ks) < 1 or not totals or min(totals) < 1:
            raise TuneError("--max-depth, --top-k and --total-tokens take whole numbers >= 1")
        if not lookups or min(lookups) < 0:
            raise TuneError("--lookup takes whole numbers >= 0 (0: no prompt-lookup chain)")
        if self.max_new_tokens < 2:
            raise TuneError(
                f"--max-new-tokens must be at least 2 for a drafting round to happen; got {self.max_new_tokens}"
            )
        return dataclasses.replace(self, top_ks=top_ks, totals=totals, lookups=lookups)

    def grid(self) -> SearchGrid:
        return SearchGrid(self.max_depth, self.top_ks, self.totals, self.lookups)


def run_tune(
    directory: Path, target: Target, options: TuneOptions, say=print, backends: Backends | None = None
) -> dict[str, Any]:
    """Fit the tree, write it into the export's ``tuned_trees.json`` and return the entry written; the
    verification forwards are timed and measured through ``backends`` (default: the default kernels)."""
    directory, backends, options = Path(directory), backends or Backends(), options.checked()
    base = tune_base(directory, target)
    draft_vocab = base.model.config.draft_vocab_limit() or int(target.model.config.vocab_size)
    if problem := top_k_problem(max(options.top_ks), draft_vocab):  # torch.topk would fail deep in the first recording
        raise TuneError(f"--top-k: {problem}; try smaller values")
    search = family_tree_search(directory)
    target = serving_target(base, target)
    prompts = calibration_prompts(target, options.questions, options.limit)
    check_prompts_fit(target, prompts, options, search.deepest(base.model.config, options.max_depth))
    say(
        f"recording the drafter's candidates at every position of {len(prompts)} prompts "
        f"({options.max_new_tokens} tokens)"
    )
    plan = build_plan(search, target, base, prompts, options, backends)
    say("timing drafting rounds, and verification forwards per tree size (bench-tree)")
    predicted = predict(target, plan, prompts, options, backends)
    say(table(predicted.ranked, predicted.plain, 5))
    best, finalists, measured = choose(target, base, plan, predicted, options, say, backends)
    plain = predicted.plain
    pays = measured[best.shape]["speedup_vs_plain"] > 1 if measured else best.tokens_per_s > plain.tokens_per_s
    if not pays:
        say(f"no tree beats plain decoding on this device; the best, {best.shape.text()}, is recorded anyway")
    entry = tuned_entry(directory, best, pays, predicted, backends)
    entry["calibration"] = {
        "prompts": len(prompts),
        "questions": str(options.questions) if options.questions else "default held-out prompts",
        "max_new_tokens": options.max_new_tokens,
        "search": plan.search,
        "verify_prefix": predicted.prefix,
    }
    entry["tuned_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if measured:
        say(f"chosen {best.shape.text()}, the fastest in decoding")
        entry["measured"] = measured[best.shape]
        entry["finalists"] = [
            {"tree": p.shape.entry(), "predicted_speedup": p.tokens_per_s / plain.tokens_per_s, **measured[p.shape]}
            for p in finalists
        ]
    key = DeviceKey.current(target.model)
    path = write_tuned_tree(directory, key, entry)
    say(f"wrote the tree for {key.text()} to {path}")
    return entry


def check_prompts_fit(target: Target, prompts: list[list[int]], options: TuneOptions, depth: int) -> None:
    """Every calibration prompt leaves room in the target's context for its decode and the largest tree."""
    for i, prompt in enumerate(prompts):
        rows = options.max_new_tokens + depth + max(options.totals) + max(options.lookups)
        check_fits_context(target.model, len(prompt), rows, f"calibration prompt {i}")


@dataclass
class Predicted:
    """Every tree's predicted speed (``ranked``, fastest first), plain decoding's, and the verification
    timings they were predicted from (bench-tree's result at a context of ``prefix`` tokens)."""

    ranked: list[Prediction]
    plain: Prediction
    bench: dict[str, Any]
    prefix: int


def predict(
    target: Target, plan: TunePlan, prompts: list[list[int]], options: TuneOptions, backends: Backends
) -> Predicted:
    """Time the plan's drafting rounds and the verification forwards of its tree sizes, and predict each
    tree's speed from them and its records."""
    draft_ms = drafting_ms(plan.round_drafters, plan.records[0], backends)
    prefix = int(statistics.fmean(len(p) for p in prompts)) + options.max_new_tokens // 2
    bench = run_tree_bench(target, verified_sizes(plan.shapes), prefix, options.repeats, backends=backends)
    verify_ms = {row["size"]: row["median_ms"] for row in bench["rows"]}
    eos = set(target.eos_token_ids)
    ranked = predictions(plan.records, verify_ms, draft_ms, plan.shapes, options.max_new_tokens, eos)
    plain = ranked[0]
    ranked.sort(key=lambda p: -p.tokens_per_s)
    return Predicted(ranked, plain, bench, prefix)


def choose(
    target: Target,
    base: Drafter,
    plan: TunePlan,
    predicted: Predicted,
    options: TuneOptions,
    say,
    backends: Backends,
) -> tuple[Prediction, list[Prediction], dict[Shape, dict[str, Any]]]:
    """The tree to record, the finalists decoded and what their decodes measured (empty without
    ``measure_choice``: then the best prediction wins)."""
    finalists = [p for p in predicted.ranked if p.shape is not None][: FINALISTS if options.measure_choice else 1]
    if not options.measure_choice:
        return finalists[0], finalists, {}
    measured = measure_finalists(
        target, base, plan.records, finalists, predicted.plain, options.max_new_tokens, say, backends
    )
    return max(finalists, key=lambda p: measured[p.shape]["tokens_per_s"]), finalists, measured


def tuned_entry(
    directory: Path, best: Prediction, pays: bool, predicted: Predicted, backends: Backends
) -> dict[str, Any]:
    """The ``tuned_trees.json`` entry of ``best``: its tree, its prediction and the kernels it was timed with."""
    plain, bench = predicted.plain, predicted.bench
    return {
        "tree": best.shape.entry(),
        "drafting_pays": pays,
        "predicted": {
            "tokens_per_round": best.tokens_per_round,
            "tokens_per_s": best.tokens_per_s,
            "speedup_vs_plain": best.tokens_per_s / plain.tokens_per_s,
            "plain_tokens_per_s": plain.tokens_per_s,
        },
        "weights_sha256": weights_sha256(directory),
        "kernels": {
            **{flag: bool(bench[flag]) for flag in ("native", "greedy_head")},
            "linear": bench["linear"]["kernel"],
            **({"isa": bench["linear"]["isa"]} if "isa" in bench["linear"] else {}),
            "weight_codes": any(form in bench["linear"].get("pack_forms", {}) for form in CODE_FORMS),
            "drafter_codes": backends.options.drafter_codes and backends.options.weight_codes,
        },
    }


# The best predicted trees tune decodes the calibration prompts with before it chooses: a prediction adds
# timings taken apart (bench-tree's forwards, drafting rounds alone), which on a busy or virtual machine can
# miss what a round costs in decoding; the decodes decide.
FINALISTS = 3


def measure_finalists(
    target: Target,
    base: Drafter,
    records: list[PromptRecord] | list[CountedRecord],
    finalists: list[Prediction],
    plain: Prediction,
    max_new_tokens: int,
    say,
    backends: Backends,
) -> dict[Shape, dict[str, Any]]:
    """Decode the calibration prompts without drafting and with each finalist's tree, interleaved prompt by
    prompt (machine noise hits them alike) and each prompt in another order (no place in it favours one),
    after one untimed decode each (a new drafter's first decode builds what it keeps), and compare each
    with its prediction over the decoding after the prompt's forward."""
    drafters = {}
    for finalist in finalists:
        shape = finalist.shape
        drafter = base.model.runtime_drafter(target.model, shape.options())
        drafters[shape] = WithPromptLookup(drafter, shape.lookup) if shape.lookup else drafter
    eos = target.eos_token_ids
    shapes = [None, *drafters]

    def decode(shape: Shape | None, prompt: list[int]):
        drafter = drafters.get(shape)
        return generate(
            target.model, prompt, drafter, max_new_tokens=max_new_tokens, eos_token_ids=eos, backends=backends
        )

    for shape in shapes:
        decode(shape, records[0].prompt)
    runs = {shape: Measured() for shape in shapes}
    for turn, record in enumerate(records):
        for shape in rotated(shapes, turn):
            runs[shape].add(decode(shape, record.prompt), simulate_rounds(record, shape, max_new_tokens, set(eos)))
    without = runs.pop(None)
    found = {}
    for finalist in finalists:
        tree = runs[finalist.shape]
        speedup = tree.tokens_per_s / without.tokens_per_s if without.tokens_per_s else 0.0
        say(
            f"{finalist.shape.text()}: predicted {finalist.tokens_per_round:.2f} tokens/round, "
            f"{finalist.tokens_per_s:.1f} tokens/s ({finalist.tokens_per_s / plain.tokens_per_s:.2f}x plain); "
            f"measured {tree.tokens_per_round:.2f} tokens/round, {tree.tokens_per_s:.1f} tokens/s ({speedup:.2f}x "
            f"the runtime without a drafter, {without.tokens_per_s:.1f} tokens/s); rounds as predicted on "
            f"{tree.as_predicted}/{len(records)} prompts"
        )
        found[finalist.shape] = {
            "tokens_per_round": tree.tokens_per_round,
            "tokens_per_s": tree.tokens_per_s,
            "plain_tokens_per_s": without.tokens_per_s,
            "speedup_vs_plain": speedup,
            "prompts_with_predicted_rounds": tree.as_predicted,
            "prompts": len(records),
        }
    return found
