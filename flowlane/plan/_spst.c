/* SPST planner kernel (DGCL seed 001 §5.2, Algorithms 1-2; digest §2.4 "implementable pseudo-code").
 * The same algorithm, step for step and with the same floating-point operations, as
 * flowlane/plan/spst.py:_spst_python (the reference); tests assert that both give identical plans.
 * Built on first use with the system C compiler and loaded through ctypes (no Python headers needed). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { double c; int h; double rw; int g; int dl; } key_t_;

static int key_less(const key_t_ *a, const key_t_ *b) {
  if (a->c != b->c) return a->c < b->c;
  if (a->h != b->h) return a->h < b->h;
  if (a->rw != b->rw) return a->rw < b->rw;
  if (a->g != b->g) return a->g < b->g;
  return a->dl < b->dl;
}
static void heap_push(key_t_ *hp, long *n, key_t_ k) {
  long i = (*n)++;
  hp[i] = k;
  while (i > 0) {
    long p = (i - 1) / 2;
    if (!key_less(&hp[i], &hp[p])) break;
    key_t_ t = hp[i]; hp[i] = hp[p]; hp[p] = t; i = p;
  }
}
static key_t_ heap_pop(key_t_ *hp, long *n) {
  key_t_ top = hp[0];
  hp[0] = hp[--(*n)];
  long i = 0;
  for (;;) {
    long l = 2 * i + 1, r = l + 1, m = i;
    if (l < *n && key_less(&hp[l], &hp[m])) m = l;
    if (r < *n && key_less(&hp[r], &hp[m])) m = r;
    if (m == i) break;
    key_t_ t = hp[i]; hp[i] = hp[m]; hp[m] = t; i = m;
  }
  return top;
}

/* Returns the number of transfers written, -1 if some destination is unreachable, -2 on capacity/alloc error. */
long flowlane_spst(int R, int S, int H, int maxh, const double *inv, const int32_t *lh, const double *raw,
                   double alpha, long NV, const int64_t *order, const int64_t *verts, const int32_t *srcs,
                   const int64_t *ptr, const int32_t *dests, int64_t *out_u, int32_t *out_k, int32_t *out_a,
                   int32_t *out_b, long cap, double *load /* (S+1)*H, zeroed by caller */) {
  if (R > 64) return -2;
  long NS = (long)R * (S + 1);
  double *T = calloc(S + 1, sizeof(double));
  char *used = calloc(S + 1, 1);
  double *bc = malloc(NS * sizeof(double)), *brw = malloc(NS * sizeof(double));
  int *bh = malloc(NS * sizeof(int)), *pred = malloc(NS * sizeof(int));
  char *has = malloc(NS), *fin = malloc(NS);
  long hcap = NS * (R + 1) + 16;
  key_t_ *hp = malloc(hcap * sizeof(key_t_));
  int depth[64];
  /* marginal-cost cache: C(k, l) of Algorithm 2 stays valid until stage k changes (version stamp) */
  long NL = (long)R * R;
  double *cval = malloc((S + 1) * NL * sizeof(double));
  long *cver = malloc((S + 1) * NL * sizeof(long));
  long *sver = calloc(S + 1, sizeof(long));
  if (cver) for (long z = 0; z < (S + 1) * NL; z++) cver[z] = -1;
  long nout = 0, rc = 0;
  if (!T || !used || !bc || !brw || !bh || !pred || !has || !fin || !hp || !cval || !cver || !sver) {
    rc = -2; goto done; }
  for (long oi = 0; oi < NV; oi++) {
    long i = order[oi];
    int64_t u = verts[i];
    uint64_t D = 0, intree = 0;
    for (long j = ptr[i]; j < ptr[i + 1]; j++) D |= (uint64_t)1 << dests[j];
    for (int g = 0; g < R; g++) depth[g] = -1;
    depth[srcs[i]] = 0; intree = (uint64_t)1 << srcs[i];
    long remaining = ptr[i + 1] - ptr[i];
    while (remaining > 0) {
      memset(has, 0, NS); memset(fin, 0, NS);
      long hn = 0;
      for (int g = 0; g < R; g++) {
        if (depth[g] < 0) continue;
        long st = (long)g * (S + 1) + depth[g];
        bc[st] = 0.0; bh[st] = 0; brw[st] = 0.0; pred[st] = -1; has[st] = 1;
        key_t_ k = {0.0, 0, 0.0, g, depth[g]};
        heap_push(hp, &hn, k);
      }
      long target = -1;
      while (hn > 0) {
        key_t_ k = heap_pop(hp, &hn);
        long st = (long)k.g * (S + 1) + k.dl;
        if (fin[st]) continue;
        if (bc[st] != k.c || bh[st] != k.h || brw[st] != k.rw) continue;
        fin[st] = 1;
        if (((D >> k.g) & 1) && !((intree >> k.g) & 1)) { target = st; break; }
        int kk = k.dl + 1;
        if (kk > S) continue;
        uint64_t onpath = 0;
        for (long p = st; p >= 0; p = pred[p]) onpath |= (uint64_t)1 << (p / (S + 1));
        for (int g2 = 0; g2 < R; g2++) {
          if (((intree | onpath) >> g2) & 1) continue;
          const int32_t *hops = lh + ((long)k.g * R + g2) * maxh;
          if (hops[0] < 0) continue;
          long ci = (long)kk * NL + (long)k.g * R + g2;
          double m;
          if (cver[ci] == sver[kk]) {
            m = cval[ci];
          } else {
            double mx = 0.0; int first = 1;
            for (int q = 0; q < maxh && hops[q] >= 0; q++) {
              double v = (load[(long)kk * H + hops[q]] + 1.0) * inv[hops[q]];
              if (first || v > mx) { mx = v; first = 0; }
            }
            m = mx - T[kk];
            if (m < 0) m = 0.0;
            cval[ci] = m; cver[ci] = sver[kk];
          }
          if (alpha != 0.0 && !used[kk]) m += alpha;
          double nc = k.c + m; int nh = k.h + 1; double nrw = k.rw + raw[(long)k.g * R + g2];
          long s2 = (long)g2 * (S + 1) + kk;
          if (fin[s2]) continue;
          int better = !has[s2];
          if (!better) {
            if (nc != bc[s2]) better = nc < bc[s2];
            else if (nh != bh[s2]) better = nh < bh[s2];
            else better = nrw < brw[s2];
          }
          if (better) {
            bc[s2] = nc; bh[s2] = nh; brw[s2] = nrw; has[s2] = 1; pred[s2] = (int)st;
            if (hn >= hcap) { rc = -2; goto done; }
            key_t_ nk = {nc, nh, nrw, g2, kk};
            heap_push(hp, &hn, nk);
          }
        }
      }
      if (target < 0) { rc = -1; goto done; }
      /* commit the path, source side first */
      int chain[65]; int len = 0;
      for (long p = target; p >= 0; p = pred[p]) chain[len++] = (int)p;
      for (int q = len - 1; q > 0; q--) {
        int a = chain[q], b = chain[q - 1];
        int ga = a / (S + 1), gb = b / (S + 1), kk = b % (S + 1);
        const int32_t *hops = lh + ((long)ga * R + gb) * maxh;
        for (int z = 0; z < maxh && hops[z] >= 0; z++) {
          double *l = &load[(long)kk * H + hops[z]];
          *l += 1.0;
          double v = *l * inv[hops[z]];
          if (v > T[kk]) T[kk] = v;
        }
        used[kk] = 1;
        sver[kk]++;
        depth[gb] = kk; intree |= (uint64_t)1 << gb;
        if (nout >= cap) { rc = -2; goto done; }
        out_u[nout] = u; out_k[nout] = kk; out_a[nout] = ga; out_b[nout] = gb; nout++;
        if ((D >> gb) & 1) remaining--;
      }
    }
  }
  rc = nout;
done:
  free(cval); free(cver); free(sver);
  free(T); free(used); free(bc); free(brw); free(bh); free(pred); free(has); free(fin); free(hp);
  return rc;
}
