#!/usr/bin/env python3
"""One engine floods `kvroute serve` with distinct block
hashes (10 M, then 30 M in all). The endpoint's inventory must stay at its
default bound (2^20 blocks per tier unless the engine reports its capacity)
with the evictions counted, and the gateway's peak RSS must stop growing once
the inventory is full.

Real peers on 127.0.0.1 only: tests/python/kv_fault_publisher.py (pyzmq/libzmq
XPUB, vLLM 0.33 msgspec batches, `flood_random` op) from the repo's .venv, and
the release `kvroute serve` subscribed to it. Bounded: a fixed number of
batches, every wait has a deadline, both processes are killed at the end.

Usage: scripts/attack_inventory.py [--bin target/release/kvroute]
       [--steps 10000000,20000000] [--keys-per-batch 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import queue

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def metric_sum(text: str, name: str) -> int:
    total = 0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def lines_of(proc: subprocess.Popen) -> "queue.Queue[str]":
    q: "queue.Queue[str]" = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return q


def until(q: "queue.Queue[str]", prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SystemExit(f"no {prefix!r} line within {timeout} s")
        try:
            line = q.get(timeout=left)
        except queue.Empty:
            continue
        if line.startswith("ERROR"):
            raise SystemExit(f"publisher: {line}")
        if line.startswith(prefix):
            return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(REPO, "target/release/kvroute"))
    p.add_argument("--steps", default="10000000,20000000", help="distinct keys per flood step")
    p.add_argument("--keys-per-batch", type=int, default=1000)
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    if sum(steps) > 100_000_000:
        raise SystemExit("at most 10^8 keys in all")
    py = os.path.join(REPO, ".venv/bin/python")
    if not os.path.exists(py):
        raise SystemExit(f"{py} missing: run scripts/python-env.sh")
    k = args.keys_per_batch
    zmq = free_port()
    script = [{"op": "wait_subscriber", "timeout_s": 60}]
    for i, n in enumerate(steps):
        if i:
            script.append({"op": "wait_stdin"})
        script.append({"op": "flood_random", "count": n // k, "keys": k})
    # The publisher closes with LINGER 0, dropping what libzmq still queues:
    # it stays up until the driver has seen every batch applied.
    script.append({"op": "wait_stdin"})
    publisher = subprocess.Popen(
        [py, os.path.join(REPO, "tests/python/kv_fault_publisher.py"), "--endpoint", f"tcp://127.0.0.1:{zmq}",
         "--socket", "xpub", "--hwm", "1000000", "--watchdog-s", str(args.timeout_s), "--script", json.dumps(script)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    model_dir = os.path.join(REPO, "golden/tokenizers/qwen3")
    cfg = (
        'listen = "127.0.0.1:0"\n[admin]\nlisten = "127.0.0.1:0"\n[limits]\nengine_load_poll_ms = 0\n'
        "[health]\ninterval_ms = 0\n"
        f'[[models]]\nslug = "qwen3"\ndir = "{model_dir}"\n'
        '[[rules]]\nname = "kv"\nmodels = ["qwen3"]\ndefault = true\nchoice = "kv_exact"\n'
        'contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0"\n'
        f'[[rules.endpoints]]\nurl = "http://127.0.0.1:{free_port()}"\nengine = "vllm"\nzmq = "tcp://*:{zmq}"\n'
    )
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
        path = f.name
    log = tempfile.TemporaryFile("w+")
    gw = subprocess.Popen([args.bin, "serve", "--config", path], stdout=subprocess.PIPE, stderr=log, text=True,
                          env={**os.environ, "RUST_LOG": "warn"})
    try:
        pub_lines = lines_of(publisher)
        until(pub_lines, "READY", 60)
        gw_lines = lines_of(gw)
        line = until(gw_lines, "kvroute serve: proxy=", 60)
        admin = dict(w.split("=", 1) for w in line.split() if "=" in w)["admin"]
        time.sleep(1.0)
        base = vm_hwm(gw.pid)
        print(f"baseline VmHWM {base >> 20} MB", flush=True)
        sent = 0
        for i, n in enumerate(steps):
            if i:
                publisher.stdin.write("go\n")
                publisher.stdin.flush()
            t0 = time.monotonic()
            until(pub_lines, "FLOODED", args.timeout_s)
            sent += n // k
            deadline = time.monotonic() + args.timeout_s
            while True:
                text = get(f"{admin}/metrics")
                applied = metric_sum(text, "kvroute_subscriber_events_applied_total")
                if applied >= sent:
                    break
                if time.monotonic() > deadline:
                    print(f"  only {applied} of {sent} batches applied within {args.timeout_s} s", flush=True)
                    break
                time.sleep(0.2)
            took = time.monotonic() - t0
            eps = json.loads(get(f"{admin}/admin/endpoints"))["endpoints"]
            blocks = sum(e.get("inventory_blocks", 0) for e in eps)
            gaps = metric_sum(text, "kvroute_subscriber_gaps_total")
            cap = metric_sum(text, "kvroute_ingest_capacity_blocks")
            mem = metric_sum(text, "kvroute_inventory_memory_bytes")
            hwm = vm_hwm(gw.pid)
            print(
                f"after {sent * k:,} distinct keys ({sent} batches applied {applied}, {took:.1f} s): inventory "
                f"{blocks:,} blocks (capacity gauge {cap:,}), inventory memory {mem >> 20} MB, gaps {gaps}; "
                f"VmHWM {hwm >> 20} MB (+{(hwm - base) >> 20} MB)",
                flush=True,
            )
        publisher.stdin.write("done\n")
        publisher.stdin.flush()
    finally:
        for proc in (publisher, gw):
            proc.kill()
            proc.wait()
        log.close()
        os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
