"""One config convention for every component: a dataclass whose fields carry a docstring (the string literal right
below the field) and a ``Literal`` where the values are a fixed set. Command-line flags are generated from it
(:func:`add_dataclass_args`: names, types, choices, defaults and help) and read back into it
(:func:`config_from_namespace`), and the Hydra YAML groups are generated from it (:func:`yaml_mirror`, written by
recipes/mirrors.py), so a field is written once. Pure Python, nothing on import.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from typing import Any


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass, read from its source (attribute docstrings exist only there)."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    if not isinstance(node, ast.ClassDef):
        raise TypeError(f"field_docs: {cls!r} is not a class")
    docs: dict[str, str] = {}
    for stmt, nxt in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _first_sentence(text: str) -> str:
    """Up to the first period that a capital or a literal (``x``) follows: "(Alg. 5.2)" and "Fig. 5.9" go on."""
    head = re.split(r"(?<=\.)\s+(?=[A-Z`])", text, maxsplit=1)[0].rstrip(".")
    return head.replace("%", "%%")  # argparse formats help with %


def add_dataclass_args(
    group: Any,
    cls: type,
    prefix: str,
    *,
    skip: tuple[str, ...] = (),
    overrides: dict[str, dict[str, Any]] | None = None,
    flags: dict[str, str] | None = None,
) -> None:
    """One ``--<prefix><field>`` flag per field of dataclass ``cls`` on ``group`` (a parser or argument group):
    ``Literal`` fields get choices, ``bool`` fields ``--x/--no-x``, ``tuple[str, ...]`` fields a comma-separated
    string; the default is the dataclass's, the help the first sentence of the field's docstring. ``overrides``
    replace keyword arguments per field; ``skip`` leaves fields out; ``flags`` gives a field another option string
    (a name users already type), its value still stored where :func:`config_from_namespace` reads it."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"add_dataclass_args: {cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        t, default = hints[f.name], getattr(defaults, f.name)
        kw: dict[str, Any] = {"default": default}
        if typing.get_origin(t) is typing.Literal:
            kw["choices"] = list(typing.get_args(t))
        elif t is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(t) is tuple:
            kw["default"] = ",".join(str(v) for v in default)
        elif t in (int, float, str):
            kw["type"] = t
        else:
            raise TypeError(
                f"add_dataclass_args: field {cls.__name__}.{f.name} has type {t!r}, which has no flag "
                "form (use int, float, str, bool, a Literal or tuple[str, ...], or skip it)"
            )
        doc = _first_sentence(docs.get(f.name, ""))
        kw["help"] = f"{doc} (default: {kw['default']})" if doc else f"(default: {kw['default']})"
        kw.update((overrides or {}).get(f.name, {}))
        flag = (flags or {}).get(f.name, f"--{prefix}{f.name.replace('_', '-')}")
        group.add_argument(flag, dest=prefix.replace("-", "_") + f.name, **kw)


def config_from_namespace(cls: type, args: argparse.Namespace, prefix: str, **given: Any) -> Any:
    """``cls`` built from the flags :func:`add_dataclass_args` added with ``prefix`` (fields absent from ``args``
    keep their defaults); ``given`` values win. The dataclass validates them (its ``__post_init__``)."""
    dest = prefix.replace("-", "_")
    values = {
        f.name: getattr(args, dest + f.name) for f in dataclasses.fields(cls) if hasattr(args, dest + f.name)
    }
    values.update(given)
    return cls(**values)


_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~", ""}


def config_from_group(cls: type, group: dict[str, Any], where: str) -> Any:
    """Dataclass ``cls`` from a Hydra feature group (``name`` plus the config's fields); ``where`` names the group in
    the error an unknown key gets (the dataclass names a bad value)."""
    values = {k: v for k, v in group.items() if k != "name"}
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(fields)}")
    return cls(**values)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exp = text.partition("e")
        return f"{mantissa}.0e{exp}" if e and "." not in mantissa else text  # YAML 1.1 floats need a dot
    if isinstance(value, str):
        plain = value.lower() not in _YAML_WORDS and all(c.isalnum() or c in "_./-" for c in value)
        return value if plain and not value[0].isdigit() else '"' + value.replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_yaml_scalar(v) for v in value) + "]"
    raise TypeError(f"yaml_mirror: no YAML form for {value!r} ({type(value).__name__})")


def yaml_mirror(
    cls: type,
    header: str,
    values: dict[str, Any] | None = None,
    width: int = 110,
    *,
    preamble: str = "",
    skip: tuple[str, ...] = (),
) -> str:
    """The Hydra config group for dataclass ``cls``: ``header`` as comment lines, ``preamble`` verbatim (e.g. a
    Hydra ``defaults:`` list), then per field not in ``skip`` the first sentence of its docstring as a comment and
    ``field: value`` (the dataclass default, or ``values[field]`` where a recipe chooses otherwise). Generated, so
    the YAML cannot drift from the dataclass (recipes/mirrors.py writes them)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"yaml_mirror: {cls!r} is not a dataclass")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted((set(values or {}) | set(skip)) - set(names))
    if unknown:
        raise ValueError(f"yaml_mirror: {cls.__name__} has no field(s) {unknown}; it has {names}")
    names = [n for n in names if n not in skip]
    defaults, docs = cls(), field_docs(cls)
    lines = [f"# {line}" for line in header.splitlines()] + preamble.splitlines()
    for name in names:
        value = (values or {}).get(name, getattr(defaults, name))
        doc = docs.get(name, "").split(". ", 1)[0].rstrip(".")
        lines += textwrap.wrap(doc, width, initial_indent="# ", subsequent_indent="#   ") if doc else []
        lines.append(f"{name}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"
