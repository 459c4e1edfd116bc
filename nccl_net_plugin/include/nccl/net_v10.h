/*
 * nccl/net_v10.h - ncclNet_v10.
 *
 * Written from NCCL's documented plugin API (ext-net README, the documented
 * struct layouts): layouts and function-pointer orders are interface facts
 * and must match NCCL exactly. One header per ABI version, as NCCL's ext-net
 * example has them, so a new version is one new file.
 */
#ifndef FLOWLANE_NCCL_NET_V10_H
#define FLOWLANE_NCCL_NET_V10_H

#include "net_v9.h"

#ifdef __cplusplus
extern "C" {
#endif

/* NCCL 2.24-2.27: connect() takes a per-communicator config (trafficClass),
 * init() takes a profiler callback, isend/irecv carry profiler handles. */

typedef ncclNetVDeviceProps_v9_t ncclNetVDeviceProps_v10_t;
typedef ncclNetProperties_v9_t ncclNetProperties_v10_t;

typedef struct {
  int trafficClass; /* plugin-specific; NCCL_NET_TRAFFIC_CLASS_UNDEF when unset */
} ncclNetCommConfig_v10_t;

typedef struct {
  const char* name;
  ncclResult_t (*init)(ncclDebugLogger_t logFunction, ncclProfilerCallback_t profFunction);
  ncclResult_t (*devices)(int* ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v10_t* props);
  ncclResult_t (*listen)(int dev, void* handle, void** listenComm);
  ncclResult_t (*connect)(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** sendComm,
                          ncclNetDeviceHandle_v10_t** sendDevComm);
  ncclResult_t (*accept)(void* listenComm, void** recvComm, ncclNetDeviceHandle_v10_t** recvDevComm);
  ncclResult_t (*regMr)(void* comm, void* data, size_t size, int type, void** mhandle);
  ncclResult_t (*regMrDmaBuf)(void* comm, void* data, size_t size, int type, uint64_t offset, int fd, void** mhandle);
  ncclResult_t (*deregMr)(void* comm, void* mhandle);
  ncclResult_t (*isend)(void* sendComm, void* data, size_t size, int tag, void* mhandle, void* phandle, void** request);
  ncclResult_t (*irecv)(void* recvComm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                        void** phandles, void** request);
  ncclResult_t (*iflush)(void* recvComm, int n, void** data, int* sizes, void** mhandles, void** request);
  ncclResult_t (*test)(void* request, int* done, int* sizes);
  ncclResult_t (*closeSend)(void* sendComm);
  ncclResult_t (*closeRecv)(void* recvComm);
  ncclResult_t (*closeListen)(void* listenComm);
  ncclResult_t (*getDeviceMr)(void* comm, void* mhandle, void** dptr_mhandle);
  ncclResult_t (*irecvConsumed)(void* recvComm, int n, void* request);
  ncclResult_t (*makeVDevice)(int* d, ncclNetVDeviceProps_v10_t* props);
} ncclNet_v10_t;

#ifdef __cplusplus
}
#endif
#endif /* FLOWLANE_NCCL_NET_V10_H */
