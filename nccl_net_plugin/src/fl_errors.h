/* fl_errors.h - one translation from the transport's errors to NCCL's result codes.
 *
 * Inside the transport a failure says *what* happened, as a negative errno: the vocabulary the socket calls already
 * speak (a failed send() hands its errno on unchanged) plus a few for the protocol's own faults. At the API boundary
 * fl_retval() says once *whose* fault it is, which is what NCCL acts on (aws-ofi-nccl translates the same way;
 * ../shared/research/anchors.md, "error translation"):
 *
 *   ncclRemoteError   the peer or the network: it closed, reset, stopped answering (-ETIMEDOUT after
 *                     FLOWLANE_NET_TIMEOUT_MS), refused the connection, broke the protocol (-EPROTO: a malformed or
 *                     unexpected frame, DATA beyond the receive posted for it) or stopped reading our
 *                     acknowledgements (-EREMOTEIO). NCCL reports "remote process exited or there was a network
 *                     error".
 *   ncclInvalidUsage  the collective's contract: an isend larger than the receive the peer posted for its tag
 *                     (-EMSGSIZE; NCCL's socket transport returns the same for a truncated message), a handle that is
 *                     not a flowlane listen handle (-EINVAL).
 *   ncclSystemError   this host: out of memory or descriptors, any other failed system call (the default).
 *
 * Contract violations by NCCL itself (a NULL out-pointer, a comm of the wrong kind) are refused where they are seen,
 * with ncclInternalError (FL_REQUIRE in fl_log.h); they carry no errno.
 */
#ifndef FL_ERRORS_H
#define FL_ERRORS_H

#include <errno.h>

#include "flowlane_net_abi.h"

/* The failed call's errno as an internal error: never 0, which would read as success. */
static inline int fl_neg_errno(void) { return errno > 0 ? -errno : -EIO; }

static inline ncclResult_t fl_retval(int err) {
  switch (-err) {
    case 0:
      return ncclSuccess;
    case ECONNRESET:
    case ECONNREFUSED:
    case ECONNABORTED:
    case EPIPE:
    case ENOTCONN:
    case ENETRESET:
    case ENETDOWN:
    case ENETUNREACH:
    case EHOSTDOWN:
    case EHOSTUNREACH:
    case ETIMEDOUT:
    case EPROTO:
    case EREMOTEIO:
      return ncclRemoteError;
    case EMSGSIZE:
    case EINVAL:
      return ncclInvalidUsage;
    default:
      return ncclSystemError;
  }
}

#endif
