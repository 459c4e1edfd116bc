/*
 * flowlane_net.h - the contract shared by libnccl-net-flowlane.so and the
 * Python side (flowlane/wire_classes.py). tests/test_nccl_net_plugin.py parses
 * the #defines below and pins them to the Python constants: change both.
 *
 * Traffic classes follow Hermod's strict order (seed 000 §5.3.1, digest A2.4):
 * smaller class = higher priority. A communicator's class arrives as
 * ncclNetCommConfig.trafficClass (v10 connect, v11 init); v8/v9 and
 * NCCL_NET_TRAFFIC_CLASS_UNDEF fall back to FLOWLANE_NET_TRAFFIC_CLASS.
 */
#ifndef FLOWLANE_NET_H
#define FLOWLANE_NET_H

#define FL_NET_PLUGIN_NAME "flowlane"
#define FL_NET_VERSION 1

/* Traffic classes (Hermod: MID > CType > LID collapsed to 4 wire levels; the
 * framework adapters send EP/PP as class 0 and DP as class 3, MID classes come
 * from the simulator's model only: docs/decisions.md A6.1 #3). */
#define FL_CLASS_CRITICAL 0 /* EP/PP traffic */
#define FL_CLASS_HIGH 1     /* EP/PP of later microbatches (simulator model) */
#define FL_CLASS_DEFAULT 2  /* untagged traffic */
#define FL_CLASS_BULK 3     /* DP gradient/parameter traffic */
#define FL_NUM_CLASSES 4

/* Per-class DSCP (IP_TOS = DSCP << 2). Standard DiffServ code points, so
 * default switch and Linux configurations already rank them: EF, AF41, BE, CS1. */
#define FL_DSCP_CLASS0 46
#define FL_DSCP_CLASS1 34
#define FL_DSCP_CLASS2 0
#define FL_DSCP_CLASS3 8

/* Per-class SO_PRIORITY. With the default pfifo_fast/prio priomap
 * (1 2 2 2 1 2 0 0 ...) these land in bands 0, 1, 1, 2. */
#define FL_SOPRIO_CLASS0 6
#define FL_SOPRIO_CLASS1 4
#define FL_SOPRIO_CLASS2 0
#define FL_SOPRIO_CLASS3 2

/* Path selectors for multi-path connections (LEO, seed 000 §6.2.2; the
 * baselines of its Fig. 6.14 and two references: src/fl_leo.h). */
#define FL_SELECTOR_LEO 0
#define FL_SELECTOR_ROUND_ROBIN 1   /* reference, not in Fig. 6.14 */
#define FL_SELECTOR_GREEDY 2        /* Greedy-E2E */
#define FL_SELECTOR_GREEDY_INTRA 3  /* Greedy-Intra */
#define FL_SELECTOR_LEO_NOTOLL 4    /* LEO with k_hat forced to 0 (ablation) */
#define FL_NUM_SELECTORS 5

/* Environment variables (all optional). */
#define FL_ENV_SOCKET_IFNAME "FLOWLANE_SOCKET_IFNAME"  /* like NCCL_SOCKET_IFNAME: prefixes, ^exclude, =exact */
#define FL_ENV_LANES "FLOWLANE_NET_LANES"              /* 1..4 priority lanes; 1 = priorities off */
#define FL_ENV_TRAFFIC_CLASS "FLOWLANE_NET_TRAFFIC_CLASS" /* class when NCCL gives none */
#define FL_ENV_PATHS "FLOWLANE_NET_PATHS"              /* sockets per connection (default: one per interface) */
#define FL_ENV_PATH_SELECTOR "FLOWLANE_NET_PATH_SELECTOR" /* leo | greedy (greedy_e2e) | greedy_intra | leo_notoll | rr (round-robin) */
#define FL_ENV_CHUNK_BYTES "FLOWLANE_NET_CHUNK_BYTES"  /* sub-chunk size */
#define FL_ENV_LANE_CAP_BYTES "FLOWLANE_NET_LANE_CAP_BYTES" /* in-flight cap of a lane below an active one */
#define FL_ENV_TIMEOUT_MS "FLOWLANE_NET_TIMEOUT_MS"    /* stalled-peer timeout */

#define FL_DEFAULT_LANES 4
#define FL_DEFAULT_TRAFFIC_CLASS FL_CLASS_DEFAULT
#define FL_DEFAULT_CHUNK_BYTES (512 * 1024)
#define FL_DEFAULT_LANE_CAP_BYTES (64 * 1024)
#define FL_DEFAULT_TIMEOUT_MS 30000
#define FL_MAX_PATHS 4
#define FL_MAX_RECVS 8

#endif /* FLOWLANE_NET_H */
