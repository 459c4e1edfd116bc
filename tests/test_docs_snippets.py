"""The Python in the docs names what exists: every ```python block in README.md and docs/*.md parses, and every
name it takes from flowlane's own packages (``from flowlane.aleph.hook import install_aleph_hook``,
``deepspeed_plugin.aleph.install(...)``) is defined where it says. Read from the source files (``ast``), so no
framework is imported and both lanes' plugins are checked in one place. The runnable examples are the packages'
doctests (``test_doctests.py``); these blocks are fragments with the user's own variables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = ("flowlane", "megatron_plugin", "deepspeed_plugin", "dgl_plugin", "recipes")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        for i, m in enumerate(BLOCK.finditer(doc.read_text())):
            out.append((f"{doc.relative_to(ROOT)}#{i + 1}", m.group(1)))
    return out


def _module_file(dotted: str) -> Path | None:
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _defined(path: Path) -> set[str]:
    """Top-level names of a module: definitions, assignments, imports, and the lazy ``_HOME`` map's keys."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "_HOME" for t in targets) and isinstance(
                node.value, ast.Dict
            ):
                names.update(k.value for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _resolves(dotted: str, name: str) -> bool:
    """``name`` is defined in module ``dotted``, or is its submodule."""
    path = _module_file(dotted)
    return path is not None and (name in _defined(path) or _module_file(f"{dotted}.{name}") is not None)


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    parts: list[str] = []
    cur: ast.expr = node
    while isinstance(cur, ast.Attribute):
        parts.append(cur.attr)
        cur = cur.value
    if not isinstance(cur, ast.Name):
        return None
    parts.append(cur.id)
    return parts[::-1]


def _missing(code: str) -> list[str]:
    tree = ast.parse(code)
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OWN:
            if _module_file(node.module) is None:
                missing.append(f"module {node.module}")
                continue
            missing += [f"{node.module}.{a.name}" for a in node.names if not _resolves(node.module, a.name)]
        elif isinstance(node, ast.Attribute):
            chain = _attribute_chain(node)
            if not chain or chain[0] not in OWN or len(chain) < 2:
                continue
            # the longest module prefix, then the next part must be defined in it
            for cut in range(len(chain) - 1, 0, -1):
                if _module_file(".".join(chain[:cut])) is not None:
                    if not _resolves(".".join(chain[:cut]), chain[cut]):
                        missing.append(".".join(chain[: cut + 1]))
                    break
    return missing


BLOCKS = _blocks()


def test_the_docs_have_python_blocks_to_check() -> None:
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_a_docs_python_block_parses_and_names_what_exists(where: str, code: str) -> None:
    assert _missing(code) == [], f"{where} names what flowlane does not define"


def test_the_check_finds_a_misnamed_import_and_attribute() -> None:
    code = (
        "from flowlane.aleph import plan_clusters, no_such_name\ndeepspeed_plugin.aleph.no_such_install(e)\n"
    )
    assert _missing(code) == ["flowlane.aleph.no_such_name", "deepspeed_plugin.aleph.no_such_install"]
