"""The byte budget of activation offloading: how much the link can move while compute runs (seed 003 §5.3.5).

SSDTrain's adaptive offloading keeps the last layers in memory so that offloading adds no step time (thesis §5.3.5,
Fig. 5.9); its selector (``adaptive.py``) compares an average bandwidth with one window. On a GPU the copies run on
their own streams in FIFO order, so this module replays the step instead: a timeline of one micro-batch with

- forward: layer (group) ``i`` computes for ``fwd_s[i]``; its stores (``allow[i]`` bytes) enter the store stream when
  its forward ends (one bulk copy per layer) and move at ``store_Bps``;
- backward: layers in reverse order, ``bwd_s[i]`` each, after ``head_s`` (loss, output layer); the reload of layer
  ``i`` is issued when the backward of layer ``i + prefetch`` begins (one group ahead by default), waits for its own
  store, and moves at ``load_Bps`` on the load stream; layer ``i``'s backward cannot begin before its reload ends.

Compute never waits for a store (no host waits), so the only cost is backward waiting for reloads: ``exposed_s``.
:func:`choose_budget` offloads bytes front to back (the earliest layers have the longest windows; the layers reloaded
first stay resident) and keeps the largest amount whose exposed time is <= ``slack_s``. The last layer is never
offloaded: its backward follows its forward at once (thesis §5.3.4, Fig. 5.5), so its copy only delays frees. Exposed
time never falls when bytes are added to the front-to-back order, so a bisection finds it. Bytes beyond the hidden
amount (``slack_s > 0``) are added layer by layer only while each layer's added exposed time is below its forward
time (past that, recomputing the layer is cheaper than waiting for it: "never offload what is cheaper to
recompute") and the modelled peak (:func:`peak_resident`) falls: bytes that lower no peak would cost time for nothing.

With ``recompute``, the time left in ``slack_s`` buys memory the link cannot: layers kept whole are recomputed in
backward instead (their forward runs again under ``torch.utils.checkpoint``; seed 003 §5.4.3 weighs keep, offload and
recompute per tensor). The memory peak sits where backward begins, and a store frees device memory only once its copy
ran, so past the bytes the link moves during forward only recomputation lowers it. The earliest kept layers go first:
their recomputation happens last in backward, after the later layers' activations were freed (recomputing the last
layer would rebuild it at the peak and save nothing, so it is never chosen). Each costs its forward time, added to its
backward in the timeline.

What a plan saves at the memory peak is modelled too (:func:`peak_resident`): stores still queued when backward
begins have not freed their device memory yet (:func:`resident_at_backward_start`), and later each layer's backward
holds that layer whole plus the reloads issued ahead of it, so offloading every layer but the last stops at two layers
(with ``prefetch=1``; measured on an H200, results/gpu). Recomputation is bought only while it lowers that peak.

Pure Python: the tensor cache feeds it CUDA-event timings of a profiled micro-batch; ``flowlane ssd-estimate`` feeds it
modelled sizes and times.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepProfile:
    """What one micro-batch looked like (forward order of layers)."""

    group_bytes: tuple[int, ...]
    """Offloadable bytes per layer (saved activations above the size threshold, parameters excluded)."""
    fwd_s: tuple[float, ...]
    """Forward compute time per layer, seconds."""
    bwd_s: tuple[float, ...]
    """Backward compute time per layer, seconds."""
    store_Bps: float
    """Store link rate, bytes/s (PCIe device-to-host; for SSD the slower of that and the disk's write rate)."""
    load_Bps: float
    """Reload link rate, bytes/s (host-to-device; for SSD the slower of that and the disk's read rate)."""
    head_s: float = 0.0
    """Compute between the last layer's forward and its backward (output layer, loss), seconds."""

    def __post_init__(self) -> None:
        n = len(self.group_bytes)
        if len(self.fwd_s) != n or len(self.bwd_s) != n:
            raise ValueError(
                f"group_bytes ({n}), fwd_s ({len(self.fwd_s)}) and bwd_s ({len(self.bwd_s)}) must have "
                "one entry per layer"
            )
        for name, xs in (("group_bytes", self.group_bytes), ("fwd_s", self.fwd_s), ("bwd_s", self.bwd_s)):
            for x in xs:
                if not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0):
                    raise ValueError(f"{name} entry {x!r} must be a finite number >= 0")
        for name in ("store_Bps", "load_Bps"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
                raise ValueError(f"{name}={v!r} must be > 0 bytes/s")
        if not (math.isfinite(self.head_s) and self.head_s >= 0):
            raise ValueError(f"head_s={self.head_s!r} must be a finite number >= 0")

    @classmethod
    def from_stats(cls, profile: dict) -> StepProfile:
        """The profile a tensor cache recorded (``OffloadStats.profile``, also in the GPU bench's JSON)."""
        return cls(
            tuple(profile["sizes"]),
            tuple(profile["fwd_times_s"]),
            tuple(profile["bwd_times_s"]),
            profile["write_bandwidth_Bps"],
            profile["read_bandwidth_Bps"],
            profile["head_s"],
        )

    @property
    def step_s(self) -> float:
        """Compute time of the micro-batch without offloading."""
        return sum(self.fwd_s) + self.head_s + sum(self.bwd_s)


@dataclass(frozen=True)
class Budget:
    """The bytes to offload per layer and what the timeline model says they cost."""

    allow_bytes: tuple[int, ...]
    """Bytes of each layer to offload (forward order); the rest stays resident."""
    exposed_s: float
    """Modelled time backward waits for reloads with this plan."""
    step_s: float
    """Compute time of the micro-batch without offloading (the profile's)."""
    recompute_cheaper: tuple[bool, ...]
    """Layers left out because waiting for their transfer would cost more than recomputing their forward."""
    resident_bytes: float = 0.0
    """Modelled saved-activation bytes on the device when backward begins (:func:`resident_at_backward_start`), less
    the layers recomputed."""
    recompute: tuple[bool, ...] = ()
    """Layers recomputed in backward instead of kept (``choose_budget(recompute=True)``); empty: none."""
    recompute_s: float = 0.0
    """Modelled time the recomputations add (their forward times)."""
    peak_bytes: float = 0.0
    """Modelled peak of saved-activation bytes on the device over the step (:func:`peak_resident`)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.allow_bytes)

    @property
    def keep_last_k(self) -> int:
        """Trailing layers with nothing offloaded."""
        k = 0
        for a in reversed(self.allow_bytes):
            if a:
                break
            k += 1
        return k

    def as_dict(self) -> dict:
        return {
            "allow_bytes": list(self.allow_bytes),
            "total_bytes": self.total_bytes,
            "exposed_s": self.exposed_s,
            "step_s": self.step_s,
            "keep_last_k": self.keep_last_k,
            "recompute_cheaper": list(self.recompute_cheaper),
            "resident_bytes_at_backward_start": self.resident_bytes,
            "recompute": list(self.recompute),
            "recompute_s": self.recompute_s,
            "peak_bytes": self.peak_bytes,
        }


def with_recompute(p: StepProfile, recompute: Sequence[bool]) -> StepProfile:
    """The profile with each recomputed layer's forward added to its backward."""
    if not any(recompute):
        return p
    bwd = tuple(b + (f if r else 0.0) for b, f, r in zip(p.bwd_s, p.fwd_s, recompute, strict=True))
    return StepProfile(p.group_bytes, p.fwd_s, bwd, p.store_Bps, p.load_Bps, p.head_s)


def choose_recompute(
    p: StepProfile, allow: Sequence[int], prefetch: int = 1, slack_s: float = 0.0
) -> tuple[bool, ...]:
    """Layers to recompute instead of keep, given the offload plan ``allow`` (module docstring): candidates are the
    layers with bytes saved and none offloaded, except the last; front to back, while the forward times added plus the
    modelled wait stay <= ``slack_s``, each only if it lowers the modelled peak (:func:`peak_resident`)."""
    n = len(p.group_bytes)
    if len(allow) != n:
        raise ValueError(f"allow has {len(allow)} entries for {n} layers")
    chosen = [False] * n
    spent = 0.0
    peak = peak_resident(p, allow, prefetch)
    for i in range(n - 1):
        if allow[i] or not p.group_bytes[i]:
            continue
        trial = chosen.copy()
        trial[i] = True
        cost = spent + p.fwd_s[i] + exposed_time(with_recompute(p, trial), allow, prefetch)
        if cost > slack_s:
            break
        lower = peak_resident(p, allow, prefetch, trial)
        if lower >= peak:  # the peak sits elsewhere (a later layer's backward): recomputing buys nothing
            continue
        chosen, spent, peak = trial, spent + p.fwd_s[i], lower
    return tuple(chosen)


def _store_ends(p: StepProfile, allow: Sequence[int]) -> list[float]:
    """When each layer's store ends: one bulk copy per layer, queued when its forward ends, moved in FIFO order at
    ``store_Bps`` (a layer with nothing offloaded ends with the queue)."""
    t = 0.0
    free = 0.0
    ends: list[float] = []
    for f, a in zip(p.fwd_s, allow, strict=True):
        t += f
        if a:
            free = max(free, t) + a / p.store_Bps
        ends.append(free)
    return ends


def _timeline(p: StepProfile, allow: Sequence[int], prefetch: int) -> tuple[list[float], list[float], float]:
    """The module docstring's timeline: (when each layer's store ends, when each layer's backward begins, seconds
    backward waited for reloads)."""
    n = len(p.group_bytes)
    if len(allow) != n:
        raise ValueError(f"allow has {len(allow)} entries for {n} layers")
    if prefetch < 1:
        raise ValueError(f"prefetch={prefetch} must be >= 1")
    done = _store_ends(p, allow)
    t = sum(p.fwd_s) + p.head_s
    waited = 0.0
    load_free = 0.0
    issued: dict[int, float] = {}
    begins = [0.0] * n
    for i in range(n - 1, -1, -1):
        # reloads issued when this layer's backward is about to begin: itself (if not yet) and `prefetch` ahead
        for j in range(i, max(-1, i - prefetch - 1), -1):
            if j not in issued:
                issued[j] = t
                if allow[j]:
                    load_free = max(load_free, t, done[j]) + allow[j] / p.load_Bps
                    issued[j] = load_free
                else:
                    issued[j] = t
        if issued[i] > t:  # layer i's backward waits for its reload
            waited += issued[i] - t
            t = issued[i]
        begins[i] = t
        t += p.bwd_s[i]
    return done, begins, waited


def exposed_time(p: StepProfile, allow: Sequence[int], prefetch: int = 1) -> float:
    """Seconds backward waits for reloads when ``allow[i]`` bytes of layer ``i`` are offloaded (module docstring)."""
    return _timeline(p, allow, prefetch)[2]


#: a point of the step where the tensor cache runs a hook: ("forward", j) when layer j's forward starts,
#: ("backward", k) when layer k's backward begins
Point = tuple[str, int]


def release_points(
    p: StepProfile, allow: Sequence[int], prefetch: int = 1, recompute: Sequence[bool] = ()
) -> tuple[Point | None, ...]:
    """Where each offloaded layer's device memory can go back to the allocator in the compute stream's order
    (``OffloadConfig.release="stream_order"``): the first hook point at or after the modelled end of the layer's
    store, a later layer's forward start or, in backward, a layer's backward begin, at the latest the layer's own.
    There the compute stream waits for the store's event, which the timeline says has fired, and the layer's
    tensors are dropped: the allocator reuses their blocks for the work that follows, in stream order, instead of
    when the host next finds the event complete (``record_stream``). ``None`` for a layer with nothing offloaded."""
    n = len(p.group_bytes)
    again = tuple(recompute) or (False,) * n
    done, begins, _ = _timeline(with_recompute(p, again), allow, prefetch)
    starts = [sum(p.fwd_s[:j]) for j in range(n)]
    points: list[Point | None] = []
    for i in range(n):
        if not allow[i]:
            points.append(None)
            continue
        point: Point = ("backward", i)
        later = [("forward", j) for j in range(i + 1, n) if starts[j] >= done[i]]
        if later:
            point = later[0]
        else:
            ready = [k for k in range(n - 1, i, -1) if begins[k] >= done[i]]
            if ready:
                point = ("backward", ready[0])
        points.append(point)
    return tuple(points)


def resident_at_backward_start(p: StepProfile, allow: Sequence[int]) -> float:
    """Bytes of saved activations still on the device when backward begins, where the memory peak of a step sits:
    the bytes kept plus the offloaded bytes whose store has not finished by then (a device block is reused only after
    its copy ran). A link that cannot store a layer within the forward caps what offloading saves at the peak, even
    when every reload is hidden."""
    ends = _store_ends(p, allow)
    t_b = sum(p.fwd_s) + p.head_s
    resident = float(sum(p.group_bytes) - sum(allow))
    for i, a in enumerate(allow):
        if a and ends[i] > t_b:  # the tail of the FIFO: the part of layer i not yet copied
            resident += min(a, (ends[i] - t_b) * p.store_Bps)
    return resident


def peak_resident(
    p: StepProfile, allow: Sequence[int], prefetch: int = 1, recompute: Sequence[bool] = ()
) -> float:
    """Modelled peak of saved-activation bytes on the device: the larger of the bytes resident where backward begins
    (:func:`resident_at_backward_start`, less the layers recomputed) and, while layer ``i``'s backward runs, the bytes
    kept by the layers before it, layer ``i`` whole (kept, reloaded or recomputed) and the reloads already issued for
    the ``prefetch`` layers whose backward comes next (``i - 1`` down to ``i - prefetch``; module docstring)."""
    n = len(p.group_bytes)
    if len(allow) != n:
        raise ValueError(f"allow has {len(allow)} entries for {n} layers")
    again = tuple(recompute) or (False,) * n
    if len(again) != n:
        raise ValueError(f"recompute has {len(again)} entries for {n} layers")
    kept = [0 if r else g - a for g, a, r in zip(p.group_bytes, allow, again, strict=True)]
    peak = resident_at_backward_start(p, allow) - sum(
        g for g, r in zip(p.group_bytes, again, strict=True) if r
    )
    before = 0.0
    for i in range(n):
        ahead = sum(allow[max(0, i - prefetch) : i])
        peak = max(peak, before + p.group_bytes[i] + ahead)
        before += kept[i]
    return peak


def _fill(p: StepProfile, total: int, eligible: Sequence[bool]) -> list[int]:
    out = [0] * len(p.group_bytes)
    left = total
    for i, s in enumerate(p.group_bytes):
        if not eligible[i]:
            continue
        take = min(s, left)
        out[i] = take
        left -= take
        if left <= 0:
            break
    return out


def choose_budget(
    p: StepProfile,
    prefetch: int = 1,
    slack_s: float = 0.0,
    granularity: int = 1 << 16,
    recompute: bool = False,
) -> Budget:
    """The most bytes, filled front to back over every layer but the last, whose modelled exposed time is <=
    ``slack_s`` and, past the hidden amount, that each lower the modelled peak (module docstring); with ``recompute``,
    then the kept layers that the rest of ``slack_s`` can recompute (:func:`choose_recompute`).

    ``granularity`` rounds the bisection (bytes); a layer's share is a byte allowance, which the cache fills with
    whole storages in the order they were saved."""
    if not (math.isfinite(slack_s) and slack_s >= 0):
        raise ValueError(f"slack_s={slack_s!r} must be a finite number >= 0")
    n = len(p.group_bytes)
    # never the last layer: its backward follows its forward at once, so offloading it only delays frees (thesis
    # §5.3.4, Fig. 5.5; digest §2.2.4, §2.2.8)
    eligible = [i < n - 1 for i in range(n)]
    cheaper = [False] * n

    def cost(total: int) -> float:
        return exposed_time(p, _fill(p, total, eligible), prefetch)

    def best(limit_s: float, hi: int) -> int:
        if cost(hi) <= limit_s:
            return hi
        lo = 0
        for edge in itertools.accumulate(p.group_bytes):  # whole layers first, then bytes of the next one
            if edge >= hi:
                break
            if cost(edge) > limit_s:
                hi = edge
                break
            lo = edge
        while hi - lo > granularity:
            mid = (lo + hi) // 2
            if cost(mid) <= limit_s:
                lo = mid
            else:
                hi = mid
        return lo

    def peak(total: int) -> float:
        return peak_resident(p, _fill(p, total, eligible), prefetch)

    total_all = sum(g for g, e in zip(p.group_bytes, eligible, strict=True) if e)
    hidden = best(0.0, total_all)
    chosen = hidden
    if slack_s > 0:
        # extend layer by layer while each layer's added wait is below its recompute (forward) time and the
        # modelled peak falls (bytes that lower no peak cost step time for nothing)
        filled = _fill(p, hidden, eligible)
        for i in range(n):
            if not eligible[i] or filled[i] >= p.group_bytes[i]:
                continue
            before = cost(chosen)
            full = chosen + (p.group_bytes[i] - filled[i])
            extra = cost(full) - before
            if extra > p.fwd_s[i]:
                cheaper[i] = True
                for j in range(i, n):  # later layers have shorter windows: at least as costly
                    cheaper[j] = cheaper[j] or (eligible[j] and p.group_bytes[j] > 0)
                break
            more = full if cost(full) <= slack_s else best(slack_s, full)
            if peak(more) >= peak(chosen):
                break
            chosen = more
            if more < full:
                break
    allow = _fill(p, chosen, eligible)
    again = choose_recompute(p, allow, prefetch, slack_s) if recompute else (False,) * n
    saved = sum(b for b, r in zip(p.group_bytes, again, strict=True) if r)
    return Budget(
        tuple(allow),
        exposed_time(with_recompute(p, again), allow, prefetch),
        p.step_s,
        tuple(cheaper),
        resident_at_backward_start(p, allow) - saved,
        again if any(again) else (),
        sum(f for f, r in zip(p.fwd_s, again, strict=True) if r),
        peak_resident(p, allow, prefetch, again),
    )


def choose_plan(
    p: StepProfile, max_prefetch: int = 1, slack_s: float = 0.0, recompute: bool = False
) -> tuple[Budget, int]:
    """The budget and prefetch depth (1 ..  ``max_prefetch``) the cache runs with: the shallowest depth that offloads
    the most bytes (deeper reloads hold memory longer); with ``recompute``, the one with the lowest modelled peak
    (:func:`peak_resident`), then the most bytes."""

    def better(b: Budget, than: Budget) -> bool:
        if recompute:
            return (b.peak_bytes, -b.total_bytes) < (than.peak_bytes, -than.total_bytes)
        return b.total_bytes > than.total_bytes

    budget, depth = choose_budget(p, prefetch=1, slack_s=slack_s, recompute=recompute), 1
    for d in range(2, max_prefetch + 1):
        b = choose_budget(p, prefetch=d, slack_s=slack_s, recompute=recompute)
        if better(b, budget):
            budget, depth = b, d
    return budget, depth
