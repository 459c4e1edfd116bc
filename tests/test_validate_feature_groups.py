"""A feature group that is off takes no key but its selector: `flowlane-train +offload.min_bytes=5` (offload off)
trained without offload, printed `features: none` and exited 0. Refused in the launching process, naming the key
and the option that turns the group on; every group option of every GPT recipe still passes."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("megatron.core")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from recipes.train import FEATURE_GROUPS, feature_lines, run_job  # noqa: E402
from recipes.validate import ConfigError, check_gpt  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "recipes" / "conf"


def _no_ranks(*a, **kw):
    raise AssertionError("ranks were started before the config was checked")


def _composed(name: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name=name, overrides=overrides), resolve=True)  # type: ignore[return-value]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["+offload.min_bytes=5"],
            r"^offload.min_bytes=5 is set but offload is off \(offload.enabled=false\): "
            r"choose offload=pinned or offload=ssd$",
        ),
        (
            ["+scheduler.ep_algorithm=plain"],
            r"^scheduler.ep_algorithm='plain' is set but scheduler is off \(scheduler.name=none\): "
            r"choose scheduler=hermod$",
        ),
        (
            ["+dp_collective.clusters='0,1'", "+dp_collective.top=ps"],
            r"^dp_collective.clusters='0,1', dp_collective.top='ps' are set but dp_collective is off "
            r"\(dp_collective.name=none\): choose dp_collective=aleph or dp_collective=syndicate$",
        ),
        # a group switched off by its own selector: every other key of the group is ignored too
        (["offload=ssd", "offload.enabled=false"], r"^offload.adaptive=False, .* are set but offload is off"),
        (
            ["--config-name=moe", "scheduler.name=none"],
            r"^scheduler.dp_mid='last', .* are set but scheduler is off",
        ),
        # GPTRecipe.features is the groups', not a key: it was a TypeError (two values for one argument)
        (["+features.x=1"], r"^unknown recipe field\(s\) \['features'\]; allowed: \['bf16'"),
    ],
)
def test_a_key_of_a_feature_group_that_is_off_is_refused(tmp_path, monkeypatch, overrides, match):
    monkeypatch.setattr("flowlane.launch.launch", _no_ranks)
    name = "default"
    if overrides[0].startswith("--config-name="):
        name = overrides.pop(0).split("=", 1)[1]
    cfg = _composed(name, [*overrides, f"output_dir={tmp_path}/out"])
    with pytest.raises(ConfigError, match=match):
        run_job(cfg)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("default", []),
        ("moe", []),
        ("default", ["offload=ssd"]),
        ("default", ["offload=pinned"]),
        ("default", ["scheduler=hermod"]),
        ("moe", ["scheduler=none"]),
        ("default", ["dp_collective=aleph", "dp_collective.clusters='0,1'"]),
        ("default", ["dp_collective=syndicate"]),
    ],
)
def test_every_feature_group_option_still_passes(tmp_path, name, overrides):
    cfg = _composed(name, [*overrides, f"output_dir={tmp_path}/out"])
    recipe = check_gpt(cfg, FEATURE_GROUPS)
    assert set(recipe.features) == set(FEATURE_GROUPS)


def test_the_summary_names_a_folder_only_for_offload_tiers_that_write_files():
    # the pinned tier keeps activations in host memory: "(system temp folder)" after it was wrong
    for backend, line in (
        ("pinned_cpu", "features: offload=pinned_cpu"),
        ("null", "features: offload=null"),
        ("posix", "features: offload=posix (system temp folder)"),
        ("kvikio", "features: offload=kvikio (system temp folder)"),
    ):
        assert feature_lines({"offload": {"enabled": True, "backend": backend}}, {})[0] == line
    pinned = _composed("default", ["offload=pinned"])
    assert feature_lines(pinned, {})[0] == "features: offload=pinned_cpu"
