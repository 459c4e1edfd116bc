/* fl_log.h - logging through NCCL's logger (prefix "NET/flowlane"). */
#ifndef FL_LOG_H
#define FL_LOG_H

#include "flowlane_net_abi.h"

extern ncclDebugLogger_t fl_logger;
void fl_log_stderr(ncclDebugLogLevel level, unsigned long flags, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));

#define FL_WARN(fmt, ...) \
  (fl_logger ? fl_logger : fl_log_stderr)(NCCL_LOG_WARN, NCCL_ALL, __FILE__, __LINE__, "NET/flowlane : " fmt, ##__VA_ARGS__)
#define FL_INFO(fmt, ...) \
  (fl_logger ? fl_logger : fl_log_stderr)(NCCL_LOG_INFO, NCCL_NET, __FILE__, __LINE__, "NET/flowlane : " fmt, ##__VA_ARGS__)

/* The API's boundary checks: a call NCCL's contract rules out (a NULL out-pointer, a comm of the wrong kind) is
 * refused with a warning naming the call and the broken condition, never silently (aws-ofi-nccl does the same). */
#define FL_REQUIRE(cond, rc)                                        \
  do {                                                              \
    if (!(cond)) {                                                  \
      FL_WARN("%s: refused: %s does not hold", __func__, #cond);    \
      return (rc);                                                  \
    }                                                               \
  } while (0)

/* An allocation that failed: said once where it happened, then ncclSystemError as before. */
#define FL_NO_MEMORY(what)                                          \
  do {                                                              \
    FL_WARN("%s: out of memory (%s)", __func__, what);              \
    return ncclSystemError;                                         \
  } while (0)

#endif
