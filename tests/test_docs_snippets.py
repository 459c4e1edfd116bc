"""The docs name what exists. Every ```python block in README.md and docs/*.md parses, and every name it takes from
flowlane's own packages (``from flowlane.aleph.hook import install_aleph_hook``, ``deepspeed_plugin.aleph.install``)
is defined where it says; every benchmark, GPU-check or ``flowlane`` sub-command the docs and results READMEs quote
(``benchmarks/aleph_netns.py --reps 5 --chunk-kb 256``, ``flowlane sim --no-overlap``) names a script that exists and
flags its parser defines; every ``flowlane-train`` command's overrides compose against its recipe (Hydra). Code is
read from the source files (``ast``), so no framework is imported and both lanes' code is checked in one place. The
runnable examples are the packages' doctests (``test_doctests.py``); these blocks are fragments with the user's own
variables."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = ("flowlane", "megatron_plugin", "deepspeed_plugin", "dgl_plugin", "recipes")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# where commands are quoted: the docs, the benchmark index, the results folders' READMEs
COMMAND_DOCS = sorted(
    {
        *DOCS,
        ROOT / "benchmarks/README.md",
        ROOT / "nccl_net_plugin/README.md",
        *(ROOT / "results").glob("*/README.md"),
    }
)
COMMAND = re.compile(
    r"((?:benchmarks|tests/gpu|scripts)/\w+\.py|flowlane (?:doctor|sim|ssd-estimate))"
    r"((?: --?[a-zA-Z][-\w]*(?:[ =](?!-)[^\s`|]+)?)+)"
)
FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][-\w]*)")


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


def _parser_flags(path: Path, seen: set[Path] | None = None) -> set[str]:
    """The ``add_argument`` option strings of a script and of the project modules it imports (shared bench parsers,
    a script that hands its other flags to another's parser)."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    flags: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            flags.update(
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")
            )
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for m in modules:
            dep = _module_file(m) if m.split(".")[0] in (*OWN, "benchmarks", "tests") else None
            sibling = path.parent / f"{m}.py"  # a script beside it, imported by its bare name
            for found in (dep, sibling if sibling.is_file() else None):
                if found is not None:
                    flags |= _parser_flags(found, seen)
    return flags


def _script_of(command: str) -> Path | None:
    """The file whose parser a quoted command runs: a script's path, or a ``flowlane`` sub-command's module."""
    if command.startswith("flowlane "):
        from flowlane.cli import COMMANDS  # noqa: PLC0415 - the sub-command table (imports nothing heavy)

        return _module_file(COMMANDS[command.split()[1]][0])
    return ROOT / command


def _commands() -> list[tuple[str, str, list[str]]]:
    out = []
    for doc in COMMAND_DOCS:
        for m in COMMAND.finditer(doc.read_text()):
            out.append((str(doc.relative_to(ROOT)), m.group(1), FLAG.findall(m.group(2))))
    return out


BLOCKS = _blocks()
COMMANDS = _commands()


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


def test_the_docs_quote_commands_to_check() -> None:
    assert len(COMMANDS) >= 30


def test_every_quoted_command_names_a_script_and_flags_it_has() -> None:
    wrong = []
    for doc, script, flags in COMMANDS:
        path = _script_of(script)
        if path is None or not path.is_file():
            wrong.append(f"{doc}: {script} does not exist")
            continue
        known = _parser_flags(path) | {"--help"}
        wrong += [f"{doc}: {script} has no {f}" for f in flags if f not in known]
    assert wrong == []


def test_the_flag_check_follows_a_parser_another_script_owns() -> None:
    # ssd_offload_rok.py hands every flag but its own to ssd_offload_bench.py's parser
    flags = _parser_flags(ROOT / "benchmarks/ssd_offload_rok.py")
    assert {"--micro-batches", "--compute-threads"} <= flags and "--no-such-flag" not in flags


# -- flowlane-train commands: the Hydra overrides the docs quote compose against the recipes' configs -----------------
TRAIN = re.compile(r"flowlane-train\)?((?:[ \t]+(?:--config-name \w+|[+\w.]+=[^\s`\"'|;]+))*)")
PLACEHOLDER = re.compile(r"<[^>]*>|\$\{?\w+\}?")


def _train_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, config name, overrides) of every ``flowlane-train`` command quoted, continuation lines joined; the
    user's placeholders (``<machines>``, ``$SLURM_NTASKS``) stand for values, so a plain one replaces them."""
    out = []
    for doc in COMMAND_DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for m in TRAIN.finditer(text):
            tokens = m.group(1).split()
            name, overrides = "default", []
            for i, tok in enumerate(tokens):
                if tok == "--config-name":
                    name = tokens[i + 1]
                elif "=" in tok and not tok.startswith("hydra."):
                    key, value = tok.split("=", 1)
                    overrides.append(f"{key}={PLACEHOLDER.sub('1', value)}")
            out.append((str(doc.relative_to(ROOT)), name, overrides))
    return out


TRAIN_COMMANDS = _train_commands()


def test_the_docs_quote_training_commands_to_check() -> None:
    assert sum(bool(o) for _, _, o in TRAIN_COMMANDS) >= 10


def _compose_errors(commands: list[tuple[str, str, list[str]]]) -> list[str]:
    import hydra  # noqa: PLC0415 - a core dependency (pyproject), imported only by these tests

    wrong = []
    with hydra.initialize_config_dir(config_dir=str(ROOT / "recipes/conf"), version_base="1.3"):
        for doc, name, overrides in commands:
            try:
                hydra.compose(config_name=name, overrides=overrides)
            except Exception as e:  # noqa: BLE001 - every failure is listed with its doc
                wrong.append(f"{doc}: flowlane-train --config-name {name} {' '.join(overrides)}: {e}")
    return wrong


def test_every_quoted_training_command_composes_against_its_recipe() -> None:
    assert _compose_errors(TRAIN_COMMANDS) == []


def test_the_compose_check_finds_a_key_a_recipe_lacks() -> None:
    (error,) = _compose_errors([("doc", "gnn_fullgraph", ["out_dir=x"])])
    assert "out_dir" in error


def test_the_benchmark_index_lists_every_benchmark_and_gpu_check() -> None:
    """benchmarks/README.md indexes every script in benchmarks/ and tests/gpu/ (helpers included, by name)."""
    index = (ROOT / "benchmarks/README.md").read_text()
    scripts = [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests/gpu").glob("*.py")]
    missing = [
        str(p.relative_to(ROOT)) for p in scripts if p.name != "__init__.py" and f"`{p.name}`" not in index
    ]
    missing = [m for m in missing if f"`{m}`" not in index]
    assert missing == []
