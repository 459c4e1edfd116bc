/* fl_leo.c - LEO and its baselines (Greedy-E2E, Greedy-Intra, LEO without toll, round-robin): per-request path
 * selection (see fl_leo.h). */
#include "fl_leo.h"

#include <math.h>
#include <string.h>

#define FL_NO_WAIT_NS 20000.0 /* t2 - t1 below this: the request met no queue of ours */
#define FL_DECAY 0.875        /* weight of older dwell samples in BW(p) */

void fl_selector_init(struct fl_selector* s, int kind, int npaths) {
  memset(s, 0, sizeof(*s));
  s->kind = kind;
  s->npaths = npaths < 1 ? 1 : (npaths > FL_MAX_PATHS ? FL_MAX_PATHS : npaths);
}

double fl_leo_bw(const struct fl_leo_path* p) {
  if (!p->have_sample || p->dwell_ns <= 0 || p->dwell_bytes <= 0) return 0;
  return p->dwell_bytes / p->dwell_ns;
}

static double toll(const struct fl_leo_path* p, uint64_t bytes) {
  double bw = fl_leo_bw(p);
  return bw > 0 ? (double)bytes / bw : 0;
}

static double base_time(const struct fl_leo_path* p, uint64_t bytes) { return p->t_tr_ns + toll(p, bytes); }

static double queue_ns(const struct fl_leo_path* p, uint64_t now_ns) {
  return p->busy_until_ns > now_ns ? (double)(p->busy_until_ns - now_ns) : 0;
}

double fl_leo_cost(const struct fl_leo_path* p, uint64_t bytes, uint64_t now_ns) {
  return queue_ns(p, now_ns) + (double)p->khat * toll(p, bytes) + base_time(p, bytes);
}

/* A greedy baseline's last time, rescaled to a request of `bytes` (per-byte time x S): the seed keeps T per
 * request type, so a small completion must not make a slow path look cheap for a large request. A zero-byte last
 * sample (first completion only: later ones keep the sized sample, on_complete) has no per-byte time: raw. */
static double last_time_for(double last_ns, uint64_t last_bytes, uint64_t bytes) {
  return last_bytes > 0 ? last_ns * ((double)bytes / (double)last_bytes) : last_ns;
}

/* What each selector minimises (fl_leo.h). leo_notoll shares LEO's cost: its k_hat stays 0 (on_complete). */
static double selector_cost(int kind, const struct fl_leo_path* st, uint64_t bytes, uint64_t now_ns) {
  switch (kind) {
    case FL_SELECTOR_GREEDY: return last_time_for(st->last_e2e_ns, st->last_bytes, bytes);
    case FL_SELECTOR_GREEDY_INTRA: return last_time_for(st->last_intra_ns, st->last_bytes, bytes);
    default: return fl_leo_cost(st, bytes, now_ns);
  }
}

int fl_selector_choose(const struct fl_selector* s, uint64_t bytes, uint64_t now_ns) {
  if (s->npaths == 1) return 0;
  if (s->kind == FL_SELECTOR_ROUND_ROBIN) return s->rr_next;
  /* No offline profile: an idle path without a measurement is probed first. */
  for (int p = 0; p < s->npaths; p++)
    if (!s->st[p].have_sample && s->st[p].inflight == 0) return p;
  int best = -1;
  double best_cost = INFINITY, best_base = INFINITY;
  for (int p = 0; p < s->npaths; p++) {
    const struct fl_leo_path* st = &s->st[p];
    if (!st->have_sample) continue; /* being probed */
    double cost = selector_cost(s->kind, st, bytes, now_ns), base = base_time(st, bytes);
    /* ties: the seed's priority list, sorted by base traverse time T(p, S) (§6.2.2), then the lower index */
    if (cost < best_cost || (cost == best_cost && base < best_base)) {
      best_cost = cost;
      best_base = base;
      best = p;
    }
  }
  if (best >= 0) return best;
  int fewest = 0; /* every path is being probed: the least loaded one */
  for (int p = 1; p < s->npaths; p++)
    if (s->st[p].inflight < s->st[fewest].inflight) fewest = p;
  return fewest;
}

void fl_selector_on_assign(struct fl_selector* s, int path, uint64_t bytes, uint64_t now_ns, struct fl_leo_ticket* tk) {
  struct fl_leo_path* st = &s->st[path];
  tk->path = path;
  tk->bytes = bytes;
  tk->t1_ns = now_ns;
  tk->predicted_ns = queue_ns(st, now_ns) + base_time(st, bytes);
  /* eq. 6.2: the queue grows by S / BW when the request joins it */
  uint64_t from = st->busy_until_ns > now_ns ? st->busy_until_ns : now_ns;
  st->busy_until_ns = from + (uint64_t)toll(st, bytes);
  st->inflight++;
  st->requests++;
  st->bytes += bytes;
  if (s->kind == FL_SELECTOR_ROUND_ROBIN && path == s->rr_next) s->rr_next = (s->rr_next + 1) % s->npaths;
}

void fl_selector_on_complete(struct fl_selector* s, const struct fl_leo_ticket* tk, uint64_t t2_ns, uint64_t dwell_ns,
                             uint64_t now_ns) {
  struct fl_leo_path* st = &s->st[tk->path];
  if (st->inflight > 0) st->inflight--;
  double wait = t2_ns > tk->t1_ns ? (double)(t2_ns - tk->t1_ns) : 0; /* t2 - t1 */
  double intra = wait + (double)dwell_ns;                            /* + receiver dwell (our t4 - t3); t6 - t5 = 0 */
  if (tk->bytes > 0 || !st->have_sample) { /* the greedy baselines' last sample, with its size (selector_cost) */
    st->last_e2e_ns = now_ns > tk->t1_ns ? (double)(now_ns - tk->t1_ns) : 0;
    st->last_intra_ns = intra;
    st->last_bytes = tk->bytes;
  }
  if (tk->bytes > 0) {
    st->dwell_bytes = st->dwell_bytes * FL_DECAY + (double)tk->bytes;
    st->dwell_ns = st->dwell_ns * FL_DECAY + (dwell_ns > 0 ? (double)dwell_ns : 1.0);
  }
  st->have_sample = 1;
  if (wait <= FL_NO_WAIT_NS) { /* met no queue of ours: a T_tr sample */
    double t_tr = intra - toll(st, tk->bytes);
    if (t_tr < 0) t_tr = 0;
    /* min filter that slowly forgets, so a path whose latency rises is re-learnt; it starts at the first sample
     * that qualifies, not at the 0 a path whose first completions waited would otherwise keep */
    st->t_tr_ns = st->have_t_tr ? fmin(st->t_tr_ns * 1.001 + 1.0, t_tr) : t_tr;
    st->have_t_tr = 1;
  }
  /* k_hat: the requests that saw this one's queue. A path is FIFO, so every
   * request still in flight on it was placed after this one and waited
   * behind it; the count of the last completion predicts the next. */
  st->khat = st->inflight < FL_KHAT_MAX ? (uint32_t)st->inflight : FL_KHAT_MAX;
  if (s->kind == FL_SELECTOR_LEO_NOTOLL) st->khat = 0; /* the ablation: no toll term */
  /* re-anchor eq. 6.2 on what is really left: nothing once the path drained */
  if (st->inflight == 0) st->busy_until_ns = now_ns;
}

int fl_selector_parse(const char* name) {
  if (!name || !*name || !strcmp(name, "leo")) return FL_SELECTOR_LEO;
  if (!strcmp(name, "rr") || !strcmp(name, "round-robin")) return FL_SELECTOR_ROUND_ROBIN;
  if (!strcmp(name, "greedy") || !strcmp(name, "greedy_e2e")) return FL_SELECTOR_GREEDY;
  if (!strcmp(name, "greedy_intra")) return FL_SELECTOR_GREEDY_INTRA;
  if (!strcmp(name, "leo_notoll")) return FL_SELECTOR_LEO_NOTOLL;
  return -1;
}

const char* fl_selector_name(int kind) {
  switch (kind) {
    case FL_SELECTOR_LEO: return "leo";
    case FL_SELECTOR_ROUND_ROBIN: return "rr";
    case FL_SELECTOR_GREEDY: return "greedy";
    case FL_SELECTOR_GREEDY_INTRA: return "greedy_intra";
    case FL_SELECTOR_LEO_NOTOLL: return "leo_notoll";
    default: return "?";
  }
}
