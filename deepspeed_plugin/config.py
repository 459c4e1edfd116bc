"""The ``"flowlane"`` section of a DeepSpeed config: each feature reads its own sub-section through here.

    {"train_batch_size": 8, ..., "flowlane": {"hermod": {...}, "offload": {...}}}

:func:`validate_flowlane_section` checks the whole section at once, as DeepSpeed checks its own sections when it
builds its config (its pydantic models forbid unknown keys and name each bad value): every problem of every
sub-section is listed in one error, each under its dotted key. Both installs (``deepspeed_plugin.hermod.install``,
``deepspeed_plugin.ssd_offload.install``) call it, so a typo in one feature's sub-section is never silently ignored
because only the other feature was installed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUBSECTIONS = ("hermod", "offload", "syndicate", "aleph")  # aleph: parsed by deepspeed_plugin.aleph


def validate_flowlane_section(ds_config: Mapping[str, Any] | str | Path | None) -> dict[str, Any]:
    """Parse every sub-section: ``{"hermod": HermodDSConfig | None, "offload": (OffloadConfig, scope class names,
    deepspeed_aio) | None, ...}``.

    Raises one ``ValueError`` listing every problem found (unknown keys, bad values), each naming its key."""
    from deepspeed_plugin.hermod import parse_hermod_section  # noqa: PLC0415 - they import this module
    from deepspeed_plugin.ssd_offload import parse_offload_section  # noqa: PLC0415

    flowlane_subsection(ds_config, "hermod")  # the section itself (not an object, unknown sub-sections) first
    errors: list[str] = []
    out: dict[str, Any] = {}
    for name, parse in (("hermod", parse_hermod_section), ("offload", parse_offload_section)):
        try:
            out[name] = parse(ds_config)
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
