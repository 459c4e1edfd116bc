"""ALEPH on DeepSpeed ZeRO 0: the DP all-reduce through the hierarchy keeps DeepSpeed's math (within float
reordering); the "flowlane.aleph" section is parsed strictly; ZeRO 1 is refused at install."""

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.aleph import parse_section  # noqa: E402
from flowlane.launch import launch  # noqa: E402
from tests import aleph_workers  # noqa: E402


def test_deepspeed_zero0_with_aleph_matches_its_own_run_and_zero1_is_refused():
    res = launch(aleph_workers.deepspeed_with_and_without, 4, timeout=300, env={"DS_ACCELERATOR": "cpu"})
    for rank, r in enumerate(res):
        assert r["calls"] >= 3, (rank, r)  # one bucket per step at least went through the hierarchy
        assert r["maxdiff"] < 1e-5 and r["moved"] > 1e-3, (rank, r)
        assert "supports ZeRO stage 0" in r["zero1"], (rank, r["zero1"])


def test_aleph_section_is_parsed_strictly():
    assert parse_section({"flowlane": {}}) is None
    assert parse_section({"flowlane": {"aleph": {"enabled": False, "clusters": [[0]]}}}) is None
    cfg, own = parse_section({"flowlane": {"aleph": {"bandwidth_gbps": [30, 10], "variant": "paper"}}})
    assert cfg.variant == "paper" and own["bandwidth_gbps"] == [30, 10]
    with pytest.raises(ValueError, match="unknown aleph config key"):
        parse_section({"flowlane": {"aleph": {"clusters": [[0]], "bogus": 1}}})
    with pytest.raises(ValueError, match=r"\['replan_every'\] would have no effect on DeepSpeed"):
        parse_section({"flowlane": {"aleph": {"clusters": [[0]], "replan_every": 10}}})
    with pytest.raises(ValueError, match="exactly one of 'bandwidth_gbps'"):
        parse_section({"flowlane": {"aleph": {"top": "ps"}}})
