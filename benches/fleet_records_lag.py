#!/usr/bin/env python3
"""How long a write acknowledged by one bridge of a fleet takes to show on another.

Starts a NATS server (JetStream, one replica) and two release bridges on the bundled
bridge.toml with a [federation] section, then N times: a Tracker task is created through
bridge A (the clock starts when A answers 201) and the task.created event for it arrives
on a subscribed Tracker connection of bridge B (the clock stops); B often has it before A
has answered, so the same from when A was asked is printed too. Prints p50/p90/p99/max.
Then the same for `take`: A's 200 to B's task.assigned.

    cargo build --release --bin agentbridge
    pip install websockets aiohttp
    python3 benches/fleet_records_lag.py [N]

nats-server comes from PATH or target/test-tools/venv (what .ci/run installs).
"""

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
import websockets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRIDGE = os.path.join(ROOT, "target", "release", "agentbridge")
TOKEN = "tb-admin-change-me"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_binary():
    found = shutil.which("nats-server")
    venv = os.path.join(ROOT, "target", "test-tools", "venv", "bin", "nats-server")
    return found or venv


def start_bridge(work, name, nats_url):
    config = open(os.path.join(ROOT, "bridge.toml")).read()
    config = re.sub(r'listen = "127\.0\.0\.1:\d+"', 'listen = "127.0.0.1:0"', config)
    config = re.sub(r'data_dir = "[^"]*"', f'data_dir = "{work}/data-{name}"', config)
    config += (
        f'\n[federation]\nnats = ["{nats_url}"]\nbridge_id = "{name}"\nreplicas = 1\n'
    )
    path = os.path.join(work, f"{name}.toml")
    open(path, "w").write(config)
    proc = subprocess.Popen(
        [BRIDGE, "run", "--log-format", "json", "--config", path],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    addrs = {}
    for line in proc.stderr:
        try:
            fields = json.loads(line)["fields"]
        except (ValueError, KeyError):
            continue
        if fields.get("message") == "listening":
            addrs.setdefault(fields["endpoint"], fields["addr"])
        if fields.get("message") == "ready":
            break
    # Keep draining its log, or the pipe fills.
    asyncio.get_event_loop().run_in_executor(None, lambda: [None for _ in proc.stderr])
    return proc, addrs


async def wait_ready(http, admin):
    for _ in range(200):
        async with http.get(f"http://{admin}/readyz") as r:
            if (await r.text()).startswith("ready"):
                return
        await asyncio.sleep(0.05)
    raise SystemExit(f"bridge at {admin} did not get ready")


async def next_event(ws, kind, task_id):
    while True:
        frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if frame.get("type") == kind and frame["data"].get("id") == task_id:
            return


def report(what, lags):
    lags = sorted(lags)

    def at(q):
        return lags[min(len(lags) - 1, int(q * len(lags)))] * 1000

    print(
        f"{what}: n={len(lags)} p50 {at(0.5):.1f} ms, p90 {at(0.9):.1f} ms, "
        f"p99 {at(0.99):.1f} ms, max {lags[-1] * 1000:.1f} ms"
    )


async def main(n):
    work = tempfile.mkdtemp()
    port = free_port()
    nats = subprocess.Popen(
        [nats_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", f"{work}/nats"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    procs = []
    try:
        url = f"nats://127.0.0.1:{port}"
        a, a_addrs = start_bridge(work, "a", url)
        b, b_addrs = start_bridge(work, "b", url)
        procs = [a, b]
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            await wait_ready(http, a_addrs["admin"])
            await wait_ready(http, b_addrs["admin"])
            async with websockets.connect(f"ws://{b_addrs['tracker']}/ws") as ws:
                await ws.send(json.dumps({"type": "auth", "token": TOKEN}))
                ok = json.loads(await ws.recv())
                for project in ok["data"]["projects"]:
                    await ws.send(
                        json.dumps({"type": "project.subscribe", "project_id": project["id"]})
                    )
                api = f"http://{a_addrs['tracker']}/api/v1"
                created, taken, round_trip = [], [], []
                for i in range(n):
                    asked = time.monotonic()
                    async with http.post(
                        f"{api}/tasks?project_slug=team-board", json={"title": f"lag {i}"}
                    ) as r:
                        task = await r.json()
                        assert r.status == 201, task
                    start = time.monotonic()
                    await next_event(ws, "task.created", task["id"])
                    created.append(time.monotonic() - start)
                    round_trip.append(time.monotonic() - asked)
                    async with http.post(f"{api}/tasks/{task['id']}/take?slug=coder") as r:
                        assert r.status == 200, await r.text()
                    start = time.monotonic()
                    await next_event(ws, "task.assigned", task["id"])
                    taken.append(time.monotonic() - start)
                report("create on A → task.created on B", created)
                report("create asked of A → task.created on B", round_trip)
                report("take on A → task.assigned on B", taken)
    finally:
        for p in procs:
            p.kill()
        nats.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 500))
