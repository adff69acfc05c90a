#!/usr/bin/env python3
"""kvroute (default KV-exact policy) against SGLang Model Gateway `cache_aware`.

Both gateways sit in front of the same 4 `kvroute mock-engine` processes on
127.0.0.1. A closed-loop multi-turn chat workload (conversations grow turn by
turn, so every turn repeats the previous turns' prefix) is driven against each
gateway in turn, interleaved, for every (concurrency, streaming) cell and run.
Before each measurement the engines' prefix caches are emptied
(`POST /admin/restart-publisher`, which also clears the mock's cache) and the
gateway under test is started fresh, so neither gateway inherits state.

The load generator is this asyncio + aiohttp (+ uvloop) client: the Rust
generator of `kvroute bench gateway` starts its own engines and gateway
in-process and sends single-turn, non-streamed completions only, so it cannot
be pointed at SMG. The client's CPU use is recorded per measurement
(`client_cpu`: process CPU seconds / wall seconds, 1.0 = one core saturated)
so a client-bound result is visible, and so is each gateway's own CPU per request
(`gateway_cpu_ms_per_request`: its process group's CPU seconds over the run, which
other work on a shared machine moves far less than req/s or latency).

Run through scripts/bench_smg.sh (venv, build, cleanup trap).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

# benchlib sits beside this file (put first on sys.path also under -P / PYTHONSAFEPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    CLIENT, CLK_TCK, CONTRACT, ENGINES, HOST, MODEL, Engine, SplitMix, Tally, add_engine_args, configure,
    engine_log_entries, engine_log_offsets, engine_requests, free_ports, http, install_uvloop, kvroute_toml,
    log, log_dir, median, pct, proxy_answers, reset_engines, spawn, sse_json, start_engines, stop, stop_all,
    stop_all_on_signals, subscribers_connected, wait_until,
)

configure("bench_smg", "BENCH_SMG_PIDFILE")


# ---------------------------------------------------------------- gateways


@dataclass
class Gateway:
    name: str
    url: str
    proc: subprocess.Popen
    logfile: Path
    admin: str | None = None


def start_kvroute(args, engines, tmp: Path, tag: str) -> Gateway:
    listen, admin = free_ports(2)
    cfg = tmp / "kvroute.toml"
    cfg.write_text(kvroute_toml(engines, listen, admin, args.model_dir, scorer=args.kvroute_scorer,
                                cost=args.kvroute_cost))
    logfile = tmp / f"kvroute-{tag}.log"
    p = spawn([args.kvroute, "serve", "--config", str(cfg)], logfile)
    admin_url = f"http://{HOST}:{admin}"
    wait_until("kvroute subscribers", lambda: subscribers_connected(admin_url), [p], 60, logfile)
    url = f"http://{HOST}:{listen}"
    wait_until("kvroute proxy", lambda: proxy_answers(url), [p], 60, logfile)
    return Gateway("kvroute", url, p, logfile, admin_url)


def start_embedded(args, engines, tmp: Path, tag: str) -> Gateway:
    """The library alone: a KvRouter with the builder's defaults in the embedding
    example's axum proxy (`embed_axum`), following the same engines' events."""
    (listen,) = free_ports(1)
    logfile = tmp / f"embedded-{tag}.log"
    cmd = [
        args.embed, f"{HOST}:{listen}", CONTRACT,
        f"{MODEL}={Path(args.model_dir).resolve()}",
        *[f"{e.url},tcp://*:{e.zmq},tcp://*:{e.replay}" for e in engines],
    ]
    p = spawn(cmd, logfile)
    url = f"http://{HOST}:{listen}"
    wait_until("embedded proxy", lambda: proxy_answers(url), [p], 60, logfile)
    # No admin API to ask: give the subscribers' handshake the moment the
    # gateway's arm waits for explicitly (the replay socket covers a miss).
    time.sleep(0.5)
    return Gateway("kvroute-embedded", url, p, logfile)


def start_smg(args, engines, tmp: Path, tag: str) -> Gateway:
    port, prom = free_ports(2)
    logfile = tmp / f"smg-{tag}.log"
    cmd = [
        args.smg, "launch",
        "--host", HOST, "--port", str(port),
        "--prometheus-host", HOST, "--prometheus-port", str(prom),
        "--policy", "cache_aware",
        "--log-level", "warn",
        "--worker-urls", *[e.url for e in engines],
    ]
    p = spawn(cmd, logfile)
    url = f"http://{HOST}:{port}"
    wait_until("smg proxy", lambda: proxy_answers(url), [p], 120, logfile)
    # All workers registered (SMG adds them asynchronously after start).
    def all_workers() -> bool:
        status, body = http("GET", f"{url}/workers")
        if status != 200:
            return True  # no such listing in this version: the warm-up answered
        try:
            healthy = {
                w.get("url") for w in json.loads(body).get("workers", []) if w.get("is_healthy")
            }
        except (ValueError, AttributeError):
            return False
        return all(e.url in healthy for e in engines)

    wait_until("smg workers", all_workers, [p], 60, logfile)
    return Gateway("smg", url, p, logfile)


# ---------------------------------------------------------------- workload


def conversations(requests: int, tenants: int, seed: int) -> list[tuple[str, list[str], int]]:
    """(system prompt, user turns, tenant) per conversation; exactly `requests` turns in all."""
    rng = SplitMix(seed)
    systems = [f"Tenant {t} assistant rules: {rng.words(250)}" for t in range(tenants)]
    out, total, c = [], 0, 0
    while total < requests:
        turns = min(3 + rng.below(8), requests - total)  # 3..10 turns
        tenant = rng.below(tenants)
        system = systems[tenant]
        users = [f"Conversation {c} turn {k}: {rng.words(20 + rng.below(21))}?" for k in range(turns)]
        out.append((system, users, tenant))
        total += turns
        c += 1
    return out


@dataclass
class Sample:
    latency: float
    ttft: float | None
    prompt_tokens: int
    cached_tokens: int
    # Per-request trace (--trace): who asked, when, and which engine answered.
    conv: int = -1
    turn: int = -1
    tenant: int = -1
    start: float = 0.0  # perf_counter at send
    unix_start: float = 0.0
    response_id: str = ""


async def one_turn(session: aiohttp.ClientSession, url: str, messages: list, stream: bool, max_tokens: int,
                   tally: Tally, who: tuple[int, int, int]):
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    unix0 = time.time()
    t0 = time.perf_counter()
    response_id = ""
    async with session.post(url, data=data, headers={"content-type": "application/json"}) as resp:
        if resp.status != 200:
            text = await resp.text()
            tally.fail(f"HTTP {resp.status}: {text[:200]}")
            return None
        if not stream:
            raw = await resp.read()
            latency = time.perf_counter() - t0
            v = json.loads(raw)
            response_id = str(v.get("id") or "")
            content = v["choices"][0]["message"]["content"]
            usage = v.get("usage") or {}
            ttft = None
        else:
            ttft = None
            parts: list[str] = []
            usage = {}
            async for v in sse_json(resp):
                if not response_id:
                    response_id = str(v.get("id") or "")
                if v.get("usage"):
                    usage = v["usage"]
                for ch in v.get("choices") or ():
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(piece)
            latency = time.perf_counter() - t0
            content = "".join(parts)
    prompt = int(usage.get("prompt_tokens") or 0)
    if prompt <= 0:
        tally.fail(f"no usage.prompt_tokens (stream={stream})")
        return None
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    conv, turn, tenant = who
    tally.samples.append(Sample(latency, ttft if ttft is not None else latency, prompt, cached,
                                conv, turn, tenant, t0, unix0, response_id))
    return content


async def drive(url: str, convs, concurrency: int, stream: bool, max_tokens: int, timeout: float) -> tuple[Tally, float, float]:
    tally = Tally()
    endpoint = f"{url}/v1/chat/completions"
    nxt = iter(range(len(convs)))
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, force_close=False)
    to = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=to) as session:

        async def worker() -> None:
            for ci in nxt:  # shared iterator: each conversation is taken once
                system, users, tenant = convs[ci]
                messages = [{"role": "system", "content": system}]
                for k, u in enumerate(users):
                    messages.append({"role": "user", "content": u})
                    try:
                        reply = await one_turn(session, endpoint, messages, stream, max_tokens, tally,
                                               (ci, k, tenant))
                    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError) as e:
                        tally.fail(f"{type(e).__name__}: {e}")
                        reply = None
                    if reply is None:
                        break  # the conversation cannot continue without its answer
                    messages.append({"role": "assistant", "content": reply})

        cpu0, t0 = time.process_time(), time.perf_counter()
        tally.t0 = t0
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    return tally, wall, cpu / wall if wall > 0 else 0.0


def summarize(tally: Tally, wall: float, client_cpu: float, stream: bool) -> dict:
    lat = [s.latency * 1e3 for s in tally.samples]
    prompt = sum(s.prompt_tokens for s in tally.samples)
    cached = sum(s.cached_tokens for s in tally.samples)
    r = {
        "requests": len(tally.samples),
        "errors": tally.errors,
        "first_error": tally.first_error,
        "seconds": round(wall, 4),
        "requests_per_second": round(len(tally.samples) / wall, 2) if wall > 0 else 0.0,
        "p50_ms": round(pct(lat, 50), 3),
        "p99_ms": round(pct(lat, 99), 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": round(cached / prompt, 4) if prompt else 0.0,
        "client_cpu": round(client_cpu, 3),
    }
    if stream:
        ttft = [s.ttft * 1e3 for s in tally.samples]
        r["ttft_p50_ms"] = round(pct(ttft, 50), 3)
        r["ttft_p99_ms"] = round(pct(ttft, 99), 3)
    return r


# ---------------------------------------------------------------- trace (--trace)


def group_cpu_seconds(pgids: set[int]) -> dict[int, float]:
    """utime + stime of every live process, summed per process group in `pgids`."""
    out = {g: 0.0 for g in pgids}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name may hold spaces; the fields after its ')' are fixed.
        rest = stat.rsplit(")", 1)[-1].split()
        try:
            pgid, utime, stime = int(rest[2]), int(rest[11]), int(rest[12])
        except (IndexError, ValueError):
            continue
        if pgid in out:
            out[pgid] += (utime + stime) / CLK_TCK
    return out


def proc_stat() -> tuple[int, int, int]:
    """(busy ticks, total ticks, runnable tasks) from /proc/stat."""
    busy = total = running = 0
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu "):
                v = [int(x) for x in line.split()[1:]]
                idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
                total = sum(v[:8])
                busy = total - idle
            elif line.startswith("procs_running"):
                running = int(line.split()[1])
    return busy, total, running


class Sampler:
    """Machine-wide CPU busy fraction and runnable tasks every `period` s, on a
    thread so the event loop's stalls do not hide in its own timeline."""

    def __init__(self, period: float = 0.05) -> None:
        import threading

        self.period = period
        self.rows: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        b0, t0, _ = proc_stat()
        while not self._stop.wait(self.period):
            b1, t1, running = proc_stat()
            frac = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
            self.rows.append((time.perf_counter(), round(frac, 3), running))
            b0, t0 = b1, t1

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def write_trace(path: Path, gw: Gateway, engines: list[Engine], tally: Tally, wall: float, extra: dict) -> None:
    port_to_engine = {e.http: i for i, e in enumerate(engines)}

    def engine_of(response_id: str) -> int:
        # The mock's ids are chatcmpl-mock-<port>-<n>.
        parts = response_id.split("-")
        try:
            return port_to_engine.get(int(parts[-2]), -1)
        except (IndexError, ValueError):
            return -1

    reqs = [
        {
            "conv": x.conv, "turn": x.turn, "tenant": x.tenant, "engine": engine_of(x.response_id),
            "id": x.response_id, "t": round(x.start - tally.t0, 6), "unix_s": x.unix_start,
            "latency_ms": round(x.latency * 1e3, 3), "ttft_ms": round(x.ttft * 1e3, 3),
            "prompt_tokens": x.prompt_tokens, "cached_tokens": x.cached_tokens,
        }
        for x in tally.samples
    ]
    doc = {"gateway": gw.name, "wall_s": wall, "requests": reqs} | extra
    path.write_text(json.dumps(doc) + "\n")


# ---------------------------------------------------------------- main


def table(cells: dict, runs: int) -> str:
    out = []
    for (conc, stream), by_gw in cells.items():
        out.append(f"\n### concurrency {conc}, {'streamed' if stream else 'non-streamed'} (median of {runs} runs)\n")
        head = "| gateway | req/s | p50 ms | p99 ms |"
        sep = "|---|---:|---:|---:|"
        if stream:
            head += " TTFT p50 ms | TTFT p99 ms |"
            sep += "---:|---:|"
        head += " cached fraction | errors | client CPU | gateway CPU ms/req |"
        sep += "---:|---:|---:|---:|"
        out += [head, sep]
        for gw, rows in by_gw.items():
            line = (
                f"| {gw} | {median(rows, 'requests_per_second'):.0f} | {median(rows, 'p50_ms'):.1f} "
                f"| {median(rows, 'p99_ms'):.1f} |"
            )
            if stream:
                line += f" {median(rows, 'ttft_p50_ms'):.1f} | {median(rows, 'ttft_p99_ms'):.1f} |"
            line += (
                f" {median(rows, 'cached_fraction'):.3f} | {sum(r['errors'] for r in rows)} "
                f"| {median(rows, 'client_cpu'):.2f} | {median(rows, 'gateway_cpu_ms_per_request'):.3f} |"
            )
            out.append(line)
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvroute", required=True, help="path of the kvroute binary")
    ap.add_argument("--smg", required=True, help="path of the smg console script")
    ap.add_argument("--embed", help="path of the embed_axum binary (the kvroute-embedded arm)")
    ap.add_argument("--arms", default="kvroute,kvroute-embedded,smg",
                    help="comma list of kvroute, kvroute-embedded, smg")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--modes", default="nonstream,stream", help="comma list of nonstream, stream")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8)
    add_engine_args(ap, prefill_us_per_token=20, prefill_step_us=500)
    ap.add_argument("--run-timeout", type=float, default=600.0, help="seconds one measurement may take")
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--kvroute-cost", default="",
                    help="[rules.cost] overrides for kvroute's rule, e.g. affinity_tokens=256")
    ap.add_argument(
        "--kvroute-scorer",
        help="KV-exact scorer for kvroute (cost, longest_prefix, overlap_count, load_aware); "
        "default: none named, i.e. the default policy",
    )
    ap.add_argument("--logs", help="directory for process logs (default: a temp dir)")
    ap.add_argument(
        "--trace", action="store_true",
        help="per-request trace per measurement (client view, engine request logs, CPU samples, "
        "kvroute's admin counters) as trace-<gateway>-<run>-c<conc>-<n|s>.json in the log dir; "
        "read it with scripts/bench_smg_trace.py",
    )
    args = ap.parse_args()
    install_uvloop()

    tmp = log_dir(args.logs)
    concs = [int(c) for c in args.concurrency.split(",") if c]
    modes = [m.strip() == "stream" for m in args.modes.split(",") if m.strip()]
    convs = conversations(args.requests, args.tenants, args.seed)
    log(f"workload: {args.requests} requests in {len(convs)} conversations over {args.tenants} tenants")

    stop_all_on_signals()

    starters = {"kvroute": start_kvroute, "kvroute-embedded": start_embedded, "smg": start_smg}
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in starters:
            ap.error(f"unknown arm {a!r}; expected {', '.join(starters)}")
    if "kvroute-embedded" in arms and not args.embed:
        ap.error("the kvroute-embedded arm needs --embed BIN")
    cells: dict = {(c, s): {a: [] for a in arms} for c in concs for s in modes}
    try:
        engines = start_engines(args, tmp, request_logs=args.trace)
        log(f"engines on :{', :'.join(str(e.http) for e in engines)}")
        for run in range(args.runs):
            for conc in concs:
                for stream in modes:
                    for name, start in ((a, starters[a]) for a in arms):
                        tag = f"r{run}-c{conc}-{'s' if stream else 'n'}"
                        reset_engines(engines)
                        gw = start(args, engines, tmp, tag)
                        before = engine_requests(engines)
                        offsets = engine_log_offsets(engines) if args.trace else []
                        groups = {gw.proc.pid} | {e.proc.pid for e in engines if e.proc}
                        # The gateway's own CPU per request is measured in every run:
                        # unlike req/s and latency it does not move with the other
                        # work on a shared machine.
                        cpu_before = group_cpu_seconds(groups if args.trace else {gw.proc.pid})
                        extra: dict = {}
                        try:
                            with Sampler() if args.trace else contextlib.nullcontext() as sampler:
                                tally, wall, cpu = asyncio.run(
                                    drive(gw.url, convs, conc, stream, args.max_tokens, args.run_timeout)
                                )
                            if sampler is not None:
                                cpu_after = group_cpu_seconds(groups)
                                used = {g: round(cpu_after[g] - cpu_before.get(g, 0.0), 3) for g in groups}
                                extra["cpu_seconds"] = {
                                    "gateway": used.get(gw.proc.pid, 0.0),
                                    "engines": [used.get(e.proc.pid, 0.0) for e in engines if e.proc],
                                    "client": round(cpu * wall, 3),
                                }
                                extra["cpu_samples"] = [
                                    (round(t - tally.t0, 4), frac, run_q) for t, frac, run_q in sampler.rows
                                ]
                                if gw.admin:
                                    for what in ("endpoints", "counters"):
                                        status, body = http("GET", f"{gw.admin}/admin/{what}")
                                        if status == 200:
                                            extra[f"admin_{what}"] = json.loads(body)
                            gw_cpu = group_cpu_seconds({gw.proc.pid}).get(gw.proc.pid, 0.0) - cpu_before.get(
                                gw.proc.pid, 0.0
                            )
                        finally:
                            stop(gw.proc)
                        r = summarize(tally, wall, cpu, stream)
                        done = len(tally.samples)
                        r["gateway_cpu_ms_per_request"] = round(gw_cpu * 1e3 / done, 3) if done else 0.0
                        r["run"] = run
                        # How each gateway spread the load: a p99 or req/s gap often shows here.
                        r["per_engine"] = [a - b for a, b in zip(engine_requests(engines), before)]
                        # Other work on the machine shows here (the 1-minute load average).
                        r["loadavg_1m"] = round(os.getloadavg()[0], 2)
                        cells[(conc, stream)][name].append(r)
                        if args.trace:
                            extra["engine_requests"] = list(engine_log_entries(engines, offsets))
                            extra["cell"] = {"run": run, "concurrency": conc, "stream": stream}
                            write_trace(tmp / f"trace-{name}-{tag}.json", gw, engines, tally, wall, extra)
                        log(
                            f"run {run} c={conc} {'stream' if stream else 'plain'} {name}: "
                            f"{r['requests_per_second']} req/s p50 {r['p50_ms']} p99 {r['p99_ms']} "
                            f"cached {r['cached_fraction']} errors {r['errors']} client_cpu {r['client_cpu']} "
                            f"gateway_cpu_ms/req {r['gateway_cpu_ms_per_request']} "
                            f"load {r['loadavg_1m']} per_engine {'/'.join(map(str, r['per_engine']))}"
                            + (f" first_error {r['first_error']}" if r["first_error"] else "")
                        )
    finally:
        stop_all()

    print(table(cells, args.runs))
    if args.json:
        doc = {
            "config": {
                k: getattr(args, k)
                for k in (
                    "requests", "runs", "tenants", "seed", "max_tokens", "capacity_blocks",
                    "max_running", "prefill_us_per_token", "prefill_step_us", "decode_us_per_token",
                )
            }
            | {"engines": ENGINES, "conversations": len(convs), "client": CLIENT, "smg_policy": "cache_aware",
               "embedded_policy": "KvRouter builder defaults (embed_axum)",
               "kvroute_policy": (f"kv_exact scorer {args.kvroute_scorer}" if args.kvroute_scorer
               else "kv_exact default scorer") + (f" cost {args.kvroute_cost}" if args.kvroute_cost else "")},
            "cells": [
                {
                    "concurrency": c,
                    "stream": s,
                    "gateways": {
                        gw: {
                            "median": {
                                k: median(rows, k)
                                for k in ("requests_per_second", "p50_ms", "p99_ms", "ttft_p50_ms",
                                          "ttft_p99_ms", "cached_fraction", "client_cpu",
                                          "gateway_cpu_ms_per_request")
                                if rows and k in rows[0]
                            },
                            "runs": rows,
                        }
                        for gw, rows in by_gw.items()
                    },
                }
                for (c, s), by_gw in cells.items()
            ],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        log(f"JSON written to {args.json}")
    bad = sum(r["errors"] for by_gw in cells.values() for rows in by_gw.values() for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
