#!/usr/bin/env bash
# Instructions one bridge of a two-bridge fleet executes per message that crosses, counted
# by valgrind's callgrind: `a` is the bridge the senders use (it publishes to JetStream),
# `b` the one the receivers use (it applies the stream). The fleet's counterpart of
# callgrind.sh, for the federation's own costs (publishing, reading batches, applying).
#
#   benches/callgrind-fleet.sh [a|b] [COUNT]       e.g.  benches/callgrind-fleet.sh b 3000
#
# Builds the release binaries, starts one nats-server with JetStream (the one .ci/run
# installs under target/test-tools, else the PATH's), runs the bundled bridge.toml twice
# (every listener on a free port, a store each in a temporary directory, `[federation]`
# added), the chosen bridge under callgrind, and sends COUNT skynet→skynet messages from
# a's Skynet endpoint to receivers on b's — 4 pairs, 16 in flight each. Prints that
# bridge's instructions per message, counted from when both are ready, and keeps the
# profile for `callgrind_annotate --inclusive=yes`. The count includes what the bridge does
# in the background meanwhile (heartbeats, upkeep), over a run about 50 times longer than
# without valgrind: compare builds at the same COUNT. Needs valgrind.
set -euo pipefail

which=${1:-a}
count=${2:-3000}
case $which in a | b) ;; *) echo "usage: $0 [a|b] [COUNT]" >&2; exit 2 ;; esac
[[ $count =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [a|b] [COUNT]: COUNT is a positive number" >&2; exit 2; }
cd "$(dirname "$0")/.."
cargo build --release --bin agentbridge --bin loadgen
bin=$(realpath "${CARGO_TARGET_DIR:-target}/release")
PATH="$PWD/target/test-tools/venv/bin:$PATH"
command -v nats-server > /dev/null || { echo "no nats-server: run .ci/run once, or put one on the PATH" >&2; exit 1; }

work=$(mktemp -d)
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
nats-server -a 127.0.0.1 -p "$port" -js -sd "$work/nats" > "$work/nats.log" 2>&1 &
pids=($!)
disown
trap 'kill -9 "${pids[@]}" 2> /dev/null || true; rm -rf "$work/nats" "$work"/*/data' EXIT
for _ in $(seq 100); do
    (echo > "/dev/tcp/127.0.0.1/$port") 2> /dev/null && break
    sleep 0.1
done

for bridge in a b; do
    mkdir -p "$work/$bridge"
    sed -E 's/^listen = "127\.0\.0\.1:[0-9]+"/listen = "127.0.0.1:0"/' bridge.toml > "$work/$bridge/bridge.toml"
    printf '\n[federation]\nnats = ["nats://127.0.0.1:%s"]\nbridge_id = "%s"\nreplicas = 1\n' \
        "$port" "$bridge" >> "$work/$bridge/bridge.toml"
    run=("$bin/agentbridge" --config bridge.toml --log-format text)
    if [ "$bridge" = "$which" ]; then
        run=(valgrind --tool=callgrind --callgrind-out-file="$work/callgrind.out" --dump-instr=no "${run[@]}")
    fi
    # The listeners' addresses are read from the log: text, at info level.
    (cd "$work/$bridge" && RUST_LOG=info exec "${run[@]}" > bridge.log 2>&1) &
    pids+=($!)
    [ "$bridge" = "$which" ] && profiled=$!
    disown
done
# Ready, and joined to the fleet: its stream and buckets set up.
for bridge in a b; do
    for _ in $(seq 600); do
        grep -q "JetStream set up" "$work/$bridge/bridge.log" && grep -q " ready" "$work/$bridge/bridge.log" && break
        sleep 0.2
    done
    grep -q "JetStream set up" "$work/$bridge/bridge.log" || { cat "$work/$bridge/bridge.log"; exit 1; }
done
url() { echo "$2=http://$(sed -nE "s/.*listening endpoint=$2 .*addr=([0-9.:]+).*/\1/p" "$work/$1/bridge.log")"; }

callgrind_control --zero "$profiled" > /dev/null 2>&1 || { echo "callgrind_control failed" >&2; exit 1; }
"$bin/loadgen" run --baseline none --count "$count" --duration 3600 --window 16 --path skynet:skynet \
    --bridge "$(url a skynet)" --bridge "$(url a tracker)" --receiver-bridge "$(url b skynet)" \
    --tracker-token tb-admin-change-me
callgrind_control --dump "$profiled" > /dev/null 2>&1 || { echo "callgrind_control failed" >&2; exit 1; }
profile=$(ls "$work"/callgrind.out.* | head -1)
total=$(callgrind_annotate "$profile" | sed -nE 's/^ *([0-9,]+).*PROGRAM TOTALS.*/\1/p' | tr -d ,)
[ -n "$total" ] || { echo "no totals in $profile" >&2; exit 1; }
echo "bridge $which of skynet@a→skynet@b: $((total / count)) instructions per message ($total for $count)"
echo "profile: $profile"
