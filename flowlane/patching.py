"""Undoing a feature's patches in any framework: each patch removes only its own wrapper.

Two features may wrap the same attribute (on Megatron-core, Hermod and ALEPH / SYNDICATE both wrap
``config.finalize_model_grads_func``; on DeepSpeed, Hermod's tap and ALEPH / SYNDICATE both wrap the comm backend's
``all_reduce``). Restoring, unconditionally, what a feature saw at install would, closed in install order, drop the
later feature's wrapper, and the later feature's close would then put back the first one's closed wrapper: training
after a partial close runs the wrong code. So a :class:`Patch` is undone only while the attribute still holds its own
value, and a feature checks all its patches (:func:`undo_all`) before it undoes any: out of order, its close is refused
and changes nothing. Closing in the reverse order of install (the last installed first) always works. Framework-free:
the plugins use it on their frameworks' objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any


def _owner_name(obj: Any) -> str:
    return obj.__name__ if isinstance(obj, type | ModuleType) else type(obj).__name__


class Patch:
    """``setattr(obj, name, value)`` on an instance, a class or a module, remembering what ``obj`` itself held before
    (its own ``vars``: an inherited attribute is removed again, not copied in). Calling it undoes the patch:
    idempotent, and refused, changing nothing, when ``obj.<name>`` no longer holds ``value``
    (:meth:`check_removable`). ``feature`` (e.g. ``flowlane.hermod``) names the feature in that error."""

    def __init__(self, obj: Any, name: str, value: Any, feature: str) -> None:
        self.obj, self.name, self.value, self.feature = obj, name, value, feature
        self.had = name in vars(obj)
        self.old = vars(obj).get(name)
        self.active = True
        setattr(obj, name, value)

    def check_removable(self) -> None:
        """Raise when undoing would remove what is not this patch's: the attribute was wrapped again after it."""
        if self.active and vars(self.obj).get(self.name) is not self.value:
            raise RuntimeError(
                f"{self.feature}: cannot close: {_owner_name(self.obj)}.{self.name} was wrapped again after it was "
                "installed (another flowlane feature or user code); close the features in the reverse order of "
                "their install (the last installed first)"
            )

    def __call__(self) -> None:
        if not self.active:
            return
        self.check_removable()
        if self.had:
            setattr(self.obj, self.name, self.old)
        else:
            delattr(self.obj, self.name)
        self.active = False


def check_all(patches: Iterable[Patch]) -> None:
    """Raise (:meth:`Patch.check_removable`) if any of ``patches`` cannot be undone."""
    for p in patches:
        p.check_removable()


def undo_all(patches: list[Patch]) -> None:
    """Undo ``patches`` (in install order) last first, checking all of them first: a refused close changes nothing.
    Empties the list."""
    check_all(patches)
    for p in reversed(patches):
        p()
    patches.clear()
