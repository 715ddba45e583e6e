"""A trained drafter's tree with prompt lookup's chain grafted on (``METHOD=DIR:lookup=N``)."""

import pytest
import torch

from conftest import tiny_llama
from draftsmith.core.drafting import DraftContext
from draftsmith.core.target import load_target
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import SamplingConfig
from draftsmith.drafters.io import export_drafter
from draftsmith.drafters.registry import get_family
from draftsmith.inference.methods.errors import MethodError
from draftsmith.inference.methods.lookup import WithPromptLookup, graft_chain
from draftsmith.inference.methods.table import build_drafter
from draftsmith.inference.runtime import generate
from helpers import fused_batch, hf_greedy, serve, train_from_target

VOCAB = 97
EOS = 2
LAYERS = [0, 2, 3]


def test_a_chain_follows_the_trees_nodes_then_grows_its_own():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, -1, 0, 1]))  # 5 -> 7, 6 -> 8
    grafted = graft_chain(tree, [5, 7, 9, 5])
    assert grafted.tokens.tolist() == [5, 6, 7, 8, 9, 5] and grafted.parents.tolist() == [-1, -1, 0, 1, 2, 4]
    assert graft_chain(tree, [6, 8]) is tree  # already in the tree: nothing to add
    assert graft_chain(tree, []) is tree
    fresh = graft_chain(tree, [7, 7])  # a token the tree holds deeper is a new child of the root
    assert fresh.tokens.tolist()[4:] == [7, 7] and fresh.parents.tolist()[4:] == [-1, 4]
    assert graft_chain(DraftTree.empty(), [3, 4]).parents.tolist() == [-1, 0]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(VOCAB, seed=0, num_hidden_layers=5)


@pytest.fixture(scope="module")
def trained_eagle3(target):
    model, _ = train_from_target("eagle3", target, fused_batch(target, VOCAB, LAYERS), 150, aux_layer_ids=LAYERS)
    return model


def repetitive_prompts(n, seed):
    """Prompts that repeat a phrase, so that lookup finds what follows."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        phrase = torch.randint(3, VOCAB, (6,), generator=generator).tolist()
        prompts.append(phrase * 3 + torch.randint(3, VOCAB, (4,), generator=generator).tolist() + phrase[:2])
    return prompts


def test_grafted_lookup_decodes_losslessly_and_adds_accepted_tokens(target, trained_eagle3):
    inner = serve(trained_eagle3, target, depth=2, top_k=2, total_tokens=4)
    grafted = WithPromptLookup(inner, 4)
    tokens = {"inner": 0, "grafted": 0}
    forwards = {"inner": 0, "grafted": 0}
    for prompt in repetitive_prompts(8, seed=3):
        reference = hf_greedy(target, prompt, 24)
        for name, drafter in (("inner", inner), ("grafted", grafted)):
            result = generate(target, prompt, drafter, max_new_tokens=24, eos_token_ids=[EOS])
            assert result.tokens == reference
            tokens[name] += len(result.tokens)
            forwards[name] += result.target_forwards
    assert tokens["grafted"] / forwards["grafted"] > tokens["inner"] / forwards["inner"]


def test_sampled_rounds_verify_the_drafters_own_tree(target, trained_eagle3):
    inner = serve(trained_eagle3, target, depth=2, top_k=2, total_tokens=4)
    prompt = repetitive_prompts(1, seed=5)[0]
    context = DraftContext(prompt, len(prompt), sampling=SamplingConfig(0.8, 20, 0.95))
    proposals = []
    for drafter in (inner, WithPromptLookup(inner, 4)):
        with torch.no_grad():
            hidden = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        context.features = torch.cat([hidden[i][0, :-1] for i in LAYERS], -1)
        context.generator = torch.Generator().manual_seed(0)
        tree = drafter.propose(context)
        proposals.append((tree.tokens.tolist(), tree.parents.tolist()))
    assert proposals[0] == proposals[1]


def test_lookup_is_an_option_of_every_trained_method(tiny_target_dir, tmp_path):
    target = load_target(str(tiny_target_dir))
    export_drafter(get_family("eagle3").build(target.model.config, {}), target.identity.to_dict(), tmp_path / "d")
    drafter = build_drafter(f"eagle3={tmp_path / 'd'}:depth=2:lookup=3", target)
    assert isinstance(drafter, WithPromptLookup) and drafter.lookup.num_draft == 3 and drafter.name == "eagle3"
    assert not isinstance(build_drafter(f"eagle3={tmp_path / 'd'}:lookup=0", target), WithPromptLookup)
    with pytest.raises(MethodError, match="lookup takes a whole number"):
        build_drafter(f"eagle3={tmp_path / 'd'}:lookup=x", target)
