/*
 * fl_api.c - the exported ncclNetPlugin_v8..v11 tables: a thin compatibility
 * layer over the one implementation in fl_transport.c. Each older version
 * gets explicit converters (no casts between struct versions).
 */
#include <stdlib.h>
#include <string.h>

#include "fl_core.h"
#include "fl_log.h"

#define FL_EXPORT __attribute__((visibility("default")))

/* ----------------------------------------------------------- properties */

static void props_to_v8(const ncclNetProperties_v11_t* in, ncclNetProperties_v8_t* out) {
  memset(out, 0, sizeof(*out));
  out->name = in->name;
  out->pciPath = in->pciPath;
  out->guid = in->guid;
  out->ptrSupport = in->ptrSupport;
  out->regIsGlobal = in->regIsGlobal;
  out->speed = in->speed;
  out->port = in->port;
  out->latency = in->latency;
  out->maxComms = in->maxComms;
  out->maxRecvs = in->maxRecvs;
  out->netDeviceType = in->netDeviceType;
  out->netDeviceVersion = in->netDeviceVersion;
}

static void props_to_v9(const ncclNetProperties_v11_t* in, ncclNetProperties_v9_t* out) {
  memset(out, 0, sizeof(*out));
  out->name = in->name;
  out->pciPath = in->pciPath;
  out->guid = in->guid;
  out->ptrSupport = in->ptrSupport;
  out->regIsGlobal = in->regIsGlobal;
  out->forceFlush = in->forceFlush;
  out->speed = in->speed;
  out->port = in->port;
  out->latency = in->latency;
  out->maxComms = in->maxComms;
  out->maxRecvs = in->maxRecvs;
  out->netDeviceType = in->netDeviceType;
  out->netDeviceVersion = in->netDeviceVersion;
  out->vProps.ndevs = in->vProps.ndevs;
  for (int i = 0; i < NCCL_NET_MAX_DEVS_PER_NIC; i++) out->vProps.devs[i] = in->vProps.devs[i];
  out->maxP2pBytes = in->maxP2pBytes;
  out->maxCollBytes = in->maxCollBytes;
}

static ncclResult_t get_properties_v8(int dev, ncclNetProperties_v8_t* props) {
  ncclNetProperties_v11_t p;
  FL_REQUIRE(props != NULL, ncclInternalError);
  ncclResult_t rc = fl_get_properties(dev, &p);
  if (rc == ncclSuccess) props_to_v8(&p, props);
  return rc;
}

static ncclResult_t get_properties_v9(int dev, ncclNetProperties_v9_t* props) {
  ncclNetProperties_v11_t p;
  FL_REQUIRE(props != NULL, ncclInternalError);
  ncclResult_t rc = fl_get_properties(dev, &p);
  if (rc == ncclSuccess) props_to_v9(&p, props);
  return rc;
}

/* --------------------------------------------------------------- shims */

static ncclResult_t init_v8(ncclDebugLogger_t logger) { return fl_init(logger); }
static ncclResult_t init_v10(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  (void)prof;
  return fl_init(logger);
}

static ncclResult_t connect_v8(int dev, void* handle, void** send_comm, ncclNetDeviceHandle_v8_t** dev_comm) {
  (void)dev_comm; /* host-only plugin: no device offload */
  return fl_connect(dev, NCCL_NET_TRAFFIC_CLASS_UNDEF, handle, send_comm);
}

static ncclResult_t connect_v10(int dev, ncclNetCommConfig_v10_t* config, void* handle, void** send_comm,
                                ncclNetDeviceHandle_v10_t** dev_comm) {
  (void)dev_comm;
  return fl_connect(dev, config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF, handle, send_comm);
}

static ncclResult_t accept_v8(void* listen_comm, void** recv_comm, ncclNetDeviceHandle_v8_t** dev_comm) {
  (void)dev_comm;
  return fl_accept(listen_comm, recv_comm);
}

static ncclResult_t isend_v8(void* comm, void* data, int size, int tag, void* mhandle, void** request) {
  if (size < 0) {
    FL_WARN("isend: negative size %d", size);
    return ncclInternalError;
  }
  return fl_isend(comm, data, (size_t)size, tag, mhandle, request);
}

static ncclResult_t isend_v9(void* comm, void* data, size_t size, int tag, void* mhandle, void** request) {
  return fl_isend(comm, data, size, tag, mhandle, request);
}

static ncclResult_t isend_v10(void* comm, void* data, size_t size, int tag, void* mhandle, void* phandle,
                              void** request) {
  (void)phandle; /* profiler handles are not used */
  return fl_isend(comm, data, size, tag, mhandle, request);
}

static ncclResult_t irecv_v8(void* comm, int n, void** data, int* sizes, int* tags, void** mhandles, void** request) {
  size_t s[FL_MAX_RECVS];
  if (n < 1 || n > FL_MAX_RECVS || !sizes) {
    FL_WARN("irecv: n=%d outside 1..%d", n, FL_MAX_RECVS);
    return ncclInternalError;
  }
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 0) {
      FL_WARN("irecv: negative size %d at index %d", sizes[i], i);
      return ncclInternalError;
    }
    s[i] = (size_t)sizes[i];
  }
  return fl_irecv(comm, n, data, s, tags, mhandles, request);
}

static ncclResult_t irecv_v9(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                             void** request) {
  return fl_irecv(comm, n, data, sizes, tags, mhandles, request);
}

static ncclResult_t irecv_v10(void* comm, int n, void** data, size_t* sizes, int* tags, void** mhandles,
                              void** phandles, void** request) {
  (void)phandles;
  return fl_irecv(comm, n, data, sizes, tags, mhandles, request);
}

static ncclResult_t make_vdevice_v9(int* d, ncclNetVDeviceProps_v9_t* props) { return fl_make_vdevice(d, props); }

/* ------------------------------------------------- v11: per-comm context */

static ncclResult_t init_v11(void** ctx, uint64_t comm_id, ncclNetCommConfig_v11_t* config, ncclDebugLogger_t logger,
                             ncclProfilerCallback_t prof) {
  (void)prof;
  FL_REQUIRE(ctx != NULL, ncclInternalError);
  ncclResult_t rc = fl_init(logger);
  if (rc != ncclSuccess) return rc;
  struct fl_ctx* c = calloc(1, sizeof(*c));
  if (!c) FL_NO_MEMORY("per-communicator context");
  c->magic = FL_CTX_MAGIC;
  c->comm_id = comm_id;
  c->traffic_class = config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  *ctx = c;
  return ncclSuccess;
}

static struct fl_ctx* ctx_check(void* ctx) {
  struct fl_ctx* c = ctx;
  if (!c || c->magic != FL_CTX_MAGIC) {
    FL_WARN("invalid per-communicator context %p (was init() called?)", ctx);
    return NULL;
  }
  return c;
}

static ncclResult_t listen_v11(void* ctx, int dev, void* handle, void** listen_comm) {
  if (!ctx_check(ctx)) return ncclInternalError;
  return fl_listen(dev, handle, listen_comm);
}

static ncclResult_t connect_v11(void* ctx, int dev, void* handle, void** send_comm,
                                ncclNetDeviceHandle_v11_t** dev_comm) {
  (void)dev_comm;
  struct fl_ctx* c = ctx_check(ctx);
  if (!c) return ncclInternalError;
  return fl_connect(dev, c->traffic_class, handle, send_comm);
}

static ncclResult_t finalize_v11(void* ctx) {
  struct fl_ctx* c = ctx_check(ctx);
  if (!c) return ncclInternalError;
  c->magic = 0;
  free(c);
  return ncclSuccess;
}

static ncclResult_t set_net_attr_v11(void* ctx, ncclNetAttr_v11_t* attr) {
  (void)attr; /* hints (op, algo, peers) are not used by the TCP transport yet */
  return ctx_check(ctx) ? ncclSuccess : ncclInternalError;
}

/* --------------------------------------------------------- the exports */

FL_EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
    .name = FL_NET_PLUGIN_NAME,
    .init = init_v11,
    .devices = fl_devices,
    .getProperties = fl_get_properties,
    .listen = listen_v11,
    .connect = connect_v11,
    .accept = accept_v8,
    .regMr = fl_reg_mr,
    .regMrDmaBuf = fl_reg_mr_dmabuf,
    .deregMr = fl_dereg_mr,
    .isend = isend_v10,
    .irecv = irecv_v10,
    .iflush = fl_iflush,
    .test = fl_test,
    .closeSend = fl_close_send,
    .closeRecv = fl_close_recv,
    .closeListen = fl_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = make_vdevice_v9,
    .finalize = finalize_v11,
    .setNetAttr = set_net_attr_v11,
};

FL_EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    .name = FL_NET_PLUGIN_NAME,
    .init = init_v10,
    .devices = fl_devices,
    .getProperties = get_properties_v9,
    .listen = fl_listen,
    .connect = connect_v10,
    .accept = accept_v8,
    .regMr = fl_reg_mr,
    .regMrDmaBuf = fl_reg_mr_dmabuf,
    .deregMr = fl_dereg_mr,
    .isend = isend_v10,
    .irecv = irecv_v10,
    .iflush = fl_iflush,
    .test = fl_test,
    .closeSend = fl_close_send,
    .closeRecv = fl_close_recv,
    .closeListen = fl_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = make_vdevice_v9,
};

FL_EXPORT const ncclNet_v9_t ncclNetPlugin_v9 = {
    .name = FL_NET_PLUGIN_NAME,
    .init = init_v8,
    .devices = fl_devices,
    .getProperties = get_properties_v9,
    .listen = fl_listen,
    .connect = connect_v8,
    .accept = accept_v8,
    .regMr = fl_reg_mr,
    .regMrDmaBuf = fl_reg_mr_dmabuf,
    .deregMr = fl_dereg_mr,
    .isend = isend_v9,
    .irecv = irecv_v9,
    .iflush = fl_iflush,
    .test = fl_test,
    .closeSend = fl_close_send,
    .closeRecv = fl_close_recv,
    .closeListen = fl_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = make_vdevice_v9,
};

FL_EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = FL_NET_PLUGIN_NAME,
    .init = init_v8,
    .devices = fl_devices,
    .getProperties = get_properties_v8,
    .listen = fl_listen,
    .connect = connect_v8,
    .accept = accept_v8,
    .regMr = fl_reg_mr,
    .regMrDmaBuf = fl_reg_mr_dmabuf,
    .deregMr = fl_dereg_mr,
    .isend = isend_v8,
    .irecv = irecv_v8,
    .iflush = fl_iflush,
    .test = fl_test,
    .closeSend = fl_close_send,
    .closeRecv = fl_close_recv,
    .closeListen = fl_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
};
