/*
 * leo_model.c - a closed-loop model that drives the plugin's path selectors (src/fl_leo.c) with synthetic time, to
 * show what each keeps choosing with several requests in flight (nccl_net_plugin/README.md quotes its output).
 *
 * Modelled: two FIFO paths of fixed rate (no foreign traffic), 1 MiB requests, 8 in flight (the multipath study's
 * stream), a fixed 1 ms ACK delay; a request is served when its path drains (t2 = its service start, dwell = S /
 * rate) and the next request is placed when its ACK arrives; 40 s of model time. Not modelled: TCP, chunking, jitter,
 * the receiver's CPU. Deterministic (no randomness, no clock).
 *   make build/leo_model && build/leo_model
 */
#include <stdio.h>
#include <string.h>

#include "fl_leo.h"

#define WINDOW 8
#define REQ_BYTES (1u << 20)
#define ACK_NS 1000000ull
#define HORIZON_NS 40000000000ull

struct req {
  uint64_t start, end, ack;
  struct fl_leo_ticket tk;
};

/* rate in bytes/ns per path */
static void run(int kind, const double rate[2]) {
  struct fl_selector s;
  fl_selector_init(&s, kind, 2);
  struct req q[WINDOW];
  uint64_t now = 0, busy[2] = {0, 0}, bytes = 0;
  long count[2] = {0, 0};
  memset(q, 0, sizeof(q));
  for (int i = 0;; i = -1) {
    if (i < 0) { /* the next ACK completes a request, whose slot sends the next one */
      i = 0;
      for (int k = 1; k < WINDOW; k++)
        if (q[k].ack < q[i].ack) i = k;
      now = q[i].ack;
      if (now >= HORIZON_NS) break;
      fl_selector_on_complete(&s, &q[i].tk, q[i].start, q[i].end - q[i].start, now);
      bytes += REQ_BYTES;
    }
    for (; i < WINDOW; i++) {
      struct req* r = &q[i];
      int p = fl_selector_choose(&s, REQ_BYTES, now);
      fl_selector_on_assign(&s, p, REQ_BYTES, now, &r->tk);
      r->start = busy[p] > now ? busy[p] : now;
      r->end = r->start + (uint64_t)(REQ_BYTES / rate[p]);
      r->ack = r->end + ACK_NS;
      busy[p] = r->end;
      count[p]++;
      if (now > 0) break; /* after the initial window: one request per completion */
    }
  }
  printf("%-13s %3.0f+%3.0f Mbit/s: requests on path 0 / 1: %5ld / %5ld, %5.1f MB/s\n", fl_selector_name(kind),
         rate[0] * 8000, rate[1] * 8000, count[0], count[1], (double)bytes / ((double)now / 1e9) / 1e6);
}

int main(void) {
  const double paths[2][2] = {{0.025, 0.025}, {0.05, 0.0125}}; /* 200+200 and 400+100 Mbit/s */
  const int kinds[FL_NUM_SELECTORS] = {FL_SELECTOR_LEO, FL_SELECTOR_GREEDY, FL_SELECTOR_GREEDY_INTRA,
                                       FL_SELECTOR_LEO_NOTOLL, FL_SELECTOR_ROUND_ROBIN};
  for (int c = 0; c < 2; c++)
    for (int k = 0; k < FL_NUM_SELECTORS; k++) run(kinds[k], paths[c]);
  return 0;
}
