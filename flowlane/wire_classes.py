"""Traffic-class contract between Python and the NCCL net plugin (nccl_net_plugin/include/flowlane_net.h).

The plugin (``libnccl-net-flowlane.so``) reads a communicator's class from ``ncclConfig_t.trafficClass`` (NCCL net
API v10 ``connect`` config, v11 per-communicator ``init`` config). Smaller class = higher priority, as in Hermod's
strict order (seed 000 §5.3.1, digest A2.4). Each class selects a priority lane; a lane marks its sockets with
``SO_PRIORITY`` (host qdisc band) and ``IP_TOS = DSCP << 2`` (switches), and the plugin's sender serves lanes in strict
priority with a small in-flight cap for lanes below an active one (digest A6.2 option 3).

With fewer lanes than classes (``FLOWLANE_NET_LANES`` 2 or 3) the lowest classes share the last lane
(:func:`lane_of_class`). A socket carries one DSCP, so a lane carries the DSCP of the highest-priority class mapped
onto it (:func:`marking_class`): no class is marked below its own priority on the wire, and the classes it shares
with are promoted (with 2 lanes, classes 1-3 all go out as class 1: AF41). The lane's ``SO_PRIORITY`` follows its own
rule (:func:`lane_so_priority`): the default pfifo_fast priomap has three bands, and lanes keep their order on the
host only in distinct bands that increase with the lane index (``SO_PRIORITY`` 6/4 for 2 lanes, 6/4/2 for 3,
6/4/0/2 for 4: bands 0/1, 0/1/2, 0/1/1/2). One lane switches priorities off and marks everything best effort
(class 2's DSCP and ``SO_PRIORITY``).

The C header is the source of truth for the numbers; ``tests/test_nccl_net_plugin.py`` parses it and pins every
constant here to it. Pure Python: imports nothing from torch or the plugins.
"""

from __future__ import annotations

#: plugin traffic classes (the values NCCL passes as ``trafficClass``)
CLASS_CRITICAL = 0  # EP/PP traffic (the framework adapters: every microbatch's; the simulator: the oldest's)
CLASS_HIGH = 1  # EP/PP of later microbatches (the simulator and the synthetic workload only)
CLASS_DEFAULT = 2  # untagged traffic (used when NCCL gives NCCL_NET_TRAFFIC_CLASS_UNDEF = -1)
CLASS_BULK = 3  # DP gradient / parameter traffic
NUM_CLASSES = 4
TRAFFIC_CLASS_UNDEF = -1

#: class -> DSCP (standard DiffServ code points: EF, AF41, best effort, CS1)
CLASS_DSCP: tuple[int, ...] = (46, 34, 0, 8)
#: class -> SO_PRIORITY (default pfifo_fast/prio priomap puts them in bands 0, 1, 1, 2)
CLASS_SO_PRIORITY: tuple[int, ...] = (6, 4, 0, 2)
#: the kernel's default pfifo_fast / prio priomap: SO_PRIORITY (TC_PRIO) 0-15 -> band (0 is served first; tc-prio(8))
PFIFO_FAST_PRIOMAP: tuple[int, ...] = (1, 2, 2, 2, 1, 2, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)

#: Hermod class (flowlane.hermod.wire: 0 critical, 1 pipeline, 2 bulk) -> plugin ``trafficClass``
#: (:func:`flowlane.hermod.wire.nccl_traffic_class` reads it).
HERMOD_TRAFFIC_CLASSES: tuple[int, ...] = (CLASS_CRITICAL, CLASS_HIGH, CLASS_BULK)

#: path selectors for multi-path connections (LEO, seed 000 §6.2.2; nccl_net_plugin/src/fl_leo.h): LEO, the
#: baselines of the seed's Fig. 6.14 (Greedy-E2E, Greedy-Intra), LEO without its toll, and round-robin (a reference)
SELECTOR_LEO = 0
SELECTOR_ROUND_ROBIN = 1
SELECTOR_GREEDY = 2  # Greedy-E2E
SELECTOR_GREEDY_INTRA = 3
SELECTOR_LEO_NOTOLL = 4  # LEO with k_hat forced to 0 (ablation)
NUM_SELECTORS = 5
SELECTOR_NAMES: dict[str, int] = {
    "leo": SELECTOR_LEO,
    "rr": SELECTOR_ROUND_ROBIN,
    "round-robin": SELECTOR_ROUND_ROBIN,
    "greedy": SELECTOR_GREEDY,
    "greedy_e2e": SELECTOR_GREEDY,
    "greedy_intra": SELECTOR_GREEDY_INTRA,
    "leo_notoll": SELECTOR_LEO_NOTOLL,
}

#: environment variables read by the plugin at init (all optional)
ENV_SOCKET_IFNAME = "FLOWLANE_SOCKET_IFNAME"  # like NCCL_SOCKET_IFNAME: prefixes, "^" excludes, "=" exact
ENV_LANES = "FLOWLANE_NET_LANES"  # 1..4 priority lanes; 1 = priorities off
ENV_TRAFFIC_CLASS = "FLOWLANE_NET_TRAFFIC_CLASS"  # class when NCCL gives none (net API v8/v9)
ENV_PATHS = "FLOWLANE_NET_PATHS"  # sockets per connection (default: one per selected interface)
ENV_PATH_SELECTOR = "FLOWLANE_NET_PATH_SELECTOR"  # a key of SELECTOR_NAMES
ENV_CHUNK_BYTES = "FLOWLANE_NET_CHUNK_BYTES"  # sub-chunk size
ENV_LANE_CAP_BYTES = "FLOWLANE_NET_LANE_CAP_BYTES"  # in-flight cap of a lane below an active lane
ENV_TIMEOUT_MS = "FLOWLANE_NET_TIMEOUT_MS"  # stalled-peer timeout

DEFAULT_LANES = 4
DEFAULT_TRAFFIC_CLASS = CLASS_DEFAULT
DEFAULT_CHUNK_BYTES = 512 * 1024
DEFAULT_LANE_CAP_BYTES = 64 * 1024
DEFAULT_TIMEOUT_MS = 30000
MAX_PATHS = 4
MAX_RECVS = 8


def tos_byte(traffic_class: int) -> int:
    """IP TOS byte the plugin sets for a class (DSCP << 2)."""
    if not 0 <= traffic_class < NUM_CLASSES:
        raise ValueError(f"traffic_class must be in [0, {NUM_CLASSES}), got {traffic_class!r}")
    return CLASS_DSCP[traffic_class] << 2


def lane_of_class(traffic_class: int, lanes: int = DEFAULT_LANES) -> int:
    """Lane a class uses when the plugin runs with ``lanes`` lanes (the low classes share the last lane)."""
    if not 1 <= lanes <= NUM_CLASSES:
        raise ValueError(f"lanes must be in [1, {NUM_CLASSES}], got {lanes!r}")
    if not 0 <= traffic_class < NUM_CLASSES:
        raise ValueError(f"traffic_class must be in [0, {NUM_CLASSES}), got {traffic_class!r}")
    return 0 if lanes == 1 else min(traffic_class, lanes - 1)


def marking_class(traffic_class: int, lanes: int = DEFAULT_LANES) -> int:
    """Class whose DSCP the sockets of ``traffic_class``'s lane carry: the highest-priority class sharing that lane
    (never a lower one than ``traffic_class``), or best effort with one lane."""
    lane = lane_of_class(traffic_class, lanes)
    return CLASS_DEFAULT if lanes == 1 else lane


def lane_so_priority(lane: int, lanes: int = DEFAULT_LANES) -> int:
    """``SO_PRIORITY`` (this host's qdisc band) of ``lane`` with ``lanes`` lanes: its marking class's, except that the
    last of 3 or more lanes takes bulk's (band 2), so that lanes sit in distinct pfifo_fast bands increasing with the
    lane index as far as three bands allow (marked as class 2, the last of 3 lanes shared lane 1's band 1 and DP bulk
    queued ahead of Hermod's pipeline class)."""
    if not 1 <= lanes <= NUM_CLASSES:
        raise ValueError(f"lanes must be in [1, {NUM_CLASSES}], got {lanes!r}")
    if not 0 <= lane < lanes:
        raise ValueError(f"lane must be in [0, {lanes}), got {lane!r}")
    if lanes >= 3 and lane == lanes - 1:
        return CLASS_SO_PRIORITY[CLASS_BULK]
    return CLASS_SO_PRIORITY[CLASS_DEFAULT if lanes == 1 else lane]
