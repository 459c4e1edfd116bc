"""The ``"flowlane"`` section of a DeepSpeed config: each feature reads its own sub-section through here.

    {"train_batch_size": 8, ..., "flowlane": {"hermod": {...}, "offload": {...}, "aleph": {...}, "syndicate": {...}}}

:func:`validate_flowlane_section` checks the whole section at once, as DeepSpeed checks its own sections when it
builds its config (its pydantic models forbid unknown keys and name each bad value): an unknown sub-section name is
refused listing the known ones, and every sub-section is parsed by its own feature's parser, every problem of every
sub-section listed in one error, each naming its key. Every install (``deepspeed_plugin.hermod.install``,
``deepspeed_plugin.ssd_offload.install``, ``deepspeed_plugin.aleph.install``, ``deepspeed_plugin.syndicate.install``)
calls it, so a typo in one feature's sub-section is never silently ignored because only another feature was installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: the DeepSpeed versions every flowlane feature on DeepSpeed was read and tested against ([first, last) by
#: (major, minor)): the private functions the hooks wrap and the paths they route; other versions are refused
DEEPSPEED_VERSIONS = ((0, 19), (0, 20))

SUBSECTIONS = ("hermod", "offload", "syndicate", "aleph")


def validate_flowlane_section(ds_config: Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """Parse every sub-section with its feature's own parser: ``{"hermod": HermodDSConfig | None, "offload":
    (OffloadConfig, scope class names, deepspeed_aio) | None, "syndicate": SyndicateDSConfig | None, "aleph":
    (AlephConfig, the section's own keys) | None}`` (None: absent or disabled).

    Raises one ``ValueError`` listing every problem found (unknown keys, bad values), each naming its key."""
    # imported here: each feature's module imports this one (the parsers stay beside the configs they build)
    from deepspeed_plugin.aleph import parse_section as parse_aleph_section  # noqa: PLC0415
    from deepspeed_plugin.hermod import parse_hermod_section  # noqa: PLC0415
    from deepspeed_plugin.ssd_offload import parse_offload_section  # noqa: PLC0415
    from deepspeed_plugin.syndicate import parse_syndicate_section  # noqa: PLC0415

    flowlane_subsection(ds_config, "hermod")  # the section itself (not an object, unknown sub-sections) first
    if isinstance(ds_config, str | Path):  # read the JSON file once (ALEPH's parser takes the dict)
        ds_config = json.loads(Path(ds_config).read_text())
    parsers: dict[str, Callable[[dict[str, Any]], Any]] = {
        "hermod": parse_hermod_section,
        "offload": parse_offload_section,
        "syndicate": parse_syndicate_section,
        "aleph": parse_aleph_section,
    }
    cfg = dict(ds_config or {})
    errors: list[str] = []
    out: dict[str, Any] = {}
    for name in SUBSECTIONS:  # a sub-section name without a parser is a KeyError here, never skipped
        try:
            out[name] = parsers[name](cfg)
        except (ValueError, TypeError) as e:
            errors.append(str(e))
    if errors:
        raise ValueError(
            f'{len(errors)} error(s) in DeepSpeed config "flowlane":\n'
            + "\n".join(f"  - {e}" for e in errors)
        )
    return out


def flowlane_subsection(
    ds_config: Mapping[str, Any] | str | Path | None, name: str
) -> Mapping[str, Any] | None:
    """``ds_config["flowlane"][name]``, or None when either level is absent.

    ``ds_config`` may be the dict given to ``deepspeed.initialize`` or a path to its JSON file.
    """
    if name not in SUBSECTIONS:
        raise ValueError(f"unknown flowlane sub-section {name!r}; known: {list(SUBSECTIONS)}")
    if ds_config is None:
        return None
    if isinstance(ds_config, str | Path):
        ds_config = json.loads(Path(ds_config).read_text())
    section = ds_config.get("flowlane")
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(f'DeepSpeed config "flowlane" must be an object, got {type(section).__name__}')
    unknown = sorted(set(section) - set(SUBSECTIONS))
    if unknown:
        raise ValueError(
            f'unknown key(s) {unknown} in DeepSpeed config "flowlane"; known: {list(SUBSECTIONS)}'
        )
    sub = section.get(name)
    if sub is None:
        return None
    if not isinstance(sub, Mapping):
        raise ValueError(f'DeepSpeed config "flowlane.{name}" must be an object, got {type(sub).__name__}')
    return sub
