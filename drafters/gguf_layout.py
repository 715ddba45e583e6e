"""llama.cpp's GGUF layout for learned drafters (``draftsmith export --format gguf``).

llama.cpp (the copy the ``llama-cpp-python`` 0.3.36 sdist vendors) serves EAGLE-3 drafters from GGUF files
of architecture ``eagle3`` (``--spec-type draft-eagle3``). A family describes itself in
:meth:`~draftsmith.drafters.base.DrafterModel.llamacpp_layout` (a :class:`LlamaCppDraft`: metadata and
tensors under llama.cpp's names); this module writes the file with the ``gguf`` package (llama.cpp's own
reader and writer). llama.cpp loads a draft's vocabulary from the draft's own file and checks it token by
token against the target's, so the target's ``tokenizer.*`` keys are copied from the target's GGUF, the
file the user serves as ``-m``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from draftsmith.core.io import atomic_directory
from draftsmith.drafters.engine_layouts import EngineLayoutError
from draftsmith.drafters.io import drafter_output_rules

GGUF_FILE = "model.gguf"
GGUF_DTYPES = ("float32", "float16", "bfloat16")  # what `--dtype` stores a GGUF export's matrices as
RECORD_KEY = "draftsmith.export"  # a JSON string: family, format, speculative_tokens, target_identity
TOKENIZER_PREFIX = "tokenizer."

_VALUE_TYPES = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32}


@dataclass
class LlamaCppDraft:
    """A drafter as llama.cpp loads it: ``general.architecture``, the architecture's metadata (keys
    without the ``ARCH.`` prefix), the tensors under llama.cpp's names (matrices as (out, in), as torch
    holds them: GGUF lists the dimensions the other way round), and what the target must match."""

    architecture: str
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    target_vocab_size: int
    target_hidden_size: int
    target_layers: list[int]
    speculative_tokens: int
    required_keys: tuple[str, ...] = ()
    required_tensors: tuple[str, ...] = ()


@dataclass(frozen=True)
class TargetGGUF:
    """What a drafter's GGUF takes from the target's: its tokenizer's keys and the shape they must fit."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    tokenizer: tuple[tuple[str, Any, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]


def llama_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's output rows reordered from transformers' rotate-half RoPE (a head's first
    half pairs with its second) to ggml's, which rotates adjacent pairs: the permutation llama.cpp's own
    converter applies to every Llama-rope model."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_target_gguf(path: Path) -> TargetGGUF:
    """The target's GGUF: its tokenizer keys (copied into the draft's file) and its shape."""
    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as error:
        raise EngineLayoutError(f"cannot read the target GGUF {path}: {error}") from None
    fields = reader.fields

    def value(key: str) -> Any:
        if key not in fields:
            raise EngineLayoutError(f"the target GGUF {path} has no {key}; is it a llama.cpp model file?")
        return fields[key].contents()

    architecture = value("general.architecture")
    tokenizer = tuple(
        (key, item.contents(), item.types[0], item.types[-1] if item.types[0] == gguf.GGUFValueType.ARRAY else None)
        for key, item in fields.items()
        if key.startswith(TOKENIZER_PREFIX)
    )
    return TargetGGUF(
        path=Path(path),
        architecture=architecture,
        vocab_size=len(value("tokenizer.ggml.tokens")),
        hidden_size=int(value(f"{architecture}.embedding_length")),
        num_layers=int(value(f"{architecture}.block_count")),
        tokenizer=tokenizer,
    )


def check_target_fits(draft: LlamaCppDraft, target: TargetGGUF) -> None:
    """The draft reads the target's token embedding, states and vocabulary by position: a target GGUF of
    another shape would load and draft nonsense, so it is refused here."""
    problems = []
    if target.vocab_size != draft.target_vocab_size:
        problems.append(f"{target.vocab_size} tokens, the drafter's target has {draft.target_vocab_size}")
    if target.hidden_size != draft.target_hidden_size:
        problems.append(f"hidden size {target.hidden_size}, the drafter reads {draft.target_hidden_size}")
    if max(draft.target_layers) >= target.num_layers:
        problems.append(f"{target.num_layers} layers, the drafter reads layer {max(draft.target_layers)}")
    if problems:
        raise EngineLayoutError(
            f"the target GGUF {target.path} is not the drafter's target ({'; '.join(problems)}); "
            "pass --verifier with the GGUF of the target it was trained for"
        )


def check_llamacpp_draft(draft: LlamaCppDraft) -> None:
    """Refuse a draft missing a key or tensor llama.cpp's loader requires (one line naming it)."""
    missing = [key for key in draft.required_keys if key not in draft.metadata]
    missing += [name for name in draft.required_tensors if name not in draft.tensors]
    if missing:
        raise EngineLayoutError(f"the gguf export lacks {', '.join(missing)}, which llama.cpp requires; this is a bug")


def stored_array(tensor: torch.Tensor, dtype: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    """A tensor as the file stores it: matrices in ``dtype``; vectors (norms) in float32, as llama.cpp's
    converter keeps them; integer tensors (``d2t``) as they are."""
    tensor = tensor.detach().cpu().contiguous()
    if not tensor.is_floating_point():
        return tensor.numpy(), None
    if tensor.dim() == 1 or dtype == "float32":
        return tensor.float().numpy(), None
    if dtype == "float16":
        return tensor.half().numpy(), None
    # numpy has no bfloat16: the raw bits go in as int16 with the type named
    return tensor.to(torch.bfloat16).view(torch.int16).numpy(), gguf.GGMLQuantizationType.BF16


def add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    else:
        writer.add_key_value(key, value, _VALUE_TYPES[type(value)])


def write_gguf(draft: LlamaCppDraft, target: TargetGGUF, dtype: str, record: dict[str, Any], path: Path) -> None:
    """``draft`` as a GGUF file at ``path``, with ``target``'s tokenizer and ``record`` under :data:`RECORD_KEY`."""
    if dtype not in GGUF_DTYPES:
        raise EngineLayoutError(f"a gguf export stores its weights as {', '.join(GGUF_DTYPES)}, not {dtype}")
    check_llamacpp_draft(draft)
    check_target_fits(draft, target)
    writer = gguf.GGUFWriter(str(path), draft.architecture)
    writer.add_name(f"draftsmith {record['family']} drafter")
    for key, value in draft.metadata.items():
        add_value(writer, f"{draft.architecture}.{key}", value)
    for key, value, value_type, sub_type in target.tokenizer:
        writer.add_key_value(key, value, value_type, sub_type=sub_type)
    writer.add_string(RECORD_KEY, json.dumps(record, sort_keys=True))
    for name, tensor in draft.tensors.items():
        array, raw_dtype = stored_array(tensor, dtype)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def export_gguf(
    model: Any,
    target_gguf: Path,
    speculative_tokens: int | None,
    dtype: str,
    target_identity: dict[str, str],
    out: Path,
    overwrite: bool = False,
    keep: tuple[tuple[str, Path], ...] = (),
) -> Path:
    """The drafter as ``out/model.gguf`` (with the record of files every export writes) for the target
    whose GGUF is ``target_gguf``; a family llama.cpp cannot run is one line from its
    :meth:`llamacpp_layout`."""
    draft = model.llamacpp_layout(speculative_tokens)
    target = read_target_gguf(target_gguf)
    record = {
        "family": model.config.drafter_family,
        "format": "gguf",
        "dtype": dtype,
        "speculative_tokens": draft.speculative_tokens,
        "target_identity": dict(target_identity),
    }
    with atomic_directory(Path(out), overwrite, drafter_output_rules(keep), record_files=True) as staging:
        write_gguf(draft, target, dtype, record, staging / GGUF_FILE)
    return Path(out)


def read_gguf_record(path: Path) -> dict[str, Any] | None:
    """What :func:`write_gguf` recorded in a draft's GGUF (family, format, speculative tokens, target), or
    None for a GGUF draftsmith did not write."""
    try:
        item = gguf.GGUFReader(str(path)).fields.get(RECORD_KEY)
    except (OSError, ValueError):
        return None
    return json.loads(item.contents()) if item is not None else None
