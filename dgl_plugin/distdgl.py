"""Run a GNN recipe's processes as DistDGL's launcher starts them (``tools/launch.py`` in DGL's source tree).

DistDGL's launcher starts, on every machine listed in ``ip_config``, graph *servers* (the training command with
``DGL_ROLE=server``, ``DGL_SERVER_ID``, ``DGL_NUM_SERVER``, ``DGL_NUM_CLIENT``, ``DGL_CONF_PATH``,
``DGL_IP_CONFIG``, ``DGL_GRAPH_FORMAT``) and *trainers* (the same command under ``python -m torch.distributed.run
--nnodes <machines> --node_rank <i> --nproc_per_node <trainers>`` with ``DGL_ROLE=client``,
``DGL_DIST_MODE=distributed`` and the same ``DGL_*`` variables). The servers serve the partitions until the trainers
shut them down; ``dgl.distributed.initialize`` is what makes a process a server or connects a trainer, and must run
before ``torch.distributed`` is initialised.

:func:`distdgl_role` reads and checks that environment; :func:`serve` and :func:`connect` are the two roles. A
trainer's rank, world size and rendezvous are torchrun's (``flowlane.launch_external.detect_launcher``). Full-graph
training (``dgl_plugin.fullgraph``) reads each trainer's partition from ``DGL_CONF_PATH`` itself and samples nothing,
so it needs one trainer per partition and no sampler processes.

A dead peer is an error, never a hang (:func:`connect_trainer`, :func:`peer_guard`, :func:`leave`). DGL's client
registers an exit hook (``exit_client``) whose barrier waits on the servers for *every* trainer, with no timeout. So
when one trainer failed (say in ``fast_pull``), it sat in that barrier at exit, alive, while the others waited in
their next gloo collective for it (30 min, gloo's default), and a trainer killed outright never reached the barrier,
so the survivors, once gloo noticed, waited there for ever. Here a trainer that fails skips the barrier and exits at
once (its peers' collectives then fail: "Connection closed by peer"); a trainer whose collective fails that way, or
times out after ``peer_timeout_s``, raises :class:`PeerLostError` naming the peer's address or the timeout and exits
non-zero; and the barrier of a normal exit is bounded by ``peer_timeout_s`` too. The servers are left to the launcher
(they wait for clients that are gone; DGL lets only client 0 shut them down, and only after the barrier).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from flowlane.launch_external import LauncherEnvError

DEFAULT_PEER_TIMEOUT_S = 300.0
"""How long a trainer waits for a peer trainer (one collective, DGL's exit barrier) before it gives up."""

_COMMON = ("DGL_IP_CONFIG", "DGL_NUM_SERVER", "DGL_NUM_CLIENT", "DGL_CONF_PATH")


@dataclass(frozen=True)
class DistDGLRole:
    """This process's part in a job DistDGL's launcher started."""

    role: Literal["server", "client"]
    """server: serves graph partitions until the trainers exit; client: a trainer (a torchrun rank)."""
    ip_config: str
    """DGL_IP_CONFIG: one line per machine, "<ip> [<port>]"."""
    part_config: str
    """DGL_CONF_PATH: the JSON written by dgl.distributed.partition_graph."""
    num_servers: int
    """DGL_NUM_SERVER: servers per machine."""
    num_clients: int
    """DGL_NUM_CLIENT: trainers x (1 + samplers per trainer) x machines, as the launcher counted them."""
    num_samplers: int
    """DGL_NUM_SAMPLER: sampler processes per trainer."""


def distdgl_role(env: Mapping[str, str] | None = None) -> DistDGLRole | None:
    """The DistDGL role this process was started in (default environment ``os.environ``), or None when DistDGL's
    launcher did not start it. A missing or malformed variable raises :class:`flowlane.launch_external.LauncherEnvError`
    naming it, before DGL is asked to serve or connect (DGL itself would assert, or a server would wait for ever)."""
    env = os.environ if env is None else env
    role = env.get("DGL_ROLE")
    if role is None:
        return None
    if role not in ("server", "client"):
        raise LauncherEnvError(f"DGL_ROLE={role!r} must be 'server' or 'client' (set by DistDGL's launch.py)")
    need = _COMMON + (("DGL_SERVER_ID",) if role == "server" else ())
    missing = [n for n in need if not env.get(n)]
    if missing:
        raise LauncherEnvError(
            f"DGL_ROLE={role} but {missing} not set: DistDGL's launch.py sets them; start the "
            f"job with it (or set them as it does)"
        )
    ints = {}
    for n in ("DGL_NUM_SERVER", "DGL_NUM_CLIENT", "DGL_NUM_SAMPLER") + (
        ("DGL_SERVER_ID",) if role == "server" else ()
    ):
        raw = env.get(n, "0")
        try:
            ints[n] = int(raw)
        except ValueError:
            raise LauncherEnvError(f"{n}={raw!r} must be an integer") from None
        if ints[n] < (1 if n in ("DGL_NUM_SERVER", "DGL_NUM_CLIENT") else 0):
            raise LauncherEnvError(
                f"{n}={ints[n]} must be >= {1 if n in ('DGL_NUM_SERVER', 'DGL_NUM_CLIENT') else 0}"
            )
    for n in ("DGL_IP_CONFIG", "DGL_CONF_PATH"):
        if not os.path.isfile(env[n]):
            raise LauncherEnvError(
                f"{n}={env[n]!r} is not a file (paths are relative to the folder the launcher "
                f"ran the command in: its --workspace)"
            )
    if role == "client" and env.get("DGL_DIST_MODE") != "distributed":
        raise LauncherEnvError(
            f"DGL_ROLE=client needs DGL_DIST_MODE=distributed (got "
            f"{env.get('DGL_DIST_MODE')!r}); DistDGL's launch.py sets it for trainers"
        )
    return DistDGLRole(
        role,
        env["DGL_IP_CONFIG"],
        env["DGL_CONF_PATH"],
        ints["DGL_NUM_SERVER"],
        ints["DGL_NUM_CLIENT"],
        ints["DGL_NUM_SAMPLER"],
    )


def check_full_graph_trainers(r: DistDGLRole, world_size: int) -> None:
    """Full-graph training under DistDGL's launcher: every client is a trainer (no samplers: nothing is sampled), so
    DGL_NUM_CLIENT must be the trainers torchrun started, or the servers would wait for clients that never come."""
    if r.num_samplers:
        raise LauncherEnvError(
            f"DGL_NUM_SAMPLER={r.num_samplers}: full-graph training samples nothing; launch with "
            f"--num_samplers 0"
        )
    if r.num_clients != world_size:
        raise LauncherEnvError(
            f"DGL_NUM_CLIENT={r.num_clients} but {world_size} trainers were started "
            f"(WORLD_SIZE): launch.py counts trainers x machines; give world_size={r.num_clients} "
            f"or launch that many trainers"
        )


def ip_config_hosts(path: str) -> list[str]:
    """The machines of a DistDGL ``ip_config`` file, one per non-blank line ("<ip> [<port>]"), in line order: the
    launcher's node order (``--node_rank`` is the line's index) and its partition order (partition i on line i)."""
    with open(path) as f:
        return [line.split()[0] for line in f if line.strip()]


def check_trainers_per_machine(r: DistDGLRole, trainers_per_machine: int, num_parts: int) -> None:
    """Full-graph training under DistDGL's launcher runs one trainer per line of ``ip_config``.

    DistDGL's launch.py pairs one partition with each line of ip_config (it asserts ``num_parts`` equals the
    lines) and starts ``--num_trainers`` trainers per line, which share that line's partition through its server.
    Full-graph training gives each trainer a partition of its own (one per rank), so ``--num_trainers`` > 1 cannot
    apply: refused here, naming the values. Several trainers per machine: list the machine once per trainer in
    ip_config (a port each; :func:`host_slot` then gives each its own GPU)."""
    lines = len(ip_config_hosts(r.ip_config))
    if trainers_per_machine > 1:
        raise LauncherEnvError(
            f"DistDGL's launcher started {trainers_per_machine} trainers per machine (--num_trainers "
            f"{trainers_per_machine}, LOCAL_WORLD_SIZE={trainers_per_machine}) on a partitioning of "
            f"num_parts={num_parts} for the {lines} line(s) of DGL_IP_CONFIG={r.ip_config!r}: launch.py gives "
            "each line one partition, which its trainers would share, but full-graph training needs a "
            "partition per trainer, so it runs --num_trainers 1. For several trainers per machine, list the "
            "machine once per trainer in ip_config (a port each) and partition into that many parts; or start "
            "the trainers with torchrun or srun (no graph servers needed); see docs/train.md"
        )
    if num_parts != lines:
        raise LauncherEnvError(
            f"DGL_CONF_PATH={r.part_config!r} has num_parts={num_parts} but DGL_IP_CONFIG={r.ip_config!r} "
            f"lists {lines} machine(s): DistDGL's launcher serves one partition per line (launch.py asserts "
            "num_parts equals the lines)"
        )


def host_slot(r: DistDGLRole, env: Mapping[str, str]) -> tuple[int, int] | None:
    """(this trainer's index among the trainers on its host, trainers on that host) when ip_config lists the host
    on several lines (one trainer per line, see :func:`check_trainers_per_machine`), else None.

    Each line is a torchrun node of its own (``GROUP_RANK`` = the line's index, ``LOCAL_RANK`` 0), so torchrun
    alone would put every trainer of the host on GPU 0; this is the place a GPU is picked by instead."""
    hosts = ip_config_hosts(r.ip_config)
    if len(set(hosts)) == len(hosts):
        return None
    raw = env.get("GROUP_RANK")
    if raw is None or not raw.isdigit() or int(raw) >= len(hosts):
        raise LauncherEnvError(
            f"GROUP_RANK={raw!r} must be this trainer's line of DGL_IP_CONFIG={r.ip_config!r} (0 to "
            f"{len(hosts) - 1}): DistDGL's launch.py starts the trainers of line i with torch.distributed.run "
            "--node_rank i, which sets it"
        )
    line = int(raw)
    mine = [i for i, h in enumerate(hosts) if h == hosts[line]]
    return mine.index(line), len(mine)


def serve(r: DistDGLRole) -> None:
    """Be a DistDGL graph server until the trainers shut the servers down; then the process exits (DGL's own
    ``initialize`` in server mode never returns)."""
    import dgl

    dgl.distributed.initialize(r.ip_config)


def connect(r: DistDGLRole, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
    """Connect this trainer to the servers (before torch.distributed is initialised, as DGL requires). When the
    process exits, DGL's exit barrier waits for every trainer (at most ``peer_timeout_s``, see :func:`leave`) and
    the first one shuts the servers down."""
    connect_trainer(r.ip_config, peer_timeout_s)


# ------------------------------------------------------------------------------------------------ dead peers

# what gloo says when the other end of a collective is gone or silent (torch 2.2: RuntimeError; newer: DistBackendError)
_LOST = ("closed by peer", "reset by peer", "broken pipe", "timed out", "timeout", "connection refused")


class PeerLostError(RuntimeError):
    """A DistDGL trainer lost a peer trainer: the peer died or failed (its own log says why), or did not answer within
    ``peer_timeout_s``."""


@dataclass
class _ExitState:
    timeout_s: float = DEFAULT_PEER_TIMEOUT_S
    abandoned: bool = False  # this trainer failed: no exit barrier (its peers would never come)
    hooked: bool = False


_EXIT = _ExitState()


#: peer_timeout_s's upper bound: past ~8.6e13 s ``datetime.timedelta`` (the trainers' gloo timeout) overflows in
#: every trainer; a year is past any real job (recipes.validate.MAX_TIMEOUT_S is the same)
MAX_PEER_TIMEOUT_S = 365 * 86400.0


def check_peer_timeout(value: object, key: str = "peer_timeout_s") -> float:
    """``value`` as seconds, or ValueError naming ``key`` and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_PEER_TIMEOUT_S:
        raise ValueError(
            f"{key}={value!r} must be a number of seconds > 0 and at most {MAX_PEER_TIMEOUT_S:.0f} (a year; how "
            "long a trainer waits for a peer)"
        )
    return float(value)


def connect_trainer(ip_config: str, peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
    """Connect this trainer to the DistDGL servers of ``ip_config`` (before torch.distributed is initialised, as DGL
    requires) and bound DGL's exit barrier by ``peer_timeout_s``: DGL's own exit hook is replaced by :func:`leave`."""
    import dgl
    from dgl.distributed import dist_context

    _EXIT.timeout_s = check_peer_timeout(peer_timeout_s)
    dgl.distributed.initialize(ip_config)
    atexit.unregister(dist_context.exit_client)
    if not _EXIT.hooked:
        atexit.register(leave)
        _EXIT.hooked = True


def leave(peer_timeout_s: float | None = None) -> None:
    """Leave DistDGL (DGL's ``exit_client``: a barrier of every trainer on the servers, then client 0 stops them),
    waiting at most ``peer_timeout_s`` (default: :func:`connect_trainer`'s) for the other trainers: past it the
    process prints why and exits with status 1 (a trainer that is gone never arrives). Nothing when not connected.
    Also this module's exit hook: after a failure (:func:`peer_guard`) it skips the barrier and ends the process
    with status 1 (exit hooks registered before :func:`connect_trainer` do not run)."""
    from dgl.distributed import dist_context

    if not dist_context.is_initialized():
        return
    if _EXIT.abandoned:
        # DGL's RPC threads stop only after the barrier: a normal interpreter exit would abort in their destructors
        # ("terminate called without an active exception", SIGABRT), so a failed trainer ends here, with status 1
        for f in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                f.flush()
        os._exit(1)
    timeout = check_peer_timeout(_EXIT.timeout_s if peer_timeout_s is None else peer_timeout_s)
    done = threading.Event()

    def give_up() -> None:
        if not done.is_set():
            print(
                f"DistDGL trainer (RANK={os.environ.get('RANK', '?')}): not every trainer reached DGL's exit barrier "
                f"within peer_timeout_s={timeout:g} s (a trainer died or hangs; its log says why): exiting with "
                "status 1 instead of waiting for ever",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    # the barrier is native code: should it hold the interpreter, the kernel-level watchdog ends the process instead
    faulthandler.dump_traceback_later(timeout + 5.0, exit=True)
    try:
        dist_context.exit_client()
    finally:
        done.set()
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def trainer_process_group(peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
    """The trainers' gloo group from torchrun's variables (``env://``), every collective bounded by
    ``peer_timeout_s`` (gloo's default is 30 min)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=check_peer_timeout(peer_timeout_s)))


def _lost_peer(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in _LOST)


@contextlib.contextmanager
def peer_guard(
    peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S, what: str = "DistDGL trainer"
) -> Iterator[None]:
    """Run a trainer's work so that a failure anywhere ends this trainer at once instead of in DGL's exit barrier
    (which would wait for every trainer: the peers would wait for this one in their next collective, and this one
    for them). A collective that failed because a peer is gone or silent is re-raised as :class:`PeerLostError`
    naming the peer's address (gloo's message) or the timeout; other errors are re-raised as they are."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, SystemExit) and e.code in (None, 0):
            raise
        _EXIT.abandoned = True
        if _lost_peer(e) and not isinstance(e, PeerLostError):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PeerLostError(
                f"{what} rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}: lost a peer "
                f"trainer in a torch.distributed collective ({first}): the peer died or failed (its log says why) "
                f"or did not answer within peer_timeout_s={float(peer_timeout_s):g} s. Exiting instead of waiting "
                "in DGL's exit barrier for a trainer that will not come"
            ) from e
        raise
