"""Loss masks derived from the chat template: exactly the assistant turns, for two real templates."""

import pytest

from conftest import make_tokenizer
from draftsmith.data.formats import Conversation, RecordError
from draftsmith.data.templates import TemplateError, check_tokenizer, format_masked, tokenize_conversation

TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "Two plus two?"},
    {"role": "assistant", "content": "Two plus two equals four."},
    {"role": "user", "content": "And a poem?"},
    {"role": "assistant", "content": "Sure, here is a short poem about snow."},
]


def supervised_runs(tokenizer, sample):
    """Decoded text of each maximal run of supervised tokens."""
    runs, current = [], []
    for token, masked in zip(sample.input_ids + [None], sample.loss_mask + [0]):
        if masked:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


@pytest.mark.parametrize("fixture, end", [("tokenizer", "<|im_end|>"), ("llama3_tokenizer", "<|eot_id|>")])
def test_mask_covers_every_assistant_turn_and_nothing_else(request, fixture, end):
    tokenizer = request.getfixturevalue(fixture)
    sample = tokenize_conversation(tokenizer, Conversation("x", TURNS))
    expected = [t["content"] + end for t in TURNS if t["role"] == "assistant"]
    assert supervised_runs(tokenizer, sample) == expected
    # Everything unsupervised is template text or user text: no assistant word leaks out of the mask.
    unsupervised = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
    assert "Paris" not in unsupervised and "equals four" not in unsupervised
    assert "What is the capital" in unsupervised
    # input_ids are the template's own tokenisation of the conversation
    rendered = tokenizer.apply_chat_template(TURNS, tokenize=False)
    assert sample.input_ids == tokenizer(rendered, add_special_tokens=False)["input_ids"][: len(sample.input_ids)]


def test_system_turn_is_never_supervised(tokenizer):
    turns = [{"role": "system", "content": "Paris rules."}] + TURNS[:2]
    sample = tokenize_conversation(tokenizer, Conversation("x", turns))
    assert supervised_runs(tokenizer, sample) == ["Paris is the capital of France.<|im_end|>"]


def test_truncation_drops_whole_turns(tokenizer):
    full = tokenize_conversation(tokenizer, Conversation("x", TURNS))
    through_two = tokenize_conversation(tokenizer, Conversation("x", TURNS[:4]))
    cut = tokenize_conversation(tokenizer, Conversation("x", TURNS), max_length=len(full.input_ids) - 1)
    assert cut.input_ids == through_two.input_ids and cut.loss_mask == through_two.loss_mask
    assert cut.dropped_turns == 1 and cut.assistant_turns == 2
    assert supervised_runs(tokenizer, cut)[-1] == "Two plus two equals four.<|im_end|>"
    exact = tokenize_conversation(tokenizer, Conversation("x", TURNS), max_length=len(full.input_ids))
    assert exact.dropped_turns == 0


def test_too_long_first_turn_is_skipped(tokenizer):
    with pytest.raises(RecordError) as info:
        tokenize_conversation(tokenizer, Conversation("x", TURNS), max_length=10)
    assert info.value.reason == "too_long"


def test_template_that_rewrites_history_is_refused():
    # Renders only the last two messages: earlier text changes as the conversation grows.
    tokenizer = make_tokenizer(
        "{% for m in messages[-2:] %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(RecordError) as info:
        tokenize_conversation(tokenizer, Conversation("x", TURNS))
    assert info.value.reason == "template_not_incremental"


def test_template_errors_become_record_errors():
    tokenizer = make_tokenizer("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(RecordError) as info:
        tokenize_conversation(tokenizer, Conversation("x", TURNS))
    assert info.value.reason == "template_error" and "alternate" in str(info.value)


def test_tokenizer_without_template_is_refused(tokenizer):
    bare = make_tokenizer(None)
    with pytest.raises(TemplateError, match="no chat template"):
        check_tokenizer(bare)
    check_tokenizer(tokenizer)


def test_format_masked_marks_supervised_text(tokenizer):
    sample = tokenize_conversation(tokenizer, Conversation("x", TURNS[:2]))
    plain = format_masked(tokenizer, sample.input_ids, sample.loss_mask, color=False)
    assert "⟦Paris is the capital of France.<|im_end|>⟧" in plain
    colored = format_masked(tokenizer, sample.input_ids, sample.loss_mask, color=True)
    assert "\x1b[1;32mParis is the capital of France.<|im_end|>\x1b[0m" in colored


def test_llama3_template_has_one_bos(llama3_tokenizer):
    sample = tokenize_conversation(llama3_tokenizer, Conversation("x", TURNS[:2]))
    bos = llama3_tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert sample.input_ids.count(bos) == 1 and sample.input_ids[0] == bos
