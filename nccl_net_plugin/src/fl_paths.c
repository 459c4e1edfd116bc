/* fl_paths.c - LEO / round-robin / greedy path selectors (see fl_paths.h). */
#include "fl_paths.h"

#include <math.h>
#include <string.h>

/* k_hat grows only when a completion exceeds T by this margin: the thesis'
 * strict ">" is noise-sensitive (digest B6 #3 recommends 10-20 %). */
#define FL_KHAT_EPS 0.20
#define FL_KHAT_DELTA_NS 20000.0
#define FL_DECAY 0.875

void fl_selector_init(struct fl_selector* s, int kind, int npaths) {
  memset(s, 0, sizeof(*s));
  s->kind = kind;
  s->npaths = npaths < 1 ? 1 : (npaths > FL_MAX_PATHS ? FL_MAX_PATHS : npaths);
}

double fl_path_bw(const struct fl_path_stats* p) {
  if (!p->have_sample || p->acc_busy_ns <= 0) return 0;
  return p->acc_bytes / p->acc_busy_ns;
}

static double base_time(const struct fl_path_stats* p, uint64_t bytes) {
  double bw = fl_path_bw(p);
  return p->lat_ns + (bw > 0 ? (double)bytes / bw : 0);
}

double fl_leo_cost(const struct fl_path_stats* p, uint64_t bytes) {
  double bw = fl_path_bw(p);
  double toll = bw > 0 ? (double)bytes / bw : 0;
  return (double)p->khat * toll + base_time(p, bytes);
}

int fl_selector_choose(struct fl_selector* s, uint64_t bytes, unsigned ready) {
  if (s->npaths == 1) return 0;
  if (s->kind == FL_SELECTOR_ROUND_ROBIN) return s->rr_next;
  /* No offline profile: an idle path without a measurement is probed first. */
  for (int p = 0; p < s->npaths; p++)
    if (!s->st[p].have_sample && s->st[p].inflight == 0 && (ready & (1u << p))) return p;
  int best = -1;
  double best_cost = INFINITY;
  for (int p = 0; p < s->npaths; p++) {
    const struct fl_path_stats* st = &s->st[p];
    if (!st->have_sample || !(ready & (1u << p))) continue; /* being probed, or full */
    double cost = s->kind == FL_SELECTOR_GREEDY ? st->last_jct_ns : fl_leo_cost(st, bytes);
    if (cost < best_cost) { /* ties keep the lower index (the prio-list order) */
      best_cost = cost;
      best = p;
    }
  }
  return best;
}

void fl_selector_on_sent(struct fl_selector* s, int path, uint64_t bytes, uint64_t now_ns) {
  struct fl_path_stats* st = &s->st[path];
  if (st->inflight == 0) st->last_event_ns = now_ns;
  else if (st->inflight < 64) st->queued_bits |= 1ull << st->inflight;
  st->inflight++;
  st->chunks_sent++;
  st->bytes_sent += bytes;
  if (s->kind == FL_SELECTOR_ROUND_ROBIN && path == s->rr_next) s->rr_next = (s->rr_next + 1) % s->npaths;
}

/* A chunk sent behind another one is served back to back, so the time since
 * the previous ACK is its pure service time: a bandwidth sample. A chunk sent
 * to an idle path measures latency + size/BW: a latency sample. Keeping the
 * two apart stops small messages (latency-bound) from posing as a slow path. */
void fl_selector_on_acked(struct fl_selector* s, int path, uint64_t bytes, uint64_t start_ns, uint64_t now_ns) {
  struct fl_path_stats* st = &s->st[path];
  double busy = now_ns > st->last_event_ns ? (double)(now_ns - st->last_event_ns) : 1.0;
  int backlogged = (int)(st->queued_bits & 1);
  st->queued_bits >>= 1;
  st->last_event_ns = now_ns;
  if (st->inflight > 0) st->inflight--;
  double jct = now_ns > start_ns ? (double)(now_ns - start_ns) : 0.0;
  double bw = fl_path_bw(st);
  if (backlogged || bw <= 0) {
    st->acc_bytes = st->acc_bytes * FL_DECAY + (double)bytes;
    st->acc_busy_ns = st->acc_busy_ns * FL_DECAY + busy;
  }
  if (!backlogged) {
    bw = st->acc_busy_ns > 0 ? st->acc_bytes / st->acc_busy_ns : 0;
    double lat_sample = bw > 0 ? jct - (double)bytes / bw : jct;
    if (lat_sample < 0) lat_sample = 0;
    /* min filter that slowly forgets, so a path whose latency rises is re-learnt */
    st->lat_ns = st->have_sample ? fmin(st->lat_ns * 1.001 + 1.0, lat_sample) : lat_sample;
  }
  st->have_sample = 1;
  st->last_jct_ns = jct;
  if (jct > base_time(st, bytes) * (1.0 + FL_KHAT_EPS) + FL_KHAT_DELTA_NS) {
    if (st->khat < FL_KHAT_MAX) st->khat++;
  } else {
    st->khat = 0;
  }
}

int fl_selector_parse(const char* name) {
  if (!name || !*name || !strcmp(name, "leo")) return FL_SELECTOR_LEO;
  if (!strcmp(name, "rr") || !strcmp(name, "round-robin")) return FL_SELECTOR_ROUND_ROBIN;
  if (!strcmp(name, "greedy")) return FL_SELECTOR_GREEDY;
  return -1;
}

const char* fl_selector_name(int kind) {
  switch (kind) {
    case FL_SELECTOR_LEO: return "leo";
    case FL_SELECTOR_ROUND_ROBIN: return "rr";
    case FL_SELECTOR_GREEDY: return "greedy";
    default: return "?";
  }
}
