#!/usr/bin/env python3
"""Bounded connection flood against `kvroute serve`.

Opens COUNT TCP connections to TARGET that never send a byte (optionally some
that stop inside the HTTP/2 preface), holds them for HOLD seconds while a
normal request (a fresh connection each) is sent to PROBE every 250 ms, and
watches when the server closes the held connections. Prints one JSON line:

  {"opened": ..., "open_failed": ..., "probes_ok": ..., "probes_failed": ...,
   "closed_by_server": ..., "all_closed_after_s": ..., ...}

Bounded: COUNT <= 30000, HOLD <= 120 s; raise `ulimit -n` above COUNT first.
Only loopback targets are accepted.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import threading
import time
import urllib.error
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True, help="host:port of the proxy listener")
    p.add_argument("--probe", required=True, help="URL of a normal request (GET)")
    p.add_argument("--count", type=int, default=10000)
    p.add_argument("--preface-stalls", type=int, default=0, help="connections that send b'PRI * HTTP/2.0' and stop")
    p.add_argument("--hold", type=float, default=20.0)
    a = p.parse_args()
    host, port = a.target.rsplit(":", 1)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print("ERROR loopback targets only", flush=True)
        return 2
    count = min(a.count, 30000)
    hold = min(a.hold, 120.0)

    held: list[socket.socket] = []
    open_failed = 0
    t0 = time.monotonic()
    for i in range(count + a.preface_stalls):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.connect((host, int(port)))
            if i >= count:
                s.sendall(b"PRI * HTTP/2.0\r\n")
            s.setblocking(False)
            held.append(s)
        except OSError:
            open_failed += 1
            s.close()
    opened_s = time.monotonic() - t0

    probes = {"ok": 0, "failed": 0, "statuses": {}}
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            try:
                with urllib.request.urlopen(a.probe, timeout=5) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            except OSError:
                code = 0
            probes["statuses"][str(code)] = probes["statuses"].get(str(code), 0) + 1
            probes["ok" if code == 200 else "failed"] += 1
            stop.wait(0.25)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()

    sel = selectors.DefaultSelector()
    for s in held:
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    all_closed_after = None
    closed_at: list[float] = []
    deadline = t0 + opened_s + hold
    while time.monotonic() < deadline and closed < len(held):
        for key, _ in sel.select(timeout=0.1):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(s)
                s.close()
                closed += 1
                closed_at.append(time.monotonic() - t0)
        if closed == len(held) and all_closed_after is None:
            all_closed_after = time.monotonic() - t0
    stop.set()
    prober.join(timeout=6)
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    print(json.dumps({
        "opened": len(held),
        "open_failed": open_failed,
        "open_took_s": round(opened_s, 2),
        "held_s": hold,
        "probes_ok": probes["ok"],
        "probes_failed": probes["failed"],
        "probe_statuses": probes["statuses"],
        "closed_by_server": closed,
        "first_closed_after_s": round(closed_at[0], 2) if closed_at else None,
        "all_closed_after_s": round(all_closed_after, 2) if all_closed_after else None,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
