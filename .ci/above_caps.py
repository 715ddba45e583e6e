"""CI's report pass: the newest releases *above* pyproject's upper bounds.

The blocking passes install within the bounds, so a release that lands above a bound is invisible to
them; this pass looks past the bounds without ever turning CI red by itself. Two commands:

    python .ci/above_caps.py requirements   # pyproject's requirements with upper bounds dropped, one a line
    python .ci/above_caps.py report PASSED  # each installed release against its bound, and what to do

``requirements`` keeps every lower bound and marker and drops ``<`` / ``<=`` / ``==`` / ``~=`` bounds;
the packages in ``HELD`` stay at the lock's release (torch: on the project's machines the releases above
the lock come as CUDA builds of several GB; docs/compatibility.md). ``report`` reads the installed
releases, and says for each one above its bound whether the bound can be lifted (the ``newest`` tests
passed: PASSED is 0) or which releases to suspect (they failed).
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
HELD = ("torch",)
UPPER_BOUNDS = ("<", "<=", "==", "~=")
TIMED_OUT = "124"  # the exit status of `timeout`, which bounds the pass in .ci/run


def declared_requirements(extras: tuple[str, ...] = ("test",)) -> list[Requirement]:
    """pyproject's dependencies and the named extras', as written."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def locked_release(package: str) -> str:
    """``package==X`` as requirements.lock pins it."""
    pattern = re.compile(rf"^{re.escape(package)}==\S+$", re.IGNORECASE | re.MULTILINE)
    found = pattern.search((ROOT / "requirements.lock").read_text())
    if found is None:
        raise SystemExit(f"requirements.lock pins no {package}")
    return found.group(0)


def without_upper_bound(requirement: Requirement) -> str:
    """The requirement with only its lower bounds (and marker) kept."""
    lower = SpecifierSet(",".join(str(s) for s in requirement.specifier if s.operator not in UPPER_BOUNDS))
    marker = f"; {requirement.marker}" if requirement.marker else ""
    return f"{requirement.name}{lower}{marker}"


def uncapped_requirements() -> list[str]:
    return [
        locked_release(r.name) if canonicalize_name(r.name) in HELD else without_upper_bound(r)
        for r in declared_requirements()
    ]


def above_their_bounds() -> list[tuple[str, str, SpecifierSet]]:
    """(package, installed release, declared range) for each installed release its range excludes."""
    found = []
    for requirement in declared_requirements():
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            found.append((requirement.name, installed, requirement.specifier))
    return found


def report(passed: bool) -> None:
    above = above_their_bounds()
    if not above:
        print("above the bounds: nothing newer than pyproject allows is on the package index")
        return
    for name, installed, declared in above:
        if passed:
            print(f"above the bounds: {name} {installed} passed the newest tests; its bound {declared} can be lifted")
        else:
            print(f"above the bounds: {name} {installed} (pyproject: {declared}) is among the suspects")
    if not passed:
        print("above the bounds: the newest tests failed (above); the bounds stay until they pass")


def main(argv: list[str]) -> None:
    if argv[:1] == ["requirements"]:
        print("\n".join(uncapped_requirements()))
    elif len(argv) == 2 and argv[0] == "report" and argv[1] == TIMED_OUT:
        print("above the bounds: the newest tests ran past their time limit; nothing is concluded, the bounds stay")
    elif len(argv) == 2 and argv[0] == "report":
        report(passed=argv[1] == "0")
    else:
        raise SystemExit("usage: above_caps.py requirements | report PYTEST_EXIT_STATUS")


if __name__ == "__main__":
    main(sys.argv[1:])
