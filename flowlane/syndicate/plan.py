"""Plans as the enforcer runs them: versioned, hashed, and switched on every rank at the same iteration.

A :class:`SyndicatePlan` lists one iteration's comm-ops in the application's submission order, each with its
signature (kind, bytes, group size, dtype) and execution-plan :class:`~flowlane.syndicate.cost.Option`, plus the
launch order: a sequence of (submission index, motif index). Its :meth:`~SyndicatePlan.digest` is the SHA-256 of a
canonical JSON, so two ranks hold the same plan exactly when their digests agree (digest §5 item 8).

Distribution is the digest's two-phase commit (§5 item 15) over a key-value store (``torch.distributed``'s
``TCPStore`` or anything with ``set``/``get``/``check``, and ``delete_key`` for the enforcer's old keys): the
coordinator writes PREPARE (the plan and a switch iteration ``k``); every rank, at an iteration boundary before
``k``, validates it and acknowledges with its digest (or refuses with a reason); the coordinator commits if every
rank acknowledged the same digest, else aborts naming the ranks. A rank that acknowledged waits at boundary ``k``
for the decision, so all ranks switch at ``k`` or none does. A rank that sees PREPARE at or after ``k`` refuses it,
so a late rank cannot split the ranks. One plan is in flight at a time: :meth:`PlanChannel.propose` waits for the
previous decision, and a rank refuses a newer PREPARE while the plan it acknowledged has not reached its switch
iteration (so the newer plan is aborted everywhere).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flowlane.syndicate.cost import Option
from flowlane.syndicate.motif import CommOp, MotifError


class Store(Protocol):
    """The part of ``torch.distributed.Store`` the plan channel and the enforcer use."""

    def set(self, key: str, value: str | bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def delete_key(self, key: str) -> bool: ...


class PlanError(RuntimeError):
    """A plan is malformed, or ranks disagree on it; the message names the ranks."""


@dataclass(frozen=True, slots=True)
class PlanOp:
    """One comm-op of the iteration, in submission order: its signature and its option."""

    name: str
    kind: str
    numel: int
    dtype: str
    ranks: int
    option: Option

    def comm_op(self, element_size: int) -> CommOp:
        return CommOp(self.name, self.kind, self.numel * element_size, self.ranks, align=element_size)


_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}


def element_size(dtype: str) -> int:
    if dtype not in _SIZES:
        raise PlanError(f"dtype {dtype!r} is not one of {sorted(_SIZES)}")
    return _SIZES[dtype]


@dataclass(frozen=True)
class SyndicatePlan:
    """A versioned plan: ``ops`` in submission order and ``order``, the launch sequence of (op index, motif)."""

    version: int
    ops: tuple[PlanOp, ...]
    order: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.version, int) or self.version < 0:
            raise PlanError(f"SyndicatePlan.version must be an integer >= 0, got {self.version!r}")
        want = set()
        for i, op in enumerate(self.ops):
            ms = op.option.motifs(op.comm_op(element_size(op.dtype)))
            want |= {(i, j) for j in range(len(ms))}
        got = [tuple(e) for e in self.order]
        if len(set(got)) != len(got) or set(got) != want:
            extra, missing = sorted(set(got) - want), sorted(want - set(got))
            raise PlanError(
                f"plan v{self.version}: order must list every (op, motif) once; "
                f"missing {missing[:5]}, unknown {extra[:5]}, {len(got) - len(set(got))} repeated"
            )
        pos = {e: k for k, e in enumerate(got)}
        for i, op in enumerate(self.ops):
            for m in op.option.motifs(op.comm_op(element_size(op.dtype))):
                for a in m.after:
                    if pos[(i, a)] > pos[(i, m.index)]:
                        raise PlanError(
                            f"plan v{self.version}: op {i} ({op.name!r}) motif {m.index} is ordered "
                            f"before motif {a} it depends on"
                        )

    def motifs(self, i: int) -> list:
        op = self.ops[i]
        return op.option.motifs(op.comm_op(element_size(op.dtype)))

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "ops": [
                {
                    "name": o.name,
                    "kind": o.kind,
                    "numel": o.numel,
                    "dtype": o.dtype,
                    "ranks": o.ranks,
                    "option": {
                        "path": o.option.path,
                        "algo": o.option.algo,
                        "segments": o.option.segments,
                        "spline": o.option.spline,
                    },
                }
                for o in self.ops
            ],
            "order": [list(e) for e in self.order],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str | bytes) -> SyndicatePlan:
        try:
            d = json.loads(text)
            ops = tuple(
                PlanOp(
                    o["name"], o["kind"], int(o["numel"]), o["dtype"], int(o["ranks"]), Option(**o["option"])
                )
                for o in d["ops"]
            )
            return cls(int(d["version"]), ops, tuple((int(a), int(b)) for a, b in d["order"]))
        except (KeyError, TypeError, ValueError, MotifError) as e:
            raise PlanError(f"not a SYNDICATE plan: {e}") from e

    @classmethod
    def fifo(cls, ops: Sequence[PlanOp], version: int = 0) -> SyndicatePlan:
        """The plan that launches every op's motifs in submission order."""
        order = tuple(
            (i, j)
            for i, op in enumerate(ops)
            for j in range(len(op.option.motifs(op.comm_op(element_size(op.dtype)))))
        )
        return cls(version, tuple(ops), order)

    @classmethod
    def from_schedule(
        cls,
        ops: Sequence[PlanOp],
        launch: Sequence[tuple[int, str, int]],
        version: int = 1,
        iteration: int | None = None,
    ) -> SyndicatePlan:
        """The plan whose order is ``launch`` (optSched's (iteration, op name, motif) sequence) restricted to one
        ``iteration`` (default: the last, the steady state; digest §5 item 7)."""
        idx = {o.name: i for i, o in enumerate(ops)}
        it = max(e[0] for e in launch) if iteration is None else iteration
        order = tuple((idx[name], j) for i, name, j in launch if i == it and name in idx)
        return cls(version, tuple(ops), order)


class PlanChannel:
    """Two-phase plan distribution over ``store`` (see the module docstring). Every rank calls :meth:`poll` at
    each iteration boundary; one rank (any) calls :meth:`propose` and then :meth:`decide`."""

    def __init__(
        self, store: Store, rank: int, world: int, prefix: str = "syndicate", timeout_s: float = 60.0
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world={world})")
        self.store, self.rank, self.world, self.prefix, self.timeout_s = store, rank, world, prefix, timeout_s
        self.current: SyndicatePlan | None = None
        self._pending: tuple[SyndicatePlan, int] | None = None
        self._seen = -1
        self.log: list[tuple[int, str, int]] = []
        """(iteration, event, version): "ack", "nack", "switch", "abort"."""

    def _k(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # -- coordinator ------------------------------------------------------------------------------------------------
    def propose(self, plan: SyndicatePlan, switch_at: int) -> None:
        """PREPARE: publish ``plan`` to switch to at iteration ``switch_at``. Refused while the previous proposal is
        undecided (its votes might not all be in, and a rank only reads the latest PREPARE), and unless ``plan`` is
        newer and switches later than it (ranks settle plans in switch order)."""
        latest = self._k("latest")
        if self.store.check([latest]):
            prev = int(self.store.get(latest))
            prev_at = int(self.store.get(self._k("v", prev, "switch_at")))
            if plan.version <= prev:
                raise PlanError(f"propose: plan v{plan.version} is not newer than the last proposal, v{prev}")
            if not self.store.check([self._k("v", prev, "decision")]):
                raise PlanError(
                    f"propose: plan v{prev} (switch at {prev_at}) is not decided yet; decide it first"
                )
            if switch_at <= prev_at:
                raise PlanError(
                    f"propose: plan v{plan.version} switches at {switch_at}, not after v{prev} (at {prev_at})"
                )
        self.store.set(self._k("v", plan.version, "plan"), plan.to_json())
        self.store.set(self._k("v", plan.version, "switch_at"), str(switch_at))
        self.store.set(self._k("v", plan.version, "digest"), plan.digest())
        self.store.set(self._k("latest"), str(plan.version))

    def decide(self, version: int) -> bool:
        """Collect every rank's vote; COMMIT if all acknowledged the plan's digest, else ABORT (naming ranks)."""
        digest = self.store.get(self._k("v", version, "digest")).decode()
        votes = _gather(
            self.store,
            [self._k("v", version, "vote", r) for r in range(self.world)],
            self.timeout_s,
            f"plan v{version} votes",
        )
        bad = {r: v for r, v in enumerate(votes) if v != digest}
        verdict = (
            "commit" if not bad else "abort: " + "; ".join(f"rank {r}: {v}" for r, v in sorted(bad.items()))
        )
        self.store.set(self._k("v", version, "decision"), verdict)
        return not bad

    # -- every rank -------------------------------------------------------------------------------------------------
    def poll(self, iteration: int) -> SyndicatePlan | None:
        """At the boundary before ``iteration``: at an acknowledged plan's switch iteration, wait for the decision;
        then vote on a new PREPARE; return the plan now in force (None: none yet). The acknowledged plan is settled
        first, and a PREPARE seen while it is still pending is refused: replacing it dropped a committed plan on
        this rank while the ranks that had switched kept it."""
        self._settle(iteration)
        latest = self._k("latest")
        if self.store.check([latest]):
            v = int(self.store.get(latest))
            if v > self._seen:
                self._seen = v
                self._vote(v, iteration)
        return self.current

    def _settle(self, iteration: int) -> None:
        if self._pending is not None and iteration >= self._pending[1]:
            plan, _ = self._pending
            self._pending = None
            verdict = _gather(
                self.store,
                [self._k("v", plan.version, "decision")],
                self.timeout_s,
                f"plan v{plan.version} decision",
            )[0]
            if verdict == "commit":
                self.current = plan
                self.log.append((iteration, "switch", plan.version))
            else:
                self.log.append((iteration, "abort", plan.version))

    def _vote(self, v: int, iteration: int) -> None:
        key = self._k("v", v, "vote", self.rank)
        try:
            plan = SyndicatePlan.from_json(self.store.get(self._k("v", v, "plan")))
            switch_at = int(self.store.get(self._k("v", v, "switch_at")))
            announced = self.store.get(self._k("v", v, "digest")).decode()
        except PlanError as e:
            self.store.set(key, f"nack: {e}")
            self.log.append((iteration, "nack", v))
            return
        if iteration >= switch_at:
            self.store.set(
                key, f"nack: saw it at iteration {iteration}, at or after its switch iteration {switch_at}"
            )
            self.log.append((iteration, "nack", v))
            return
        if plan.digest() != announced:
            self.store.set(key, f"nack: digest {plan.digest()[:12]} != announced {announced[:12]}")
            self.log.append((iteration, "nack", v))
            return
        if self._pending is not None:
            pending, at = self._pending
            self.store.set(
                key, f"nack: acknowledged v{pending.version} switches at {at}, after iteration {iteration}"
            )
            self.log.append((iteration, "nack", v))
            return
        self.store.set(key, plan.digest())
        self._pending = (plan, switch_at)
        self.log.append((iteration, "ack", v))


def _gather(store: Store, keys: list[str], timeout_s: float, what: str) -> list[str]:
    """Values of ``keys`` once all exist; a timeout names the ranks (key suffixes) still missing."""
    deadline = time.monotonic() + timeout_s
    delay = 1e-4
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[-1] for k in keys if not store.check([k])]
            raise PlanError(
                f"{what}: no answer within {timeout_s:.0f} s from {missing} (a rank is stuck, dead, "
                f"or on another plan)"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
    return [store.get(k).decode() for k in keys]


def exchange(store: Store, rank: int, world: int, key: str, value: str, timeout_s: float) -> list[str]:
    """Every rank publishes ``value`` under ``key``; returns all ranks' values (rank order)."""
    store.set(f"{key}/{rank}", value)
    return _gather(store, [f"{key}/{r}" for r in range(world)], timeout_s, key)


def disagreeing(values: Sequence[str]) -> str:
    """ "" when all equal, else which ranks hold which value (majority first), for error messages."""
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    if len(groups) == 1:
        return ""
    parts = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    return "; ".join(f"ranks {rs} hold {v[:16]}" for v, rs in parts)


class ReplanTrigger:
    """The enforcer's feedback rule (seed 004 §5.2: replan when the busy-wait "consistently" exceeds 5 % of the
    iteration; digest §5 item 16 fills in the window): fire when the median held fraction of the last ``window``
    iterations exceeds ``threshold``, then stay quiet for ``cooldown`` iterations and start a fresh window."""

    def __init__(self, window: int = 20, threshold: float = 0.05, cooldown: int = 50) -> None:
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"ReplanTrigger.window must be an integer >= 1, got {window!r}")
        if not 0 < threshold < 1:
            raise ValueError(f"ReplanTrigger.threshold must be in (0, 1), got {threshold!r}")
        if not isinstance(cooldown, int) or cooldown < 0:
            raise ValueError(f"ReplanTrigger.cooldown must be an integer >= 0, got {cooldown!r}")
        self.window, self.threshold, self.cooldown = window, threshold, cooldown
        self._hist: list[float] = []
        self._quiet_until = -1
        self.fired: list[int] = []
        """Iterations at which it fired."""

    def observe(self, iteration: int, held_s: float, iteration_s: float) -> bool:
        """Record one iteration's held time and wall time; True when a replan is due."""
        if iteration < self._quiet_until:
            return False
        self._hist.append(held_s / iteration_s if iteration_s > 0 else 0.0)
        self._hist = self._hist[-self.window :]
        if len(self._hist) < self.window:
            return False
        ordered = sorted(self._hist)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        if median <= self.threshold:
            return False
        self.fired.append(iteration)
        self._hist = []
        self._quiet_until = iteration + 1 + self.cooldown
        return True
