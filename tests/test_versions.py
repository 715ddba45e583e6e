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


def above_caps_script():
    """CI's report pass (``.ci/above_caps.py``), imported as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("above_caps", REPO / ".ci" / "above_caps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("declared", "uncapped"),
    [
        ("transformers>=5.23,<5.26", "transformers>=5.23"),
        ("peft>=0.21.2,<=0.21.9", "peft>=0.21.2"),
        ("wandb~=0.31.0", "wandb"),
        ("pytest>=9.2,<10; python_version >= '3.11'", 'pytest>=9.2; python_version >= "3.11"'),
    ],
)
def test_the_report_pass_drops_upper_bounds_and_keeps_lower_ones(declared, uncapped):
    assert above_caps_script().without_upper_bound(Requirement(declared)) == uncapped


def test_the_report_pass_holds_torch_at_the_lock_and_lifts_every_other_bound():
    script = above_caps_script()
    requirements = script.uncapped_requirements()
    assert script.locked_release("torch") in requirements
    lifted = [Requirement(line) for line in requirements if not line.startswith("torch==")]
    assert lifted and all(s.operator in (">=", ">") for r in lifted for s in r.specifier)
