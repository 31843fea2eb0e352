#!/usr/bin/env bash
# Run a command inside a fresh network namespace whose loopback is rate-limited (DESIGN.md §7).
# Usage: sudo recipes/netns_run.sh RATE COMMAND...      RATE: e.g. 1gbit, 200mbit, or none
# The namespace is always removed, also on error or Ctrl-C. Workers talk over 127.0.0.1 inside it.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 RATE COMMAND..." >&2; exit 2; fi
rate=$1; shift
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  echo "netns_run: needs root and iproute2 (ip, tc) to emulate a slow link" >&2; exit 3
fi
ns="commsched-$$"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM
ip netns add "$ns"
ip -n "$ns" link set lo mtu 9000 up
if [ "$rate" != none ]; then
  # burst must exceed the MTU or large messages stall
  ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 256kb latency 50ms
fi
ip netns exec "$ns" "$@"
