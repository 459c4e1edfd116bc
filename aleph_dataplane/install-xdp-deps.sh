#!/usr/bin/env bash
# The XDP tier's toolchain from Debian's packages: clang (BPF target), libbpf-dev (headers + libbpf for the loader),
# linux-libc-dev (linux/bpf.h etc.). Called by scripts/test.sh; a no-op when they are there. Without root or apt it
# says so and exits 0: the XDP tier's tests then skip with the reason (flowlane/aleph/xdp.py), the other tiers run.
set -uo pipefail
have() { command -v clang >/dev/null && [ -f /usr/include/bpf/bpf_helpers.h ] && [ -f /usr/include/linux/bpf.h ]; }
if have; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-xdp-deps: not root or no apt-get; the XDP tier's tests will skip (needs clang libbpf-dev)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends clang libbpf-dev linux-libc-dev; } \
  >/tmp/aleph-xdp-deps.log 2>&1; then
  echo "install-xdp-deps: apt-get failed (log: /tmp/aleph-xdp-deps.log); the XDP tier's tests will skip" >&2
fi
exit 0
