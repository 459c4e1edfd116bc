#!/bin/sh
# Emulated links for the plugin's tests and benchmarks (traffic never leaves the two namespaces created here).
#   netns.sh up PREFIX RATES [fifo|prio]   RATES: comma-separated Mbit/s per path, 0 = unshaped
#   netns.sh down PREFIX
# Creates namespaces ${PREFIX}a (sender side) and ${PREFIX}b (receiver side), joined by one veth pair per path:
# ${PREFIX}v<i>a 10.77.<i+1>.1/24 <-> ${PREFIX}v<i>b 10.77.<i+1>.2/24. A shaped path gets a tbf on the sender's
# egress; with "prio" the tbf's child is pfifo_fast, whose 3 bands honour SO_PRIORITY (the plugin's lanes).
set -eu
cmd=${1:?usage: netns.sh up PREFIX RATES [fifo|prio] | down PREFIX}
p=${2:?missing PREFIX}
case "$cmd" in
up)
  rates=${3:?missing RATES}
  mode=${4:-fifo}
  ip netns add "${p}a"
  ip netns add "${p}b"
  ip -n "${p}a" link set lo up
  ip -n "${p}b" link set lo up
  i=0
  for r in $(echo "$rates" | tr ',' ' '); do
    a="${p}v${i}a"
    b="${p}v${i}b"
    ip link add "$a" netns "${p}a" type veth peer name "$b" netns "${p}b"
    ip -n "${p}a" addr add "10.77.$((i + 1)).1/24" dev "$a"
    ip -n "${p}b" addr add "10.77.$((i + 1)).2/24" dev "$b"
    ip -n "${p}a" link set "$a" up
    ip -n "${p}b" link set "$b" up
    if [ "$r" != 0 ]; then
      tc -n "${p}a" qdisc add dev "$a" root handle 1: tbf rate "${r}mbit" burst 64kb latency 200ms
      if [ "$mode" = prio ]; then
        tc -n "${p}a" qdisc add dev "$a" parent 1:1 handle 10: pfifo_fast
      fi
    fi
    i=$((i + 1))
  done
  ;;
down)
  ip netns del "${p}a" 2>/dev/null || true
  ip netns del "${p}b" 2>/dev/null || true
  ;;
*)
  echo "unknown command $cmd" >&2
  exit 2
  ;;
esac
