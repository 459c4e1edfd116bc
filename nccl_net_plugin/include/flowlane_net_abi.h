/*
 * flowlane_net_abi.h - the NCCL net-plugin ABI versions flowlane implements.
 *
 * One header per version under nccl/ (net_common.h, net_v8.h .. net_v11.h),
 * written from NCCL's documented plugin API; src/fl_api.c maps each version
 * onto one implementation (the newest semantics). Supporting a new version is
 * one more header here and one more table in fl_api.c.
 */
#ifndef FLOWLANE_NET_ABI_H
#define FLOWLANE_NET_ABI_H

#include "nccl/net_v8.h"
#include "nccl/net_v11.h" /* includes v10, which includes v9 */

#endif /* FLOWLANE_NET_ABI_H */
