/*
 * fl_driver.c - loads libnccl-net-flowlane.so with dlopen and runs the call
 * sequences NCCL's proxy uses (listen, out-of-band handle exchange,
 * connect/accept polling, regMr, isend/irecv retried on NULL request, test
 * polling, close) through the v8 or v11 table. Sender and receiver run as
 * forked processes, optionally each inside a network namespace
 * (--send-ns/--recv-ns, entered with setns) so paths cross veth links.
 *
 *   fl_driver --plugin PATH [--api v8|v11] SCENARIO [options]
 * Scenarios: props integrity multirecv grouped closeload manycomms threads badsecret
 *            strangers peerdeath stall cudareject all | hostdeath (namespaces only) |
 *            bench-stream bench-pingpong bench-comms
 * Exit status 0 = every check passed; failures print "FAIL: ...".
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "flowlane_net.h"
#include "flowlane_net_abi.h"
#include "fl_wire.h"

/* ------------------------------------------------------------ options */

static struct {
  const char* plugin;
  int api; /* 8 or 11 */
  const char* send_ns;
  const char* recv_ns;
  const char* send_ifname;
  const char* recv_ifname;
  uint64_t max_bytes;
  uint64_t bytes;
  int iters;
  int window;
  int comms;
  int ping_class, bulk_class;
  int bulk;
  int timeout_s;
  int ping_size;
} O = {.api = 11, .max_bytes = 256ull << 20, .bytes = 64ull << 20, .iters = 16, .window = 4, .comms = 16,
       .ping_class = FL_CLASS_CRITICAL, .bulk_class = FL_CLASS_BULK, .timeout_s = 60, .ping_size = 1024};

static int g_warns_refused, g_warns_host_only, g_warns_total;
static const char* g_role = "driver";

static void logger(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (level == NCCL_LOG_WARN) {
    g_warns_total++;
    if (strstr(msg, "refused")) g_warns_refused++;
    if (strstr(msg, "host memory only")) g_warns_host_only++;
    fprintf(stderr, "[%s] WARN %s:%d %s\n", g_role, file, line, msg);
  } else if (getenv("FLOWLANE_NET_DEBUG")) {
    fprintf(stderr, "[%s] INFO %s\n", g_role, msg);
  }
}

#define FAILF(...)                                   \
  do {                                               \
    fprintf(stderr, "[%s] FAIL: ", g_role);          \
    fprintf(stderr, __VA_ARGS__);                    \
    fputc('\n', stderr);                             \
    exit(1);                                         \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------ the API-version facade */

struct net {
  const ncclNet_v8_t* v8;
  const ncclNet_v11_t* v11;
  void* ctx[FL_NUM_CLASSES + 1]; /* v11: one per-communicator context per class */
};
static struct net N;

static void net_load(void) {
  void* h = dlopen(O.plugin, RTLD_NOW | RTLD_LOCAL);
  if (!h) FAILF("dlopen %s: %s", O.plugin, dlerror());
  if (O.api == 8) {
    N.v8 = dlsym(h, "ncclNetPlugin_v8");
    if (!N.v8) FAILF("symbol ncclNetPlugin_v8 missing");
    if (N.v8->init(logger) != ncclSuccess) FAILF("v8 init failed");
  } else {
    N.v11 = dlsym(h, "ncclNetPlugin_v11");
    if (!N.v11) FAILF("symbol ncclNetPlugin_v11 missing");
    for (int c = 0; c <= FL_NUM_CLASSES; c++) {
      ncclNetCommConfig_v11_t cfg = {.trafficClass = c == FL_NUM_CLASSES ? NCCL_NET_TRAFFIC_CLASS_UNDEF : c};
      if (N.v11->init(&N.ctx[c], 1000 + (uint64_t)c, &cfg, logger, NULL) != ncclSuccess) FAILF("v11 init failed");
    }
  }
  int ndev = 0;
  if ((N.v8 ? N.v8->devices(&ndev) : N.v11->devices(&ndev)) != ncclSuccess || ndev < 1) FAILF("no devices");
}

static void net_finalize(void) {
  if (N.v11)
    for (int c = 0; c <= FL_NUM_CLASSES; c++) N.v11->finalize(N.ctx[c]);
}

/* tc < 0: NCCL gave no class (v8 always). */
static void* ctx_for(int tc) { return N.ctx[tc < 0 ? FL_NUM_CLASSES : tc]; }

static void net_listen(int tc, uint8_t* handle, void** lc) {
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  ncclResult_t rc = N.v8 ? N.v8->listen(0, handle, lc) : N.v11->listen(ctx_for(tc), 0, handle, lc);
  if (rc != ncclSuccess || !*lc) FAILF("listen failed (%d)", rc);
}

static ncclResult_t net_connect_once(int tc, uint8_t* handle, void** sc) {
  ncclNetDeviceHandle_v8_t* dev = NULL;
  return N.v8 ? N.v8->connect(0, handle, sc, &dev) : N.v11->connect(ctx_for(tc), 0, handle, sc, &dev);
}

static ncclResult_t net_accept_once(void* lc, void** rc) {
  ncclNetDeviceHandle_v8_t* dev = NULL;
  return N.v8 ? N.v8->accept(lc, rc, &dev) : N.v11->accept(lc, rc, &dev);
}

static void* net_regmr(void* comm, void* buf, size_t size) {
  void* mh = NULL;
  ncclResult_t rc = N.v8 ? N.v8->regMr(comm, buf, size, NCCL_PTR_HOST, &mh)
                         : N.v11->regMr(comm, buf, size, NCCL_PTR_HOST, &mh);
  if (rc != ncclSuccess) FAILF("regMr failed (%d)", rc);
  return mh;
}

static void net_deregmr(void* comm, void* mh) {
  if (N.v8) N.v8->deregMr(comm, mh);
  else N.v11->deregMr(comm, mh);
}

static ncclResult_t net_isend(void* sc, void* buf, size_t size, int tag, void* mh, void** req) {
  if (N.v8) return N.v8->isend(sc, buf, (int)size, tag, mh, req);
  return N.v11->isend(sc, buf, size, tag, mh, NULL, req);
}

static ncclResult_t net_irecv(void* rcomm, int n, void** bufs, size_t* sizes, int* tags, void** mhs, void** req) {
  if (N.v8) {
    int isz[FL_MAX_RECVS];
    for (int i = 0; i < n; i++) isz[i] = (int)sizes[i];
    return N.v8->irecv(rcomm, n, bufs, isz, tags, mhs, req);
  }
  void* ph[FL_MAX_RECVS] = {0};
  return N.v11->irecv(rcomm, n, bufs, sizes, tags, mhs, ph, req);
}

/* Yield when a request is not done, as NCCL's proxy thread does when idle:
 * on a 2-core box a pure spin starves ksoftirqd, which carries loopback and
 * veth traffic, and throughput collapses. */
static ncclResult_t net_test(void* req, int* done, int* sizes) {
  ncclResult_t rc = N.v8 ? N.v8->test(req, done, sizes) : N.v11->test(req, done, sizes);
  if (rc == ncclSuccess && !*done) sched_yield();
  return rc;
}

static void net_close_send(void* c) { N.v8 ? N.v8->closeSend(c) : N.v11->closeSend(c); }
static void net_close_recv(void* c) { N.v8 ? N.v8->closeRecv(c) : N.v11->closeRecv(c); }
static void net_close_listen(void* c) { N.v8 ? N.v8->closeListen(c) : N.v11->closeListen(c); }

/* Blocking helpers with a deadline, the way NCCL's proxy loops. */
static void* connect_blocking(int tc, uint8_t* handle) {
  void* sc = NULL;
  double end = now_s() + O.timeout_s;
  while (!sc) {
    if (net_connect_once(tc, handle, &sc) != ncclSuccess) FAILF("connect failed");
    if (now_s() > end) FAILF("connect timed out");
  }
  return sc;
}

static void* accept_blocking(void* lc) {
  void* rc = NULL;
  double end = now_s() + O.timeout_s;
  while (!rc) {
    if (net_accept_once(lc, &rc) != ncclSuccess) FAILF("accept failed");
    if (now_s() > end) FAILF("accept timed out");
  }
  return rc;
}

static void* isend_blocking(void* sc, void* buf, size_t size, int tag, void* mh) {
  void* req = NULL;
  double end = now_s() + O.timeout_s;
  while (!req) {
    ncclResult_t rc = net_isend(sc, buf, size, tag, mh, &req);
    if (rc != ncclSuccess) FAILF("isend(%zu B, tag %d) failed (%d)", size, tag, rc);
    if (now_s() > end) FAILF("isend could not start within %d s", O.timeout_s);
  }
  return req;
}

static void wait_req(void* req, int* sizes) {
  int done = 0;
  double end = now_s() + O.timeout_s;
  while (!done) {
    if (net_test(req, &done, sizes) != ncclSuccess) FAILF("test() returned an error");
    if (now_s() > end) FAILF("request did not complete within %d s", O.timeout_s);
  }
}

/* --------------------------------------------------- processes, netns */

static void enter_netns(const char* name) {
  if (!name || !*name) return;
  char path[256];
  snprintf(path, sizeof(path), "/var/run/netns/%s", name);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) FAILF("cannot enter network namespace %s: %s", name, strerror(errno));
  close(fd);
}

static void write_all(int fd, const void* buf, size_t len) {
  const uint8_t* p = buf;
  while (len) {
    ssize_t w = write(fd, p, len);
    if (w <= 0) FAILF("pipe write failed");
    p += w;
    len -= (size_t)w;
  }
}

static void read_all(int fd, void* buf, size_t len) {
  uint8_t* p = buf;
  while (len) {
    ssize_t r = read(fd, p, len);
    if (r <= 0) FAILF("pipe read failed (peer process exited?)");
    p += r;
    len -= (size_t)r;
  }
}

static int victim_is_sender(void) {
  const char* v = getenv("FL_DRIVER_VICTIM");
  return !v || strcmp(v, "recv") != 0;
}
static int fault_is_stop(void) {
  const char* v = getenv("FL_DRIVER_FAULT");
  return v && strcmp(v, "stop") == 0;
}

typedef void (*role_fn)(int to_peer, int from_peer);

/* Fork receiver and sender; each gets a pipe to the other (the out-of-band
 * channel NCCL's bootstrap provides). Returns the exit codes. */
static void run_pair(role_fn recv_role, role_fn send_role, int* recv_status, int* send_status, pid_t* send_pid_out) {
  int r2s[2], s2r[2];
  if (pipe(r2s) || pipe(s2r)) FAILF("pipe");
  fflush(NULL);
  pid_t rp = fork();
  if (rp == 0) {
    g_role = "recv";
    close(r2s[0]);
    close(s2r[1]);
    enter_netns(O.recv_ns);
    if (O.recv_ifname) setenv(FL_ENV_SOCKET_IFNAME, O.recv_ifname, 1);
    /* diagnostics: a different path selector on the receiving side (its sends: pongs, ACK-free) */
    if (getenv("FL_DRIVER_RECV_SELECTOR")) setenv(FL_ENV_PATH_SELECTOR, getenv("FL_DRIVER_RECV_SELECTOR"), 1);
    net_load();
    recv_role(r2s[1], s2r[0]);
    fflush(NULL);
    _exit(0);
  }
  pid_t sp = fork();
  if (sp == 0) {
    g_role = "send";
    close(r2s[1]);
    close(s2r[0]);
    enter_netns(O.send_ns);
    if (O.send_ifname) setenv(FL_ENV_SOCKET_IFNAME, O.send_ifname, 1);
    net_load();
    send_role(s2r[1], r2s[0]);
    fflush(NULL);
    _exit(0);
  }
  if (send_pid_out) *send_pid_out = sp;
  close(r2s[0]), close(r2s[1]), close(s2r[0]), close(s2r[1]);
  double end = now_s() + O.timeout_s + 30;
  int rs = -1, ss = -1, left = 2;
  while (left > 0) {
    int st;
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p == rp) rs = st, left--;
    else if (p == sp) ss = st, left--;
    else if (p == 0) {
      if (now_s() > end) {
        fprintf(stderr, "[driver] FAIL: scenario exceeded its time bound; killing both sides\n");
        kill(rp, SIGKILL);
        kill(sp, SIGKILL);
        end = now_s() + 1e9;
      }
      /* a stopped sender (stall scenario) is killed once the receiver finished */
      /* fault scenarios: once the survivor is done, reap a stopped victim */
      if (getenv("FL_DRIVER_FAULT") && victim_is_sender() && rs != -1 && ss == -1) kill(sp, SIGKILL);
      if (getenv("FL_DRIVER_FAULT") && !victim_is_sender() && ss != -1 && rs == -1) kill(rp, SIGKILL);
      usleep(2000);
    } else if (p < 0) {
      break;
    }
  }
  *recv_status = rs;
  *send_status = ss;
}

static int exited_ok(int st) { return WIFEXITED(st) && WEXITSTATUS(st) == 0; }

/* ---------------------------------------------------------- data pattern */

static uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

static void fill(uint8_t* buf, size_t len, uint64_t seed) {
  uint64_t s = mix(seed + 1);
  size_t i = 0;
  for (; i + 8 <= len; i += 8) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    memcpy(buf + i, &s, 8);
  }
  s = s * 6364136223846793005ull + 1442695040888963407ull;
  for (; i < len; i++) buf[i] = (uint8_t)(s >> (8 * (i & 7)));
}

static int verify(const uint8_t* buf, size_t len, uint64_t seed, uint8_t* scratch) {
  fill(scratch, len, seed);
  return memcmp(buf, scratch, len) == 0;
}

static uint8_t* big_alloc(size_t len) {
  void* p = mmap(NULL, len ? len : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) FAILF("mmap %zu bytes failed", len);
  return p;
}

/* ------------------------------------------------------------- scenarios */

static const uint64_t kLadder[] = {0, 1, 7, 4096, 65537, 1u << 20, (1u << 20) + 3, (16u << 20) + 5, 64u << 20,
                                   256u << 20};
#define NLADDER (sizeof(kLadder) / sizeof(kLadder[0]))
#define NSMALL 256

/* integrity: 256 small messages with 32 in flight, then 0 B..max_bytes. */
static void integrity_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  /* phase 1: many outstanding small receives */
  enum { INFL = NCCL_NET_MAX_REQUESTS };
  static uint8_t small[INFL][4096 + 64];
  uint8_t scratch[4096 + 64];
  void* mh[INFL];
  void* req[INFL] = {0};
  int msg_of[INFL];
  for (int i = 0; i < INFL; i++) mh[i] = net_regmr(rc, small[i], sizeof(small[i]));
  int posted = 0, completed = 0;
  double end = now_s() + O.timeout_s;
  while (completed < NSMALL) {
    for (int i = 0; i < INFL && posted < NSMALL; i++) {
      if (req[i]) continue;
      void* b = small[i];
      size_t sz = sizeof(small[i]);
      int tag = 0;
      if (net_irecv(rc, 1, &b, &sz, &tag, &mh[i], &req[i]) != ncclSuccess) FAILF("irecv failed");
      if (req[i]) msg_of[i] = posted++;
    }
    for (int i = 0; i < INFL; i++) {
      if (!req[i]) continue;
      int done = 0, size = -1;
      if (net_test(req[i], &done, &size) != ncclSuccess) FAILF("test failed (small phase)");
      if (!done) continue;
      size_t expect = (size_t)(mix((uint64_t)msg_of[i]) % 4097);
      if ((size_t)size != expect) FAILF("small message %d: got %d bytes, expected %zu", msg_of[i], size, expect);
      if (!verify(small[i], expect, 7000 + (uint64_t)msg_of[i], scratch)) FAILF("small message %d corrupted", msg_of[i]);
      req[i] = NULL;
      completed++;
    }
    if (now_s() > end) FAILF("small-message phase timed out at %d/%d", completed, NSMALL);
  }
  for (int i = 0; i < INFL; i++) net_deregmr(rc, mh[i]);
  /* phase 2: size ladder, receive buffers larger than the message */
  uint64_t maxb = 0;
  for (size_t k = 0; k < NLADDER; k++)
    if (kLadder[k] <= O.max_bytes && kLadder[k] > maxb) maxb = kLadder[k];
  uint8_t* buf = big_alloc(maxb + 64);
  uint8_t* scr = big_alloc(maxb + 64);
  void* bmh = net_regmr(rc, buf, maxb + 64);
  for (size_t k = 0; k < NLADDER; k++) {
    if (kLadder[k] > O.max_bytes) continue;
    void* b = buf;
    size_t sz = kLadder[k] + 64;
    int tag = 1, got = -1;
    void* r = NULL;
    while (!r)
      if (net_irecv(rc, 1, &b, &sz, &tag, &bmh, &r) != ncclSuccess) FAILF("irecv failed");
    double t0 = now_s();
    wait_req(r, &got);
    double dt = now_s() - t0;
    if ((uint64_t)got != kLadder[k]) FAILF("ladder: got %d bytes, expected %llu", got, (unsigned long long)kLadder[k]);
    if (!verify(buf, kLadder[k], 9000 + k, scr)) FAILF("ladder message of %llu bytes corrupted", (unsigned long long)kLadder[k]);
    printf("[recv] %llu bytes ok (%.1f MB/s)\n", (unsigned long long)kLadder[k], dt > 0 ? kLadder[k] / dt / 1e6 : 0);
  }
  net_deregmr(rc, bmh);
  net_close_recv(rc);
  net_close_listen(lc);
  net_finalize();
  (void)from;
}

static void integrity_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  void* sc = connect_blocking(-1, handle);
  enum { INFL = NCCL_NET_MAX_REQUESTS };
  static uint8_t small[INFL][4096];
  void* mh[INFL];
  void* req[INFL] = {0};
  for (int i = 0; i < INFL; i++) mh[i] = net_regmr(sc, small[i], sizeof(small[i]));
  int sent = 0, completed = 0;
  double end = now_s() + O.timeout_s;
  while (completed < NSMALL) {
    for (int i = 0; i < INFL && sent < NSMALL; i++) {
      if (req[i]) continue;
      size_t sz = (size_t)(mix((uint64_t)sent) % 4097);
      fill(small[i], sz, 7000 + (uint64_t)sent);
      if (net_isend(sc, small[i], sz, 0, mh[i], &req[i]) != ncclSuccess) FAILF("isend failed");
      if (req[i]) sent++;
      else break; /* would block: keep send order, retry later */
    }
    for (int i = 0; i < INFL; i++) {
      if (!req[i]) continue;
      int done = 0;
      if (net_test(req[i], &done, NULL) != ncclSuccess) FAILF("test failed (small phase)");
      if (done) req[i] = NULL, completed++;
    }
    if (now_s() > end) FAILF("small-message phase timed out at %d/%d", completed, NSMALL);
  }
  for (int i = 0; i < INFL; i++) net_deregmr(sc, mh[i]);
  uint64_t maxb = 0;
  for (size_t k = 0; k < NLADDER; k++)
    if (kLadder[k] <= O.max_bytes && kLadder[k] > maxb) maxb = kLadder[k];
  uint8_t* buf = big_alloc(maxb);
  void* bmh = net_regmr(sc, buf, maxb);
  for (size_t k = 0; k < NLADDER; k++) {
    if (kLadder[k] > O.max_bytes) continue;
    fill(buf, kLadder[k], 9000 + k);
    if (k == 3) { /* the receiver posted 4096 + 64 bytes: one byte more is the caller's error, and the comm lives on */
      void* over = NULL;
      ncclResult_t orc = ncclSuccess;
      double until = now_s() + O.timeout_s;
      while (orc == ncclSuccess && !over && now_s() < until) orc = net_isend(sc, buf, kLadder[k] + 65, 1, bmh, &over);
      if (orc != ncclInvalidUsage || over)
        FAILF("isend beyond the posted receive returned %d (request %p), expected ncclInvalidUsage (%d)", orc, over,
              ncclInvalidUsage);
    }
    void* r = isend_blocking(sc, buf, kLadder[k], 1, bmh);
    int got = -1;
    wait_req(r, &got);
    if ((uint64_t)got != kLadder[k]) FAILF("send size reported %d", got);
  }
  net_deregmr(sc, bmh);
  net_close_send(sc);
  net_finalize();
  (void)to;
}

/* multirecv: groups of n=8 tagged receives; sends arrive in a shuffled tag order. */
#define MR_GROUPS 24
static const size_t kMrSizes[FL_MAX_RECVS] = {0, 1, 100, 4096, 65536, 1u << 20, 3, 777};

static void multirecv_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  static uint8_t bufs[FL_MAX_RECVS][(1u << 20) + 16];
  static uint8_t scratch[(1u << 20) + 16];
  void* mh[FL_MAX_RECVS];
  void* ptrs[FL_MAX_RECVS];
  for (int i = 0; i < FL_MAX_RECVS; i++) ptrs[i] = bufs[i], mh[i] = net_regmr(rc, bufs[i], sizeof(bufs[i]));
  for (int g = 0; g < MR_GROUPS; g++) {
    size_t sizes[FL_MAX_RECVS];
    int tags[FL_MAX_RECVS], got[FL_MAX_RECVS];
    for (int i = 0; i < FL_MAX_RECVS; i++) sizes[i] = sizeof(bufs[i]), tags[i] = 100 + i;
    void* r = NULL;
    while (!r)
      if (net_irecv(rc, FL_MAX_RECVS, ptrs, sizes, tags, mh, &r) != ncclSuccess) FAILF("irecv(n=8) failed");
    wait_req(r, got);
    for (int i = 0; i < FL_MAX_RECVS; i++) {
      size_t expect = kMrSizes[(i + g) % FL_MAX_RECVS];
      if ((size_t)got[i] != expect) FAILF("group %d tag %d: %d bytes, expected %zu", g, tags[i], got[i], expect);
      if (!verify(bufs[i], expect, (uint64_t)g * 100 + (uint64_t)tags[i], scratch))
        FAILF("group %d tag %d: data landed in the wrong buffer or is corrupted", g, tags[i]);
    }
  }
  printf("[recv] %d multi-receive groups of %d ok\n", MR_GROUPS, FL_MAX_RECVS);
  net_close_recv(rc);
  net_close_listen(lc);
  net_finalize();
  (void)from;
}

static void multirecv_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  void* sc = connect_blocking(-1, handle);
  static uint8_t bufs[FL_MAX_RECVS][1u << 20];
  void* mh[FL_MAX_RECVS];
  for (int i = 0; i < FL_MAX_RECVS; i++) mh[i] = net_regmr(sc, bufs[i], sizeof(bufs[i]));
  for (int g = 0; g < MR_GROUPS; g++) {
    void* req[FL_MAX_RECVS];
    for (int k = 0; k < FL_MAX_RECVS; k++) {
      int i = (int)((k * 5 + g) % FL_MAX_RECVS); /* shuffled tag order */
      size_t sz = kMrSizes[(i + g) % FL_MAX_RECVS];
      fill(bufs[i], sz, (uint64_t)g * 100 + 100 + (uint64_t)i);
      req[k] = isend_blocking(sc, bufs[i], sz, 100 + i, mh[i]);
    }
    for (int k = 0; k < FL_MAX_RECVS; k++) wait_req(req[k], NULL);
  }
  net_close_send(sc);
  net_finalize();
  (void)to;
}

/* grouped: NCCL's grouped receives. Two 4-way receives are posted at once (tags 10..13 and 20..23); the
 * sender issues its 8 sends in a shuffled order across both groups and retries every send that returns a NULL
 * request, as NCCL's proxy does: a tag of the newer group is not matchable until the older group is. */
#define GR_ROUNDS 16
#define GR_N 4
#define GR_MAX 65536
static size_t gr_size(int round, int g, int i) { return (size_t)(mix((uint64_t)(round * 8 + g * GR_N + i)) % (GR_MAX + 1)); }
static int gr_tag(int g, int i) { return 10 * (g + 1) + i; }

static void grouped_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  static uint8_t bufs[2][GR_N][GR_MAX + 16];
  static uint8_t scratch[GR_MAX + 16];
  void* mh[2][GR_N];
  for (int g = 0; g < 2; g++)
    for (int i = 0; i < GR_N; i++) mh[g][i] = net_regmr(rc, bufs[g][i], sizeof(bufs[g][i]));
  for (int round = 0; round < GR_ROUNDS; round++) {
    void* req[2] = {NULL, NULL};
    for (int g = 0; g < 2; g++) {
      void* ptrs[GR_N];
      size_t sizes[GR_N];
      int tags[GR_N];
      for (int i = 0; i < GR_N; i++) ptrs[i] = bufs[g][i], sizes[i] = sizeof(bufs[g][i]), tags[i] = gr_tag(g, i);
      double end = now_s() + O.timeout_s;
      while (!req[g]) {
        if (net_irecv(rc, GR_N, ptrs, sizes, tags, mh[g], &req[g]) != ncclSuccess) FAILF("irecv(n=%d) failed", GR_N);
        if (now_s() > end) FAILF("irecv could not be posted");
      }
    }
    for (int g = 0; g < 2; g++) {
      int got[GR_N];
      wait_req(req[g], got);
      for (int i = 0; i < GR_N; i++) {
        size_t expect = gr_size(round, g, i);
        if ((size_t)got[i] != expect) FAILF("round %d tag %d: %d bytes, expected %zu", round, gr_tag(g, i), got[i], expect);
        if (!verify(bufs[g][i], expect, (uint64_t)(round * 100 + gr_tag(g, i)), scratch))
          FAILF("round %d tag %d: data landed in the wrong buffer or is corrupted", round, gr_tag(g, i));
      }
    }
  }
  printf("[recv] %d rounds of two grouped receives (out-of-order sends) ok\n", GR_ROUNDS);
  net_close_recv(rc);
  net_close_listen(lc);
  net_finalize();
  (void)from;
}

static void grouped_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  void* sc = connect_blocking(-1, handle);
  static uint8_t bufs[2 * GR_N][GR_MAX];
  void* mh[2 * GR_N];
  for (int k = 0; k < 2 * GR_N; k++) mh[k] = net_regmr(sc, bufs[k], sizeof(bufs[k]));
  int nulls = 0;
  for (int round = 0; round < GR_ROUNDS; round++) {
    void* req[2 * GR_N] = {0};
    int order[2 * GR_N];
    for (int k = 0; k < 2 * GR_N; k++) order[k] = (k * 5 + round + 4) % (2 * GR_N); /* newer group's tags first */
    for (int k = 0; k < 2 * GR_N; k++) {
      int g = k / GR_N, i = k % GR_N;
      fill(bufs[k], gr_size(round, g, i), (uint64_t)(round * 100 + gr_tag(g, i)));
    }
    int started = 0, finished = 0;
    int fin[2 * GR_N] = {0};
    double end = now_s() + O.timeout_s;
    while (finished < 2 * GR_N) {
      for (int j = 0; j < 2 * GR_N; j++) {
        int k = order[j], g = k / GR_N, i = k % GR_N;
        if (!req[k]) {
          ncclResult_t rc = net_isend(sc, bufs[k], gr_size(round, g, i), gr_tag(g, i), mh[k], &req[k]);
          if (rc != ncclSuccess) FAILF("isend(tag %d) returned %d; a tag not matchable yet must give a NULL request", gr_tag(g, i), rc);
          if (req[k]) started++;
          else nulls++;
        } else if (!fin[k]) {
          int done = 0;
          if (net_test(req[k], &done, NULL) != ncclSuccess) FAILF("test failed");
          if (done) fin[k] = 1, finished++;
        }
      }
      if (now_s() > end) FAILF("round %d: %d/%d sends started, %d finished", round, started, 2 * GR_N, finished);
    }
  }
  printf("[send] %d grouped rounds ok, %d isend calls returned a NULL request and were retried\n", GR_ROUNDS, nulls);
  net_close_send(sc);
  net_finalize();
  (void)to;
}

/* closeload: closeSend under load and with a silent peer.
 * Phase 1: CL_COMMS comms stream CL_MSGS messages each (CL_WINDOW in flight); the sender closes each comm as
 * soon as its last send is done, while the others still stream, and exits right after the last close: every
 * message must arrive intact. Phase 2: on CL_COMMS more comms the receiver posts a receive and then stops
 * calling the plugin; the sender sends, closes them all and only then lets the receiver go on: closing must not
 * wait for a peer that does not answer, and the receiver still gets the messages. */
#define CL_COMMS 4
#define CL_MSGS 8
#define CL_WINDOW 4
#define CL_BYTES (1u << 20)
#define CL_SMALL 8192
static size_t cl_size(int k, int m) { return CL_BYTES - (size_t)(mix((uint64_t)(k * 100 + m)) % 4096); }

static void closeload_recv(int to, int from) {
  void* lcs[2 * CL_COMMS];
  void* rcs[2 * CL_COMMS] = {0};
  for (int k = 0; k < 2 * CL_COMMS; k++) {
    uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
    net_listen(k % FL_NUM_CLASSES, handle, &lcs[k]);
    write_all(to, handle, sizeof(handle));
  }
  for (int k = 0; k < 2 * CL_COMMS; k++) rcs[k] = accept_blocking(lcs[k]);
  static uint8_t bufs[CL_COMMS][CL_WINDOW][CL_BYTES];
  static uint8_t scratch[CL_BYTES];
  void* mh[CL_COMMS][CL_WINDOW];
  void* req[CL_COMMS][CL_WINDOW] = {{0}};
  int msg_of[CL_COMMS][CL_WINDOW];
  int posted[CL_COMMS] = {0}, done_n[CL_COMMS] = {0}, total = 0;
  for (int k = 0; k < CL_COMMS; k++)
    for (int w = 0; w < CL_WINDOW; w++) mh[k][w] = net_regmr(rcs[k], bufs[k][w], CL_BYTES);
  double end = now_s() + O.timeout_s;
  while (total < CL_COMMS * CL_MSGS) {
    for (int k = 0; k < CL_COMMS; k++)
      for (int w = 0; w < CL_WINDOW; w++) {
        if (!req[k][w] && posted[k] < CL_MSGS) {
          void* b = bufs[k][w];
          size_t sz = CL_BYTES;
          int tag = 7;
          if (net_irecv(rcs[k], 1, &b, &sz, &tag, &mh[k][w], &req[k][w]) != ncclSuccess) FAILF("irecv failed");
          if (req[k][w]) msg_of[k][w] = posted[k]++;
        } else if (req[k][w]) {
          int done = 0, got = -1;
          if (net_test(req[k][w], &done, &got) != ncclSuccess) FAILF("comm %d: test() failed while its sender closed", k);
          if (!done) continue;
          int m = msg_of[k][w];
          if ((size_t)got != cl_size(k, m) || !verify(bufs[k][w], cl_size(k, m), (uint64_t)(k * 100 + m), scratch))
            FAILF("comm %d message %d: wrong size (%d) or data", k, m, got);
          req[k][w] = NULL;
          done_n[k]++, total++;
        }
      }
    if (now_s() > end) FAILF("phase 1 timed out at %d/%d messages", total, CL_COMMS * CL_MSGS);
  }
  printf("[recv] phase 1: %d comms x %d messages intact while their senders closed\n", CL_COMMS, CL_MSGS);
  /* phase 2: post, then fall silent until the sender has closed everything */
  static uint8_t small[CL_COMMS][CL_SMALL];
  void* smh[CL_COMMS];
  void* sreq[CL_COMMS] = {0};
  for (int k = 0; k < CL_COMMS; k++) {
    void* rcomm = rcs[CL_COMMS + k];
    smh[k] = net_regmr(rcomm, small[k], CL_SMALL);
    void* b = small[k];
    size_t sz = CL_SMALL;
    int tag = 9;
    while (!sreq[k])
      if (net_irecv(rcomm, 1, &b, &sz, &tag, &smh[k], &sreq[k]) != ncclSuccess) FAILF("phase 2 irecv failed");
  }
  write_all(to, "p", 1); /* receives posted */
  char c;
  read_all(from, &c, 1); /* the sender closed all its comms */
  for (int k = 0; k < CL_COMMS; k++) {
    int got = -1;
    wait_req(sreq[k], &got);
    if (got != CL_SMALL || !verify(small[k], CL_SMALL, 5000 + (uint64_t)k, scratch))
      FAILF("phase 2 comm %d: message lost or corrupted after its sender closed", k);
  }
  printf("[recv] phase 2: messages of %d comms closed while this side was silent arrived intact\n", CL_COMMS);
  write_all(to, "d", 1);
  for (int k = 0; k < 2 * CL_COMMS; k++) net_close_recv(rcs[k]), net_close_listen(lcs[k]);
  net_finalize();
}

static void closeload_send(int to, int from) {
  uint8_t handles[2 * CL_COMMS][NCCL_NET_HANDLE_MAXSIZE];
  void* scs[2 * CL_COMMS];
  for (int k = 0; k < 2 * CL_COMMS; k++) read_all(from, handles[k], NCCL_NET_HANDLE_MAXSIZE);
  for (int k = 0; k < 2 * CL_COMMS; k++) scs[k] = connect_blocking(k % FL_NUM_CLASSES, handles[k]);
  static uint8_t bufs[CL_COMMS][CL_WINDOW][CL_BYTES];
  void* mh[CL_COMMS][CL_WINDOW];
  void* req[CL_COMMS][CL_WINDOW] = {{0}};
  int sent[CL_COMMS] = {0}, done_n[CL_COMMS] = {0}, closed = 0;
  for (int k = 0; k < CL_COMMS; k++)
    for (int w = 0; w < CL_WINDOW; w++) mh[k][w] = net_regmr(scs[k], bufs[k][w], CL_BYTES);
  double end = now_s() + O.timeout_s, close_s = 0;
  while (closed < CL_COMMS) {
    for (int k = 0; k < CL_COMMS; k++) {
      if (!scs[k]) continue;
      for (int w = 0; w < CL_WINDOW; w++) {
        if (!req[k][w] && sent[k] < CL_MSGS) {
          fill(bufs[k][w], cl_size(k, sent[k]), (uint64_t)(k * 100 + sent[k]));
          if (net_isend(scs[k], bufs[k][w], cl_size(k, sent[k]), 7, mh[k][w], &req[k][w]) != ncclSuccess) FAILF("isend failed");
          if (req[k][w]) sent[k]++;
        } else if (req[k][w]) {
          int done = 0;
          if (net_test(req[k][w], &done, NULL) != ncclSuccess) FAILF("test failed");
          if (done) req[k][w] = NULL, done_n[k]++;
        }
      }
      if (done_n[k] == CL_MSGS) { /* close at once, the other comms are still streaming */
        double t0 = now_s();
        net_close_send(scs[k]);
        close_s += now_s() - t0;
        scs[k] = NULL;
        closed++;
      }
    }
    if (now_s() > end) FAILF("phase 1 timed out");
  }
  /* phase 2 */
  char c;
  read_all(from, &c, 1);
  static uint8_t small[CL_COMMS][CL_SMALL];
  for (int k = 0; k < CL_COMMS; k++) {
    void* sc = scs[CL_COMMS + k];
    fill(small[k], CL_SMALL, 5000 + (uint64_t)k);
    void* mhs = net_regmr(sc, small[k], CL_SMALL);
    void* r = isend_blocking(sc, small[k], CL_SMALL, 9, mhs);
    int done = 0;
    for (int i = 0; i < 100 && !done; i++) /* the receiver is silent: its ACK cannot come */
      if (net_test(r, &done, NULL) != ncclSuccess) FAILF("phase 2 test failed");
  }
  double t0 = now_s();
  for (int k = 0; k < CL_COMMS; k++) net_close_send(scs[CL_COMMS + k]);
  double silent_s = now_s() - t0;
  write_all(to, "c", 1);
  printf("[send] closeSend: %d comms under load in %.3f s, %d comms with a silent peer in %.3f s\n", CL_COMMS, close_s,
         CL_COMMS, silent_s);
  /* A close must not wait for the peer (before: up to 5 s per comm). 2 s for all four is far above a
   * close's cost and far below one peer wait. */
  if (silent_s > 2.0) FAILF("closing %d comms with a silent peer took %.1f s: closeSend waits for the peer", CL_COMMS, silent_s);
  read_all(from, &c, 1); /* stay alive until the receiver has everything (the kernel delivers the rest) */
  net_finalize();
}

/* manycomms: O.comms connections at once, progressed round-robin. */
#define MC_MSGS 24
static void manycomms_recv(int to, int from) {
  int K = O.comms;
  void** lcs = calloc((size_t)K, sizeof(void*));
  void** rcs = calloc((size_t)K, sizeof(void*));
  for (int k = 0; k < K; k++) {
    uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
    net_listen(k % FL_NUM_CLASSES, handle, &lcs[k]);
    write_all(to, handle, sizeof(handle));
  }
  int accepted = 0;
  double end = now_s() + O.timeout_s;
  while (accepted < K) { /* accept all in parallel, like NCCL's proxy */
    for (int k = 0; k < K; k++)
      if (!rcs[k]) {
        if (net_accept_once(lcs[k], &rcs[k]) != ncclSuccess) FAILF("accept failed");
        if (rcs[k]) accepted++;
      }
    if (now_s() > end) FAILF("accepted only %d/%d comms", accepted, K);
  }
  uint8_t** bufs = calloc((size_t)K, sizeof(uint8_t*));
  void** reqs = calloc((size_t)K, sizeof(void*));
  void** mhs = calloc((size_t)K, sizeof(void*));
  int* count = calloc((size_t)K, sizeof(int));
  uint8_t* scratch = malloc(1u << 20);
  for (int k = 0; k < K; k++) bufs[k] = malloc(1u << 20), mhs[k] = net_regmr(rcs[k], bufs[k], 1u << 20);
  int finished = 0;
  while (finished < K) {
    for (int k = 0; k < K; k++) {
      if (count[k] == MC_MSGS) continue;
      if (!reqs[k]) {
        void* b = bufs[k];
        size_t sz = 1u << 20;
        int tag = k;
        if (net_irecv(rcs[k], 1, &b, &sz, &tag, &mhs[k], &reqs[k]) != ncclSuccess) FAILF("irecv failed");
        continue;
      }
      int done = 0, got = -1;
      if (net_test(reqs[k], &done, &got) != ncclSuccess) FAILF("test failed on comm %d", k);
      if (!done) continue;
      size_t expect = (size_t)(mix((uint64_t)(k * 1000 + count[k])) % (1u << 20));
      if ((size_t)got != expect || !verify(bufs[k], expect, (uint64_t)(k * 1000 + count[k]), scratch))
        FAILF("comm %d message %d: wrong size (%d) or data", k, count[k], got);
      reqs[k] = NULL;
      if (++count[k] == MC_MSGS) finished++;
    }
    if (now_s() > end) FAILF("many-comms traffic timed out (%d/%d comms finished)", finished, K);
  }
  printf("[recv] %d concurrent comms x %d messages ok\n", K, MC_MSGS);
  for (int k = 0; k < K; k++) net_close_recv(rcs[k]), net_close_listen(lcs[k]);
  net_finalize();
  (void)from;
}

static void manycomms_send(int to, int from) {
  int K = O.comms;
  uint8_t(*handles)[NCCL_NET_HANDLE_MAXSIZE] = calloc((size_t)K, NCCL_NET_HANDLE_MAXSIZE);
  void** scs = calloc((size_t)K, sizeof(void*));
  for (int k = 0; k < K; k++) read_all(from, handles[k], NCCL_NET_HANDLE_MAXSIZE);
  int connected = 0;
  double end = now_s() + O.timeout_s;
  while (connected < K) {
    for (int k = 0; k < K; k++)
      if (!scs[k]) {
        if (net_connect_once(k % FL_NUM_CLASSES, handles[k], &scs[k]) != ncclSuccess) FAILF("connect failed");
        if (scs[k]) connected++;
      }
    if (now_s() > end) FAILF("connected only %d/%d comms", connected, K);
  }
  uint8_t** bufs = calloc((size_t)K, sizeof(uint8_t*));
  void** reqs = calloc((size_t)K, sizeof(void*));
  void** mhs = calloc((size_t)K, sizeof(void*));
  int* count = calloc((size_t)K, sizeof(int));
  for (int k = 0; k < K; k++) bufs[k] = malloc(1u << 20), mhs[k] = net_regmr(scs[k], bufs[k], 1u << 20);
  int finished = 0;
  while (finished < K) {
    for (int k = 0; k < K; k++) {
      if (count[k] == MC_MSGS) continue;
      size_t sz = (size_t)(mix((uint64_t)(k * 1000 + count[k])) % (1u << 20));
      if (!reqs[k]) {
        fill(bufs[k], sz, (uint64_t)(k * 1000 + count[k]));
        if (net_isend(scs[k], bufs[k], sz, k, mhs[k], &reqs[k]) != ncclSuccess) FAILF("isend failed");
        continue;
      }
      int done = 0;
      if (net_test(reqs[k], &done, NULL) != ncclSuccess) FAILF("test failed on comm %d", k);
      if (!done) continue;
      reqs[k] = NULL;
      if (++count[k] == MC_MSGS) finished++;
    }
    if (now_s() > end) FAILF("many-comms traffic timed out");
  }
  for (int k = 0; k < K; k++) net_close_send(scs[k]);
  net_finalize();
  (void)to;
}

/* threads: one thread per comm on both sides (classes 0..3, as with several
 * NCCL proxy threads in one process), TH_MSGS verified messages each, two in
 * flight. Per-comm locks let them progress in parallel; lower lanes held back
 * by higher ones are helped across threads (trylock) and must not deadlock. */
#define TH_COMMS FL_NUM_CLASSES
#define TH_MSGS 40
#define TH_MAX (1u << 20)
static size_t th_size(int k, int m) { return (size_t)(mix((uint64_t)(k * 7919 + m)) % (TH_MAX + 1)); }
struct th_arg {
  int k;
  void* lc;
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
};

static void* th_recv_main(void* p) {
  struct th_arg* a = p;
  void* rc = accept_blocking(a->lc);
  uint8_t* bufs[2] = {malloc(TH_MAX), malloc(TH_MAX)};
  uint8_t* scratch = malloc(TH_MAX);
  void* mhs[2] = {net_regmr(rc, bufs[0], TH_MAX), net_regmr(rc, bufs[1], TH_MAX)};
  void* reqs[2] = {NULL, NULL};
  int msg_of[2] = {0, 0};
  int posted = 0, done_n = 0;
  double end = now_s() + O.timeout_s;
  while (done_n < TH_MSGS) {
    for (int i = 0; i < 2; i++) {
      if (!reqs[i] && posted < TH_MSGS) {
        void* b = bufs[i];
        size_t sz = TH_MAX;
        int tag = a->k;
        if (net_irecv(rc, 1, &b, &sz, &tag, &mhs[i], &reqs[i]) != ncclSuccess) FAILF("comm %d: irecv failed", a->k);
        if (reqs[i]) msg_of[i] = posted++;
        continue;
      }
      if (!reqs[i]) continue;
      int done = 0, got = -1;
      if (net_test(reqs[i], &done, &got) != ncclSuccess) FAILF("comm %d: test failed", a->k);
      if (!done) continue;
      size_t want = th_size(a->k, msg_of[i]);
      if ((size_t)got != want || !verify(bufs[i], want, (uint64_t)(a->k * 100000 + msg_of[i]), scratch))
        FAILF("comm %d message %d: wrong size (%d, expected %zu) or data", a->k, msg_of[i], got, want);
      reqs[i] = NULL;
      done_n++;
    }
    if (now_s() > end) FAILF("comm %d: threads scenario timed out (%d/%d)", a->k, done_n, TH_MSGS);
  }
  for (int i = 0; i < 2; i++) net_deregmr(rc, mhs[i]), free(bufs[i]);
  free(scratch);
  net_close_recv(rc);
  return NULL;
}

static void* th_send_main(void* p) {
  struct th_arg* a = p;
  void* sc = connect_blocking(a->k, a->handle);
  uint8_t* bufs[2] = {malloc(TH_MAX), malloc(TH_MAX)};
  void* mhs[2] = {net_regmr(sc, bufs[0], TH_MAX), net_regmr(sc, bufs[1], TH_MAX)};
  void* reqs[2] = {NULL, NULL};
  int sent = 0, done_n = 0;
  double end = now_s() + O.timeout_s;
  while (done_n < TH_MSGS) {
    for (int i = 0; i < 2; i++) {
      if (!reqs[i] && sent < TH_MSGS) {
        size_t sz = th_size(a->k, sent);
        fill(bufs[i], sz, (uint64_t)(a->k * 100000 + sent));
        if (net_isend(sc, bufs[i], sz, a->k, mhs[i], &reqs[i]) != ncclSuccess) FAILF("comm %d: isend failed", a->k);
        if (reqs[i]) sent++;
        continue;
      }
      if (!reqs[i]) continue;
      int done = 0;
      if (net_test(reqs[i], &done, NULL) != ncclSuccess) FAILF("comm %d: test failed", a->k);
      if (done) reqs[i] = NULL, done_n++;
    }
    if (now_s() > end) FAILF("comm %d: threads scenario send timed out (%d/%d)", a->k, done_n, TH_MSGS);
  }
  for (int i = 0; i < 2; i++) net_deregmr(sc, mhs[i]), free(bufs[i]);
  net_close_send(sc);
  return NULL;
}

static void threads_recv(int to, int from) {
  struct th_arg args[TH_COMMS];
  pthread_t th[TH_COMMS];
  for (int k = 0; k < TH_COMMS; k++) {
    args[k].k = k;
    net_listen(k, args[k].handle, &args[k].lc);
    write_all(to, args[k].handle, sizeof(args[k].handle));
  }
  for (int k = 0; k < TH_COMMS; k++) pthread_create(&th[k], NULL, th_recv_main, &args[k]);
  for (int k = 0; k < TH_COMMS; k++) pthread_join(th[k], NULL);
  for (int k = 0; k < TH_COMMS; k++) net_close_listen(args[k].lc);
  printf("[recv] %d threads x %d messages intact, one comm per thread\n", TH_COMMS, TH_MSGS);
  net_finalize();
  (void)from;
}

static void threads_send(int to, int from) {
  struct th_arg args[TH_COMMS];
  pthread_t th[TH_COMMS];
  for (int k = 0; k < TH_COMMS; k++) {
    args[k].k = k;
    read_all(from, args[k].handle, sizeof(args[k].handle));
  }
  for (int k = 0; k < TH_COMMS; k++) pthread_create(&th[k], NULL, th_send_main, &args[k]);
  for (int k = 0; k < TH_COMMS; k++) pthread_join(th[k], NULL);
  net_finalize();
  (void)to;
}

/* peerdeath / stall: one side disappears or freezes mid-message; the other
 * side's test() must return an error (never hang). Which side fails is
 * chosen by FL_DRIVER_VICTIM=send|recv; mode by FL_DRIVER_FAULT=kill|stop. */
static void survivor_wait_error(void* req, const char* what) {
  int done = 0;
  double t0 = now_s();
  while (!done) {
    ncclResult_t rc = net_test(req, &done, NULL);
    if (rc == ncclRemoteError) {
      printf("[%s] test() reported error %d after %.2f s (%s) - ok\n", g_role, rc, now_s() - t0, what);
      return;
    }
    if (rc != ncclSuccess) FAILF("%s: test() returned %d, expected ncclRemoteError (%d)", what, rc, ncclRemoteError);
    if (now_s() - t0 > O.timeout_s) FAILF("%s: test() neither failed nor completed within %d s", what, O.timeout_s);
  }
  FAILF("%s: request completed although the peer failed mid-message", what);
}

#define FAULT_BYTES (256u << 20)
#define FAULT_WINDOW_S 0.02 /* progress before the fault: a few MiB move, far from all 256 MiB */
static void fault_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  uint8_t* buf = big_alloc(FAULT_BYTES);
  void* mh = net_regmr(rc, buf, FAULT_BYTES);
  void* b = buf;
  size_t sz = FAULT_BYTES;
  int tag = 0;
  void* r = NULL;
  while (!r)
    if (net_irecv(rc, 1, &b, &sz, &tag, &mh, &r) != ncclSuccess) FAILF("irecv failed");
  if (!victim_is_sender()) {
    /* receive a little, then die or freeze. The window must stay far below the time 256 MiB takes on loopback
     * (~0.2 s at 1.4 GB/s), or the message can complete before the fault and the scenario proves nothing. */
    double t0 = now_s();
    int done = 0;
    while (now_s() - t0 < FAULT_WINDOW_S && !done) net_test(r, &done, NULL);
    if (done) FAILF("256 MiB receive finished before the fault could be injected");
    if (fault_is_stop()) raise(SIGSTOP);
    else raise(SIGKILL);
  }
  survivor_wait_error(r, fault_is_stop() ? "sender stalled" : "sender died");
  (void)from;
  fflush(NULL);
  _exit(0);
}

static void fault_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  void* sc = connect_blocking(-1, handle);
  uint8_t* buf = big_alloc(FAULT_BYTES);
  void* mh = net_regmr(sc, buf, FAULT_BYTES);
  void* r = isend_blocking(sc, buf, FAULT_BYTES, 0, mh);
  if (victim_is_sender()) {
    double t0 = now_s();
    int done = 0;
    while (now_s() - t0 < FAULT_WINDOW_S && !done) net_test(r, &done, NULL);
    if (done) FAILF("256 MiB send finished before the fault could be injected");
    if (fault_is_stop()) raise(SIGSTOP);
    else raise(SIGKILL);
  }
  survivor_wait_error(r, fault_is_stop() ? "receiver stalled" : "receiver died");
  (void)to;
  fflush(NULL);
  _exit(0);
}

/* hostdeath (namespaces only): the victim's host vanishes while the comm is idle - a receive posted that the sender
 * has not started, or a send whose receiver has posted nothing - with no FIN or RST: the victim takes its namespace's
 * links down and freezes. No data is unacknowledged, so only keepalive can notice; the survivor's test() (or isend,
 * which NCCL keeps retrying while no CTS came) must fail with ncclRemoteError, not wait forever. */
static void blackhole_own_namespace(void) {
  struct if_nameindex* ifs = if_nameindex();
  int s = socket(AF_INET, SOCK_DGRAM, 0);
  if (!ifs || s < 0) FAILF("cannot list this namespace's links: %s", strerror(errno));
  for (struct if_nameindex* i = ifs; i->if_index; i++) {
    if (!strcmp(i->if_name, "lo")) continue;
    struct ifreq ifr;
    memset(&ifr, 0, sizeof(ifr));
    snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", i->if_name);
    if (ioctl(s, SIOCGIFFLAGS, &ifr) != 0) FAILF("SIOCGIFFLAGS %s: %s", i->if_name, strerror(errno));
    ifr.ifr_flags &= ~IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) != 0) FAILF("cannot take %s down: %s", i->if_name, strerror(errno));
  }
  close(s);
  if_freenameindex(ifs);
}

static void vanish_when_told(int from) {
  uint8_t go;
  read_all(from, &go, 1);
  blackhole_own_namespace();
  printf("[%s] links down, frozen\n", g_role);
  fflush(NULL);
  raise(SIGSTOP);
}

static void hostdeath_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  if (!victim_is_sender()) vanish_when_told(from); /* posts nothing: the sender's isend never gets a CTS */
  uint8_t buf[64];
  void* mh = net_regmr(rc, buf, sizeof(buf));
  void* b = buf;
  size_t sz = sizeof(buf);
  int tag = 0;
  void* r = NULL;
  while (!r)
    if (net_irecv(rc, 1, &b, &sz, &tag, &mh, &r) != ncclSuccess) FAILF("irecv failed");
  write_all(to, "", 1); /* the sender never sends: the posted receive idles until its host is gone */
  survivor_wait_error(r, "sender's host vanished while idle");
  fflush(NULL);
  _exit(0);
}

static void hostdeath_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  void* sc = connect_blocking(-1, handle);
  if (victim_is_sender()) vanish_when_told(from);
  write_all(to, "", 1);
  uint8_t buf[64] = {0};
  void* mh = net_regmr(sc, buf, sizeof(buf));
  double t0 = now_s();
  for (;;) { /* as NCCL's proxy: retry isend on a NULL request */
    void* r = NULL;
    ncclResult_t rc = net_isend(sc, buf, sizeof(buf), 0, mh, &r);
    if (rc == ncclRemoteError) {
      printf("[%s] isend() reported error %d after %.2f s (receiver's host vanished while idle) - ok\n", g_role, rc,
             now_s() - t0);
      break;
    }
    if (rc != ncclSuccess) FAILF("isend returned %d, expected ncclRemoteError (%d)", rc, ncclRemoteError);
    if (r) FAILF("isend started although the receiver posted nothing");
    if (now_s() - t0 > O.timeout_s) FAILF("isend neither failed nor started within %d s", O.timeout_s);
  }
  fflush(NULL);
  _exit(0);
}

/* badsecret: a connection presenting a wrong secret is refused and logged;
 * the genuine one is still accepted. */
static void badsecret_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  if (g_warns_refused < 1) FAILF("the wrong-secret connection was not refused with a log line");
  uint8_t buf[64];
  void* mh = net_regmr(rc, buf, sizeof(buf));
  void* b = buf;
  size_t sz = sizeof(buf);
  int tag = 5, got = -1;
  void* r = NULL;
  while (!r)
    if (net_irecv(rc, 1, &b, &sz, &tag, &mh, &r) != ncclSuccess) FAILF("irecv failed");
  wait_req(r, &got);
  if (got != 11 || memcmp(buf, "genuine msg", 11) != 0) FAILF("genuine connection delivered wrong data");
  printf("[recv] refused %d impostor connection(s); genuine peer ok\n", g_warns_refused);
  net_close_recv(rc);
  net_close_listen(lc);
  net_finalize();
  (void)from;
}

static void badsecret_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE], forged[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  memcpy(forged, handle, sizeof(handle));
  forged[8] ^= 0x5a; /* the secret starts at byte 8 of flowlane's handle */
  void* bad = connect_blocking(-1, forged);
  /* The impostor's comm must fail (listener closes it), not hang. */
  char msg[16] = "impostor";
  void* mh = net_regmr(bad, msg, sizeof(msg));
  void* r = NULL;
  double t0 = now_s();
  ncclResult_t rc = ncclSuccess;
  while (!r && rc == ncclSuccess && now_s() - t0 < O.timeout_s) rc = net_isend(bad, msg, 8, 5, mh, &r);
  if (rc == ncclSuccess) FAILF("impostor connection was able to send (refusal not enforced)");
  if (rc != ncclRemoteError) FAILF("impostor's isend returned %d, expected ncclRemoteError (%d)", rc, ncclRemoteError);
  net_close_send(bad);
  void* sc = connect_blocking(-1, handle);
  char good[16] = "genuine msg";
  void* gmh = net_regmr(sc, good, sizeof(good));
  void* req = isend_blocking(sc, good, 11, 5, gmh);
  wait_req(req, NULL);
  net_close_send(sc);
  net_finalize();
  (void)to;
}

/* strangers: handshake denial of service (issue 32 item 2). The sender side plays strangers from raw sockets,
 * then connects genuinely; the receiver keeps calling accept() (as NCCL's proxy does) and receives each genuine
 * message. Phases (FL_STRANGER_PHASES, default ABCD):
 *   A  3 x 16 idle connections fill every handshake slot, then the genuine peer connects and must get through;
 *      every idle one must eventually be closed by the listener (evicted or past the first-byte deadline).
 *   B  a silent stranger is closed while one that sent part of a hello is still waiting (first-byte deadline
 *      shorter than the hello deadline): an ordering, not a time measurement.
 *   C  40 strangers with a wrong secret are refused, with a bounded number of log lines.
 *   D  a peer with the secret leaves 6 multi-path connections half open (1 of 2 paths), then the genuine peer
 *      connects and must get through; every half-open path is eventually closed.
 * Every wait is for an outcome, bounded by the generous --timeout. */
#define ST_SILENT (3 * 16)
#define ST_BADSECRET 40
#define ST_HALF_OPEN 6

static int st_phase(char ph) {
  const char* v = getenv("FL_STRANGER_PHASES");
  return !v || strchr(v, ph) != NULL;
}

static int st_connect(const struct fl_handle* h) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(h->addrs[0].port)};
  memcpy(&sa.sin_addr, h->addrs[0].addr, 4);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (struct sockaddr*)&sa, sizeof(sa)) != 0) FAILF("stranger connect failed: %s", strerror(errno));
  return fd;
}

/* 1 once the listener closed fd (EOF or reset), 0 while it is open. */
static int st_closed(int fd) {
  char b[256];
  for (;;) {
    ssize_t r = recv(fd, b, sizeof(b), MSG_DONTWAIT);
    if (r == 0) return 1;
    if (r > 0) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : 1;
  }
}

static void st_wait_closed(const int* fds, int n, const char* what) {
  double end = now_s() + O.timeout_s;
  for (int i = 0; i < n; i++) {
    while (!st_closed(fds[i])) {
      struct pollfd pf = {.fd = fds[i], .events = POLLIN};
      poll(&pf, 1, 100);
      if (now_s() > end) FAILF("%s: connection %d of %d is still open after %d s", what, i, n, O.timeout_s);
    }
  }
  for (int i = 0; i < n; i++) close(fds[i]);
}

static void st_hello(int fd, const struct fl_handle* h, uint64_t conn_id, int path, int npaths, int bad_secret,
                     size_t len) {
  struct fl_hello he = {.version = FL_NET_VERSION, .conn_id = conn_id, .path_index = (uint16_t)path,
                        .npaths = (uint16_t)npaths, .traffic_class = FL_CLASS_DEFAULT};
  memcpy(he.secret, h->secret, FL_SECRET_BYTES);
  if (bad_secret) he.secret[3] ^= 0x5a;
  uint8_t b[FL_HELLO_BYTES];
  fl_hello_encode(b, &he);
  if (send(fd, b, len, MSG_NOSIGNAL) != (ssize_t)len) FAILF("stranger hello: %s", strerror(errno));
}

static void st_genuine(const uint8_t* handle, int n) {
  uint8_t h[NCCL_NET_HANDLE_MAXSIZE];
  memcpy(h, handle, sizeof(h)); /* connect() keeps resume state in the handle */
  void* sc = connect_blocking(-1, h);
  char msg[16];
  snprintf(msg, sizeof(msg), "genuine %d", n);
  void* mh = net_regmr(sc, msg, sizeof(msg));
  void* req = isend_blocking(sc, msg, sizeof(msg), 5, mh);
  wait_req(req, NULL);
  net_deregmr(sc, mh);
  net_close_send(sc);
}

static void strangers_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  fcntl(from, F_SETFL, fcntl(from, F_GETFL) | O_NONBLOCK);
  int genuine = 0;
  double t0 = now_s(), end = t0 + 4.0 * O.timeout_s;
  for (;;) {
    void* rc = NULL;
    if (net_accept_once(lc, &rc) != ncclSuccess) FAILF("accept failed");
    if (rc) {
      char buf[16];
      void* mh = net_regmr(rc, buf, sizeof(buf));
      void* b = buf;
      size_t sz = sizeof(buf);
      int tag = 5, got = -1;
      void* r = NULL;
      while (!r)
        if (net_irecv(rc, 1, &b, &sz, &tag, &mh, &r) != ncclSuccess) FAILF("irecv failed");
      wait_req(r, &got);
      char expect[16];
      snprintf(expect, sizeof(expect), "genuine %d", genuine);
      if (got != (int)sizeof(buf) || strcmp(buf, expect) != 0) FAILF("genuine connection %d delivered wrong data", genuine);
      genuine++;
      net_deregmr(rc, mh);
      net_close_recv(rc);
    }
    char c;
    ssize_t n = read(from, &c, 1);
    if (n == 1) break; /* the stranger side is done */
    if (n == 0) FAILF("the stranger side exited early");
    if (now_s() > end) FAILF("strangers scenario did not finish");
    usleep(200);
  }
  double dt = now_s() - t0;
  /* Log volume: at most FL_REFUSE_LOG_BURST lines plus one summary per 10 s window (FL_REFUSE_LOG_*). */
  int windows = 1 + (int)(dt / 10.0);
  int allowed = windows * (5 + 1);
  printf("[recv] %d genuine connection(s) accepted among strangers; %d refusal log line(s) in %.1f s (allowed %d)\n",
         genuine, g_warns_refused, dt, allowed);
  if (st_phase('C') && g_warns_refused > allowed)
    FAILF("%d refusal log lines in %.1f s: refusals are not rate-limited", g_warns_refused, dt);
  write_all(to, &genuine, sizeof(genuine));
  net_close_listen(lc);
  net_finalize();
}

static void strangers_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  struct fl_handle h;
  char err[160];
  if (fl_handle_decode(handle, sizeof(handle), &h, err, sizeof(err)) != 0) FAILF("handle: %s", err);
  if (h.addrs[0].family != 4) FAILF("strangers scenario needs an IPv4 listener");
  int expect = 0;
  if (st_phase('A')) {
    int fds[ST_SILENT];
    for (int i = 0; i < ST_SILENT; i++) fds[i] = st_connect(&h);
    st_genuine(handle, expect++);
    st_wait_closed(fds, ST_SILENT, "idle stranger");
    printf("[send] A: %d idle strangers did not lock the genuine peer out, all were closed\n", ST_SILENT);
  }
  if (st_phase('B')) {
    int silent = st_connect(&h), talking = st_connect(&h);
    st_hello(talking, &h, 1, 0, 1, 0, 10); /* 10 of 64 bytes, then nothing */
    st_wait_closed(&silent, 1, "silent stranger");
    if (st_closed(talking)) FAILF("B: the stranger that sent its first bytes was closed together with the silent one");
    close(talking);
    printf("[send] B: the silent stranger was closed first (first-byte deadline)\n");
  }
  if (st_phase('C')) {
    int fds[ST_BADSECRET];
    for (int i = 0; i < ST_BADSECRET; i++) {
      fds[i] = st_connect(&h);
      st_hello(fds[i], &h, 100 + (uint64_t)i, 0, 1, 1, FL_HELLO_BYTES);
    }
    st_wait_closed(fds, ST_BADSECRET, "wrong-secret stranger");
    printf("[send] C: %d wrong-secret strangers refused\n", ST_BADSECRET);
  }
  if (st_phase('D')) {
    int fds[ST_HALF_OPEN];
    for (int i = 0; i < ST_HALF_OPEN; i++) {
      fds[i] = st_connect(&h);
      st_hello(fds[i], &h, 1000 + (uint64_t)i, 0, 2, 0, FL_HELLO_BYTES); /* path 0 of 2; path 1 never comes */
    }
    st_genuine(handle, expect++);
    st_wait_closed(fds, ST_HALF_OPEN, "half-open multi-path connection");
    printf("[send] D: %d half-open multi-path connections did not lock the genuine peer out, all expired\n",
           ST_HALF_OPEN);
  }
  write_all(to, "d", 1);
  int got = -1;
  read_all(from, &got, sizeof(got));
  if (got != expect) FAILF("receiver accepted %d genuine connection(s), expected %d", got, expect);
  net_finalize();
}

/* isolation (issue 32, per-comm progress): an API call on one comm does work
 * only for that comm, so its cost does not grow with the number of comms.
 * The receiver accepts ISO_COMMS connections opened from raw sockets by the
 * other process (a peer with the secret, scripted with the wire codec) and
 * posts one receive on each. The raw peer then sends a complete DATA frame to
 * comms 1..ISO_COMMS-1, and the receiver calls test() only on comm 0's
 * receive (which has no data) ISO_TESTS times. Loopback delivers the frames
 * before those calls, so a progress pass over every socket (the old global
 * poll) reads them and returns their ACKs during the calls on comm 0; per-comm
 * progress sends no ACK until those comms are called. Then each comm is
 * tested and must complete with its exact bytes, and its ACK must arrive.
 * Only the order of events is checked, never a duration (the 300 ms wait for
 * an ACK that must not come is a bound on an absence). */
#define ISO_COMMS 4
#define ISO_TESTS 200
#define ISO_BYTES 3000

static uint8_t iso_byte(int k, size_t i) { return (uint8_t)(mix((uint64_t)k * 1000003u + i) & 0xff); }

static void iso_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(-1, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc[ISO_COMMS];
  void* mh[ISO_COMMS];
  void* req[ISO_COMMS];
  static uint8_t buf[ISO_COMMS][ISO_BYTES];
  for (int k = 0; k < ISO_COMMS; k++) {
    rc[k] = accept_blocking(lc); /* accept order, not connect order: the tag names the comm */
    mh[k] = net_regmr(rc[k], buf[k], ISO_BYTES);
    void* b = buf[k];
    size_t sz = ISO_BYTES;
    int tag = 100 + k;
    req[k] = NULL;
    while (!req[k])
      if (net_irecv(rc[k], 1, &b, &sz, &tag, &mh[k], &req[k]) != ncclSuccess) FAILF("irecv on comm %d failed", k);
  }
  write_all(to, "p", 1); /* every receive is posted: the raw peer reads the CTS frames */
  char c;
  read_all(from, &c, 1); /* the frames for comms 1.. were written (and are in our sockets: loopback) */
  for (int i = 0; i < ISO_TESTS; i++) {
    int done = 0;
    if (net_test(req[0], &done, NULL) != ncclSuccess) FAILF("test() on comm 0 returned an error");
    if (done) FAILF("comm 0's receive completed although nothing was sent to it");
  }
  write_all(to, "t", 1);
  read_all(from, &c, 1); /* the raw peer looked for ACKs */
  for (int k = 1; k < ISO_COMMS; k++) {
    int got = -1;
    wait_req(req[k], &got);
    if (got != ISO_BYTES) FAILF("comm %d received %d bytes, expected %d", k, got, ISO_BYTES);
    for (size_t i = 0; i < ISO_BYTES; i++)
      if (buf[k][i] != iso_byte(k, i)) FAILF("comm %d: byte %zu differs", k, i);
  }
  write_all(to, "r", 1);
  int got = -1;
  wait_req(req[0], &got); /* the raw peer now sends comm 0's message */
  if (got != ISO_BYTES) FAILF("comm 0 received %d bytes, expected %d", got, ISO_BYTES);
  for (size_t i = 0; i < ISO_BYTES; i++)
    if (buf[0][i] != iso_byte(0, i)) FAILF("comm 0: byte %zu differs", i);
  write_all(to, "e", 1);
  read_all(from, &c, 1);
  for (int k = 0; k < ISO_COMMS; k++) {
    net_deregmr(rc[k], mh[k]);
    net_close_recv(rc[k]);
  }
  net_close_listen(lc);
  printf("[recv] %d test() calls on comm 0 left comms 1..%d alone; all %d comms then completed intact\n", ISO_TESTS,
         ISO_COMMS - 1, ISO_COMMS);
  net_finalize();
}

static void iso_read_frame(int fd, struct fl_frame* f, uint8_t* payload, size_t cap, const char* what) {
  uint8_t hdr[FL_FRAME_HDR_BYTES];
  char err[160];
  read_all(fd, hdr, sizeof(hdr));
  if (fl_frame_decode(hdr, sizeof(hdr), f, err, sizeof(err)) != 0) FAILF("%s: %s", what, err);
  if (f->length > cap) FAILF("%s: %u payload bytes", what, f->length);
  read_all(fd, payload, f->length);
}

/* 1 if fd has bytes to read within ms milliseconds. */
static int iso_readable(int fd, int ms) {
  struct pollfd pf = {.fd = fd, .events = POLLIN};
  return poll(&pf, 1, ms) == 1 && (pf.revents & POLLIN);
}

static void iso_send_data(int fd, int k, uint32_t seq) {
  struct fl_frame f = {.type = FL_FRAME_DATA, .index = 0, .seq = seq, .offset = 0, .length = ISO_BYTES,
                       .aux = 7000u + (uint32_t)k, .total = ISO_BYTES};
  uint8_t b[FL_FRAME_HDR_BYTES + ISO_BYTES];
  fl_frame_encode(b, &f);
  for (size_t i = 0; i < ISO_BYTES; i++) b[FL_FRAME_HDR_BYTES + i] = iso_byte(k, i);
  write_all(fd, b, sizeof(b));
}

static void iso_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  struct fl_handle h;
  char err[160];
  if (fl_handle_decode(handle, sizeof(handle), &h, err, sizeof(err)) != 0) FAILF("handle: %s", err);
  if (h.addrs[0].family != 4) FAILF("isolation scenario needs an IPv4 listener");
  int fds[ISO_COMMS];
  for (int i = 0; i < ISO_COMMS; i++) {
    fds[i] = st_connect(&h);
    st_hello(fds[i], &h, 5000 + (uint64_t)i, 0, 1, 0, FL_HELLO_BYTES);
  }
  char c;
  read_all(from, &c, 1);
  int fd_of[ISO_COMMS];
  uint32_t seq_of[ISO_COMMS];
  for (int k = 0; k < ISO_COMMS; k++) fd_of[k] = -1;
  for (int i = 0; i < ISO_COMMS; i++) { /* one CTS per connection; its tag says which comm it is */
    struct fl_frame f;
    uint8_t payload[FL_MAX_RECVS * FL_CTS_ENTRY_BYTES];
    struct fl_cts_entry e[FL_MAX_RECVS];
    iso_read_frame(fds[i], &f, payload, sizeof(payload), "CTS");
    if (f.type != FL_FRAME_CTS || f.index != 1 || fl_cts_decode(payload, f.length, 1, e, err, sizeof(err)) != 0)
      FAILF("connection %d: expected a one-entry CTS (type %u, n %u)", i, f.type, f.index);
    int k = e[0].tag - 100;
    if (k < 0 || k >= ISO_COMMS || fd_of[k] >= 0 || e[0].size != ISO_BYTES) FAILF("unexpected CTS tag %d", e[0].tag);
    fd_of[k] = fds[i];
    seq_of[k] = f.seq;
  }
  for (int k = 1; k < ISO_COMMS; k++) iso_send_data(fd_of[k], k, seq_of[k]);
  write_all(to, "s", 1);
  read_all(from, &c, 1); /* the receiver made its test() calls on comm 0 */
  int progressed = 0;
  for (int k = 1; k < ISO_COMMS; k++) progressed += iso_readable(fd_of[k], k == 1 ? 300 : 0);
  if (progressed)
    FAILF("%d of %d other comms sent ACKs during test() calls on comm 0 only: a call progresses every comm "
          "(per-call work grows with the number of comms)", progressed, ISO_COMMS - 1);
  write_all(to, "c", 1);
  read_all(from, &c, 1); /* comms 1.. completed */
  for (int k = 1; k < ISO_COMMS; k++) {
    struct fl_frame f;
    uint8_t none[1];
    iso_read_frame(fd_of[k], &f, none, 0, "ACK");
    if (f.type != FL_FRAME_ACK || f.seq != 7000u + (uint32_t)k)
      FAILF("comm %d: expected the ACK of chunk %u", k, 7000u + (unsigned)k);
  }
  iso_send_data(fd_of[0], 0, seq_of[0]);
  read_all(from, &c, 1);
  write_all(to, "x", 1);
  for (int i = 0; i < ISO_COMMS; i++) close(fds[i]);
  printf("[send] no ACK from comms 1..%d while only comm 0 was called; each ACKed once called\n", ISO_COMMS - 1);
  net_finalize();
}

static int scenario_props(void) {
  void* h = dlopen(O.plugin, RTLD_NOW | RTLD_LOCAL);
  if (!h) FAILF("dlopen %s: %s", O.plugin, dlerror());
  const char* names[] = {"ncclNetPlugin_v8", "ncclNetPlugin_v9", "ncclNetPlugin_v10", "ncclNetPlugin_v11"};
  for (int i = 0; i < 4; i++) {
    const char* const* name = dlsym(h, names[i]);
    if (!name || strcmp(*name, FL_NET_PLUGIN_NAME) != 0) FAILF("%s missing or misnamed", names[i]);
  }
  const ncclNet_v8_t* v8 = dlsym(h, "ncclNetPlugin_v8");
  const ncclNet_v9_t* v9 = dlsym(h, "ncclNetPlugin_v9");
  const ncclNet_v10_t* v10 = dlsym(h, "ncclNetPlugin_v10");
  const ncclNet_v11_t* v11 = dlsym(h, "ncclNetPlugin_v11");
  ncclNetProperties_v8_t p8;
  ncclNetProperties_v9_t p9;
  ncclNetProperties_v11_t p11;
  void* ctx = NULL;
  ncclNetCommConfig_v11_t cfg = {.trafficClass = 0};
  if (v8->init(logger) || v8->getProperties(0, &p8)) FAILF("v8 getProperties failed");
  if (v9->init(logger) || v9->getProperties(0, &p9)) FAILF("v9 getProperties failed");
  if (v10->init(logger, NULL) || v10->getProperties(0, &p9)) FAILF("v10 getProperties failed");
  if (v11->init(&ctx, 1, &cfg, logger, NULL) || v11->getProperties(0, &p11)) FAILF("v11 getProperties failed");
  if (p8.ptrSupport != NCCL_PTR_HOST || p9.ptrSupport != NCCL_PTR_HOST || p11.ptrSupport != NCCL_PTR_HOST)
    FAILF("ptrSupport must be NCCL_PTR_HOST only");
  if (p8.maxRecvs != FL_MAX_RECVS || p11.maxRecvs != FL_MAX_RECVS) FAILF("maxRecvs wrong");
  if (p9.maxP2pBytes != p11.maxP2pBytes || p8.speed != p11.speed) FAILF("property conversion mismatch");
  if (v8->getProperties(3, &p8) == ncclSuccess) FAILF("getProperties accepted a bad device index");
  /* CUDA memory must be refused with a clear message. */
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc = NULL;
  if (v11->listen(ctx, 0, handle, &lc) != ncclSuccess) FAILF("listen failed");
  void* sc = NULL;
  double end = now_s() + 10;
  void* rc = NULL;
  ncclNetDeviceHandle_v11_t* dh = NULL;
  while ((!sc || !rc) && now_s() < end) {
    if (!sc && v11->connect(ctx, 0, handle, &sc, &dh) != ncclSuccess) FAILF("connect failed");
    if (!rc && v11->accept(lc, &rc, &dh) != ncclSuccess) FAILF("accept failed");
  }
  if (!sc || !rc) FAILF("in-process loopback connection failed");
  void* mh = NULL;
  int warns = g_warns_host_only;
  if (v11->regMr(sc, (void*)0x1000, 4096, NCCL_PTR_CUDA, &mh) == ncclSuccess) FAILF("regMr accepted NCCL_PTR_CUDA");
  if (g_warns_host_only <= warns) FAILF("CUDA rejection did not log a 'host memory only' message");
  /* Calls NCCL's contract rules out are refused with a warning naming the call, never silently. */
  warns = g_warns_refused;
  void* req = NULL;
  char byte = 0;
  if (v11->isend(rc, &byte, 1, 0, NULL, NULL, &req) == ncclSuccess) FAILF("isend accepted a receive comm");
  if (v11->irecv(sc, 1, (void**)&mh, (size_t[]){1}, (int[]){0}, NULL, NULL, &req) == ncclSuccess)
    FAILF("irecv accepted a send comm");
  if (v11->devices(NULL) == ncclSuccess) FAILF("devices accepted a NULL count");
  if (g_warns_refused - warns != 3) FAILF("%d of 3 contract violations logged as refused", g_warns_refused - warns);
  v11->closeSend(sc);
  v11->closeRecv(rc);
  v11->closeListen(lc);
  v11->finalize(ctx);
  printf("[driver] v8..v11 tables present; properties consistent; CUDA memory and contract violations refused\n");
  return 0;
}

/* ------------------------------------------------------------ benchmarks */

static int cmp_double(const void* a, const void* b);

/* bench-stream: O.iters messages of O.bytes, O.window in flight. The sender
 * prints per-message completion-time percentiles, the receiver throughput. */
static double g_bench_seconds;
static void stream_recv(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  void* lc;
  net_listen(O.bulk_class, handle, &lc);
  write_all(to, handle, sizeof(handle));
  void* rc = accept_blocking(lc);
  int W = O.window;
  uint8_t** bufs = calloc((size_t)W, sizeof(uint8_t*));
  void** mhs = calloc((size_t)W, sizeof(void*));
  void** reqs = calloc((size_t)W, sizeof(void*));
  for (int i = 0; i < W; i++) bufs[i] = big_alloc(O.bytes), mhs[i] = net_regmr(rc, bufs[i], O.bytes), memset(bufs[i], 1, O.bytes);
  int posted = 0, done_n = 0;
  double t0 = 0;
  while (done_n < O.iters) {
    for (int i = 0; i < W; i++) {
      if (!reqs[i] && posted < O.iters) {
        void* b = bufs[i];
        size_t sz = O.bytes;
        int tag = 0;
        if (net_irecv(rc, 1, &b, &sz, &tag, &mhs[i], &reqs[i]) != ncclSuccess) FAILF("irecv failed");
        if (reqs[i]) posted++;
      }
      if (reqs[i]) {
        int done = 0, got;
        if (net_test(reqs[i], &done, &got) != ncclSuccess) FAILF("test failed");
        if (done) {
          if (done_n == 0) t0 = now_s(); /* first message = warm-up, timing starts after it */
          reqs[i] = NULL;
          done_n++;
        }
      }
    }
  }
  g_bench_seconds = now_s() - t0;
  double bytes = (double)O.bytes * (O.iters - 1);
  printf("{\"bytes\": %.0f, \"seconds\": %.6f, \"gbytes_per_s\": %.4f}\n", bytes, g_bench_seconds,
         bytes / g_bench_seconds / 1e9);
  net_close_recv(rc);
  net_close_listen(lc);
  net_finalize();
  (void)from;
}

static void stream_send(int to, int from) {
  uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
  read_all(from, handle, sizeof(handle));
  void* sc = connect_blocking(O.bulk_class, handle);
  int W = O.window;
  uint8_t** bufs = calloc((size_t)W, sizeof(uint8_t*));
  void** mhs = calloc((size_t)W, sizeof(void*));
  void** reqs = calloc((size_t)W, sizeof(void*));
  for (int i = 0; i < W; i++) bufs[i] = big_alloc(O.bytes), mhs[i] = net_regmr(sc, bufs[i], O.bytes), memset(bufs[i], 2, O.bytes);
  double* t_start = calloc((size_t)W, sizeof(double));
  double* lat = calloc((size_t)O.iters, sizeof(double)); /* isend accepted -> test() done, per message */
  int sent = 0, done_n = 0;
  double end = now_s() + O.timeout_s;
  while (done_n < O.iters) {
    for (int i = 0; i < W; i++) {
      if (!reqs[i] && sent < O.iters) {
        if (net_isend(sc, bufs[i], O.bytes, 0, mhs[i], &reqs[i]) != ncclSuccess) FAILF("isend failed");
        if (reqs[i]) sent++, t_start[i] = now_s();
      }
      if (reqs[i]) {
        int done = 0;
        if (net_test(reqs[i], &done, NULL) != ncclSuccess) FAILF("test failed");
        if (done) lat[done_n++] = now_s() - t_start[i], reqs[i] = NULL;
      }
    }
    if (now_s() > end) FAILF("stream timed out");
  }
  int m = O.iters - 1; /* the first message is warm-up, as on the receiver */
  qsort(lat + 1, (size_t)m, sizeof(double), cmp_double);
  printf("{\"lat_ms_p50\": %.3f, \"lat_ms_p99\": %.3f, \"lat_ms_max\": %.3f}\n", lat[1 + m / 2] * 1e3,
         lat[1 + (m * 99) / 100] * 1e3, lat[m] * 1e3);
  fflush(stdout);
  net_close_send(sc);
  net_finalize();
  (void)to;
}

/* bench-pingpong: A (sender side) pings B with O.ping_size bytes in class
 * O.ping_class, B answers; optionally A also streams 4 MiB bulk messages of
 * class O.bulk_class to B. Prints RTT percentiles measured at A. */
#define PP_BULK_BYTES (4u << 20)
#define PP_BULK_WINDOW 4
static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

static void pp_side_b(int to, int from) { /* "recv" process */
  uint8_t h_ping[NCCL_NET_HANDLE_MAXSIZE], h_bulk[NCCL_NET_HANDLE_MAXSIZE], h_pong[NCCL_NET_HANDLE_MAXSIZE];
  void *lc_ping, *lc_bulk = NULL;
  net_listen(O.ping_class, h_ping, &lc_ping);
  net_listen(O.bulk_class, h_bulk, &lc_bulk);
  write_all(to, h_ping, sizeof(h_ping));
  write_all(to, h_bulk, sizeof(h_bulk));
  read_all(from, h_pong, sizeof(h_pong));
  void *rc_ping = NULL, *rc_bulk = NULL, *sc_pong = NULL;
  double end = now_s() + O.timeout_s;
  while (!rc_ping || !rc_bulk || !sc_pong) {
    if (!rc_ping && net_accept_once(lc_ping, &rc_ping)) FAILF("accept");
    if (!rc_bulk && net_accept_once(lc_bulk, &rc_bulk)) FAILF("accept");
    if (!sc_pong && net_connect_once(O.ping_class, h_pong, &sc_pong)) FAILF("connect");
    if (now_s() > end) FAILF("setup timed out");
  }
  uint8_t* pbuf = malloc((size_t)O.ping_size);
  void* pmh_r = net_regmr(rc_ping, pbuf, (size_t)O.ping_size);
  void* pmh_s = net_regmr(sc_pong, pbuf, (size_t)O.ping_size);
  uint8_t* bbuf[PP_BULK_WINDOW];
  void* bmh[PP_BULK_WINDOW];
  void* breq[PP_BULK_WINDOW] = {0};
  for (int i = 0; i < PP_BULK_WINDOW; i++) bbuf[i] = big_alloc(PP_BULK_BYTES), bmh[i] = net_regmr(rc_bulk, bbuf[i], PP_BULK_BYTES);
  void* ping_req = NULL;
  void* pong_req = NULL;
  int pongs = 0;
  uint64_t bulk_bytes = 0;
  double t0 = now_s();
  while (pongs < O.iters + 10) {
    if (O.bulk)
      for (int i = 0; i < PP_BULK_WINDOW; i++) {
        if (!breq[i]) {
          void* b = bbuf[i];
          size_t sz = PP_BULK_BYTES;
          int tag = 0;
          if (net_irecv(rc_bulk, 1, &b, &sz, &tag, &bmh[i], &breq[i])) FAILF("bulk irecv");
        } else {
          int done = 0, got = 0;
          if (net_test(breq[i], &done, &got)) FAILF("bulk test");
          if (done) breq[i] = NULL, bulk_bytes += (uint64_t)got;
        }
      }
    if (!ping_req && !pong_req) {
      void* b = pbuf;
      size_t sz = (size_t)O.ping_size;
      int tag = 1;
      if (net_irecv(rc_ping, 1, &b, &sz, &tag, &pmh_r, &ping_req)) FAILF("ping irecv");
    } else if (ping_req) {
      int done = 0;
      if (net_test(ping_req, &done, NULL)) FAILF("ping test");
      if (done) {
        ping_req = NULL;
        while (!pong_req)
          if (net_isend(sc_pong, pbuf, (size_t)O.ping_size, 1, pmh_s, &pong_req)) FAILF("pong isend");
      }
    } else {
      int done = 0;
      if (net_test(pong_req, &done, NULL)) FAILF("pong test");
      if (done) pong_req = NULL, pongs++;
    }
    if (now_s() - t0 > O.timeout_s) FAILF("ping-pong timed out after %d pongs", pongs);
  }
  double dt = now_s() - t0;
  fprintf(stderr, "[recv] bulk goodput during ping-pong: %.2f MB/s\n", bulk_bytes / dt / 1e6);
  printf("{\"bulk_mbytes_per_s\": %.3f}\n", bulk_bytes / dt / 1e6);
  fflush(NULL);
  char fin;
  read_all(from, &fin, 1); /* stay connected until A has its last pong */
  write_all(to, "y", 1);   /* and A stays until then: neither side sees the other close mid-loop */
  _exit(0); /* bulk may still be in flight; the sender side exits on its own */
}

static void pp_side_a(int to, int from) { /* "send" process */
  uint8_t h_ping[NCCL_NET_HANDLE_MAXSIZE], h_bulk[NCCL_NET_HANDLE_MAXSIZE], h_pong[NCCL_NET_HANDLE_MAXSIZE];
  void* lc_pong;
  net_listen(O.ping_class, h_pong, &lc_pong);
  write_all(to, h_pong, sizeof(h_pong));
  read_all(from, h_ping, sizeof(h_ping));
  read_all(from, h_bulk, sizeof(h_bulk));
  void *sc_ping = NULL, *sc_bulk = NULL, *rc_pong = NULL;
  double end = now_s() + O.timeout_s;
  while (!sc_ping || !sc_bulk || !rc_pong) {
    if (!sc_ping && net_connect_once(O.ping_class, h_ping, &sc_ping)) FAILF("connect");
    if (!sc_bulk && net_connect_once(O.bulk_class, h_bulk, &sc_bulk)) FAILF("connect");
    if (!rc_pong && net_accept_once(lc_pong, &rc_pong)) FAILF("accept");
    if (now_s() > end) FAILF("setup timed out");
  }
  uint8_t* pbuf = malloc((size_t)O.ping_size);
  memset(pbuf, 3, (size_t)O.ping_size);
  void* pmh_s = net_regmr(sc_ping, pbuf, (size_t)O.ping_size);
  void* pmh_r = net_regmr(rc_pong, pbuf, (size_t)O.ping_size);
  uint8_t* bbuf = big_alloc(PP_BULK_BYTES);
  void* bmh = net_regmr(sc_bulk, bbuf, PP_BULK_BYTES);
  void* breq[PP_BULK_WINDOW] = {0};
  int total = O.iters + 10; /* first 10 are warm-up */
  double* rtt = calloc((size_t)total, sizeof(double));
  int n = 0;
  void *ping_req = NULL, *pong_req = NULL;
  double t_ping = 0, next_ping = now_s() + (O.bulk ? 0.5 : 0.05); /* let the bulk stream fill the link */
  int state = 0; /* 0 idle, 1 ping in flight, 2 waiting pong */
  while (n < total) {
    if (O.bulk)
      for (int i = 0; i < PP_BULK_WINDOW; i++) {
        if (!breq[i]) {
          if (net_isend(sc_bulk, bbuf, PP_BULK_BYTES, 0, bmh, &breq[i])) FAILF("bulk isend");
        } else {
          int done = 0;
          if (net_test(breq[i], &done, NULL)) FAILF("bulk test");
          if (done) breq[i] = NULL;
        }
      }
    double t = now_s();
    if (state == 0 && t >= next_ping) {
      void* b = pbuf;
      size_t sz = (size_t)O.ping_size;
      int tag = 1;
      if (net_irecv(rc_pong, 1, &b, &sz, &tag, &pmh_r, &pong_req)) FAILF("pong irecv");
      t_ping = now_s();
      while (!ping_req)
        if (net_isend(sc_ping, pbuf, (size_t)O.ping_size, 1, pmh_s, &ping_req)) FAILF("ping isend");
      state = 1;
    } else if (state == 1) {
      int done = 0;
      if (net_test(ping_req, &done, NULL)) FAILF("ping test");
      if (done) ping_req = NULL, state = 2;
    } else if (state == 2) {
      int done = 0;
      if (net_test(pong_req, &done, NULL)) FAILF("pong test");
      if (done) {
        rtt[n++] = now_s() - t_ping;
        pong_req = NULL;
        state = 0;
        next_ping = now_s() + 0.002;
      }
    }
    if (now_s() > end + 120) FAILF("ping-pong timed out");
  }
  int m = total - 10;
  qsort(rtt + 10, (size_t)m, sizeof(double), cmp_double);
  double* s = rtt + 10;
  printf("{\"rtt_us_p50\": %.2f, \"rtt_us_p90\": %.2f, \"rtt_us_p99\": %.2f, \"rtt_us_max\": %.2f, \"samples\": %d}\n",
         s[m / 2] * 1e6, s[(m * 9) / 10] * 1e6, s[(m * 99) / 100] * 1e6, s[m - 1] * 1e6, m);
  fflush(stdout);
  write_all(to, "x", 1);
  char fin;
  read_all(from, &fin, 1); /* B has counted its last pong */
  _exit(0);
}

/* ------------------------------------------------------------------ main */

/* bench-comms: O.comms connections, O.iters messages of O.bytes each, one in
 * flight per comm, every comm polled in turn as NCCL's proxy does. Reports
 * the cost of one plugin call, which per-comm progress keeps independent of
 * how many comms exist (a global poll over every socket made it grow). */
static void comms_recv(int to, int from) {
  int K = O.comms;
  void** lcs = calloc((size_t)K, sizeof(void*));
  void** rcs = calloc((size_t)K, sizeof(void*));
  for (int k = 0; k < K; k++) {
    uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
    net_listen(O.bulk_class, handle, &lcs[k]);
    write_all(to, handle, sizeof(handle));
  }
  for (int k = 0; k < K; k++) rcs[k] = accept_blocking(lcs[k]);
  uint8_t** bufs = calloc((size_t)K, sizeof(uint8_t*));
  void** reqs = calloc((size_t)K, sizeof(void*));
  void** mhs = calloc((size_t)K, sizeof(void*));
  int* count = calloc((size_t)K, sizeof(int));
  size_t cap = O.bytes ? O.bytes : 1;
  for (int k = 0; k < K; k++) bufs[k] = malloc(cap), mhs[k] = net_regmr(rcs[k], bufs[k], cap);
  int finished = 0;
  uint64_t calls = 0;
  double t0 = now_s(), end = t0 + O.timeout_s;
  while (finished < K) {
    for (int k = 0; k < K; k++) {
      if (count[k] == O.iters) continue;
      calls++;
      if (!reqs[k]) {
        void* b = bufs[k];
        size_t sz = cap;
        int tag = 0;
        if (net_irecv(rcs[k], 1, &b, &sz, &tag, &mhs[k], &reqs[k]) != ncclSuccess) FAILF("irecv failed");
        continue;
      }
      int done = 0, got = -1;
      if (net_test(reqs[k], &done, &got) != ncclSuccess) FAILF("test failed on comm %d", k);
      if (!done) continue;
      if ((uint64_t)got != O.bytes) FAILF("comm %d: got %d bytes, expected %llu", k, got, (unsigned long long)O.bytes);
      reqs[k] = NULL;
      if (++count[k] == O.iters) finished++;
    }
    if (now_s() > end) FAILF("bench-comms timed out (%d/%d comms finished)", finished, K);
  }
  double dt = now_s() - t0;
  printf("{\"comms\": %d, \"messages\": %d, \"seconds\": %.6f, \"msgs_per_s\": %.1f, \"recv_calls\": %llu, "
         "\"recv_us_per_call\": %.3f}\n", K, K * O.iters, dt, K * O.iters / dt, (unsigned long long)calls,
         dt / (double)calls * 1e6);
  fflush(stdout);
  for (int k = 0; k < K; k++) net_close_recv(rcs[k]), net_close_listen(lcs[k]);
  net_finalize();
  (void)from;
}

static void comms_send(int to, int from) {
  int K = O.comms;
  void** scs = calloc((size_t)K, sizeof(void*));
  for (int k = 0; k < K; k++) {
    uint8_t handle[NCCL_NET_HANDLE_MAXSIZE];
    read_all(from, handle, sizeof(handle));
    scs[k] = connect_blocking(O.bulk_class, handle);
  }
  size_t cap = O.bytes ? O.bytes : 1;
  uint8_t* buf = malloc(cap);
  memset(buf, 7, cap);
  void** mhs = calloc((size_t)K, sizeof(void*));
  void** reqs = calloc((size_t)K, sizeof(void*));
  int* count = calloc((size_t)K, sizeof(int));
  for (int k = 0; k < K; k++) mhs[k] = net_regmr(scs[k], buf, cap);
  int finished = 0;
  uint64_t calls = 0;
  double t0 = now_s(), end = t0 + O.timeout_s;
  while (finished < K) {
    for (int k = 0; k < K; k++) {
      if (count[k] == O.iters) continue;
      calls++;
      if (!reqs[k]) {
        if (net_isend(scs[k], buf, O.bytes, 0, mhs[k], &reqs[k]) != ncclSuccess) FAILF("isend failed");
        continue;
      }
      int done = 0;
      if (net_test(reqs[k], &done, NULL) != ncclSuccess) FAILF("test failed on comm %d", k);
      if (done) {
        reqs[k] = NULL;
        if (++count[k] == O.iters) finished++;
      }
    }
    if (now_s() > end) FAILF("bench-comms send timed out");
  }
  double dt = now_s() - t0;
  printf("{\"send_calls\": %llu, \"send_us_per_call\": %.3f}\n", (unsigned long long)calls, dt / (double)calls * 1e6);
  fflush(stdout);
  for (int k = 0; k < K; k++) net_close_send(scs[k]);
  net_finalize();
  (void)to;
}

struct scenario {
  const char* name;
  role_fn recv, send;
};
static const struct scenario kScenarios[] = {
    {"integrity", integrity_recv, integrity_send},
    {"multirecv", multirecv_recv, multirecv_send},
    {"grouped", grouped_recv, grouped_send},
    {"closeload", closeload_recv, closeload_send},
    {"manycomms", manycomms_recv, manycomms_send},
    {"threads", threads_recv, threads_send},
    {"isolation", iso_recv, iso_send},
    {"badsecret", badsecret_recv, badsecret_send},
    {"strangers", strangers_recv, strangers_send},
    {"peerdeath", fault_recv, fault_send},
    {"stall", fault_recv, fault_send},
    {"hostdeath", hostdeath_recv, hostdeath_send},
    {"bench-stream", stream_recv, stream_send},
    {"bench-pingpong", pp_side_b, pp_side_a},
    {"bench-comms", comms_recv, comms_send},
};

static int run_scenario(const char* name) {
  if (!strcmp(name, "props") || !strcmp(name, "cudareject")) {
    /* in a child, so the plugin's process-wide state never leaks into later scenarios */
    fflush(NULL);
    pid_t p = fork();
    if (p == 0) _exit(scenario_props());
    int st = 0;
    waitpid(p, &st, 0);
    return exited_ok(st) ? 0 : 1;
  }
  for (size_t i = 0; i < sizeof(kScenarios) / sizeof(kScenarios[0]); i++) {
    const struct scenario* s = &kScenarios[i];
    if (strcmp(s->name, name) != 0) continue;
    if (!strcmp(name, "hostdeath") && (!O.send_ns || !O.recv_ns)) {
      fprintf(stderr, "[driver] hostdeath: FAIL: needs --send-ns and --recv-ns (it takes the victim's links down)\n");
      return 1;
    }
    int own_timeout = (!strcmp(name, "stall") || !strcmp(name, "strangers") || !strcmp(name, "hostdeath")) &&
                      !getenv(FL_ENV_TIMEOUT_MS);
    /* stall detection bound; for strangers it caps the hello and half-open deadlines (4 s) but not the first-byte
     * one (1 s), so phases B and D end sooner */
    if (own_timeout) setenv(FL_ENV_TIMEOUT_MS, !strcmp(name, "strangers") ? "4000" : "1500", 1);
    if (!strcmp(name, "stall")) setenv("FL_DRIVER_FAULT", "stop", 1);
    if (!strcmp(name, "peerdeath")) setenv("FL_DRIVER_FAULT", "kill", 1);
    if (!strcmp(name, "hostdeath")) setenv("FL_DRIVER_FAULT", "vanish", 1);
    int own_paths = !strcmp(name, "closeload") && !getenv(FL_ENV_PATHS);
    if (own_paths) setenv(FL_ENV_PATHS, "2", 1); /* closes with sub-chunks spread over two paths */
    int fault = !strcmp(name, "stall") || !strcmp(name, "peerdeath") || !strcmp(name, "hostdeath");
    int rs, ss;
    pid_t sp;
    double t0 = now_s();
    run_pair(s->recv, s->send, &rs, &ss, &sp);
    if (own_timeout) unsetenv(FL_ENV_TIMEOUT_MS);
    if (own_paths) unsetenv(FL_ENV_PATHS);
    unsetenv("FL_DRIVER_FAULT");
    int ok;
    if (fault) {
      int survivor = victim_is_sender() ? rs : ss;
      ok = exited_ok(survivor);
    } else {
      ok = exited_ok(rs) && exited_ok(ss);
    }
    printf("[driver] %s (api v%d%s%s): %s in %.2f s\n", name, O.api, fault ? ", victim " : "",
           fault ? (victim_is_sender() ? "sender" : "receiver") : "", ok ? "PASS" : "FAIL", now_s() - t0);
    fflush(stdout);
    return ok ? 0 : 1;
  }
  fprintf(stderr, "unknown scenario \"%s\"\n", name);
  return 2;
}

static void usage(void) {
  fprintf(stderr,
          "usage: fl_driver --plugin PATH [--api v8|v11] [--send-ns NS --recv-ns NS] [--send-ifname S --recv-ifname S]\n"
          "                 [--max-bytes N] [--bytes N --iters K --window W] [--comms K] [--timeout S]\n"
          "                 [--bulk] [--ping-class C] [--bulk-class C] [--ping-size B] SCENARIO...\n"
          "scenarios: props integrity multirecv grouped closeload manycomms threads isolation badsecret strangers peerdeath stall all\n"
          "           hostdeath (with --send-ns/--recv-ns)\n"
          "           bench-stream bench-pingpong bench-comms\n");
  exit(2);
}

int main(int argc, char** argv) {
  const char* scen[16];
  int nscen = 0;
  signal(SIGPIPE, SIG_IGN);
  for (int i = 1; i < argc; i++) {
    const char* a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
#define TAKE() (v ? (i++, v) : (usage(), ""))
    if (!strcmp(a, "--plugin")) O.plugin = TAKE();
    else if (!strcmp(a, "--api")) {
      const char* x = TAKE();
      O.api = !strcmp(x, "v8") ? 8 : !strcmp(x, "v11") ? 11 : 0;
      if (!O.api) usage();
    } else if (!strcmp(a, "--send-ns")) O.send_ns = TAKE();
    else if (!strcmp(a, "--recv-ns")) O.recv_ns = TAKE();
    else if (!strcmp(a, "--send-ifname")) O.send_ifname = TAKE();
    else if (!strcmp(a, "--recv-ifname")) O.recv_ifname = TAKE();
    else if (!strcmp(a, "--max-bytes")) O.max_bytes = strtoull(TAKE(), NULL, 0);
    else if (!strcmp(a, "--bytes")) O.bytes = strtoull(TAKE(), NULL, 0);
    else if (!strcmp(a, "--iters")) O.iters = atoi(TAKE());
    else if (!strcmp(a, "--window")) O.window = atoi(TAKE());
    else if (!strcmp(a, "--comms")) O.comms = atoi(TAKE());
    else if (!strcmp(a, "--timeout")) O.timeout_s = atoi(TAKE());
    else if (!strcmp(a, "--ping-class")) O.ping_class = atoi(TAKE());
    else if (!strcmp(a, "--bulk-class")) O.bulk_class = atoi(TAKE());
    else if (!strcmp(a, "--ping-size")) O.ping_size = atoi(TAKE());
    else if (!strcmp(a, "--bulk")) O.bulk = 1;
    else if (a[0] == '-') usage();
    else if (nscen < 16) scen[nscen++] = a;
  }
  if (!O.plugin || nscen == 0 || O.iters < 2 || O.window < 1 || O.window > 32 || O.comms < 1 || O.comms > 256)
    usage();
  int fails = 0;
  for (int k = 0; k < nscen; k++) {
    if (!strcmp(scen[k], "all")) {
      const char* list[] = {"props", "integrity", "multirecv", "grouped", "closeload", "manycomms", "threads",
                            "isolation", "badsecret", "strangers", "peerdeath", "stall"};
      int apis[] = {8, 11};
      for (int a = 0; a < 2; a++) {
        O.api = apis[a];
        for (size_t j = 0; j < sizeof(list) / sizeof(list[0]); j++) {
          if (O.api == 8 && !strcmp(list[j], "strangers")) continue; /* handshakes do not depend on the API version */
          fails += run_scenario(list[j]) != 0;
        }
      }
    } else {
      fails += run_scenario(scen[k]) != 0;
    }
  }
  return fails ? 1 : 0;
}
