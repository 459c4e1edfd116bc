"""flowlane.versions (the one version-pin check both LLM plugins use) and the result envelope's commit."""

import re
from importlib.metadata import version

import pytest

from flowlane.versions import check_version_range

pytestmark = pytest.mark.once


def test_inside_the_range_returns_the_version_outside_it_names_dist_version_and_range() -> None:
    v = version("pytest")
    major, minor = (int(x) for x in re.findall(r"\d+", v)[:2])
    assert check_version_range("pytest", ((major, minor), (major, minor + 1)), "here") == v
    with pytest.raises(
        RuntimeError,
        match=rf"here: pytest {re.escape(v)} is not supported .* checked on 0\.1 to "
        r"0\.1\); pin pytest to that range",
    ):
        check_version_range("pytest", ((0, 1), (0, 2)), "here")


def test_provenance_takes_the_commit_its_sender_names_over_a_possibly_stale_git(monkeypatch) -> None:
    from flowlane.testing.provenance import provenance

    monkeypatch.setenv("FLOWLANE_COMMIT", "abc1234-dirty")
    p = provenance(command="x")
    assert (p["commit"], p["dirty"], p["command"]) == ("abc1234-dirty", None, "x")
    monkeypatch.delenv("FLOWLANE_COMMIT")
    assert provenance(command="x")["commit"] != "abc1234-dirty"


def test_write_result_records_the_envelope_and_replaces_the_file_whole(tmp_path, monkeypatch) -> None:
    import json

    from flowlane.testing.provenance import write_result

    monkeypatch.setenv("FLOWLANE_COMMIT", "abc1234")
    out = write_result(tmp_path / "sub" / "r.json", {"figure": 1.5}, command="bench --x 1")
    doc = json.loads(out.read_text())
    assert doc["figure"] == 1.5 and doc["provenance"]["command"] == "bench --x 1"
    assert doc["provenance"]["commit"] == "abc1234"
    write_result(out, {"figure": 2.0})
    assert json.loads(out.read_text())["figure"] == 2.0
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temporary file left behind


def test_write_result_puts_bulky_detail_beside_the_summary(tmp_path, monkeypatch) -> None:
    import json

    import pytest

    from flowlane.testing.provenance import read_detail, write_result

    monkeypatch.setenv("FLOWLANE_COMMIT", "abc1234")
    out = write_result(tmp_path / "r.json", {"figure": 1.5}, command="b", detail={"timeline": [[0, 1]] * 3})
    doc = json.loads(out.read_text())
    assert doc["detail_file"] == "r.detail.json.gz" and "timeline" not in doc
    side = read_detail(out)
    assert side["timeline"] == [[0, 1]] * 3 and side["provenance"]["commit"] == "abc1234"
    # the same detail and envelope give the same bytes (gzip's timestamp is fixed): rewrites make no diff
    monkeypatch.setattr("flowlane.testing.provenance.provenance", lambda command=None: {"command": "b"})
    write_result(out, {"figure": 1.5}, detail={"timeline": [[0, 1]] * 3})
    first = (tmp_path / "r.detail.json.gz").read_bytes()
    write_result(out, {"figure": 1.5}, detail={"timeline": [[0, 1]] * 3})
    assert (tmp_path / "r.detail.json.gz").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.detail.json.gz", "r.json"]
    write_result(tmp_path / "plain.json", {"x": 1})
    with pytest.raises(FileNotFoundError, match="plain.json names no detail_file"):
        read_detail(tmp_path / "plain.json")
