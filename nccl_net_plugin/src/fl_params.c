/* fl_params.c - the plugin's few knobs (documented in include/flowlane_net.h
 * and nccl_net_plugin/README.md), the class->marking contract, and logging. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fl_core.h"
#include "fl_log.h"

ncclDebugLogger_t fl_logger = NULL;

void fl_log_stderr(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags;
  /* Without NCCL's logger: warnings always, info only with FLOWLANE_NET_DEBUG=1. */
  if (level != NCCL_LOG_WARN) {
    const char* dbg = getenv("FLOWLANE_NET_DEBUG");
    if (!dbg || strcmp(dbg, "1") != 0) return;
  }
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s %s:%d ", level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

static int env_int(const char* name, long lo, long hi, long dflt, long* out) {
  const char* v = getenv(name);
  if (!v || !*v) {
    *out = dflt;
    return 0;
  }
  char* end = NULL;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || !end || *end != '\0' || x < lo || x > hi) {
    FL_WARN("%s=\"%s\" is invalid: expected an integer in [%ld, %ld]", name, v, lo, hi);
    return -1;
  }
  *out = x;
  return 0;
}

int fl_params_load(struct fl_params* p) {
  long v;
  memset(p, 0, sizeof(*p));
  const char* ifs = getenv(FL_ENV_SOCKET_IFNAME);
  if (ifs) snprintf(p->ifname_spec, sizeof(p->ifname_spec), "%s", ifs);
  if (env_int(FL_ENV_LANES, 1, FL_NUM_CLASSES, FL_DEFAULT_LANES, &v)) return -1;
  p->lanes = (int)v;
  if (env_int(FL_ENV_TRAFFIC_CLASS, 0, FL_NUM_CLASSES - 1, FL_DEFAULT_TRAFFIC_CLASS, &v)) return -1;
  p->default_class = (int)v;
  if (env_int(FL_ENV_PATHS, 0, FL_MAX_PATHS, 0, &v)) return -1;
  p->paths = (int)v;
  if (env_int(FL_ENV_CHUNK_BYTES, 4096, FL_MAX_CHUNK_BYTES, FL_DEFAULT_CHUNK_BYTES, &v)) return -1;
  p->chunk_bytes = (uint64_t)v;
  if (env_int(FL_ENV_LANE_CAP_BYTES, 4096, FL_MAX_CHUNK_BYTES, FL_DEFAULT_LANE_CAP_BYTES, &v)) return -1;
  p->lane_cap_bytes = (uint64_t)v;
  if (env_int(FL_ENV_TIMEOUT_MS, 100, 3600 * 1000, FL_DEFAULT_TIMEOUT_MS, &v)) return -1;
  p->timeout_ms = (int)v;
  const char* sel = getenv(FL_ENV_PATH_SELECTOR);
  p->selector = fl_selector_parse(sel);
  if (p->selector < 0) {
    FL_WARN("%s=\"%s\" is invalid: expected leo, greedy (or greedy_e2e), greedy_intra, leo_notoll or rr (or round-robin)",
            FL_ENV_PATH_SELECTOR, sel);
    return -1;
  }
  return 0;
}

int fl_class_dscp(int cls) {
  static const int dscp[FL_NUM_CLASSES] = {FL_DSCP_CLASS0, FL_DSCP_CLASS1, FL_DSCP_CLASS2, FL_DSCP_CLASS3};
  return dscp[cls < 0 ? 0 : (cls >= FL_NUM_CLASSES ? FL_NUM_CLASSES - 1 : cls)];
}

int fl_class_sopriority(int cls) {
  static const int prio[FL_NUM_CLASSES] = {FL_SOPRIO_CLASS0, FL_SOPRIO_CLASS1, FL_SOPRIO_CLASS2, FL_SOPRIO_CLASS3};
  return prio[cls < 0 ? 0 : (cls >= FL_NUM_CLASSES ? FL_NUM_CLASSES - 1 : cls)];
}

/* With fewer lanes than classes, the low classes share the last lane. */
int fl_lane_of_class(int cls, int lanes) {
  if (lanes <= 1) return 0;
  return cls < lanes - 1 ? cls : lanes - 1;
}

/* Which class's DSCP a lane's sockets carry (the switches' view). A socket
 * carries one mark, so the classes sharing a lane share it: the
 * highest-priority (smallest) class mapped onto the lane, which is the lane's
 * own index (fl_lane_of_class). No class is marked below its own priority on
 * the wire; bulk sharing the last lane with higher classes is promoted to
 * theirs (with 2 lanes, DP rides as class 1). One lane = priorities off = best
 * effort for everyone. */
int fl_lane_marking_class(int lane, int lanes) {
  if (lanes <= 1) return FL_CLASS_DEFAULT;
  return lane;
}

/* A lane's SO_PRIORITY (this host's qdisc band), decoupled from its DSCP. The
 * default pfifo_fast/prio priomap (1 2 2 2 1 2 0 0 ...) has three bands, and
 * lanes keep their order on the host only in distinct, increasing bands:
 * 2 lanes -> 6/4 (bands 0/1), 3 -> 6/4/2 (0/1/2), 4 -> 6/4/0/2 (0/1/1/2: four
 * lanes in three bands, classes 1 and 2 share band 1 and the sender's strict
 * lane order still ranks them). So a lane takes its marking class's value,
 * except the last of 3 or more, which takes bulk's (band 2): the last of 3
 * marked as class 2 (SO_PRIORITY 0, band 1) shared lane 1's band, so DP bulk
 * queued ahead of Hermod's pipeline class on a loaded host. */
int fl_lane_sopriority(int lane, int lanes) {
  if (lanes >= 3 && lane == lanes - 1) return fl_class_sopriority(FL_CLASS_BULK);
  return fl_class_sopriority(fl_lane_marking_class(lane, lanes));
}
