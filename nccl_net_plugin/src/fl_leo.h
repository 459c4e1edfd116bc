/*
 * fl_leo.h - LEO's per-request path selection (seed 000 ch. 6, §6.2.2;
 * digest 000-hermod-leo.md part B2.3) and what the seed's Fig. 6.14 compares
 * it with: Greedy-E2E and Greedy-Intra, plus LEO without its toll (ablation)
 * and round-robin (a reference; not one of Fig. 6.14's baselines). Fig. 6.14's
 * offline LP optimum is not implemented (README: it needs the whole request
 * sequence in advance). Pure model: timestamps come in as arguments, no
 * sockets, no clock, no I/O.
 *
 * A request is one NCCL isend; all of it travels on the path chosen for it
 * (it may be framed into sub-chunks there, which the model never sees).
 * Paths are the sockets of one connection (digest B6 #7). For path p and a
 * request of S bytes:
 *
 *   BW(p)        = sum S / sum (t4 - t3)     receiver dwell, decayed sums
 *   T(p, S)      = T_tr(p) + S / BW(p)       base traverse time
 *   toll(p, S)   = S / BW(p)                 communication toll
 *   Q(p)         = eq. 6.2 for our own requests: grows by S/BW(p) when a
 *                  request is put on p, drains with time, 0 once p has
 *                  none of ours in flight
 *   T_total(p)   = Q(p) + k_hat(p) * toll(p, S) + T(p, S)   (eq. 6.5 + Q)
 *
 * and the request goes to argmin T_total. Ties go to the lower T(p, S), then
 * the lower index: the seed's priority list is sorted by base traverse time
 * (§6.2.2, offline phase). The tradeoff is the seed's: joining a queued fast
 * path costs its queue plus the toll it imposes; an idle slow path costs its
 * longer base time.
 *
 * Timestamps (Fig. 6.6, with one departure): t1 the request is put on its
 * path, t2 its first byte is handed to the socket (leaves our queue), t5/t6
 * the ACK's arrival/processing (one call apart here: t6 - t5 = 0). In the
 * seed t3/t4 are the server's CQE and its response being queued, so t4 - t3
 * is server processing and excludes the network. A net plugin has no
 * server-side processing phase; what the receiver can observe is its dwell,
 * so here t3/t4 are when the receiver reads a frame's header / its last byte
 * (returned in the ACK). That dwell includes serialising the frame through
 * the path's bottleneck (which is why BW(p) can be fitted to it) but not
 * propagation or the ACK's way back. Intra-host JCT here = (t2 - t1) +
 * sum(t4 - t3): an ACK delayed by the network (RTT jitter) does not move it,
 * the seed's point against Greedy-E2E; a slower or shared bottleneck does.
 *
 * k_hat(p), "the number of requests that will see the queue caused by this
 * one", from contention by other requests: when a request completes on p,
 * every request still in flight on p was placed after it and queued behind
 * it (one TCP path is FIFO), so that count is k_hat(p) until the next
 * completion. The thesis infers the same number from consecutive delayed
 * completions (k_hat += 1 when intra JCT > T, else 0), because its paths are
 * shared and its queues unseen; here the count is exact, a path that drained
 * has k_hat 0, and a request alone on a path pays no toll. Our sub-chunks of
 * one request never count: the model sees whole requests.
 *
 * T_tr(p) is learnt from completions that met no queue (min filter that
 * slowly forgets, started by the first such completion) instead of the
 * thesis' offline profile; a path with no sample yet is probed with the first
 * request that finds it idle (every selector but rr).
 *
 * The other selectors (FLOWLANE_NET_PATH_SELECTOR; same probing and ties):
 *   greedy        Greedy-E2E (alias greedy_e2e): least end-to-end time (ACK
 *                 arrival - t1) of the last request completed on each path,
 *                 scaled to the new request's size (per-byte time x S: the
 *                 seed keeps T per request type, so a small completion does
 *                 not make a slow path look cheap for a large request; a
 *                 zero-byte completion keeps the last sized sample). The seed
 *                 does not say how the estimate is kept; this is the last
 *                 sample, and a path greedy stops choosing is never measured
 *                 again, so its stale time decides: with several requests in
 *                 flight it can leave a path unused (README).
 *   greedy_intra  Greedy-Intra: least intra-host JCT, (t2 - t1) + dwell, of
 *                 the last request completed on each path (same last-sample
 *                 and size rules): no toll and no model of the queue it is
 *                 building.
 *   leo_notoll    LEO with k_hat forced to 0: argmin Q(p) + T(p, S), the
 *                 seed's k = 1 greedy on LEO's own estimates; what the toll
 *                 adds is leo against this.
 *   rr            round-robin, per request.
 *
 * Measured (issue 32, FLOWLANE_NET_LEO_TRACE, netns 400+100 Mbit/s,
 * results/nccl_net_plugin/leo_paths.json): T_tr(p) comes out 0 on every
 * path. The intra JCT is (t2 - t1) plus the dwell and BW(p) is fitted to the
 * same dwell, so intra - S/BW(p) is (t2 - t1) plus zero-mean noise, which the
 * min filter clamps at 0; the fixed per-request time (propagation, the ACK's
 * return) is therefore not in T(p, S): harmless between paths of one RTT,
 * blind to an RTT difference for small requests. BW(p) from dwell tracks a
 * shaped path (about 400 and 98 Mbit/s learnt for 400 and 100) but is an
 * upper bound where the receiver lags the wire (a CPU-bound path: the payload
 * is buffered before its header is read, under 1 ms dwell for 2 MiB against
 * 4-15 ms end to end) and a lower bound where the receiver is descheduled
 * mid-frame; a first sample taken in TCP slow start reads low (38-43 Mbit/s
 * for the 100 path in two runs at load 26).
 */
#ifndef FL_LEO_H
#define FL_LEO_H

#include <stdint.h>

#include "flowlane_net.h"

#define FL_KHAT_MAX 64

struct fl_leo_path {
  int have_sample;          /* a request completed on this path */
  int have_t_tr;            /* ... and one met no queue of ours: t_tr_ns holds a sample */
  double dwell_bytes;       /* decayed sum of request bytes ... */
  double dwell_ns;          /* ... and of their receiver dwell: BW(p) = bytes / ns */
  double t_tr_ns;           /* T_tr(p): base traverse time, min-filtered */
  uint32_t khat;            /* k_hat(p) */
  uint64_t busy_until_ns;   /* Q(p) = busy_until - now (eq. 6.2) */
  int inflight;             /* our requests on p, not yet complete */
  double last_e2e_ns;       /* Greedy-E2E: ACK time - t1 of the last request */
  double last_intra_ns;     /* Greedy-Intra: (t2 - t1) + dwell of the last request */
  uint64_t last_bytes;      /* its size: the greedy costs are scaled to the next request's (per-byte time x S) */
  uint64_t requests, bytes; /* totals, for logs and benchmarks */
};

struct fl_selector {
  int kind; /* FL_SELECTOR_* */
  int npaths;
  int rr_next;
  struct fl_leo_path st[FL_MAX_PATHS];
};

/* What the selector predicted when it placed a request (kept with it). */
struct fl_leo_ticket {
  int path;
  uint64_t bytes;
  uint64_t t1_ns;
  double predicted_ns; /* Q(p) + T(p, S) at t1: the intra JCT LEO expected (logs, tests) */
};

void fl_selector_init(struct fl_selector* s, int kind, int npaths);
/* Path for a request of `bytes` arriving at now_ns (always a valid index). */
int fl_selector_choose(const struct fl_selector* s, uint64_t bytes, uint64_t now_ns);
/* The request was put on `path` at now_ns (t1). */
void fl_selector_on_assign(struct fl_selector* s, int path, uint64_t bytes, uint64_t now_ns, struct fl_leo_ticket* tk);
/* The request completed (its last ACK at now_ns): t2 when its first byte left
 * our queue, dwell_ns = sum of the receiver's t4 - t3 over its frames. */
void fl_selector_on_complete(struct fl_selector* s, const struct fl_leo_ticket* tk, uint64_t t2_ns, uint64_t dwell_ns,
                             uint64_t now_ns);
/* T_total of one path for a request of `bytes` at now_ns (tests and logs). */
double fl_leo_cost(const struct fl_leo_path* p, uint64_t bytes, uint64_t now_ns);
double fl_leo_bw(const struct fl_leo_path* p); /* bytes per ns, 0 if unknown */
int fl_selector_parse(const char* name);       /* -1 if unknown */
const char* fl_selector_name(int kind);

#endif /* FL_LEO_H */
