"""Loads a ``draftsmith export --format speculators`` EAGLE-3 drafter with the ``speculators`` library's
own classes and runs its forward, for tests/test_engine_exports.py.

``speculators`` (PyPI 0.9.0) pins torch and transformers differently from draftsmith, so it lives in
its own venv and this file runs by path with that venv's python; it imports nothing of draftsmith:
``SPECULATORS_PYTHON speculators_worker.py EXPORT_DIR INPUTS.safetensors RESULT_DIR``.

INPUTS: ``hidden_states`` (1, T, layers x h): the target's fused layer states, ``input_ids`` (1, T): the
token each position reads (already shifted: position t reads x_{t+1}), ``position_ids`` (1, T), and
``ttt_steps`` (a 0-d tensor). RESULT_DIR: ``logits.safetensors`` (``step{i}``: the draft head's logits
at each training-time-test step, captured at ``lm_head``; ``d2t``, ``t2d`` as the model holds them)
and ``result.json`` (the config class, the fields it parsed, missing/unexpected weight names, and the
parameters still NaN: speculators initialises unloaded weights to NaN)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(export_dir: str, inputs_path: str, result_dir: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(export_dir)
    # the training forward defaults to flex attention, which wants a compiler; eager is the same maths
    config.transformer_layer_config._attn_implementation = "eager"
    model = SpeculatorModel.from_pretrained(export_dir, config=config).float().eval()
    stored = set(load_file(str(Path(export_dir) / "model.safetensors")))
    never_read = ("verifier_lm_head.", "verifier_norm.")  # the training loss's teacher: loaded from the verifier
    expected = {name for name in model.state_dict() if not name.startswith(never_read)}
    inputs = load_file(inputs_path)
    captured: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, args, output: captured.append(output.detach().clone()))
    with torch.no_grad():
        model(
            hidden_states=inputs["hidden_states"],
            input_ids=inputs["input_ids"],
            document_ids=torch.zeros_like(inputs["input_ids"]),
            position_ids=inputs["position_ids"],
            ttt_steps=int(inputs["ttt_steps"]),
        )
    tensors = {f"step{i}": logits.contiguous() for i, logits in enumerate(captured)}
    for name in ("d2t", "t2d"):
        if getattr(model, name, None) is not None:
            tensors[name] = getattr(model, name).contiguous()
    out = Path(result_dir)
    save_file(tensors, str(out / "logits.safetensors"))
    result = {
        "config_class": type(config).__name__,
        "speculators_model_type": config.speculators_model_type,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": config.eagle_aux_hidden_state_layer_ids,
        "speculative_tokens": config.speculators_config.proposal_methods[0].speculative_tokens,
        "verifier": config.speculators_config.verifier.name_or_path,
        "model_class": type(model).__name__,
        # speculators fills a missing embed_tokens / lm_head from the verifier without a word: compare names
        "missing_keys": sorted(expected - stored),
        "unexpected_keys": sorted(stored - expected),
        "nan_parameters": sorted(
            name
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
            if tensor.is_floating_point() and tensor.isnan().any() and not name.startswith(never_read)
        ),
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
