"""flowlane.configs: flags generated from a config dataclass (names, types, choices, defaults, help from the field
docstrings) and read back into it; Hermod's Megatron-LM flags are built this way."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import pytest

from flowlane.configs import add_dataclass_args, config_from_namespace, field_docs

pytestmark = pytest.mark.once


@dataclass
class _Example:
    mode: Literal["fast", "safe"] = "safe"
    """How to run. Second sentence, not in the help."""
    rate_mbit: float = 100.0
    """Link rate, 20 % headroom."""
    rounds: int = 3
    verbose: bool = False
    """Say more."""
    names: tuple[str, ...] = ("a", "b")
    """Names to compare."""

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if isinstance(self.names, str):
            self.names = tuple(self.names.split(","))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_dataclass_args(p, _Example, "ex-", overrides={"rounds": {"help": "rounds per rate"}})
    return p


def test_flags_carry_types_choices_defaults_and_the_docstrings_first_sentence() -> None:
    assert field_docs(_Example)["mode"] == "How to run. Second sentence, not in the help."
    p = _parser()
    assert config_from_namespace(_Example, p.parse_args([]), "ex_") == _Example()
    got = config_from_namespace(
        _Example,
        p.parse_args(["--ex-mode", "fast", "--ex-rate-mbit", "2.5", "--ex-verbose", "--ex-names", "x,y,z"]),
        "ex_",
    )
    assert got == _Example(mode="fast", rate_mbit=2.5, verbose=True, names=("x", "y", "z"))
    text = p.format_help()
    assert "How to run (default: safe)" in text and "Second sentence" not in text
    assert "20 % headroom (default: 100.0)" in text and "rounds per rate" in text
    with pytest.raises(SystemExit):
        p.parse_args(["--ex-mode", "slow"])
    # the dataclass validates what was read
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        config_from_namespace(_Example, p.parse_args(["--ex-rounds", "0"]), "ex_")
    assert config_from_namespace(_Example, p.parse_args([]), "ex_", rounds=7).rounds == 7  # given values win


def test_a_field_type_without_a_flag_form_is_named() -> None:
    @dataclass
    class Bad:
        table: dict[str, int] | None = None

    with pytest.raises(TypeError, match=r"field Bad.table has type .* which has no flag form"):
        add_dataclass_args(argparse.ArgumentParser(), Bad, "bad-")


def test_a_field_keeps_the_flag_name_users_type_and_abbreviations_do_not_end_its_help() -> None:
    @dataclass
    class Renamed:
        link_GBps: float = 0.0
        """The link's rate (Alg. 5.2, Fig. 5.9). Measured when 0."""

    p = argparse.ArgumentParser()
    add_dataclass_args(p, Renamed, "x-", flags={"link_GBps": "--x-link-gbps"})
    assert config_from_namespace(Renamed, p.parse_args(["--x-link-gbps", "55"]), "x_").link_GBps == 55.0
    text = p.format_help()
    assert "The link's rate (Alg. 5.2, Fig. 5.9) (default: 0.0)" in text and "Measured" not in text
    with pytest.raises(SystemExit):
        p.parse_args(["--x-link-GBps", "55"])  # the generated name is replaced, not added
