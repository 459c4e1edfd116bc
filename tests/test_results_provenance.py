"""Every result JSON under results/ says what produced it (the house standard): a ``provenance`` envelope with the
commit and the command (``flowlane.testing.provenance.write_result`` writes it; the first files written with it
carry its fields at the top level). Files older than the envelope carry
one backfilled from git history, marked ``backfilled`` and saying where the run is described instead of a command.
The recipes' own run outputs (results/train: metrics and traces of ``make train``) are not benchmark results."""

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.once

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _result_files() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("*.json") if p.relative_to(RESULTS).parts[0] != "train")


def test_every_result_json_records_its_commit_and_command_or_is_a_marked_backfill():
    files = _result_files()
    assert len(files) > 100  # the folder is there and read
    bad = []
    for p in files:
        doc = json.loads(p.read_text())
        prov = doc.get("provenance") if isinstance(doc, dict) else None
        if prov is None and isinstance(doc, dict) and "command" in doc:
            prov = doc  # the envelope's fields at the top level (the first files written with it)
        name = str(p.relative_to(RESULTS))
        if not isinstance(prov, dict):
            bad.append(f"{name}: no provenance")
            continue
        if not re.match(r"[0-9a-f]{7,40}\b", str(prov.get("commit", ""))) and "unknown" not in str(
            prov.get("commit")
        ):
            bad.append(f"{name}: commit {prov.get('commit')!r}")
        if prov.get("backfilled"):
            if not prov.get("command") and "describe the run" not in prov.get("note", ""):
                bad.append(f"{name}: a backfill without a command must say where the run is described")
        elif not prov.get("command"):
            bad.append(f"{name}: no command")
    assert not bad, "\n".join(bad)
