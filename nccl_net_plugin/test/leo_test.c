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
   * the 4th goes to the fast path (a tie goes to the lower base time T), the 5th to the slow. */
  CHECK(path[0] == 0 && path[1] == 0 && path[2] == 0 && path[3] == 0, "first four on the fast path: %d %d %d %d",
        path[0], path[1], path[2], path[3]);
  CHECK(path[4] == 1, "fifth request joins the idle slow path, got %d", path[4]);
  CHECK(path[5] == 0, "sixth: fast queue 4 ms + 1 ms < slow 4 + 4 ms, got %d", path[5]);
  printf("ok joins_a_queued_fast_path_until_the_idle_slow_one_is_cheaper (paths %d%d%d%d%d%d)\n", path[0], path[1],
         path[2], path[3], path[4], path[5]);
}

static void k_hat_counts_the_requests_queued_behind_the_completed_one(void) {
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  CHECK(s.st[0].khat == 0 && s.st[1].khat == 0, "lone probes leave k_hat 0");
  struct fl_leo_ticket tk[4];
  for (int k = 0; k < 4; k++) fl_selector_on_assign(&s, 0, S, t, &tk[k]);
  for (int k = 0; k < 4; k++) {
    uint64_t t2 = t + (uint64_t)k * MS; /* waited behind our own k requests */
    fl_selector_on_complete(&s, &tk[k], t2, 1 * MS, t2 + 1 * MS);
    CHECK(s.st[0].khat == (uint32_t)(3 - k), "after completion %d: k_hat %u, expected %d", k, s.st[0].khat, 3 - k);
  }
  printf("ok k_hat_counts_the_requests_queued_behind_the_completed_one\n");
}

static void the_toll_sends_a_request_to_the_idle_slow_path_before_the_queue_alone_would(void) {
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  struct fl_leo_ticket tk[4];
  for (int k = 0; k < 4; k++) fl_selector_on_assign(&s, 0, S, t, &tk[k]);
  fl_selector_on_complete(&s, &tk[0], t, 1 * MS, t + 1 * MS); /* 3 queued behind it: k_hat 3 */
  t += 1 * MS;
  /* fast: Q 3 ms + k_hat 3 x toll 1 ms + T 1 ms = 7 ms; slow idle: 4 ms. Without the toll: 4 ms, a tie. */
  double c0 = fl_leo_cost(&s.st[0], S, t), c1 = fl_leo_cost(&s.st[1], S, t);
  CHECK(fabs(c0 - 7.0 * MS) < 0.05 * MS && fabs(c1 - 4.0 * MS) < 0.05 * MS, "costs %.0f / %.0f ns", c0, c1);
  CHECK(fl_selector_choose(&s, S, t) == 1, "the toll must send the request to the idle slow path");
  printf("ok the_toll_sends_a_request_to_the_idle_slow_path_before_the_queue_alone_would\n");
}

static void a_lone_request_stays_on_a_fast_path_slowed_by_a_foreign_flow(void) {
  /* A competing flow halves path 0 (dwell 2 ms for S); path 1 takes 4 ms.
   * One request at a time queues behind nobody: no toll, path 0 still wins. */
  struct fl_selector s;
  uint64_t t = learn_4_to_1(&s, FL_SELECTOR_LEO);
  for (int k = 0; k < 20; k++) {
    int p = fl_selector_choose(&s, S, t);
    CHECK(p == 0, "request %d: a lone request must stay on the faster path, got %d", k, p);
    struct fl_leo_ticket x;
    fl_selector_on_assign(&s, p, S, t, &x);
    fl_selector_on_complete(&s, &x, t, 2 * MS, t + 2 * MS);
    t += 3 * MS;
  }
  CHECK(s.st[0].khat == 0, "k_hat must stay 0 without followers, got %u", s.st[0].khat);
  double bw_ms = (double)S / fl_leo_bw(&s.st[0]) / MS;
  CHECK(bw_ms > 1.9 && bw_ms < 2.1, "BW(p) must follow the dwell time: %.2f ms per request", bw_ms);
  printf("ok a_lone_request_stays_on_a_fast_path_slowed_by_a_foreign_flow\n");
}

static void network_delay_misleads_greedy_e2e_but_not_leo_or_greedy_intra(void) {
  /* Path 0 is the faster link but its ACKs come back 10 ms late (network RTT
   * jitter); dwell-based LEO and Greedy-Intra still prefer it, Greedy-E2E does
   * not (Fig. 6.14: "it can misselect paths due to network fluctuation"). */
  struct fl_selector leo, e2e, intra;
  fl_selector_init(&leo, FL_SELECTOR_LEO, 2);
  fl_selector_init(&e2e, FL_SELECTOR_GREEDY, 2);
  fl_selector_init(&intra, FL_SELECTOR_GREEDY_INTRA, 2);
  struct fl_selector* all[3] = {&leo, &e2e, &intra};
  uint64_t t = 0;
  for (int k = 0; k < 3; k++) {
    for (int i = 0; i < 3; i++) {
      probe(all[i], 0, t, 1 * MS, 10 * MS);
      probe(all[i], 1, t + 20 * MS, 2 * MS, 0);
    }
    t += 40 * MS;
  }
  int pl = fl_selector_choose(&leo, S, t), pg = fl_selector_choose(&e2e, S, t), pi = fl_selector_choose(&intra, S, t);
  CHECK(pl == 0, "LEO must pick the faster link whatever the ACK delay, got %d", pl);
  CHECK(pi == 0, "Greedy-Intra must pick the faster link whatever the ACK delay, got %d", pi);
  CHECK(pg == 1, "Greedy-E2E is expected to be misled here (baseline), got %d", pg);
  printf("ok network_delay_misleads_greedy_e2e_but_not_leo_or_greedy_intra\n");
}

static void greedy_intra_ignores_the_queue_it_builds_leo_notoll_models_it_but_pays_no_toll(void) {
  /* Six requests at once on the 4:1 paths. Greedy-Intra compares the last
   * completed requests only, so all six join the fast path; LEO and its
   * toll-free ablation model the queue (eq. 6.2) and move the fifth. */
  int kinds[3] = {FL_SELECTOR_GREEDY_INTRA, FL_SELECTOR_LEO_NOTOLL, FL_SELECTOR_LEO};
  int slow[3];
  for (int i = 0; i < 3; i++) {
    struct fl_selector s;
    uint64_t t = learn_4_to_1(&s, kinds[i]);
    struct fl_leo_ticket tk;
    slow[i] = 0;
    for (int k = 0; k < 6; k++) {
      int p = fl_selector_choose(&s, S, t);
      fl_selector_on_assign(&s, p, S, t, &tk);
      slow[i] += p == 1;
    }
  }
  CHECK(slow[0] == 0, "Greedy-Intra: no request on the slow path expected, got %d", slow[0]);
  CHECK(slow[1] == 1 && slow[2] == 1, "the queue model moves one request: leo_notoll %d, leo %d", slow[1], slow[2]);
  /* Three on the fast path, the first completes: two queued behind it, Q = 2 ms.
   * LEO: 2 + k_hat 2 x toll 1 + T 1 = 5 ms > slow idle 4 ms; without the toll 3 ms. */
  int choice[2];
  for (int i = 0; i < 2; i++) {
    struct fl_selector s;
    uint64_t t = learn_4_to_1(&s, kinds[i + 1]);
    struct fl_leo_ticket tk[3];
    for (int k = 0; k < 3; k++) fl_selector_on_assign(&s, 0, S, t, &tk[k]);
    fl_selector_on_complete(&s, &tk[0], t, 1 * MS, t + 1 * MS);
    CHECK(s.st[0].khat == (i == 0 ? 0u : 2u), "k_hat %u (%s)", s.st[0].khat, fl_selector_name(kinds[i + 1]));
    choice[i] = fl_selector_choose(&s, S, t + 1 * MS);
  }
  CHECK(choice[0] == 0, "leo_notoll: Q 2 ms + T 1 ms < 4 ms, must stay on the fast path, got %d", choice[0]);
  CHECK(choice[1] == 1, "leo: the toll (2 x 1 ms) must send the request to the idle slow path, got %d", choice[1]);
  printf("ok greedy_intra_ignores_the_queue_it_builds_leo_notoll_models_it_but_pays_no_toll\n");
}

static void ties_follow_the_priority_list_by_base_time_not_the_index(void) {
  /* Path 0 moves S in 4S ns, path 1 in S ns (powers of two: exact costs).
   * Three requests queued on path 1: its cost Q 3S + T S = 4S ties with idle
   * path 0's T 4S; the seed's priority list is sorted by T, so path 1. */
  struct fl_selector s;
  fl_selector_init(&s, FL_SELECTOR_LEO, 2);
  uint64_t t = 0;
  for (int k = 0; k < 3; k++) {
    t = probe(&s, 0, t, 4ull * S, 0);
    t = probe(&s, 1, t, 1ull * S, 0);
  }
  t += 100 * MS;
  struct fl_leo_ticket tk;
  for (int k = 0; k < 3; k++) fl_selector_on_assign(&s, 1, S, t, &tk);
  double c0 = fl_leo_cost(&s.st[0], S, t), c1 = fl_leo_cost(&s.st[1], S, t);
  CHECK(c0 == c1 && c0 == 4.0 * S, "expected an exact tie at 4S ns: %.1f / %.1f", c0, c1);
  int p = fl_selector_choose(&s, S, t);
  CHECK(p == 1, "a tie goes to the lower base time T(p, S) (path 1), got %d", p);
  printf("ok ties_follow_the_priority_list_by_base_time_not_the_index\n");
}

static void t_tr_starts_at_the_first_completion_that_met_no_queue(void) {
  /* The path's first request waited 5 ms in our queue (no T_tr sample); the
   * second waited 15 us (a sample: intra S + 15 us - toll S = 15 us). */
  struct fl_selector s;
  fl_selector_init(&s, FL_SELECTOR_LEO, 1);
  struct fl_leo_ticket tk;
  fl_selector_on_assign(&s, 0, S, 0, &tk);
  fl_selector_on_complete(&s, &tk, 5 * MS, S, 5 * MS + S);
  CHECK(s.st[0].have_sample && !s.st[0].have_t_tr, "a waited completion is a BW sample, not a T_tr one");
  uint64_t t = 20 * MS;
  fl_selector_on_assign(&s, 0, S, t, &tk);
  fl_selector_on_complete(&s, &tk, t + 15000, S, t + 15000 + S);
  CHECK(fabs(s.st[0].t_tr_ns - 15000.0) < 1.0, "T_tr must start at the first qualifying sample: %.1f ns, not 15000",
        s.st[0].t_tr_ns);
  printf("ok t_tr_starts_at_the_first_completion_that_met_no_queue\n");
}

static void selector_names_round_trip(void) {
  for (int k = 0; k < FL_NUM_SELECTORS; k++)
    CHECK(fl_selector_parse(fl_selector_name(k)) == k, "selector %d (%s) does not parse back", k, fl_selector_name(k));
  CHECK(fl_selector_parse("greedy_e2e") == FL_SELECTOR_GREEDY && fl_selector_parse("round-robin") == FL_SELECTOR_ROUND_ROBIN &&
            fl_selector_parse("fastest") == -1,
        "aliases");
  printf("ok selector_names_round_trip\n");
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

static void greedy_baselines_scale_the_last_time_to_the_request_size(void) {
  /* The 4:1 paths, then a 4 KiB request completes on the slow path in 16 us: its raw time is far below the fast
   * path's 1 ms for 1 MiB, but per byte the slow path is still 4x slower, so a 1 MiB request goes to the fast one
   * (the seed keeps T per request type). */
  int kinds[2] = {FL_SELECTOR_GREEDY, FL_SELECTOR_GREEDY_INTRA};
  for (int i = 0; i < 2; i++) {
    struct fl_selector s;
    uint64_t t = learn_4_to_1(&s, kinds[i]);
    struct fl_leo_ticket tk;
    fl_selector_on_assign(&s, 1, 4096, t, &tk);
    fl_selector_on_complete(&s, &tk, t, 16000, t + 16000);
    t += MS;
    int p = fl_selector_choose(&s, S, t);
    CHECK(p == 0, "%s: a 1 MiB request after a 4 KiB completion on the slow path must take the fast path, got %d",
          fl_selector_name(kinds[i]), p);
    /* ... and a zero-byte completion there keeps the sized sample instead of a raw 1 us */
    fl_selector_on_assign(&s, 1, 0, t, &tk);
    fl_selector_on_complete(&s, &tk, t, 0, t + 1000);
    p = fl_selector_choose(&s, S, t + MS);
    CHECK(p == 0, "%s: a zero-byte completion on the slow path made it look cheap for 1 MiB, got %d",
          fl_selector_name(kinds[i]), p);
  }
  printf("ok greedy_baselines_scale_the_last_time_to_the_request_size\n");
}

int main(void) {
  joins_a_queued_fast_path_until_the_idle_slow_one_is_cheaper();
  k_hat_counts_the_requests_queued_behind_the_completed_one();
  the_toll_sends_a_request_to_the_idle_slow_path_before_the_queue_alone_would();
  a_lone_request_stays_on_a_fast_path_slowed_by_a_foreign_flow();
  network_delay_misleads_greedy_e2e_but_not_leo_or_greedy_intra();
  greedy_intra_ignores_the_queue_it_builds_leo_notoll_models_it_but_pays_no_toll();
  ties_follow_the_priority_list_by_base_time_not_the_index();
  t_tr_starts_at_the_first_completion_that_met_no_queue();
  selector_names_round_trip();
  unmeasured_paths_are_probed_and_round_robin_rotates_per_request();
  zero_byte_requests_leave_the_estimates_finite();
  greedy_baselines_scale_the_last_time_to_the_request_size();
  if (g_fail) return 1;
  printf("leo_test: all cases passed\n");
  return 0;
}
