/*
 * fl_transport.c - flowlane's TCP transport, its first half: the engine (interfaces, parameters), listen, connect
 * and the guarded accept with its authenticated handshake, and each comm's lifetime. The second half, the data path
 * (frames, paths, lanes, isend/irecv/test/close), is fl_progress.c; what both share is fl_transport.h.
 *
 * Protocol (receiver-driven, like NCCL's RDMA transports): irecv posts a CTS
 * frame (slot seq, n, tags, sizes) to the sender on path 0; isend matches the
 * oldest CTS by tag, so sends complete into the right buffer of a
 * multi-receive and every DATA byte has a known destination. DATA frames
 * (seq, index, offset, length, total) may travel on any path and are written
 * straight into the posted buffer at their offset; the receiver returns an
 * ACK per sub-chunk on the path it came from, which gives the LEO selector
 * its completion timestamps (seed 000 §6.2.2) and bounds what a lane has in
 * flight (Hermod priority, digest A6.2 option 3). A send is done when all its
 * sub-chunks are acknowledged (like an RDMA write's completion), so closing a
 * comm never has to wait for data NCCL already saw complete.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fl_errors.h"
#include "fl_log.h"
#include "fl_transport.h"

int fl_params_load(struct fl_params* p);

/* ------------------------------------------------------------- engine */

struct fl_connect_state {
  uint64_t cookie; /* stored in the NCCL-owned handle so repeated connect() calls resume */
  struct fl_handle h;
  int traffic_class;
  int npaths;
  int fds[FL_MAX_PATHS];
  int stage[FL_MAX_PATHS]; /* 0 connecting, 1 sending hello, 2 done */
  uint32_t hello_off[FL_MAX_PATHS];
  uint8_t hello[FL_MAX_PATHS][FL_HELLO_BYTES];
  uint64_t deadline_ns;
  struct fl_connect_state* next;
};

struct fl_engine fl_engine = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int random_bytes(void* buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t r = getrandom((uint8_t*)buf + got, len - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    got += (size_t)r;
  }
  return 0;
}

static void fmt_sockaddr(const struct sockaddr* sa, char* out, size_t outlen) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in* s4 = (const struct sockaddr_in*)sa;
    inet_ntop(AF_INET, &s4->sin_addr, host, sizeof(host));
    port = ntohs(s4->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6* s6 = (const struct sockaddr_in6*)sa;
    inet_ntop(AF_INET6, &s6->sin6_addr, host, sizeof(host));
    port = ntohs(s6->sin6_port);
  }
  snprintf(out, outlen, "%s:%d", host, port);
}

/* FLOWLANE_SOCKET_IFNAME follows NCCL_SOCKET_IFNAME: comma-separated
 * prefixes, "=" for exact names, a leading "^" to exclude. */
static int ifname_selected(const char* spec, const char* name) {
  if (!spec || !*spec) return strncmp(name, "lo", 2) != 0 && strncmp(name, "docker", 6) != 0;
  int exclude = spec[0] == '^';
  if (exclude) spec++;
  int exact = spec[0] == '=';
  if (exact) spec++;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", spec);
  int match = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (exact ? strcmp(name, tok) == 0 : strncmp(name, tok, strlen(tok)) == 0) match = 1;
  }
  return exclude ? !match : match;
}

static int iface_speed(const char* name) {
  char path[128];
  snprintf(path, sizeof(path), "/sys/class/net/%s/speed", name);
  FILE* f = fopen(path, "r");
  int speed = -1;
  if (f) {
    if (fscanf(f, "%d", &speed) != 1) speed = -1;
    fclose(f);
  }
  return speed > 0 ? speed : 10000; /* virtual links report nothing: assume 10 Gb/s */
}

static int find_interfaces(const char* spec, int allow_lo) {
  struct ifaddrs* list = NULL;
  if (getifaddrs(&list) != 0) return 0;
  int n = 0;
  for (struct ifaddrs* ifa = list; ifa && n < FL_MAX_IFACES; ifa = ifa->ifa_next) {
    if (!ifa->ifa_addr || !(ifa->ifa_flags & IFF_UP)) continue;
    int fam = ifa->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    if (fam == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&((struct sockaddr_in6*)ifa->ifa_addr)->sin6_addr)) continue;
    if ((ifa->ifa_flags & IFF_LOOPBACK) && !allow_lo) continue;
    if (!allow_lo || (spec && *spec)) {
      if (!ifname_selected(spec, ifa->ifa_name)) continue;
    } else if (!(ifa->ifa_flags & IFF_LOOPBACK)) {
      continue;
    }
    int dup = 0; /* one address per interface, IPv4 first (getifaddrs lists it first) */
    for (int i = 0; i < n; i++) dup |= strcmp(fl_engine.ifaces[i].name, ifa->ifa_name) == 0;
    if (dup) continue;
    struct fl_iface* it = &fl_engine.ifaces[n++];
    snprintf(it->name, sizeof(it->name), "%s", ifa->ifa_name);
    it->addrlen = fam == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
    memcpy(&it->addr, ifa->ifa_addr, it->addrlen);
    it->speed_mbps = iface_speed(ifa->ifa_name);
  }
  freeifaddrs(list);
  return n;
}

const struct fl_params* fl_get_params(void) { return &fl_engine.params; }

static FILE* g_leo_trace; /* FLOWLANE_NET_LEO_TRACE: per-request choices and outcomes */
static pthread_mutex_t g_leo_trace_lock = PTHREAD_MUTEX_INITIALIZER;

void fl_leo_trace_choice(const struct fl_comm* c, uint64_t size, uint64_t t1, int pi) {
  if (!g_leo_trace) return;
  pthread_mutex_lock(&g_leo_trace_lock);
  fprintf(g_leo_trace, "choose pid=%d comm=%llu sel=%s t1=%llu bytes=%llu path=%d", (int)getpid(),
          (unsigned long long)c->id, fl_selector_name(c->sel.kind), (unsigned long long)t1, (unsigned long long)size, pi);
  for (int p = 0; p < c->sel.npaths; p++) {
    const struct fl_leo_path* st = &c->sel.st[p];
    fprintf(g_leo_trace, " | p%d cost=%.0f bw=%.4f ttr=%.0f q=%.0f khat=%u infl=%d e2e=%.0f intra=%.0f", p,
            st->have_sample ? fl_leo_cost(st, size, t1) : -1.0, fl_leo_bw(st), st->t_tr_ns,
            st->busy_until_ns > t1 ? (double)(st->busy_until_ns - t1) : 0.0, st->khat, st->inflight, st->last_e2e_ns,
            st->last_intra_ns);
  }
  fputc('\n', g_leo_trace);
  fflush(g_leo_trace);
  pthread_mutex_unlock(&g_leo_trace_lock);
}

void fl_leo_trace_done(const struct fl_comm* c, const struct fl_request* r, uint64_t t) {
  if (!g_leo_trace) return;
  pthread_mutex_lock(&g_leo_trace_lock);
  fprintf(g_leo_trace, "done pid=%d comm=%llu path=%d bytes=%llu wait=%llu dwell=%llu e2e=%llu predicted=%.0f chunks=%u\n",
          (int)getpid(), (unsigned long long)c->id, r->ticket.path, (unsigned long long)r->size,
          (unsigned long long)(r->t2_ns - r->ticket.t1_ns), (unsigned long long)r->dwell_ns,
          (unsigned long long)(t - r->ticket.t1_ns), r->ticket.predicted_ns, (unsigned)r->chunks_carved);
  fflush(g_leo_trace);
  pthread_mutex_unlock(&g_leo_trace_lock);
}

ncclResult_t fl_init(ncclDebugLogger_t logger) {
  pthread_mutex_lock(&fl_engine.lock);
  if (logger) fl_logger = logger;
  if (fl_engine.initialized) {
    pthread_mutex_unlock(&fl_engine.lock);
    return ncclSuccess;
  }
  if (fl_params_load(&fl_engine.params) != 0) {
    pthread_mutex_unlock(&fl_engine.lock);
    return ncclInvalidUsage;
  }
  const char* spec = fl_engine.params.ifname_spec;
  /* An explicit spec may name "lo"; without one, loopback is the fallback. */
  fl_engine.n_ifaces = find_interfaces(spec, spec[0] != '\0');
  if (fl_engine.n_ifaces == 0 && spec[0] == '\0') fl_engine.n_ifaces = find_interfaces("", 1);
  if (fl_engine.n_ifaces == 0) {
    FL_WARN("no usable interface matches %s=\"%s\"", FL_ENV_SOCKET_IFNAME, spec);
    pthread_mutex_unlock(&fl_engine.lock);
    return ncclSystemError;
  }
  int pos = 0;
  for (int i = 0; i < fl_engine.n_ifaces; i++)
    pos += snprintf(fl_engine.dev_name + pos, sizeof(fl_engine.dev_name) - (size_t)pos, "%s%s", i ? "+" : "", fl_engine.ifaces[i].name);
  fl_engine.initialized = 1;
  const char* trace = getenv("FLOWLANE_NET_LEO_TRACE"); /* diagnostics: one line per path choice and completion */
  if (trace && *trace && !g_leo_trace) {
    g_leo_trace = fopen(trace, "a");
    if (!g_leo_trace) FL_WARN("FLOWLANE_NET_LEO_TRACE=%s: %s (no trace written)", trace, strerror(errno));
  }
  FL_INFO("using %s (%d interface(s)), %d lane(s), %d path(s)/connection, selector %s, chunk %llu B", fl_engine.dev_name,
          fl_engine.n_ifaces, fl_engine.params.lanes, fl_engine.params.paths ? fl_engine.params.paths : fl_engine.n_ifaces,
          fl_selector_name(fl_engine.params.selector), (unsigned long long)fl_engine.params.chunk_bytes);
  pthread_mutex_unlock(&fl_engine.lock);
  return ncclSuccess;
}

ncclResult_t fl_devices(int* ndev) {
  FL_REQUIRE(ndev != NULL, ncclInternalError);
  *ndev = fl_engine.initialized ? 1 : 0;
  return ncclSuccess;
}

ncclResult_t fl_get_properties(int dev, ncclNetProperties_v11_t* props) {
  if (!fl_engine.initialized || dev != 0 || !props) {
    FL_WARN("getProperties(dev=%d): flowlane exposes one device (0) after init", dev);
    return ncclInvalidArgument;
  }
  memset(props, 0, sizeof(*props));
  props->name = fl_engine.dev_name;
  props->pciPath = NULL; /* virtual aggregate of the selected interfaces */
  props->guid = 0x464c4f574c414e45ull;
  props->ptrSupport = NCCL_PTR_HOST;
  props->regIsGlobal = 0;
  props->forceFlush = 0;
  int speed = 0;
  for (int i = 0; i < fl_engine.n_ifaces; i++) speed += fl_engine.ifaces[i].speed_mbps;
  props->speed = speed;
  props->port = 0;
  props->latency = 0;
  props->maxComms = 65536;
  props->maxRecvs = FL_MAX_RECVS;
  props->netDeviceType = NCCL_NET_DEVICE_HOST;
  props->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION;
  props->vProps.ndevs = 1;
  props->vProps.devs[0] = 0;
  props->maxP2pBytes = NCCL_MAX_NET_SIZE_BYTES;
  props->maxCollBytes = NCCL_MAX_NET_SIZE_BYTES;
  props->maxMultiRequestSize = 1;
  return ncclSuccess;
}

ncclResult_t fl_make_vdevice(int* d, ncclNetVDeviceProps_v11_t* props) {
  FL_REQUIRE(d != NULL && props != NULL, ncclInternalError);
  if (props->ndevs == 1 && props->devs[0] == 0) {
    *d = 0;
    return ncclSuccess;
  }
  FL_WARN("makeVDevice(ndevs=%d): flowlane already aggregates its interfaces into device 0 (multi-path); "
          "merging devices is not supported", props->ndevs);
  return ncclInvalidUsage;
}

/* --------------------------------------------------------- socket setup */

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Lane marking: SO_PRIORITY picks the qdisc band on this host, DSCP carries
 * the class to switches (digest A6.2: "IP_TOS (DSCP<<2) + SO_PRIORITY"); the
 * two follow separate rules (fl_params.c). */
static void set_lane_options(int fd, int family, int lane) {
  int tos = fl_class_dscp(fl_lane_marking_class(lane, fl_engine.params.lanes)) << 2;
  int prio = fl_lane_sopriority(lane, fl_engine.params.lanes);
  int one = 1;
  if (family == AF_INET) {
    if (setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof(tos)) != 0) FL_WARN("IP_TOS=%d failed: %s", tos, strerror(errno));
  } else {
    if (setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, sizeof(tos)) != 0)
      FL_WARN("IPV6_TCLASS=%d failed: %s", tos, strerror(errno));
  }
  /* after IP_TOS, which may reset sk_priority on some kernels */
  if (setsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, sizeof(prio)) != 0)
    FL_WARN("SO_PRIORITY=%d failed: %s", prio, strerror(errno));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  /* A dead host: unacknowledged data times out after TCP_USER_TIMEOUT. An idle comm (a posted receive the sender has
   * not started, a send waiting for its CTS) has none, so keepalive probes start after a quiet timeout and the same
   * user timeout ends the connection when they go unanswered (tcp(7)): the next test()/isend fails. */
  unsigned int user_timeout = (unsigned int)fl_engine.params.timeout_ms;
  int keep_idle_s = fl_engine.params.timeout_ms < 1000 ? 1 : fl_engine.params.timeout_ms / 1000, keep_intvl_s = 1,
      keep_cnt = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &keep_idle_s, sizeof(keep_idle_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &keep_intvl_s, sizeof(keep_intvl_s));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &keep_cnt, sizeof(keep_cnt));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof(user_timeout));
}

static void wire_to_sockaddr(const struct fl_wire_addr* a, struct sockaddr_storage* ss, socklen_t* len) {
  memset(ss, 0, sizeof(*ss));
  if (a->family == 4) {
    struct sockaddr_in* s4 = (struct sockaddr_in*)ss;
    s4->sin_family = AF_INET;
    s4->sin_port = htons(a->port);
    memcpy(&s4->sin_addr, a->addr, 4);
    *len = sizeof(*s4);
  } else {
    struct sockaddr_in6* s6 = (struct sockaddr_in6*)ss;
    s6->sin6_family = AF_INET6;
    s6->sin6_port = htons(a->port);
    memcpy(&s6->sin6_addr, a->addr, 16);
    *len = sizeof(*s6);
  }
}

/* ---------------------------------------------------------------- listen */

ncclResult_t fl_listen(int dev, void* handle, void** listen_comm) {
  FL_REQUIRE(handle != NULL && listen_comm != NULL, ncclInternalError);
  if (!fl_engine.initialized || dev != 0) {
    FL_WARN("listen(dev=%d): flowlane exposes one device (0) after init", dev);
    return ncclInvalidArgument;
  }
  struct fl_listen* l = calloc(1, sizeof(*l));
  if (!l) FL_NO_MEMORY("listen comm");
  for (int i = 0; i < FL_MAX_PENDING_ACCEPTS; i++) l->pend[i].fd = -1;
  if (random_bytes(l->secret, sizeof(l->secret)) != 0) {
    FL_WARN("getrandom failed: %s", strerror(errno));
    free(l);
    return ncclSystemError;
  }
  struct fl_handle h;
  memset(&h, 0, sizeof(h));
  h.version = FL_NET_VERSION;
  memcpy(h.secret, l->secret, sizeof(h.secret));
  for (int i = 0; i < fl_engine.n_ifaces; i++) {
    struct fl_iface* it = &fl_engine.ifaces[i];
    int fam = it->addr.ss_family;
    int fd = socket(fam, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_storage ss;
    memcpy(&ss, &it->addr, it->addrlen);
    if (fam == AF_INET) ((struct sockaddr_in*)&ss)->sin_port = 0;
    else ((struct sockaddr_in6*)&ss)->sin6_port = 0;
    socklen_t sl = it->addrlen;
    if (fd < 0 || bind(fd, (struct sockaddr*)&ss, sl) != 0 || listen(fd, 128) != 0 || set_nonblocking(fd) != 0 ||
        getsockname(fd, (struct sockaddr*)&ss, &sl) != 0) {
      FL_WARN("listen on %s failed: %s", it->name, strerror(errno));
      if (fd >= 0) close(fd);
      for (int j = 0; j < l->nfds; j++) close(l->fds[j]);
      free(l);
      return ncclSystemError;
    }
    l->fds[l->nfds++] = fd;
    struct fl_wire_addr* wa = &h.addrs[h.naddrs++];
    if (fam == AF_INET) {
      wa->family = 4;
      wa->port = ntohs(((struct sockaddr_in*)&ss)->sin_port);
      memcpy(wa->addr, &((struct sockaddr_in*)&ss)->sin_addr, 4);
    } else {
      wa->family = 6;
      wa->port = ntohs(((struct sockaddr_in6*)&ss)->sin6_port);
      memcpy(wa->addr, &((struct sockaddr_in6*)&ss)->sin6_addr, 16);
    }
  }
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  fl_handle_encode((uint8_t*)handle, &h);
  *listen_comm = l;
  return ncclSuccess;
}

ncclResult_t fl_close_listen(void* listen_comm) {
  struct fl_listen* l = listen_comm;
  if (!l) return ncclSuccess;
  for (int i = 0; i < l->nfds; i++) close(l->fds[i]);
  for (int i = 0; i < FL_MAX_PENDING_ACCEPTS; i++)
    if (l->pend[i].fd >= 0) close(l->pend[i].fd);
  for (int g = 0; g < FL_MAX_HALF_OPEN; g++)
    if (l->groups[g].used)
      for (int p = 0; p < l->groups[g].npaths; p++)
        if (l->groups[g].fds[p] >= 0) close(l->groups[g].fds[p]);
  if (l->refused) FL_INFO("listen comm closed; it refused %llu connection(s)", (unsigned long long)l->refused);
  free(l);
  return ncclSuccess;
}

/* ---------------------------------------------------------------- comms */

static struct fl_comm* comm_new(int is_send, int traffic_class, int npaths) {
  struct fl_comm* c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->is_send = is_send;
  c->traffic_class = traffic_class;
  c->lane = fl_lane_of_class(traffic_class, fl_engine.params.lanes);
  c->npaths = npaths;
  c->id = ++fl_engine.next_comm_id;
  pthread_mutex_init(&c->lock, NULL);
  for (int p = 0; p < FL_MAX_PATHS; p++) c->paths[p].fd = -1;
  fl_selector_init(&c->sel, fl_engine.params.selector, npaths);
  c->last_progress_ns = fl_now_ns();
  return c;
}

static void comm_link(struct fl_comm* c) {
  c->prev = NULL;
  c->next = fl_engine.lanes[c->lane];
  if (c->next) c->next->prev = c;
  fl_engine.lanes[c->lane] = c;
}

void fl_comm_unlink(struct fl_comm* c) {
  if (c->prev) c->prev->next = c->next;
  else fl_engine.lanes[c->lane] = c->next;
  if (c->next) c->next->prev = c->prev;
}

void fl_comm_free(struct fl_comm* c) {
  for (int p = 0; p < c->npaths; p++) {
    if (c->paths[p].fd >= 0) close(c->paths[p].fd);
    free(c->paths[p].ctl);
  }
  pthread_mutex_destroy(&c->lock);
  free(c);
}

void fl_comm_fail(struct fl_comm* c, int err, const char* fmt, ...) {
  if (c->failed) return;
  c->failed = err < 0 ? err : -EIO;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->errmsg, sizeof(c->errmsg), fmt, ap);
  va_end(ap);
  /* Logged as INFO here; the WARN comes when the failure reaches NCCL
   * (test/isend/irecv), so a peer closing an idle comm stays quiet. */
  FL_INFO("%s comm %llu (class %d): %s", c->is_send ? "send" : "recv", (unsigned long long)c->id, c->traffic_class,
          c->errmsg);
}

/* --------------------------------------------------------------- connect */

static struct fl_connect_state* connect_lookup(uint64_t cookie) {
  for (struct fl_connect_state* s = fl_engine.connecting; s; s = s->next)
    if (s->cookie == cookie) return s;
  return NULL;
}

static void connect_drop(struct fl_connect_state* st, int close_fds) {
  struct fl_connect_state** pp = &fl_engine.connecting;
  while (*pp && *pp != st) pp = &(*pp)->next;
  if (*pp) *pp = st->next;
  if (close_fds)
    for (int p = 0; p < st->npaths; p++)
      if (st->fds[p] >= 0) close(st->fds[p]);
  free(st);
}

/* Starts the connect a handle describes: 0, or a negative errno (fl_errors.h). */
static int connect_start(uint8_t* handle, int traffic_class, struct fl_connect_state** out) {
  char err[160];
  struct fl_connect_state* st = calloc(1, sizeof(*st));
  if (!st) {
    FL_WARN("connect: out of memory (connect state)");
    return -ENOMEM;
  }
  if (fl_handle_decode(handle, NCCL_NET_HANDLE_MAXSIZE, &st->h, err, sizeof(err)) != 0) {
    FL_WARN("connect: invalid handle: %s", err);
    free(st);
    return -EINVAL;
  }
  st->traffic_class = traffic_class;
  st->npaths = fl_engine.params.paths ? fl_engine.params.paths : st->h.naddrs;
  if (st->npaths > FL_MAX_PATHS) st->npaths = FL_MAX_PATHS;
  uint64_t conn_id;
  if (random_bytes(&conn_id, sizeof(conn_id)) != 0 || random_bytes(&st->cookie, sizeof(st->cookie)) != 0) {
    int e = -fl_neg_errno();
    FL_WARN("connect: getrandom failed: %s", strerror(e));
    free(st);
    return -e;
  }
  st->cookie |= 1; /* 0 means "no connect in progress" */
  st->deadline_ns = fl_now_ns() + (uint64_t)fl_engine.params.timeout_ms * 1000000ull;
  int lane = fl_lane_of_class(traffic_class, fl_engine.params.lanes);
  for (int p = 0; p < st->npaths; p++) st->fds[p] = -1;
  for (int p = 0; p < st->npaths; p++) {
    /* Path p goes to the listener's address p mod naddrs: one path per
     * interface by default, extra paths add source ports on the same one. */
    struct sockaddr_storage ss;
    socklen_t sl;
    wire_to_sockaddr(&st->h.addrs[p % st->h.naddrs], &ss, &sl);
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      int e = -fl_neg_errno();
      FL_WARN("connect: socket() failed: %s", strerror(e));
      connect_drop(st, 1);
      return -e;
    }
    st->fds[p] = fd;
    set_lane_options(fd, ss.ss_family, lane);
    if (connect(fd, (struct sockaddr*)&ss, sl) != 0 && errno != EINPROGRESS) {
      int e = -fl_neg_errno();
      char a[80];
      fmt_sockaddr((struct sockaddr*)&ss, a, sizeof(a));
      FL_WARN("connect to %s failed: %s", a, strerror(e));
      connect_drop(st, 1);
      return -e;
    }
    struct fl_hello hello = {.version = FL_NET_VERSION, .conn_id = conn_id, .path_index = (uint16_t)p,
                             .npaths = (uint16_t)st->npaths, .traffic_class = (uint8_t)traffic_class};
    memcpy(hello.secret, st->h.secret, FL_SECRET_BYTES);
    fl_hello_encode(st->hello[p], &hello);
  }
  st->next = fl_engine.connecting;
  fl_engine.connecting = st;
  *out = st;
  return 0;
}

/* Non-blocking: returns ncclSuccess with *send_comm NULL until every path is
 * connected and has sent its hello (NCCL calls connect() again). */
ncclResult_t fl_connect(int dev, int traffic_class, void* handle, void** send_comm) {
  FL_REQUIRE(handle != NULL && send_comm != NULL, ncclInternalError);
  *send_comm = NULL;
  if (!fl_engine.initialized || dev != 0) {
    FL_WARN("connect(dev=%d): flowlane exposes one device (0) after init", dev);
    return ncclInvalidArgument;
  }
  if (traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF) traffic_class = fl_engine.params.default_class;
  if (traffic_class < 0 || traffic_class >= FL_NUM_CLASSES) {
    FL_WARN("connect: trafficClass %d is not a flowlane class (0..%d, or -1 for %s=%d)", traffic_class,
            FL_NUM_CLASSES - 1, FL_ENV_TRAFFIC_CLASS, fl_engine.params.default_class);
    return ncclInvalidUsage;
  }
  pthread_mutex_lock(&fl_engine.lock);
  uint8_t* hb = handle;
  uint64_t cookie;
  memcpy(&cookie, hb + FL_HANDLE_STATE_OFFSET, sizeof(cookie));
  /* The cookie is only a lookup key into our own registry, never dereferenced. */
  struct fl_connect_state* st = cookie ? connect_lookup(cookie) : NULL;
  int err = 0; /* a negative errno ends the connect (fl_errors.h) */
  if (!st) {
    err = connect_start(hb, traffic_class, &st);
    if (err) goto out;
    memcpy(hb + FL_HANDLE_STATE_OFFSET, &st->cookie, sizeof(st->cookie));
  }
  int all_done = 1;
  for (int p = 0; p < st->npaths; p++) {
    int fd = st->fds[p];
    if (st->stage[p] == 0) {
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      if (poll(&pf, 1, 0) > 0) {
        int soerr = 0;
        socklen_t sl = sizeof(soerr);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        if (soerr) {
          FL_WARN("connect path %d failed: %s", p, strerror(soerr));
          err = -soerr;
          break;
        }
        st->stage[p] = 1;
      }
    }
    if (st->stage[p] == 1) {
      ssize_t w = send(fd, st->hello[p] + st->hello_off[p], FL_HELLO_BYTES - st->hello_off[p], MSG_NOSIGNAL);
      if (w > 0) st->hello_off[p] += (uint32_t)w;
      else if (w < 0 && !fl_io_would_block()) {
        err = fl_neg_errno();
        FL_WARN("connect path %d: sending hello failed: %s", p, strerror(-err));
        break;
      }
      if (st->hello_off[p] == FL_HELLO_BYTES) st->stage[p] = 2;
    }
    if (st->stage[p] != 2) all_done = 0;
  }
  if (!err && !all_done && fl_now_ns() > st->deadline_ns) {
    FL_WARN("connect did not complete within %d ms (%s)", fl_engine.params.timeout_ms, FL_ENV_TIMEOUT_MS);
    err = -ETIMEDOUT;
  }
  if (err) {
    memset(hb + FL_HANDLE_STATE_OFFSET, 0, sizeof(uint64_t));
    connect_drop(st, 1);
    goto out;
  }
  if (all_done) {
    struct fl_comm* c = comm_new(1, st->traffic_class, st->npaths);
    if (!c) {
      FL_WARN("connect: out of memory (send comm)");
      err = -ENOMEM;
      connect_drop(st, 1);
      goto out;
    }
    for (int p = 0; p < st->npaths; p++) c->paths[p].fd = st->fds[p];
    memset(hb + FL_HANDLE_STATE_OFFSET, 0, sizeof(uint64_t));
    connect_drop(st, 0);
    comm_link(c);
    *send_comm = c;
    FL_INFO("send comm %llu connected: class %d lane %d, %d path(s)", (unsigned long long)c->id, c->traffic_class,
            c->lane, c->npaths);
  }
out:
  pthread_mutex_unlock(&fl_engine.lock);
  return fl_retval(err);
}

/* ---------------------------------------------------------------- accept */

/* Refusals are logged with a rate limit shared by all listen comms: a
 * stranger can open connections faster than anyone reads logs. */
static struct {
  uint64_t window_start_ns;
  int logged;
  uint64_t suppressed;
} refusal_log;

static void log_refusal(const char* peer, const char* why) {
  uint64_t t = fl_now_ns();
  if (refusal_log.window_start_ns == 0 || t - refusal_log.window_start_ns >= FL_REFUSE_LOG_WINDOW_MS * 1000000ull) {
    if (refusal_log.suppressed)
      FL_WARN("refused %llu more connection(s) in %d s without logging each (at most %d lines per %d s)",
              (unsigned long long)refusal_log.suppressed, FL_REFUSE_LOG_WINDOW_MS / 1000, FL_REFUSE_LOG_BURST,
              FL_REFUSE_LOG_WINDOW_MS / 1000);
    refusal_log.window_start_ns = t;
    refusal_log.logged = 0;
    refusal_log.suppressed = 0;
  }
  if (refusal_log.logged < FL_REFUSE_LOG_BURST) {
    refusal_log.logged++;
    FL_WARN("refused connection from %s: %s", peer, why);
  } else {
    refusal_log.suppressed++;
  }
}

static void refuse(struct fl_listen* l, struct fl_pending_accept* pa, const char* why) {
  log_refusal(pa->peer, why);
  l->refused++;
  close(pa->fd);
  pa->fd = -1;
}

static void group_drop(struct fl_listen* l, struct fl_accept_group* g, const char* why) {
  char msg[160];
  snprintf(msg, sizeof(msg), "multi-path connection with %d of %d paths: %s", g->have, g->npaths, why);
  log_refusal(g->peer, msg);
  l->refused++;
  for (int p = 0; p < FL_MAX_PATHS; p++)
    if (g->fds[p] >= 0) close(g->fds[p]);
  g->used = 0;
}

static uint64_t capped_ms(int ms) {
  return (uint64_t)(ms < fl_engine.params.timeout_ms ? ms : fl_engine.params.timeout_ms) * 1000000ull;
}

/* An authenticated path joins the group of its connection; a group with all
 * its paths is ready to become a recv comm. */
static void group_join(struct fl_listen* l, struct fl_pending_accept* pa, const struct fl_hello* h, uint64_t now) {
  struct fl_accept_group* g = NULL;
  for (int k = 0; k < FL_MAX_HALF_OPEN && !g; k++)
    if (l->groups[k].used && l->groups[k].conn_id == h->conn_id) g = &l->groups[k];
  if (g && (g->npaths != h->npaths || g->fds[h->path_index] >= 0)) {
    refuse(l, pa, "path announcement conflicts with an earlier one of the same connection");
    return;
  }
  if (!g) {
    struct fl_accept_group* oldest = NULL;
    for (int k = 0; k < FL_MAX_HALF_OPEN && !g; k++) {
      struct fl_accept_group* q = &l->groups[k];
      if (!q->used) g = q;
      else if (q->have < q->npaths && (!oldest || q->created_ns < oldest->created_ns)) oldest = q;
    }
    if (!g && !oldest) {
      refuse(l, pa, "every multi-path group is complete and waits for accept()");
      return;
    }
    if (!g) {
      g = oldest;
      group_drop(l, g, "evicted, the oldest of too many half-open connections");
    }
    memset(g, 0, sizeof(*g));
    g->used = 1;
    g->conn_id = h->conn_id;
    g->npaths = h->npaths;
    g->traffic_class = h->traffic_class;
    g->created_ns = now;
    g->deadline_ns = now + capped_ms(FL_HELLO_TIMEOUT_MS);
    snprintf(g->peer, sizeof(g->peer), "%s", pa->peer);
    for (int p = 0; p < FL_MAX_PATHS; p++) g->fds[p] = -1;
  }
  g->fds[h->path_index] = pa->fd;
  g->have++;
  pa->fd = -1;
}

/* Read what pending sockets sent; enforce the first-byte and hello deadlines;
 * move complete, authentic hellos into their group. */
static void pending_poll(struct fl_listen* l, uint64_t now) {
  for (int s = 0; s < FL_MAX_PENDING_ACCEPTS; s++) {
    struct fl_pending_accept* pa = &l->pend[s];
    if (pa->fd < 0) continue;
    ssize_t r = recv(pa->fd, pa->buf + pa->got, FL_HELLO_BYTES - pa->got, 0);
    if (r == 0) {
      refuse(l, pa, "closed before completing the handshake");
      continue;
    }
    if (r < 0) {
      char why[96];
      if (!fl_io_would_block()) {
        refuse(l, pa, strerror(errno));
      } else if (pa->got == 0 && now > pa->first_byte_deadline_ns) {
        snprintf(why, sizeof(why), "no byte within %llu ms", (unsigned long long)(capped_ms(FL_FIRST_BYTE_MS) / 1000000));
        refuse(l, pa, why);
      } else if (now > pa->deadline_ns) {
        snprintf(why, sizeof(why), "no complete handshake within %llu ms",
                 (unsigned long long)(capped_ms(FL_HELLO_TIMEOUT_MS) / 1000000));
        refuse(l, pa, why);
      }
      continue;
    }
    pa->got += (uint32_t)r;
    if (pa->got < FL_HELLO_BYTES) continue;
    struct fl_hello h;
    char err[160];
    if (fl_hello_decode(pa->buf, pa->got, &h, err, sizeof(err)) != 0 ||
        fl_hello_accept(&h, l->secret, err, sizeof(err)) != 0) {
      refuse(l, pa, err);
      continue;
    }
    group_join(l, pa, &h, now);
  }
}

static struct fl_pending_accept* pending_slot(struct fl_listen* l, uint64_t now) {
  for (int s = 0; s < FL_MAX_PENDING_ACCEPTS; s++)
    if (l->pend[s].fd < 0) return &l->pend[s];
  pending_poll(l, now); /* a finished hello frees its slot */
  struct fl_pending_accept* oldest = NULL;
  for (int s = 0; s < FL_MAX_PENDING_ACCEPTS; s++) {
    if (l->pend[s].fd < 0) return &l->pend[s];
    if (!oldest || l->pend[s].accepted_ns < oldest->accepted_ns) oldest = &l->pend[s];
  }
  /* Evict the oldest: a genuine connector sends its hello right after
   * connecting, so the socket that waited longest is the likeliest stranger,
   * and a flood can no longer lock the genuine peer out. */
  char why[96];
  snprintf(why, sizeof(why), "evicted, the oldest of %d unauthenticated connections", FL_MAX_PENDING_ACCEPTS);
  refuse(l, oldest, why);
  return oldest;
}

/* Non-blocking: accepts sockets, reads and checks hellos, groups paths by
 * conn_id; returns a recv comm once every path of one connection arrived. */
ncclResult_t fl_accept(void* listen_comm, void** recv_comm) {
  struct fl_listen* l = listen_comm;
  FL_REQUIRE(l != NULL && recv_comm != NULL, ncclInternalError);
  *recv_comm = NULL;
  pthread_mutex_lock(&fl_engine.lock);
  uint64_t now = fl_now_ns();
  for (int k = 0; k < FL_MAX_HALF_OPEN; k++) {
    struct fl_accept_group* g = &l->groups[k];
    if (g->used && g->have < g->npaths && now > g->deadline_ns) group_drop(l, g, "the other paths did not arrive in time");
  }
  pending_poll(l, now); /* deadlines first, so expired strangers make room */
  for (int i = 0; i < l->nfds; i++) {
    for (int k = 0; k < FL_ACCEPTS_PER_CALL; k++) {
      struct sockaddr_storage ss;
      socklen_t sl = sizeof(ss);
      int fd = accept4(l->fds[i], (struct sockaddr*)&ss, &sl, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) break;
      struct fl_pending_accept* pa = pending_slot(l, now);
      memset(pa, 0, sizeof(*pa));
      pa->fd = fd;
      pa->accepted_ns = fl_now_ns();
      pa->first_byte_deadline_ns = now + capped_ms(FL_FIRST_BYTE_MS);
      pa->deadline_ns = now + capped_ms(FL_HELLO_TIMEOUT_MS);
      fmt_sockaddr((struct sockaddr*)&ss, pa->peer, sizeof(pa->peer));
    }
  }
  pending_poll(l, now);
  struct fl_comm* done = NULL;
  for (int k = 0; k < FL_MAX_HALF_OPEN && !done; k++) {
    struct fl_accept_group* g = &l->groups[k];
    if (!g->used || g->have < g->npaths) continue;
    struct fl_comm* c = comm_new(0, g->traffic_class, g->npaths);
    if (!c) break;
    for (int p = 0; p < g->npaths; p++) {
      c->paths[p].fd = g->fds[p];
      struct sockaddr_storage ss;
      socklen_t sl = sizeof(ss);
      getsockname(g->fds[p], (struct sockaddr*)&ss, &sl);
      set_lane_options(g->fds[p], ss.ss_family, c->lane); /* CTS/ACK travel in the same lane */
    }
    g->used = 0;
    comm_link(c);
    done = c;
    FL_INFO("recv comm %llu accepted: class %d lane %d, %d path(s)", (unsigned long long)c->id, c->traffic_class,
            c->lane, c->npaths);
  }
  pthread_mutex_unlock(&fl_engine.lock);
  *recv_comm = done;
  return ncclSuccess;
}

/* --------------------------------------------------------------- memory */

struct fl_mr {
  uint64_t magic;
  void* data;
  size_t size;
};
#define FL_MR_MAGIC 0x464c4d52464c4d52ull

ncclResult_t fl_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle) {
  FL_REQUIRE(comm != NULL && mhandle != NULL, ncclInternalError);
  if (type != NCCL_PTR_HOST) {
    FL_WARN("regMr(type=%d): flowlane transports host memory only (ptrSupport=NCCL_PTR_HOST); "
            "NCCL must stage GPU buffers through host memory", type);
    return ncclInternalError;
  }
  struct fl_mr* mr = malloc(sizeof(*mr));
  if (!mr) FL_NO_MEMORY("memory registration");
  mr->magic = FL_MR_MAGIC;
  mr->data = data;
  mr->size = size;
  *mhandle = mr;
  return ncclSuccess;
}

ncclResult_t fl_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle) {
  (void)offset;
  (void)fd;
  if (type != NCCL_PTR_HOST) {
    FL_WARN("regMrDmaBuf(type=%d): DMA-BUF/CUDA registration is not supported; flowlane moves host memory only", type);
    return ncclInternalError;
  }
  return fl_reg_mr(comm, data, size, type, mhandle);
}

ncclResult_t fl_dereg_mr(void* comm, void* mhandle) {
  (void)comm;
  struct fl_mr* mr = mhandle;
  if (!mr) return ncclSuccess;
  if (mr->magic != FL_MR_MAGIC) {
    FL_WARN("deregMr: %p is not a flowlane memory handle", mhandle);
    return ncclInternalError;
  }
  mr->magic = 0;
  free(mr);
  return ncclSuccess;
}

