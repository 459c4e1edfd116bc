/* SPST planner kernel (DGCL seed 001 §5.2, Algorithms 1-2; digest §2.4 "implementable pseudo-code").
 * Gives exactly the plans of flowlane/plan/spst.py:_spst_python (the reference, a heap-based Dijkstra over
 * (rank, depth) states); tests assert identical digests and costs. Built on first use with the system C compiler and
 * loaded through ctypes (no Python headers needed). Single-threaded, like the seed's Table 8 measurements.
 *
 * Profile of the previous version of this kernel (Web-Google-sized graph, 16 ranks on two_servers): one search per
 * (vertex, destination) pair, ~17 settled states and ~185 edge relaxations per search, ~1.8 committed transfers per
 * search; 58 % of the relaxations recomputed the marginal cost over the link's hops (the cache was invalidated by
 * every commit), and the heap took ~25 % of the rest. What changed, without changing any result:
 *
 * - Marginal cost C(k, l) = max(0, M(k, l) - t^k) with M(k, l) = max_{h in l} (c_h^k + 1)/b_h kept up to date
 *   *eagerly*: a commit only raises its own hops' loads, so M only grows, by one max() per link sharing a changed hop
 *   (hop -> links index). max() is exact, so M is bit-identical to recomputing it; a relaxation is one subtraction.
 * - No heap. Every edge goes from depth d to d+1 and strictly increases the key (cost, hops, raw time) because hops
 *   grows by one, so the reference's label of a state is the best over its predecessors at depth d - 1, the tie going
 *   to the predecessor popped first, i.e. the one with the smaller key (cost, hops, raw, rank, depth). The search
 *   therefore settles depths in increasing order, breaks exact ties by comparing the predecessors' keys, never expands
 *   an uncovered destination (the reference stops at the first one it pops), and skips states whose key is not below
 *   the best uncovered destination found so far (the reference would pop the target before them; what they could
 *   reach has a larger key still). The target is the uncovered destination with the smallest key, as in the reference.
 * - The ranks on the path to a state are a bitmask stored with its label (no walk along the predecessor chain);
 *   neighbours are a bitmask visited in increasing rank order; state labels are reset by a generation stamp; no
 *   allocation per vertex. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Dijkstra's pop order: (cost, hops, raw time, rank, depth); st = rank*(S+1)+depth orders like (rank, depth) */
static inline int state_less(const double *bc, const int *bh, const double *brw, int a, int b) {
  if (bc[a] != bc[b]) return bc[a] < bc[b];
  if (bh[a] != bh[b]) return bh[a] < bh[b];
  if (brw[a] != brw[b]) return brw[a] < brw[b];
  return a < b;
}
/* Returns the number of transfers written, -1 if some destination is unreachable, -2 on capacity/alloc error. */
long flowlane_spst(int R, int S, int H, int maxh, const double *inv, const int32_t *lh, const double *raw,
                   double alpha, long NV, const int64_t *order, const int64_t *verts, const int32_t *srcs,
                   const int64_t *ptr, const int32_t *dests, int64_t *out_u, int32_t *out_k, int32_t *out_a,
                   int32_t *out_b, long cap, double *load /* (S+1)*H, zeroed by caller */) {
  if (R > 64 || R < 1) return -2;
  const int S1 = S + 1;
  const long NS = (long)R * S1, NL = (long)R * R;
  double *T = calloc(S1, sizeof(double));
  char *used = calloc(S1, 1);
  double *bc = malloc(NS * sizeof(double)), *brw = malloc(NS * sizeof(double));
  int *bh = malloc(NS * sizeof(int)), *pred = malloc(NS * sizeof(int));
  uint64_t *pmask = malloc(NS * sizeof(uint64_t));
  uint32_t *seen = calloc(NS, sizeof(uint32_t));
  uint64_t *lay = malloc(S1 * sizeof(uint64_t));       /* per depth: ranks with a label at that depth */
  double *M = malloc(S1 * NL * sizeof(double));       /* M[k][a*R+b] = max_{h in link a->b} (c_h^k + 1)/b_h */
  int *h2l_ptr = calloc(H + 1, sizeof(int)), *h2l = NULL;
  uint64_t nbr[64];
  int depth[64];
  long nout = 0, rc = 0;
  uint32_t gen = 0;
  if (!T || !used || !bc || !brw || !bh || !pred || !pmask || !seen || !lay || !M || !h2l_ptr) {
    rc = -2; goto done_; }
  /* neighbour masks, initial M (all loads 0: (0 + 1.0) * inv = inv) and the hop -> links index */
  for (int a = 0; a < R; a++) {
    nbr[a] = 0;
    for (int b = 0; b < R; b++) {
      const int32_t *hops = lh + ((long)a * R + b) * maxh;
      double mx = 0.0; int first = 1;
      for (int q = 0; q < maxh && hops[q] >= 0; q++) {
        double v = (0.0 + 1.0) * inv[hops[q]];
        if (first || v > mx) { mx = v; first = 0; }
        h2l_ptr[hops[q] + 1]++;
      }
      if (hops[0] >= 0 && a != b) nbr[a] |= (uint64_t)1 << b;
      for (int k = 0; k < S1; k++) M[(long)k * NL + (long)a * R + b] = mx;
    }
  }
  for (int h = 0; h < H; h++) h2l_ptr[h + 1] += h2l_ptr[h];
  h2l = malloc((h2l_ptr[H] + 1) * sizeof(int));
  if (!h2l) { rc = -2; goto done_; }
  {
    int *fill = calloc(H + 1, sizeof(int));
    if (!fill) { rc = -2; goto done_; }
    for (int a = 0; a < R; a++)
      for (int b = 0; b < R; b++) {
        const int32_t *hops = lh + ((long)a * R + b) * maxh;
        for (int q = 0; q < maxh && hops[q] >= 0; q++) h2l[h2l_ptr[hops[q]] + fill[hops[q]]++] = a * R + b;
      }
    free(fill);
  }
  for (long oi = 0; oi < NV; oi++) {
    long i = order[oi];
    int64_t u = verts[i];
    uint64_t D = 0, intree;
    for (long j = ptr[i]; j < ptr[i + 1]; j++) D |= (uint64_t)1 << dests[j];
    for (int g = 0; g < R; g++) depth[g] = -1;
    depth[srcs[i]] = 0; intree = (uint64_t)1 << srcs[i];
    long remaining = ptr[i + 1] - ptr[i];
    while (remaining > 0) {
      if (++gen == 0) {   /* stamp wrapped: clear the stamps once every 2^32 searches */
        memset(seen, 0, NS * sizeof(uint32_t)); gen = 1;
      }
      const uint64_t Dn = D & ~intree;               /* destinations not yet covered */
      int lo = S1, hi = -1;
      memset(lay, 0, S1 * sizeof(uint64_t));
      for (int g = 0; g < R; g++) {
        if (depth[g] < 0) continue;
        int st = g * S1 + depth[g];
        bc[st] = 0.0; bh[st] = 0; brw[st] = 0.0; pred[st] = -1; seen[st] = gen;
        pmask[st] = (uint64_t)1 << g;
        lay[depth[g]] |= (uint64_t)1 << g;
        if (depth[g] < lo) lo = depth[g];
        if (depth[g] > hi) hi = depth[g];
      }
      int target = -1;
      for (int dl = lo; dl < S && dl <= hi; dl++) {
        const int kk = dl + 1;
        uint64_t todo = lay[dl] & ~Dn;               /* Dijkstra never expands a destination: it stops there */
        if (!todo) continue;
        const double *Mk = M + (long)kk * NL;
        const double Tk = T[kk];
        const double am = (alpha != 0.0 && !used[kk]) ? alpha : 0.0;
        while (todo) {
          int g = __builtin_ctzll(todo);
          todo &= todo - 1;
          int st = g * S1 + dl;
          if (target >= 0 && !state_less(bc, bh, brw, st, target)) continue;  /* never popped before the target */
          uint64_t cand = nbr[g] & ~(intree | pmask[st]);
          const double *Mg = Mk + (long)g * R;
          const double *rawg = raw + (long)g * R;
          const double c = bc[st], rw = brw[st];
          const int nh = bh[st] + 1;
          const uint64_t pm = pmask[st];
          while (cand) {
            int g2 = __builtin_ctzll(cand);
            cand &= cand - 1;
            int s2 = g2 * S1 + kk;
            double m = Mg[g2] - Tk;
            m = m < 0 ? 0.0 : m;
            m += am;                                  /* exact no-op when am == 0 (m >= +0) */
            double nc = c + m; double nrw = rw + rawg[g2];
            int better;
            if (seen[s2] != gen) better = 1;
            else if (nc != bc[s2]) better = nc < bc[s2];
            else if (nh != bh[s2]) better = nh < bh[s2];
            else if (nrw != brw[s2]) better = nrw < brw[s2];
            else better = state_less(bc, bh, brw, st, pred[s2]);   /* tie: Dijkstra keeps the first-popped pred */
            if (better) {
              bc[s2] = nc; bh[s2] = nh; brw[s2] = nrw; seen[s2] = gen; pred[s2] = st;
              pmask[s2] = pm | ((uint64_t)1 << g2);
              lay[kk] |= (uint64_t)1 << g2;
              if (kk > hi) hi = kk;
              if (((Dn >> g2) & 1) && (target < 0 || state_less(bc, bh, brw, s2, target))) target = s2;
            }
          }
        }
      }
      if (target < 0) { rc = -1; goto done_; }
      /* commit the path, source side first */
      int chain[65]; int len = 0;
      for (long p = target; p >= 0; p = pred[p]) chain[len++] = (int)p;
      for (int q = len - 1; q > 0; q--) {
        int a = chain[q], b = chain[q - 1];
        int ga = a / S1, gb = b / S1, kk = b % S1;
        const int32_t *hops = lh + ((long)ga * R + gb) * maxh;
        double *Mk = M + (long)kk * NL;
        for (int z = 0; z < maxh && hops[z] >= 0; z++) {
          int hz = hops[z];
          double *l = &load[(long)kk * H + hz];
          *l += 1.0;
          double v = *l * inv[hz];
          if (v > T[kk]) T[kk] = v;
          double nv = (*l + 1.0) * inv[hz];
          for (int e = h2l_ptr[hz]; e < h2l_ptr[hz + 1]; e++)
            if (nv > Mk[h2l[e]]) Mk[h2l[e]] = nv;
        }
        used[kk] = 1;
        depth[gb] = kk; intree |= (uint64_t)1 << gb;
        if (nout >= cap) { rc = -2; goto done_; }
        out_u[nout] = u; out_k[nout] = kk; out_a[nout] = ga; out_b[nout] = gb; nout++;
        if ((D >> gb) & 1) remaining--;
      }
    }
  }
  rc = nout;
done_:
  free(M); free(h2l); free(h2l_ptr); free(pmask); free(seen); free(lay);
  free(T); free(used); free(bc); free(brw); free(bh); free(pred);
  return rc;
}
