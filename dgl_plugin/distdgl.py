"""Run a GNN recipe's processes as DistDGL's launcher starts them (``tools/launch.py`` in DGL's source tree).

DistDGL's launcher starts, on every machine listed in ``ip_config``, graph *servers* (the training command with
``DGL_ROLE=server``, ``DGL_SERVER_ID``, ``DGL_NUM_SERVER``, ``DGL_NUM_CLIENT``, ``DGL_CONF_PATH``,
``DGL_IP_CONFIG``, ``DGL_GRAPH_FORMAT``) and *trainers* (the same command under ``python -m torch.distributed.run
--nnodes <machines> --node_rank <i> --nproc_per_node <trainers>`` with ``DGL_ROLE=client``,
``DGL_DIST_MODE=distributed`` and the same ``DGL_*`` variables). The servers serve the partitions until the trainers
shut them down; ``dgl.distributed.initialize`` is what makes a process a server or connects a trainer, and must run
before ``torch.distributed`` is initialised.

:func:`distdgl_role` reads and checks that environment; :func:`serve` and :func:`connect` are the two roles. A
trainer's rank, world size and rendezvous are torchrun's (``flowlane.launch.detect_launcher``). Full-graph training
(``dgl_plugin.fullgraph``) reads each trainer's partition from ``DGL_CONF_PATH`` itself and samples nothing, so it
needs one trainer per partition and no sampler processes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from flowlane.launch import LauncherEnvError

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
    launcher did not start it. A missing or malformed variable raises :class:`flowlane.launch.LauncherEnvError`
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


def connect(r: DistDGLRole) -> None:
    """Connect this trainer to the servers (before torch.distributed is initialised, as DGL requires). When the
    process exits, DGL's exit hook waits for every trainer and the first one shuts the servers down."""
    import dgl

    dgl.distributed.initialize(r.ip_config)
