/*
 * fuzz_wire.c - fuzzes every parser that reads peer-controlled bytes
 * (handle, hello, frame header, CTS payload), the path selector's
 * arithmetic, and the DATA range claims against an exact byte-map model. Built as a libFuzzer target with clang, or with
 * -DFL_STANDALONE_FUZZ as a bounded random/mutation driver (gcc + ASan/UBSan).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fl_claims.h"
#include "fl_leo.h"
#include "fl_wire.h"

static const uint8_t kSecret[FL_SECRET_BYTES] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  char err[256];
  struct fl_handle h;
  if (fl_handle_decode(data, size, &h, err, sizeof(err)) == 0) {
    if (h.naddrs < 1 || h.naddrs > FL_HANDLE_MAX_ADDRS) abort(); /* decoder promised bounds */
    uint8_t re[FL_HANDLE_BYTES];
    fl_handle_encode(re, &h);
  }
  struct fl_hello he;
  if (fl_hello_decode(data, size, &he, err, sizeof(err)) == 0) {
    if (he.path_index >= he.npaths || he.npaths > FL_MAX_PATHS) abort();
    (void)fl_hello_accept(&he, kSecret, err, sizeof(err));
  }
  struct fl_frame f;
  if (fl_frame_decode(data, size, &f, err, sizeof(err)) == 0) {
    if (f.type == FL_FRAME_DATA && (f.offset + f.length > f.total || f.length > FL_MAX_CHUNK_BYTES)) abort();
    if (f.type == FL_FRAME_CTS) {
      struct fl_cts_entry e[FL_MAX_RECVS];
      if (size >= FL_FRAME_HDR_BYTES) (void)fl_cts_decode(data + FL_FRAME_HDR_BYTES, size - FL_FRAME_HDR_BYTES, f.index, e, err, sizeof(err));
    }
  }
  if (size > 0) { /* CTS with an arbitrary n */
    struct fl_cts_entry e[FL_MAX_RECVS];
    (void)fl_cts_decode(data + 1, size - 1, (int)(int8_t)data[0], e, err, sizeof(err));
  }
  /* Selector under arbitrary event sequences: must stay in range, never NaN. */
  struct fl_selector s;
  fl_selector_init(&s, size ? data[0] % FL_NUM_SELECTORS : 0, size > 1 ? 1 + data[1] % FL_MAX_PATHS : 2);
  uint64_t t = 1000;
  struct fl_leo_ticket open_tk[64];
  int nopen = 0;
  for (size_t i = 2; i + 3 < size; i += 4) {
    uint64_t bytes = (uint64_t)data[i] << (data[i + 1] % 24);
    t += (uint64_t)data[i + 2] * 1000;
    if (nopen < 64 && (data[i + 1] & 1)) { /* a request arrives */
      int p = fl_selector_choose(&s, bytes, t);
      if (p < 0 || p >= s.npaths) abort();
      fl_selector_on_assign(&s, p, bytes, t, &open_tk[nopen++]);
    } else if (nopen > 0) { /* one completes (any order across paths) */
      int k = data[i + 3] % nopen;
      struct fl_leo_ticket tk = open_tk[k];
      open_tk[k] = open_tk[--nopen];
      uint64_t t2 = tk.t1_ns + (uint64_t)data[i + 3] * 100u;
      if (t < t2) t = t2;
      fl_selector_on_complete(&s, &tk, t2, (uint64_t)data[i + 2] * 1000u, t + data[i + 3]);
    }
    for (int q = 0; q < s.npaths; q++) {
      double c = fl_leo_cost(&s.st[q], bytes, t);
      if (isnan(c) || c < 0 || s.st[q].inflight < 0) abort();
    }
  }
  /* Claims: granted ranges never overlap or leave the message, and the
   * prefix equals the model's longest fully claimed prefix. */
  enum { ENTRIES = 3, TOTAL = 256 };
  static struct fl_claims cl;
  static uint8_t owned[ENTRIES][TOTAL];
  uint64_t prefix[ENTRIES] = {0};
  memset(&cl, 0, sizeof(cl));
  memset(owned, 0, sizeof(owned));
  for (size_t i = 0; i + 2 < size; i += 3) {
    int e = data[i] % ENTRIES;
    uint64_t off = data[i + 1], len = data[i + 2] % 64;
    if (data[i] & 0x80) off = prefix[e] + (data[i + 1] & 31); /* mostly near the frontier: gaps and merges */
    int model_ok = off + len <= TOTAL;
    for (uint64_t b = off; model_ok && b < off + len; b++) model_ok = !owned[e][b];
    int got = fl_claim(&cl, 7, (uint8_t)e, &prefix[e], TOTAL, off, len, err, sizeof(err));
    if (got == 0 && !model_ok) abort(); /* granted an overlap or an overrun */
    if (got == 0)
      for (uint64_t b = off; b < off + len; b++) owned[e][b] = 1;
    uint64_t p = 0;
    while (p < TOTAL && owned[e][p]) p++;
    if (prefix[e] != p) abort();
  }
  return 0;
}

#ifdef FL_STANDALONE_FUZZ
/* Bounded random + mutation driver for machines without libFuzzer. Half the
 * inputs start from a valid encoding so mutations reach the checks past the
 * magic numbers. */
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

int main(int argc, char** argv) {
  double seconds = 10;
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
  rng ^= (uint64_t)time(NULL);
  uint8_t buf[512];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  unsigned long long runs = 0;
  for (;;) {
    size_t len = next() % sizeof(buf);
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)next();
    switch (next() % 4) {
      case 0: {
        struct fl_handle h = {.version = FL_NET_VERSION, .naddrs = 1 + next() % 4};
        for (int a = 0; a < h.naddrs; a++) h.addrs[a].family = 4, h.addrs[a].port = 1 + next() % 65535;
        fl_handle_encode(buf, &h);
        if (len < FL_HANDLE_BYTES) len = FL_HANDLE_BYTES + next() % 16;
        break;
      }
      case 1: {
        struct fl_hello h = {.version = FL_NET_VERSION, .npaths = 1 + next() % 4, .traffic_class = next() % 4};
        memcpy(h.secret, kSecret, sizeof(kSecret));
        fl_hello_encode(buf, &h);
        if (len < FL_HELLO_BYTES) len = FL_HELLO_BYTES + next() % 16;
        break;
      }
      case 2: {
        struct fl_frame f = {.type = 1 + next() % 3, .index = next() % 9, .seq = (uint32_t)next(),
                             .offset = next() % 4096, .length = (uint32_t)(next() % 4096), .total = next() % 8192};
        fl_frame_encode(buf, &f);
        if (len < FL_FRAME_HDR_BYTES) len = FL_FRAME_HDR_BYTES + next() % 200;
        break;
      }
      default:
        break;
    }
    for (int m = (int)(next() % 4); m > 0 && len; m--) buf[next() % len] ^= (uint8_t)(1u << (next() % 8));
    LLVMFuzzerTestOneInput(buf, len);
    runs++;
    if ((runs & 1023) == 0) {
      clock_gettime(CLOCK_MONOTONIC, &t1);
      if ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9 > seconds) break;
    }
  }
  printf("fuzz_wire: %llu inputs in %.0f s, no crash or sanitizer report\n", runs, seconds);
  return 0;
}
#endif
