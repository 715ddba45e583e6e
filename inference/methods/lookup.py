"""A drafter's tree with prompt lookup's chain grafted on, verified in one forward (``METHOD=DIR:lookup=N``).

A trained drafter guesses the next tokens from the target's states; prompt lookup copies what followed
the last n-gram earlier in the context. They win in different places: the drafter on free text, lookup
where the answer repeats the prompt or itself (summaries, extraction, code edits), where it proposes
long runs a small tree cannot reach. Grafting lookup's chain onto the drafter's tree costs a few more
rows in the same verification forward and no drafter work. Greedy decoding only: a sampled tree's
nodes carry the distributions they were drawn from, which a copied chain has not, so under sampling
the drafter's own tree is verified unchanged.
"""

from __future__ import annotations

import torch

from draftsmith.core.drafting import DraftContext, Drafter
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import Verdict
from draftsmith.inference.methods.pld import PromptLookupDrafter

LOOKUP_MAX_NGRAM = 3  # prompt lookup's own default


def graft_chain(tree: DraftTree, chain: list[int]) -> DraftTree:
    """``tree`` with ``chain`` hung from the root: the chain follows the tree's own nodes while they hold
    its tokens (a shared prefix adds nothing), and the rest becomes new nodes after the tree's. The
    tree's nodes keep their numbers."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    child = {(parent, token): node for node, (token, parent) in reversed(list(enumerate(zip(tokens, parents))))}
    node, grown = -1, False
    for token in chain:
        if not grown and (node, token) in child:
            node = child[(node, token)]
            continue
        tokens.append(token)
        parents.append(node)
        node, grown = len(tokens) - 1, True
    if not grown:
        return tree
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class WithPromptLookup(Drafter):
    """``inner``'s drafter with a prompt-lookup chain of up to ``num_draft`` tokens grafted onto each
    greedy round's tree (:func:`graft_chain`); every other hook is ``inner``'s."""

    def __init__(self, inner: Drafter, num_draft: int) -> None:
        if num_draft < 1:
            raise ValueError(f"lookup takes a chain of at least 1 token; got {num_draft}")
        self.inner = inner
        self.lookup = PromptLookupDrafter(max_ngram=LOOKUP_MAX_NGRAM, num_draft=num_draft)
        self.name = inner.name
        self.wants_features = inner.wants_features
        self.feature_layers = inner.feature_layers
        self.reads_logits = inner.reads_logits

    def propose(self, context: DraftContext) -> DraftTree:
        tree = self.inner.propose(context)
        if context.sampling is not None:
            return tree
        return graft_chain(tree, self.lookup.propose(context).tokens.tolist())

    def observe(self, tree: DraftTree, logits: torch.Tensor | None, verdict: Verdict) -> None:
        self.inner.observe(tree, logits, verdict)

    def own_modules(self):
        return self.inner.own_modules()

    def use_layer_kernel(self, kernel):
        self.inner.use_layer_kernel(kernel)

    def served_model(self):
        return self.inner.served_model()

    def verifier_model(self):
        return self.inner.verifier_model()

    def verified_rows(self, output):
        return self.inner.verified_rows(output)

    def reference_model(self):
        return self.inner.reference_model()
