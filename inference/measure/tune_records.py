"""What ``draftsmith tune`` records of each calibration prompt: its greedy continuation and what every
candidate tree would accept along it, read off one growth per top_k (:class:`PromptRecord`) or counted
tree by tree (:class:`CountedRecord`), and the rounds a decode with a tree would make (see
:mod:`~draftsmith.inference.measure.tune` for why this is exact)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.target import Target
from draftsmith.core.tree import DraftTree, TreeGrowth, admission_order, candidate_depths
from draftsmith.drafters.tree_search import Shape
from draftsmith.inference.backends import Backends
from draftsmith.inference.kernels.packed_gemm import PackedGemm
from draftsmith.inference.methods.lookup import LOOKUP_MAX_NGRAM
from draftsmith.inference.methods.pld import PromptLookupDrafter
from draftsmith.inference.runtime import generate


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
    drafters: dict[int, Drafter],
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


def packed_drafter(backends: Backends, drafter: Drafter) -> PackedGemm | None:
    """``drafter`` with the kernels it drafts with in decoding; its linears' packs, made now (before any
    clock starts, as in decoding)."""
    gemm = backends.drafting_kernels(drafter)
    if gemm is not None:
        gemm.padded_rows(1)
    return gemm


def _drafting(backends: Backends, drafter: Drafter) -> AbstractContextManager[None]:
    """The context in which ``drafter`` proposes what it proposes in decoding through ``backends``."""
    gemm = packed_drafter(backends, drafter)
    return gemm.rows() if gemm is not None else nullcontext()


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
