/* ALEPH data plane wire format (seed 002 §5; digest research/002-aleph.md §2.7 "[ours] Proposed header", §5.2).
 *
 * One UDP datagram = one header + `count` little-endian int32 fixed-point values. Every tier (the userspace
 * aggregator in src/aleph_udp.c, the XDP aggregator in src/aleph_xdp.bpf.c) uses this header;
 * flowlane/aleph/wire.py mirrors it and tests/test_aleph_udp.py parses this file to pin the two together.
 *
 * Types:
 *   DATA    child -> parent: a segment of the child's contribution (a worker's gradient, an aggregator's cluster sum)
 *   RESULT  parent -> child: a segment of the global sum (the PS's multicast, relayed by aggregators)
 *   NACK    child -> parent: "these result segments are missing": bitmap over segments [segment, segment + 32)
 *   RETX    parent -> child: "resend your DATA for these segments" (same bitmap layout)
 *
 * Every field from the network is checked before use (aleph_udp.c: check_packet); a packet that fails is dropped and
 * counted by reason, never trusted.
 */
#ifndef ALEPH_WIRE_H
#define ALEPH_WIRE_H

#if defined(__bpf__) /* the XDP tier (src/aleph_xdp.bpf.c): no libc headers for the BPF target */
#include <linux/types.h>
typedef __s8 int8_t;
typedef __u8 uint8_t;
typedef __u16 uint16_t;
typedef __u32 uint32_t;
#else
#include <stdint.h>
#endif

#define ALEPH_MAGIC 0xA1E9u
#define ALEPH_VERSION 1u
#define ALEPH_SEG_ELEMS 128u   /* gradients per packet: "each buffer holding 128 gradients" (Sec. 4.2) */
#define ALEPH_MAX_CHILDREN 32u /* the bitmap is 32 bits (paper: 16, digest §5.2 #9) */
#define ALEPH_NACK_SPAN 32u    /* segments covered by one NACK / RETX bitmap */

enum aleph_type { ALEPH_DATA = 1, ALEPH_RESULT = 2, ALEPH_NACK = 3, ALEPH_RETX = 4 };

struct __attribute__((packed)) aleph_hdr {
    uint16_t magic;     /* ALEPH_MAGIC */
    uint8_t version;    /* ALEPH_VERSION */
    uint8_t type;       /* enum aleph_type */
    uint16_t job_id;    /* several jobs may share an aggregator port */
    uint16_t src_id;    /* the sender's local id at the receiver (child index), 0 from a parent */
    uint32_t iteration; /* >= 1; resets slots and rejects stale or early packets (digest §5.2 #4) */
    uint32_t segment;   /* DATA/RESULT: segment index; NACK/RETX: first segment of the bitmap window */
    uint32_t bitmap;    /* DATA: 1 << src_id; RESULT: all ones; NACK/RETX: segments [segment, segment+32) */
    int8_t scale;       /* fixed-point exponent k: value = int / 2^k, the same for every contribution of an iteration */
    uint8_t flags;      /* reserved, must be 0 */
    uint16_t count;     /* int32 values after the header: the segment's length for DATA/RESULT, 0 for NACK/RETX */
};

_Static_assert(sizeof(struct aleph_hdr) == 24, "aleph_hdr is 24 bytes on the wire");

#define ALEPH_MAX_PACKET (sizeof(struct aleph_hdr) + 4u * ALEPH_SEG_ELEMS)

#endif
