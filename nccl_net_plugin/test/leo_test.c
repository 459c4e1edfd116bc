/*
 * leo_test.c - unit tests of the LEO path model (src/fl_leo.c) with synthetic
 * timestamps: each case pins one behaviour of seed 000 §6.2.2 as fl_leo.h
 * states it. Prints one line per case; exits non-zero on the first failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "fl_leo.h"

#define MS 1000000ull
#define S (1u << 20) /* request size: 1 MiB */

static int g_fail;
#define CHECK(cond, ...)                                         \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);       \
      fprintf(stderr, __VA_ARGS__);                              \
      fprintf(stderr, "\n");                                     \
      g_fail = 1;                                                \
      return;                                                    \
    }                                                            \
  } while (0)

/* One request on `path` at t that met no queue: t2 = t1, dwell = S / rate. */
static uint64_t probe(struct fl_selector* s, int path, uint64_t t, uint64_t dwell, uint64_t ack_delay) {
  struct fl_leo_ticket tk;
  fl_selector_on_assign(s, path, S, t, &tk);
  uint64_t done = t + dwell + ack_delay;
  fl_selector_on_complete(s, &tk, t, dwell, done);
  return done;
}

/* Two paths learnt: path 0 moves S in 1 ms, path 1 in 4 ms (4:1). */
static uint64_t learn_4_to_1(struct fl_selector* s, int kind) {
  fl_selector_init(s, kind, 2);
  uint64_t t = 0;
  for (int k = 0; k < 3; k++) {
    t = probe(s, 0, t, 1 * MS, 0);
    t = probe(s, 1, t, 4 * MS, 0);
  }
  return t + 100 * MS; /* both idle */
}

static void joins_a_queued_fast_path_until_the_idle_slow_one_is_cheaper(void) {
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  int path[6];
  struct fl_leo_ticket tk[6];
  for (int k = 0; k < 6; k++) { /* six requests arrive at once */
    path[k] = fl_selector_choose(&s, S, t);
    fl_selector_on_assign(&s, path[k], S, t, &tk[k]);
  }
  /* fast path: costs 1, 2, 3, 4 ms as its queue grows; slow idle: 4 ms, so
   * the 4th goes to the fast path (tie -> lower index), the 5th to the slow. */
  CHECK(path[0] == 0 && path[1] == 0 && path[2] == 0 && path[3] == 0, "first four on the fast path: %d %d %d %d",
        path[0], path[1], path[2], path[3]);
  CHECK(path[4] == 1, "fifth request joins the idle slow path, got %d", path[4]);
  CHECK(path[5] == 0, "sixth: fast queue 4 ms + 1 ms < slow 4 + 4 ms, got %d", path[5]);
  printf("ok joins_a_queued_fast_path_until_the_idle_slow_one_is_cheaper (paths %d%d%d%d%d%d)\n", path[0], path[1],
         path[2], path[3], path[4], path[5]);
}

static void own_queue_never_raises_k_hat_but_foreign_contention_does(void) {
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  /* three of our requests queue on path 0 and complete exactly as predicted */
  struct fl_leo_ticket tk[3];
  for (int k = 0; k < 3; k++) fl_selector_on_assign(&s, 0, S, t, &tk[k]);
  for (int k = 0; k < 3; k++) {
    uint64_t t2 = t + (uint64_t)k * MS; /* waited behind our own k requests */
    fl_selector_on_complete(&s, &tk[k], t2, 1 * MS, t2 + 1 * MS);
  }
  CHECK(s.st[0].khat == 0, "our own queue counted into k_hat: %u", s.st[0].khat);
  /* now a foreign flow shares path 0: dwell doubles for two requests */
  t += 10 * MS;
  for (int k = 0; k < 2; k++) {
    struct fl_leo_ticket x;
    fl_selector_on_assign(&s, 0, S, t, &x);
    fl_selector_on_complete(&s, &x, t, 3 * MS, t + 3 * MS);
    t += 3 * MS;
  }
  CHECK(s.st[0].khat == 2, "two slowed completions must give k_hat 2, got %u", s.st[0].khat);
  double toll = (double)S / fl_leo_bw(&s.st[0]);
  double cost = fl_leo_cost(&s.st[0], S, t);
  CHECK(cost >= 3 * toll * 0.999, "T_total must be k_hat * toll + T >= 3 tolls: %.0f vs toll %.0f", cost, toll);
  /* one completion as predicted resets it */
  struct fl_leo_ticket y;
  fl_selector_on_assign(&s, 0, S, t, &y);
  double pred = y.predicted_ns;
  fl_selector_on_complete(&s, &y, t, (uint64_t)pred, t + (uint64_t)pred);
  CHECK(s.st[0].khat == 0, "an on-time completion must reset k_hat, got %u", s.st[0].khat);
  printf("ok own_queue_never_raises_k_hat_but_foreign_contention_does\n");
}

static void loaded_path_is_avoided_then_retried_once_drained(void) {
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  for (int k = 0; k < 4; k++) { /* a competing flow makes path 0 six times slower than it was */
    struct fl_leo_ticket x;
    fl_selector_on_assign(&s, 0, S, t, &x);
    fl_selector_on_complete(&s, &x, t, 6 * MS, t + 6 * MS);
    t += 6 * MS;
  }
  CHECK(s.st[0].khat == 4, "four slowed completions must give k_hat 4, got %u", s.st[0].khat);
  int p = fl_selector_choose(&s, S, t);
  CHECK(p == 1, "a contended fast path must lose to the idle slow one, got %d", p);
  /* no request of ours on path 0 for longer than k_hat * toll: its queue drained */
  t += (uint64_t)(s.st[0].khat + 1) * 5 * MS;
  p = fl_selector_choose(&s, S, t);
  double c0 = fl_leo_cost(&s.st[0], S, t);
  CHECK(c0 < 5.0 * MS, "a drained path is priced without its stale toll: %.0f ns", c0);
  printf("ok loaded_path_is_avoided_then_retried_once_drained (choice after drain: %d)\n", p);
}

static void network_delay_misleads_greedy_e2e_but_not_leo(void) {
  /* Path 0 is the faster link but its ACKs come back 10 ms late (network RTT
   * jitter); dwell-based LEO still prefers it, Greedy-E2E does not (Fig. 6.14). */
  struct fl_selector leo, e2e;
  fl_selector_init(&leo, FL_SELECTOR_LEO, 2);
  fl_selector_init(&e2e, FL_SELECTOR_GREEDY, 2);
  uint64_t t = 0;
  for (int k = 0; k < 3; k++) {
    probe(&leo, 0, t, 1 * MS, 10 * MS);
    probe(&e2e, 0, t, 1 * MS, 10 * MS);
    probe(&leo, 1, t + 20 * MS, 2 * MS, 0);
    probe(&e2e, 1, t + 20 * MS, 2 * MS, 0);
    t += 40 * MS;
  }
  int pl = fl_selector_choose(&leo, S, t), pg = fl_selector_choose(&e2e, S, t);
  CHECK(pl == 0, "LEO must pick the faster link whatever the ACK delay, got %d", pl);
  CHECK(pg == 1, "Greedy-E2E is expected to be misled here (baseline), got %d", pg);
  printf("ok network_delay_misleads_greedy_e2e_but_not_leo\n");
}

static void unmeasured_paths_are_probed_and_round_robin_rotates_per_request(void) {
  struct fl_selector s;
  fl_selector_init(&s, FL_SELECTOR_LEO, 3);
  struct fl_leo_ticket tk;
  for (int k = 0; k < 3; k++) {
    int p = fl_selector_choose(&s, S, 0);
    CHECK(p == k, "probe order: expected %d, got %d", k, p);
    fl_selector_on_assign(&s, p, S, 0, &tk);
  }
  fl_selector_init(&s, FL_SELECTOR_ROUND_ROBIN, 3);
  for (int k = 0; k < 7; k++) {
    int p = fl_selector_choose(&s, S, 0);
    CHECK(p == k % 3, "round-robin: expected %d, got %d", k % 3, p);
    fl_selector_on_assign(&s, p, S, 0, &tk);
  }
  printf("ok unmeasured_paths_are_probed_and_round_robin_rotates_per_request\n");
}

static void zero_byte_requests_leave_the_estimates_finite(void) {
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  double bw = fl_leo_bw(&s.st[0]);
  for (int k = 0; k < 100; k++) {
    struct fl_leo_ticket x;
    int p = fl_selector_choose(&s, 0, t);
    fl_selector_on_assign(&s, p, 0, t, &x);
    fl_selector_on_complete(&s, &x, t, 0, t + 1000);
    t += 2000;
  }
  CHECK(fabs(fl_leo_bw(&s.st[0]) - bw) < 1e-12, "zero-byte requests moved BW");
  for (int p = 0; p < 2; p++) CHECK(isfinite(fl_leo_cost(&s.st[p], S, t)), "cost not finite");
  printf("ok zero_byte_requests_leave_the_estimates_finite\n");
}

int main(void) {
  joins_a_queued_fast_path_until_the_idle_slow_one_is_cheaper();
  own_queue_never_raises_k_hat_but_foreign_contention_does();
  loaded_path_is_avoided_then_retried_once_drained();
  network_delay_misleads_greedy_e2e_but_not_leo();
  unmeasured_paths_are_probed_and_round_robin_rotates_per_request();
  zero_byte_requests_leave_the_estimates_finite();
  if (g_fail) return 1;
  printf("leo_test: all cases passed\n");
  return 0;
}
