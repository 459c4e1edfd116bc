/*
 * fl_core.h - flowlane's one transport implementation (TCP, priority lanes,
 * multi-path). fl_api.c adapts every NCCL API version onto these calls.
 *
 * Object chain: engine (process-wide) -> listen/send/recv comm -> path (one
 * TCP socket) -> request (fixed pool per comm). Progress happens inside API
 * calls (NCCL's proxy thread polls test()) and is per comm: a call locks its
 * own comm and polls its own sockets. The engine lock guards only the comm
 * lists and connection setup; lane priority reads per-lane atomic counters,
 * and a call whose lane is held back helps the waiting higher-lane comms
 * (trylock), so no comm depends on being called by a thread that never comes.
 */
#ifndef FL_CORE_H
#define FL_CORE_H

#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>

#include "flowlane_net.h"
#include "flowlane_net_abi.h"
#include "fl_claims.h"
#include "fl_leo.h"
#include "fl_wire.h"

#define FL_MAX_IFACES FL_MAX_PATHS
#define FL_REQS_PER_COMM (NCCL_NET_MAX_REQUESTS * FL_MAX_RECVS)
#define FL_RECV_SLOTS FL_REQS_PER_COMM /* receive sequence numbers live in seq % slots */
#define FL_CTS_QUEUE FL_REQS_PER_COMM
#define FL_PATH_WINDOW 4 /* unacknowledged sub-chunks per path */
_Static_assert(FL_CLAIM_EXTENTS >= FL_MAX_PATHS * FL_PATH_WINDOW, "an honest sender's gaps must fit the claim pool");
/* Handshake limits against peers without the secret (README, Security): a
 * listen comm holds at most FL_MAX_PENDING_ACCEPTS unauthenticated sockets
 * and evicts the oldest when another arrives; a socket must send its first
 * byte within FL_FIRST_BYTE_MS and its whole hello within FL_HELLO_TIMEOUT_MS
 * (both capped by FLOWLANE_NET_TIMEOUT_MS). Authenticated paths of a
 * multi-path connection wait for their siblings in at most FL_MAX_HALF_OPEN
 * groups (the oldest is evicted when full), each for FLOWLANE_NET_TIMEOUT_MS
 * capped at FL_HELLO_TIMEOUT_MS. Refusals are logged at most
 * FL_REFUSE_LOG_BURST times per FL_REFUSE_LOG_WINDOW_MS, then counted. */
#define FL_MAX_PENDING_ACCEPTS 16
#define FL_FIRST_BYTE_MS 1000
#define FL_HELLO_TIMEOUT_MS 10000
#define FL_MAX_HALF_OPEN 4
#define FL_ACCEPTS_PER_CALL 64 /* bounds the work one accept() call does for a flood */
#define FL_REFUSE_LOG_BURST 5
#define FL_REFUSE_LOG_WINDOW_MS 10000
#define FL_LANE_ACTIVE_NS 100000000ull /* a lane counts as active 100 ms after it last sent */

struct fl_params {
  char ifname_spec[256];
  int lanes;
  int default_class;
  int paths; /* 0: one per interface */
  int selector;
  uint64_t chunk_bytes;
  uint64_t lane_cap_bytes;
  int timeout_ms;
};

struct fl_iface {
  char name[32];
  struct sockaddr_storage addr;
  socklen_t addrlen;
  int speed_mbps;
};

enum { FL_REQ_FREE = 0, FL_REQ_SEND = 0x5E4D, FL_REQ_RECV = 0x2EC7 };

struct fl_comm;

struct fl_request {
  int kind;
  int done;
  struct fl_comm* comm;
  /* send */
  const uint8_t* data;
  uint64_t size;
  int tag;
  uint32_t slot_seq;
  uint8_t index;
  uint64_t carved;       /* bytes handed to its path */
  int chunks_carved;
  int chunks_acked; /* done when every carved sub-chunk is acknowledged (as RDMA completes on the remote ACK) */
  struct fl_leo_ticket ticket; /* its path and what LEO predicted at t1 (fl_leo.h) */
  uint64_t t2_ns;              /* first byte handed to the socket */
  uint64_t dwell_ns;           /* sum of the receiver's dwell (our t4 - t3) over its sub-chunks (ACKs) */
  struct fl_request* path_next; /* FIFO of requests placed on one path */
  /* recv */
  int n;
  uint32_t seq;
  uint8_t* bufs[FL_MAX_RECVS];
  uint64_t caps[FL_MAX_RECVS];
  int tags[FL_MAX_RECVS];
  uint64_t totals[FL_MAX_RECVS];
  uint64_t received[FL_MAX_RECVS]; /* payload bytes of completed frames */
  uint64_t claimed[FL_MAX_RECVS];  /* claimed prefix (fl_claims.h): bytes granted to frames when their header arrived */
  uint8_t known[FL_MAX_RECVS];
};

struct fl_chunk_rec {
  uint32_t id;
  uint64_t bytes;
  uint64_t start_ns;
  struct fl_request* req; /* live until this ACK arrives: a send is done only then */
};

struct fl_path {
  int fd;
  int eof; /* the peer closed its side: read no more; an error only if the comm still expects something */
  /* outgoing data frame (send comm) */
  int out_active;
  uint8_t out_hdr[FL_FRAME_HDR_BYTES];
  const uint8_t* out_payload;
  uint32_t out_len;
  uint64_t out_done; /* of FL_FRAME_HDR_BYTES + out_len */
  struct fl_request* out_req;
  /* outgoing control bytes (recv comm: CTS and ACK frames) */
  uint8_t* ctl;
  uint64_t ctl_len, ctl_off, ctl_cap;
  /* incoming frame parser */
  uint8_t in_hdr[FL_FRAME_HDR_BYTES];
  uint32_t in_hdr_got;
  int in_body; /* header decoded, reading payload */
  struct fl_frame in_frame;
  uint64_t in_got;
  uint8_t in_ctl[FL_MAX_RECVS * FL_CTS_ENTRY_BYTES];
  struct fl_request* in_req;
  uint64_t in_start_ns;
  /* send comm: requests LEO placed on this path, not yet fully carved (FIFO) */
  struct fl_request *qhead, *qtail;
  /* unacknowledged sub-chunks, oldest first (TCP keeps per-path order) */
  struct fl_chunk_rec ring[FL_PATH_WINDOW];
  int ring_head, ring_count;
};

struct fl_cts {
  uint32_t seq;
  int n;
  struct fl_cts_entry e[FL_MAX_RECVS];
  uint8_t used[FL_MAX_RECVS];
};

struct fl_comm {
  pthread_mutex_t lock; /* one API call at a time on this comm; engine lock -> comm lock only by trylock */
  _Atomic int in_lanes_pending; /* counted in the engine's lane_pending[lane] (send work queued) */
  _Atomic int in_ctl_backlog;   /* counted in the engine's ctl_backlog (control bytes the socket did not take) */
  int is_send;
  int traffic_class;
  int lane;
  uint64_t id;
  int npaths;
  struct fl_path paths[FL_MAX_PATHS];
  struct fl_selector sel;
  struct fl_request reqs[FL_REQS_PER_COMM];
  /* send side */
  int queued; /* matched sends not yet fully carved, over all path queues */
  struct fl_cts cts[FL_CTS_QUEUE];
  int cts_head, cts_count;
  uint32_t next_chunk_id;
  uint64_t unacked_bytes;
  uint64_t last_sent_ns;
  /* recv side */
  uint32_t next_seq;
  struct fl_request* slots[FL_RECV_SLOTS];
  struct fl_claims claims; /* DATA ranges granted above each entry's claimed prefix */
  /* health */
  int failed;        /* 0, or the negative errno that ended the comm (fl_errors.h) */
  char errmsg[256]; /* what ended it, for the WARN the next call gives NCCL */
  uint64_t last_progress_ns;
  struct fl_comm *prev, *next;
};

struct fl_pending_accept {
  int fd;
  uint8_t buf[FL_HELLO_BYTES];
  uint32_t got;
  uint64_t accepted_ns; /* eviction order: oldest first */
  uint64_t first_byte_deadline_ns, deadline_ns;
  char peer[80];
};

struct fl_accept_group {
  int used;
  uint64_t conn_id;
  int npaths, have, traffic_class;
  int fds[FL_MAX_PATHS];
  uint64_t created_ns, deadline_ns;
  char peer[80];
};

struct fl_listen {
  int nfds;
  int fds[FL_MAX_IFACES];
  uint8_t secret[FL_SECRET_BYTES];
  struct fl_pending_accept pend[FL_MAX_PENDING_ACCEPTS];
  struct fl_accept_group groups[FL_MAX_HALF_OPEN];
  uint64_t refused; /* connections refused (bad magic/version/secret, deadline, eviction) */
};

/* Per-communicator context of the v11 API (init(ctx, commId, config)). */
struct fl_ctx {
  uint64_t magic;
  uint64_t comm_id;
  int traffic_class; /* NCCL_NET_TRAFFIC_CLASS_UNDEF when NCCL gave none */
};
#define FL_CTX_MAGIC 0x464c4354584d4147ull

/* ---- implementation entry points (newest semantics) ---- */
ncclResult_t fl_init(ncclDebugLogger_t logger);
ncclResult_t fl_devices(int* ndev);
ncclResult_t fl_get_properties(int dev, ncclNetProperties_v11_t* props);
ncclResult_t fl_listen(int dev, void* handle, void** listen_comm);
/* traffic_class: NCCL_NET_TRAFFIC_CLASS_UNDEF or a flowlane class. */
ncclResult_t fl_connect(int dev, int traffic_class, void* handle, void** send_comm);
ncclResult_t fl_accept(void* listen_comm, void** recv_comm);
ncclResult_t fl_reg_mr(void* comm, void* data, size_t size, int type, void** mhandle);
ncclResult_t fl_reg_mr_dmabuf(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
ncclResult_t fl_dereg_mr(void* comm, void* mhandle);
ncclResult_t fl_isend(void* send_comm, void* data, size_t size, int tag, void* mhandle, void** request);
ncclResult_t fl_irecv(void* recv_comm, int n, void** data, const size_t* sizes, const int* tags, void** mhandles,
                      void** request);
ncclResult_t fl_iflush(void* recv_comm, int n, void** data, int* sizes, void** mhandles, void** request);
ncclResult_t fl_test(void* request, int* done, int* sizes);
ncclResult_t fl_close_send(void* send_comm);
ncclResult_t fl_close_recv(void* recv_comm);
ncclResult_t fl_close_listen(void* listen_comm);
ncclResult_t fl_make_vdevice(int* d, ncclNetVDeviceProps_v11_t* props);
/* Parameters as parsed from the environment (valid after fl_init). */
const struct fl_params* fl_get_params(void);

/* Traffic class -> wire marking (the contract in flowlane_net.h). */
int fl_class_dscp(int cls);
int fl_class_sopriority(int cls);
int fl_lane_of_class(int cls, int lanes);
int fl_lane_marking_class(int lane, int lanes); /* DSCP's class */
int fl_lane_sopriority(int lane, int lanes);

#endif /* FL_CORE_H */
