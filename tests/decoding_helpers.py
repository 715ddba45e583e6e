"""Helpers shared by the drafter tests: the HF greedy reference, random prompts and self-distilled batches
on the tiny random Llama (whose EOS id is 2)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import DraftTree
from draftsmith.drafters.base import TreeOptions
from draftsmith.inference.measure.bench import hf_greedy as bench_hf_greedy
from draftsmith.train.batch import TrainBatch

TINY_EOS = 2


def seeded_random_tree(nodes: int, seed: int, vocab: int) -> DraftTree:
    """A tree of ``nodes`` random tokens, each node's parent any earlier node or the root."""
    rng = random.Random(seed)
    parents = [rng.randrange(-1, i) for i in range(nodes)]
    return DraftTree(torch.tensor([rng.randrange(vocab) for _ in range(nodes)]), torch.tensor(parents))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | Sequence[int] = TINY_EOS) -> list[int]:
    """What plain greedy decoding produces (``bench``'s reference): every method must reproduce it exactly."""
    return bench_hf_greedy(model, prompt, max_new_tokens, [eos] if isinstance(eos, int) else list(eos))[0]


def serve(model, target, **tree):
    """The runtime drafter of a trained drafter model for ``target``, with serve-time tree options."""
    return model.runtime_drafter(target, TreeOptions(**tree))


def prefill_and_verify(model, prefix: torch.Tensor, tree, cache) -> None:
    """Prefill all of ``prefix`` (1, n) but its last token, then one verification forward over that
    token (the root) and ``tree``: the cache then holds the prefix and every tree row."""
    from draftsmith.core.tree import tree_attention_inputs

    past = prefix.shape[1] - 1
    model(prefix[:, :-1], **cache_kwargs(cache), use_cache=True)
    mask, positions = tree_attention_inputs(tree, past, torch.float32)
    root_and_tree = torch.cat([prefix[:, -1:], tree.tokens[None]], 1)
    model(root_and_tree, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)


def random_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 10))] for _ in range(n)]


def padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask``."""
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq)
        attention[row, : len(seq)] = 1
    return ids, attention


def fit(model: torch.nn.Module, loss_of, steps: int, lr: float = 3e-3) -> list[float]:
    """Full-batch AdamW over ``model``'s parameters on ``loss_of(model).loss``; the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_of(model).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def self_distilled_batch(target, vocab: int, n: int = 16, new_tokens: int = 40, seed: int = 0) -> TrainBatch:
    """The target's own greedy continuations with their features: what self-distillation trains on."""
    ids, attention = padded([p + hf_greedy(target, p, new_tokens) for p in random_prompts(n, seed, vocab)])
    ids, attention = ids.to(target.device), attention.to(target.device)
    with torch.no_grad():
        features = target.model(ids, attention_mask=attention).last_hidden_state
    return TrainBatch(ids, attention.float(), attention, features)


def sampled_twice(target, drafter, prompt: list[int], max_new_tokens: int = 24) -> list[list[int]]:
    """Two sampled generations with the same seed: a drafter must not add randomness of its own."""
    from draftsmith.core.verify import SamplingConfig
    from draftsmith.inference.runtime import generate

    return [
        generate(
            target,
            prompt,
            drafter,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(0.8, 20, 0.95),
            generator=torch.Generator().manual_seed(1),
        ).tokens
        for _ in range(2)
    ]


def prepare_arithmetic_chats(out, target_dir, n: int) -> None:
    """``draftsmith data prepare`` over ``n`` tiny arithmetic conversations for the tiny target."""
    from conftest import sharegpt, write_jsonl
    from draftsmith.train.cli import main

    out.parent.mkdir(parents=True, exist_ok=True)
    records = [
        sharegpt(("human", f"Question {i}: what is {i} plus {i}?"), ("gpt", f"It is {2 * i}. " * (1 + i % 3)))
        for i in range(n)
    ]
    chats = write_jsonl(out.parent / f"{out.name}-chats.jsonl", records)
    main(["data", "prepare", str(chats), "--out", str(out), "--target", str(target_dir), "--max-length", "128"])
