import json

import pytest

from deepspeed_plugin.config import flowlane_subsection

pytestmark = pytest.mark.llm


def test_absent_sections_mean_off():
    assert flowlane_subsection(None, "hermod") is None
    assert flowlane_subsection({"train_batch_size": 8}, "hermod") is None
    assert flowlane_subsection({"flowlane": {"offload": {}}}, "hermod") is None


def test_subsection_is_read_from_a_dict_or_a_json_file(tmp_path):
    cfg = {"flowlane": {"hermod": {"enabled": True}, "offload": {"keep_last_k": 2}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert flowlane_subsection(cfg, "offload") == {"keep_last_k": 2}
    assert flowlane_subsection(path, "hermod") == {"enabled": True}


def test_every_feature_section_is_known_to_the_others():
    """ALEPH's sub-section beside Hermod's: each feature's install parses the whole section, so a sibling feature's
    sub-section must not be an unknown key (it was: ALEPH + Hermod failed with "unknown key(s) ['aleph']")."""
    cfg = {"flowlane": {"hermod": {"enabled": True}, "aleph": {"enabled": True}, "syndicate": {}}}
    assert flowlane_subsection(cfg, "hermod") == {"enabled": True}
    assert flowlane_subsection(cfg, "aleph") == {"enabled": True}


@pytest.mark.parametrize(
    "cfg, name, match",
    [
        ({"flowlane": []}, "hermod", 'DeepSpeed config "flowlane" must be an object, got list'),
        ({"flowlane": {"hermod": 3}}, "hermod", '"flowlane.hermod" must be an object, got int'),
        ({"flowlane": {"hermes": {}}}, "hermod", r"unknown key\(s\) \['hermes'\]"),
        ({"flowlane": {}}, "zero", "unknown flowlane sub-section 'zero'"),
    ],
)
def test_malformed_sections_are_rejected_naming_the_problem(cfg, name, match):
    with pytest.raises(ValueError, match=match):
        flowlane_subsection(cfg, name)


def test_the_whole_section_is_validated_at_once_naming_every_bad_key_and_value():
    from deepspeed_plugin.config import validate_flowlane_section

    assert validate_flowlane_section({"train_batch_size": 8}) == {"hermod": None, "offload": None}
    got = validate_flowlane_section(
        {"flowlane": {"hermod": {"window": "backward"}, "offload": {"enabled": False}}}
    )
    assert got["hermod"].window == "backward" and got["offload"] is None
    with pytest.raises(ValueError) as e:
        validate_flowlane_section(
            {"flowlane": {"hermod": {"window": "step", "gate_timout_s": 1}, "offload": {"keep_last_k": -1}}}
        )
    msg = str(e.value)
    assert msg.startswith('2 error(s) in DeepSpeed config "flowlane"')
    assert "['gate_timout_s']" in msg and "keep_last_k" in msg
    with pytest.raises(ValueError, match=r"flowlane.hermod.window 'step' is not one of"):
        validate_flowlane_section({"flowlane": {"hermod": {"window": "step"}}})
    with pytest.raises(
        ValueError, match=r"flowlane.hermod.gate_timeout_s must be a number of seconds >= 0, got 'x'"
    ):
        validate_flowlane_section({"flowlane": {"hermod": {"gate_timeout_s": "x"}}})
