#!/usr/bin/env python3
"""Peak RSS of `kvroute serve` under N parallel distinct
~1 M-character prompts, with the tokenization admission limits and without
them (limits raised out of reach, i.e. main before the cap).

Everything runs on 127.0.0.1: the gateway (release binary), and an in-process
echo upstream that reads each body and answers a small completion (it never
tokenizes, so only the gateway's memory is measured). Bounded: N requests per
run, each with a client timeout; the gateway is killed at the end.

Usage: scripts/attack_tokenize.py [--bin target/release/kvroute] [--count 16]
       [--chars 1000000] [--runs default,capped,wait,uncapped] [--cap-count N --cap-bytes B]
(default: the gateway's defaults, policy "wait" up to 250 ms; capped: the default limits and policy "skip"; wait: the default limits, policy
"wait" with a 300 s bound, so every prompt is tokenized in turn; uncapped: the
limits out of reach.)
Prints one line per run: VmHWM before/after, growth, admitted/overloaded.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server API)
        n = int(self.headers.get("content-length", "0"))
        body = self.rfile.read(n)
        out = json.dumps({"len": len(body), "usage": {"prompt_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST

    def log_message(self, *_args):
        pass


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def prompt(seed: int, chars: int) -> str:
    parts, total, i = [], 0, 0
    while total < chars:
        w = f"s{seed}w{(i * 2654435761) % 1000003} "
        parts.append(w)
        total += len(w)
        i += 1
    return "".join(parts)[:chars]


def post(url: str, body: bytes, timeout: float) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def run(args, name: str, limits: str, upstream: int) -> None:
    model_dir = os.path.join(REPO, "golden/tokenizers/qwen3")
    cfg = (
        'listen = "127.0.0.1:0"\n[admin]\nlisten = "127.0.0.1:0"\n'
        f"[limits]\nmax_prompt_tokens = 2000000\n{limits}\n[health]\ninterval_ms = 0\n"
        f'[[models]]\nslug = "qwen3"\ndir = "{model_dir}"\n'
        '[[rules]]\nname = "kv"\nmodels = ["qwen3"]\ndefault = true\nchoice = "kv_exact"\n'
        'contract = "vllm@0.33.0:sha256_cbor:block=16:seed=0"\n'
        f'[[rules.endpoints]]\nurl = "http://127.0.0.1:{upstream}"\n'
        # No engine publishes events (a port nothing listens on): every
        # tokenized prompt is a KV miss, which is all this attack needs.
        f'zmq = "tcp://*:{closed_port()}"\n'
    )
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(cfg)
        path = f.name
    log = tempfile.TemporaryFile("w+")
    gw = subprocess.Popen(
        [args.bin, "serve", "--config", path],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={**os.environ, "RUST_LOG": "warn"},
    )
    try:
        proxy = admin = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = gw.stdout.readline()
            if not line:
                break
            if line.startswith("kvroute serve: proxy="):
                words = dict(w.split("=", 1) for w in line.split() if "=" in w)
                proxy, admin = words["proxy"], words["admin"]
                break
        if proxy is None:
            gw.kill()
            raise SystemExit(f"{name}: kvroute serve printed no start line: {log.seek(0) or log.read()[-2000:]}")
        url = f"{proxy}/v1/completions"
        warm = json.dumps({"model": "qwen3", "prompt": "warm up", "max_tokens": 1}).encode()
        for _ in range(600):  # the proxy may answer 503 until the tokenizer loaded
            try:
                if post(url, warm, 30)[0] == 200:
                    break
            except Exception:  # noqa: BLE001
                time.sleep(0.1)
        bodies = [
            json.dumps({"model": "qwen3", "prompt": prompt(i, args.chars), "max_tokens": 1}).encode()
            for i in range(args.count)
        ]
        before = vm_hwm(gw.pid)
        results: list = [None] * len(bodies)

        def one(i: int) -> None:
            try:
                results[i] = post(url, bodies[i], 300)[0]
            except Exception as e:  # noqa: BLE001
                results[i] = repr(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(330)
        took = time.monotonic() - t0
        after = vm_hwm(gw.pid)
        counters = get_json(f"{admin}/admin/counters")
        tok = counters.get("tokenize", {})
        ok = sum(1 for r in results if r == 200)
        print(
            f"{name}: {args.count} x {args.chars}-char prompts ({limits.strip().replace(chr(10), '; ') or 'defaults'}): "
            f"{ok}/{args.count} answered 200 in {took:.1f} s; VmHWM {before >> 20} MB -> {after >> 20} MB "
            f"(+{(after - before) >> 20} MB); admitted {tok.get('admitted')}, overloaded {tok.get('overloaded')}, "
            f"peak in flight {tok.get('peak_in_flight')} / {tok.get('peak_bytes_in_flight')} B",
            flush=True,
        )
        if ok != args.count:
            print(f"  failures: {[r for r in results if r != 200]}", flush=True)
    finally:
        gw.kill()
        gw.wait()
        log.close()
        os.unlink(path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.path.join(REPO, "target/release/kvroute"))
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--chars", type=int, default=1_000_000)
    p.add_argument("--runs", default="default,capped,uncapped")
    p.add_argument("--cap-count", type=int, default=None, help="max_concurrent_tokenizations (default: the gateway's)")
    p.add_argument("--cap-bytes", type=int, default=None, help="max_tokenize_bytes_in_flight (default: the gateway's)")
    args = p.parse_args()
    if args.count > 256 or args.chars > 1 << 20:
        raise SystemExit("--count <= 256 and --chars <= 1 Mi (the default max_prompt_chars)")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    upstream = server.server_address[1]
    for name in args.runs.split(","):
        if name == "default":
            limits = ""
        elif name == "capped":
            limits = 'tokenize_overload = "skip"\n'
            if args.cap_count:
                limits += f"max_concurrent_tokenizations = {args.cap_count}\n"
            if args.cap_bytes:
                limits += f"max_tokenize_bytes_in_flight = {args.cap_bytes}\n"
        elif name == "wait":
            limits = 'tokenize_overload = "wait"\ntokenize_wait_ms = 300000\n'
        elif name == "uncapped":
            limits = "max_concurrent_tokenizations = 100000\nmax_tokenize_bytes_in_flight = 1099511627776\n"
        else:
            raise SystemExit(f"unknown run {name!r}")
        run(args, name, limits, upstream)
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
