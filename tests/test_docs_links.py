"""Every relative link in the repository's Markdown resolves to a file or folder in the repository (issue 29: the
README is an index over docs/ and results/, so a moved file must not leave a dead link)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.once
ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _markdown_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / p for p in out.split()]


def dead_links() -> list[str]:
    dead = []
    for md in _markdown_files():
        # code blocks are not links
        text = re.sub(r"```.*?```", "", md.read_text(errors="replace"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # http(s)/mailto links and in-page anchors
            path = target.split("#", 1)[0]
            if path and not (md.parent / path).exists():
                dead.append(f"{md.relative_to(ROOT)}: {target}")
    return dead


def test_relative_markdown_links_resolve():
    assert len(_markdown_files()) > 10
    assert dead_links() == []
