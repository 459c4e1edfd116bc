"""How the Megatron-core features undo what they installed: :class:`flowlane.patching.Patch` (each patch removes only
its own wrapper, a close out of order is refused and changes nothing), plus the mark a feature leaves on each bucket
group whose gradient collective it takes over, so that a second feature cannot take the same bucket group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flowlane.patching import Patch, check_all, undo_all

__all__ = ["GROUP_OWNER", "Patch", "check_all", "check_group_free", "undo_all"]


#: the attribute a feature sets on each bucket group whose gradient collective it takes over (Hermod's DDP hooks,
#: ALEPH, SYNDICATE): the feature's name, removed with the feature's other patches at its close
GROUP_OWNER = "_flowlane_grad_sync_owner"


def check_group_free(bucket_groups: Iterable[Any], feature: str) -> None:
    """Refuse bucket groups whose gradient collective another feature already took over: two cannot share one (the
    second would wrap the first's group, and its check of the group's ranks or classes would pass only by chance)."""
    for bg in bucket_groups:
        owner = getattr(bg, GROUP_OWNER, None)
        if owner is not None:
            raise ValueError(
                f"{feature}: a Megatron-core DDP bucket group's gradient reduction is already taken over by {owner}; "
                "Hermod's DDP hooks, ALEPH and SYNDICATE cannot share a bucket group (install one of them)"
            )
