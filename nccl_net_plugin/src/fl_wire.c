/* fl_wire.c - encoders and bounds-checked decoders for flowlane's wire formats. */
#include "fl_wire.h"

#include <stdio.h>
#include <string.h>

static void put16(uint8_t* p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static void put64(uint8_t* p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i)); }
static uint16_t get16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

#define FAIL(...)                                   \
  do {                                              \
    if (err && errlen) snprintf(err, errlen, __VA_ARGS__); \
    return -1;                                      \
  } while (0)

_Static_assert(FL_HANDLE_BYTES <= 128, "flowlane handle must fit NCCL_NET_HANDLE_MAXSIZE");
_Static_assert(24 + FL_HANDLE_MAX_ADDRS * FL_HANDLE_ADDR_BYTES <= FL_HANDLE_STATE_OFFSET, "handle layout overlaps");

void fl_handle_encode(uint8_t out[FL_HANDLE_BYTES], const struct fl_handle* h) {
  memset(out, 0, FL_HANDLE_BYTES);
  put32(out, FL_HANDLE_MAGIC);
  put16(out + 4, h->version);
  put16(out + 6, h->naddrs);
  memcpy(out + 8, h->secret, FL_SECRET_BYTES);
  for (int i = 0; i < h->naddrs && i < FL_HANDLE_MAX_ADDRS; i++) {
    uint8_t* a = out + 24 + i * FL_HANDLE_ADDR_BYTES;
    put16(a, h->addrs[i].family);
    put16(a + 2, h->addrs[i].port);
    memcpy(a + 4, h->addrs[i].addr, 16);
  }
}

int fl_handle_decode(const uint8_t* buf, size_t len, struct fl_handle* out, char* err, size_t errlen) {
  if (len < FL_HANDLE_BYTES) FAIL("handle too short: %zu bytes, need %d", len, FL_HANDLE_BYTES);
  uint32_t magic = get32(buf);
  if (magic != FL_HANDLE_MAGIC) FAIL("handle magic 0x%08x is not flowlane's 0x%08x", magic, FL_HANDLE_MAGIC);
  memset(out, 0, sizeof(*out));
  out->version = get16(buf + 4);
  if (out->version != FL_NET_VERSION) FAIL("handle version %u, this plugin speaks %d", out->version, FL_NET_VERSION);
  out->naddrs = get16(buf + 6);
  if (out->naddrs < 1 || out->naddrs > FL_HANDLE_MAX_ADDRS)
    FAIL("handle lists %u addresses, expected 1..%d", out->naddrs, FL_HANDLE_MAX_ADDRS);
  memcpy(out->secret, buf + 8, FL_SECRET_BYTES);
  for (int i = 0; i < out->naddrs; i++) {
    const uint8_t* a = buf + 24 + i * FL_HANDLE_ADDR_BYTES;
    out->addrs[i].family = get16(a);
    out->addrs[i].port = get16(a + 2);
    memcpy(out->addrs[i].addr, a + 4, 16);
    if (out->addrs[i].family != 4 && out->addrs[i].family != 6)
      FAIL("handle address %d has family %u, expected 4 or 6", i, out->addrs[i].family);
    if (out->addrs[i].port == 0) FAIL("handle address %d has port 0", i);
  }
  return 0;
}

void fl_hello_encode(uint8_t out[FL_HELLO_BYTES], const struct fl_hello* h) {
  memset(out, 0, FL_HELLO_BYTES);
  put32(out, FL_HELLO_MAGIC);
  put16(out + 4, h->version);
  put16(out + 6, FL_HELLO_BYTES);
  memcpy(out + 8, h->secret, FL_SECRET_BYTES);
  put64(out + 24, h->conn_id);
  put16(out + 32, h->path_index);
  put16(out + 34, h->npaths);
  out[36] = h->traffic_class;
}

int fl_hello_decode(const uint8_t* buf, size_t len, struct fl_hello* out, char* err, size_t errlen) {
  if (len < FL_HELLO_BYTES) FAIL("hello too short: %zu bytes, need %d", len, FL_HELLO_BYTES);
  uint32_t magic = get32(buf);
  if (magic != FL_HELLO_MAGIC) FAIL("hello magic 0x%08x is not flowlane's 0x%08x", magic, FL_HELLO_MAGIC);
  uint16_t hlen = get16(buf + 6);
  if (hlen != FL_HELLO_BYTES) FAIL("hello announces %u bytes, expected %d", hlen, FL_HELLO_BYTES);
  memset(out, 0, sizeof(*out));
  out->version = get16(buf + 4);
  memcpy(out->secret, buf + 8, FL_SECRET_BYTES);
  out->conn_id = get64(buf + 24);
  out->path_index = get16(buf + 32);
  out->npaths = get16(buf + 34);
  out->traffic_class = buf[36];
  if (out->npaths < 1 || out->npaths > FL_MAX_PATHS) FAIL("hello npaths %u outside 1..%d", out->npaths, FL_MAX_PATHS);
  if (out->path_index >= out->npaths) FAIL("hello path index %u >= npaths %u", out->path_index, out->npaths);
  if (out->traffic_class >= FL_NUM_CLASSES)
    FAIL("hello traffic class %u outside 0..%d", out->traffic_class, FL_NUM_CLASSES - 1);
  return 0;
}

int fl_hello_accept(const struct fl_hello* h, const uint8_t secret[FL_SECRET_BYTES], char* err, size_t errlen) {
  if (h->version != FL_NET_VERSION) FAIL("peer speaks protocol version %u, we speak %d", h->version, FL_NET_VERSION);
  uint8_t diff = 0; /* constant-time compare: do not leak how many bytes matched */
  for (int i = 0; i < FL_SECRET_BYTES; i++) diff |= (uint8_t)(h->secret[i] ^ secret[i]);
  if (diff != 0) FAIL("peer did not present the secret from this listen() handle");
  return 0;
}

void fl_frame_encode(uint8_t out[FL_FRAME_HDR_BYTES], const struct fl_frame* f) {
  put16(out, FL_FRAME_MAGIC);
  out[2] = f->type;
  out[3] = f->index;
  put32(out + 4, f->seq);
  put64(out + 8, f->offset);
  put32(out + 16, f->length);
  put32(out + 20, f->aux);
  put64(out + 24, f->total);
}

int fl_frame_decode(const uint8_t* buf, size_t len, struct fl_frame* out, char* err, size_t errlen) {
  if (len < FL_FRAME_HDR_BYTES) FAIL("frame header too short: %zu bytes, need %d", len, FL_FRAME_HDR_BYTES);
  uint16_t magic = get16(buf);
  if (magic != FL_FRAME_MAGIC) FAIL("frame magic 0x%04x is not 0x%04x", magic, FL_FRAME_MAGIC);
  out->type = buf[2];
  out->index = buf[3];
  out->seq = get32(buf + 4);
  out->offset = get64(buf + 8);
  out->length = get32(buf + 16);
  out->aux = get32(buf + 20);
  out->total = get64(buf + 24);
  switch (out->type) {
    case FL_FRAME_DATA:
      if (out->index >= FL_MAX_RECVS) FAIL("data frame receive index %u >= %d", out->index, FL_MAX_RECVS);
      if (out->length > FL_MAX_CHUNK_BYTES) FAIL("data frame length %u exceeds %u", out->length, FL_MAX_CHUNK_BYTES);
      if (out->total > (uint64_t)1 << 40) FAIL("data frame message size %llu exceeds 1 TiB", (unsigned long long)out->total);
      if (out->offset > out->total || out->length > out->total - out->offset)
        FAIL("data frame [%llu, +%u) lies outside a %llu-byte message", (unsigned long long)out->offset, out->length,
             (unsigned long long)out->total);
      return 0;
    case FL_FRAME_CTS:
      if (out->index < 1 || out->index > FL_MAX_RECVS) FAIL("CTS frame n=%u outside 1..%d", out->index, FL_MAX_RECVS);
      if (out->length != (uint32_t)out->index * FL_CTS_ENTRY_BYTES)
        FAIL("CTS frame length %u != n(%u) * %d", out->length, out->index, FL_CTS_ENTRY_BYTES);
      return 0;
    case FL_FRAME_ACK:
      if (out->length != 0) FAIL("ACK frame carries %u payload bytes, expected 0", out->length);
      return 0;
    default:
      FAIL("unknown frame type %u", out->type);
  }
}

void fl_cts_encode(uint8_t* out, const struct fl_cts_entry* e, int n) {
  for (int i = 0; i < n; i++) {
    put32(out + i * FL_CTS_ENTRY_BYTES, (uint32_t)e[i].tag);
    put32(out + i * FL_CTS_ENTRY_BYTES + 4, 0);
    put64(out + i * FL_CTS_ENTRY_BYTES + 8, e[i].size);
  }
}

int fl_cts_decode(const uint8_t* buf, size_t len, int n, struct fl_cts_entry* out, char* err, size_t errlen) {
  if (n < 1 || n > FL_MAX_RECVS) FAIL("CTS n=%d outside 1..%d", n, FL_MAX_RECVS);
  if (len < (size_t)n * FL_CTS_ENTRY_BYTES) FAIL("CTS payload %zu bytes, need %d", len, n * FL_CTS_ENTRY_BYTES);
  for (int i = 0; i < n; i++) {
    out[i].tag = (int32_t)get32(buf + i * FL_CTS_ENTRY_BYTES);
    out[i].size = get64(buf + i * FL_CTS_ENTRY_BYTES + 8);
    if (out[i].size > (uint64_t)1 << 40) FAIL("CTS entry %d posts %llu bytes, above 1 TiB", i, (unsigned long long)out[i].size);
  }
  return 0;
}
