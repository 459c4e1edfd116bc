"""The ``"flowlane"`` section of a DeepSpeed config: each feature reads its own sub-section through here.

    {"train_batch_size": 8, ..., "flowlane": {"hermod": {...}, "offload": {...}}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUBSECTIONS = ("hermod", "offload")


def flowlane_subsection(ds_config: Mapping[str, Any] | str | Path | None, name: str) -> Mapping[str, Any] | None:
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
        raise ValueError(f'unknown key(s) {unknown} in DeepSpeed config "flowlane"; known: {list(SUBSECTIONS)}')
    sub = section.get(name)
    if sub is None:
        return None
    if not isinstance(sub, Mapping):
        raise ValueError(f'DeepSpeed config "flowlane.{name}" must be an object, got {type(sub).__name__}')
    return sub
