#!/usr/bin/env bash
# Validates deploy/kubernetes/ offline:
#   1. every manifest against the Kubernetes API schemas (PyPI `kubernetes-validate`,
#      strict: unknown fields are errors), for the oldest Kubernetes the manifests need
#      (1.30: native sidecars, preStop `sleep`) and the newest the package knows;
#   2. that the pieces fit: every Secret and ConfigMap key referenced exists, every ${VAR}
#      of the bridge's config is in the bridge container's environment, Services and the
#      ServiceMonitor select what exists by ports that exist, the NATS routes and the
#      bridge's [federation] servers name the StatefulSet's pods, the grace period covers
#      preStop and the drain, the kustomization lists every manifest (but the Secret's
#      example);
#   3. with AGENTBRIDGE=path/to/agentbridge, `agentbridge check` accepts the ConfigMap's
#      bridge.toml and the image's deploy/container/bridge.toml; with a nats-server in the
#      tools' venv, `nats-server -t` accepts nats.yaml's server config.
#
# kubernetes-validate is installed on first use into target/test-tools/venv (the tests'
# tools venv; needs python3 and access to PyPI). Exit status 0 when everything passes.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
tools=$repo/target/test-tools
venv=$tools/venv
MIN_KUBERNETES=1.30.0

say() { printf 'deploy/kubernetes/validate.sh: %s\n' "$*" >&2; }

mkdir -p "$tools"
# The same lock the tests take (tests/common/tools.rs) around installs into this venv.
exec 9>"$tools/venv.lock"
flock 9
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || { say "python3 -m venv failed (install python3 and python3-venv)"; exit 1; }
fi
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    "$venv/bin/python" -m pip install --quiet kubernetes-validate ||
        { say "pip install kubernetes-validate failed (needs access to PyPI)"; exit 1; }
fi
flock -u 9

manifests=()
for file in "$here"/*.yaml; do
    [ "$(basename "$file")" = kustomization.yaml ] && continue
    manifests+=("$file")
done

status=0
latest=$("$venv/bin/python" -c 'from kubernetes_validate import utils; print(utils.latest_version())')
for version in "$MIN_KUBERNETES" "$latest"; do
    say "schemas of Kubernetes $version (strict)"
    # Kinds without a schema (the ServiceMonitor CRD) are warnings; step 2 checks them.
    out=$("$venv/bin/kubernetes-validate" --strict --quiet -k "$version" "${manifests[@]}" 2>&1) ||
        status=1
    [ -z "$out" ] || printf '%s\n' "$out" >&2
    if printf '%s\n' "$out" | grep -v 'servicemonitor.yaml' | grep -q WARN; then
        say "a manifest other than the ServiceMonitor has no schema"
        status=1
    fi
done

say "cross-references"
"$venv/bin/python" - "$here" <<'EOF' || status=1
import glob, os, re, sys, tomllib
import yaml

here = sys.argv[1]
errors = []
resources = []  # (file, resource)
for path in sorted(glob.glob(os.path.join(here, "*.yaml"))):
    name = os.path.basename(path)
    for doc in yaml.safe_load_all(open(path)):
        if doc:
            resources.append((name, doc))

def of_kind(kind):
    return [r for f, r in resources if r.get("kind") == kind]

# The kustomization lists every manifest but the example Secret, and nothing else.
kustomization = of_kind("Kustomization")
files = {f for f, r in resources if r.get("kind") != "Kustomization"} - {"secret.example.yaml"}
if len(kustomization) != 1:
    errors.append("expected one kustomization.yaml")
elif set(kustomization[0].get("resources", [])) != files:
    errors.append(f"kustomization resources {sorted(kustomization[0].get('resources', []))} != {sorted(files)}")

for f, r in resources:
    if r.get("kind") == "Kustomization":
        continue
    if not (r.get("apiVersion") and r.get("metadata", {}).get("name")):
        errors.append(f"{f}: a resource without apiVersion or metadata.name")
    if r.get("metadata", {}).get("namespace"):
        errors.append(f"{f}: {r['metadata']['name']} names a namespace (kustomization sets it)")

secrets = {r["metadata"]["name"]: set(r.get("stringData", {})) | set(r.get("data", {})) for r in of_kind("Secret")}
configmaps = {r["metadata"]["name"]: r.get("data", {}) for r in of_kind("ConfigMap")}

workloads = of_kind("Deployment") + of_kind("StatefulSet")
def pod_containers(w):
    spec = w["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec.get("containers", [])

def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

for w in workloads:
    wname = f"{w['kind']} {w['metadata']['name']}"
    template = w["spec"]["template"]
    if not matches(w["spec"]["selector"]["matchLabels"], template["metadata"].get("labels", {})):
        errors.append(f"{wname}: selector does not match its pod labels")
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    claims = {c["metadata"]["name"] for c in w["spec"].get("volumeClaimTemplates", [])}
    for v in volumes.values():
        if "configMap" in v and v["configMap"]["name"] not in configmaps:
            errors.append(f"{wname}: volume {v['name']} names ConfigMap {v['configMap']['name']}, which is not defined")
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            if claim not in {p["metadata"]["name"] for p in of_kind("PersistentVolumeClaim")}:
                errors.append(f"{wname}: volume {v['name']} names PVC {claim}, which is not defined")
    for c in pod_containers(w):
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref and ref["key"] not in secrets.get(ref["name"], set()):
                errors.append(f"{wname}/{c['name']}: env {env['name']} needs key {ref['key']} of Secret {ref['name']}")
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes and m["name"] not in claims:
                errors.append(f"{wname}/{c['name']}: mounts {m['name']}, which is not a volume")
        port_names = {p.get("name") for p in c.get("ports", [])}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            if isinstance(port, str) and port not in port_names:
                errors.append(f"{wname}/{c['name']}: {probe} uses port {port}, which it does not name")

# Services select pods by labels and forward to named ports those pods have.
services = {s["metadata"]["name"]: s for s in of_kind("Service")}
for s in services.values():
    selected = [w for w in workloads if matches(s["spec"].get("selector"), w["spec"]["template"]["metadata"].get("labels", {}))]
    if not selected:
        errors.append(f"Service {s['metadata']['name']} selects no pod")
    for p in s["spec"]["ports"]:
        target = p.get("targetPort")
        if isinstance(target, str) and not any(target in {q.get("name") for c in pod_containers(w) for q in c.get("ports", [])} for w in selected):
            errors.append(f"Service {s['metadata']['name']}: targetPort {target} is no port of the pods it selects")

# The ServiceMonitor selects the admin Service by its labels and a port it names.
monitors = of_kind("ServiceMonitor")
if not monitors:
    errors.append("no ServiceMonitor")
for m in monitors:
    if m.get("apiVersion") != "monitoring.coreos.com/v1":
        errors.append(f"ServiceMonitor {m['metadata']['name']}: apiVersion {m.get('apiVersion')}")
    chosen = [s for s in services.values() if matches(m["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
    if not chosen:
        errors.append(f"ServiceMonitor {m['metadata']['name']} selects no Service")
    for e in m["spec"]["endpoints"]:
        if not any(e.get("port") in {p.get("name") for p in s["spec"]["ports"]} for s in chosen):
            errors.append(f"ServiceMonitor {m['metadata']['name']}: port {e.get('port')} is no port of the Services it selects")
        if e.get("path", "/metrics") != "/metrics":
            errors.append("ServiceMonitor: the bridge serves /metrics")

# NATS: a headless Service for the StatefulSet; routes and the bridges' servers are its pods.
sts = {s["metadata"]["name"]: s for s in of_kind("StatefulSet")}
pod_dns = set()
for name, s in sts.items():
    svc = services.get(s["spec"]["serviceName"])
    if not svc or svc["spec"].get("clusterIP") != "None":
        errors.append(f"StatefulSet {name}: serviceName {s['spec']['serviceName']} is not a headless Service")
    for i in range(s["spec"]["replicas"]):
        pod_dns.add(f"{name}-{i}.{s['spec']['serviceName']}")
nats = sts.get("nats")
if not nats or nats["spec"]["replicas"] != 3:
    errors.append("the NATS StatefulSet has not 3 replicas")
nats_conf = configmaps.get("nats-config", {}).get("nats-server.conf", "")
if "jetstream" not in nats_conf:
    errors.append("nats-server.conf does not enable JetStream")
routes = re.findall(r"nats://([a-z0-9.-]+):6222", nats_conf)
if set(routes) != pod_dns or len(routes) != 3:
    errors.append(f"NATS routes {routes} are not the StatefulSet's pods {sorted(pod_dns)}")

# The bridge's config: every ${VAR} is in the sidecar's environment; federation names the
# NATS pods; the grace period covers preStop and the drain.
for w in of_kind("Deployment"):
    wname = f"Deployment {w['metadata']['name']}"
    bridges = [c for c in pod_containers(w) if "agentbridge" in c["image"]]
    if len(bridges) != 1:
        errors.append(f"{wname}: expected one agentbridge container")
        continue
    bridge = bridges[0]
    mounts = {m["mountPath"]: m["name"] for m in bridge.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
    config_volume = volumes.get(mounts.get("/etc/agentbridge"), {})
    text = configmaps.get(config_volume.get("configMap", {}).get("name"), {}).get("bridge.toml")
    if text is None:
        errors.append(f"{wname}: no bridge.toml mounted at /etc/agentbridge")
        continue
    env = {e["name"] for e in bridge.get("env", [])}
    for var in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", text):
        if var not in env:
            errors.append(f"{wname}: bridge.toml uses ${{{var}}}, not in the agentbridge container's env")
    config = tomllib.loads(text)
    servers = [re.sub(r"^nats://|:4222$", "", u) for u in config.get("federation", {}).get("nats", [])]
    nats_pods = {f"nats-{i}.{nats['spec']['serviceName']}" for i in range(nats["spec"]["replicas"])} if nats else set()
    if set(servers) != nats_pods or len(servers) != len(nats_pods):
        errors.append(f"{wname}: [federation] nats {servers} are not the NATS pods")
    admin_port = int(config.get("admin", {}).get("listen", "127.0.0.1:9464").rsplit(":", 1)[1])
    if admin_port not in {p["containerPort"] for p in bridge.get("ports", [])}:
        errors.append(f"{wname}: the admin port {admin_port} is not a container port")
    if not config.get("admin", {}).get("listen", "").startswith("127.0.0.1") and "token" not in config.get("admin", {}):
        errors.append(f"{wname}: a non-loopback admin listener needs [admin] token")
    if config.get("bridge", {}).get("data_dir") not in mounts:
        errors.append(f"{wname}: data_dir is not a mounted volume")
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        if bridge.get(probe, {}).get("httpGet", {}).get("path") != path:
            errors.append(f"{wname}: the bridge's {probe} is not {path}")
    if "limits" not in bridge.get("resources", {}) or "requests" not in bridge.get("resources", {}):
        errors.append(f"{wname}: the bridge has no resource requests and limits")
    drain = config.get("limits", {}).get("drain_timeout_ms", 10000) / 1000
    pre_stop = bridge.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    if grace <= drain + pre_stop:
        errors.append(f"{wname}: terminationGracePeriodSeconds {grace} <= preStop {pre_stop} s + drain {drain} s")

for e in errors:
    print(f"ERROR {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
EOF

# The configs themselves, by the programs that read them.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$venv/bin/python" - "$here/agent.yaml" "$here/nats.yaml" "$scratch" <<'EOF'
import sys, yaml
agent, nats, out = sys.argv[1:]
for path, name, key in ((agent, "team-a-agentbridge", "bridge.toml"), (nats, "nats-config", "nats-server.conf")):
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == name:
            open(f"{out}/{key}", "w").write(doc["data"][key])
EOF
if [ -n "${AGENTBRIDGE:-}" ]; then
    for config in "$scratch/bridge.toml" "$repo/deploy/container/bridge.toml"; do
        shown=${config#"$repo/"}
        [ "$config" = "$scratch/bridge.toml" ] && shown="agent.yaml's bridge.toml"
        # The data dir and scratchpad moved somewhere writable; the variables set.
        sed -e "s#\"/var/lib/agentbridge\"#\"$scratch/data\"#" -e "s#\"/grid/#\"$scratch/grid/#" \
            "$config" >"$scratch/check.toml"
        if ! env AGENTBRIDGE_ADMIN_TOKEN=placeholder-admin-token-0123456789 NATS_TOKEN=placeholder-nats \
            TRACKER_ADMIN_TOKEN=tb-placeholder-admin TRACKER_CODER_TOKEN=tb-placeholder-coder \
            "$AGENTBRIDGE" check --config "$scratch/check.toml" >"$scratch/check.log" 2>&1; then
            cat "$scratch/check.log" >&2
            say "agentbridge check refuses $shown"
            status=1
        fi
    done
fi
if [ -x "$venv/bin/nats-server" ]; then
    sed -e "s#/data/jetstream#$scratch/js#" -e "s#/var/run/nats/#$scratch/#" \
        "$scratch/nats-server.conf" >"$scratch/nats.conf"
    if ! POD_NAME=nats-0 NATS_TOKEN=x "$venv/bin/nats-server" -t -c "$scratch/nats.conf" >"$scratch/nats.log" 2>&1; then
        cat "$scratch/nats.log" >&2
        say "nats-server -t refuses nats.yaml's nats-server.conf"
        status=1
    fi
fi

if [ "$status" -eq 0 ]; then
    say "passed: ${#manifests[@]} manifests"
fi
exit "$status"
