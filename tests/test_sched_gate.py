"""The comm scheduler's gate in one process (no process group): which critical ops hold deferred chunks back.
Hermod gates on every critical op (EP, PP, CP before DP); ``gate_ctypes=("ep",)`` is the thesis' Lina baseline (EP
before DP only), so a pipeline send no longer holds DP back."""

import threading
import time

import pytest

from flowlane.hermod.order import HermodOrderConfig
from flowlane.hermod.policy import HermodPolicy
from flowlane.policy import CoflowMeta
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
            a = sched.defer(
                CoflowMeta("dp", microbatch=3, layer=2, op="reduce_scatter"), [lambda: order.append("a")]
            )
            with sched.critical_section(CoflowMeta("pp", microbatch=0, layer=0, op="send_fwd")):
                b = sched.defer(
                    CoflowMeta("dp", microbatch=3, layer=0, op="reduce_scatter"), [lambda: order.append("b")]
                )
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


def test_the_log_keeps_its_newest_entries_and_the_counts_stay_whole():
    """A long run logs every chunk: the log keeps the newest ``log_entries``, ``events`` counts them all."""
    sched = CommScheduler(HermodPolicy(HermodOrderConfig(4)), SchedulerConfig(log_entries=3))
    try:
        for i in range(5):
            with sched.critical_section(CoflowMeta("pp", microbatch=i, layer=0, op="send_fwd")):
                pass
        assert len(sched.log) == 3 and [e.meta.microbatch for e in sched.log] == [2, 3, 4]
        assert sched.events["critical"] == 5
    finally:
        sched.close()
    with pytest.raises(ValueError, match="log_entries must be an integer >= 0, got -1"):
        SchedulerConfig(log_entries=-1)


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


class _NeverCompletes:
    """Like torch 2.15's gloo reduce_scatter_tensor work: ``wait()`` blocks until done, ``is_completed()`` never turns
    true. A pacer that polled ``is_completed()`` hung on it (the distributed-optimizer tests did)."""

    def __init__(self, run_s: float, events: list[str], name: str) -> None:
        self.run_s, self.events, self.name = run_s, events, name

    def wait(self, timeout=None) -> bool:
        time.sleep(self.run_s)
        self.events.append(f"{self.name} done")
        return True

    def is_completed(self) -> bool:
        return False


def test_the_pacer_keeps_one_chunk_in_flight_and_trusts_wait():
    """With one chunk in flight, the second chunk goes out only after the first one's ``wait()`` returned, and the
    op completes although its works never report ``is_completed()``."""
    events: list[str] = []
    sched = CommScheduler(config=SchedulerConfig(max_inflight_chunks=1))
    try:

        def launch(name: str):
            def go():
                events.append(f"{name} launched")
                return _NeverCompletes(0.1, events, name)

            return go

        t0 = time.monotonic()
        h = sched.defer(
            CoflowMeta("dp", microbatch=0, layer=0, op="reduce_scatter"), [launch("a"), launch("b")]
        )
        sched.seal()
        while not h.is_completed() and time.monotonic() - t0 < 10:  # no wait(): that would make the op urgent
            time.sleep(0.01)
        assert h.is_completed() and time.monotonic() - t0 < 5
        assert events == ["a launched", "a done", "b launched", "b done"]
    finally:
        sched.close()


class _FailingWork:
    def wait(self, timeout=None) -> bool:
        raise RuntimeError("Connection closed by peer")


def test_a_chunk_failing_while_waited_for_fails_its_op_at_once():
    """The pacer used to take a chunk off its in-flight list before waiting for it, so when the wait raised, the op
    was never marked failed and its handle waited out ``wait_timeout_s`` (300 s by default) instead."""
    sched = CommScheduler(config=SchedulerConfig(wait_timeout_s=120.0))
    try:
        h = sched.defer(CoflowMeta("dp", microbatch=0, layer=0, op="reduce_scatter"), [_FailingWork])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="failed") as e:
            h.wait()
        assert time.monotonic() - t0 < 5
        assert "Connection closed by peer" in str(e.value.__cause__)
    finally:
        with pytest.raises(RuntimeError, match="failed"):  # close() surfaces the failure too
            sched.close()


class _SlowFailingWork:
    def wait(self, timeout=None) -> bool:
        time.sleep(0.5)
        raise RuntimeError("Connection closed by peer")


def test_an_op_still_in_the_open_window_fails_at_once_when_the_pacer_fails():
    """An op deferred before the pacer failed but not yet sealed (so neither in flight nor queued) was left
    un-failed: its wait sealed it into a queue no thread would run again and waited out ``wait_timeout_s``."""
    sched = CommScheduler(config=SchedulerConfig(wait_timeout_s=120.0))
    try:
        bad = sched.defer(CoflowMeta("dp", microbatch=0, layer=0, op="reduce_scatter"), [_SlowFailingWork])
        sched.seal()
        # deferred while the pacer waits on the failing chunk: it stays in the open window
        later = sched.defer(CoflowMeta("dp", microbatch=0, layer=1, op="reduce_scatter"), [lambda: None])
        deadline = time.monotonic() + 60
        while not bad.is_completed() and time.monotonic() < deadline:  # no wait(): it would seal ``later``
            time.sleep(0.01)
        assert bad.is_completed()
        # the pacer's own error, not the TimeoutError that waiting out wait_timeout_s would raise
        with pytest.raises(RuntimeError, match="failed") as e:
            later.wait()
        assert "Connection closed by peer" in str(e.value.__cause__)
    finally:
        with pytest.raises(RuntimeError, match="failed"):
            sched.close()


def test_a_held_critical_op_keeps_dp_back_until_released_and_release_counts_once():
    """``hold``: Megatron's overlapped pipeline p2p is launched now and waited for later, elsewhere."""
    sched = CommScheduler(config=SchedulerConfig(gate_timeout_s=30.0))
    launched = threading.Event()
    try:
        release = sched.hold(CoflowMeta("pp", microbatch=0, layer=0, op="send_next"))
        h = sched.defer(CoflowMeta("dp", microbatch=3, layer=1, op="all_reduce"), [launched.set])
        sched.seal()
        assert not launched.wait(0.3) and sched.outstanding_critical == 1
        release()
        release()  # idempotent: the gate's count drops once
        h.wait()
        assert launched.is_set() and sched.outstanding_critical == 0
    finally:
        sched.close()


def test_program_order_launches_each_sealed_window_at_once_in_key_order_on_the_sealing_thread():
    """``launch="program_order"`` (Hermod on NCCL): no pacer thread; a seal point launches its whole window, in key
    order, from the thread that reached it, whatever critical op is outstanding (no timing dependence)."""
    policy = HermodPolicy(HermodOrderConfig(4))
    sched = CommScheduler(policy, SchedulerConfig(launch="program_order"))
    seen: list[tuple[str, str]] = []
    metas = {
        "l0": CoflowMeta("dp", microbatch=3, layer=0, op="all_reduce", seq=1),
        "l5": CoflowMeta("dp", microbatch=3, layer=5, op="all_reduce", seq=2),
    }
    try:
        assert sched._thread is None
        handles = {
            name: sched.defer(m, [lambda name=name: seen.append((name, threading.current_thread().name))])
            for name, m in metas.items()
        }
        assert seen == []  # nothing goes out before a seal point
        release = sched.hold(CoflowMeta("pp", microbatch=0, layer=0, op="send_next"))  # outstanding: no gate
        sched.seal()
        expected = [n for n, _ in sorted(metas.items(), key=lambda kv: policy.order(kv[1]))]
        assert [n for n, _ in seen] == expected
        assert {t for _, t in seen} == {threading.current_thread().name}
        release()
        assert all(h.wait() for h in handles.values()) and not sched._live
    finally:
        sched.close()
    with pytest.raises(ValueError, match=r"launch 'thread' is not one of \['pacer', 'program_order'\]"):
        SchedulerConfig(launch="thread")  # type: ignore[arg-type]


class _Payload:
    """Stands in for what a launch closure holds (DeepSpeed's detached bucket and its buffer)."""


@pytest.mark.parametrize("mode", ["pacer", "program_order", "fifo"])
def test_a_finished_op_keeps_nothing_its_launch_held_while_its_handle_lives(mode):
    """The DeepSpeed adapter keeps every handle until the end of backward; each handle's chunk kept its launch closure
    and with it the bucket's buffer after the reduction, so a backward held about the whole model's gradients twice
    (review: 5 finished handles held 396,480 B under ZeRO-2). A launched chunk now drops its launch."""
    import gc
    import weakref

    config = (
        SchedulerConfig(mode="fifo") if mode == "fifo" else SchedulerConfig(launch=mode)  # type: ignore[arg-type]
    )
    sched = CommScheduler(config=config)
    try:
        payloads = [_Payload(), _Payload()]
        alive = [weakref.ref(p) for p in payloads]
        h = sched.defer(
            CoflowMeta("dp", microbatch=0, layer=0, op="all_reduce"),
            [lambda p=p: (p, None)[1] for p in payloads],
        )
        del payloads
        assert h.wait() and h.is_completed()
        gc.collect()
        assert [r() for r in alive] == [None, None]
    finally:
        sched.close()


def test_the_pacer_moves_to_the_callers_cuda_device_before_its_first_launch(monkeypatch):
    """The current CUDA device is per thread: the pacer set the caller's only before its first wait, so the first
    launch (DeepSpeed's bucket function runs in the pacer) ran on device 0 (torch.cuda mocked: no GPU needed)."""
    import torch

    from flowlane.sched import scheduler

    events: list[tuple] = []

    class _Stream:
        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: events.append(("set_device", d, threading.current_thread().name))
    )
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(scheduler, "_wait_done", lambda work, stream: events.append(("wait", type(stream))))
    sched = CommScheduler(config=SchedulerConfig())
    try:
        h = sched.defer(
            CoflowMeta("dp", microbatch=0, layer=0, op="all_reduce"),
            [lambda: events.append(("launch", threading.current_thread().name))],
        )
        h.wait()
    finally:
        sched.close()
    pacer = "flowlane-hermod-pacer"
    assert events == [("set_device", 3, pacer), ("launch", pacer), ("wait", _Stream)]
