#!/usr/bin/env bash
# Instructions the bridge executes per relayed message, counted by valgrind's callgrind:
# a number that stays put where msgs/s on a shared machine moves ±15 % between runs, so
# a change's cost or saving shows even when it is a few per cent.
#
#   benches/callgrind.sh [PATH] [COUNT]       e.g.  benches/callgrind.sh grid:skynet 10000
#
# Builds the release binaries, runs the bundled bridge.toml (every listener moved to a free
# port, the store in a temporary directory) under callgrind, sends COUNT messages over PATH
# (default skynet:skynet, 20000) with the load generator — 4 pairs, 16 in flight each —
# and prints the bridge's instructions per message, counted from when the bridge is ready.
# The profile and the bridge's log are kept (their folder is printed) for
# `callgrind_annotate --inclusive=yes`; the store is removed. Needs valgrind (Debian
# package `valgrind`). Everything runs about 50 times slower under callgrind.
set -euo pipefail

path=${1:-skynet:skynet}
count=${2:-20000}
cd "$(dirname "$0")/.."
cargo build --release --bin agentbridge --bin loadgen
bin=$(realpath "${CARGO_TARGET_DIR:-target}/release")

work=$(mktemp -d)
sed -E 's/^listen = "127\.0\.0\.1:[0-9]+"/listen = "127.0.0.1:0"/' bridge.toml > "$work/bridge.toml"
cd "$work"
# The listeners' addresses are read from the log: text, at info level.
RUST_LOG=info valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out" \
    --dump-instr=no "$bin/agentbridge" --config bridge.toml --log-format text > bridge.log 2>&1 &
bridge=$!
trap 'kill -9 $bridge 2> /dev/null || true; rm -rf "$work/data"' EXIT
for _ in $(seq 600); do
    grep -q " ready" bridge.log && break
    sleep 0.2
done
grep -q " ready" bridge.log || { cat bridge.log; exit 1; }
url() { echo "$1=http://$(sed -nE "s/.*listening endpoint=$1 .*addr=([0-9.:]+).*/\1/p" bridge.log)"; }

callgrind_control --zero $bridge > /dev/null 2>&1 || { echo "callgrind_control failed" >&2; exit 1; }
"$bin/loadgen" run --baseline none --count "$count" --duration 3600 --window 16 --path "$path" \
    --bridge "$(url skynet)" --bridge "$(url tracker)" --bridge "$(url synapse)" \
    --bridge "$(url grid)" --tracker-token tb-admin-change-me
callgrind_control --dump $bridge > /dev/null 2>&1 || { echo "callgrind_control failed" >&2; exit 1; }
profile=$(ls "$work"/callgrind.out.* | head -1)
total=$(callgrind_annotate "$profile" | sed -nE 's/^ *([0-9,]+).*PROGRAM TOTALS.*/\1/p' | tr -d ,)
echo "$path: $((total / count)) instructions per message in the bridge ($total for $count)"
echo "profile: $profile"
