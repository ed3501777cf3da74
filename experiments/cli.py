"""Command lines and YAML files derived from a settings model (``experiments/settings.py``).

Every field of the model becomes a ``--kebab-case`` flag (booleans get ``--x / --no-x``, optional values accept
``none``, literals become choices) and a ``snake_case`` YAML key. Values are checked by the model in strict
mode, once, before anything starts: a wrong type, an out-of-range value, an unknown key or malformed YAML is
an error naming the option and, for YAML, the file and line. The command line overrides the ``--config``
file, which overrides the model's defaults; a file may start from another with ``base: OTHER.yaml``.

pydantic (already a dependency of Ray and MLflow) does the typing and validation, so no option is checked by
hand: the model's field declarations are the only place where a type, a bound or a default is written.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from algos.tree_grpo.settings import validated

Sources = dict[str, str]  # field -> the file and line its value came from ("file.yaml:7")


class _Loader(yaml.SafeLoader):
    """YAML as users write it: ``1e-6`` is a number (YAML 1.2, JSON), not the string PyYAML's 1.1 rules make it."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
                              list("-+0123456789."))


def yaml_scalar(text: str) -> Any:
    """A command-line value as YAML reads it (``3``, ``1e-6``, ``true``, ``tree``), ``none`` as None."""
    return None if text.strip().lower() in ("none", "null") else yaml.load(text, Loader=_Loader)


class SettingsError(ValueError):
    """Invalid options: the message names each option (and its file and line) with what is wrong."""


def check_output_directory(path: str | os.PathLike, option: str = "--output") -> None:
    """A ``SettingsError`` naming ``option`` where ``path`` cannot be a directory this process writes in: a file is
    there, or the nearest folder that exists above it is a file or not writable. Found before any work, not when the
    first result is written."""
    target = Path(path).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise SettingsError(f"{option} {path}: a file is there, not a directory")
    existing = next(folder for folder in (target, *target.parents) if folder.exists())
    if not existing.is_dir():
        raise SettingsError(f"{option} {path}: {existing} is a file, so no directory can be made under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SettingsError(f"{option} {path}: {existing} is not writable")


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _optional(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return None if text.lower() == "none" else convert(text)

    parse.__name__ = convert.__name__  # argparse names the type in its error message
    return parse


def _argument(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field's type: int, float, str, Literal[...], list[...], dict[...] (as text) and
    ``X | None``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) < len(
        typing.get_args(annotation))
    if optional:
        annotation = args[0]
    keywords: dict[str, Any] = {}
    if typing.get_origin(annotation) is list:
        keywords["nargs"] = "+"
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is dict:  # given as text, which the model's own validator parses
        annotation = str
    if typing.get_origin(annotation) is typing.Literal:
        keywords["choices"] = list(typing.get_args(annotation))
        annotation = type(keywords["choices"][0])
    keywords["type"] = _optional(annotation) if optional else annotation
    return keywords


def default_of(function: Any, name: str) -> Any:
    """The default of parameter ``name`` of ``function`` (a class: its constructor): declared there, not here."""
    return inspect.signature(function).parameters[name].default


def field_help(description: str, default: Any, also: str | None = None) -> str:
    """An option's help: its ``description`` and its default, once (a description that explains its default,
    ``(default: ...)`` or ``...; default: ...)``, keeps its own words; a default computed by a factory is left to the
    description). ``also``: another default, where it applies, said after the first inside the same parentheses
    (``(default: 1e-06; 0.0005 on a CPU for ...)``)."""
    extra = "" if also is None else f"; {also}"
    at = description.find("(default")
    at = at + 1 if at >= 0 else description.find("default:")
    if at >= 0:  # into the parentheses the description's own default is said in, before the one that closes them
        depth = 0
        for end in range(at, len(description)):
            depth += {"(": 1, ")": -1}.get(description[end], 0)
            if depth < 0:
                return description[:end] + extra + description[end:]
        return description + extra
    if default is PydanticUndefined:
        return description if also is None else f"{description} ({also})"
    return f"{description} (default: {default}{extra})"


def build_parser(model: type[BaseModel], *, description: str | None = None,
                 aliases: dict[str, tuple[str, Any]] | None = None, sections: Mapping[str, str] | None = None,
                 defaults: Mapping[str, Any] | None = None,
                 also: Mapping[str, str] | None = None,
                 descriptions: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """A parser with one option per field of ``model``; every option defaults to "not given" (absent from the
    namespace), so that only what the user typed overrides the file and the defaults.

    ``sections`` (field -> section) groups the options in ``--help``, sections in the order they first appear,
    fields in that mapping's order (fields it does not name go first); ``defaults`` are the defaults the caller
    applies instead of the model's (shown in ``--help``); ``also`` (field -> words) a second default each, where it
    applies, shown beside the first (``field_help``); ``descriptions`` (field -> words) what an option means to this
    command where the field's description does not say it (``argparse.SUPPRESS``: an option it refuses, parsed to
    be refused by name and left out of ``--help``)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", metavar="FILE", help="a YAML file of options (keys as the option names, "
                                                         "snake_case); the command line overrides it")
    sections, defaults, also = dict(sections or {}), dict(defaults or {}), dict(also or {})
    groups = {section: parser.add_argument_group(section) for section in dict.fromkeys(sections.values())}
    by_field: dict[str, list[tuple[str, Any]]] = {}
    for alias, (name, constant) in (aliases or {}).items():
        by_field.setdefault(name, []).append((alias, constant))
    order = [name for name in model.model_fields if name not in sections] + list(sections)
    for name in order:
        field, group = model.model_fields[name], groups.get(sections.get(name), parser)
        description = (descriptions or {}).get(name, field.description or "")
        help_text = (description if description == argparse.SUPPRESS
                     else field_help(description, defaults.get(name, field.default), also.get(name)))
        flags = [flag(name)] + [alias for alias, constant in by_field.get(name, []) if constant is None]
        if field.annotation is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(*flags, dest=name, help=help_text, **_argument(field.annotation))
        for alias, constant in by_field.get(name, []):
            if constant is not None:
                same = (flag(name) if constant else f"--no-{flag(name)[2:]}") if field.annotation is bool \
                    else f"{flag(name)} {constant}"
                group.add_argument(alias, dest=name, action="store_const", const=constant, help=f"same as {same}")
    return parser


def read_yaml(path: str | Path, model: type[BaseModel], _seen: tuple[Path, ...] = ()) -> tuple[dict, Sources]:
    """The options of a YAML file (after its ``base`` file's) and where each came from. Keys are checked against
    ``model``'s fields; values are checked later, with everything else, by ``validate``."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SettingsError(f"--config: no file {path} (expected a YAML mapping of option names to values)")
    if path in _seen:
        raise SettingsError(f"--config {path}: 'base' files include each other in a cycle")
    text = path.read_text(encoding="utf-8")
    try:
        node = yaml.compose(text, Loader=_Loader)
        values = yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise SettingsError(f"{where}: malformed YAML: {problem}") from None
    if values is None:
        return {}, {}
    if not isinstance(values, dict):
        raise SettingsError(f"{path}: expected a YAML mapping of option names to values, got {type(values).__name__}")
    lines = {key.value: key.start_mark.line + 1 for key, _ in node.value}
    options, sources = {}, {}
    base = values.pop("base", None)
    if base is not None:
        options, sources = read_yaml(path.parent / str(base), model, (*_seen, path))
    for key, value in values.items():
        name = str(key).replace("-", "_")
        where = f"{path}:{lines.get(key, '?')}"
        if name not in model.model_fields:
            near = difflib.get_close_matches(name, model.model_fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known: base, {', '.join(model.model_fields)}"
            raise SettingsError(f"{where}: unknown option {key!r}{hint}")
        options[name], sources[name] = value, where
    return options, sources


def validate(model: type[BaseModel], values: dict[str, Any], sources: Sources | None = None) -> BaseModel:
    """``model`` from ``values``, strictly; a ``SettingsError`` naming every wrong option otherwise."""
    try:
        return validated(model, values, sources)
    except ValueError as error:
        raise SettingsError(str(error)) from None


def given_options(model: type[BaseModel], namespace: argparse.Namespace) -> tuple[dict, Sources]:
    """The options the user gave (a parsed ``build_parser(model)`` namespace), from its ``--config`` file and
    the command line (which wins), with their sources."""
    values, sources = {}, {}
    config = getattr(namespace, "config", None)
    if config:
        values, sources = read_yaml(config, model)
    for name in model.model_fields:
        if hasattr(namespace, name):  # the command line wins; its errors name the option alone
            values[name] = getattr(namespace, name)
            sources.pop(name, None)
    return values, sources


def dump_yaml(settings: BaseModel, path: Path, header: str = "") -> None:
    """Every field of ``settings`` as a YAML file that ``--config`` reads back to the same settings."""
    text = yaml.safe_dump(settings.model_dump(), sort_keys=False)
    path.write_text(header + text, encoding="utf-8")
