#!/usr/bin/env bash
# How fast the Grid keeps mail for a program that is not connected: a flood of Grid HTTP
# requests to a declared program that never connects, each queued for it and appended to
# the scratchpad by the Grid's writer (src/protocols/grid/writer.rs).
#
#   benches/grid_flood.sh [alone|fleet] [COUNT] [IN_FLIGHT]     e.g.  benches/grid_flood.sh fleet
#
# Builds the release binary and starts one bridge with only its Grid and admin listeners
# (the store and the scratchpad in a temporary directory); `fleet` joins it to a one-server
# NATS with JetStream (`nats-server` on the PATH, as .ci/run installs it under
# target/test-tools/venv/bin), so each message is also a record of the fleet. curl posts
# COUNT messages (default 5000), IN_FLIGHT at once (32); then one poll as the program, which
# waits for the writer to have written everything accepted before it. Prints the rate the
# requests were accepted at and the rate everything was accepted, queued and appended at.
set -euo pipefail

mode=${1:-alone}
count=${2:-5000}
in_flight=${3:-32}
cd "$(dirname "$0")/.."
cargo build --release --bin agentbridge
bin=$(realpath "${CARGO_TARGET_DIR:-target}/release/agentbridge")

work=$(mktemp -d)
trap 'kill $(jobs -p) 2> /dev/null || true; rm -rf "$work"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
grid_port=$(free_port)
admin_port=$(free_port)

federation=""
if [ "$mode" = fleet ]; then
    nats_port=$(free_port)
    nats-server --jetstream --store_dir "$work/nats" --addr 127.0.0.1 --port "$nats_port" > "$work/nats.log" 2>&1 &
    federation="[federation]
nats = [\"nats://127.0.0.1:$nats_port\"]
bridge_id = \"flood\"
replicas = 1"
fi
cat > "$work/bridge.toml" <<EOF
[bridge]
data_dir = "$work/data"
[admin]
listen = "127.0.0.1:$admin_port"
[grid]
listen = "127.0.0.1:$grid_port"
scratchpad = "$work/SCRATCHPAD.md"
programs = ["absent"]
$federation
EOF
"$bin" run --config "$work/bridge.toml" > "$work/bridge.log" 2>&1 &
for _ in $(seq 100); do
    [ "$(curl -s "http://127.0.0.1:$admin_port/readyz" | head -c 5)" = ready ] && break
    sleep 0.1
done

# One request body a message, and a curl config naming them all.
for i in $(seq 0 $((count - 1))); do
    printf 'message:\n  id: "flood-%d"\n  timestamp: "2026-01-24T10:00:00Z"\n  type: "request"\n  sender:\n    agent: "flooder"\n  receiver:\n    agent: "absent"\n  content:\n    action: "note"\n    payload:\n      text: "flood %d"\n' "$i" "$i" > "$work/body$i"
    [ "$i" -gt 0 ] && echo next
    printf 'url = "http://127.0.0.1:%s/grid/v1/messages"\nheader = "Content-Type: application/x-yaml"\ndata-binary = "@%s/body%d"\noutput = "/dev/null"\n' "$grid_port" "$work" "$i"
done > "$work/requests"

start=$(date +%s.%N)
curl -s --no-progress-meter --fail --parallel --parallel-max "$in_flight" --config "$work/requests"
accepted=$(date +%s.%N)
queued=$(curl -s "http://127.0.0.1:$grid_port/grid/v1/messages?agent=absent" | grep -c 'id: flood-' || true)
written=$(date +%s.%N)
appended=$(grep -c 'id: flood-' "$work/SCRATCHPAD.md" || true)
python3 - "$mode" "$count" "$start" "$accepted" "$written" "$queued" "$appended" <<'EOF'
import sys
mode, count, start, accepted, written, queued, appended = sys.argv[1:]
count, start, accepted, written = int(count), float(start), float(accepted), float(written)
print(f"{mode}: {count} accepted at {count / (accepted - start):,.0f} msg/s; "
      f"queued ({queued}) and appended ({appended}) at {count / (written - start):,.0f} msg/s")
EOF
