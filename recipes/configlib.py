"""Typed configs: nested dataclasses loaded from YAML, with dotted ``key=value`` overrides.

Unknown keys are rejected by name (with a suggestion), values are checked against the field types, and each
section may define ``validate()`` for its own rules. Strings may contain ``{run_dir}``, filled in from the top
level ``run_dir`` field so that one override moves a whole run.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from eagle.errors import EagleError
from eagle.fileio import write_text_atomic

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (converting where it is lossless) or raise EagleError."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except EagleError as exc:
                errors.append(str(exc))
        names = " or ".join(_type_name(a) for a in args)
        raise EagleError(f"config key '{where}' must be {names}, got {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise EagleError(f"config key '{where}' must be one of {list(get_args(tp))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if isinstance(value, str | int | float):
            value = [value]
        if not isinstance(value, list | tuple):
            raise EagleError(f"config key '{where}' must be a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise EagleError(f"config key '{where}' must be a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise EagleError(f"config section '{where}' must be a mapping, got {value!r}")
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise EagleError(f"config key '{where}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise EagleError(f"config key '{where}' must be an integer, got {value!r}")
    if tp is float:
        number = None
        if isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "5e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
        raise EagleError(f"config key '{where}' must be a finite number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise EagleError(f"config key '{where}' must be a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys by name and checking types."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        full = f"{where}.{key}" if where else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            section = f"section '{where}'" if where else "the top level"
            raise EagleError(
                f"unknown config key '{full}'{hint}; keys allowed in {section}: {', '.join(names)}"
            )
        kwargs[key] = _coerce(value, hints[key], full)
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """A dataclass (possibly nested) as plain YAML-safe data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["train.lr=1e-4", "data.sources=[chitchat]"]`` -> nested dict (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise EagleError(f"override '{item}' is not of the form key=value (e.g. train.lr=1e-4)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise EagleError(f"override '{item}' has an empty key: write section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise EagleError(f"override '{item}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Merge ``extra`` into a copy of ``base`` (mappings merged recursively, other values replaced)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML mapping, with clear errors for missing, unreadable or malformed files."""
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"config file {path} does not exist: pass --config with an existing YAML file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise EagleError(f"config file {path} is not UTF-8 text ({exc}): save it as UTF-8") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise EagleError(
            f"config file {path} is not valid YAML ({what}{where}): fix the syntax there "
            "(the shipped configs/smollm2_demo.yaml is a complete example)"
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise EagleError(
            f"config file {path} must hold a mapping of sections (train:, data:, ...), got "
            f"{type(data).__name__}: see configs/smollm2_demo.yaml for the layout"
        )
    return data


def fill_run_dir(obj: Any, run_dir: str) -> Any:
    """Replace ``{run_dir}`` in every string field of a (nested) dataclass, in place."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, fill_run_dir(getattr(obj, f.name), run_dir))
        return obj
    if isinstance(obj, str):
        return obj.replace("{run_dir}", run_dir)
    if isinstance(obj, list):
        return [fill_run_dir(v, run_dir) for v in obj]
    return obj


def validate_all(obj: Any) -> None:
    """Call ``validate()`` on every (nested) dataclass section that defines it."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        validate_all(getattr(obj, f.name))
    check = getattr(obj, "validate", None)
    if callable(check):
        check()


def write_yaml_atomic(data: dict[str, Any], path: str | os.PathLike) -> None:
    """Write YAML through :func:`eagle.fileio.write_text_atomic` (a crash never leaves half a file)."""
    write_text_atomic(yaml.safe_dump(data, sort_keys=False), path)


def field_help(cls: type) -> dict[str, str]:
    """One line of help per field of dataclass ``cls``: the comment on the field's line, else the comment lines
    just above it (the source is the documentation; fields without a comment get none)."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    for line in lines:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# ").strip())
            continue
        match = _FIELD_RE.match(text)
        if match and match.group(1) in names:
            comment = text.split("  # ", 1)[1].strip() if "  # " in text else " ".join(above)
            if comment:
                out[match.group(1)] = comment.split(". ")[0].rstrip(".")
        above = []
    return out


_FIELD_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:")
