/*
 * nccl/net_common.h - what every ncclNet_vN shares: results, logging, limits, the device handle.
 *
 * Written from NCCL's documented plugin API (ext-net README, the documented
 * struct layouts): layouts and function-pointer orders are interface facts
 * and must match NCCL exactly. One header per ABI version, as NCCL's ext-net
 * example has them, so a new version is one new file.
 */
#ifndef FLOWLANE_NCCL_NET_COMMON_H
#define FLOWLANE_NCCL_NET_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
  ncclNumResults = 8
} ncclResult_t;

typedef enum {
  NCCL_LOG_NONE = 0, NCCL_LOG_VERSION = 1, NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3, NCCL_LOG_ABORT = 4, NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

/* Subsystem flags passed with INFO logs (NCCL_NET is the one we use). */
#define NCCL_INIT 1
#define NCCL_NET 16
#define NCCL_ALL (~0)

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags,
                                  const char* file, int line, const char* fmt, ...);

/* Profiler callback handed to init() since v10; flowlane does not call it. */
typedef ncclResult_t (*ncclProfilerCallback_t)(void** eHandle, int type, void* phandle,
                                               int64_t pluginId, void* extData);

#define NCCL_NET_HANDLE_MAXSIZE 128
#define NCCL_MAX_NET_SIZE_BYTES (1ULL << 40) /* 1 TiB */
#define NCCL_PTR_HOST 0x1
#define NCCL_PTR_CUDA 0x2
#define NCCL_PTR_DMABUF 0x4
/* Each comm must sustain this many requests in flight (x maxRecvs on the send side). */
#define NCCL_NET_MAX_REQUESTS 32
#define NCCL_NET_TRAFFIC_CLASS_UNDEF (-1)
#define NCCL_NET_MAX_DEVS_PER_NIC 4

typedef enum { NCCL_NET_DEVICE_HOST = 0, NCCL_NET_DEVICE_UNPACK = 1 } ncclNetDeviceType;
#define NCCL_NET_DEVICE_INVALID_VERSION 0x0

/* Device-offload handle: identical layout in v8..v11. */
typedef struct {
  ncclNetDeviceType netDeviceType;
  int netDeviceVersion;
  void* handle;
  size_t size;
  int needsProxyProgress;
} ncclNetDeviceHandle_v8_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v9_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v10_t;
typedef ncclNetDeviceHandle_v8_t ncclNetDeviceHandle_v11_t;

#ifdef __cplusplus
}
#endif
#endif /* FLOWLANE_NCCL_NET_COMMON_H */
