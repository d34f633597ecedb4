"""From YAML text to typed config dataclasses: strict parsing, overrides and type checks.

`read_yaml` parses with a SafeLoader that refuses duplicate keys (YAML would keep the last one
silently) and turns every YAML error into a ValueError naming the file, line and column.
`apply_override` applies `--section.key=value` (the value parsed as YAML). `build_dataclass`
rejects unknown keys with their dotted path and the known key nearest each ("did you mean ...?"),
and checks every value against its annotation.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping holding the same key twice."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]}): keep only one of them",
                    key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str, source: str) -> Any:
    """Parse `text`; a YAML error becomes a ValueError naming `source`, the line and the column."""
    try:
        return yaml.load(text, Loader=StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error)
        if isinstance(error, yaml.reader.ReaderError):  # a control character: no mark, and a two-line str()
            line_start = text.rfind("\n", 0, error.position) + 1
            where = f", line {text.count(chr(10), 0, error.position) + 1}, column {error.position - line_start + 1}"
            problem = f"unacceptable character #x{error.character:04x} ({error.reason})"
        context = getattr(error, "context", None)
        raise ValueError(f"{source}{where}: {problem}{f' ({context})' if context else ''}: "
                         f"fix the YAML there.") from None


def read_yaml_file(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML config file (empty for an empty file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: byte {error.start} ({error.object[error.start:error.start + 1]!r}) is not UTF-8: "
                         "a config is UTF-8 text; save it as such (is it the file you meant?).") from None
    data = read_yaml(text, str(path)) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections (model:, data:, ...), "
                         f"got {type(data).__name__}.")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `section.key=value` (leading dashes allowed); the value is parsed as YAML."""
    text = override.lstrip("-")
    if "=" not in text:
        raise ValueError(f"override {override!r} must look like --section.key=value.")
    dotted, raw = text.split("=", 1)
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {key} is not a section.")
    node[keys[-1]] = read_yaml(raw, f"override {override!r}") if raw != "" else ""


def check_type(path: str, value: Any, annotation: Any) -> Any:
    """Return `value` if it fits `annotation` (ints are accepted for floats), else raise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return check_type(path, value, option)
            except ValueError:
                pass
        raise ValueError(f"{path}={value!r} has type {type(value).__name__}; expected {type_name(annotation)}.")
    if origin is Literal:
        if value not in typing.get_args(annotation):
            raise ValueError(f"{path}={value!r} is not one of {list(typing.get_args(annotation))}.")
        return value
    if origin is list and isinstance(value, list):  # list[int] (a list of dataclasses is built by build_dataclass)
        return [check_type(f"{path}[{i}]", item, typing.get_args(annotation)[0]) for i, item in enumerate(value)]
    if annotation is type(None):
        if value is None:
            return None
    elif annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, int) and abs(value) > sys.float_info.max:
            raise ValueError(f"{path}={value!r} is too large for a float: give a finite number.")
        return float(value)
    elif annotation is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            pass
    elif annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif annotation in (bool, str) and isinstance(value, annotation):
        return value
    raise ValueError(f"{path}={value!r} has type {type(value).__name__}; expected {type_name(annotation)}.")


def type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return "one of " + str(list(typing.get_args(annotation)))
    if typing.get_origin(annotation) is list:
        return f"a list of {type_name(typing.get_args(annotation)[0])}"
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _did_you_mean(key: Any, names: set[str], prefix: str) -> str:
    """" (did you mean model.num_layers?)" for the known key nearest a misspelt one; "" when none is near."""
    near = difflib.get_close_matches(str(key), sorted(names), n=1)
    return f" (did you mean {prefix}{near[0]}?)" if near else ""


def build_dataclass(cls, data: dict[str, Any], prefix: str):
    """`cls(**data)` with nested sections built alike; unknown keys and wrong types raise ValueError (keys of older
    releases are upgraded before: checkpointing.compatibility.upgrade_run_config)."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(data).__name__}.")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        where = ", ".join(f"{prefix}{k}{_did_you_mean(k, names, prefix)}" for k in unknown)
        raise ValueError(f"unknown config key(s): {where}; known keys here: {', '.join(sorted(names))}.")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = build_dataclass(hint, value, f"{prefix}{name}.")
        elif typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            kwargs[name] = _build_list(typing.get_args(hint)[0], value, f"{prefix}{name}")
        else:
            kwargs[name] = check_type(f"{prefix}{name}", value, hint)
    return cls(**kwargs)


def _build_list(cls, value: Any, path: str) -> list:
    """A list of `cls` entries (e.g. data.blend), each a mapping built and checked like a section."""
    if not isinstance(value, list):
        raise ValueError(f"{path}={value!r} must be a list of mappings, e.g. [{{path: data/web, weight: 0.7}}].")
    return [item if isinstance(item, cls) else build_dataclass(cls, item, f"{path}[{i}].")
            for i, item in enumerate(value)]


_OVERRIDE = re.compile(r"--[A-Za-z_]\w*(\.[A-Za-z_]\w*)+=")  # --section.key=value (the value may hold spaces)


def parse_with_overrides(parser, argv: list[str]):
    """(the parser's arguments, the `--section.key=value` overrides) of a script's command line; anything else
    is refused by the parser's own error. The overrides are taken out first: argparse reads an argument that holds
    a space as a value, so `--resume --data.text_field='a b'` would make the override --resume's step directory."""
    args, others = parser.parse_known_args([a for a in argv if not _OVERRIDE.match(a)])
    overrides = [a for a in argv if _OVERRIDE.match(a) or a in others]  # in their order: the last one wins
    bad = [o for o in overrides if not (o.startswith("--") and "=" in o)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.key=value")
    return args, overrides
