/*
 * bvn.c - compiled all-to-all phase planner for flowlane/hermod/matching.py (issue 30 item 5).
 *
 * Same plans as the pure-Python reference in matching.py, phase for phase and send for send, not merely plans of
 * equal quality: every rank computes the identical plan from the identical matrix (decisions.md A6.1 #11), whichever of
 * the two implementations it happens to run. Integer-only (int64), no floating point, no library tie-breaking
 * (qsort runs on keys made unique by the cell index, or on bare values, whose equal copies are indistinguishable). Built on first use with the system C compiler
 * (flowlane/_cbuild.py) and loaded through ctypes; no global state, reentrant.
 *
 * flowlane_bvn(n, T, bottleneck, ...): Birkhoff-von Neumann, reproducing matching.bvn_phases:
 *   1. real = T with the diagonal zeroed; L = max(row sum, column sum); L == 0: no phases.
 *   2. padding (_pad): dummy traffic brings every row and column sum to L, one greedy pass over the n*n cells in
 *      index order (bottleneck: by decreasing real entry, ties in index order), add = min(row deficit, col deficit).
 *   3. while real + dummy has a positive entry: take a perfect matching of its support --
 *      first:      the previous phase's matching minus the pairs whose entry the phase emptied, completed by Kuhn's
 *                  augmenting paths from the unmatched rows in index order, each row's DFS trying columns in index
 *                  order with a fresh `seen` set per row (the first phase starts from the empty matching). A phase
 *                  empties one or a few entries, so a phase costs one or a few searches instead of n;
 *      bottleneck: the highest threshold whose entries >= threshold still hold a perfect matching, then Kuhn as
 *                  above from scratch on that support. Found by binary search over the positive entries (sorted
 *                  once, then kept sorted as phases change n of them), bounded by the smallest row or column
 *                  maximum and by the previous phase's threshold (tried first); each step only asks whether a
 *                  perfect matching exists, answered by growing one warm matching (Berge), so the search gives the
 *                  reference's threshold and the final Kuhn run its matching;
 *      w = smallest matched entry; each matched pair sends a = min(w, real) real units, the rest of w is dummy.
 *   The support is kept as bitsets (64 columns per word); "next column in index order that is in the support and
 *   not yet seen" is the lowest set bit of support & ~seen, which is the column the Python loop reaches next
 *   (columns it passed are either outside the support or already seen, and seen bits are never cleared mid-row).
 * flowlane_alg3(n, T, ...): seed Algorithm 3, reproducing matching.algorithm3_phases: repeated max-weight
 *   assignment (Hungarian, the same e-maxx formulation and loop order as _max_weight_assignment; the Python float
 *   infinity is only ever an initial value, replaced by a finite one before any arithmetic, so INT64_MAX stands in
 *   for it exactly), w = smallest positive matched entry.
 *
 * Contract (the caller, matching.py, validates before calling; the C code trusts it):
 *   n >= 1; T is n*n row-major int64, every entry >= 0, and n * max entry <= 2^50 (no sum can overflow; the
 *   Hungarian potentials stay within +-2^52).
 *   Outputs: weight[k] and count[k] per phase k (at most cap_phases), sends (src[m], dst[m], amt[m]) of all phases
 *   concatenated in phase order, rows in increasing src order (at most cap_sends).
 *   max_phases > 0 caps the plan (flowlane_bvn): after max_phases - 1 matched phases, one residual phase sends every
 *   real entry left (*residual = 1 then). It bounds planning time and per-phase costs; the residual may incast.
 * Returns the number of phases (>= 0), or
 *   -1 out of memory, -2 no perfect matching (cannot happen for a valid input: the padded matrix is L times a
 *   doubly stochastic one), -3 more than cap_phases phases, -4 more than cap_sends sends (the caller retries with
 *   larger buffers; n*n phases and n*n*n sends always suffice).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t word;

typedef struct {
  int n, W;
  const word *sup; /* n rows of W words */
  word *seen;      /* W words */
  int *col_of_row, *row_of_col;
} km_t;

static int augment(km_t *k, int i) {
  const word *s = k->sup + (size_t)i * k->W;
  for (;;) {
    int j = -1;
    for (int w = 0; w < k->W; w++) {
      word c = s[w] & ~k->seen[w];
      if (c) {
        j = w * 64 + __builtin_ctzll(c);
        break;
      }
    }
    if (j < 0) return 0;
    k->seen[j >> 6] |= (word)1 << (j & 63);
    if (k->row_of_col[j] < 0 || augment(k, k->row_of_col[j])) {
      k->row_of_col[j] = i;
      k->col_of_row[i] = j;
      return 1;
    }
  }
}

/* _perfect_matching: 1 and col_of_row filled, or 0 */
static int perfect(km_t *k) {
  for (int i = 0; i < k->n; i++) k->col_of_row[i] = k->row_of_col[i] = -1;
  for (int i = 0; i < k->n; i++) {
    memset(k->seen, 0, sizeof(word) * (size_t)k->W);
    if (!augment(k, i)) return 0;
  }
  return 1;
}

/* _complete_matching: augment every unmatched row (cor[i] < 0) in index order; 1, or 0 if one has no path */
static int complete(km_t *k) {
  for (int i = 0; i < k->n; i++) {
    if (k->col_of_row[i] >= 0) continue;
    memset(k->seen, 0, sizeof(word) * (size_t)k->W);
    if (!augment(k, i)) return 0;
  }
  return 1;
}

/* whether k->sup holds a perfect matching, growing the matching k holds: its pairs outside sup are dropped, then
 * every free row is augmented. Exact: a row left with no augmenting path has none in any larger matching (Berge). */
static int feasible(km_t *k) {
  for (int i = 0; i < k->n; i++) {
    int j = k->col_of_row[i];
    if (j >= 0 && !((k->sup[(size_t)i * k->W + (j >> 6)] >> (j & 63)) & 1)) k->col_of_row[i] = k->row_of_col[j] = -1;
  }
  return complete(k);
}

/* thr = the bitsets of the entries of tot (= real + dummy) that are >= t; branch-free */
static void threshold(const int64_t *tot, int n, int W, int64_t t, word *thr) {
  memset(thr, 0, sizeof(word) * (size_t)n * W);
  for (int i = 0; i < n; i++) {
    const int64_t *r = tot + (size_t)i * n;
    word *b = thr + (size_t)i * W;
    for (int j = 0; j < n; j++) b[j >> 6] |= (word)(r[j] >= t) << (j & 63);
  }
}

typedef struct {
  int64_t v;
  long idx;
} cell_t;

static int by_value_desc(const void *a, const void *b) {
  const cell_t *x = a, *y = b;
  if (x->v != y->v) return x->v > y->v ? -1 : 1;
  return x->idx < y->idx ? -1 : (x->idx > y->idx); /* unique key: the order is fully determined */
}

static int i64_asc(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : (x > y);
}

/* the number of entries of sorted v[0..nv) that are <= x */
static long upper(const int64_t *v, long nv, int64_t x) {
  long lo = 0, hi = nv;
  while (lo < hi) {
    long mid = lo + (hi - lo) / 2;
    if (v[mid] <= x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* sorted multiset v[0..nv) of positive entries: one `from` becomes `to` (dropped when to == 0); the new count */
static long move_value(int64_t *v, long nv, int64_t from, int64_t to) {
  long at = upper(v, nv, from) - 1; /* an occurrence of from: the last one */
  memmove(v + at, v + at + 1, sizeof(int64_t) * (size_t)(nv - at - 1));
  nv--;
  if (to > 0) {
    long in = upper(v, nv, to);
    memmove(v + in + 1, v + in, sizeof(int64_t) * (size_t)(nv - in));
    v[in] = to;
    nv++;
  }
  return nv;
}

typedef struct {
  long np, ns, cap_phases, cap_sends;
  int64_t *weight, *amt;
  int32_t *count, *src, *dst;
} out_t;

/* append one phase; the sends of row i are (i, match[i], a) for a > 0. Returns 0 or -3/-4 on overflow. */
static int emit_begin(out_t *o, int64_t w) {
  if (o->np >= o->cap_phases) return -3;
  o->weight[o->np] = w;
  o->count[o->np] = 0;
  return 0;
}

static int emit_send(out_t *o, int i, int j, int64_t a) {
  if (o->ns >= o->cap_sends) return -4;
  o->src[o->ns] = i;
  o->dst[o->ns] = j;
  o->amt[o->ns] = a;
  o->ns++;
  o->count[o->np]++;
  return 0;
}

long flowlane_bvn(int n, const int64_t *T, int bottleneck, long cap_phases, long cap_sends, int64_t *weight,
                  int32_t *count, int32_t *src, int32_t *dst, int64_t *amt, long max_phases, int32_t *residual) {
  const size_t nn = (size_t)n * (size_t)n;
  const int W = (n + 63) / 64;
  out_t o = {0, 0, cap_phases, cap_sends, weight, amt, count, src, dst};
  long ret = -1;
  int64_t *real = malloc(sizeof(int64_t) * nn), *dummy = calloc(nn, sizeof(int64_t));
  int64_t *rows = calloc((size_t)n, sizeof(int64_t)), *cols = calloc((size_t)n, sizeof(int64_t));
  word *sup = calloc((size_t)n * W, sizeof(word)), *thr = calloc((size_t)n * W, sizeof(word));
  word *seen = calloc((size_t)W, sizeof(word));
  int *cor = malloc(sizeof(int) * (size_t)n), *roc = malloc(sizeof(int) * (size_t)n);
  int *wcor = malloc(sizeof(int) * (size_t)n), *wroc = malloc(sizeof(int) * (size_t)n);
  int64_t *vals = bottleneck ? malloc(sizeof(int64_t) * nn) : NULL;
  int64_t *tot = bottleneck ? calloc(nn, sizeof(int64_t)) : NULL; /* real + dummy, for the threshold search */
  cell_t *cells = bottleneck ? malloc(sizeof(cell_t) * nn) : NULL;
  if (!real || !dummy || !rows || !cols || !sup || !thr || !seen || !cor || !roc || !wcor || !wroc ||
      (bottleneck && (!vals || !cells || !tot)))
    goto done;
  int64_t L = 0;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) {
      int64_t v = i == j ? 0 : T[(size_t)i * n + j];
      real[(size_t)i * n + j] = v;
      rows[i] += v;
      cols[j] += v;
    }
  for (int i = 0; i < n; i++) {
    if (rows[i] > L) L = rows[i];
    if (cols[i] > L) L = cols[i];
  }
  ret = 0;
  if (L == 0) goto done;
  /* _pad */
  if (bottleneck) {
    for (size_t c = 0; c < nn; c++) cells[c] = (cell_t){real[c], (long)c};
    qsort(cells, nn, sizeof(cell_t), by_value_desc);
  }
  for (size_t c = 0; c < nn; c++) {
    size_t cc = bottleneck ? (size_t)cells[c].idx : c;
    int i = (int)(cc / n), j = (int)(cc % n);
    int64_t dr = L - rows[i], dc = L - cols[j];
    int64_t add = dr < dc ? dr : dc;
    if (add > 0) {
      dummy[cc] += add;
      rows[i] += add;
      cols[j] += add;
    }
  }
  /* tot = real + dummy is never stored apart: tot[c] = real[c] + dummy[c]; sup = its positive entries */
  long nz = 0, nv = 0;
  int64_t prev_t = INT64_MAX; /* the previous phase's bottleneck threshold */
  for (size_t c = 0; c < nn; c++)
    if (real[c] + dummy[c] > 0) {
      sup[(c / n) * W + (c % n) / 64] |= (word)1 << ((c % n) & 63);
      nz++;
      if (bottleneck) vals[nv++] = tot[c] = real[c] + dummy[c];
    }
  if (bottleneck) qsort(vals, (size_t)nv, sizeof(int64_t), i64_asc); /* once; move_value keeps it sorted */
  km_t k = {n, W, sup, seen, cor, roc}, wk = {n, W, thr, seen, wcor, wroc};
  for (int i = 0; i < n; i++) cor[i] = roc[i] = wcor[i] = wroc[i] = -1;
  *residual = 0;
  while (nz > 0) {
    const int *match;
    if (max_phases > 0 && o.np == max_phases - 1) {
      /* the cap: one last phase sends every real entry left, several per rank (may incast); its weight is the
       * residual's own bound, max(row sum, column sum). No phase at all if only dummy traffic is left. */
      int64_t wr = 0;
      for (int i = 0; i < n; i++) {
        int64_t r = 0, c = 0;
        for (int j = 0; j < n; j++) {
          r += real[(size_t)i * n + j];
          c += real[(size_t)j * n + i];
        }
        if (r > wr) wr = r;
        if (c > wr) wr = c;
      }
      if (wr == 0) break;
      if ((ret = emit_begin(&o, wr)) < 0) goto done;
      for (size_t c = 0; c < nn; c++)
        if (real[c] > 0 && (ret = emit_send(&o, (int)(c / n), (int)(c % n), real[c])) < 0) goto done;
      o.np++;
      *residual = 1;
      break;
    }
    if (!bottleneck) {
      k.sup = sup;
      if (!complete(&k)) {
        ret = -2;
        goto done;
      }
      match = cor;
    } else {
      /* _bottleneck_matching: binary search on the threshold over the positive entries, kept sorted from phase to
       * phase (vals, nv: a multiset; duplicates only repeat a step of the search over distinct values, and the
       * last threshold that holds a perfect matching is the same entry value, so the same Kuhn run decides). The
       * threshold cannot exceed any row's or column's largest entry, which bounds the search from above. */
      int64_t ub = INT64_MAX;
      for (int i = 0; i < n; i++) {
        int64_t rm = 0, cm = 0;
        for (int j = 0; j < n; j++) {
          const int64_t a = tot[(size_t)i * n + j], b = tot[(size_t)j * n + i];
          rm = a > rm ? a : rm;
          cm = b > cm ? b : cm;
        }
        if (rm < ub) ub = rm;
        if (cm < ub) ub = cm;
      }
      /* The search only asks whether a threshold holds a perfect matching, so it grows one warm matching (wk:
       * pairs outside the threshold dropped, free rows augmented) instead of matching from scratch each step; the
       * matching itself then comes from one Kuhn run from scratch at the threshold found, as the reference's. */
      /* Entries only shrink from phase to phase, so the threshold cannot exceed the previous phase's either; that
       * bound held as the threshold itself in 61 % of the phases of Zipf EP-32 plans, so it is tried first. */
      if (prev_t < ub) ub = prev_t;
      long lo = 0, hi = upper(vals, nv, ub) - 1;
      int64_t tstar = -1;
      for (int first = 1; lo <= hi; first = 0) {
        const int64_t t = vals[first ? hi : (lo + hi) / 2];
        threshold(tot, n, W, t, thr);
        if (feasible(&wk)) { /* step past every copy of t: the search runs over distinct values */
          tstar = t;
          lo = upper(vals, nv, t);
        } else {
          hi = upper(vals, nv, t - 1) - 1;
        }
      }
      prev_t = tstar;
      threshold(tot, n, W, tstar, thr);
      k.sup = thr;
      if (tstar < 0 || !perfect(&k)) {
        ret = -2;
        goto done;
      }
      match = cor;
    }
    int64_t w = INT64_MAX;
    for (int i = 0; i < n; i++) {
      size_t c = (size_t)i * n + match[i];
      int64_t v = real[c] + dummy[c];
      if (v < w) w = v;
    }
    if ((ret = emit_begin(&o, w)) < 0) goto done;
    for (int i = 0; i < n; i++) {
      int j = match[i];
      size_t c = (size_t)i * n + j;
      int64_t a = real[c] < w ? real[c] : w;
      if (bottleneck) {
        nv = move_value(vals, nv, tot[c], tot[c] - w);
        tot[c] -= w;
      }
      real[c] -= a;
      dummy[c] -= w - a;
      if (real[c] + dummy[c] == 0) {
        sup[(size_t)i * W + (j >> 6)] &= ~((word)1 << (j & 63));
        nz--;
        if (!bottleneck) cor[i] = roc[j] = -1; /* the pair is gone: row i is searched again next phase */
      }
      if (a > 0 && (ret = emit_send(&o, i, j, a)) < 0) goto done;
    }
    o.np++;
  }
  ret = o.np;
done:
  free(real);
  free(dummy);
  free(rows);
  free(cols);
  free(sup);
  free(thr);
  free(seen);
  free(cor);
  free(roc);
  free(wcor);
  free(wroc);
  free(vals);
  free(tot);
  free(cells);
  return ret;
}

/* _max_weight_assignment on W (n*n), same loop order; match[row] = col. Work arrays of n + 1. */
static void hungarian(int n, const int64_t *Wm, int64_t *u, int64_t *v, int *p, int *way, int64_t *minv,
                      unsigned char *used, int *match) {
  memset(u, 0, sizeof(int64_t) * (size_t)(n + 1));
  memset(v, 0, sizeof(int64_t) * (size_t)(n + 1));
  memset(p, 0, sizeof(int) * (size_t)(n + 1));
  memset(way, 0, sizeof(int) * (size_t)(n + 1));
  for (int i = 1; i <= n; i++) {
    p[0] = i;
    int j0 = 0;
    for (int j = 0; j <= n; j++) {
      minv[j] = INT64_MAX;
      used[j] = 0;
    }
    for (;;) {
      used[j0] = 1;
      int i0 = p[j0], j1 = 0;
      int64_t delta = INT64_MAX;
      for (int j = 1; j <= n; j++) {
        if (!used[j]) {
          int64_t cur = -Wm[(size_t)(i0 - 1) * n + (j - 1)] - u[i0] - v[j];
          if (cur < minv[j]) {
            minv[j] = cur;
            way[j] = j0;
          }
          if (minv[j] < delta) {
            delta = minv[j];
            j1 = j;
          }
        }
      }
      for (int j = 0; j <= n; j++) {
        if (used[j]) {
          u[p[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
      if (p[j0] == 0) break;
    }
    for (;;) {
      int j1 = way[j0];
      p[j0] = p[j1];
      j0 = j1;
      if (j0 == 0) break;
    }
  }
  for (int j = 1; j <= n; j++) match[p[j] - 1] = j - 1;
}

long flowlane_alg3(int n, const int64_t *T, long cap_phases, long cap_sends, int64_t *weight, int32_t *count,
                   int32_t *src, int32_t *dst, int64_t *amt) {
  const size_t nn = (size_t)n * (size_t)n;
  out_t o = {0, 0, cap_phases, cap_sends, weight, amt, count, src, dst};
  long ret = -1;
  int64_t *M = malloc(sizeof(int64_t) * nn);
  int64_t *u = malloc(sizeof(int64_t) * (size_t)(n + 1)), *v = malloc(sizeof(int64_t) * (size_t)(n + 1));
  int64_t *minv = malloc(sizeof(int64_t) * (size_t)(n + 1));
  int *p = malloc(sizeof(int) * (size_t)(n + 1)), *way = malloc(sizeof(int) * (size_t)(n + 1));
  int *match = malloc(sizeof(int) * (size_t)n);
  unsigned char *used = malloc((size_t)(n + 1));
  if (!M || !u || !v || !minv || !p || !way || !match || !used) goto done;
  long nz = 0;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < n; j++) {
      int64_t x = i == j ? 0 : T[(size_t)i * n + j];
      M[(size_t)i * n + j] = x;
      nz += x > 0;
    }
  while (nz > 0) {
    hungarian(n, M, u, v, p, way, minv, used, match);
    int64_t w = INT64_MAX;
    for (int i = 0; i < n; i++) {
      int64_t x = M[(size_t)i * n + match[i]];
      if (x > 0 && x < w) w = x;
    }
    if (w == INT64_MAX) { /* cannot happen: a max-weight assignment of a nonzero matrix has a positive entry */
      ret = -2;
      goto done;
    }
    if ((ret = emit_begin(&o, w)) < 0) goto done;
    for (int i = 0; i < n; i++) {
      size_t c = (size_t)i * n + match[i];
      int64_t a = M[c] < w ? M[c] : w;
      if (a > 0) {
        M[c] -= a;
        if (M[c] == 0) nz--;
        if ((ret = emit_send(&o, i, match[i], a)) < 0) goto done;
      }
    }
    o.np++;
  }
  ret = o.np;
done:
  free(M);
  free(u);
  free(v);
  free(minv);
  free(p);
  free(way);
  free(match);
  free(used);
  return ret;
}
