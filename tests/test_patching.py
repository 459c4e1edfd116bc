"""flowlane.patching on plain objects (the plugins' tests run it on Megatron-core's and DeepSpeed's): a patch is
undone only while it holds its own value, a feature's patches are checked together before any is undone, a second
undo does nothing, and an inherited attribute is removed again rather than copied onto the object."""

import pytest

from flowlane.patching import Patch, undo_all


class _Backend:
    def send(self) -> str:
        return "class"


def test_patches_undo_in_reverse_install_order_only() -> None:
    b = _Backend()
    first = [
        Patch(b, "send", lambda: "first", "flowlane.a"),
        Patch(_Backend, "recv", lambda self: 1, "flowlane.a"),
    ]
    second = [Patch(b, "send", lambda: "second", "flowlane.b")]
    with pytest.raises(RuntimeError, match=r"flowlane\.a: cannot close: _Backend\.send was wrapped again"):
        undo_all(first)
    assert b.send() == "second" and hasattr(_Backend, "recv")  # the refused close changed nothing
    undo_all(second)
    assert b.send() == "first"
    undo_all(first)
    assert "send" not in vars(b) and b.send() == "class" and not hasattr(_Backend, "recv")
    stale = Patch(b, "send", lambda: "x", "flowlane.c")
    stale()
    stale()  # a second undo does nothing
    assert "send" not in vars(b)
