"""The tested ranges are pyproject's, and a process outside them hears it in one line when it imports the
runtime or the trainer (a warning, not a refusal); inside them it hears nothing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from draftsmith.core.versions import PATCHED_PACKAGES, range_tested

REPO = Path(__file__).resolve().parents[1]

# Python run in a fresh interpreter: the installed release of one package reads as ``version``.
IMPORT_WITH_VERSION = """
from importlib import metadata
installed = metadata.version
metadata.version = lambda name: {version!r} if name == {package!r} else installed(name)
import {module}
"""


def import_quietly(module: str, package: str = "", version: str = "") -> list[str]:
    """The stderr lines of a fresh interpreter importing ``module`` (``package`` reading as ``version``)."""
    code = IMPORT_WITH_VERSION.format(module=module, package=package, version=version)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines()


@pytest.mark.parametrize("package", PATCHED_PACKAGES)
def test_the_checked_ranges_are_the_ones_pyproject_declares(package):
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    specifiers = {Requirement(line).name: Requirement(line).specifier for line in declared}
    assert range_tested(package) == specifiers[package]  # else reinstall: the metadata is older than pyproject


@pytest.mark.parametrize("module", ["draftsmith.inference.runtime", "draftsmith.train.trainer"])
def test_an_untested_transformers_gets_one_line_naming_the_range(module):
    lines = import_quietly(module, "transformers", "99.0.0")
    tested = range_tested("transformers")
    assert len(lines) == 1, lines
    assert "99.0.0 is installed" in lines[0] and all(str(part) in lines[0] for part in tested), lines


def test_the_tested_releases_import_without_a_word():
    assert import_quietly("draftsmith.train.trainer") == []  # no warning of ours, nor a deprecation from our calls
