"""How the other engines' bench methods are spelled: ``NAME`` (the engine alone) and ``NAME=DIR[:KEY=N]``
(with the drafter exported for it in DIR, drafting N tokens a step; by default as many as it was exported
with). vLLM's are ``vllm=DIR[:tokens=N]``, llama.cpp's ``llamacpp=DIR[:depth=N]``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineMethodSpelling:
    """One engine's method spelling: its method ``name``, the ``key`` of its draft length, the ``engine`` as
    messages name it, and the ``error`` a spec it cannot run raises."""

    name: str
    key: str
    engine: str
    error: type[Exception]

    def matches(self, spec: str) -> bool:
        return spec == self.name or spec.startswith(self.name + "=")

    def split(self, spec: str) -> tuple[Path, str]:
        """``NAME=DIR[:KEY=N]`` -> (DIR, N as written, empty where it is not given)."""
        location, _, length = spec[len(self.name) + 1 :].partition(f":{self.key}=")
        return Path(location), length

    def draft_length(self, spec: str, length: str, record: dict[str, Any]) -> int:
        """The draft length ``spec`` gives, else the one its export ``record`` was made with."""
        if not length and not record.get("speculative_tokens"):
            raise self.error(
                f"{spec}: the export records no draft length; give one as {spec}:{self.key}=N "
                f"(tokens {self.engine} drafts per step, a whole number >= 1)"
            )
        length = length or str(record["speculative_tokens"])
        if not length.isdigit() or int(length) < 1:
            raise self.error(
                f"{spec}: {self.key}= takes a whole number >= 1 (tokens {self.engine} drafts per step), "
                f"e.g. {self.name}=DIR:{self.key}=3"
            )
        return int(length)
