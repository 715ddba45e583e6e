"""The releases draftsmith is tested with, and one warning line for a process that runs outside them.

The ranges are ``pyproject.toml``'s, read back from the installed package's metadata, so they are
written in one place. Only the packages whose internals draftsmith patches or mirrors are checked:
transformers (the direct forward, the decoder-layer hooks, the cache layers) and peft (the LoRA
injection); a newer minor release of either can rename what those depend on. ``pip`` keeps users
inside the ranges; the warning is for an environment that was changed afterwards (``--no-deps``, an
upgrade of one package). A warning, not a refusal: an untested release may well work.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

PATCHED_PACKAGES = ("transformers", "peft")

logger = logging.getLogger("draftsmith")


def range_tested(package: str) -> SpecifierSet | None:
    """The range of ``package`` that draftsmith's installed metadata requires (None when draftsmith is
    not installed as a package, or does not require it)."""
    try:
        requirements = metadata.requires("draftsmith") or []
    except metadata.PackageNotFoundError:
        return None
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is None and canonicalize_name(requirement.name) == canonicalize_name(package):
            return requirement.specifier
    return None


def untested_version_message(package: str) -> str | None:
    """One line naming the tested range when the installed ``package`` is outside it, else None."""
    tested = range_tested(package)
    if not tested:
        return None
    installed = metadata.version(package)
    if tested.contains(installed, prereleases=True):
        return None
    shown = _lower_bound_first(tested)
    return (
        f"draftsmith is tested with {package} {shown} but {installed} is installed; "
        f"if training or decoding fails, pip install '{package}{shown}'"
    )


def _lower_bound_first(specifier: SpecifierSet) -> str:
    return ",".join(sorted((str(part) for part in specifier), key=lambda part: not part.startswith(">")))


@functools.cache
def warn_about_untested_versions() -> None:
    """Log one warning line per patched package outside its tested range, once per process (the runtime
    and the trainer call it when they are imported)."""
    for package in PATCHED_PACKAGES:
        message = untested_version_message(package)
        if message is not None:
            logger.warning(message)
