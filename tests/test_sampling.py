"""Sampling is lossless: the empirical distribution of the first three tokens under speculative
sampling matches the exact distribution, enumerated on a tiny model; a lossy verifier fails the test."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.drafting import Drafter
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import Verdict
from draftsmith.inference import runtime
from draftsmith.inference.backends import Backends
from draftsmith.inference.kernels.options import KernelOptions
from helpers import N_SAMPLES, SAMPLING_VOCAB, chi_square_p_value, exact_distribution, sample_counts
from helpers import SAMPLING_CONFIGS as CONFIGS


@pytest.fixture(scope="module")
def model():
    model = tiny_llama(SAMPLING_VOCAB, seed=3)
    with torch.no_grad():  # a peaked distribution, far from uniform, so lossy rules show
        model.lm_head.weight.mul_(8.0)
    return model


class FixedTree(Drafter):
    """A deterministic tree with siblings at two depths (recursive rejection over siblings)."""

    name = "fixed-tree"

    def propose(self, context):
        return DraftTree.from_paths([[0, 1], [0, 2], [3, 0], [4]])


class SampledChain(Drafter):
    """Samples a 2-token chain from a fixed distribution q (Leviathan's rule applies)."""

    name = "sampled-chain"

    def __init__(self):
        self.q = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.1])

    def propose(self, context):
        tokens = torch.multinomial(self.q, 2, replacement=True, generator=context.generator).tolist()
        return DraftTree.chain(tokens, self.q.repeat(2, 1))


@pytest.mark.parametrize(
    "drafter, config",
    [
        (None, CONFIGS[1]),
        (FixedTree(), CONFIGS[0]),
        (FixedTree(), CONFIGS[1]),
        (SampledChain(), CONFIGS[0]),
        (SampledChain(), CONFIGS[1]),
    ],
    ids=["plain-t0.7-k4-p0.9", "tree-t1", "tree-t0.7-k4-p0.9", "chain-t1", "chain-t0.7-k4-p0.9"],
)
def test_speculative_sampling_matches_the_exact_distribution(model, drafter, config):
    exact = exact_distribution(model, config)
    assert abs(sum(exact.values()) - 1) < 1e-5
    counts = sample_counts(model, drafter, config, seed=11)
    assert chi_square_p_value(counts, exact, N_SAMPLES) > 1e-3


def test_compiled_verification_samples_the_exact_distribution(model):
    """The compiled path's padded, bucketed forwards (aot_eager here: the same graphs, compiled fast)
    under recursive rejection over siblings at two depths."""
    config = CONFIGS[1]
    backends = Backends(KernelOptions(compiled=True), compile_backend="aot_eager")
    counts = sample_counts(model, FixedTree(), config, seed=12, backends=backends)
    assert chi_square_p_value(counts, exact_distribution(model, config), N_SAMPLES) > 1e-3


def lossy_verify(tree, logits, config, generator=None):
    """A lossy shortcut of the kind some public code ships: accept any drafted child whose
    probability is at least 0.05 ('plausible enough'), else sample."""
    probs = config.probs(logits)
    accepted, current = [], -1
    while True:
        p = probs[current + 1]
        children = [i for i, parent in enumerate(tree.parents.tolist()) if parent == current]
        chosen = next((c for c in children if float(p[int(tree.tokens[c])]) >= 0.05), None)
        if chosen is None:
            return Verdict(accepted, int(torch.multinomial(p, 1, generator=generator)))
        accepted.append(chosen)
        current = chosen


def test_the_test_catches_a_lossy_verifier(model, monkeypatch):
    monkeypatch.setattr(runtime, "verify_sampling", lossy_verify)
    config = CONFIGS[0]
    counts = sample_counts(model, FixedTree(), config, seed=11)
    assert chi_square_p_value(counts, exact_distribution(model, config), N_SAMPLES) < 1e-6
