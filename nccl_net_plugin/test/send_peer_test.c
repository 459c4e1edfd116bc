/*
 * send_peer_test.c - the send path against a peer that holds the handle's
 * secret but not the protocol: a raw socket plays the receiver of a plugin
 * send comm over loopback (the plugin's sources are linked in, ASan+UBSan).
 * fuzz_conn plays the sender against the receive path; this is its mirror for
 * the ACKs a send comm trusts.
 *
 * Oracle: test() may report a send done only once the plugin no longer reads
 * the caller's buffer. The buffer is overwritten the moment test() says done
 * (NCCL hands it back to the application), and every payload byte the peer
 * reads afterwards must still be the original pattern.
 *
 * Cases (one line each; exits non-zero on the first failure):
 *   honest      read the whole chunk, then ACK: done, payload intact
 *   early_ack   ACK right after the 32-byte header while most of the 16 MiB
 *               chunk is unsent: ncclRemoteError, never done
 *   wrong_ack   ACK naming a chunk that was never sent: ncclRemoteError
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fl_core.h"
#include "fl_wire.h"

#define CHUNK (16u << 20) /* FL_MAX_CHUNK_BYTES: far more than a small receive window plus the send buffer */
#define PEER_RCVBUF 4096  /* keeps the plugin's write unfinished while the peer reads only the header */

static int g_fail;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s: ", g_case);                \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
      g_fail = 1;                                          \
      return;                                              \
    }                                                      \
  } while (0)
static const char* g_case;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Read exactly n bytes within `seconds` without calling into the plugin; returns bytes read. */
static size_t read_for(int fd, uint8_t* out, size_t n, double seconds) {
  size_t got = 0;
  double end = now_s() + seconds;
  while (got < n && now_s() < end) {
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 10) <= 0) continue;
    ssize_t r = recv(fd, out + got, n - got, 0);
    if (r <= 0) break;
    got += (size_t)r;
  }
  return got;
}

static int send_all(int fd, const void* b, size_t n) { return send(fd, b, n, MSG_NOSIGNAL) == (ssize_t)n ? 0 : -1; }

struct pair {
  void* send_comm;
  int peer; /* the raw socket on the receiving end */
};

/* A plugin send comm connected to a raw socket that has read the hello. */
static int open_pair(struct pair* pr) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  int rcvbuf = PEER_RCVBUF;
  setsockopt(ls, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf)); /* inherited by the accepted socket */
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof(a);
  if (bind(ls, (struct sockaddr*)&a, sizeof(a)) || listen(ls, 4) || getsockname(ls, (struct sockaddr*)&a, &al)) return -1;
  struct fl_handle h = {.version = FL_NET_VERSION, .naddrs = 1};
  memset(h.secret, 7, sizeof(h.secret));
  h.addrs[0].family = 4;
  h.addrs[0].port = ntohs(a.sin_port);
  memcpy(h.addrs[0].addr, &a.sin_addr, 4);
  uint8_t handle[FL_HANDLE_BYTES];
  fl_handle_encode(handle, &h);
  pr->send_comm = NULL;
  pr->peer = -1;
  for (double end = now_s() + 10; !pr->send_comm && now_s() < end;) {
    if (fl_connect(0, -1, handle, &pr->send_comm) != ncclSuccess) return -1;
    struct pollfd p = {ls, POLLIN, 0};
    if (pr->peer < 0 && poll(&p, 1, 1) > 0) pr->peer = accept(ls, NULL, NULL);
  }
  close(ls);
  uint8_t hello[FL_HELLO_BYTES];
  if (!pr->send_comm || pr->peer < 0 || read_for(pr->peer, hello, sizeof(hello), 5) != sizeof(hello)) return -1;
  return 0;
}

static void close_pair(struct pair* pr) {
  fl_close_send(pr->send_comm);
  close(pr->peer);
}

/* Post a one-entry CTS for tag 0, then isend `n` bytes of buf; returns the request. */
static void* post_and_send(struct pair* pr, uint8_t* buf, size_t n) {
  uint8_t cts[FL_FRAME_HDR_BYTES + FL_CTS_ENTRY_BYTES];
  struct fl_frame f = {.type = FL_FRAME_CTS, .index = 1, .seq = 0, .length = FL_CTS_ENTRY_BYTES};
  fl_frame_encode(cts, &f);
  struct fl_cts_entry e = {.tag = 0, .size = n};
  fl_cts_encode(cts + FL_FRAME_HDR_BYTES, &e, 1);
  if (send_all(pr->peer, cts, sizeof(cts))) return NULL;
  void* req = NULL;
  for (double end = now_s() + 5; !req && now_s() < end;)
    if (fl_isend(pr->send_comm, buf, n, 0, NULL, &req) != ncclSuccess) return NULL;
  return req;
}

static int read_data_header(int fd, struct fl_frame* d) {
  uint8_t hdr[FL_FRAME_HDR_BYTES];
  char err[128];
  if (read_for(fd, hdr, sizeof(hdr), 5) != sizeof(hdr)) return -1;
  return fl_frame_decode(hdr, sizeof(hdr), d, err, sizeof(err)) || d->type != FL_FRAME_DATA ? -1 : 0;
}

static int send_ack(int fd, uint32_t chunk_id) {
  uint8_t ab[FL_FRAME_HDR_BYTES];
  struct fl_frame ack = {.type = FL_FRAME_ACK, .seq = chunk_id};
  fl_frame_encode(ab, &ack);
  return send_all(fd, ab, sizeof(ab));
}

/* Drive test() until it reports done or an error (or 10 s pass). */
static ncclResult_t wait_request(void* req, int* done) {
  *done = 0;
  ncclResult_t rc = ncclSuccess;
  for (double end = now_s() + 10; rc == ncclSuccess && !*done && now_s() < end;) rc = fl_test(req, done, NULL);
  return rc;
}

/* After test() said done: the caller reuses the buffer; what the peer still reads must be the original bytes. */
static void check_done_means_released(int peer, uint8_t* buf, size_t want) {
  memset(buf, 'Z', CHUNK);
  uint8_t* rest = malloc(want ? want : 1);
  size_t got = read_for(peer, rest, want, 5);
  size_t reused = 0;
  for (size_t k = 0; k < got; k++) reused += rest[k] == 'Z';
  free(rest);
  CHECK(got == want && reused == 0,
        "test() reported done, yet %zu of %zu unread payload bytes arrived afterwards, %zu of them from the reused buffer",
        got, want, reused);
}

static void honest(void) {
  g_case = "honest";
  struct pair pr;
  CHECK(open_pair(&pr) == 0, "no connection");
  uint8_t* buf = malloc(CHUNK);
  memset(buf, 'A', CHUNK);
  void* req = post_and_send(&pr, buf, CHUNK);
  struct fl_frame d;
  uint8_t* got = malloc(CHUNK);
  size_t n = 0;
  int ok = req && read_data_header(pr.peer, &d) == 0;
  for (double end = now_s() + 10; ok && n < d.length && now_s() < end;) { /* the plugin writes as the peer reads */
    int done;
    fl_test(req, &done, NULL);
    n += read_for(pr.peer, got + n, d.length - n, 0.01);
  }
  int intact = ok && n == CHUNK && memcmp(got, buf, CHUNK) == 0;
  free(got);
  int done = 0;
  ncclResult_t rc = intact && send_ack(pr.peer, d.aux) == 0 ? wait_request(req, &done) : ncclInternalError;
  close_pair(&pr);
  free(buf);
  CHECK(intact, "the peer read %zu of %u bytes, or they differ from the buffer", n, CHUNK);
  CHECK(rc == ncclSuccess && done, "an ACK after the whole chunk: test() returned %d, done=%d", rc, done);
  printf("PASS honest: %u bytes read, ACKed, send done\n", CHUNK);
}

static void early_ack(void) {
  g_case = "early_ack";
  struct pair pr;
  CHECK(open_pair(&pr) == 0, "no connection");
  uint8_t* buf = malloc(CHUNK);
  memset(buf, 'A', CHUNK);
  void* req = post_and_send(&pr, buf, CHUNK);
  struct fl_frame d;
  int ok = req && read_data_header(pr.peer, &d) == 0 && send_ack(pr.peer, d.aux) == 0;
  int done = 0;
  ncclResult_t rc = ok ? wait_request(req, &done) : ncclInternalError;
  if (ok && done) check_done_means_released(pr.peer, buf, d.length); /* legitimate only if the write had ended */
  close_pair(&pr);
  free(buf);
  if (g_fail) return;
  CHECK(ok, "no DATA header from the plugin");
  CHECK(rc == ncclRemoteError || done, "an ACK after the header only: test() returned %d, expected ncclRemoteError (%d)",
        rc, ncclRemoteError);
  printf("PASS early_ack: %s\n", done ? "the whole chunk had left before the ACK (huge socket buffers): done is safe"
                                      : "test() returned ncclRemoteError, the caller's buffer never reported free");
}

static void wrong_ack(void) {
  g_case = "wrong_ack";
  struct pair pr;
  CHECK(open_pair(&pr) == 0, "no connection");
  uint8_t* buf = calloc(1, 4096);
  void* req = post_and_send(&pr, buf, 4096);
  struct fl_frame d;
  int ok = req && read_data_header(pr.peer, &d) == 0 && send_ack(pr.peer, d.aux + 1) == 0;
  int done = 0;
  ncclResult_t rc = ok ? wait_request(req, &done) : ncclInternalError;
  close_pair(&pr);
  free(buf);
  CHECK(ok && rc == ncclRemoteError && !done, "an ACK for a chunk never sent: test() returned %d, done=%d", rc, done);
  printf("PASS wrong_ack: ncclRemoteError\n");
}

static void quiet(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  setenv(FL_ENV_SOCKET_IFNAME, "=lo", 1);
  setenv(FL_ENV_CHUNK_BYTES, "16777216", 1);
  if (fl_init(quiet) != ncclSuccess) return 2;
  honest();
  if (!g_fail) early_ack();
  if (!g_fail) wrong_ack();
  return g_fail;
}
