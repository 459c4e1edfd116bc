/*
 * fl_claims.h - byte-range claims of a receive comm's DATA frames.
 *
 * A DATA frame claims [offset, offset + length) of one receive entry (slot
 * seq, index) when its header is accepted, before any payload byte is
 * written. A claim is granted only if it lies inside the message and
 * overlaps no earlier claim of that entry. Hence, with `received` counting
 * the payload bytes of completed frames:
 *     received <= sum of granted claims <= total,
 * so received == total means every claimed frame has completed: no path is
 * still writing into the buffer when test() hands it back, no byte is
 * written twice, and no completion leaves a hole.
 *
 * State: per entry, the claimed prefix [0, prefix); claims above it (sub-
 * chunks that overtook an earlier one on another path) wait as merged
 * extents in a per-comm pool and join the prefix when the gap closes. Each
 * extent follows a gap, and each gap holds a sub-chunk the sender has in
 * flight, so an honest sender needs at most paths x window extents; a claim
 * that would need more is refused like an overlap. Pure logic, no I/O.
 */
#ifndef FL_CLAIMS_H
#define FL_CLAIMS_H

#include <stddef.h>
#include <stdint.h>

#define FL_CLAIM_EXTENTS 32 /* >= FL_MAX_PATHS x FL_PATH_WINDOW (16), with margin */

struct fl_claim_extent {
  uint64_t start, end; /* end == 0: free */
  uint32_t seq;
  uint8_t index;
};

struct fl_claims {
  struct fl_claim_extent ext[FL_CLAIM_EXTENTS];
};

/* Claim [offset, offset + length) of entry (seq, index), whose claimed prefix
 * is *prefix and whose message has `total` bytes. Returns 0 and records the
 * claim (advancing *prefix when it extends it), or -1 with the reason in err
 * and nothing recorded. A zero-length claim inside the message always succeeds. */
int fl_claim(struct fl_claims* cl, uint32_t seq, uint8_t index, uint64_t* prefix, uint64_t total, uint64_t offset,
             uint64_t length, char* err, size_t errlen);

#endif /* FL_CLAIMS_H */
