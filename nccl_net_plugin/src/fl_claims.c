/* fl_claims.c - byte-range claims of DATA frames (contract in fl_claims.h). */
#include "fl_claims.h"

#include <stdio.h>

#define FAIL(...)                                          \
  do {                                                     \
    if (err && errlen) snprintf(err, errlen, __VA_ARGS__); \
    return -1;                                             \
  } while (0)

static int same_entry(const struct fl_claim_extent* e, uint32_t seq, uint8_t index) {
  return e->end != 0 && e->seq == seq && e->index == index;
}

int fl_claim(struct fl_claims* cl, uint32_t seq, uint8_t index, uint64_t* prefix, uint64_t total, uint64_t offset,
             uint64_t length, char* err, size_t errlen) {
  if (offset > total || length > total - offset)
    FAIL("range [%llu, +%llu) lies outside the %llu-byte message", (unsigned long long)offset,
         (unsigned long long)length, (unsigned long long)total);
  if (length == 0) return 0;
  uint64_t end = offset + length;
  if (offset < *prefix)
    FAIL("range [%llu, %llu) overlaps bytes [0, %llu) already claimed", (unsigned long long)offset,
         (unsigned long long)end, (unsigned long long)*prefix);
  struct fl_claim_extent* before = NULL; /* extent ending exactly at offset */
  struct fl_claim_extent* after = NULL;  /* extent starting exactly at end */
  struct fl_claim_extent* free_slot = NULL;
  for (int k = 0; k < FL_CLAIM_EXTENTS; k++) {
    struct fl_claim_extent* e = &cl->ext[k];
    if (e->end == 0) {
      if (!free_slot) free_slot = e;
      continue;
    }
    if (!same_entry(e, seq, index)) continue;
    if (offset < e->end && e->start < end)
      FAIL("range [%llu, %llu) overlaps [%llu, %llu) already claimed", (unsigned long long)offset,
           (unsigned long long)end, (unsigned long long)e->start, (unsigned long long)e->end);
    if (e->end == offset) before = e;
    if (e->start == end) after = e;
  }
  if (offset == *prefix) { /* extends the prefix, possibly up to the next extent */
    *prefix = end;
    if (after) {
      *prefix = after->end;
      after->end = 0;
    }
    return 0;
  }
  if (before && after) { /* fills the gap between two extents */
    before->end = after->end;
    after->end = 0;
  } else if (before) {
    before->end = end;
  } else if (after) {
    after->start = offset;
  } else {
    if (!free_slot)
      FAIL("range [%llu, %llu) would be out-of-order range %d of this comm (an honest sender needs at most %d)",
           (unsigned long long)offset, (unsigned long long)end, FL_CLAIM_EXTENTS + 1, FL_CLAIM_EXTENTS / 2);
    *free_slot = (struct fl_claim_extent){.start = offset, .end = end, .seq = seq, .index = index};
  }
  return 0;
}
