#!/usr/bin/env bash
# Builds deploy/Containerfile with podman, offline, and proves the image runs.
#
# No registry is needed: the script makes the two base images the Containerfile takes as
# build arguments itself — BINARY_IMAGE, `FROM scratch` holding the binary where the build
# stage leaves it (/out/agentbridge), and RUNTIME_IMAGE, `FROM scratch` holding the shared
# libraries the binary links (ldd), /etc/passwd with the nonroot user (65532) and /tmp —
# then builds the real Containerfile on them (the compiling stage is skipped). Containers
# cannot run here (crun cannot set rlimits in this sandbox), so the image is proven by
# exporting its filesystem (podman create + podman export) and starting its entrypoint and
# command, as its user, under chroot: the bridge must answer /readyz from inside that root.
#
#   deploy/check.sh                                   # the release binary
#   BINARY=target/debug/agentbridge deploy/check.sh   # another build
#
# Environment:
#   BINARY                    the binary to put in the image (default target/release/agentbridge)
#   READY_TIMEOUT             seconds to wait for /readyz (default 30)
#   KEEP=1                    keep the work directory (image store, exported root, logs)
#
# Exit status: 0 passed; 77 skipped (podman missing or unable to run here, or not root:
# chroot needs root), with the reason on stderr; anything else failed.
set -euo pipefail

SKIPPED=77
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

say() { printf 'deploy/check.sh: %s\n' "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

if ! command -v podman >/dev/null 2>&1; then
    say "skipped: podman is not installed (apt-get install podman)"
    exit "$SKIPPED"
fi
if [ "$(id -u)" -ne 0 ]; then
    say "skipped: chroot needs root (run as root, e.g. with sudo)"
    exit "$SKIPPED"
fi
for tool in ldd chroot curl python3 tar; do
    command -v "$tool" >/dev/null 2>&1 || fail "$tool is not installed"
done

BINARY=${BINARY:-target/release/agentbridge}
READY_TIMEOUT=${READY_TIMEOUT:-30}
[ -x "$BINARY" ] || fail "no binary at $BINARY: build it (cargo build --release) or set BINARY=path"
BINARY=$(cd "$(dirname "$BINARY")" && pwd)/$(basename "$BINARY")

work=$(mktemp -d "${TMPDIR:-/tmp}/agentbridge-check.XXXXXX")
# A private image store: nothing is pulled, nothing is left in the machine's own store.
podman=(podman --root "$work/storage" --runroot "$work/runroot" --events-backend none)
tag=$$
binary_image=localhost/agentbridge-check-binary:$tag
runtime_image=localhost/agentbridge-check-runtime:$tag
image=localhost/agentbridge-check:$tag
container=agentbridge-check-$tag
bridge_pid=

cleanup() {
    local status=$?
    if [ -n "$bridge_pid" ] && kill -0 "$bridge_pid" 2>/dev/null; then
        kill -KILL "$bridge_pid" 2>/dev/null || true
        wait "$bridge_pid" 2>/dev/null || true
    fi
    "${podman[@]}" rm --force --ignore "$container" >/dev/null 2>&1 || true
    "${podman[@]}" rmi --all --force >/dev/null 2>&1 || true
    if [ "${KEEP:-0}" = 1 ]; then
        say "kept $work"
    else
        rm -rf "$work"
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# A machine where podman is installed but cannot work (no overlay or user namespaces, as in
# some containers) cannot build the image at all: that is a skip, not a failure.
if ! "${podman[@]}" info >"$work/podman-info.log" 2>&1; then
    say "skipped: podman cannot run here: $(tail -1 "$work/podman-info.log")"
    exit "$SKIPPED"
fi

# --- the base images ---------------------------------------------------------------------
say "making the base images from $BINARY"
mkdir -p "$work/binary/out/data"
cp "$BINARY" "$work/binary/out/agentbridge"
printf 'FROM scratch\nCOPY out/ /out/\n' >"$work/binary/Containerfile"
"${podman[@]}" build --quiet --pull=never --network=none -t "$binary_image" "$work/binary" >/dev/null

base=$work/runtime/rootfs
mkdir -p "$base/etc" "$base/tmp" "$base/var/lib" "$base/usr/local/bin"
chmod 1777 "$base/tmp"
# Every library the binary links, and the dynamic loader, at the paths ldd names.
ldd "$BINARY" | awk '/=> \//{print $3} /^[[:space:]]*\//{print $1}' | sort -u | while read -r lib; do
    mkdir -p "$base$(dirname "$lib")"
    cp -L "$lib" "$base$lib"
done
cat >"$base/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOF
cat >"$base/etc/group" <<'EOF'
root:x:0:
nonroot:x:65532:
EOF
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    mkdir -p "$base/etc/ssl/certs"
    cp /etc/ssl/certs/ca-certificates.crt "$base/etc/ssl/certs/"
fi
printf 'FROM scratch\nCOPY rootfs/ /\n' >"$work/runtime/Containerfile"
"${podman[@]}" build --quiet --pull=never --network=none -t "$runtime_image" "$work/runtime" >/dev/null

# --- the image -----------------------------------------------------------------------------
say "building deploy/Containerfile (BINARY_IMAGE=$binary_image RUNTIME_IMAGE=$runtime_image)"
# --format docker: the OCI format has no HEALTHCHECK. The builder image is never pulled
# (its stage is skipped); naming a local one keeps it so with any podman.
"${podman[@]}" build --pull=never --network=none --format docker \
    --build-arg BUILDER_IMAGE="$binary_image" \
    --build-arg BINARY_IMAGE="$binary_image" \
    --build-arg RUNTIME_IMAGE="$runtime_image" \
    -f deploy/Containerfile -t "$image" "$repo" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log" >&2; fail "podman build"; }

"${podman[@]}" image inspect "$image" >"$work/inspect.json"
# The image's run settings, as shell assignments: user, environment, entrypoint + command.
python3 - "$work/inspect.json" >"$work/settings.sh" <<'EOF'
import json, shlex, sys
inspect = json.load(open(sys.argv[1]))[0]
config = inspect["Config"]
problems = []
if config.get("User") != "65532:65532":
    problems.append(f"User is {config.get('User')!r}, not 65532:65532")
if "/var/lib/agentbridge" not in (config.get("Volumes") or {}):
    problems.append("no VOLUME /var/lib/agentbridge")
for port in ("9464/tcp", "4117/tcp", "8100/tcp", "50051/tcp", "8300/tcp"):
    if port not in (config.get("ExposedPorts") or {}):
        problems.append(f"port {port} is not exposed")
# podman shows the HEALTHCHECK beside Config, docker inside it.
health = (inspect.get("Healthcheck") or config.get("Healthcheck") or {}).get("Test") or []
if "health" not in health:
    problems.append(f"no HEALTHCHECK running `agentbridge health`: {health}")
argv = (config.get("Entrypoint") or []) + (config.get("Cmd") or [])
if "--config" not in argv or argv[argv.index("--config") + 1] != "/etc/agentbridge/bridge.toml":
    problems.append(f"the command does not read /etc/agentbridge/bridge.toml: {argv}")
for p in problems:
    print(f"echo {shlex.quote('image: ' + p)} >&2")
print(f"image_problems={len(problems)}")
print("image_user=" + shlex.quote(config.get("User") or "0:0"))
print("image_env=(" + " ".join(shlex.quote(e) for e in config.get("Env") or []) + ")")
print("image_argv=(" + " ".join(shlex.quote(a) for a in argv) + ")")
print("image_health=(" + " ".join(shlex.quote(a) for a in health[1:]) + ")")
EOF
image_problems=1 image_user='' image_env=() image_argv=() image_health=()
# shellcheck source=/dev/null
. "$work/settings.sh"
[ "$image_problems" -eq 0 ] || fail "the image's settings (above)"

# --- its filesystem --------------------------------------------------------------------------
say "exporting the image's filesystem"
rootfs=$work/rootfs
mkdir -p "$rootfs"
"${podman[@]}" create --name "$container" "$image" >/dev/null
"${podman[@]}" export "$container" | tar -x --numeric-owner -C "$rootfs"
[ -x "$rootfs/usr/local/bin/agentbridge" ] || fail "no /usr/local/bin/agentbridge in the image"
[ -f "$rootfs/etc/agentbridge/bridge.toml" ] || fail "no /etc/agentbridge/bridge.toml in the image"
owner=$(stat -c %u:%g "$rootfs/var/lib/agentbridge")
[ "$owner" = 65532:65532 ] || fail "/var/lib/agentbridge is owned by $owner, not 65532:65532"

userspec=$image_user
case $userspec in *:*) ;; *) userspec=$userspec:$userspec ;; esac
# In the image's root, as its user, with its environment only.
# `exec`: started in the background, the bridge itself is $! (env and chroot exec it too).
in_image() {
    exec env -i "${image_env[@]}" AGENTBRIDGE_ADMIN_TOKEN=check-admin-token \
        chroot --userspec="$userspec" --groups="${userspec#*:}" "$rootfs" "$@"
}

# The image's own config must pass `agentbridge check`.
if ! (in_image /usr/local/bin/agentbridge check --config /etc/agentbridge/bridge.toml) \
    >"$work/config-check.log" 2>&1; then
    cat "$work/config-check.log" >&2
    fail "agentbridge check refuses the image's /etc/agentbridge/bridge.toml"
fi

# The image's config with every listener on a free loopback port (the chroot shares this
# machine's network).
python3 - "$rootfs/etc/agentbridge/bridge.toml" "$rootfs/etc/agentbridge/check.toml" \
    >"$work/ports" <<'EOF'
import re, socket, sys
source, target = sys.argv[1], sys.argv[2]
sockets = []
def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    sockets.append(s)  # held until every port is chosen, so none is chosen twice
    return s.getsockname()[1]
section, out, admin = None, [], None
for line in open(source):
    header = re.match(r"\s*\[\[?([A-Za-z_.]+)\]\]?", line)
    if header:
        section = header.group(1)
    elif re.match(r"\s*(listen|grpc_listen|http_listen)\s*=", line) and section and "." not in section:
        port = free_port()
        if section == "admin":
            admin = port
        line = re.sub(r'"[^"]*"', f'"127.0.0.1:{port}"', line, count=1)
    out.append(line)
if admin is None:
    out.append(f'\n[admin]\nlisten = "127.0.0.1:{free_port()}"\n')
    admin = sockets[-1].getsockname()[1]
open(target, "w").write("".join(out))
print(admin)
EOF
admin_port=$(cat "$work/ports")
chown 65532:65532 "$rootfs/etc/agentbridge/check.toml"

# Sets the array named $1 to the command that follows, its --config pointed at check.toml.
with_check_config() {
    local -n into=$1
    shift
    into=()
    local arg replace_next=0
    for arg in "$@"; do
        if [ "$replace_next" = 1 ]; then arg=/etc/agentbridge/check.toml; replace_next=0; fi
        [ "$arg" = --config ] && replace_next=1
        into+=("$arg")
    done
}
with_check_config argv "${image_argv[@]}"

# --- start it ----------------------------------------------------------------------------------
say "starting ${argv[*]} under chroot as $userspec (admin on 127.0.0.1:$admin_port)"
(in_image "${argv[@]}") >"$work/bridge.log" 2>&1 &
bridge_pid=$!

deadline=$((SECONDS + READY_TIMEOUT))
status=000
while [ "$SECONDS" -lt "$deadline" ]; do
    if ! kill -0 "$bridge_pid" 2>/dev/null; then
        tail -n 20 "$work/bridge.log" >&2
        fail "the bridge exited before it was ready"
    fi
    status=$(curl -s -o "$work/readyz" -w '%{http_code}' --max-time 2 \
        "http://127.0.0.1:$admin_port/readyz" || true)
    [ "$status" = 200 ] && break
    sleep 0.2
done
if [ "$status" != 200 ]; then
    tail -n 20 "$work/bridge.log" >&2
    fail "/readyz did not answer 200 within ${READY_TIMEOUT}s (last: $status)"
fi
say "/readyz: 200 $(cat "$work/readyz")"

curl -sf --max-time 5 "http://127.0.0.1:$admin_port/metrics" >"$work/metrics" ||
    fail "/metrics did not answer"
grep -q '^agentbridge_build_info{' "$work/metrics" || fail "/metrics has no agentbridge_build_info"
[ -n "$(find "$rootfs/var/lib/agentbridge" -mindepth 1 -user 65532 -print -quit)" ] ||
    fail "the bridge wrote nothing to /var/lib/agentbridge"

# The image's HEALTHCHECK.
with_check_config health "${image_health[@]}"
(in_image "${health[@]}") >"$work/health.log" 2>&1 ||
    { cat "$work/health.log" >&2; fail "the HEALTHCHECK command failed: ${health[*]}"; }
say "HEALTHCHECK (${health[*]}): passed"

# --- stop it: SIGTERM drains and exits within [limits] drain_timeout_ms ----------------------
kill -TERM "$bridge_pid"
deadline=$((SECONDS + 30))
while kill -0 "$bridge_pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do
    sleep 0.2
done
if kill -0 "$bridge_pid" 2>/dev/null; then
    fail "the bridge did not exit within 30 s of SIGTERM"
fi
code=0
wait "$bridge_pid" || code=$?
bridge_pid=
[ "$code" -eq 0 ] || { tail -n 20 "$work/bridge.log" >&2; fail "the bridge exited with $code after SIGTERM"; }

say "passed: the image builds offline and its entrypoint answers /readyz under chroot as $userspec"
