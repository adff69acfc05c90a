#!/usr/bin/env python3
"""How soon one `kvroute serve` replica sees another's request (`[replicas]`).

Starts two mock engines and two gateway replicas sharing load (defaults:
sync_interval_ms = 2, heartbeat_ms = 1000) on 127.0.0.1, then per trial sends
one non-streamed completion through replica 1 and polls, with a kept-alive
connection, either replica 2's `/admin/endpoints` (`remote_in_flight`) or, for
the baseline, replica 1's own (`in_flight`) until the request shows, and again
after the answer until it is gone. The baseline carries the same client,
connect, tokenize and decide time, so the difference is what the sharing adds.

    python3 scripts/replica_sync_latency.py [--bin target/release/kvroute] [--trials 50]

Standard library only. Every process it starts is killed at the end.
"""

import argparse
import http.client
import json
import pathlib
import socket
import subprocess
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "golden/tokenizers/qwen3"
CONTRACT = "vllm@0.33.0:sha256_cbor:block=16:seed=0"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_line(proc, prefix, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"process exited before printing {prefix!r}")
        if line.startswith(prefix):
            return line
    raise SystemExit(f"no {prefix!r} line within {timeout}s")


def gateway_toml(listen, admin, peer_admin, engines, ident):
    endpoints = "".join(
        f'[[rules.endpoints]]\nurl = "http://127.0.0.1:{http}"\n'
        f'zmq = "tcp://127.0.0.1:{zmq}"\nreplay = "tcp://127.0.0.1:{replay}"\n\n'
        for http, zmq, replay in engines
    )
    return (
        f'listen = "127.0.0.1:{listen}"\n[admin]\nlisten = "127.0.0.1:{admin}"\n'
        f'[replicas]\nid = "{ident}"\npeers = ["http://127.0.0.1:{peer_admin}"]\n'
        f'[[models]]\nslug = "qwen3"\ndir = "{MODEL_DIR}"\n'
        f'[[rules]]\nname = "qwen3"\nmodels = ["qwen3"]\ndefault = true\n'
        f'choice = "kv_exact"\ntopology = "converged"\ncontract = "{CONTRACT}"\n\n{endpoints}'
    )


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3


def measure(proxy, admin, field, trials):
    poll = http.client.HTTPConnection("127.0.0.1", admin, timeout=30)

    def load():
        poll.request("GET", "/admin/endpoints")
        v = json.loads(poll.getresponse().read())
        return sum(e[field] or 0 for e in v["endpoints"])

    seen, gone = [], []
    for t in range(trials):
        done = {}

        def send():
            c = http.client.HTTPConnection("127.0.0.1", proxy, timeout=30)
            body = json.dumps(
                {"model": "qwen3", "prompt": f"Probe {t}: replica sync visibility.", "max_tokens": 40}
            )
            c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            r = c.getresponse()
            r.read()
            done["at"], done["status"] = time.perf_counter(), r.status

        th = threading.Thread(target=send)
        t0 = time.perf_counter()
        th.start()
        for _ in range(1_000_000):
            if load() >= 1:
                break
        seen.append(time.perf_counter() - t0)
        th.join()
        if done.get("status") != 200:
            raise SystemExit(f"trial {t}: status {done.get('status')}")
        for _ in range(1_000_000):
            if load() == 0:
                break
        gone.append(time.perf_counter() - done["at"])
    return seen, gone


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(REPO / "target/release/kvroute"))
    ap.add_argument("--trials", type=int, default=50)
    args = ap.parse_args()
    procs = []
    tmp = tempfile.TemporaryDirectory()
    try:
        engines = []
        for _ in range(2):
            ports = (free_port(), free_port(), free_port())
            p = subprocess.Popen(
                [args.bin, "mock-engine", "--port", str(ports[0]), "--zmq-port", str(ports[1]),
                 "--replay-port", str(ports[2]), "--model-dir", str(MODEL_DIR), "--model", "qwen3"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            wait_line(p, "mock-engine:")
            engines.append(ports)
        listen = [free_port(), free_port()]
        admin = [free_port(), free_port()]
        for i in range(2):
            path = pathlib.Path(tmp.name) / f"gw{i}.toml"
            path.write_text(gateway_toml(listen[i], admin[i], admin[1 - i], engines, f"gw-{i + 1}"))
            p = subprocess.Popen([args.bin, "serve", "--config", str(path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            procs.append(p)
            wait_line(p, "kvroute serve: proxy=")
        rows = [
            ("replica 1 itself (in_flight)", measure(listen[0], admin[0], "in_flight", args.trials)),
            ("replica 2 (remote_in_flight)", measure(listen[0], admin[1], "remote_in_flight", args.trials)),
        ]
        print(f"{args.trials} sequential requests through replica 1, 2 mock engines, loopback\n")
        print("| seen at | visible after send p50 / p90 / max (ms) | gone after answer p50 / p90 / max (ms) |")
        print("|---|---|---|")
        for name, (seen, gone) in rows:
            print(f"| {name} | {pct(seen, .5):.2f} / {pct(seen, .9):.2f} / {max(seen) * 1e3:.2f} "
                  f"| {pct(gone, .5):.2f} / {pct(gone, .9):.2f} / {max(gone) * 1e3:.2f} |")
    finally:
        for p in procs:
            p.kill()
            p.wait()
        tmp.cleanup()


if __name__ == "__main__":
    main()
