/*
 * fl_progress.c - the transport's data path: receiver-driven frames (CTS, DATA, ACK) on each path, LEO's choice of
 * path per isend, lanes served in strict priority, and isend/irecv/test/close on top. Connections come from
 * fl_transport.c; what both share is in fl_transport.h. The protocol is described at the top of fl_transport.c.
 */
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fl_errors.h"
#include "fl_log.h"
#include "fl_transport.h"

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
        fl_comm_fail(c, -EREMOTEIO, "control queue above 64 MiB: peer is not reading");
        return -1;
      }
      uint8_t* nb = realloc(p->ctl, cap);
      if (!nb) {
        fl_comm_fail(c, -ENOMEM, "out of memory for the control queue");
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
      if (!fl_io_would_block()) fl_comm_fail(c, fl_neg_errno(), "path %d: send failed: %s (peer gone?)", pi, strerror(errno));
      return;
    }
    p->ctl_off += (uint64_t)w;
    c->last_progress_ns = fl_now_ns();
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
    fl_comm_fail(c, -EPROTO, "path %d: malformed frame from peer: %s", pi, err);
    return -1;
  }
  p->in_got = 0;
  p->in_req = NULL;
  if (c->is_send) {
    if (f->type == FL_FRAME_DATA) {
      fl_comm_fail(c, -EPROTO, "path %d: peer sent DATA to a send comm", pi);
      return -1;
    }
    if (f->type == FL_FRAME_ACK) {
      if (p->ring_count == 0 || p->ring[p->ring_head].id != f->seq) {
        fl_comm_fail(c, -EPROTO, "path %d: ACK for chunk %u does not match the oldest unacknowledged chunk", pi, f->seq);
        return -1;
      }
      /* Chunks go out one at a time, so only the newest ring entry can be mid-write. An ACK for it before its last
       * byte left would let test() report the send done while this path still reads the caller's buffer. */
      if (p->out_active && p->ring_count == 1) {
        fl_comm_fail(c, -EPROTO, "path %d: ACK for chunk %u before all of it was sent", pi, f->seq);
        return -1;
      }
      struct fl_chunk_rec* rec = &p->ring[p->ring_head];
      c->unacked_bytes -= rec->bytes;
      struct fl_request* r = rec->req;
      r->chunks_acked++;
      r->dwell_ns += f->aux; /* the receiver's dwell for this sub-chunk: our t4 - t3 (fl_leo.h) */
      if (r->carved == r->size && r->chunks_acked == r->chunks_carved) {
        r->done = 1;
        uint64_t t5 = fl_now_ns();
        fl_selector_on_complete(&c->sel, &r->ticket, r->t2_ns, r->dwell_ns, t5); /* t5 = t6 */
        fl_leo_trace_done(c, r, t5);
      }
      p->ring_head = (p->ring_head + 1) % FL_PATH_WINDOW;
      p->ring_count--;
      return 0;
    }
    return 0; /* CTS: payload follows */
  }
  if (f->type != FL_FRAME_DATA) {
    fl_comm_fail(c, -EPROTO, "path %d: peer sent frame type %u to a recv comm", pi, f->type);
    return -1;
  }
  struct fl_request* r = c->slots[f->seq % FL_RECV_SLOTS];
  if (!r || r->seq != f->seq || r->kind != FL_REQ_RECV || r->done) {
    fl_comm_fail(c, -EPROTO, "path %d: DATA for receive slot %u, which is not posted", pi, f->seq);
    return -1;
  }
  if (f->index >= r->n) {
    fl_comm_fail(c, -EPROTO, "path %d: DATA for receive index %u of a %d-way receive", pi, f->index, r->n);
    return -1;
  }
  int i = f->index;
  if (f->total > r->caps[i]) {
    fl_comm_fail(c, -EPROTO, "message of %llu bytes exceeds the posted receive of %llu bytes (tag %d)",
              (unsigned long long)f->total, (unsigned long long)r->caps[i], r->tags[i]);
    return -1;
  }
  if (r->known[i] && r->totals[i] != f->total) {
    fl_comm_fail(c, -EPROTO, "path %d: sub-chunk claims message size %llu, earlier ones said %llu", pi,
              (unsigned long long)f->total, (unsigned long long)r->totals[i]);
    return -1;
  }
  /* Claim the frame's range now, before its payload lands: a frame that
   * overlaps another one (on any path) or overruns the message is refused, so
   * test() never reports done while a path is still writing into the buffer. */
  if (fl_claim(&c->claims, f->seq, f->index, &r->claimed[i], f->total, f->offset, f->length, err, sizeof(err)) != 0) {
    fl_comm_fail(c, -EPROTO, "path %d: DATA for receive %u index %d (tag %d): %s", pi, f->seq, i, r->tags[i], err);
    return -1;
  }
  r->known[i] = 1;
  r->totals[i] = f->total;
  p->in_req = r;
  p->in_start_ns = fl_now_ns();
  return 0;
}

/* The payload of the current frame is complete. */
static int on_frame_body(struct fl_comm* c, struct fl_path* p, int pi) {
  struct fl_frame* f = &p->in_frame;
  if (c->is_send) {
    if (f->type != FL_FRAME_CTS) return 0;
    if (c->cts_count == FL_CTS_QUEUE) {
      fl_comm_fail(c, -EPROTO, "peer posted more than %d receives", FL_CTS_QUEUE);
      return -1;
    }
    char err[160];
    struct fl_cts* e = &c->cts[(c->cts_head + c->cts_count) % FL_CTS_QUEUE];
    memset(e, 0, sizeof(*e));
    if (fl_cts_decode(p->in_ctl, f->length, f->index, e->e, err, sizeof(err)) != 0) {
      fl_comm_fail(c, -EPROTO, "path %d: malformed CTS: %s", pi, err);
      return -1;
    }
    e->seq = f->seq;
    e->n = f->index;
    c->cts_count++;
    return 0;
  }
  struct fl_request* r = p->in_req;
  r->received[f->index] += f->length;
  /* LEO's t4 - t3 here: header read -> last byte read. Unlike the seed's (server processing, network excluded) it
   * includes the frame's serialisation through the path's bottleneck; no server phase exists (fl_leo.h). */
  uint64_t dwell = fl_now_ns() - p->in_start_ns;
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
      if (!fl_io_would_block()) fl_comm_fail(c, fl_neg_errno(), "path %d: recv failed: %s", pi, strerror(errno));
      return;
    }
    c->last_progress_ns = fl_now_ns();
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
      if (!fl_io_would_block()) fl_comm_fail(c, fl_neg_errno(), "path %d: send failed: %s (peer gone?)", pi, strerror(errno));
      return;
    }
    p->out_done += (uint64_t)w;
    c->last_progress_ns = fl_now_ns();
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
      uint64_t chunk = fl_engine.params.chunk_bytes;
      if (capped && chunk > fl_engine.params.lane_cap_bytes) chunk = fl_engine.params.lane_cap_bytes;
      if (left < chunk) chunk = left;
      if (capped && c->unacked_bytes > 0 && c->unacked_bytes + chunk > fl_engine.params.lane_cap_bytes) return;
      carve_chunk(c, pi, r, chunk);
      moved = 1;
    }
  }
}

/* Put the next `chunk` bytes of r (queued on path pi) on the wire. */
static void carve_chunk(struct fl_comm* c, int pi, struct fl_request* r, uint64_t chunk) {
  struct fl_path* p = &c->paths[pi];
  uint64_t t = fl_now_ns();
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
  atomic_store_explicit(&fl_engine.lane_last_sent_ns[c->lane], t, memory_order_relaxed);
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
    if (p->ring_count > 0 || p->out_active || p->ctl_off < p->ctl_len || p->in_hdr_got) return 1;
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
    if (c->paths[pi].eof && comm_expects_peer(c)) fl_comm_fail(c, -ECONNRESET, "path %d: peer closed the connection", pi);
  for (int pi = 0; pi < c->npaths && !c->failed; pi++) {
    if (c->is_send) path_write(c, pi);
    else ctl_flush(c, &c->paths[pi], pi);
  }
  if (c->is_send) carve(c, gated, capped);
  if (!c->failed && comm_waits_on_peer(c)) {
    uint64_t idle = fl_now_ns() - c->last_progress_ns;
    if (idle > (uint64_t)fl_engine.params.timeout_ms * 1000000ull)
      fl_comm_fail(c, -ETIMEDOUT, "peer made no progress for %llu ms (%s=%d): stalled or dead",
                (unsigned long long)(idle / 1000000), FL_ENV_TIMEOUT_MS, fl_engine.params.timeout_ms);
  }
}

static int higher_lane_pending(int lane) {
  for (int l = 0; l < lane; l++)
    if (atomic_load_explicit(&fl_engine.lane_pending[l], memory_order_relaxed) > 0) return 1;
  return 0;
}

static int higher_lane_active(int lane, uint64_t t) {
  for (int l = 0; l < lane; l++) {
    uint64_t ls = atomic_load_explicit(&fl_engine.lane_last_sent_ns[l], memory_order_relaxed);
    if (ls && t > ls && t - ls < FL_LANE_ACTIVE_NS) return 1;
  }
  return 0;
}

/* Keep the engine's per-lane and backlog counters in step with c (c->lock held). */
static void comm_account(struct fl_comm* c) {
  int pending = c->is_send && !c->failed && c->queued > 0;
  if (pending != atomic_load(&c->in_lanes_pending)) {
    atomic_fetch_add(&fl_engine.lane_pending[c->lane], pending ? 1 : -1);
    atomic_store(&c->in_lanes_pending, pending);
  }
  int backlog = 0;
  for (int pi = 0; pi < c->npaths && !c->failed && !c->is_send; pi++) backlog |= c->paths[pi].ctl_off < c->paths[pi].ctl_len;
  if (backlog != atomic_load(&c->in_ctl_backlog)) {
    atomic_fetch_add(&fl_engine.ctl_backlog, backlog ? 1 : -1);
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
    progress_comm(c, rev, higher_lane_pending(c->lane), higher_lane_active(c->lane, fl_now_ns()));
  }
  comm_account(c);
}

/* Progress the comms others wait on, when there are any: higher-lane sends
 * with data queued (they hold c's lane back; NCCL may be calling only c) and
 * receivers whose ACKs/CTS did not fit their socket. Only by trylock, so two
 * threads helping each other never deadlock; a busy comm is progressing. */
static void help_others(struct fl_comm* c) {
  int lanes = c->is_send && c->queued > 0 && higher_lane_pending(c->lane);
  int ctl = atomic_load_explicit(&fl_engine.ctl_backlog, memory_order_relaxed) > atomic_load(&c->in_ctl_backlog);
  if (!lanes && !ctl) return;
  pthread_mutex_lock(&fl_engine.lock);
  for (int l = 0; l < FL_NUM_CLASSES; l++)
    for (struct fl_comm* o = fl_engine.lanes[l]; o; o = o->next) {
      if (o == c) continue;
      if (!((lanes && l < c->lane && atomic_load(&o->in_lanes_pending)) || (ctl && atomic_load(&o->in_ctl_backlog))))
        continue;
      if (pthread_mutex_trylock(&o->lock) != 0) continue;
      progress_locked(o);
      pthread_mutex_unlock(&o->lock);
    }
  pthread_mutex_unlock(&fl_engine.lock);
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
    if (c->paths[pi].eof) fl_comm_fail(c, -ECONNRESET, "path %d: peer closed the connection", pi);
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
  uint64_t t1 = fl_now_ns();
  int pi = fl_selector_choose(&c->sel, size, t1);
  fl_leo_trace_choice(c, size, t1, pi);
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
  pthread_mutex_lock(&fl_engine.lock);
  fl_comm_unlink(c); /* no helper can find it now */
  pthread_mutex_unlock(&fl_engine.lock);
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
  if (atomic_load(&c->in_lanes_pending)) atomic_fetch_sub(&fl_engine.lane_pending[c->lane], 1);
  if (atomic_load(&c->in_ctl_backlog)) atomic_fetch_sub(&fl_engine.ctl_backlog, 1);
  pthread_mutex_unlock(&c->lock);
  /* No wait for the peer: a send is done only once acknowledged, so nothing
   * NCCL saw complete is still in flight, and a peer that stopped reading
   * cannot hold up closing (NCCL closes comms one after another). */
  for (int pi = 0; pi < c->npaths; pi++) {
    if (c->paths[pi].fd < 0) continue;
    drain_input(c->paths[pi].fd);
    shutdown(c->paths[pi].fd, SHUT_WR);
  }
  fl_comm_free(c);
  return ncclSuccess;
}

ncclResult_t fl_close_send(void* send_comm) { return close_comm(send_comm); }
ncclResult_t fl_close_recv(void* recv_comm) { return close_comm(recv_comm); }
