"""Recipes: YAML files turned into typed dataclasses, with ``key.sub=value`` overrides.

A recipe's schema is a tree of dataclasses. Unknown keys and wrongly typed values are errors that
name the key path and the accepted keys, so a typo never silently falls back to a default. The
resolved recipe (file + overrides + defaults) is written next to every run's outputs.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from draftsmith.core.errors import DraftsmithError
from draftsmith.core.io import atomic_write_bytes
from draftsmith.core.text import read_text_file
from draftsmith.drafters.base import check_keys as check_option_keys

T = TypeVar("T")


class RecipeError(DraftsmithError, ValueError):
    """A recipe or override that does not fit the schema; the message names the key."""


def check_keys(section: str, options: dict[str, Any], known: Sequence[str]) -> None:
    """Unknown ``section.KEY`` recipe keys are recipe errors that suggest the key meant."""
    check_option_keys(section, options, known, RecipeError)


def shipped_recipes() -> Path:
    """The folder of YAML recipes and accelerate configs shipped inside the package.

    ``draftsmith.recipes`` holds YAML only (no ``__init__``), so it is a namespace package whose
    search path also carries the editable-install hook; the real folder is the existing directory."""
    import importlib.util

    spec = importlib.util.find_spec("draftsmith.recipes")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    raise RecipeError("the shipped recipes folder is missing from this installation; reinstall draftsmith")


def parse_override(item: str) -> tuple[list[str], Any]:
    """``train.lr=5e-5`` -> (["train", "lr"], 5e-05); values are parsed as YAML scalars/lists."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise RecipeError(f"override {item!r} is not of the form key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, ValueError):  # not YAML, or a value it cannot convert: the schema judges the text
        value = raw
    return key.strip().split("."), value


def apply_overrides(tree: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``tree`` with each override set (intermediate mappings are created as needed;
    whether the key exists is decided by the schema, which reports unknown keys)."""
    import copy

    tree = copy.deepcopy(tree)
    for item in overrides:
        path, value = parse_override(item)
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"override {item!r}: {part} is a value, not a section")
            node = child
        node[path[-1]] = value
    return tree


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, where)
            except RecipeError as error:
                errors.append(str(error))
        raise RecipeError(errors[0])
    if origin is typing.Literal:
        if isinstance(value, bool) and (spelled := "yes" if value else "no") in args:
            value = spelled  # YAML 1.1 reads a bare `no` (as in `mixed_precision: no`) as false
        if value not in args:
            raise RecipeError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise RecipeError(f"{where} must be a section (mapping), got {value!r}")
        return build(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where} must be a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [_convert(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where} must be a mapping, got {value!r}")
        value_type = args[1] if len(args) == 2 else Any
        return {key: _convert(item, value_type, f"{where}.{key}") for key, item in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite(float(value), where)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "5e-5" as a string
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            return _finite(number, where)
    if tp in (int, str, bool, float) and (type(value) is not tp):
        raise RecipeError(f"{where} must be {_type_name(tp)}, got {value!r}")
    return value


def _finite(value: float, where: str) -> float:
    """A recipe number must be one: NaN or infinity in a weight or rate trains garbage without a word."""
    if not math.isfinite(value):
        raise RecipeError(f"{where} must be a finite number, got {value!r}")
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML whose mappings refuse a repeated key: PyYAML keeps the last one silently, so a recipe with two
    ``train:`` sections (or two ``warmup_steps:``) would train with half of what it says."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise RecipeError(f"key {key!r} appears twice (again at line {mark.line + 1}); keep one of them")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def build(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """A ``cls`` dataclass from a mapping; unknown keys and wrong types raise RecipeError."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            path = f"{where}.{key}" if where else key
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise RecipeError(f"unknown recipe key {path!r}{hint} (known keys: {', '.join(fields)})")
    values = {}
    for name, field in fields.items():
        path = f"{where}.{name}" if where else name
        if name in data:
            values[name] = _convert(data[name], hints[name], path)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise RecipeError(f"recipe key {path!r} is required")
    return cls(**values)


def load_recipe(path: Path, schema: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a YAML recipe, apply overrides and build the typed recipe."""
    path = Path(path)
    try:
        text = read_text_file(path, RecipeError)
    except FileNotFoundError:
        raise RecipeError(f"recipe {path} does not exist") from None
    except IsADirectoryError:
        inside = sorted(child.name for child in path.glob("*.yaml"))
        example = f", e.g. {path / inside[0]}" if inside else ""
        raise RecipeError(f"recipe {path} is a folder, not a YAML file; give the recipe file{example}") from None
    try:
        tree = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except RecipeError as exc:
        raise RecipeError(f"recipe {path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise RecipeError(f"recipe {path} is not valid YAML{where}") from None
    except ValueError as exc:  # a value YAML resolves but cannot convert: a 5,000-digit integer, 2020-13-01
        raise RecipeError(
            f"recipe {path} holds a value YAML cannot convert ({str(exc).split(';')[0]}); quote it if it is text"
        ) from None
    if not isinstance(tree, dict):
        raise RecipeError(f"recipe {path} must be a mapping of sections, got {type(tree).__name__}")
    return build(schema, apply_overrides(tree, overrides))


def to_tree(recipe: Any) -> dict[str, Any]:
    """Plain data (tuples as lists) of a built recipe, ready for YAML."""

    def plain(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(recipe))


def save_resolved(recipe: Any, out_dir: Path, name: str = "recipe.resolved.yaml") -> Path:
    """Write the fully resolved recipe next to a run's outputs (atomically)."""
    path = Path(out_dir) / name
    atomic_write_bytes(path, yaml.safe_dump(to_tree(recipe), sort_keys=False).encode())
    return path
