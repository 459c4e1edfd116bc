"""One config convention for every component: a dataclass whose fields carry a docstring (the string literal right
below the field) and a ``Literal`` where the values are a fixed set. Command-line flags are generated from it
(:func:`add_dataclass_args`: names, types, choices, defaults and help) and read back into it
(:func:`config_from_namespace`), so a field is written once; the Hydra YAML mirrors are checked against the same
dataclasses by tests. Pure Python, nothing on import.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
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
    head = text.split(". ", 1)[0].rstrip(".")
    return head.replace("%", "%%")  # argparse formats help with %


def add_dataclass_args(
    group: Any,
    cls: type,
    prefix: str,
    *,
    skip: tuple[str, ...] = (),
    overrides: dict[str, dict[str, Any]] | None = None,
) -> None:
    """One ``--<prefix><field>`` flag per field of dataclass ``cls`` on ``group`` (a parser or argument group):
    ``Literal`` fields get choices, ``bool`` fields ``--x/--no-x``, ``tuple[str, ...]`` fields a comma-separated
    string; the default is the dataclass's, the help the first sentence of the field's docstring. ``overrides``
    replace keyword arguments per field; ``skip`` leaves fields out."""
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
        group.add_argument(f"--{prefix}{f.name.replace('_', '-')}", **kw)


def config_from_namespace(cls: type, args: argparse.Namespace, prefix: str, **given: Any) -> Any:
    """``cls`` built from the flags :func:`add_dataclass_args` added with ``prefix`` (fields absent from ``args``
    keep their defaults); ``given`` values win. The dataclass validates them (its ``__post_init__``)."""
    dest = prefix.replace("-", "_")
    values = {
        f.name: getattr(args, dest + f.name) for f in dataclasses.fields(cls) if hasattr(args, dest + f.name)
    }
    values.update(given)
    return cls(**values)
