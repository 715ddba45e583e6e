"""The spelling vLLM's and llama.cpp's bench methods share: ``NAME=DIR[:KEY=N]``, each engine naming its own
key and error in a one-line refusal."""

from pathlib import Path

import pytest

from draftsmith.core.vllm_env import VllmError
from draftsmith.inference.measure.llamacpp_engine import SPELLING as LLAMACPP
from draftsmith.inference.measure.llamacpp_engine import LlamaCppError
from draftsmith.inference.measure.vllm_engine import SPELLING as VLLM


def test_a_spec_splits_into_the_directory_and_the_draft_length_written():
    assert VLLM.matches("vllm") and VLLM.matches("vllm=d") and not VLLM.matches("vllmx")
    assert VLLM.split("vllm=out/e3:tokens=4") == (Path("out/e3"), "4")
    assert LLAMACPP.split("llamacpp=out/e3") == (Path("out/e3"), "")
    assert LLAMACPP.split("llamacpp=a:b:depth=2") == (Path("a:b"), "2")


def test_the_draft_length_is_the_one_given_else_the_exports():
    assert VLLM.draft_length("vllm=d:tokens=2", "2", {"speculative_tokens": 5}) == 2
    assert LLAMACPP.draft_length("llamacpp=d", "", {"speculative_tokens": 5}) == 5


ENGINES = [(VLLM, VllmError, "tokens"), (LLAMACPP, LlamaCppError, "depth")]


@pytest.mark.parametrize(("spelling", "error", "key"), ENGINES)
def test_a_draft_length_that_cannot_run_is_refused_in_the_engines_words(spelling, error, key):
    with pytest.raises(error, match=rf"{key}= takes a whole number >= 1 \(tokens {spelling.engine} drafts per step\)"):
        spelling.draft_length(f"{spelling.name}=d:{key}=0", "0", {"speculative_tokens": 5})
    with pytest.raises(error, match=rf"the export records no draft length; give one as {spelling.name}=d:{key}=N"):
        spelling.draft_length(f"{spelling.name}=d", "", {})
