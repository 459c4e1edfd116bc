/* ALEPH tier 1: the userspace UDP aggregator and worker (seed 002 §5; digest §5.2, §5.4 tier 1).
 *
 *   aleph_udp node   --children N [--parent HOST:PORT --id I] --elems E --iters K [options]
 *   aleph_udp worker --parent HOST:PORT --id I --elems E --iters K --in FILE --out FILE [options]
 *   options: --port P (node; 0 = any) --job J --rto-ms R --linger-ms L --drop P --seed S --scale K (worker)
 *            --max-idle-ms T (give up, exit 3, after T ms without progress; default 30000)
 *            --wait-go 1 (worker: after printing its port, wait for a line on stdin before sending)
 *            --xdp 1 --child-addrs IP:PORT,... (aggregator: the XDP tier sums the DATA in front of this socket)
 *
 * A node aggregates its N children's DATA segments (int32 sums; a 32-bit bitmap per segment records who was
 * added, so a duplicate is never counted twice). With a --parent it is an aggregator: a completed segment goes up as
 * its own DATA, and RESULTs from the parent are relayed to every child. Without one it is the PS: a completed
 * segment is the result and is sent to every child. A node prints "port <P>" on start and a JSON line of counters
 * when it leaves: after K iterations, once no packet arrived for --linger-ms.
 *
 * A worker sends its E values per iteration (K iterations of E int32 in --in, native little-endian) and writes the
 * K results to --out.
 *
 * Reliability is receiver-driven and per hop (digest §5.2 #8): a child missing result segments --rto-ms after its
 * last progress sends NACKs, doubling the wait (up to 1 s) until a result arrives, so a busy parent is not flooded;
 * the parent answers with RESULTs it has, and with a RETX for segments where it lacks the child's own DATA; the
 * child resends those. Nodes keep the previous iteration's results to answer late NACKs
 * (a parent can be at most one iteration ahead of a child). --drop P drops each received datagram with probability
 * P before parsing (seeded): the loss injection of the tests and of benchmarks/aleph_loss.py.
 *
 * With --xdp 1 an aggregator node is the userspace half of the XDP tier (src/aleph_xdp.bpf.c attached to the
 * interface its children's DATA arrive on): the program adds the DATA in the kernel and sends each cluster sum to the
 * parent itself, so this node never sees DATA (one that arrives anyway is counted as "unaggregated" and dropped: no
 * program in front). It relays the parent's RESULTs to the children -- whose addresses it is given (--child-addrs,
 * child id order), since their DATA never reach it -- opens an iteration on its first RESULT, answers a child's NACK
 * with the results it has and a RETX for the rest (it cannot see the program's bitmaps; the program drops a DATA it
 * already added), and relays the parent's RETX to every child: their DATA for a segment the program has completed
 * makes it send the stored sum up again.
 */
#define _GNU_SOURCE
#include "aleph_wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "aleph_udp reads the wire format in host order: little-endian hosts only"
#endif

#define MAX_ITERS 1000000u
#define MAX_ELEMS (1u << 26)
#define RTO_MAX_MS 1000 /* NACK back-off cap */

struct opts {
    int node, port, has_parent, rto_ms, linger_ms, scale, max_idle_ms, wait_go, xdp;
    unsigned children, id, job, iters, elems;
    double drop;
    unsigned long long seed;
    struct sockaddr_in parent;
    const char *in, *out, *child_addrs;
};

/* counters, printed as JSON on exit */
static struct {
    unsigned long long rx, tx, injected, dup, stale, overflow, nacks, retx_req, retx_data, results_resent,
        unaggregated, nacks_rx, data_rx;
    unsigned long long bad_len, bad_magic, bad_version, bad_type, bad_job, bad_src, bad_seg, bad_count, bad_scale,
        bad_flags, bad_addr, bad_iter;
} C;

static void die(const char *msg) {
    fprintf(stderr, "aleph_udp: %s\n", msg);
    exit(2);
}

static unsigned long long rng_state;
static double rnd(void) { /* xorshift64*, seeded: reproducible loss */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static unsigned nseg_of(unsigned elems) { return (elems + ALEPH_SEG_ELEMS - 1) / ALEPH_SEG_ELEMS; }
static unsigned seg_len(unsigned elems, unsigned seg) {
    unsigned left = elems - seg * ALEPH_SEG_ELEMS;
    return left < ALEPH_SEG_ELEMS ? left : ALEPH_SEG_ELEMS;
}

static int sock;

static void send_pkt(const struct sockaddr_in *to, const struct aleph_hdr *h, const int32_t *vals) {
    unsigned char buf[ALEPH_MAX_PACKET];
    size_t n = sizeof *h + 4u * h->count;
    memcpy(buf, h, sizeof *h);
    if (h->count)
        memcpy(buf + sizeof *h, vals, 4u * h->count);
    if (sendto(sock, buf, n, 0, (const struct sockaddr *)to, sizeof *to) == (ssize_t)n)
        C.tx++;
}

static void hdr_init(struct aleph_hdr *h, const struct opts *o, unsigned type, unsigned src, unsigned iter,
                     unsigned seg, uint32_t bitmap, int scale, unsigned count) {
    memset(h, 0, sizeof *h);
    h->magic = ALEPH_MAGIC;
    h->version = ALEPH_VERSION;
    h->type = (uint8_t)type;
    h->job_id = (uint16_t)o->job;
    h->src_id = (uint16_t)src;
    h->iteration = iter;
    h->segment = seg;
    h->bitmap = bitmap;
    h->scale = (int8_t)scale;
    h->count = (uint16_t)count;
}

/* Checks every field a packet carries against what this receiver expects; 0 when it may be used. `nchildren` is
 * 0 when only a parent may send to us (a worker). */
static int check_packet(const unsigned char *buf, ssize_t len, const struct opts *o, unsigned nchildren,
                        struct aleph_hdr *h) {
    if (len < (ssize_t)sizeof *h || len > (ssize_t)ALEPH_MAX_PACKET)
        return C.bad_len++, -1;
    memcpy(h, buf, sizeof *h);
    if (h->magic != ALEPH_MAGIC)
        return C.bad_magic++, -1;
    if (h->version != ALEPH_VERSION)
        return C.bad_version++, -1;
    if (h->type < ALEPH_DATA || h->type > ALEPH_RETX)
        return C.bad_type++, -1;
    if (h->job_id != o->job)
        return C.bad_job++, -1;
    if (h->flags != 0)
        return C.bad_flags++, -1;
    if (h->iteration == 0 || h->iteration > o->iters)
        return C.bad_iter++, -1;
    int from_child = h->type == ALEPH_DATA || h->type == ALEPH_NACK;
    if (from_child && (nchildren == 0 || h->src_id >= nchildren))
        return C.bad_src++, -1;
    if (!from_child && h->src_id != 0)
        return C.bad_src++, -1;
    unsigned nseg = nseg_of(o->elems);
    if (h->segment >= nseg)
        return C.bad_seg++, -1;
    if (h->type == ALEPH_DATA || h->type == ALEPH_RESULT) {
        if (h->count != seg_len(o->elems, h->segment))
            return C.bad_count++, -1;
        if (h->type == ALEPH_DATA && h->bitmap != (1u << h->src_id))
            return C.bad_src++, -1;
    } else {
        if (h->count != 0 || h->segment % ALEPH_NACK_SPAN != 0)
            return C.bad_count++, -1;
    }
    if (len != (ssize_t)(sizeof *h + 4u * h->count))
        return C.bad_len++, -1;
    return 0;
}

static ssize_t recv_pkt(unsigned char *buf, struct sockaddr_in *from, int timeout_ms) {
    struct pollfd p = {.fd = sock, .events = POLLIN};
    int r = poll(&p, 1, timeout_ms < 0 ? 0 : timeout_ms);
    if (r <= 0)
        return -1;
    socklen_t fl = sizeof *from;
    ssize_t n = recvfrom(sock, buf, ALEPH_MAX_PACKET + 1, 0, (struct sockaddr *)from, &fl);
    if (n < 0)
        return -1;
    C.rx++;
    return n;
}

static int same_addr(const struct sockaddr_in *a, const struct sockaddr_in *b) {
    return a->sin_addr.s_addr == b->sin_addr.s_addr && a->sin_port == b->sin_port;
}

static void parse_addr(const char *v, struct sockaddr_in *a);

/* ---------------------------------------------------------------- node (aggregator or PS) */

struct slotbuf { /* one iteration's slots */
    unsigned iter;
    int scale, scale_set;
    uint32_t *bitmap;  /* per segment: children added */
    int32_t *sum;      /* elems: running sums; a PS's completed sums are the results */
    int32_t *result;   /* elems: results (aggregator: from the parent) */
    unsigned char *have; /* per segment: result known */
    unsigned known;
};

static void slot_reset(struct slotbuf *s, unsigned iter, unsigned nseg, unsigned elems) {
    s->iter = iter;
    s->scale_set = 0;
    s->known = 0;
    memset(s->bitmap, 0, nseg * sizeof *s->bitmap);
    memset(s->sum, 0, elems * sizeof *s->sum);
    memset(s->have, 0, nseg);
}

static void node_send_result(const struct opts *o, const struct sockaddr_in *to, const struct slotbuf *s,
                             unsigned seg) {
    struct aleph_hdr h;
    hdr_init(&h, o, ALEPH_RESULT, 0, s->iter, seg, 0xffffffffu, s->scale, seg_len(o->elems, seg));
    send_pkt(to, &h, s->result + seg * ALEPH_SEG_ELEMS);
}

static void node_send_up(const struct opts *o, const struct slotbuf *s, unsigned seg) {
    struct aleph_hdr h;
    hdr_init(&h, o, ALEPH_DATA, o->id, s->iter, seg, 1u << o->id, s->scale, seg_len(o->elems, seg));
    send_pkt(&o->parent, &h, s->sum + seg * ALEPH_SEG_ELEMS);
}

static int node(struct opts *o) {
    unsigned nseg = nseg_of(o->elems), n = o->children;
    uint32_t full = n == 32 ? 0xffffffffu : ((1u << n) - 1);
    struct slotbuf buf[2];
    for (int i = 0; i < 2; i++) {
        buf[i].bitmap = calloc(nseg, sizeof(uint32_t));
        buf[i].sum = calloc(o->elems, sizeof(int32_t));
        buf[i].result = o->has_parent ? calloc(o->elems, sizeof(int32_t)) : buf[i].sum;
        buf[i].have = calloc(nseg, 1);
        if (!buf[i].bitmap || !buf[i].sum || !buf[i].result || !buf[i].have)
            die("out of memory");
        slot_reset(&buf[i], 0, nseg, o->elems);
    }
    struct sockaddr_in child[ALEPH_MAX_CHILDREN];
    unsigned char child_known[ALEPH_MAX_CHILDREN] = {0};
    if (o->xdp) /* the children's DATA go to the XDP program, never here: their addresses are given */
        for (unsigned c = 0; c < n; c++) {
            const char *a = o->child_addrs;
            for (unsigned k = 0; k < c; k++)
                a = strchr(a, ',') + 1;
            char one[64];
            size_t len = strcspn(a, ",");
            if (len >= sizeof one)
                die("--child-addrs: an address is too long");
            memcpy(one, a, len);
            one[len] = 0;
            parse_addr(one, &child[c]);
            child_known[c] = 1;
        }
    int rc = 0, rto = o->rto_ms;
    unsigned cur = 0; /* iteration 0 is "complete": the first DATA of iteration 1 opens it */
    buf[0].known = nseg;
    /* last: any valid packet (linger ends after a quiet --linger-ms); progress: a new contribution, a result or an
     * opened iteration. Children NACKing this node are packets, not progress: were they to hold off its own NACKs,
     * a parent that missed one round could never be asked again while the children keep asking. */
    long long last = now_ms(), progress = last, last_nack = 0;
    unsigned char pkt[ALEPH_MAX_PACKET + 1];
    for (;;) {
        struct slotbuf *s = &buf[cur & 1];
        int done = cur == o->iters && s->known == nseg;
        long long t = now_ms();
        if (done && t - last >= o->linger_ms) {
            struct pollfd pf = {.fd = sock, .events = POLLIN};
            if (poll(&pf, 1, 0) <= 0) /* leave only with nothing queued: a descheduled node still counts all */
                break;
        }
        if (!done && t - progress >= o->max_idle_ms) {
            fprintf(stderr, "aleph_udp node: no progress for %d ms in iteration %u; giving up\n", o->max_idle_ms, cur);
            rc = 3;
            break;
        }
        /* an aggregator missing results asks its parent (it also answers its children's NACKs meanwhile) */
        if (o->has_parent && cur > 0 && s->known < nseg && t - progress >= rto && t - last_nack >= rto) {
            for (unsigned base = 0; base < nseg; base += ALEPH_NACK_SPAN) {
                uint32_t miss = 0;
                for (unsigned k = 0; k < ALEPH_NACK_SPAN && base + k < nseg; k++)
                    if (!s->have[base + k])
                        miss |= 1u << k;
                if (miss) {
                    struct aleph_hdr h;
                    hdr_init(&h, o, ALEPH_NACK, o->id, cur, base, miss, 0, 0);
                    send_pkt(&o->parent, &h, NULL);
                    C.nacks++;
                }
            }
            last_nack = t;
            rto = rto * 2 > RTO_MAX_MS ? RTO_MAX_MS : rto * 2; /* back off until a result arrives */
        }
        struct sockaddr_in from;
        ssize_t len = recv_pkt(pkt, &from, rto);
        if (len < 0)
            continue;
        if (o->drop > 0 && rnd() < o->drop) {
            C.injected++;
            continue;
        }
        struct aleph_hdr h;
        if (check_packet(pkt, len, o, n, &h) != 0)
            continue;
        if (o->xdp && h.type == ALEPH_DATA) { /* the XDP program adds DATA; this one went past it */
            C.unaggregated++;
            continue;
        }
        int from_parent = h.type == ALEPH_RESULT || h.type == ALEPH_RETX;
        if (from_parent && (!o->has_parent || !same_addr(&from, &o->parent))) {
            C.bad_addr++;
            continue;
        }
        if (!from_parent) { /* a child's address is learnt from its first valid packet and must not change */
            if (!child_known[h.src_id]) {
                child[h.src_id] = from;
                child_known[h.src_id] = 1;
            } else if (!same_addr(&child[h.src_id], &from)) {
                C.bad_addr++;
                continue;
            }
        }
        /* open the next iteration when a child has moved on (with XDP: or the parent's results have) and this one
         * is complete */
        if ((!from_parent || (o->xdp && h.type == ALEPH_RESULT)) && h.iteration == cur + 1 && s->known == nseg) {
            cur++;
            s = &buf[cur & 1];
            slot_reset(s, cur, nseg, o->elems);
            progress = now_ms();
        }
        last = now_ms();
        if (h.iteration != cur && !(h.type == ALEPH_NACK && h.iteration + 1 == cur)) {
            C.stale++;
            continue;
        }
        unsigned seg = h.segment;
        if (h.type == ALEPH_DATA) {
            C.data_rx++; /* valid DATA of this iteration (duplicates included) */
            if (s->scale_set && h.scale != s->scale) {
                C.bad_scale++;
                continue;
            }
            if (s->bitmap[seg] & h.bitmap) {
                C.dup++;
                continue;
            }
            s->scale = h.scale;
            s->scale_set = 1;
            progress = now_ms();
            const unsigned char *v = pkt + sizeof h;
            int32_t *dst = s->sum + seg * ALEPH_SEG_ELEMS;
            for (unsigned i = 0; i < h.count; i++) {
                int32_t x;
                memcpy(&x, v + 4u * i, 4);
                int64_t y = (int64_t)dst[i] + x;
                if (y > INT32_MAX || y < INT32_MIN) { /* headroom is the sender's duty; count, wrap like int32 */
                    C.overflow++;
                    y = (int32_t)(uint32_t)y;
                }
                dst[i] = (int32_t)y;
            }
            s->bitmap[seg] |= h.bitmap;
            if (s->bitmap[seg] == full) {
                if (o->has_parent) {
                    node_send_up(o, s, seg);
                } else {
                    s->have[seg] = 1;
                    s->known++;
                    for (unsigned c = 0; c < n; c++)
                        if (child_known[c])
                            node_send_result(o, &child[c], s, seg);
                }
            }
        } else if (h.type == ALEPH_RESULT) {
            if (s->have[seg]) {
                C.dup++;
                continue;
            }
            memcpy(s->result + seg * ALEPH_SEG_ELEMS, pkt + sizeof h, 4u * h.count);
            s->scale = h.scale;
            s->have[seg] = 1;
            s->known++;
            progress = now_ms();
            rto = o->rto_ms;
            for (unsigned c = 0; c < n; c++)
                if (child_known[c])
                    node_send_result(o, &child[c], s, seg);
        } else if (h.type == ALEPH_NACK) {
            C.nacks_rx++;
            struct slotbuf *q = &buf[h.iteration & 1];
            uint32_t want = 0;
            for (unsigned k = 0; k < ALEPH_NACK_SPAN && h.segment + k < nseg; k++) {
                if (!(h.bitmap & (1u << k)))
                    continue;
                unsigned sg = h.segment + k;
                if (q->have[sg]) {
                    node_send_result(o, &from, q, sg);
                    C.results_resent++;
                } else if (!(q->bitmap[sg] & (1u << h.src_id))) {
                    want |= 1u << k;
                }
            }
            if (want) {
                struct aleph_hdr r;
                hdr_init(&r, o, ALEPH_RETX, 0, h.iteration, h.segment, want, 0, 0);
                send_pkt(&from, &r, NULL);
                C.retx_req++;
            }
        } else if (o->xdp) { /* RETX from the parent: the sums are the program's; the children resend to it */
            for (unsigned c = 0; c < n; c++) {
                struct aleph_hdr r;
                hdr_init(&r, o, ALEPH_RETX, 0, h.iteration, h.segment, h.bitmap, 0, 0);
                send_pkt(&child[c], &r, NULL);
                C.retx_req++;
            }
        } else { /* RETX from the parent: resend the cluster sums it lacks (only complete ones exist to send) */
            for (unsigned k = 0; k < ALEPH_NACK_SPAN && h.segment + k < nseg; k++)
                if ((h.bitmap & (1u << k)) && s->bitmap[h.segment + k] == full) {
                    node_send_up(o, s, h.segment + k);
                    C.retx_data++;
                }
        }
    }
    for (int i = 0; i < 2; i++) {
        free(buf[i].bitmap);
        free(buf[i].sum);
        if (o->has_parent)
            free(buf[i].result);
        free(buf[i].have);
    }
    return rc;
}

/* ---------------------------------------------------------------- worker */

static int worker(struct opts *o) {
    unsigned nseg = nseg_of(o->elems);
    size_t total = (size_t)o->elems * o->iters;
    int32_t *in = malloc(total * 4), *out = malloc(total * 4);
    unsigned char *have = malloc(nseg);
    if (!in || !out || !have)
        die("out of memory");
    FILE *f = fopen(o->in, "rb");
    if (!f || fread(in, 4, total, f) != total)
        die("--in: cannot read iters * elems int32 values");
    fclose(f);
    if (o->wait_go) { /* start together with the other workers: the caller writes a line when all are up */
        char line[16];
        if (!fgets(line, sizeof line, stdin))
            die("--wait-go: stdin closed before the go line");
    }
    unsigned char pkt[ALEPH_MAX_PACKET + 1];
    for (unsigned it = 1; it <= o->iters; it++) {
        int32_t *mine = in + (size_t)(it - 1) * o->elems, *res = out + (size_t)(it - 1) * o->elems;
        memset(have, 0, nseg);
        unsigned known = 0;
        struct aleph_hdr h;
        for (unsigned sg = 0; sg < nseg; sg++) {
            hdr_init(&h, o, ALEPH_DATA, o->id, it, sg, 1u << o->id, o->scale, seg_len(o->elems, sg));
            send_pkt(&o->parent, &h, mine + sg * ALEPH_SEG_ELEMS);
        }
        long long last = now_ms(), progress = last;
        int rto = o->rto_ms;
        while (known < nseg) {
            if (now_ms() - progress >= o->max_idle_ms) {
                fprintf(stderr, "aleph_udp worker %u: no result for %d ms in iteration %u; giving up\n", o->id,
                        o->max_idle_ms, it);
                return 3;
            }
            struct sockaddr_in from;
            ssize_t len = recv_pkt(pkt, &from, (int)(last + rto - now_ms()));
            if (len < 0) {
                if (now_ms() - last < rto)
                    continue;
                for (unsigned base = 0; base < nseg; base += ALEPH_NACK_SPAN) {
                    uint32_t miss = 0;
                    for (unsigned k = 0; k < ALEPH_NACK_SPAN && base + k < nseg; k++)
                        if (!have[base + k])
                            miss |= 1u << k;
                    if (miss) {
                        hdr_init(&h, o, ALEPH_NACK, o->id, it, base, miss, 0, 0);
                        send_pkt(&o->parent, &h, NULL);
                        C.nacks++;
                    }
                }
                last = now_ms();
                rto = rto * 2 > RTO_MAX_MS ? RTO_MAX_MS : rto * 2; /* back off until a result arrives */
                continue;
            }
            if (o->drop > 0 && rnd() < o->drop) {
                C.injected++;
                continue;
            }
            if (check_packet(pkt, len, o, 0, &h) != 0)
                continue;
            if (!same_addr(&from, &o->parent)) {
                C.bad_addr++;
                continue;
            }
            if (h.iteration != it) {
                C.stale++;
                continue;
            }
            if (h.type == ALEPH_RESULT) {
                if (have[h.segment]) {
                    C.dup++;
                    continue;
                }
                memcpy(res + h.segment * ALEPH_SEG_ELEMS, pkt + sizeof h, 4u * h.count);
                have[h.segment] = 1;
                known++;
                last = progress = now_ms();
                rto = o->rto_ms;
            } else { /* RETX */
                for (unsigned k = 0; k < ALEPH_NACK_SPAN && h.segment + k < nseg; k++)
                    if (h.bitmap & (1u << k)) {
                        unsigned sg = h.segment + k;
                        struct aleph_hdr d;
                        hdr_init(&d, o, ALEPH_DATA, o->id, it, sg, 1u << o->id, o->scale, seg_len(o->elems, sg));
                        send_pkt(&o->parent, &d, mine + sg * ALEPH_SEG_ELEMS);
                        C.retx_data++;
                    }
            }
        }
    }
    /* all or nothing: a failed write leaves no half file under --out's name */
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%d", o->out, (int)getpid()) >= (int)sizeof tmp)
        die("--out: the path is too long");
    f = fopen(tmp, "wb");
    int ok = f && fwrite(out, 4, total, f) == total;
    ok = f && fflush(f) == 0 && fsync(fileno(f)) == 0 && ok;
    if ((f && fclose(f) != 0) || !ok || rename(tmp, o->out) != 0) {
        unlink(tmp);
        die("--out: cannot write the results");
    }
    free(in);
    free(out);
    free(have);
    return 0;
}

/* ---------------------------------------------------------------- command line */

static unsigned long parse_num(const char *name, const char *v, unsigned long lo, unsigned long hi) {
    char *end;
    errno = 0;
    unsigned long x = strtoul(v, &end, 10);
    if (errno || *end || v[0] == '-' || x < lo || x > hi) {
        fprintf(stderr, "aleph_udp: %s=%s must be an integer in [%lu, %lu]\n", name, v, lo, hi);
        exit(2);
    }
    return x;
}

static int parse_int(const char *name, const char *v, long lo, long hi) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || !*v || x < lo || x > hi) {
        fprintf(stderr, "aleph_udp: %s=%s must be an integer in [%ld, %ld]\n", name, v, lo, hi);
        exit(2);
    }
    return (int)x;
}

static void parse_addr(const char *v, struct sockaddr_in *a) {
    char host[256];
    const char *colon = strrchr(v, ':');
    if (!colon || (size_t)(colon - v) >= sizeof host) {
        fprintf(stderr, "aleph_udp: --parent=%s must be IPV4:PORT\n", v);
        exit(2);
    }
    memcpy(host, v, (size_t)(colon - v));
    host[colon - v] = 0;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_port = htons((uint16_t)parse_num("--parent port", colon + 1, 1, 65535));
    if (inet_pton(AF_INET, host, &a->sin_addr) != 1) {
        fprintf(stderr, "aleph_udp: --parent=%s: %s is not an IPv4 address\n", v, host);
        exit(2);
    }
}

int main(int argc, char **argv) {
    struct opts o = {.rto_ms = 20, .linger_ms = 300, .seed = 1, .max_idle_ms = 30000};
    if (argc < 2 || (strcmp(argv[1], "node") && strcmp(argv[1], "worker")))
        die("usage: aleph_udp node|worker --option value ... (see the header of aleph_udp.c)");
    o.node = !strcmp(argv[1], "node");
    for (int i = 2; i < argc; i += 2) {
        const char *k = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "aleph_udp: %s needs a value\n", k);
            return 2;
        }
        if (!strcmp(k, "--port")) o.port = (int)parse_num(k, v, 0, 65535);
        else if (!strcmp(k, "--children")) o.children = (unsigned)parse_num(k, v, 1, ALEPH_MAX_CHILDREN);
        else if (!strcmp(k, "--parent")) { parse_addr(v, &o.parent); o.has_parent = 1; }
        else if (!strcmp(k, "--id")) o.id = (unsigned)parse_num(k, v, 0, ALEPH_MAX_CHILDREN - 1);
        else if (!strcmp(k, "--job")) o.job = (unsigned)parse_num(k, v, 0, 65535);
        else if (!strcmp(k, "--elems")) o.elems = (unsigned)parse_num(k, v, 1, MAX_ELEMS);
        else if (!strcmp(k, "--iters")) o.iters = (unsigned)parse_num(k, v, 1, MAX_ITERS);
        else if (!strcmp(k, "--rto-ms")) o.rto_ms = (int)parse_num(k, v, 1, 60000);
        else if (!strcmp(k, "--linger-ms")) o.linger_ms = (int)parse_num(k, v, 0, 600000);
        else if (!strcmp(k, "--seed")) o.seed = parse_num(k, v, 0, (unsigned long)-1);
        else if (!strcmp(k, "--scale")) o.scale = parse_int(k, v, -100, 100);
        else if (!strcmp(k, "--max-idle-ms")) o.max_idle_ms = (int)parse_num(k, v, 1, 3600000);
        else if (!strcmp(k, "--wait-go")) o.wait_go = (int)parse_num(k, v, 0, 1);
        else if (!strcmp(k, "--xdp")) o.xdp = (int)parse_num(k, v, 0, 1);
        else if (!strcmp(k, "--child-addrs")) o.child_addrs = v;
        else if (!strcmp(k, "--in")) o.in = v;
        else if (!strcmp(k, "--out")) o.out = v;
        else if (!strcmp(k, "--drop")) {
            char *end;
            o.drop = strtod(v, &end);
            if (*end || !(o.drop >= 0 && o.drop < 1)) {
                fprintf(stderr, "aleph_udp: --drop=%s must be a probability in [0, 1)\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "aleph_udp: unknown option %s\n", k);
            return 2;
        }
    }
    if (!o.elems || !o.iters)
        die("--elems and --iters are required");
    if (o.node && !o.children)
        die("node: --children is required");
    if (!o.node && (!o.has_parent || !o.in || !o.out))
        die("worker: --parent, --in and --out are required");
    if (o.xdp || o.child_addrs) {
        unsigned commas = 0;
        for (const char *c = o.child_addrs ? o.child_addrs : ""; *c; c++)
            commas += *c == ',';
        if (!o.node || !o.has_parent || !o.xdp || !o.child_addrs || commas + 1 != o.children) {
            fprintf(stderr, "aleph_udp: --xdp 1 is an aggregator's (node with --parent) and needs --child-addrs "
                            "with --children=%u addresses, got %s\n",
                    o.children, o.child_addrs ? o.child_addrs : "none");
            return 2;
        }
        struct sockaddr_in tmp;
        for (const char *a = o.child_addrs; a; a = strchr(a, ',') ? strchr(a, ',') + 1 : NULL) {
            char one[64];
            size_t len = strcspn(a, ",");
            if (len == 0 || len >= sizeof one) {
                fprintf(stderr, "aleph_udp: --child-addrs=%s: an empty or overlong address\n", o.child_addrs);
                return 2;
            }
            memcpy(one, a, len);
            one[len] = 0;
            parse_addr(one, &tmp); /* exits naming the value when it is not IPV4:PORT */
        }
    }
    rng_state = o.seed * 0x9E3779B97F4A7C15ULL + 0x2545F4914F6CDD1DULL;
    if (!rng_state)
        rng_state = 1;
    sock = socket(AF_INET, SOCK_DGRAM, 0);
    if (sock < 0)
        die("socket() failed");
    int rcv = 8 << 20;
    setsockopt(sock, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof rcv);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons((uint16_t)o.port)};
    me.sin_addr.s_addr = htonl(INADDR_ANY);
    if (bind(sock, (struct sockaddr *)&me, sizeof me) != 0)
        die("bind() failed");
    socklen_t ml = sizeof me;
    getsockname(sock, (struct sockaddr *)&me, &ml);
    printf("port %u\n", ntohs(me.sin_port));
    fflush(stdout);
    int rc = o.node ? node(&o) : worker(&o);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
    printf("{\"role\": \"%s\", \"rx\": %llu, \"tx\": %llu, \"injected_drops\": %llu, \"dup\": %llu, \"stale\": %llu, "
           "\"overflow\": %llu, \"nacks\": %llu, \"retx_requests\": %llu, \"retx_data\": %llu, "
           "\"results_resent\": %llu, \"unaggregated\": %llu, \"nacks_rx\": %llu, \"data_rx\": %llu, "
           "\"cpu_s\": %.6f, "
           "\"bad\": {\"len\": %llu, \"magic\": %llu, \"version\": %llu, "
           "\"type\": %llu, \"job\": %llu, \"src\": %llu, \"seg\": %llu, \"count\": %llu, \"scale\": %llu, "
           "\"flags\": %llu, \"addr\": %llu, \"iter\": %llu}}\n",
           o.node ? (o.has_parent ? "aggregator" : "ps") : "worker", C.rx, C.tx, C.injected, C.dup, C.stale,
           C.overflow, C.nacks, C.retx_req, C.retx_data, C.results_resent, C.unaggregated, C.nacks_rx, C.data_rx,
           cpu, C.bad_len, C.bad_magic, C.bad_version, C.bad_type, C.bad_job, C.bad_src, C.bad_seg, C.bad_count, C.bad_scale, C.bad_flags,
           C.bad_addr, C.bad_iter);
    return rc;
}
