/*
 * fl_transport.c - flowlane's TCP transport: connection setup with an
 * authenticated handshake, priority lanes, multi-path sub-chunking, and the
 * progress engine behind isend/irecv/test.
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
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "fl_core.h"
#include "fl_errors.h"
#include "fl_log.h"

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

static struct {
  pthread_mutex_t lock;
  int initialized;
  struct fl_params params;
  struct fl_iface ifaces[FL_MAX_IFACES];
  int n_ifaces;
  struct fl_comm* lanes[FL_NUM_CLASSES]; /* comms by lane, highest priority first */
  struct fl_connect_state* connecting;
  uint64_t next_comm_id;
  _Atomic int lane_pending[FL_NUM_CLASSES];           /* send comms per lane with data queued */
  _Atomic uint64_t lane_last_sent_ns[FL_NUM_CLASSES]; /* last sub-chunk started per lane */
  _Atomic int ctl_backlog;                            /* recv comms whose control bytes wait for their socket */
  char dev_name[64];
} E = {.lock = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

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
    for (int i = 0; i < n; i++) dup |= strcmp(E.ifaces[i].name, ifa->ifa_name) == 0;
    if (dup) continue;
    struct fl_iface* it = &E.ifaces[n++];
    snprintf(it->name, sizeof(it->name), "%s", ifa->ifa_name);
    it->addrlen = fam == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
    memcpy(&it->addr, ifa->ifa_addr, it->addrlen);
    it->speed_mbps = iface_speed(ifa->ifa_name);
  }
  freeifaddrs(list);
  return n;
}

const struct fl_params* fl_get_params(void) { return &E.params; }

static FILE* g_leo_trace; /* FLOWLANE_NET_LEO_TRACE: per-request choices and outcomes */
static pthread_mutex_t g_leo_trace_lock = PTHREAD_MUTEX_INITIALIZER;

static void leo_trace_choice(const struct fl_comm* c, uint64_t size, uint64_t t1, int pi) {
  if (!g_leo_trace) return;
  pthread_mutex_lock(&g_leo_trace_lock);
  fprintf(g_leo_trace, "choose pid=%d comm=%llu sel=%s t1=%llu bytes=%llu path=%d", (int)getpid(),
          (unsigned long long)c->id, fl_selector_name(c->sel.kind), (unsigned long long)t1, (unsigned long long)size, pi);
  for (int p = 0; p < c->sel.npaths; p++) {
    const struct fl_leo_path* st = &c->sel.st[p];
    fprintf(g_leo_trace, " | p%d cost=%.0f bw=%.4f ttr=%.0f q=%.0f khat=%u infl=%d e2e=%.0f", p,
            st->have_sample ? fl_leo_cost(st, size, t1) : -1.0, fl_leo_bw(st), st->t_tr_ns,
            st->busy_until_ns > t1 ? (double)(st->busy_until_ns - t1) : 0.0, st->khat, st->inflight, st->last_e2e_ns);
  }
  fputc('\n', g_leo_trace);
  fflush(g_leo_trace);
  pthread_mutex_unlock(&g_leo_trace_lock);
}

static void leo_trace_done(const struct fl_comm* c, const struct fl_request* r, uint64_t t) {
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
  pthread_mutex_lock(&E.lock);
  if (logger) fl_logger = logger;
  if (E.initialized) {
    pthread_mutex_unlock(&E.lock);
    return ncclSuccess;
  }
  if (fl_params_load(&E.params) != 0) {
    pthread_mutex_unlock(&E.lock);
    return ncclInvalidUsage;
  }
  const char* spec = E.params.ifname_spec;
  /* An explicit spec may name "lo"; without one, loopback is the fallback. */
  E.n_ifaces = find_interfaces(spec, spec[0] != '\0');
  if (E.n_ifaces == 0 && spec[0] == '\0') E.n_ifaces = find_interfaces("", 1);
  if (E.n_ifaces == 0) {
    FL_WARN("no usable interface matches %s=\"%s\"", FL_ENV_SOCKET_IFNAME, spec);
    pthread_mutex_unlock(&E.lock);
    return ncclSystemError;
  }
  int pos = 0;
  for (int i = 0; i < E.n_ifaces; i++)
    pos += snprintf(E.dev_name + pos, sizeof(E.dev_name) - (size_t)pos, "%s%s", i ? "+" : "", E.ifaces[i].name);
  E.initialized = 1;
  const char* trace = getenv("FLOWLANE_NET_LEO_TRACE"); /* diagnostics: one line per path choice and completion */
  if (trace && *trace && !g_leo_trace) {
    g_leo_trace = fopen(trace, "a");
    if (!g_leo_trace) FL_WARN("FLOWLANE_NET_LEO_TRACE=%s: %s (no trace written)", trace, strerror(errno));
  }
  FL_INFO("using %s (%d interface(s)), %d lane(s), %d path(s)/connection, selector %s, chunk %llu B", E.dev_name,
          E.n_ifaces, E.params.lanes, E.params.paths ? E.params.paths : E.n_ifaces,
          fl_selector_name(E.params.selector), (unsigned long long)E.params.chunk_bytes);
  pthread_mutex_unlock(&E.lock);
  return ncclSuccess;
}

ncclResult_t fl_devices(int* ndev) {
  FL_REQUIRE(ndev != NULL, ncclInternalError);
  *ndev = E.initialized ? 1 : 0;
  return ncclSuccess;
}

ncclResult_t fl_get_properties(int dev, ncclNetProperties_v11_t* props) {
  if (!E.initialized || dev != 0 || !props) {
    FL_WARN("getProperties(dev=%d): flowlane exposes one device (0) after init", dev);
    return ncclInvalidArgument;
  }
  memset(props, 0, sizeof(*props));
  props->name = E.dev_name;
  props->pciPath = NULL; /* virtual aggregate of the selected interfaces */
  props->guid = 0x464c4f574c414e45ull;
  props->ptrSupport = NCCL_PTR_HOST;
  props->regIsGlobal = 0;
  props->forceFlush = 0;
  int speed = 0;
  for (int i = 0; i < E.n_ifaces; i++) speed += E.ifaces[i].speed_mbps;
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

static int io_would_block(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

static int set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL);
  return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* Lane marking: SO_PRIORITY picks the qdisc band on this host, DSCP carries
 * the class to switches (digest A6.2: "IP_TOS (DSCP<<2) + SO_PRIORITY"). */
static void set_lane_options(int fd, int family, int lane) {
  int cls = fl_lane_marking_class(lane, E.params.lanes);
  int tos = fl_class_dscp(cls) << 2;
  int prio = fl_class_sopriority(cls);
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
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  unsigned int user_timeout = (unsigned int)E.params.timeout_ms; /* dead host: unacked data times out */
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
  if (!E.initialized || dev != 0) {
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
  for (int i = 0; i < E.n_ifaces; i++) {
    struct fl_iface* it = &E.ifaces[i];
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
  c->lane = fl_lane_of_class(traffic_class, E.params.lanes);
  c->npaths = npaths;
  c->id = ++E.next_comm_id;
  pthread_mutex_init(&c->lock, NULL);
  for (int p = 0; p < FL_MAX_PATHS; p++) c->paths[p].fd = -1;
  fl_selector_init(&c->sel, E.params.selector, npaths);
  c->last_progress_ns = now_ns();
  return c;
}

static void comm_link(struct fl_comm* c) {
  c->prev = NULL;
  c->next = E.lanes[c->lane];
  if (c->next) c->next->prev = c;
  E.lanes[c->lane] = c;
}

static void comm_unlink(struct fl_comm* c) {
  if (c->prev) c->prev->next = c->next;
  else E.lanes[c->lane] = c->next;
  if (c->next) c->next->prev = c->prev;
}

static void comm_free(struct fl_comm* c) {
  for (int p = 0; p < c->npaths; p++) {
    if (c->paths[p].fd >= 0) close(c->paths[p].fd);
    free(c->paths[p].ctl);
  }
  pthread_mutex_destroy(&c->lock);
  free(c);
}

/* The comm's first failure ends it: err (a negative errno, fl_errors.h) is what test/isend/irecv return, translated. */
static void comm_fail(struct fl_comm* c, int err, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
static void comm_fail(struct fl_comm* c, int err, const char* fmt, ...) {
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
  for (struct fl_connect_state* s = E.connecting; s; s = s->next)
    if (s->cookie == cookie) return s;
  return NULL;
}

static void connect_drop(struct fl_connect_state* st, int close_fds) {
  struct fl_connect_state** pp = &E.connecting;
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
  st->npaths = E.params.paths ? E.params.paths : st->h.naddrs;
  if (st->npaths > FL_MAX_PATHS) st->npaths = FL_MAX_PATHS;
  uint64_t conn_id;
  if (random_bytes(&conn_id, sizeof(conn_id)) != 0 || random_bytes(&st->cookie, sizeof(st->cookie)) != 0) {
    int e = -fl_neg_errno();
    FL_WARN("connect: getrandom failed: %s", strerror(e));
    free(st);
    return -e;
  }
  st->cookie |= 1; /* 0 means "no connect in progress" */
  st->deadline_ns = now_ns() + (uint64_t)E.params.timeout_ms * 1000000ull;
  int lane = fl_lane_of_class(traffic_class, E.params.lanes);
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
  st->next = E.connecting;
  E.connecting = st;
  *out = st;
  return 0;
}

/* Non-blocking: returns ncclSuccess with *send_comm NULL until every path is
 * connected and has sent its hello (NCCL calls connect() again). */
ncclResult_t fl_connect(int dev, int traffic_class, void* handle, void** send_comm) {
  FL_REQUIRE(handle != NULL && send_comm != NULL, ncclInternalError);
  *send_comm = NULL;
  if (!E.initialized || dev != 0) {
    FL_WARN("connect(dev=%d): flowlane exposes one device (0) after init", dev);
    return ncclInvalidArgument;
  }
  if (traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF) traffic_class = E.params.default_class;
  if (traffic_class < 0 || traffic_class >= FL_NUM_CLASSES) {
    FL_WARN("connect: trafficClass %d is not a flowlane class (0..%d, or -1 for %s=%d)", traffic_class,
            FL_NUM_CLASSES - 1, FL_ENV_TRAFFIC_CLASS, E.params.default_class);
    return ncclInvalidUsage;
  }
  pthread_mutex_lock(&E.lock);
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
      else if (w < 0 && !io_would_block()) {
        err = fl_neg_errno();
        FL_WARN("connect path %d: sending hello failed: %s", p, strerror(-err));
        break;
      }
      if (st->hello_off[p] == FL_HELLO_BYTES) st->stage[p] = 2;
    }
    if (st->stage[p] != 2) all_done = 0;
  }
  if (!err && !all_done && now_ns() > st->deadline_ns) {
    FL_WARN("connect did not complete within %d ms (%s)", E.params.timeout_ms, FL_ENV_TIMEOUT_MS);
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
  pthread_mutex_unlock(&E.lock);
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
  uint64_t t = now_ns();
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
  return (uint64_t)(ms < E.params.timeout_ms ? ms : E.params.timeout_ms) * 1000000ull;
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
      if (!io_would_block()) {
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
  pthread_mutex_lock(&E.lock);
  uint64_t now = now_ns();
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
      pa->accepted_ns = now_ns();
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
  pthread_mutex_unlock(&E.lock);
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

/* -------------------------------------------------------------- progress */

static struct fl_request* req_alloc(struct fl_comm* c, int kind) {
  for (int i = 0; i < FL_REQS_PER_COMM; i++) {
    if (c->reqs[i].kind == FL_REQ_FREE) {
      struct fl_request* r = &c->reqs[i];
      memset(r, 0, sizeof(*r));
      r->kind = kind;
      r->comm = c;
      return r;
    }
  }
  return NULL;
}

/* Queue a control frame (+payload) on a receiver path. */
static int ctl_push(struct fl_comm* c, struct fl_path* p, const struct fl_frame* f, const uint8_t* payload) {
  uint64_t need = FL_FRAME_HDR_BYTES + f->length;
  if (p->ctl_off > 0 && p->ctl_off == p->ctl_len) p->ctl_off = p->ctl_len = 0;
  if (p->ctl_len + need > p->ctl_cap) {
    if (p->ctl_off > 0) { /* compact */
      memmove(p->ctl, p->ctl + p->ctl_off, p->ctl_len - p->ctl_off);
      p->ctl_len -= p->ctl_off;
      p->ctl_off = 0;
    }
    if (p->ctl_len + need > p->ctl_cap) {
      uint64_t cap = p->ctl_cap ? p->ctl_cap * 2 : 4096;
      while (cap < p->ctl_len + need) cap *= 2;
      if (cap > (64u << 20)) {
        comm_fail(c, -EREMOTEIO, "control queue above 64 MiB: peer is not reading");
        return -1;
      }
      uint8_t* nb = realloc(p->ctl, cap);
      if (!nb) {
        comm_fail(c, -ENOMEM, "out of memory for the control queue");
        return -1;
      }
      p->ctl = nb;
      p->ctl_cap = cap;
    }
  }
  fl_frame_encode(p->ctl + p->ctl_len, f);
  if (f->length) memcpy(p->ctl + p->ctl_len + FL_FRAME_HDR_BYTES, payload, f->length);
  p->ctl_len += need;
  return 0;
}

static void ctl_flush(struct fl_comm* c, struct fl_path* p, int pi) {
  while (p->ctl_off < p->ctl_len) {
    ssize_t w = send(p->fd, p->ctl + p->ctl_off, p->ctl_len - p->ctl_off, MSG_NOSIGNAL);
    if (w < 0) {
      if (!io_would_block()) comm_fail(c, fl_neg_errno(), "path %d: send failed: %s (peer gone?)", pi, strerror(errno));
      return;
    }
    p->ctl_off += (uint64_t)w;
    c->last_progress_ns = now_ns();
  }
}

static void recv_request_check_done(struct fl_request* r) {
  for (int i = 0; i < r->n; i++)
    if (!r->known[i] || r->received[i] != r->totals[i]) return;
  r->done = 1;
  r->comm->slots[r->seq % FL_RECV_SLOTS] = NULL;
}

/* A full frame header arrived on path pi: validate it against our state. */
static int on_frame_header(struct fl_comm* c, struct fl_path* p, int pi) {
  char err[200];
  struct fl_frame* f = &p->in_frame;
  if (fl_frame_decode(p->in_hdr, FL_FRAME_HDR_BYTES, f, err, sizeof(err)) != 0) {
    comm_fail(c, -EPROTO, "path %d: malformed frame from peer: %s", pi, err);
    return -1;
  }
  p->in_got = 0;
  p->in_req = NULL;
  if (c->is_send) {
    if (f->type == FL_FRAME_DATA) {
      comm_fail(c, -EPROTO, "path %d: peer sent DATA to a send comm", pi);
      return -1;
    }
    if (f->type == FL_FRAME_ACK) {
      if (p->ring_count == 0 || p->ring[p->ring_head].id != f->seq) {
        comm_fail(c, -EPROTO, "path %d: ACK for chunk %u does not match the oldest unacknowledged chunk", pi, f->seq);
        return -1;
      }
      struct fl_chunk_rec* rec = &p->ring[p->ring_head];
      c->unacked_bytes -= rec->bytes;
      struct fl_request* r = rec->req;
      r->chunks_acked++;
      r->dwell_ns += f->aux; /* the receiver's t4 - t3 for this sub-chunk */
      if (r->carved == r->size && r->chunks_acked == r->chunks_carved) {
        r->done = 1;
        uint64_t t5 = now_ns();
        fl_selector_on_complete(&c->sel, &r->ticket, r->t2_ns, r->dwell_ns, t5); /* t5 = t6 */
        leo_trace_done(c, r, t5);
      }
      p->ring_head = (p->ring_head + 1) % FL_PATH_WINDOW;
      p->ring_count--;
      return 0;
    }
    return 0; /* CTS: payload follows */
  }
  if (f->type != FL_FRAME_DATA) {
    comm_fail(c, -EPROTO, "path %d: peer sent frame type %u to a recv comm", pi, f->type);
    return -1;
  }
  struct fl_request* r = c->slots[f->seq % FL_RECV_SLOTS];
  if (!r || r->seq != f->seq || r->kind != FL_REQ_RECV || r->done) {
    comm_fail(c, -EPROTO, "path %d: DATA for receive slot %u, which is not posted", pi, f->seq);
    return -1;
  }
  if (f->index >= r->n) {
    comm_fail(c, -EPROTO, "path %d: DATA for receive index %u of a %d-way receive", pi, f->index, r->n);
    return -1;
  }
  int i = f->index;
  if (f->total > r->caps[i]) {
    comm_fail(c, -EPROTO, "message of %llu bytes exceeds the posted receive of %llu bytes (tag %d)",
              (unsigned long long)f->total, (unsigned long long)r->caps[i], r->tags[i]);
    return -1;
  }
  if (r->known[i] && r->totals[i] != f->total) {
    comm_fail(c, -EPROTO, "path %d: sub-chunk claims message size %llu, earlier ones said %llu", pi,
              (unsigned long long)f->total, (unsigned long long)r->totals[i]);
    return -1;
  }
  /* Claim the frame's range now, before its payload lands: a frame that
   * overlaps another one (on any path) or overruns the message is refused, so
   * test() never reports done while a path is still writing into the buffer. */
  if (fl_claim(&c->claims, f->seq, f->index, &r->claimed[i], f->total, f->offset, f->length, err, sizeof(err)) != 0) {
    comm_fail(c, -EPROTO, "path %d: DATA for receive %u index %d (tag %d): %s", pi, f->seq, i, r->tags[i], err);
    return -1;
  }
  r->known[i] = 1;
  r->totals[i] = f->total;
  p->in_req = r;
  p->in_start_ns = now_ns();
  return 0;
}

/* The payload of the current frame is complete. */
static int on_frame_body(struct fl_comm* c, struct fl_path* p, int pi) {
  struct fl_frame* f = &p->in_frame;
  if (c->is_send) {
    if (f->type != FL_FRAME_CTS) return 0;
    if (c->cts_count == FL_CTS_QUEUE) {
      comm_fail(c, -EPROTO, "peer posted more than %d receives", FL_CTS_QUEUE);
      return -1;
    }
    char err[160];
    struct fl_cts* e = &c->cts[(c->cts_head + c->cts_count) % FL_CTS_QUEUE];
    memset(e, 0, sizeof(*e));
    if (fl_cts_decode(p->in_ctl, f->length, f->index, e->e, err, sizeof(err)) != 0) {
      comm_fail(c, -EPROTO, "path %d: malformed CTS: %s", pi, err);
      return -1;
    }
    e->seq = f->seq;
    e->n = f->index;
    c->cts_count++;
    return 0;
  }
  struct fl_request* r = p->in_req;
  r->received[f->index] += f->length;
  uint64_t dwell = now_ns() - p->in_start_ns;
  struct fl_frame ack = {.type = FL_FRAME_ACK, .seq = f->aux, .aux = dwell > 0xffffffffu ? 0xffffffffu : (uint32_t)dwell};
  if (ctl_push(c, p, &ack, NULL) != 0) return -1;
  recv_request_check_done(r);
  return 0;
}

static void path_read(struct fl_comm* c, int pi) {
  struct fl_path* p = &c->paths[pi];
  uint64_t budget = 16u << 20; /* fairness across comms within one progress pass */
  while (!c->failed && !p->eof && budget > 0) {
    ssize_t r;
    if (!p->in_body) {
      r = recv(p->fd, p->in_hdr + p->in_hdr_got, FL_FRAME_HDR_BYTES - p->in_hdr_got, 0);
      if (r > 0) {
        p->in_hdr_got += (uint32_t)r;
        if (p->in_hdr_got == FL_FRAME_HDR_BYTES) {
          p->in_hdr_got = 0;
          if (on_frame_header(c, p, pi) != 0) return;
          p->in_body = 1;
        }
      }
    } else {
      struct fl_frame* f = &p->in_frame;
      uint64_t left = f->length - p->in_got;
      if (left == 0) {
        r = 1; /* zero-length payload: complete now */
      } else {
        uint8_t* dst = c->is_send ? p->in_ctl + p->in_got
                                  : p->in_req->bufs[f->index] + f->offset + p->in_got;
        uint64_t want = left < budget ? left : budget;
        r = recv(p->fd, dst, want, 0);
        if (r > 0) {
          p->in_got += (uint64_t)r;
          budget -= (uint64_t)r;
        }
      }
      if (r > 0 && p->in_got == f->length) {
        p->in_body = 0;
        if (on_frame_body(c, p, pi) != 0) return;
      }
    }
    if (r == 0) { /* judged in progress_comm once every path was read: an ACK may still wait on another one */
      p->eof = 1;
      return;
    }
    if (r < 0) {
      if (!io_would_block()) comm_fail(c, fl_neg_errno(), "path %d: recv failed: %s", pi, strerror(errno));
      return;
    }
    c->last_progress_ns = now_ns();
  }
}

/* Continue writing the data frame in progress on a send path. */
static void path_write(struct fl_comm* c, int pi) {
  struct fl_path* p = &c->paths[pi];
  while (p->out_active && !c->failed) {
    struct iovec iov[2];
    int n = 0;
    uint64_t done = p->out_done;
    if (done < FL_FRAME_HDR_BYTES) {
      iov[n].iov_base = p->out_hdr + done;
      iov[n].iov_len = FL_FRAME_HDR_BYTES - done;
      n++;
      if (p->out_len) {
        iov[n].iov_base = (void*)p->out_payload;
        iov[n].iov_len = p->out_len;
        n++;
      }
    } else {
      iov[n].iov_base = (void*)(p->out_payload + (done - FL_FRAME_HDR_BYTES));
      iov[n].iov_len = FL_FRAME_HDR_BYTES + p->out_len - done;
      n++;
    }
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    ssize_t w = sendmsg(p->fd, &mh, MSG_NOSIGNAL);
    if (w < 0) {
      if (!io_would_block()) comm_fail(c, fl_neg_errno(), "path %d: send failed: %s (peer gone?)", pi, strerror(errno));
      return;
    }
    p->out_done += (uint64_t)w;
    c->last_progress_ns = now_ns();
    if (p->out_done == FL_FRAME_HDR_BYTES + p->out_len) {
      p->out_active = 0;
      p->out_req = NULL;
    }
  }
}

static void carve_chunk(struct fl_comm* c, int pi, struct fl_request* r, uint64_t chunk);

/* Hand the next sub-chunks of each path's queued sends to that path. gated: a
 * higher lane has data waiting, so this lane starts nothing new (strict
 * priority); capped: a higher lane is active, so this lane keeps at most
 * lane_cap bytes in flight, i.e. a high-class chunk queues behind at most one
 * small chunk. The path of a request was chosen once, by LEO, in isend. */
static void carve(struct fl_comm* c, int gated, int capped) {
  for (int moved = 1; moved && !gated && !c->failed && c->queued > 0;) {
    moved = 0;
    for (int pi = 0; pi < c->npaths && !c->failed; pi++) {
      struct fl_path* p = &c->paths[pi];
      struct fl_request* r = p->qhead;
      if (!r || p->out_active || p->ring_count == FL_PATH_WINDOW) continue;
      uint64_t left = r->size - r->carved;
      uint64_t chunk = E.params.chunk_bytes;
      if (capped && chunk > E.params.lane_cap_bytes) chunk = E.params.lane_cap_bytes;
      if (left < chunk) chunk = left;
      if (capped && c->unacked_bytes > 0 && c->unacked_bytes + chunk > E.params.lane_cap_bytes) return;
      carve_chunk(c, pi, r, chunk);
      moved = 1;
    }
  }
}

/* Put the next `chunk` bytes of r (queued on path pi) on the wire. */
static void carve_chunk(struct fl_comm* c, int pi, struct fl_request* r, uint64_t chunk) {
  struct fl_path* p = &c->paths[pi];
  uint64_t t = now_ns();
  if (r->chunks_carved == 0) r->t2_ns = t; /* t2: leaves our queue */
  uint32_t id = c->next_chunk_id++;
  struct fl_frame f = {.type = FL_FRAME_DATA, .index = r->index, .seq = r->slot_seq, .offset = r->carved,
                       .length = (uint32_t)chunk, .aux = id, .total = r->size};
  fl_frame_encode(p->out_hdr, &f);
  p->out_payload = r->data + r->carved;
  p->out_len = (uint32_t)chunk;
  p->out_done = 0;
  p->out_active = 1;
  p->out_req = r;
  p->ring[(p->ring_head + p->ring_count) % FL_PATH_WINDOW] = (struct fl_chunk_rec){id, chunk, t, r};
  p->ring_count++;
  c->unacked_bytes += chunk;
  c->last_sent_ns = t;
  atomic_store_explicit(&E.lane_last_sent_ns[c->lane], t, memory_order_relaxed);
  if (p->ring_count == 1) c->last_progress_ns = t; /* the peer's clock starts now */
  r->carved += chunk;
  r->chunks_carved++;
  if (r->carved == r->size) { /* fully carved: leaves the path's queue */
    p->qhead = r->path_next;
    if (!p->qhead) p->qtail = NULL;
    r->path_next = NULL;
    c->queued--;
  }
  path_write(c, pi);
}

static int comm_waits_on_peer(const struct fl_comm* c) {
  for (int pi = 0; pi < c->npaths; pi++) {
    const struct fl_path* p = &c->paths[pi];
    if (p->ring_count > 0 || p->out_active || p->ctl_off < p->ctl_len) return 1;
    if (!c->is_send && p->in_body) return 1;
  }
  if (!c->is_send)
    for (int i = 0; i < FL_REQS_PER_COMM; i++) {
      const struct fl_request* r = &c->reqs[i];
      if (r->kind == FL_REQ_RECV && !r->done)
        for (int k = 0; k < r->n; k++)
          if (r->known[k] && r->received[k] < r->totals[k]) return 1;
    }
  return 0;
}

/* Does the comm still expect anything from its peer (a closed peer is then an error)? */
static int comm_expects_peer(const struct fl_comm* c) {
  if (c->is_send && c->queued > 0) return 1;
  for (int pi = 0; pi < c->npaths; pi++) {
    const struct fl_path* p = &c->paths[pi];
    if (p->ring_count > 0 || p->out_active || p->in_body || p->in_hdr_got) return 1;
  }
  if (!c->is_send)
    for (int i = 0; i < FL_REQS_PER_COMM; i++)
      if (c->reqs[i].kind == FL_REQ_RECV && !c->reqs[i].done) return 1;
  return 0;
}

static void progress_comm(struct fl_comm* c, const short* revents, int gated, int capped) {
  if (c->failed) return;
  for (int pi = 0; pi < c->npaths && !c->failed; pi++) {
    if (!revents || (revents[pi] & (POLLIN | POLLHUP | POLLERR))) path_read(c, pi);
  }
  for (int pi = 0; pi < c->npaths && !c->failed; pi++)
    if (c->paths[pi].eof && comm_expects_peer(c)) comm_fail(c, -ECONNRESET, "path %d: peer closed the connection", pi);
  for (int pi = 0; pi < c->npaths && !c->failed; pi++) {
    if (c->is_send) path_write(c, pi);
    else ctl_flush(c, &c->paths[pi], pi);
  }
  if (c->is_send) carve(c, gated, capped);
  if (!c->failed && comm_waits_on_peer(c)) {
    uint64_t idle = now_ns() - c->last_progress_ns;
    if (idle > (uint64_t)E.params.timeout_ms * 1000000ull)
      comm_fail(c, -ETIMEDOUT, "peer made no progress for %llu ms (%s=%d): stalled or dead",
                (unsigned long long)(idle / 1000000), FL_ENV_TIMEOUT_MS, E.params.timeout_ms);
  }
}

static int higher_lane_pending(int lane) {
  for (int l = 0; l < lane; l++)
    if (atomic_load_explicit(&E.lane_pending[l], memory_order_relaxed) > 0) return 1;
  return 0;
}

static int higher_lane_active(int lane, uint64_t t) {
  for (int l = 0; l < lane; l++) {
    uint64_t ls = atomic_load_explicit(&E.lane_last_sent_ns[l], memory_order_relaxed);
    if (ls && t > ls && t - ls < FL_LANE_ACTIVE_NS) return 1;
  }
  return 0;
}

/* Keep the engine's per-lane and backlog counters in step with c (c->lock held). */
static void comm_account(struct fl_comm* c) {
  int pending = c->is_send && !c->failed && c->queued > 0;
  if (pending != atomic_load(&c->in_lanes_pending)) {
    atomic_fetch_add(&E.lane_pending[c->lane], pending ? 1 : -1);
    atomic_store(&c->in_lanes_pending, pending);
  }
  int backlog = 0;
  for (int pi = 0; pi < c->npaths && !c->failed && !c->is_send; pi++) backlog |= c->paths[pi].ctl_off < c->paths[pi].ctl_len;
  if (backlog != atomic_load(&c->in_ctl_backlog)) {
    atomic_fetch_add(&E.ctl_backlog, backlog ? 1 : -1);
    atomic_store(&c->in_ctl_backlog, backlog);
  }
}

/* One progress pass over c's own sockets (c->lock held). */
static void progress_locked(struct fl_comm* c) {
  if (!c->failed) {
    struct pollfd pf[FL_MAX_PATHS];
    short rev[FL_MAX_PATHS];
    for (int pi = 0; pi < c->npaths; pi++) pf[pi] = (struct pollfd){.fd = c->paths[pi].fd, .events = POLLIN};
    int ok = poll(pf, (nfds_t)c->npaths, 0) >= 0;
    for (int pi = 0; pi < c->npaths; pi++) rev[pi] = ok ? pf[pi].revents : POLLIN; /* poll failed: just try */
    progress_comm(c, rev, higher_lane_pending(c->lane), higher_lane_active(c->lane, now_ns()));
  }
  comm_account(c);
}

/* Progress the comms others wait on, when there are any: higher-lane sends
 * with data queued (they hold c's lane back; NCCL may be calling only c) and
 * receivers whose ACKs/CTS did not fit their socket. Only by trylock, so two
 * threads helping each other never deadlock; a busy comm is progressing. */
static void help_others(struct fl_comm* c) {
  int lanes = c->is_send && c->queued > 0 && higher_lane_pending(c->lane);
  int ctl = atomic_load_explicit(&E.ctl_backlog, memory_order_relaxed) > atomic_load(&c->in_ctl_backlog);
  if (!lanes && !ctl) return;
  pthread_mutex_lock(&E.lock);
  for (int l = 0; l < FL_NUM_CLASSES; l++)
    for (struct fl_comm* o = E.lanes[l]; o; o = o->next) {
      if (o == c) continue;
      if (!((lanes && l < c->lane && atomic_load(&o->in_lanes_pending)) || (ctl && atomic_load(&o->in_ctl_backlog))))
        continue;
      if (pthread_mutex_trylock(&o->lock) != 0) continue;
      progress_locked(o);
      pthread_mutex_unlock(&o->lock);
    }
  pthread_mutex_unlock(&E.lock);
}

/* Progress for an API call on c (c->lock held): what holds c back, then c. */
static void progress(struct fl_comm* c) {
  help_others(c);
  progress_locked(c);
}

/* ------------------------------------------------------------ isend/irecv */

ncclResult_t fl_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  struct fl_comm* c = send_comm;
  FL_REQUIRE(c != NULL && request != NULL && c->is_send, ncclInternalError);
  (void)mhandle;
  *request = NULL;
  if (size > NCCL_MAX_NET_SIZE_BYTES || (size > 0 && !data)) {
    FL_WARN("isend: invalid buffer (data=%p, size=%zu)", data, size);
    return ncclInternalError;
  }
  pthread_mutex_lock(&c->lock);
  ncclResult_t rc = ncclSuccess;
  progress(c);
  for (int pi = 0; pi < c->npaths && !c->failed; pi++) /* a closed receiver will post no more receives */
    if (c->paths[pi].eof) comm_fail(c, -ECONNRESET, "path %d: peer closed the connection", pi);
  if (c->failed) {
    FL_WARN("isend on send comm %llu: %s", (unsigned long long)c->id, c->errmsg);
    rc = fl_retval(c->failed);
    goto out;
  }
  if (c->cts_count == 0) goto out; /* receiver has not posted yet: NCCL retries */
  /* Match the oldest posted (multi-)receive by tag (NCCL's multi-recv rule). */
  struct fl_cts* e = &c->cts[c->cts_head];
  int idx = -1;
  for (int i = 0; i < e->n; i++)
    if (!e->used[i] && e->e[i].tag == tag) {
      idx = i;
      break;
    }
  /* Not (yet) matchable: NCCL's own transports return a NULL request and NCCL
   * retries, e.g. while the sends for the other tags of the oldest grouped
   * receive are still to come. */
  if (idx < 0) goto out;
  if (size > e->e[idx].size) {
    FL_WARN("isend of %zu bytes exceeds the peer's posted receive of %llu bytes (tag %d)", size,
            (unsigned long long)e->e[idx].size, tag);
    rc = fl_retval(-EMSGSIZE);
    goto out;
  }
  struct fl_request* r = req_alloc(c, FL_REQ_SEND);
  if (!r) goto out; /* pool exhausted: would block */
  e->used[idx] = 1;
  int all_used = 1;
  for (int i = 0; i < e->n; i++) all_used &= e->used[i];
  r->data = data;
  r->size = size;
  r->tag = tag;
  r->slot_seq = e->seq;
  r->index = (uint8_t)idx;
  if (all_used) {
    c->cts_head = (c->cts_head + 1) % FL_CTS_QUEUE;
    c->cts_count--;
  }
  /* LEO: one path per request, chosen now (t1) from the paths' queues,
   * tolls and base times (fl_leo.h). */
  uint64_t t1 = now_ns();
  int pi = fl_selector_choose(&c->sel, size, t1);
  leo_trace_choice(c, size, t1, pi);
  fl_selector_on_assign(&c->sel, pi, size, t1, &r->ticket);
  struct fl_path* pq = &c->paths[pi];
  if (pq->qtail) pq->qtail->path_next = r;
  else pq->qhead = r;
  pq->qtail = r;
  c->queued++;
  *request = r;
  progress(c);
out:
  pthread_mutex_unlock(&c->lock);
  return rc;
}

ncclResult_t fl_irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags, void** mhandles,
                      void** request) {
  struct fl_comm* c = recv_comm;
  (void)mhandles;
  FL_REQUIRE(c != NULL && request != NULL && !c->is_send, ncclInternalError);
  *request = NULL;
  if (n < 1 || n > FL_MAX_RECVS || !data || !sizes || !tags) {
    FL_WARN("irecv: n=%d outside 1..%d (maxRecvs) or missing arrays", n, FL_MAX_RECVS);
    return ncclInternalError;
  }
  pthread_mutex_lock(&c->lock);
  ncclResult_t rc = ncclSuccess;
  if (c->failed) {
    FL_WARN("irecv on recv comm %llu: %s", (unsigned long long)c->id, c->errmsg);
    rc = fl_retval(c->failed);
    goto out;
  }
  if (c->slots[c->next_seq % FL_RECV_SLOTS]) goto out; /* too many outstanding: would block */
  struct fl_request* r = req_alloc(c, FL_REQ_RECV);
  if (!r) goto out;
  r->n = n;
  r->seq = c->next_seq++;
  struct fl_cts_entry ent[FL_MAX_RECVS];
  for (int i = 0; i < n; i++) {
    r->bufs[i] = data[i];
    r->caps[i] = sizes[i];
    r->tags[i] = tags[i];
    ent[i].tag = tags[i];
    ent[i].size = sizes[i];
  }
  c->slots[r->seq % FL_RECV_SLOTS] = r;
  uint8_t payload[FL_MAX_RECVS * FL_CTS_ENTRY_BYTES];
  fl_cts_encode(payload, ent, n);
  struct fl_frame f = {.type = FL_FRAME_CTS, .index = (uint8_t)n, .seq = r->seq,
                       .length = (uint32_t)(n * FL_CTS_ENTRY_BYTES)};
  if (ctl_push(c, &c->paths[0], &f, payload) != 0) { /* the comm failed: the queue's memory or an unread peer */
    FL_WARN("irecv on recv comm %llu: %s", (unsigned long long)c->id, c->errmsg);
    rc = fl_retval(c->failed);
    goto out;
  }
  *request = r;
  progress(c);
out:
  pthread_mutex_unlock(&c->lock);
  return rc;
}

ncclResult_t fl_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request) {
  (void)recv_comm, (void)n, (void)data, (void)sizes, (void)mhandles;
  if (request) *request = NULL; /* host memory: nothing to flush */
  return ncclSuccess;
}

ncclResult_t fl_test(void* request, int* done, int* sizes) {
  struct fl_request* r = request;
  if (!r || !done || (r->kind != FL_REQ_SEND && r->kind != FL_REQ_RECV)) {
    FL_WARN("test: %p is not a live flowlane request", request);
    return ncclInternalError;
  }
  struct fl_comm* c = r->comm;
  pthread_mutex_lock(&c->lock);
  ncclResult_t rc = ncclSuccess;
  *done = 0;
  if (!r->done) progress(c);
  if (r->done) {
    *done = 1;
    if (sizes) {
      if (r->kind == FL_REQ_SEND) sizes[0] = (int)r->size;
      else
        for (int i = 0; i < r->n; i++) sizes[i] = (int)r->totals[i];
    }
    r->kind = FL_REQ_FREE;
  } else if (r->comm->failed) {
    FL_WARN("test: request on %s comm %llu failed: %s", r->comm->is_send ? "send" : "recv",
            (unsigned long long)r->comm->id, r->comm->errmsg);
    rc = fl_retval(r->comm->failed);
  }
  pthread_mutex_unlock(&c->lock);
  return rc;
}

/* Read and drop what the peer sent and nobody will read: close() with unread
 * input sends RST instead of FIN. Bounded: a peer may still be sending. */
static void drain_input(int fd) {
  uint8_t junk[4096];
  for (int k = 0; k < 256 && recv(fd, junk, sizeof(junk), MSG_DONTWAIT) > 0; k++) {
  }
}

static ncclResult_t close_comm(struct fl_comm* c) {
  if (!c) return ncclSuccess;
  pthread_mutex_lock(&E.lock);
  comm_unlink(c); /* no helper can find it now */
  pthread_mutex_unlock(&E.lock);
  pthread_mutex_lock(&c->lock); /* a helper that took it before the unlink is done */
  if (c->is_send)
    for (int pi = 0; pi < c->npaths; pi++) {
      const struct fl_leo_path* st = &c->sel.st[pi];
      FL_INFO("send comm %llu path %d: %llu requests, %llu bytes, est. %.1f MB/s, k_hat %u, selector %s",
              (unsigned long long)c->id, pi, (unsigned long long)st->requests, (unsigned long long)st->bytes,
              fl_leo_bw(st) * 1e3, st->khat, fl_selector_name(c->sel.kind));
    }
  else
    for (int pi = 0; pi < c->npaths && !c->failed; pi++) ctl_flush(c, &c->paths[pi], pi); /* last ACKs complete sends */
  if (atomic_load(&c->in_lanes_pending)) atomic_fetch_sub(&E.lane_pending[c->lane], 1);
  if (atomic_load(&c->in_ctl_backlog)) atomic_fetch_sub(&E.ctl_backlog, 1);
  pthread_mutex_unlock(&c->lock);
  /* No wait for the peer: a send is done only once acknowledged, so nothing
   * NCCL saw complete is still in flight, and a peer that stopped reading
   * cannot hold up closing (NCCL closes comms one after another). */
  for (int pi = 0; pi < c->npaths; pi++) {
    if (c->paths[pi].fd < 0) continue;
    drain_input(c->paths[pi].fd);
    shutdown(c->paths[pi].fd, SHUT_WR);
  }
  comm_free(c);
  return ncclSuccess;
}

ncclResult_t fl_close_send(void* send_comm) { return close_comm(send_comm); }
ncclResult_t fl_close_recv(void* recv_comm) { return close_comm(recv_comm); }
