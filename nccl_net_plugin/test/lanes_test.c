/*
 * lanes_test.c - the class -> lane -> socket marking rule (src/fl_params.c) for
 * every FLOWLANE_NET_LANES value: a lane carries the marking of the
 * highest-priority (smallest) class mapped onto it, so no class is marked
 * below its own priority, and one lane (priorities off) marks everything best
 * effort. Prints the table (tests/test_nccl_net_plugin.py pins
 * flowlane/wire_classes.py to it); exits non-zero on any violation.
 */
#include <stdio.h>

#include "fl_core.h"

int main(void) {
  int fail = 0;
  for (int lanes = 1; lanes <= FL_NUM_CLASSES; lanes++) {
    for (int cls = 0; cls < FL_NUM_CLASSES; cls++) {
      int lane = fl_lane_of_class(cls, lanes), mark = fl_lane_marking_class(lane, lanes);
      printf("lanes=%d class=%d lane=%d dscp=%d so_priority=%d\n", lanes, cls, lane, fl_class_dscp(mark),
             fl_class_sopriority(mark));
      int top = cls; /* the highest-priority class sharing this lane */
      while (top > 0 && fl_lane_of_class(top - 1, lanes) == lane) top--;
      int want = lanes == 1 ? FL_CLASS_DEFAULT : top;
      if (mark != want) {
        fprintf(stderr, "FAIL lanes=%d: class %d's lane %d is marked as class %d, expected class %d\n", lanes, cls,
                lane, mark, want);
        fail = 1;
      }
    }
  }
  if (!fail) printf("lanes_test: each lane marked as its highest-priority class\n");
  return fail;
}
