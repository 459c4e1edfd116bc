/* fl_transport.h - what the transport's two halves share: fl_transport.c sets connections up (init, listen, connect,
 * the guarded accept, comm lifetime) and fl_progress.c moves their data (frames, paths, lanes, isend/irecv/test,
 * close). Not part of the API (fl_core.h is). */
#ifndef FL_TRANSPORT_H
#define FL_TRANSPORT_H

#include <errno.h>
#include <stdatomic.h>
#include <time.h>

#include "fl_core.h"

struct fl_connect_state; /* a connect in progress (fl_transport.c) */

/* The process-wide engine: the selected interfaces, every comm by lane, and the lanes' shared counters. */
struct fl_engine {
  pthread_mutex_t lock; /* guards the comm lists and connection setup only; data moves under each comm's own lock */
  int initialized;
  struct fl_params params;
  struct fl_iface ifaces[FL_MAX_IFACES];
  int n_ifaces;
  struct fl_comm* lanes[FL_NUM_CLASSES]; /* comms by lane, highest priority first */
  struct fl_connect_state* connecting;
  uint64_t next_comm_id;
  _Atomic int lane_pending[FL_NUM_CLASSES];           /* send comms per lane with data queued */
  _Atomic uint64_t lane_last_sent_ns[FL_NUM_CLASSES]; /* last sub-chunk started per lane */
  _Atomic int ctl_backlog;                            /* recv comms whose control bytes wait for their socket */
  char dev_name[64];
};
extern struct fl_engine fl_engine;

static inline uint64_t fl_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A non-blocking socket call that only has to be retried. */
static inline int fl_io_would_block(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

/* The comm's first failure ends it: err (a negative errno, fl_errors.h) is what test/isend/irecv return,
 * translated; the message is logged as INFO here and as the WARN of the next call NCCL makes. */
void fl_comm_fail(struct fl_comm* c, int err, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
/* Off the engine's lane lists (no other comm's progress can reach it), then freed with its sockets. */
void fl_comm_unlink(struct fl_comm* c);
void fl_comm_free(struct fl_comm* c);

/* FLOWLANE_NET_LEO_TRACE: one line per path choice (t1) and per completed send. */
void fl_leo_trace_choice(const struct fl_comm* c, uint64_t size, uint64_t t1, int pi);
void fl_leo_trace_done(const struct fl_comm* c, const struct fl_request* r, uint64_t t);

#endif
