#!/usr/bin/env python3
"""A scripted stand-in for `trtllm-serve`'s `POST /kv_cache_events` (destructive drain).

Each POST consumes the next scripted response; once the script is used up every
drain answers `[]` (an idle engine). Response steps (JSON list, argv `--script` or
the first stdin line):
  {"body_file": "golden/trtllm-events/classic/02_context_blocks_stored.json"}
  {"body": [...]}                 literal JSON body
  {"status": 500}                 an error status (body "internal error")
  {"delay_ms": 3000, ...}         sleep before answering (client timeouts)
  {"raw": "not json"}             a 200 with a garbage body
Prints `READY port=N` once listening and `SERVED n status=S` per request, flushed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Script:
    def __init__(self, steps: list[dict]) -> None:
        self.steps = list(steps)
        self.lock = threading.Lock()
        self.served = 0

    def next(self) -> dict:
        with self.lock:
            self.served += 1
            return self.steps.pop(0) if self.steps else {"body": []}


def make_handler(script: Script):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # keep stderr quiet
            pass

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            if self.path != "/kv_cache_events":
                self.reply(404, b"not found", "text/plain")
                return
            step = script.next()
            n = script.served
            if "delay_ms" in step:
                time.sleep(step["delay_ms"] / 1000)
            if "status" in step:
                self.reply(int(step["status"]), b"internal error", "text/plain")
            elif "raw" in step:
                self.reply(200, step["raw"].encode(), "application/json")
            elif "body_file" in step:
                with open(step["body_file"], "rb") as f:
                    self.reply(200, f.read(), "application/json")
            else:
                self.reply(200, json.dumps(step["body"]).encode(), "application/json")
            print(f"SERVED {n} status={step.get('status', 200)}", flush=True)

        def reply(self, status: int, body: bytes, ctype: str) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test)

    return Handler


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--script", default=None)
    p.add_argument("--watchdog-s", type=float, default=60.0)
    args = p.parse_args()
    steps = json.loads(args.script if args.script is not None else sys.stdin.readline())
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(Script(steps)))
    server.daemon_threads = True
    timer = threading.Timer(args.watchdog_s, server.shutdown)
    timer.daemon = True
    timer.start()
    print(f"READY port={server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
