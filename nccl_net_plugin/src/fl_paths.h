/*
 * fl_paths.h - per-sub-chunk path selection for multi-path connections.
 *
 * LEO heuristic (seed 000 §6.2.2, digest B2.3), reinterpreted for sockets as
 * digest B6 #7 recommends: per path p and chunk size s
 *     toll(p, s) = s / BW(p)            base T(p, s) = lat(p) + s / BW(p)
 *     T_total(p) = k_hat(p) * toll(p, s) + T(p, s)          (eq. 6.5)
 * and pick the minimum. k_hat(p) += 1 when a completed chunk took longer than
 * T(p, s) (a queue exists), else k_hat(p) = 0. BW and lat come from our own
 * completion timestamps (ACK frames), replacing the thesis' offline profile.
 * Round-robin and greedy (Greedy-E2E: least last completion time) are kept
 * for comparison. Pure logic: no sockets, unit-tested through the driver.
 */
#ifndef FL_PATHS_H
#define FL_PATHS_H

#include <stdint.h>

#include "flowlane_net.h"

#define FL_KHAT_MAX 64

struct fl_path_stats {
  int have_sample;
  int inflight;           /* chunks handed to the path and not yet acknowledged */
  uint32_t khat;          /* LEO congestion counter */
  double acc_bytes;       /* decayed bytes acknowledged while busy */
  double acc_busy_ns;     /* decayed busy time */
  double lat_ns;          /* base latency estimate (min-filtered) */
  double last_jct_ns;     /* greedy: completion time of the previous chunk */
  uint64_t last_event_ns; /* previous ACK, or the send time of a chunk sent to an idle path */
  uint64_t queued_bits;   /* FIFO of "sent behind another chunk" flags, one bit per chunk in flight */
  uint64_t chunks_sent;
  uint64_t bytes_sent;
};

struct fl_selector {
  int kind; /* FL_SELECTOR_* */
  int npaths;
  int rr_next;
  struct fl_path_stats st[FL_MAX_PATHS];
};

void fl_selector_init(struct fl_selector* s, int kind, int npaths);
/* Path for the next chunk of `bytes`, or -1 to wait for a completion first.
 * `ready` has bit p set when path p can take a chunk now. LEO and greedy
 * choose among ready paths (a full path's queue is what their cost already
 * prices); round-robin keeps its strict rotation and may return a busy path,
 * i.e. it splits data evenly like striping across QPs. */
int fl_selector_choose(struct fl_selector* s, uint64_t bytes, unsigned ready);
void fl_selector_on_sent(struct fl_selector* s, int path, uint64_t bytes, uint64_t now_ns);
void fl_selector_on_acked(struct fl_selector* s, int path, uint64_t bytes, uint64_t start_ns, uint64_t now_ns);
/* T_total of eq. 6.5 for one path (exposed for tests and logs). */
double fl_leo_cost(const struct fl_path_stats* p, uint64_t bytes);
double fl_path_bw(const struct fl_path_stats* p); /* bytes per ns, 0 if unknown */
int fl_selector_parse(const char* name);          /* -1 if unknown */
const char* fl_selector_name(int kind);

#endif /* FL_PATHS_H */
