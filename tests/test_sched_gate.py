"""The comm scheduler's gate in one process (no process group): which critical ops hold deferred chunks back.
Hermod gates on every critical op (EP, PP, CP before DP); ``gate_ctypes=("ep",)`` is the thesis' Lina baseline (EP
before DP only), so a pipeline send no longer holds DP back."""

import threading
import time

import pytest

from flowlane.coflow import HermodOrderConfig
from flowlane.policy import CoflowMeta
from flowlane.sched.hermod import HermodPolicy
from flowlane.sched.scheduler import CommScheduler, SchedulerConfig


def _dp_launched_while_inside(ctype: str, gate_ctypes: tuple[str, ...] | None) -> bool:
    """Defer a one-chunk DP op inside a critical section of ``ctype``; did it go out before the section ended?"""
    sched = CommScheduler(config=SchedulerConfig(gate_timeout_s=30.0, gate_ctypes=gate_ctypes))
    launched = threading.Event()
    try:
        with sched.critical_section(CoflowMeta(ctype, microbatch=0, layer=0, op="send_fwd")):
            h = sched.defer(CoflowMeta("dp", microbatch=3, layer=1, op="reduce_scatter"), [launched.set])
            sched.seal()
            inside = launched.wait(0.3)
        h.wait()  # out of the section the gate opens: the chunk goes out either way
        assert launched.is_set()
    finally:
        sched.close()
    return inside


@pytest.mark.parametrize("ctype", ["pp", "ep"])
def test_hermod_holds_dp_behind_every_critical_op(ctype):
    assert not _dp_launched_while_inside(ctype, None)


def test_lina_gate_holds_dp_behind_all_to_alls_only():
    assert not _dp_launched_while_inside("ep", ("ep",))
    assert _dp_launched_while_inside("pp", ("ep",))


def test_a_non_gating_critical_op_still_seals_its_window():
    """Sealing is a program-order point on every rank (identical launch sequences), whatever the gate does."""
    sched = CommScheduler(HermodPolicy(HermodOrderConfig(4)), SchedulerConfig(gate_ctypes=("ep",)))
    try:
        order: list[str] = []
        with sched.critical_section(CoflowMeta("ep", microbatch=0, layer=0, op="dispatch")):
            a = sched.defer(CoflowMeta("dp", microbatch=3, layer=2, op="reduce_scatter"), [lambda: order.append("a")])
            with sched.critical_section(CoflowMeta("pp", microbatch=0, layer=0, op="send_fwd")):
                b = sched.defer(CoflowMeta("dp", microbatch=3, layer=0, op="reduce_scatter"),
                                [lambda: order.append("b")])
        t0 = time.monotonic()
        b.wait()
        a.wait()
        assert time.monotonic() - t0 < 5
        # a was sealed (by the pp section) before b was deferred: a goes first although b's key ranks higher
        # (lower layer); in one window Hermod's order would have launched b first
        assert order == ["a", "b"]
        assert [e.event for e in sched.log if e.event == "critical"] == ["critical", "critical"]
    finally:
        sched.close()


@pytest.mark.parametrize("bad", ["ep", ("ep", 3)])
def test_bad_gate_ctypes_are_named(bad):
    with pytest.raises(ValueError, match="gate_ctypes"):
        SchedulerConfig(gate_ctypes=bad)


def test_a_non_gating_critical_op_wakes_the_pacer_for_what_it_sealed():
    """A DP op deferred before a pipeline send is sealed by it; under Lina's gate it must go out during the send."""
    sched = CommScheduler(config=SchedulerConfig(gate_timeout_s=30.0, gate_ctypes=("ep",)))
    launched = threading.Event()
    try:
        h = sched.defer(CoflowMeta("dp", microbatch=3, layer=1, op="reduce_scatter"), [launched.set])
        time.sleep(0.05)  # the pacer is idle, waiting for a notification
        with sched.critical_section(CoflowMeta("pp", microbatch=0, layer=0, op="send_fwd")):
            assert launched.wait(2.0)
        h.wait()
    finally:
        sched.close()
