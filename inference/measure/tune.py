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

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.target import Target
from draftsmith.core.tree import DraftTree, TreeGrowth, admission_order, candidate_depths
from draftsmith.data.default_prompts import held_out_questions
from draftsmith.drafters.base import TreeOptions, top_k_problem
from draftsmith.drafters.eagle import EagleTreeDrafter
from draftsmith.drafters.io import read_drafter_config
from draftsmith.drafters.medusa import DYNAMIC, MedusaTreeDrafter
from draftsmith.drafters.registry import TreeSearch, get_family
from draftsmith.inference.backends import Backends
from draftsmith.inference.context import check_fits_context
from draftsmith.inference.kernels.packed_gemm import CODE_FORMS, PackedGemm
from draftsmith.inference.measure.bench import read_questions
from draftsmith.inference.measure.bench_tree import run_tree_bench
from draftsmith.inference.methods.learned import load_drafter
from draftsmith.inference.methods.lookup import LOOKUP_MAX_NGRAM, WithPromptLookup
from draftsmith.inference.methods.pld import PromptLookupDrafter
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


@dataclass(frozen=True)
class Shape:
    depth: int
    top_k: int
    total_tokens: int
    medusa: bool = False  # Medusa's dynamic tree: depth (heads that run) follows from the budget, not an option
    lookup: int = 0  # a prompt-lookup chain of up to this many tokens grafted onto each tree (lookup=N)

    def options(self) -> TreeOptions:
        if self.medusa:
            return TreeOptions(tree=DYNAMIC, top_k=self.top_k, total_tokens=self.total_tokens)
        return TreeOptions(depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens)

    def entry(self) -> dict[str, Any]:
        """The tree options as ``tuned_trees.json`` and serve-time options name them."""
        options = self.options()
        names = sorted(TreeOptions.names(), key=lambda name: name != "tree")  # Medusa's mode reads first
        entry = {name: getattr(options, name) for name in names if getattr(options, name) is not None}
        return entry | ({"lookup": self.lookup} if self.lookup else {})

    def text(self) -> str:
        return " ".join(f"{name}={value}" for name, value in self.entry().items())


def candidate_count(depth: int, top_k: int) -> int:
    """Candidates an EAGLE-2 growth makes: the root's top_k children, then top_k children for each of
    the top_k frontier nodes at every further level."""
    return top_k + (depth - 1) * top_k * top_k


@dataclass
class PromptRecord:
    """One calibration prompt: its greedy continuation and, per top_k, per round start ``t`` (new
    tokens committed before the round) and per depth d, the admission ranks of the candidates that
    spell ``continuation[t:]`` among the candidates of depth <= d."""

    prompt: list[int]
    continuation: list[int]
    features: torch.Tensor  # the target's features at the prompt and the continuation (drafter input)
    ranks: dict[int, list[list[tuple[int, ...]]]] = field(default_factory=dict)  # [top_k][t][depth - 1]
    # prompt lookup's chain at every round start t (the longest tried), and the admission ranks of the
    # candidates spelling it, as ``ranks`` holds them for the continuation
    chains: list[list[int]] = field(default_factory=list)  # [t]
    chain_ranks: dict[int, list[list[tuple[int, ...]]]] = field(default_factory=dict)  # [top_k][t][depth - 1]

    def accepted(self, shape: Shape, t: int) -> int:
        """Draft tokens a round starting at ``t`` accepts with ``shape`` (greedy): the tree's path along the
        continuation, or the grafted chain's where that runs further (the grafted tree holds both paths)."""
        tree = _admitted(self.ranks[shape.top_k][t][shape.depth - 1], shape)
        if not shape.lookup:
            return tree
        chain = self.chains[t][: shape.lookup]
        matched = next((i for i, (a, b) in enumerate(zip(chain, self.continuation[t:])) if a != b), len(chain))
        return max(tree, min(matched, len(self.continuation) - t))

    def grafted_rows(self, shape: Shape, t: int) -> int:
        """The rows the chain adds to the tree of a round starting at ``t``: its tokens past those the
        tree already holds (:func:`~draftsmith.inference.methods.lookup.graft_chain`)."""
        if not shape.lookup:
            return 0
        chain = self.chains[t][: shape.lookup]
        return len(chain) - min(len(chain), _admitted(self.chain_ranks[shape.top_k][t][shape.depth - 1], shape))


def _admitted(ranks: tuple[int, ...], shape: Shape) -> int:
    """How many of a path's candidates (ranked in admission order, parents first) ``shape``'s tree holds."""
    return sum(1 for rank in ranks if rank < shape.total_tokens)


@dataclass
class CountedRecord:
    """One calibration prompt for drafters whose every tree is drafted at every position (Medusa):
    the accepted draft tokens per shape and round start ``t``."""

    prompt: list[int]
    continuation: list[int]
    features: torch.Tensor
    counts: dict[Shape, list[int]] = field(default_factory=dict)  # [shape][t]

    def accepted(self, shape: Shape, t: int) -> int:
        return self.counts[shape][t]

    def grafted_rows(self, shape: Shape, t: int) -> int:
        return 0  # no chain is grafted onto these trees


def simulate_rounds(
    record: PromptRecord | CountedRecord, shape: Shape | None, max_new_tokens: int, eos: set[int]
) -> list[int]:
    """Tokens committed per verification forward (the runtime's ``accept_lengths``) when decoding the
    prompt with ``shape`` (None: no drafting), as the runtime's loop would."""
    g = record.continuation
    lengths: list[int] = []
    t = 1  # the prefill commits the first token
    done = g[0] in eos or max_new_tokens <= 1
    while not done:
        step = 1 + (record.accepted(shape, t) if shape is not None else 0)
        lengths.append(step)
        end = t + step
        done = any(token in eos for token in g[t : min(end, max_new_tokens)]) or end >= max_new_tokens
        t = end
    return lengths


def round_rows(record: PromptRecord | CountedRecord, shape: Shape | None, lengths: list[int]) -> list[int]:
    """The rows of each round's verification forward (the root, the tree, any grafted chain), for the
    rounds ``simulate_rounds`` gave."""
    rows, t = [], 1
    for length in lengths:
        rows.append(1 + (shape.total_tokens + record.grafted_rows(shape, t) if shape is not None else 0))
        t += length
    return rows


class _FeatureRecorder(Drafter):
    """Drafts nothing; keeps the target's features the runtime hands over (plain decoding's)."""

    wants_features = True

    def __init__(self, feature_layers: tuple[int, ...]) -> None:
        self.feature_layers = feature_layers
        self.features: torch.Tensor | None = None

    def propose(self, context: DraftContext) -> DraftTree:
        self.features = context.features
        return DraftTree.empty()


def greedy_continuation(
    target: Target, prompt: list[int], tokens: int, feature_layers: tuple[int, ...], backends: Backends | None = None
) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding of ``tokens`` tokens past any EOS (a round can accept draft tokens past
    it before the runtime cuts), and the target's features at the prompt and every new token but the
    last two; through ``backends``' kernels (a caller decoding many prompts passes one, so its kernels
    are built once)."""
    recorder = _FeatureRecorder(feature_layers)
    result = generate(target.model, prompt, recorder, max_new_tokens=tokens, eos_token_ids=(), backends=backends)
    return result.tokens, recorder.features


def chain_ranks(growth: TreeGrowth, spelled: Sequence[int], max_depth: int) -> list[tuple[int, ...]]:
    """Per depth d = 1..max_depth: the admission ranks, among the candidates of depth <= d, of the
    candidates spelling ``spelled`` from the root (shallowest first; it stops where none does)."""
    chain = spelled_path(growth.parents, growth.tokens, spelled[:max_depth])
    depths = candidate_depths(growth.parents)
    per_depth = []
    for depth in range(1, max_depth + 1):
        shallow = sum(1 for d in depths if d <= depth)  # growth numbers candidates level by level
        order = admission_order(growth.parents[:shallow], growth.scores[:shallow])
        rank = {candidate: position for position, candidate in enumerate(order)}
        ranks = []
        for node in chain[:depth]:
            if node not in rank:
                break
            ranks.append(rank[node])
        per_depth.append(tuple(ranks))
    return per_depth


def record_prompt(
    target: Target,
    drafters: dict[int, EagleTreeDrafter],
    prompt: list[int],
    max_new_tokens: int,
    max_depth: int,
    backends: Backends | None = None,
    lookup: int = 0,
) -> PromptRecord:
    """The greedy continuation and every top_k's candidate ranks at every round start; with ``lookup``,
    prompt lookup's chain of up to that many tokens there and the ranks of the candidates spelling it."""
    backends = backends or Backends()  # one for the continuation and every drafter: kernels and packs built once
    any_drafter = next(iter(drafters.values()))
    layers = any_drafter.feature_layers
    g, features = greedy_continuation(target, prompt, max_new_tokens + max(max_depth, lookup), layers, backends)
    record = PromptRecord(prompt, g, features)
    looker = PromptLookupDrafter(max_ngram=LOOKUP_MAX_NGRAM, num_draft=lookup) if lookup else None
    contexts = [
        DraftContext(prompt + g[:t], len(prompt), features=features[: len(prompt) + t - 1])
        for t in range(max_new_tokens)
    ]
    record.chains = [looker.propose(context).tokens.tolist() if looker else [] for context in contexts]
    for top_k, drafter in drafters.items():
        per_t: list[list[tuple[int, ...]]] = [[]]  # t = 0 never starts a round
        chains_t: list[list[tuple[int, ...]]] = [[]]
        with _drafting(backends, drafter):
            for t in range(1, max_new_tokens):
                _, growth = drafter.grow(contexts[t])
                per_t.append(chain_ranks(growth, g[t:], max_depth))
                chains_t.append(chain_ranks(growth, record.chains[t], max_depth))
        record.ranks[top_k], record.chain_ranks[top_k] = per_t, chains_t
    return record


def _packed_drafter(backends: Backends, drafter: Drafter) -> PackedGemm | None:
    """``drafter`` with the kernels it drafts with in decoding; its linears' packs, made now (before any
    clock starts, as in decoding)."""
    gemm = backends.drafting_kernels(drafter)
    if gemm is not None:
        gemm.padded_rows(1)
    return gemm


def _drafting(backends: Backends, drafter: Drafter) -> AbstractContextManager[None]:
    """The context in which ``drafter`` proposes what it proposes in decoding through ``backends``."""
    gemm = _packed_drafter(backends, drafter)
    return gemm.rows() if gemm is not None else nullcontext()


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
        gemm = _packed_drafter(backends, drafter)
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
    base: EagleTreeDrafter, target: Target, depths: Sequence[int], top_ks: Sequence[int]
) -> dict[tuple[int, int], Drafter]:
    """One runtime drafter per (depth, top_k): what an EAGLE-2 round costs depends on both."""
    return {(depth, top_k): eagle_growth(base, target, depth, top_k) for top_k in top_ks for depth in depths}


def spelled_path(parents: Sequence[int], tokens: Sequence[int], spelled: Sequence[int]) -> list[int]:
    """The nodes (root's child first) of the tree path spelling a prefix of ``spelled``, as long as one
    does: what greedy verification accepts when ``spelled`` is the target's own continuation."""
    child = {(int(parent), int(token)): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    path, node = [], -1
    for token in spelled:
        node = child.get((node, int(token)), None)
        if node is None:
            break
        path.append(node)
    return path


def record_counted_prompt(
    target: Target,
    base: Drafter,
    prompt: list[int],
    max_new_tokens: int,
    shapes: Sequence[Shape],
    backends: Backends | None = None,
) -> CountedRecord:
    """The greedy continuation, and every shape's accepted length at every round start."""
    backends = backends or Backends()  # one for the continuation and every shape: kernels and packs built once
    depth = max(shape.depth for shape in shapes)
    g, features = greedy_continuation(target, prompt, max_new_tokens + depth, base.feature_layers, backends)
    record = CountedRecord(prompt, g, features)
    for shape in shapes:
        drafter = base.model.runtime_drafter(target.model, shape.options())
        counts = [0]  # t = 0 never starts a round
        with _drafting(backends, drafter):
            for t in range(1, max_new_tokens):
                tokens = prompt + g[:t]
                tree = drafter.propose(DraftContext(tokens, len(prompt), features=features[: len(tokens) - 1]))
                counts.append(len(spelled_path(tree.parents.tolist(), tree.tokens.tolist(), g[t:])))
        record.counts[shape] = counts
    return record


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


def search_space(
    max_depth: int, top_ks: Sequence[int], totals: Sequence[int], lookups: Sequence[int] = (0,)
) -> list[Shape]:
    """Every (depth, top_k, total_tokens) whose budget the growth can fill (a larger budget would
    verify the same tree), with each prompt-lookup chain length in ``lookups``."""
    return [
        Shape(depth, top_k, total, lookup=lookup)
        for lookup in lookups
        for top_k in top_ks
        for depth in range(1, max_depth + 1)
        for total in totals
        if total <= candidate_count(depth, top_k)
    ]


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


def runtime_drafter_for_tune(directory: Path, target: Target, max_depth: int, top_k: int) -> EagleTreeDrafter:
    """The export's EAGLE-2 drafter growing trees of ``max_depth`` levels with ``top_k``."""
    drafter = tune_base(directory, target)
    if family_tree_search(directory) is not TreeSearch.GROWTH:
        raise TuneError(f"{directory} holds a {drafter.name!r} drafter, not an EAGLE-2 one")
    return eagle_growth(drafter, target, max_depth, top_k)


def family_tree_search(directory: Path) -> TreeSearch | None:
    """How tune searches the trees of the export's family (its registry entry's ``tree_search``)."""
    return get_family(read_drafter_config(directory)["drafter_family"]).tree_search


def eagle_growth(base: EagleTreeDrafter, target: Target, depth: int, top_k: int) -> EagleTreeDrafter:
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


def medusa_search_space(heads: int, top_ks: Sequence[int], totals: Sequence[int]) -> list[Shape]:
    """Every dynamic Medusa tree (top_k per head, total_tokens) whose budget the heads can fill."""
    return [
        Shape(min(heads, total), top_k, total, medusa=True)  # a budget of N nodes reaches depth N at most
        for top_k in top_ks
        for total in totals
        if total <= sum(top_k**depth for depth in range(1, heads + 1))
    ]


def parallel_search_space(max_depth: int, top_ks: Sequence[int], totals: Sequence[int]) -> list[Shape]:
    """Every tree of one forward's depths (depth, top_k per depth, total_tokens) whose budget the
    depths can fill and reach: a budget of N nodes never drafts deeper than N."""
    return [
        Shape(depth, top_k, total)
        for top_k in top_ks
        for depth in range(1, max_depth + 1)
        for total in totals
        if depth <= total <= sum(top_k**level for level in range(1, depth + 1))
    ]


@dataclass
class TunePlan:
    """What a family's tune measures: the trees tried, each calibration prompt's record of what they
    accept, one drafter per round cost to time (keyed like ``Prediction``'s drafting costs), and the
    search as recorded in the entry."""

    shapes: list[Shape]
    records: list[PromptRecord] | list[CountedRecord]
    round_drafters: dict[tuple[int, int], Drafter]
    search: dict[str, Any]


def eagle_plan(
    target: Target,
    base: EagleTreeDrafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    max_depth: int,
    top_ks: Sequence[int],
    totals: Sequence[int],
    backends: Backends,
    lookups: Sequence[int] = (0,),
) -> TunePlan:
    drafters = {k: eagle_growth(base, target, max_depth, k) for k in top_ks}
    longest = max(lookups)
    return TunePlan(
        search_space(max_depth, top_ks, totals, lookups),
        [record_prompt(target, drafters, prompt, max_new_tokens, max_depth, backends, longest) for prompt in prompts],
        eagle_drafters_per_round_shape(base, target, range(1, max_depth + 1), top_ks),
        {"max_depth": max_depth, "top_k": list(top_ks), "total_tokens": list(totals), "lookup": list(lookups)},
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


def medusa_plan(
    target: Target,
    base: MedusaTreeDrafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    top_ks: Sequence[int],
    totals: Sequence[int],
    backends: Backends,
) -> TunePlan:
    heads = base.model.config.num_heads
    search = {"heads": heads, "top_k": list(top_ks), "total_tokens": list(totals)}
    return counted_plan(
        target, base, prompts, max_new_tokens, medusa_search_space(heads, top_ks, totals), search, backends
    )


def parallel_plan(
    target: Target,
    base: Drafter,
    prompts: list[list[int]],
    max_new_tokens: int,
    max_depth: int,
    top_ks: Sequence[int],
    totals: Sequence[int],
    backends: Backends,
) -> TunePlan:
    """P-EAGLE, DFlash: one forward gives every depth, so a round costs one drafter forward of ``depth`` rows
    whatever the tree, and each tree's acceptance is counted from its own drafts."""
    depth = min(max_depth, base.model.config.parallel_depths())
    search = {"max_depth": depth, "top_k": list(top_ks), "total_tokens": list(totals)}
    return counted_plan(
        target, base, prompts, max_new_tokens, parallel_search_space(depth, top_ks, totals), search, backends
    )


@dataclass(frozen=True)
class Search:
    """What tune does for one :class:`~draftsmith.drafters.registry.TreeSearch`: the deepest tree it
    tries (given ``--max-depth``) and the plan it measures."""

    deepest: Callable[[Drafter, int], int]
    plan: Callable[..., TunePlan]  # (target, base, prompts, max_new_tokens, max_depth, top_ks, totals, backends)
    grafts_lookup: bool = False  # whether its trees are tried with prompt lookup's chain grafted on (--lookup)


SEARCHES = {
    TreeSearch.GROWTH: Search(lambda base, max_depth: max_depth, eagle_plan, grafts_lookup=True),
    # a Medusa tree is as deep as its heads: --max-depth does not apply
    TreeSearch.HEADS: Search(
        lambda base, max_depth: base.model.config.num_heads,
        lambda target, base, prompts, tokens, max_depth, top_ks, totals, backends: medusa_plan(
            target, base, prompts, tokens, top_ks, totals, backends
        ),
    ),
    # the depths one forward was trained to draft bound the tree
    TreeSearch.PARALLEL: Search(
        lambda base, max_depth: min(max_depth, base.model.config.parallel_depths()), parallel_plan
    ),
}


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


def run_tune(
    directory: Path,
    target: Target,
    questions: Path | None,
    limit: int,
    max_new_tokens: int,
    max_depth: int = 6,
    top_ks: Sequence[int] = DEFAULT_TOP_K,
    totals: Sequence[int] = DEFAULT_TOTAL_TOKENS,
    repeats: int = 5,
    measure_choice: bool = True,
    say=print,
    backends: Backends | None = None,
    lookups: Sequence[int] = DEFAULT_LOOKUP,
) -> dict[str, Any]:
    """Fit the tree, write it into the export's ``tuned_trees.json`` and return the entry written; the
    verification forwards are timed and measured through ``backends`` (default: the default kernels)."""
    directory = Path(directory)
    backends = backends or Backends()
    top_ks, totals = sorted(set(top_ks)), sorted(set(totals))
    if max_depth < 1 or not top_ks or min(top_ks) < 1 or not totals or min(totals) < 1:
        raise TuneError("--max-depth, --top-k and --total-tokens take whole numbers >= 1")
    lookups = sorted(set(lookups))
    if not lookups or min(lookups) < 0:
        raise TuneError("--lookup takes whole numbers >= 0 (0: no prompt-lookup chain)")
    if max_new_tokens < 2:
        raise TuneError(f"--max-new-tokens must be at least 2 for a drafting round to happen; got {max_new_tokens}")
    base = tune_base(directory, target)
    draft_vocab = base.model.config.draft_vocab_limit() or int(target.model.config.vocab_size)
    if problem := top_k_problem(max(top_ks), draft_vocab):  # torch.topk would fail deep in the first recording
        raise TuneError(f"--top-k: {problem}; try smaller values")
    search = SEARCHES[family_tree_search(directory)]
    target = serving_target(base, target)
    depth = search.deepest(base, max_depth)
    prompts = calibration_prompts(target, questions, limit)
    for i, prompt in enumerate(prompts):
        rows = max_new_tokens + depth + max(totals) + max(lookups)
        check_fits_context(target.model, len(prompt), rows, f"calibration prompt {i}")
    say(f"recording the drafter's candidates at every position of {len(prompts)} prompts ({max_new_tokens} tokens)")
    plan = (
        search.plan(target, base, prompts, max_new_tokens, max_depth, top_ks, totals, backends, lookups)
        if search.grafts_lookup
        else search.plan(target, base, prompts, max_new_tokens, max_depth, top_ks, totals, backends)
    )
    shapes, records = plan.shapes, plan.records
    say("timing drafting rounds, and verification forwards per tree size (bench-tree)")
    draft_ms = drafting_ms(plan.round_drafters, records[0], backends)
    sizes = verified_sizes(shapes)
    prefix = int(statistics.fmean(len(p) for p in prompts)) + max_new_tokens // 2
    bench = run_tree_bench(target, sizes, prefix, repeats, backends=backends)
    verify_ms = {row["size"]: row["median_ms"] for row in bench["rows"]}
    eos = set(target.eos_token_ids)
    ranked = predictions(records, verify_ms, draft_ms, shapes, max_new_tokens, eos)
    plain = ranked[0]
    ranked.sort(key=lambda p: -p.tokens_per_s)
    say(table(ranked, plain, 5))
    finalists = [p for p in ranked if p.shape is not None][: FINALISTS if measure_choice else 1]
    measured = {}
    if measure_choice:
        measured = measure_finalists(target, base, records, finalists, plain, max_new_tokens, say, backends)
    best = max(finalists, key=lambda p: measured[p.shape]["tokens_per_s"]) if measured else finalists[0]
    pays = measured[best.shape]["speedup_vs_plain"] > 1 if measured else best.tokens_per_s > plain.tokens_per_s
    if not pays:
        say(f"no tree beats plain decoding on this device; the best, {best.shape.text()}, is recorded anyway")
    entry: dict[str, Any] = {
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
        "calibration": {
            "prompts": len(prompts),
            "questions": str(questions) if questions else "default held-out prompts",
            "max_new_tokens": max_new_tokens,
            "search": plan.search,
            "verify_prefix": prefix,
        },
        "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
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
