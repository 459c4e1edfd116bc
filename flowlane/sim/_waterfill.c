/* Max-min fair rate allocation kernel for the flow-level simulator: the progressive filling of
 * flowlane/sim/network.py:_waterfill_numpy (the reference) with strict priority classes, for the small arrays the
 * engine passes ~10^5 times per iteration, where numpy's per-call overhead dominated. Built on first use with the
 * system C compiler and loaded through ctypes (no Python headers needed); single-threaded, no global state.
 *
 * Results are bit-identical to the numpy reference, not merely close, because every floating-point operation is
 * the same one in the same order:
 * - per-link weight sums: np.bincount adds the weights sequentially in (flow, hop) order starting from 0.0; so do we,
 *   over the unfrozen flows in their original order (the compact list `act` keeps that order);
 * - rates subtracted from a link: np.bincount first sums the frozen flows' rates in (flow, hop) order, then
 *   `cap -= sum`; we accumulate `sub[l]` the same way and subtract once (not rate by rate);
 * - the freeze threshold is lvl * (1 + rtol) + 1e-300 with the same rounding; the build passes -ffp-contract=off so
 *   that no compiler fuses it (or anything else) into an FMA on targets that have one;
 * - the level is a minimum (exact in any order); a NaN share makes it NaN, as np.min does.
 * Only links crossed by unfrozen flows are visited per pass (a link no unfrozen flow crosses has share = inf in the
 * reference, and `cap - 0.0` leaves the others unchanged), so a pass costs O(unfrozen flows x hops).
 * Optional wire costs `pen` (n x h, like hops; NULL = all 1): a flow delivering rate r uses r * pen[i][j] of hop j's
 * link (the per-class incast model: bytes lost to incast still occupy the wire). With pen, the weight added to a
 * link is w * pen and the rate subtracted r * pen, each one product, as the reference computes them. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  long nl;          /* links + pad */
  int h;            /* hops per flow (padded) */
  const int64_t *hops;
  const double *pen; /* wire cost per (flow, hop) or NULL */
  double *wsum, *share, *sub;
  unsigned char *mark; /* 1 while a link is on `touched` */
  long *touched;
  long *act;        /* unfrozen flows of the current class, in original order */
} ws_t;

/* Progressive filling of the flows act[0..na) with weights w (NULL: all 1.0) on capacities cap (length nl, pad
 * last), decreased in place. Returns 0, or -2 if a pass froze no flow (only possible with rtol < 0 or NaN weights;
 * the reference would loop forever). */
static int fill(ws_t *s, long na, const double *w, double *cap, double rtol, double *rates) {
  const long pad = s->nl - 1;
  const int h = s->h;
  const int64_t *hops = s->hops;
  const double *pen = s->pen;
  long *act = s->act, *touched = s->touched;
  double *wsum = s->wsum, *share = s->share, *sub = s->sub;
  unsigned char *mark = s->mark;
  while (na > 0) {
    long nt = 0;
    for (long a = 0; a < na; a++) {
      const long i = act[a];
      const double wi = w ? w[i] : 1.0;
      const int64_t *row = hops + i * h;
      for (int j = 0; j < h; j++) {
        const long l = (long)row[j];
        if (l == pad) continue;            /* wsum[-1] = 0 in the reference: the pad never limits */
        if (!mark[l]) {
          mark[l] = 1;
          wsum[l] = 0.0;
          sub[l] = 0.0;
          touched[nt++] = l;
        }
        wsum[l] += pen ? wi * pen[i * h + j] : wi;
      }
    }
    double lvl = INFINITY;
    int nan = 0;
    for (long t = 0; t < nt; t++) {
      const long l = touched[t];
      double sh = INFINITY;
      if (wsum[l] > 0) {
        const double c = cap[l];
        /* np.maximum(c, 0.0): NaN propagates, -0.0 >= 0.0 keeps -0.0 */
        sh = ((c >= 0.0 || isnan(c)) ? c : 0.0) / wsum[l];
      }
      share[l] = sh;
      if (isnan(sh)) nan = 1;
      else if (sh < lvl) lvl = sh;
    }
    if (nan || !isfinite(lvl)) {  /* flows that cross no finite link (cannot happen with real routes) */
      for (long a = 0; a < na; a++) rates[act[a]] = INFINITY;
      for (long t = 0; t < nt; t++) mark[touched[t]] = 0;
      return 0;
    }
    const double thr = lvl * (1 + rtol) + 1e-300;
    long keep = 0;
    for (long a = 0; a < na; a++) {
      const long i = act[a];
      const int64_t *row = hops + i * h;
      int fz = 0;
      for (int j = 0; j < h; j++) {
        const long l = (long)row[j];
        if (l != pad && share[l] <= thr) { fz = 1; break; }
      }
      if (fz) {
        const double r = (w ? w[i] : 1.0) * lvl;
        rates[i] = r;
        for (int j = 0; j < h; j++) {
          const long l = (long)row[j];
          if (l != pad) sub[l] += pen ? r * pen[i * h + j] : r;  /* cap[-1] is reset to inf below */
        }
      } else {
        act[keep++] = i;
      }
    }
    for (long t = 0; t < nt; t++) {
      const long l = touched[t];
      cap[l] -= sub[l];
      mark[l] = 0;
    }
    cap[pad] = INFINITY;
    if (keep == na) return -2;
    na = keep;
  }
  return 0;
}

typedef struct { int64_t c; long i; } ckey_t;
static int key_cmp(const void *x, const void *y) {
  const ckey_t *a = x, *b = y;
  if (a->c != b->c) return a->c < b->c ? -1 : 1;
  return a->i < b->i ? -1 : (a->i > b->i);
}

/* keys[0..n) = (cls[i], i) in a stable order by class: a counting sort when the class values are dense (the
 * engine's ranks are), else a sort of (class, index) pairs, stable by construction. NULL: out of memory. */
static ckey_t *sort_by_class(long n, const int64_t *cls, int64_t lo, int64_t hi) {
  ckey_t *keys = malloc(sizeof(ckey_t) * n);
  if (!keys) return NULL;
  if ((uint64_t)hi - (uint64_t)lo < (uint64_t)n + 1024) {
    const long nc = (long)(hi - lo) + 1;
    long *cnt = calloc(nc + 1, sizeof(long));
    if (!cnt) { free(keys); return NULL; }
    for (long i = 0; i < n; i++) cnt[cls[i] - lo + 1]++;
    for (long c = 0; c < nc; c++) cnt[c + 1] += cnt[c];
    for (long i = 0; i < n; i++) { ckey_t *k = &keys[cnt[cls[i] - lo]++]; k->c = cls[i]; k->i = i; }
    free(cnt);
  } else {
    for (long i = 0; i < n; i++) { keys[i].c = cls[i]; keys[i].i = i; }
    qsort(keys, n, sizeof(ckey_t), key_cmp);
  }
  return keys;
}

static void class_range(long n, const int64_t *cls, int64_t *lo, int64_t *hi) {
  *lo = *hi = cls[0];
  for (long i = 1; i < n; i++) {
    if (cls[i] < *lo) *lo = cls[i];
    if (cls[i] > *hi) *hi = cls[i];
  }
}

/* The per-class incast model's wire costs (network.py:incast_wire_cost is the reference): for flow i's hop j on a
 * link l with inc_link[l], pen = 1 + alpha * max(0, k - thr), k = the hops on l of flows of i's class that count
 * (inc_count[i * h + j] != 0; NULL: all count); 1 elsewhere. keys: the flows sorted by class. cnt: nl zeros (left
 * zeroed); touched: nl longs of scratch. */
static void class_costs(long n, int h, long nl, const int64_t *hops, const ckey_t *keys, const unsigned char *inc_link,
                        const unsigned char *inc_count, double alpha, long thr, long *cnt, long *touched, double *pen) {
  const long pad = nl - 1;
  for (long a = 0; a < n;) {
    long b = a, nt = 0;
    while (b < n && keys[b].c == keys[a].c) b++;
    for (long q = a; q < b; q++) {
      const long i = keys[q].i;
      for (int j = 0; j < h; j++) {
        const long l = (long)hops[i * h + j];
        if (l == pad || !inc_link[l] || (inc_count && !inc_count[i * h + j])) continue;
        if (cnt[l]++ == 0) touched[nt++] = l;
      }
    }
    for (long q = a; q < b; q++) {
      const long i = keys[q].i;
      for (int j = 0; j < h; j++) {
        const long l = (long)hops[i * h + j];
        const long over = (l != pad && inc_link[l] && cnt[l] > thr) ? cnt[l] - thr : 0;
        pen[i * h + j] = 1.0 + alpha * (double)over;
      }
    }
    for (long t = 0; t < nt; t++) cnt[touched[t]] = 0;
    a = b;
  }
}

/* Rates of n flows (hops: n x h row-major, link indices in [0, nl), nl - 1 = pad) on capacities cap (length nl,
 * decreased in place). cls == NULL: one filling with weights w (NULL: all 1.0). Otherwise strict priority: the
 * classes in increasing value, each filled with unit weights on what the previous ones left, its flows in their
 * original order (the reference's stable argsort). inc_link != NULL: the per-class incast model -- wire costs from
 * class_costs with the classes inc_cls, thr and alpha, and inc_count (NULL: every hop counts). Returns 0; -1: out of
 * memory; -2: a pass froze nothing; -(3 + k): hops.flat[k] is not a link index. */
long flowlane_allocate(long n, int h, long nl, const int64_t *hops, const int64_t *cls, const double *w,
                       const int64_t *inc_cls, const unsigned char *inc_link, const unsigned char *inc_count,
                       double alpha, long thr, double *cap, double rtol, double *rates) {
  if (n <= 0) return 0;
  for (long k = 0; k < n * h; k++)
    if (hops[k] < 0 || hops[k] >= nl) return -(3 + k);
  ws_t s = {nl, h, hops, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
  long rc = -1;
  ckey_t *keys = NULL;
  double *pen = NULL;
  long *cnt = NULL;
  s.wsum = malloc(sizeof(double) * nl);
  s.share = malloc(sizeof(double) * nl);
  s.sub = malloc(sizeof(double) * nl);
  s.mark = calloc(nl, 1);
  s.touched = malloc(sizeof(long) * nl);
  s.act = malloc(sizeof(long) * n);
  if (!s.wsum || !s.share || !s.sub || !s.mark || !s.touched || !s.act) goto done;
  int64_t lo = 0, hi = 0;
  if (cls) class_range(n, cls, &lo, &hi);
  if (inc_link) {
    int64_t ilo, ihi;
    class_range(n, inc_cls, &ilo, &ihi);
    pen = malloc(sizeof(double) * n * h);
    cnt = calloc(nl, sizeof(long));
    keys = sort_by_class(n, inc_cls, ilo, ihi);
    if (!pen || !cnt || !keys) goto done;
    class_costs(n, h, nl, hops, keys, inc_link, inc_count, alpha, thr, cnt, s.touched, pen);
    s.pen = pen;
    if (inc_cls != cls) { free(keys); keys = NULL; }
  }
  if (lo == hi) {  /* one class (or weighted): a single filling, as the reference does for classes.size == 1 */
    for (long i = 0; i < n; i++) s.act[i] = i;
    rc = fill(&s, n, cls ? NULL : w, cap, rtol, rates);
    goto done;
  }
  if (!keys && !(keys = sort_by_class(n, cls, lo, hi))) goto done;
  rc = 0;
  for (long a = 0; a < n && rc == 0;) {
    long b = a;
    while (b < n && keys[b].c == keys[a].c) { s.act[b - a] = keys[b].i; b++; }
    rc = fill(&s, b - a, NULL, cap, rtol, rates);
    a = b;
  }
done:
  free(keys); free(pen); free(cnt);
  free(s.wsum); free(s.share); free(s.sub); free(s.mark); free(s.touched); free(s.act);
  return rc;
}
