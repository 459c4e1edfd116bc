"""The Hydra config groups generated from config dataclasses (recipes/mirrors.py) are up to date and load back as
the dataclass's values (issue 29 item 5)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest
import yaml

pytestmark = pytest.mark.llm

from flowlane.configs import yaml_mirror  # noqa: E402
from recipes import mirrors  # noqa: E402


def test_generated_config_groups_match_their_dataclasses():
    assert mirrors.stale() == [], "run `python -m recipes.mirrors` and commit the YAML it writes"
    assert mirrors.main(["--check"]) == 0


def test_each_generated_group_loads_back_as_the_dataclass_values():
    from flowlane.offload import OffloadConfig
    from megatron_plugin.hermod import HermodConfig

    for name, cls, chosen in [
        ("scheduler/hermod.yaml", HermodConfig, {}),
        ("offload/ssd.yaml", OffloadConfig, {"offload_cpu_tensors": True}),
    ]:
        loaded = yaml.safe_load((mirrors.CONF / name).read_text())
        want = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cls()).items()}
        assert loaded == want | chosen, name
        assert cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in loaded.items()}) == cls(**chosen)


@dataclasses.dataclass
class _Tricky:
    switch: Literal["on", "off"] = "off"
    """YAML 1.1 reads a bare off as false. Quoted."""
    rate: float = 1e-06
    """PyYAML reads 1e-06 as a string. Written with a dot."""
    names: tuple[str, ...] = ("a b", "yes")
    label: str = "x: y"


def test_values_yaml_would_misread_are_written_so_they_load_back_exactly():
    text = yaml_mirror(_Tricky, "header")
    assert text.startswith("# header\n# YAML 1.1 reads a bare off as false\nswitch: ")
    assert yaml.safe_load(text) == {"switch": "off", "rate": 1e-06, "names": ["a b", "yes"], "label": "x: y"}
    with pytest.raises(ValueError, match=r"_Tricky has no field\(s\) \['speed'\]"):
        yaml_mirror(_Tricky, "h", {"speed": 1})
