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

    assert validate_flowlane_section({"train_batch_size": 8}) == {
        "hermod": None,
        "offload": None,
        "syndicate": None,
        "aleph": None,
    }
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


#: one typo per sub-section: (sub-section, its body, the bad key, a key the error lists as allowed)
TYPOS = [
    ("hermod", {"windw": "bucket"}, "windw", "'window'"),
    ("offload", {"keep_lst_k": 2}, "keep_lst_k", "'keep_last_k'"),
    ("aleph", {"bandwith_gbps": [30, 10], "topp": "ps"}, "bandwith_gbps", "'bandwidth_gbps'"),
    ("syndicate", {"plann": "p.json", "mode": "fifo"}, "plann", "'plan'"),
]


@pytest.mark.parametrize("feature", ["hermod", "offload", "aleph", "syndicate"], ids="install_{}".format)
@pytest.mark.parametrize("sub, body, bad, allowed", TYPOS, ids=[f"typo_in_{t[0]}" for t in TYPOS])
def test_a_typo_in_any_sub_section_is_refused_by_every_install(feature, sub, body, bad, allowed):
    """Whatever feature is installed, a typo in any feature's sub-section is an error naming the key and the allowed
    ones (ALEPH's and SYNDICATE's sub-sections were not parsed unless ALEPH / SYNDICATE itself was installed). The
    section is checked before the engine is touched, so no engine is needed."""
    pytest.importorskip("deepspeed")
    import importlib

    install = importlib.import_module(
        {
            "hermod": "deepspeed_plugin.hermod",
            "offload": "deepspeed_plugin.ssd_offload",
            "aleph": "deepspeed_plugin.aleph",
            "syndicate": "deepspeed_plugin.syndicate",
        }[feature]
    ).install
    with pytest.raises(ValueError) as e:
        install(object(), {"train_batch_size": 8, "flowlane": {sub: body}})
    msg = str(e.value)
    assert repr(bad) in msg and allowed in msg, msg
    if sub == "aleph":  # every unknown key at once
        assert "'topp'" in msg, msg


def test_aleph_install_refuses_a_deepspeed_version_outside_the_range(monkeypatch):
    """ALEPH wraps DeepSpeed's backend and its ZeRO reductions as 0.19 has them: another version is refused at install,
    as Hermod and SYNDICATE refuse it (it was not checked). The check runs before the engine is touched."""
    pytest.importorskip("deepspeed")
    import flowlane.versions
    from deepspeed_plugin.aleph import install

    monkeypatch.setattr(flowlane.versions, "version", lambda dist: {"deepspeed": "0.18.2"}[dist])
    with pytest.raises(
        RuntimeError, match=r"flowlane.aleph: deepspeed 0.18.2 is not supported .* 0.19 to 0.19"
    ):
        install(object(), {"flowlane": {"aleph": {"clusters": [[0, 1]]}}})
    assert install(object(), {"flowlane": {}}) is None  # absent: nothing installed, nothing checked


def test_offload_install_refuses_a_deepspeed_version_outside_the_range(monkeypatch):
    """The offload wraps ZeRO-3's fetch_sub_module as 0.19 has it: another version is refused at install."""
    pytest.importorskip("deepspeed")
    import flowlane.versions
    from deepspeed_plugin.ssd_offload import install

    monkeypatch.setattr(flowlane.versions, "version", lambda dist: {"deepspeed": "0.18.2"}[dist])
    with pytest.raises(
        RuntimeError, match=r"flowlane.offload: deepspeed 0.18.2 is not supported .* 0.19 to 0.19"
    ):
        install(object(), {"flowlane": {"offload": {"dirs": ["/tmp"]}}})


def test_a_misspelt_key_in_a_disabled_aleph_section_is_still_refused() -> None:
    """A disabled section's values are not read, but its keys are checked as Hermod's and SYNDICATE's are."""
    from deepspeed_plugin.aleph import parse_section

    assert parse_section({"flowlane": {"aleph": {"enabled": False, "bandwidth_gbps": [1.0, 2.0]}}}) is None
    with pytest.raises(
        ValueError, match=r"flowlane\.aleph: unknown key\(s\) \['topp'\]; allowed: .*'bandwidth_gbps'"
    ):
        parse_section({"flowlane": {"aleph": {"enabled": False, "topp": 1}}})


def test_aleph_enabled_must_be_a_boolean() -> None:
    """The string "false" is true in Python: the section installed; Hermod's and SYNDICATE's refuse it already."""
    from deepspeed_plugin.aleph import parse_section

    with pytest.raises(ValueError, match=r"flowlane\.aleph\.enabled must be true or false, got 'false'"):
        parse_section({"flowlane": {"aleph": {"enabled": "false", "clusters": [[0]]}}})
