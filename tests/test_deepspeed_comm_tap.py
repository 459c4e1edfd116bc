"""CommTap's close on DeepSpeed's own backend class (``deepspeed.comm.torch.TorchBackend``, one process, no
collective run): close removes only the wrappers it installed and puts back what it wrapped, a second close does
nothing, and a close out of order (a method wrapped again after the tap, or the tap no longer the backend's) is
refused with the close-order message, changing nothing."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

pytestmark = pytest.mark.llm
pytest.importorskip("deepspeed")

from deepspeed_plugin.comm import CommTap  # noqa: E402


@pytest.fixture
def cdb(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A TorchBackend instance as ``deepspeed.comm.comm.cdb`` (``__init__`` skipped: it would start a process
    group; installing and closing the tap reads only the class's methods and signatures)."""
    import deepspeed.comm.comm as dscomm

    backend = object.__new__(importlib.import_module("deepspeed.comm.torch").TorchBackend)
    monkeypatch.setattr(dscomm, "cdb", backend)
    return backend


def _other(*args: Any, **kwargs: Any) -> None:
    """Somebody else's wrapper (another feature, user code)."""


def test_close_is_idempotent_and_puts_back_the_wrapper_it_wrapped(cdb: Any) -> None:
    tap = CommTap(None)
    tap.close()
    assert vars(cdb) == {}
    cdb.all_reduce = _other  # installed after the tap's close (e.g. ALEPH on the bare backend)
    tap.close()  # a second close: nothing of the tap's is left to remove
    assert vars(cdb) == {"all_reduce": _other}
    tap2 = CommTap(
        None
    )  # the backend takes a new tap (over that wrapper); the old one's close still does nothing
    tap.close()
    assert cdb._flowlane_tap is tap2 and vars(cdb)["broadcast"] is not _other
    tap2.close()
    assert vars(cdb) == {"all_reduce": _other}  # put back, not removed: the tap wrapped it


def test_close_out_of_order_is_refused_and_changes_nothing(cdb: Any) -> None:
    tap = CommTap(None)
    before = dict(vars(cdb))
    cdb.all_reduce = _other  # wrapped again over the tap
    with pytest.raises(RuntimeError, match=r"TorchBackend\.all_reduce was wrapped again .* reverse order"):
        tap.close()
    assert dict(vars(cdb)) == {**before, "all_reduce": _other}  # the other wrapper and the tap's others stay
    cdb.all_reduce = before["all_reduce"]  # the later wrapper closes first: now the tap may go
    tap.close()
    assert vars(cdb) == {}

    tap = CommTap(None)
    other_tap = object()
    cdb._flowlane_tap = other_tap  # no longer the backend's tap
    before = dict(vars(cdb))
    with pytest.raises(RuntimeError, match="no longer the backend's tap.* reverse order"):
        tap.close()
    assert dict(vars(cdb)) == before
    cdb._flowlane_tap = tap
    tap.close()
    assert vars(cdb) == {}


class _Engine:
    """Stands in for a DeepSpeed engine: ``step`` and the accumulation boundary are all ``after_iteration`` reads."""

    def step(self) -> str:
        return "stepped"

    def is_gradient_accumulation_boundary(self) -> bool:
        return True


def test_aleph_and_syndicate_wraps_undo_only_their_own_and_refuse_out_of_order(
    cdb: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ALEPH's and SYNDICATE's wraps of the backend's all_reduce and the engine's step: undone in reverse order they
    leave the instances as they found them; a method wrapped again after them refuses the close, changing nothing
    (the undo used to pop whatever was there, a later feature's wrapper included)."""
    import torch.distributed as dist

    from deepspeed_plugin.comm import after_iteration, route_dp_all_reduce
    from flowlane.patching import undo_all

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    engine, ends = _Engine(), []
    reduce_wrap = route_dp_all_reduce(cdb, (0, 1), lambda t, a: None, "flowlane.aleph")
    step_wrap = after_iteration(engine, lambda: ends.append(1), "flowlane.aleph")
    assert engine.step() == "stepped" and ends == [1]
    cdb.all_reduce = _other  # a later install wraps the routed all_reduce
    with pytest.raises(RuntimeError, match=r"flowlane\.aleph: cannot close: .*all_reduce was wrapped again"):
        undo_all([reduce_wrap, step_wrap])
    assert vars(cdb) == {"all_reduce": _other} and "step" in vars(engine)  # nothing undone
    cdb.all_reduce = reduce_wrap.value  # the later one closed first
    undo_all([reduce_wrap, step_wrap])
    undo_all([reduce_wrap, step_wrap])  # a second close does nothing
    assert vars(cdb) == {} and vars(engine) == {}
    engine.step = _other  # an instance wrapper from before: put back, not removed
    undo_all([after_iteration(engine, lambda: None, "flowlane.syndicate")])
    assert vars(engine) == {"step": _other}
