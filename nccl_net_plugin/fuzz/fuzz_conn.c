/*
 * fuzz_conn.c - stateful fuzzer: drives whole connections into the plugin's
 * listen/accept/irecv/test/close calls over loopback TCP and plays the peer
 * from raw sockets: handshakes (valid, forged, partial, silent), DATA frames
 * interleaved on several paths (in order, out of order, overlapping,
 * duplicated, split mid-payload across other paths' frames, mutated),
 * garbage and early closes. Built with ASan/UBSan and linked with the plugin
 * sources, so the receive logic runs exactly as in NCCL's process.
 *
 * Oracles besides the sanitizers: a receive buffer is freed the moment test()
 * reports it done (as NCCL hands it back to the application), so any later
 * write into it is a heap-use-after-free; sizes never exceed what was posted;
 * and while the peer kept every stream in sync (every payload byte follows a
 * pattern of (slot, index, offset)), a completed receive holds exactly that
 * pattern - a completion with a hole in it is a bug.
 *
 * Each input is one connection's program. With clang it is a libFuzzer target;
 * with gcc (-DFL_STANDALONE_FUZZ) a bounded random driver: fixed regression
 * programs first, then random ones for --seconds.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fl_core.h"
#include "fl_wire.h"

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "fuzz_conn: invariant violated: "); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
      abort();                                             \
    }                                                      \
  } while (0)

static unsigned long long g_warns, g_completed, g_conns;
static int g_verbose;
static void quiet_logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt,
                         ...) {
  (void)flags, (void)file, (void)line;
  if (level == NCCL_LOG_WARN) g_warns++;
  if (!g_verbose) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputc('\n', stderr);
}

/* ---- program source: the fuzz input, read as small bounded choices ---- */
struct src {
  const uint8_t* p;
  size_t n, i;
};
static unsigned take(struct src* s, unsigned bound) { /* 0..bound-1; 0 once the input is used up */
  if (bound <= 1 || s->i >= s->n) return 0;
  unsigned v = s->p[s->i++];
  if (bound > 256 && s->i < s->n) v = (v << 8) | s->p[s->i++];
  return v % bound;
}

static uint8_t pattern(uint32_t seq, unsigned index, uint64_t off) {
  uint64_t x = (uint64_t)seq * 0x9E3779B97F4A7C15ull + index * 0xBF58476D1CE4E5B9ull + (off >> 3) * 0x94D049BB133111EBull;
  return (uint8_t)(x >> (8 * (off & 7)));
}

/* ---- the peer: raw sockets that speak (or abuse) the wire protocol ---- */
#define MAX_LIVE 8
#define MAX_MSG 20000

struct posted {
  void* req;
  uint32_t seq;
  int n;
  uint8_t* bufs[FL_MAX_RECVS];
  uint64_t caps[FL_MAX_RECVS];
  uint64_t totals[FL_MAX_RECVS]; /* what the honest peer sends */
  uint64_t next[FL_MAX_RECVS];   /* honest peer: next offset to send */
  uint8_t started[FL_MAX_RECVS]; /* honest peer: sent a frame of this entry (a 0-byte message needs one) */
};

struct peer {
  int npaths;
  int fd[FL_MAX_PATHS];
  /* a frame whose payload was only partly written, per path */
  int partial[FL_MAX_PATHS];
  struct fl_frame pf[FL_MAX_PATHS];
  uint64_t pf_sent[FL_MAX_PATHS];
  int in_sync; /* every byte written so far belongs to a well-formed frame */
  void* lc;
  void* rc;
  int failed;
  uint32_t next_seq;
  struct posted live[MAX_LIVE];
  int nlive;
};

static void drain(struct peer* pe) { /* the plugin's CTS/ACK frames: read and drop */
  uint8_t junk[4096];
  for (int p = 0; p < pe->npaths; p++)
    if (pe->fd[p] >= 0)
      while (recv(pe->fd[p], junk, sizeof(junk), MSG_DONTWAIT) > 0) {
      }
}

static void raw_write(struct peer* pe, int p, const void* buf, size_t len) {
  if (pe->fd[p] < 0 || len == 0) return;
  ssize_t w = send(pe->fd[p], buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
  if (w != (ssize_t)len) pe->in_sync = 0; /* a short write desynchronizes the stream: still valid fuzz */
}

static void write_payload(struct peer* pe, int p, const struct fl_frame* f, uint64_t from, uint64_t to) {
  uint8_t buf[4096];
  while (from < to) {
    size_t k = to - from < sizeof(buf) ? (size_t)(to - from) : sizeof(buf);
    for (size_t j = 0; j < k; j++) buf[j] = pattern(f->seq, f->index, f->offset + from + j);
    raw_write(pe, p, buf, k);
    from += k;
  }
}

/* Header plus payload bytes [0, upto) of frame f on path p. */
static void send_frame(struct peer* pe, int p, const struct fl_frame* f, uint64_t upto) {
  if (pe->fd[p] < 0) return;
  if (pe->partial[p]) pe->in_sync = 0; /* starts a frame inside another one's payload */
  uint8_t hdr[FL_FRAME_HDR_BYTES];
  fl_frame_encode(hdr, f);
  raw_write(pe, p, hdr, sizeof(hdr));
  write_payload(pe, p, f, 0, upto);
  pe->partial[p] = upto < f->length;
  pe->pf[p] = *f;
  pe->pf_sent[p] = upto;
}

static void finish_frame(struct peer* pe, int p) {
  if (!pe->partial[p] || pe->fd[p] < 0) return;
  write_payload(pe, p, &pe->pf[p], pe->pf_sent[p], pe->pf[p].length);
  pe->partial[p] = 0;
}

static struct fl_frame data_frame(uint32_t seq, unsigned index, uint64_t off, uint64_t len, uint64_t total) {
  return (struct fl_frame){.type = FL_FRAME_DATA, .index = (uint8_t)index, .seq = seq, .offset = off,
                           .length = (uint32_t)len, .aux = 0, .total = total};
}

static void release(struct posted* q) {
  for (int i = 0; i < q->n; i++) free(q->bufs[i]);
  q->n = 0;
  q->req = NULL;
}

/* One test() on every live receive; completed ones are checked and freed. */
static void test_all(struct peer* pe) {
  for (int k = 0; k < pe->nlive; k++) {
    struct posted* q = &pe->live[k];
    int done = 0, sizes[FL_MAX_RECVS];
    for (int i = 0; i < FL_MAX_RECVS; i++) sizes[i] = -1;
    ncclResult_t rc = fl_test(q->req, &done, sizes);
    if (rc != ncclSuccess) { /* whatever the peer sends, it is the peer's fault, never this host's or flowlane's */
      CHECK(rc == ncclRemoteError, "test() on receive %u returned %d, expected ncclRemoteError", q->seq, rc);
      pe->failed = 1;
      return; /* the comm failed: its requests are dead, closeRecv cleans up */
    }
    if (!done) continue;
    for (int i = 0; i < q->n; i++) {
      CHECK(sizes[i] >= 0 && (uint64_t)sizes[i] <= q->caps[i], "receive %u index %d completed with %d bytes, %llu posted",
            q->seq, i, sizes[i], (unsigned long long)q->caps[i]);
      if (pe->in_sync)
        for (int j = 0; j < sizes[i]; j++)
          CHECK(q->bufs[i][j] == pattern(q->seq, (unsigned)i, (uint64_t)j),
                "receive %u index %d reported done with byte %d never written (hole) or wrong", q->seq, i, j);
    }
    g_completed++;
    release(q); /* NCCL gives the buffer back: any later write is a use-after-free */
    pe->live[k] = pe->live[--pe->nlive];
    k--;
  }
}

static void pump(struct peer* pe, int rounds) {
  for (int r = 0; r < rounds && !pe->failed; r++) {
    drain(pe);
    test_all(pe);
  }
}

static void post(struct peer* pe, struct src* s) {
  static const uint64_t kSizes[] = {0, 1, 7, 100, 4096, 4099, 16384, MAX_MSG};
  if (pe->nlive == MAX_LIVE || pe->failed) return;
  struct posted* q = &pe->live[pe->nlive];
  memset(q, 0, sizeof(*q));
  q->n = 1 + (int)take(s, FL_MAX_RECVS);
  void* ptrs[FL_MAX_RECVS];
  size_t sizes[FL_MAX_RECVS];
  int tags[FL_MAX_RECVS];
  for (int i = 0; i < q->n; i++) {
    q->caps[i] = kSizes[take(s, 8)];
    q->totals[i] = take(s, 2) ? q->caps[i] : take(s, (unsigned)q->caps[i] + 1);
    q->bufs[i] = malloc(q->caps[i] ? q->caps[i] : 1); /* exact size: ASan sees one byte past it */
    memset(q->bufs[i], 0xA5, q->caps[i]);
    ptrs[i] = q->bufs[i];
    sizes[i] = q->caps[i];
    tags[i] = i;
  }
  if (fl_irecv(pe->rc, q->n, ptrs, sizes, tags, NULL, &q->req) != ncclSuccess) pe->failed = 1;
  if (!q->req) { /* failed comm, or would block */
    release(q);
    return;
  }
  q->seq = pe->next_seq++;
  pe->nlive++;
}

/* The next honest range of entry i: [off, off + len). Returns 0 when the entry is fully sent. */
static int honest_range(struct posted* q, unsigned i, struct src* s, uint64_t* off, uint64_t* len) {
  uint64_t left = q->totals[i] - q->next[i];
  if (left == 0 && q->started[i]) return 0;
  *off = q->next[i];
  *len = left ? 1 + take(s, (unsigned)left) : 0;
  q->next[i] += *len;
  q->started[i] = 1;
  return 1;
}

/* kind 0: the next range in order; 3: an overlapping or duplicate range;
 * 4: the next two ranges, the later one first and on another path (they
 * overtake each other, as sub-chunks on a faster path do); 5: a frame for a
 * receive that is not posted. */
static void frame_op(struct peer* pe, struct src* s, unsigned kind) {
  int p = (int)take(s, (unsigned)pe->npaths);
  if (pe->partial[p] && take(s, 16)) finish_frame(pe, p); /* rarely: a new frame inside the payload */
  if (kind == 5) {
    struct fl_frame f = data_frame(pe->next_seq + take(s, 3) - 1, take(s, 2), 0, take(s, 64), 64);
    send_frame(pe, p, &f, f.length);
    return;
  }
  if (pe->nlive == 0) return;
  struct posted* q = &pe->live[take(s, (unsigned)pe->nlive)];
  unsigned i = take(s, (unsigned)q->n);
  if (kind != 3 && take(s, 2))
    for (unsigned j = 0; j < (unsigned)q->n; j++)
      if (q->next[j] < q->totals[j] || !q->started[j]) {
        i = j;
        break;
      }
  uint64_t total = q->totals[i];
  uint64_t off, len;
  if (kind == 3) {
    off = total ? take(s, (unsigned)total) : 0;
    len = take(s, (unsigned)(total - off) + 1);
  } else if (!honest_range(q, i, s, &off, &len)) {
    return;
  }
  if (kind == 4) {
    uint64_t off2, len2;
    if (honest_range(q, i, s, &off2, &len2)) {
      int p2 = (int)take(s, (unsigned)pe->npaths);
      if (pe->partial[p2]) finish_frame(pe, p2);
      struct fl_frame later = data_frame(q->seq, i, off2, len2, total);
      send_frame(pe, p2, &later, take(s, 2) ? later.length : take(s, (unsigned)later.length + 1));
      if (p2 == p && pe->partial[p]) finish_frame(pe, p);
    }
  }
  struct fl_frame f = data_frame(q->seq, i, off, len, total);
  if (take(s, 32) == 0) { /* mutate one field; the payload still follows the (mutated) header */
    switch (take(s, 5)) {
      case 0: f.total = take(s, 2) ? q->caps[i] + 1 : total + 1; break;
      case 1: f.index = (uint8_t)take(s, FL_MAX_RECVS + 1); break;
      case 2: f.offset += take(s, 3) - 1; break;
      case 3: f.length = (uint32_t)(f.length + take(s, 3) - 1); break;
      default: f.seq += take(s, 3) - 1; break;
    }
    if (f.length > MAX_MSG + 1) f.length = MAX_MSG + 1;
  }
  uint64_t upto = f.length;
  if (f.length > 0 && take(s, 3) == 0) upto = take(s, f.length); /* stop mid-payload; finished later */
  send_frame(pe, p, &f, upto);
}

static int connect_raw(const struct fl_wire_addr* a) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(a->port)};
  memcpy(&sa.sin_addr, a->addr, 4);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, (struct sockaddr*)&sa, sizeof(sa)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Listen, connect npaths raw sockets, handshake (maybe badly), accept. */
static int open_conn(struct peer* pe, struct src* s, int npaths, int hello_faults) {
  memset(pe, 0, sizeof(*pe));
  pe->in_sync = 1;
  for (int p = 0; p < FL_MAX_PATHS; p++) pe->fd[p] = -1;
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  CHECK(fl_listen(0, handle, &pe->lc) == ncclSuccess, "listen failed");
  struct fl_handle h;
  char err[160];
  CHECK(fl_handle_decode(handle, sizeof(handle), &h, err, sizeof(err)) == 0, "own handle: %s", err);
  CHECK(h.addrs[0].family == 4, "fuzz_conn expects an IPv4 loopback listener");
  pe->npaths = npaths;
  uint64_t conn_id = 0x1234 + take(s, 3);
  for (int p = 0; p < npaths; p++) {
    pe->fd[p] = connect_raw(&h.addrs[0]);
    CHECK(pe->fd[p] >= 0, "loopback connect failed: %s", strerror(errno));
    struct fl_hello he = {.version = FL_NET_VERSION, .conn_id = conn_id, .path_index = (uint16_t)p,
                          .npaths = (uint16_t)npaths, .traffic_class = (uint8_t)take(s, FL_NUM_CLASSES)};
    memcpy(he.secret, h.secret, FL_SECRET_BYTES);
    uint8_t hb[FL_HELLO_BYTES];
    fl_hello_encode(hb, &he);
    size_t len = FL_HELLO_BYTES;
    if (hello_faults && take(s, 4) == 0) {
      switch (take(s, 4)) {
        case 0: hb[8 + take(s, FL_SECRET_BYTES)] ^= 1; break; /* wrong secret */
        case 1: len = take(s, FL_HELLO_BYTES); break;         /* partial or silent */
        case 2: hb[take(s, FL_HELLO_BYTES)] ^= (uint8_t)(1u << take(s, 8)); break;
        default: hb[32] = (uint8_t)take(s, 6); break;          /* path index: duplicate or out of range */
      }
    }
    raw_write(pe, p, hb, len);
  }
  for (int tries = 0; tries < 8 && !pe->rc; tries++) {
    CHECK(fl_accept(pe->lc, &pe->rc) == ncclSuccess, "accept returned an error");
    if (!pe->rc) usleep(tries < 2 ? 0 : 200);
  }
  return pe->rc != NULL;
}

static void close_conn(struct peer* pe) {
  if (pe->rc) fl_close_recv(pe->rc);
  for (int k = 0; k < pe->nlive; k++) release(&pe->live[k]); /* after close: the plugin no longer owns them */
  pe->nlive = 0;
  if (pe->lc) fl_close_listen(pe->lc);
  for (int p = 0; p < FL_MAX_PATHS; p++)
    if (pe->fd[p] >= 0) close(pe->fd[p]);
}

static void run_program(struct src* s) {
  struct peer pe;
  int npaths = 1 + (int)take(s, FL_MAX_PATHS);
  if (!open_conn(&pe, s, npaths, take(s, 8) == 0)) {
    close_conn(&pe);
    return;
  }
  g_conns++;
  for (int op = 0; op < 128 && s->i < s->n && !pe.failed; op++) {
    unsigned kind = take(s, 32); /* mostly honest traffic, so receives complete and state builds up */
    if (kind < 14) frame_op(&pe, s, 0);
    else if (kind < 16) frame_op(&pe, s, 4);
    else if (kind == 16) frame_op(&pe, s, 3);
    else if (kind == 17 && take(s, 4) == 0) frame_op(&pe, s, 5);
    else if (kind < 22) post(&pe, s);
    else if (kind < 24) finish_frame(&pe, (int)take(s, (unsigned)pe.npaths));
    else if (kind == 24 && take(s, 4) == 0) { /* early close or half-close of one path */
      int p = (int)take(s, (unsigned)pe.npaths);
      if (pe.fd[p] >= 0) {
        if (take(s, 2)) shutdown(pe.fd[p], SHUT_WR);
        else close(pe.fd[p]), pe.fd[p] = -1;
      }
    } else if (kind == 25 && take(s, 4) == 0) { /* garbage */
      uint8_t junk[40];
      size_t len = 1 + take(s, sizeof(junk));
      for (size_t j = 0; j < len; j++) junk[j] = (uint8_t)take(s, 256);
      raw_write(&pe, (int)take(s, (unsigned)pe.npaths), junk, len);
      pe.in_sync = 0;
    } else {
      pump(&pe, 1 + (int)take(s, 3));
    }
    if (pe.nlive == 0 && take(s, 2)) post(&pe, s);
  }
  for (int p = 0; p < pe.npaths; p++)
    if (take(s, 2)) finish_frame(&pe, p);
  pump(&pe, 4);
  close_conn(&pe);
}

/* ---- fixed regression programs ---- */

/* Issue 32 item 1: a peer with the secret sends two overlapping DATA frames on
 * two paths. The second must fail the comm; before the fix the first frame's
 * bytes were counted only when complete, test() reported the receive done after
 * the second, and the first kept writing into the returned buffer. */
static void regression_overlap_two_paths(void) {
  struct src none = {0};
  struct peer pe;
  CHECK(open_conn(&pe, &none, 2, 0), "regression: handshake failed");
  enum { N = 128000 };
  uint8_t* buf = malloc(N);
  void* ptr = buf;
  size_t cap = N;
  int tag = 0;
  void* req = NULL;
  CHECK(fl_irecv(pe.rc, 1, &ptr, &cap, &tag, NULL, &req) == ncclSuccess && req, "regression: irecv");
  struct fl_frame f = data_frame(0, 0, 0, N, N);
  send_frame(&pe, 0, &f, 1000); /* path 0: header and 1000 of 128000 bytes */
  int done = 0, size = 0;
  ncclResult_t rc = ncclSuccess;
  for (int k = 0; k < 50 && rc == ncclSuccess && !done; k++) rc = fl_test(req, &done, &size);
  CHECK(rc == ncclSuccess && !done, "regression: 1000 of 128000 bytes cannot complete a receive");
  send_frame(&pe, 1, &f, N); /* path 1: the same range, complete */
  for (int k = 0; k < 2000 && rc == ncclSuccess && !done; k++) rc = fl_test(req, &done, &size);
  if (done) free(buf); /* the receive is the application's again */
  finish_frame(&pe, 0); /* path 0's remaining 127000 bytes */
  enum { N2 = 64 };       /* the next receive reuses the request slot, with a small buffer */
  uint8_t* buf2 = malloc(N2);
  ptr = buf2;
  cap = N2;
  void* req2 = NULL;
  int done2 = 0;
  if (fl_irecv(pe.rc, 1, &ptr, &cap, &tag, NULL, &req2) == ncclSuccess && req2)
    for (int k = 0; k < 200 && !done2; k++)
      if (fl_test(req2, &done2, &size) != ncclSuccess) break;
  CHECK(!done, "regression: overlapping frames completed a receive (test() must return an error)");
  CHECK(rc == ncclRemoteError, "regression: overlapping frames gave %d, expected ncclRemoteError (a protocol fault)", rc);
  fl_close_recv(pe.rc);
  pe.rc = NULL;
  free(buf);
  free(buf2);
  close_conn(&pe);
}

/* Frames overtaking each other across paths (the multi-path normal case) still complete exactly. */
static void regression_out_of_order_gaps(void) {
  struct src none = {0};
  struct peer pe;
  CHECK(open_conn(&pe, &none, 3, 0), "regression: handshake failed");
  enum { N = 9000 };
  uint8_t* buf = malloc(N);
  void* ptr = buf;
  size_t cap = N;
  int tag = 0;
  void* req = NULL;
  CHECK(fl_irecv(pe.rc, 1, &ptr, &cap, &tag, NULL, &req) == ncclSuccess && req, "regression: irecv");
  struct fl_frame c[5] = {data_frame(0, 0, 0, 1000, N), data_frame(0, 0, 1000, 2000, N),
                          data_frame(0, 0, 3000, 1500, N), data_frame(0, 0, 4500, 4000, N),
                          data_frame(0, 0, 8500, 500, N)};
  send_frame(&pe, 2, &c[4], c[4].length); /* the tail first, then the middle, then the head */
  send_frame(&pe, 1, &c[2], c[2].length);
  send_frame(&pe, 0, &c[1], 10);
  send_frame(&pe, 2, &c[3], c[3].length);
  send_frame(&pe, 1, &c[0], c[0].length);
  int done = 0, size = 0;
  for (int k = 0; k < 100 && !done; k++) CHECK(fl_test(req, &done, &size) == ncclSuccess, "regression: gaps failed the comm");
  CHECK(!done, "regression: receive completed with bytes 1010..3000 still missing");
  finish_frame(&pe, 0);
  for (int k = 0; k < 2000 && !done; k++) CHECK(fl_test(req, &done, &size) == ncclSuccess, "regression: gaps failed the comm");
  CHECK(done && size == N, "regression: out-of-order sub-chunks did not complete the receive");
  for (int j = 0; j < N; j++) CHECK(buf[j] == pattern(0, 0, (uint64_t)j), "regression: byte %d wrong", j);
  free(buf);
  close_conn(&pe);
}

static void setup(void) {
  static int done;
  if (done) return;
  done = 1;
  signal(SIGPIPE, SIG_IGN);
  g_verbose = getenv("FUZZ_CONN_VERBOSE") != NULL;
  setenv(FL_ENV_SOCKET_IFNAME, "=lo", 0);
  CHECK(fl_init(quiet_logger) == ncclSuccess, "fl_init failed");
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  setup();
  struct src s = {data, size, 0};
  run_program(&s);
  return 0;
}

#ifdef FL_STANDALONE_FUZZ
static uint64_t rng;
static uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}

int main(int argc, char** argv) {
  double seconds = 5;
  uint64_t seed = (uint64_t)time(NULL);
  int regressions = 1;
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--random-only")) regressions = 0;
  for (int i = 1; i + 1 < argc; i++) {
    if (!strcmp(argv[i], "--seconds")) seconds = atof(argv[i + 1]);
    if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 0);
  }
  setup();
  printf("fuzz_conn: seed %llu (replay with --seed)\n", (unsigned long long)seed);
  fflush(stdout);
  if (regressions) {
    regression_overlap_two_paths();
    regression_out_of_order_gaps();
  }
  rng = seed * 0x9E3779B97F4A7C15ull + 1;
  uint8_t buf[1024];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  unsigned long long runs = 0;
  for (;;) {
    size_t len = 64 + next() % (sizeof(buf) - 64);
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)next();
    LLVMFuzzerTestOneInput(buf, len);
    runs++;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if ((t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9 > seconds) break;
  }
  printf("fuzz_conn: %llu programs in %.0f s (%llu connections accepted, %llu receives completed, %llu plugin "
         "warnings), no crash or sanitizer report\n", runs, seconds, g_conns, g_completed, g_warns);
  return 0;
}
#endif
