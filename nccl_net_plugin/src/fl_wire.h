/*
 * fl_wire.h - flowlane's on-wire formats and their parsers.
 *
 * Everything read from a peer goes through these decoders first; they are
 * pure (no sockets, no globals) so the fuzzer (fuzz/fuzz_wire.c) drives them
 * directly. All integers are little-endian on the wire.
 */
#ifndef FL_WIRE_H
#define FL_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "flowlane_net.h"

#define FL_SECRET_BYTES 16

/* ---- connection handle (listen() fills it, NCCL ships it out of band) ---- */
#define FL_HANDLE_MAGIC 0x444C4846u /* "FHLD" */
#define FL_HANDLE_MAX_ADDRS FL_MAX_PATHS
#define FL_HANDLE_ADDR_BYTES 20
#define FL_HANDLE_STATE_OFFSET 104 /* connector-local resume slot, see fl_transport.c */
#define FL_HANDLE_BYTES 112

struct fl_wire_addr {
  uint16_t family; /* 4 or 6 */
  uint16_t port;   /* host order */
  uint8_t addr[16];
};

struct fl_handle {
  uint16_t version;
  uint16_t naddrs;
  uint8_t secret[FL_SECRET_BYTES];
  struct fl_wire_addr addrs[FL_HANDLE_MAX_ADDRS];
};

/* ---- handshake: first bytes on every path socket, connector -> listener ---- */
#define FL_HELLO_MAGIC 0x484E4C46u /* "FLNH" */
#define FL_HELLO_BYTES 64

struct fl_hello {
  uint16_t version;
  uint8_t secret[FL_SECRET_BYTES];
  uint64_t conn_id;     /* random, groups the paths of one connection */
  uint16_t path_index;
  uint16_t npaths;
  uint8_t traffic_class;
};

/* ---- frames after the handshake (both directions) ---- */
#define FL_FRAME_MAGIC 0xF17Au
#define FL_FRAME_HDR_BYTES 32
#define FL_MAX_CHUNK_BYTES (16u << 20)       /* upper bound a peer may announce */
#define FL_CTS_ENTRY_BYTES 16

enum fl_frame_type {
  FL_FRAME_DATA = 1, /* sender -> receiver: one sub-chunk of a message */
  FL_FRAME_CTS = 2,  /* receiver -> sender: a posted (multi-)receive */
  FL_FRAME_ACK = 3,  /* receiver -> sender: a sub-chunk fully arrived on this path */
};

struct fl_frame {
  uint8_t type;
  uint8_t index;   /* DATA: receive index within the group; CTS: n */
  uint32_t seq;    /* DATA/CTS: receive-slot sequence; ACK: chunk id */
  uint64_t offset; /* DATA: byte offset in the message */
  uint32_t length; /* payload bytes that follow the header */
  uint32_t aux;    /* DATA: chunk id; ACK: receiver dwell in ns (our t4-t3, fl_leo.h) */
  uint64_t total;  /* DATA: size of the whole message */
};

struct fl_cts_entry {
  int32_t tag;
  uint64_t size;
};

/* Decoders return 0 on success, -1 on a malformed input with a message in err. */
void fl_handle_encode(uint8_t out[FL_HANDLE_BYTES], const struct fl_handle* h);
int fl_handle_decode(const uint8_t* buf, size_t len, struct fl_handle* out, char* err, size_t errlen);

void fl_hello_encode(uint8_t out[FL_HELLO_BYTES], const struct fl_hello* h);
int fl_hello_decode(const uint8_t* buf, size_t len, struct fl_hello* out, char* err, size_t errlen);
/* Checks version and secret (constant time) against what listen() issued. */
int fl_hello_accept(const struct fl_hello* h, const uint8_t secret[FL_SECRET_BYTES], char* err, size_t errlen);

void fl_frame_encode(uint8_t out[FL_FRAME_HDR_BYTES], const struct fl_frame* f);
int fl_frame_decode(const uint8_t* buf, size_t len, struct fl_frame* out, char* err, size_t errlen);

void fl_cts_encode(uint8_t* out, const struct fl_cts_entry* e, int n);
int fl_cts_decode(const uint8_t* buf, size_t len, int n, struct fl_cts_entry* out, char* err, size_t errlen);

#endif /* FL_WIRE_H */
