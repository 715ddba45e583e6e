"""Helpers shared by the test modules (no test module imports another): the HF greedy reference, random
prompts and self-distilled batches on the tiny random targets (whose EOS id is 2), the sampling tests'
exact distributions and chi-square test, the trainer tests' recipes, and Speculative Streaming's builders."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith.core.cache_kwarg import cache_kwargs
from draftsmith.core.tree import DraftTree
from draftsmith.core.verify import SamplingConfig
from draftsmith.drafters.base import TreeOptions
from draftsmith.drafters.streaming import StreamingConfig, StreamingModel
from draftsmith.inference.backends import Backends
from draftsmith.inference.kernels.options import KernelOptions
from draftsmith.inference.kernels.packed_gemm import rounded_to_four_bit_blocks
from draftsmith.inference.measure.bench import hf_greedy as bench_hf_greedy
from draftsmith.train.batch import TrainBatch

TINY_EOS = 2

# (family, architecture) pairs that do not work yet, each with the one-line reason: the conformance tests
# expect them to fail (strict, so a fix shows) and no recipe is shipped for them on a named target.
NOT_YET: dict[tuple[str, str], str] = {}


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


def repetitive_prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    """Random prompts whose spans repeat (one to three times): prompt lookup finds something in them."""
    rng = random.Random(seed)
    made = []
    for i in range(n):
        base = [rng.randrange(4, vocab) for _ in range(rng.randint(3, 12))]
        made.append(base * (1 + i % 3))
    return made


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


def fused_batch(target, vocab: int, layers: Sequence[int], **kwargs) -> TrainBatch:
    """A self-distilled batch carrying the target states ``layers`` (what the trainer hands EAGLE-3's loss)."""
    from draftsmith.train.loader import online_features

    batch = self_distilled_batch(target, vocab, **kwargs)
    batch.hidden_states, batch.drafter_states = online_features(target, batch, tuple(layers))
    return batch


def row_invariant_backends() -> Backends:
    """Backends whose linears (the target's and the drafter's) all run the stream kernel, whose rows are
    bitwise row-invariant on every CPU by construction. ``tune`` counts a tree's acceptance from plain
    steps and one-row drafter catch-ups, while decoding verifies and catches up several rows at a time:
    the two agree bit for bit only where a row rounds the same among others. ``--linear auto`` times its
    choice per machine and may take oneDNN, row-invariant on some CPUs only; there a tiny random model's
    near-tied drafts can flip between the two. The drafter's stream packs hold its weights rounded to 4-bit
    codes (``drafter_codes``), so a draft that bypassed them (the default kernel) differs loudly, not by a
    near-tie: tests sharing one of these between tune's record and decoding see it."""
    return Backends(KernelOptions(linear="stream"))


def train_from_target(family_name: str, target, batch: TrainBatch, steps: int, **options):
    """A drafter set up as the trainer sets it up (seeded; draft vocabulary from ``batch``, weights from the
    target) and fitted for ``steps`` full-batch steps of its family's loss: (the model in eval mode, losses)."""
    from draftsmith.drafters.base import FrozenTarget
    from draftsmith.drafters.registry import get_family
    from draftsmith.train.losses import family_loss

    torch.manual_seed(0)
    family = get_family(family_name)
    model = family.build(target.config, options)
    vocab = target.config.vocab_size
    model.fit_data(torch.bincount(batch.input_ids[batch.attention_mask.bool()], minlength=vocab))
    frozen = FrozenTarget.from_model(target)
    model.init_from_target(frozen)
    losses = fit(model, lambda m: family_loss(family)(m, batch, frozen), steps)
    return model.eval(), losses


def sampled_twice(target, drafter, prompt: list[int], max_new_tokens: int = 24) -> list[list[int]]:
    """Two sampled generations with the same seed: a drafter must not add randomness of its own."""
    from draftsmith.inference.runtime import Sampling, generate

    return [
        generate(
            target,
            prompt,
            drafter,
            max_new_tokens=max_new_tokens,
            sampling=Sampling(SamplingConfig(0.8, 20, 0.95), torch.Generator().manual_seed(1)),
        ).tokens
        for _ in range(2)
    ]


def prepare_arithmetic_chats(out, target_dir, n: int) -> None:
    """``draftsmith data prepare`` over ``n`` tiny arithmetic conversations for the tiny target."""
    from conftest import sharegpt, write_jsonl
    from draftsmith.cli import main

    out.parent.mkdir(parents=True, exist_ok=True)
    records = [
        sharegpt(("human", f"Question {i}: what is {i} plus {i}?"), ("gpt", f"It is {2 * i}. " * (1 + i % 3)))
        for i in range(n)
    ]
    chats = write_jsonl(out.parent / f"{out.name}-chats.jsonl", records)
    main(["data", "prepare", str(chats), "--out", str(out), "--target", str(target_dir), "--max-length", "128"])


# ---- sampling: the exact distribution of the first tokens, and Pearson's test against it ------------
SAMPLING_VOCAB = 5
SAMPLING_PROMPT = [1, 3, 2, 4]
N_SAMPLES = 4000
SAMPLING_CONFIGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)]


@torch.no_grad()
def exact_distribution(model, config, prompt: Sequence[int] = SAMPLING_PROMPT, steps: int = 3) -> dict:
    """P(x1..x_steps | prompt) of every sequence the sampling ``config`` can produce, by enumeration
    (top-k and top-p keep the enumeration small on a large vocabulary)."""
    probs = config.probs(model(torch.tensor([list(prompt)])).logits[0, -1:])[0]
    result = {}
    for token in probs.nonzero().flatten().tolist():
        p = float(probs[token])
        if steps == 1:
            result[(token,)] = p
            continue
        for rest, q in exact_distribution(model, config, [*prompt, token], steps - 1).items():
            result[(token, *rest)] = p * q
    return result


def chi_square_p_value(counts: Counter, expected_probs: dict, n: int) -> float:
    """Pearson's test, cells with expected count < 5 pooled (with any sequence outside the enumerated
    support, which must never come out); p-value from the chi-square tail."""
    stat, dof, pool_exp = 0.0, -1, 0.0
    pool_obs = sum(count for cell, count in counts.items() if cell not in expected_probs)
    for cell, prob in expected_probs.items():
        expected, observed = prob * n, counts.get(cell, 0)
        if expected < 5:
            pool_obs, pool_exp = pool_obs + observed, pool_exp + expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / max(pool_exp, 1e-9)
        dof += 1
    assert dof >= 2, "degenerate distribution: the test would have no power"
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(stat / 2.0)))


def sample_counts(
    model, drafter, config, seed, backends=None, prompt=SAMPLING_PROMPT, n: int = N_SAMPLES, steps: int = 3
) -> Counter:
    """How often each sequence of the first ``steps`` tokens comes out of ``n`` sampled generations."""
    from draftsmith.inference.runtime import Sampling, generate

    sampling = Sampling(config, torch.Generator().manual_seed(seed))  # one generator: n different draws
    counts = Counter()
    for _ in range(n):
        result = generate(model, list(prompt), drafter, max_new_tokens=steps, sampling=sampling, backends=backends)
        counts[tuple(result.tokens)] += 1
    return counts


# ---- every family from its shipped recipe, on a tiny target ----------------------------------------
REPO = Path(__file__).resolve().parents[1]
# What a run on a tiny two-layer target needs beyond the shipped recipe: the whole (small) vocabulary,
# stream layers it has. EAGLE-3's default fused layers fit any depth.
WHOLE_VOCABULARY = ["drafter.draft_vocab_size=0"]
TINY_DRAFTER = {
    "eagle": WHOLE_VOCABULARY,
    "fspad": WHOLE_VOCABULARY,
    "eagle3": WHOLE_VOCABULARY,
    "fspad3": WHOLE_VOCABULARY,
    "peagle": WHOLE_VOCABULARY,
    "dflash": WHOLE_VOCABULARY,
    "medusa": WHOLE_VOCABULARY,
    "medusa2": WHOLE_VOCABULARY,
    "streaming": ["drafter.num_stream_layers=1"],
}
NO_SIDE_EFFECTS = ["data.features=null", "tracking.wandb=false"]
CHAT_PROMPTS = ("Question 3: what is 3 plus 3?", "Explain how a rainbow forms.")


def shipped_recipe(family: str) -> Path:
    recipe = {"medusa": "medusa1"}.get(family, family)  # Medusa-1's recipe names its version
    return REPO / "recipes" / f"{recipe}-smollm2.yaml"


def served_model(drafter, target_model):
    """The model whose plain decoding ``drafter``'s output must equal (an adapted copy for the LoRA families)."""
    from contextlib import nullcontext

    return drafter.reference_model() or nullcontext(target_model)


def assert_decodes_like_plain_greedy(target, drafter, new_tokens: int, texts=CHAT_PROMPTS) -> None:
    """Greedy decoding of each chat prompt with ``drafter`` equals the served model's plain greedy decoding."""
    from draftsmith.inference.measure.bench import hf_greedy as plain_greedy
    from draftsmith.inference.runtime import generate

    for text in texts:
        prompt = target.encode_chat([{"role": "user", "content": text}])
        with served_model(drafter, target.model) as served:
            reference, _ = plain_greedy(served, prompt, new_tokens, [])
        assert generate(target.model, prompt, drafter, max_new_tokens=new_tokens).tokens == reference, text


def interrupt_at(monkeypatch, step_index: int) -> None:
    """The trainer dies (as on Ctrl-C) when it starts step ``step_index`` (0-based)."""
    from draftsmith.train.trainer import Trainer

    original = Trainer.train_step

    def train_step(self, step):
        if step == step_index:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", train_step)


# ---- the trainer tests' recipes and metrics ----------------------------------------------------------
def write_recipe(tmp_path: Path, target: Path, prepared: Path, **sections) -> Path:
    """A small FSPAD recipe for ``target`` and ``prepared`` data; ``sections`` override its sections."""
    tree = {
        "target": {"name": str(target)},
        "output_dir": str(tmp_path / "run"),
        "data": {"prepared": str(prepared)},
        "drafter": {"family": "fspad"},
        "loss": {"metric_steps": 2},
        "train": {"lr": 1e-3, "batch_size": 2, "max_steps": 4, "save_every": 2, "log_every": 1, "warmup_steps": 1},
        "tracking": {"wandb": False},
    }
    for name, values in sections.items():
        tree[name] = {**tree.get(name, {}), **values} if isinstance(values, dict) else values
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def losses(run_dir: Path) -> dict[int, float]:
    """The training loss of each logged step of a run."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# ---- Speculative Streaming on its own tiny target ----------------------------------------------------
STREAMING_VOCAB = 120


def streaming_target(seed: int = 0):
    """The streaming tests' four-layer tiny Llama (streams take its top layers)."""
    from conftest import tiny_llama

    return tiny_llama(STREAMING_VOCAB, seed, num_hidden_layers=4, eos_token_id=TINY_EOS)


def streaming_prompts(n: int, seed: int) -> list[list[int]]:
    return random_prompts(n, seed, STREAMING_VOCAB)


def make_streaming(target, lora_noise: float = 0.05, seed: int = 1, **options) -> StreamingModel:
    """A streaming model attached to ``target``, its adapter non-zero so "adapted" and "original" differ."""
    options = {"num_streams": 3, "num_stream_layers": 2, "lora_rank": 4, "lora_alpha": 8, **options}
    torch.manual_seed(seed)
    model = StreamingModel(StreamingConfig.for_target(target.config, **options))
    with torch.no_grad():
        for pair in model.lora.values():
            pair.B.weight.normal_(std=lora_noise)
    model.attach_target(target)
    return model.eval()


def batch_of(seqs: list[list[int]], prompt_lengths: list[int] | None = None) -> TrainBatch:
    """Right-padded; tokens after each prompt are the supervised (assistant) ones."""
    ids, attention = padded(seqs)
    loss_mask = attention.float()
    for row, prompt_length in enumerate(prompt_lengths or []):
        loss_mask[row, :prompt_length] = 0
    return TrainBatch(ids, loss_mask, attention)


def train_streams(target, model, prompts, seqs, steps, lr=1e-2):
    """Full-batch AdamW on the streaming loss over ``seqs`` (prompts unsupervised); every step's output."""
    from draftsmith.train.losses.streaming import streaming_loss

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    batch = batch_of(seqs, [len(p) for p in prompts])
    history = []
    for _ in range(steps):
        out = streaming_loss(model, batch, None)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        history.append(out)
    return model.eval(), history


# ---- hostile inputs (test_hostile*.py) ----


def refused(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """Run ``draftsmith argv``; assert it is refused as a user error; return its one error line."""
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("draftsmith: error:")]
    assert info.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes, to prove nothing was lost or changed."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def generate_argv(drafter: Path, target: Path) -> list:
    return [
        "generate",
        "Write a poem about snow.",
        "--target",
        target,
        "--method",
        f"fspad={drafter}",
        "--max-new-tokens",
        "4",
    ]


def assert_one_drafter_forward_per_round(model, target, trees: list[tuple[int, int]], vocab: int) -> None:
    """Decoding with ``model`` as a chain and as trees (top_k, total_tokens): one forward of the drafter
    per verification round, whatever the tree (the parallel-drafting families' promise)."""
    from draftsmith.inference.runtime import generate

    calls = []
    handle = model.register_forward_hook(lambda *_: calls.append(1))
    try:
        for top_k, total in trees:
            calls.clear()
            drafter = serve(model, target, top_k=top_k, total_tokens=total)
            result = generate(target, random_prompts(1, 3, vocab)[0], drafter, max_new_tokens=30)  # no EOS
            assert len(calls) == len(result.accept_lengths) > 1, (top_k, total)
    finally:
        handle.remove()


def skip_without_avx512() -> None:
    """Skips the test where the runtime's C++ kernels cannot run their AVX-512 code (the CPU lacks it)."""
    from draftsmith.inference.kernels.native import native_extension

    built = native_extension()
    try:
        built.stream_linear(torch.zeros(1, 1), built.stream_pack(torch.zeros(16, 1)), isa="avx512")
    except RuntimeError as error:
        pytest.skip(str(error).splitlines()[0])


def q4_1_dequantised(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in; in a multiple of 32) as a GGUF Q4_1 file holds it, read back as gguf-py reads it:
    per 32 inputs, codes round((w - min) / d) with d = (max - min) / 15, d and min stored as float16, then
    d * code + min in float32 (a product, then a sum)."""
    return rounded_to_four_bit_blocks(weight)  # the runtime's rounding of a drafter's weights is Q4_1's


def q8_0_dequantised(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out, in; in a multiple of 32) as a GGUF Q8_0 file holds it, read back as gguf-py reads it:
    per 32 inputs, int8 codes round(w / d) with d = max |w| / 127 stored as float16, then d * code."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    step = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
    codes = torch.where(step > 0, groups / step, torch.zeros_like(groups)).round().clamp(-128, 127).to(torch.int8)
    return (step * codes.float()).reshape(weight.shape)


def catch_up_split_and_whole(model, target, context, monkeypatch, mlp: torch.nn.Module) -> tuple:
    """The runtime drafters of ``model`` caught up on ``context`` with only its last position through the
    whole layer (the runtime's way for many positions) and with every position through it, and the rows
    ``mlp`` read each way."""
    from draftsmith.drafters import eagle

    rows: list[int] = []
    hook = mlp.register_forward_hook(lambda module, inputs, output: rows.append(inputs[0].shape[-2]))
    try:  # the model is a module fixture: a failed catch-up must not leave the hook on it
        split = serve(model, target)
        split._catch_up(context.tokens, context.features)
        split_rows = list(rows)
        rows.clear()
        monkeypatch.setattr(eagle, "_CONTEXT_ONLY_ROWS", len(context.tokens) + 1)
        whole = serve(model, target)
        whole._catch_up(context.tokens, context.features)
    finally:
        hook.remove()
    return split, whole, split_rows, rows


def assert_same_drafter_state(split, whole, positions: int) -> None:
    """Both drafters hold ``positions`` cached keys and values and the same root, up to float rounding."""
    for a, b in (
        (split._cache.layers[0].keys, whole._cache.layers[0].keys),
        (split._cache.layers[0].values, whole._cache.layers[0].values),
    ):
        assert a.shape[-2] == positions
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(split._root_top[0], whole._root_top[0])  # the root's top log-probabilities
    torch.testing.assert_close(split._last_feature, whole._last_feature)
