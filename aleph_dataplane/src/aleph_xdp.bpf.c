/* ALEPH data plane, tier 2: an XDP aggregator (seed 002 §4-5; digest research/002-aleph.md §5.4 tier 2).
 *
 * Attached to an aggregator's interface, it sums its children's DATA packets in the kernel, before the socket layer:
 * per segment a slot holds the iteration, the bitmap of children added and the int32 running sums; the packet that
 * completes a segment is rewritten in place into this aggregator's DATA packet for its parent (Ethernet, IPv4 and UDP
 * addresses from the config map, the cluster sum as payload) and sent back out with XDP_TX. Every other DATA packet
 * is consumed (XDP_DROP after it is added). A child's DATA for a segment that is already complete (sent again on a
 * RETX that the parent's NACK caused) sends the stored sum up again. The wire format is the UDP tier's (include/aleph_wire.h), so the parent
 * can be the userspace node (src/aleph_udp.c) or another XDP aggregator.
 *
 * Scope (what stays in userspace, XDP_PASS): RESULT packets (the result fan-out, one packet in and k out, is not
 * implemented here: the seed's Gradient Forwarder does it in XDP, Sec. 5.4, XDP_Multiredirect with one veth per
 * destination; bpf_redirect_map with BPF_F_BROADCAST over a devmap would be the way, digest §5.2 #6), NACK and RETX
 * packets (per-hop reliability), non-IPv4, IP options and fragments, other UDP ports. The PS's aggregation and the
 * workers' Gradient Receiver (both XDP in the seed, Sec. 5.3 and 5.5) are not XDP roles here either: they run in
 * tier 1's userspace node and worker. The slots map is readable from userspace (a RETX can be answered from it).
 *
 * Bounds (the verifier insists, and the network is not trusted): every header is checked against data_end before it
 * is read; for a packet addressed to the ALEPH port every field is checked as check_packet() in aleph_udp.c does
 * (length, magic, version, type, job, flags, iteration range, src id, segment range, count vs the segment's length,
 * UDP length vs count, one scale per iteration); a packet that fails is dropped and counted by reason, never added.
 * Then, as the userspace node does, the DATA's source (IPv4 address and UDP port) must be its child id's: the loader
 * gives the children's addresses when it knows them (--child-addrs, the relay's list), else an id is pinned to the
 * source of its first DATA that passes the checks; a DATA for that id from another source is dropped and counted
 * (bad_addr), so a host on the children's network that spoofs an id cannot add to a sum. The pin is taken under the
 * id's bpf_spin_lock: of two first packets from different sources on two CPUs exactly one pins the id.
 * A duplicate (its bit already set) is dropped and counted: no double counting. Values are added in 64 bits and an
 * int32 overflow is counted (the sender's scale leaves log2(n) headroom bits; digest §5.2 #1).
 *
 * Concurrency: a slot's update (iteration check, bitmap, sums) runs under the slot's bpf_spin_lock, so packets of
 * one segment on several CPUs are added one at a time and exactly one of them completes the segment.
 */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

#include "aleph_wire.h"

#define ALEPH_XDP_MAX_SEGMENTS 8192u /* 1 Mi values per iteration per aggregator */

/* counters (per CPU); aleph_xdp_run.c and flowlane/aleph/xdp.py name them in this order */
enum {
    C_RX,         /* packets to the ALEPH port */
    C_ADDED,      /* DATA packets added to a slot */
    C_TX_UP,      /* completed segments sent to the parent (XDP_TX) */
    C_PASS,       /* ALEPH packets handed to userspace (RESULT, NACK, RETX) */
    C_BAD_LEN,    /* datagram shorter than the header, longer than a packet, or not header + 4 x count */
    C_BAD_MAGIC,
    C_BAD_VERSION,
    C_BAD_TYPE,
    C_BAD_JOB,
    C_BAD_FLAGS,
    C_BAD_ITER,   /* 0 or above the configured iterations */
    C_BAD_SRC,    /* src id not a child, or a DATA bitmap other than 1 << src id */
    C_BAD_SEG,    /* segment beyond the configured elements */
    C_BAD_COUNT,  /* count is not the segment's length */
    C_BAD_SCALE,  /* a second fixed-point exponent within one slot's iteration */
    C_DUP,        /* this child's bit is already set */
    C_STALE,      /* iteration other than the slot's (or its successor once the slot is complete) */
    C_OVERFLOW,   /* an int32 sum overflowed (counted, wraps as in the userspace tier) */
    C_NOT_CONFIGURED,
    C_RESENT_UP,  /* a child's DATA again for a complete segment: the cluster sum is sent up again (XDP_TX) */
    C_BAD_ADDR,   /* a DATA from a source other than its child id's (given by the loader or pinned by its first) */
    C_NCOUNTERS
};

struct aleph_xdp_cfg { /* written by the loader before attaching; all multi-byte addresses in network order */
    __u32 configured;  /* 1 once the loader has filled it */
    __u16 port;        /* the ALEPH UDP port (host order) */
    __u16 job;         /* job id accepted */
    __u32 iters;       /* iterations accepted: 1..iters */
    __u32 elems;       /* values per iteration (segments of ALEPH_SEG_ELEMS, the last one shorter) */
    __u32 nchildren;   /* children of this aggregator: src ids 0..nchildren-1 */
    __u32 my_id;       /* this aggregator's src id at its parent */
    __u32 parent_ip;   /* network order */
    __u16 parent_port; /* network order */
    __u8 parent_mac[ETH_ALEN];
};

struct slot {
    struct bpf_spin_lock lock;
    __u32 iteration; /* 0: never used */
    __u32 bitmap;    /* children added in this iteration */
    __s32 scale;
    __s32 sum[ALEPH_SEG_ELEMS];
};

struct child_addr { /* the source a child id's DATA must come from (aleph_udp.c's child[] / child_known[]) */
    struct bpf_spin_lock lock;
    __u32 ip;     /* network order */
    __u16 port;   /* network order */
    __u16 pinned; /* 1: given by the loader, or taken by the id's first DATA */
};

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, struct aleph_xdp_cfg);
} aleph_cfg SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, ALEPH_XDP_MAX_SEGMENTS);
    __type(key, __u32);
    __type(value, struct slot);
} aleph_slots SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, ALEPH_MAX_CHILDREN);
    __type(key, __u32);
    __type(value, struct child_addr);
} aleph_children SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
    __uint(max_entries, C_NCOUNTERS);
    __type(key, __u32);
    __type(value, __u64);
} aleph_counters SEC(".maps");

static __always_inline int count(__u32 reason, int verdict) {
    __u64 *c = bpf_map_lookup_elem(&aleph_counters, &reason);
    if (c)
        *c += 1;
    return verdict;
}

static __always_inline __u16 ip_checksum(struct iphdr *ip) {
    __u32 s = 0;
    __u16 *w = (__u16 *)ip;
    ip->check = 0;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(*ip) / 2); i++)
        s += w[i];
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    return (__u16)~s;
}

SEC("xdp")
int aleph_xdp(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data;
    void *data_end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
        return XDP_PASS;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl != 5 || ip->protocol != IPPROTO_UDP)
        return XDP_PASS;
    if (ip->frag_off & bpf_htons(0x3fff)) /* a fragment (MF or offset): the UDP header is not all here */
        return XDP_PASS;
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > data_end)
        return XDP_PASS;
    __u32 zero = 0;
    struct aleph_xdp_cfg *cfg = bpf_map_lookup_elem(&aleph_cfg, &zero);
    if (!cfg)
        return XDP_PASS;
    if (udp->dest != bpf_htons(cfg->port))
        return XDP_PASS;
    if (!cfg->configured)
        return count(C_NOT_CONFIGURED, XDP_PASS);
    count(C_RX, 0);

    /* the datagram: UDP length against the header, the packet and the largest ALEPH packet */
    __u32 ulen = bpf_ntohs(udp->len);
    struct aleph_hdr *h = (void *)(udp + 1);
    if (ulen < sizeof(*udp) + sizeof(*h) || ulen > sizeof(*udp) + ALEPH_MAX_PACKET ||
        (void *)udp + ulen > data_end || (void *)(h + 1) > data_end)
        return count(C_BAD_LEN, XDP_DROP);
    __u32 dlen = ulen - sizeof(*udp);
    if (h->magic != ALEPH_MAGIC)
        return count(C_BAD_MAGIC, XDP_DROP);
    if (h->version != ALEPH_VERSION)
        return count(C_BAD_VERSION, XDP_DROP);
    if (h->type < ALEPH_DATA || h->type > ALEPH_RETX)
        return count(C_BAD_TYPE, XDP_DROP);
    if (h->job_id != cfg->job)
        return count(C_BAD_JOB, XDP_DROP);
    if (h->flags != 0)
        return count(C_BAD_FLAGS, XDP_DROP);
    if (h->iteration == 0 || h->iteration > cfg->iters)
        return count(C_BAD_ITER, XDP_DROP);
    if (h->type != ALEPH_DATA) /* RESULT / NACK / RETX: the userspace node's (checks again there) */
        return count(C_PASS, XDP_PASS);
    __u32 nch = cfg->nchildren;
    if (nch == 0 || nch > ALEPH_MAX_CHILDREN || h->src_id >= nch || h->bitmap != (1u << (h->src_id & 31)))
        return count(C_BAD_SRC, XDP_DROP);
    __u32 elems = cfg->elems;
    __u32 nseg = (elems + ALEPH_SEG_ELEMS - 1) / ALEPH_SEG_ELEMS;
    __u32 seg = h->segment;
    if (seg >= nseg || seg >= ALEPH_XDP_MAX_SEGMENTS)
        return count(C_BAD_SEG, XDP_DROP);
    __u32 seglen = elems - seg * ALEPH_SEG_ELEMS;
    if (seglen > ALEPH_SEG_ELEMS)
        seglen = ALEPH_SEG_ELEMS;
    if (h->count != seglen)
        return count(C_BAD_COUNT, XDP_DROP);
    if (dlen != sizeof(*h) + 4u * h->count)
        return count(C_BAD_LEN, XDP_DROP);

    /* the source must be the child id's: pinned by its first valid DATA unless the loader gave it (as tier 1) */
    __u32 cid = h->src_id, saddr = ip->saddr;
    __u16 sport = udp->source;
    struct child_addr *ca = bpf_map_lookup_elem(&aleph_children, &cid);
    if (!ca)
        return count(C_BAD_SRC, XDP_DROP);
    int foreign = 0;
    bpf_spin_lock(&ca->lock);
    if (!ca->pinned) {
        ca->ip = saddr;
        ca->port = sport;
        ca->pinned = 1;
    } else
        foreign = ca->ip != saddr || ca->port != sport;
    bpf_spin_unlock(&ca->lock);
    if (foreign)
        return count(C_BAD_ADDR, XDP_DROP);

    struct slot *s = bpf_map_lookup_elem(&aleph_slots, &seg);
    if (!s)
        return count(C_BAD_SEG, XDP_DROP);
    __u32 full = nch >= 32 ? 0xffffffffu : (1u << nch) - 1;
    __u32 bit = h->bitmap, iter = h->iteration, n = h->count;
    __s32 *vals = (void *)(h + 1);
    int reason = -1, done = 0, overflow = 0, resend = 0;
    bpf_spin_lock(&s->lock);
    if (iter == s->iteration + 1 && (s->iteration == 0 || s->bitmap == full)) { /* open the next iteration */
        s->iteration = iter;
        s->bitmap = 0;
        s->scale = h->scale;
        for (__u32 i = 0; i < ALEPH_SEG_ELEMS; i++)
            s->sum[i] = 0;
    }
    if (iter != s->iteration)
        reason = C_STALE;
    else if ((s->bitmap & bit) && s->bitmap == full) {
        /* the segment is complete and a child sends its DATA again: it was asked to (a RETX relayed from the
         * parent, which lacks this aggregator's sum: the XDP_TX frame was lost), so the sum goes up again. Not
         * added; the parent's bitmap refuses it if the first copy did arrive. */
        resend = 1;
        for (__u32 i = 0; i < ALEPH_SEG_ELEMS; i++) {
            if (i >= n || (void *)(vals + i + 1) > data_end)
                break;
            vals[i] = s->sum[i];
        }
    } else if (s->bitmap & bit)
        reason = C_DUP;
    else if (s->bitmap && s->scale != h->scale)
        reason = C_BAD_SCALE;
    else {
        s->scale = h->scale;
        for (__u32 i = 0; i < ALEPH_SEG_ELEMS; i++) {
            if (i >= n || (void *)(vals + i + 1) > data_end)
                break;
            __s64 y = (__s64)s->sum[i] + vals[i];
            if (y > 2147483647LL || y < -2147483648LL)
                overflow = 1;
            s->sum[i] = (__s32)y;
        }
        s->bitmap |= bit;
        if (s->bitmap == full) { /* this packet completes the segment: it carries the cluster sum up */
            done = 1;
            for (__u32 i = 0; i < ALEPH_SEG_ELEMS; i++) {
                if (i >= n || (void *)(vals + i + 1) > data_end)
                    break;
                vals[i] = s->sum[i];
            }
        }
    }
    bpf_spin_unlock(&s->lock);
    if (reason >= 0)
        return count(reason, XDP_DROP);
    if (resend)
        count(C_RESENT_UP, 0);
    else {
        if (overflow)
            count(C_OVERFLOW, 0);
        count(C_ADDED, 0);
        if (!done)
            return XDP_DROP; /* added; the packet itself is consumed */
    }

    /* rewrite into this aggregator's DATA packet for the parent: ours as the source, the parent as the destination */
    h->src_id = (__u16)cfg->my_id;
    h->bitmap = 1u << (cfg->my_id & 31);
    __builtin_memcpy(eth->h_source, eth->h_dest, ETH_ALEN);
    __builtin_memcpy(eth->h_dest, cfg->parent_mac, ETH_ALEN);
    ip->saddr = ip->daddr;
    ip->daddr = cfg->parent_ip;
    ip->ttl = 64;
    ip->check = ip_checksum(ip);
    udp->source = udp->dest;
    udp->dest = cfg->parent_port;
    udp->check = 0; /* optional over IPv4 */
    return count(C_TX_UP, XDP_TX);
}

/* For the veth peer of an interface running aleph_xdp: a veth delivers XDP_TX frames to its peer only when the peer's
 * NAPI is on, i.e. when the peer has an XDP program (or GRO) -- this one passes every frame to the stack. */
SEC("xdp")
int aleph_xdp_pass(struct xdp_md *ctx) {
    (void)ctx;
    return XDP_PASS;
}

char LICENSE[] SEC("license") = "GPL"; /* bpf_spin_lock is a GPL-only helper */
