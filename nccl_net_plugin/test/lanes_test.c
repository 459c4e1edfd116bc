/*
 * lanes_test.c - the class -> lane -> socket marking rules (src/fl_params.c)
 * for every FLOWLANE_NET_LANES value. DSCP (the switches' view): a lane
 * carries the DSCP of the highest-priority (smallest) class mapped onto it, so
 * no class is marked below its own priority, and one lane (priorities off)
 * marks everything best effort. SO_PRIORITY (this host's qdisc band): under
 * the default pfifo_fast/prio priomap, distinct lanes land in distinct bands
 * that increase with the lane index, as far as the three bands allow (4 lanes:
 * bands 0/1/1/2). Prints the table (tests/test_nccl_net_plugin.py pins
 * flowlane/wire_classes.py to it); exits non-zero on any violation.
 */
#include <stdio.h>

#include "fl_core.h"

/* the kernel's default priomap (TC_PRIO -> band) of pfifo_fast and prio: tc-prio(8) */
static const int priomap[16] = {1, 2, 2, 2, 1, 2, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};
#define NUM_BANDS 3

int main(void) {
  int fail = 0;
  for (int lanes = 1; lanes <= FL_NUM_CLASSES; lanes++) {
    for (int cls = 0; cls < FL_NUM_CLASSES; cls++) {
      int lane = fl_lane_of_class(cls, lanes), mark = fl_lane_marking_class(lane, lanes);
      printf("lanes=%d class=%d lane=%d dscp=%d so_priority=%d\n", lanes, cls, lane, fl_class_dscp(mark),
             fl_lane_sopriority(lane, lanes));
      int top = cls; /* the highest-priority class sharing this lane */
      while (top > 0 && fl_lane_of_class(top - 1, lanes) == lane) top--;
      int want = lanes == 1 ? FL_CLASS_DEFAULT : top;
      if (mark != want) {
        fprintf(stderr, "FAIL lanes=%d: class %d's lane %d is marked as class %d, expected class %d\n", lanes, cls,
                lane, mark, want);
        fail = 1;
      }
    }
    /* distinct lanes -> distinct, increasing bands: bands never decrease with the lane index, and the lanes use
     * min(lanes, 3) distinct bands (so 2 and 3 lanes are strictly increasing, 4 lanes use all three) */
    int prev = -1, distinct = 0;
    for (int lane = 0; lane < lanes && lanes > 1; lane++) {
      int prio = fl_lane_sopriority(lane, lanes);
      int band = prio >= 0 && prio < 16 ? priomap[prio] : -1;
      if (band < prev || band < 0) {
        fprintf(stderr, "FAIL lanes=%d: lane %d (SO_PRIORITY %d) is in band %d, after band %d\n", lanes, lane, prio,
                band, prev);
        fail = 1;
      }
      distinct += band != prev;
      prev = band;
    }
    int want_distinct = lanes < NUM_BANDS ? lanes : NUM_BANDS;
    if (lanes > 1 && distinct != want_distinct) {
      fprintf(stderr, "FAIL lanes=%d: the lanes use %d pfifo_fast bands, expected %d\n", lanes, distinct,
              want_distinct);
      fail = 1;
    }
  }
  if (!fail)
    printf("lanes_test: each lane's DSCP is its highest-priority class; lanes sit in distinct, increasing bands\n");
  return fail;
}
