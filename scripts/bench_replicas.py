#!/usr/bin/env python3
"""4 `kvroute serve` replicas sharing load over one nats-server, against 1 replica.

Both arms sit in front of the same 4 `kvroute mock-engine` processes on
127.0.0.1 and receive the identical, seeded request schedule:

* **Bursts.** Every `--burst-ms` a burst of `--burst-min`..`--burst-max`
  streamed chat requests (size drawn per burst) is sent at the same instant,
  open loop: a burst goes out on schedule whatever is still in flight.
* **Shared root.** Every request starts with the same long system prompt
  (`--root-words`).
* **Multi-turn.** A conversation opens with its own document
  (`--doc-words`), then each turn re-sends the whole history (the assistant
  replies are the mock's own text for `--max-tokens` tokens, fetched once, so
  the content never depends on timing); a conversation's next turn goes in a
  later burst (`--gap-min`..`--gap-max` bursts later).
* **Front end.** Each request goes to a uniformly random replica (seeded),
  as a load balancer would spread it; the 1-replica arm gets every request.

Per measurement the engines' caches are emptied (`/admin/restart-publisher`),
and the arm's gateways (and, for the replicas, a fresh nats-server) are
started and stopped; arms are interleaved within each run, alternating which
goes first; figures are medians over runs.

Reported per arm: cached fraction (the engines' own `cached_tokens` over
prompt tokens), streamed TTFT p50/p99, requests per engine (max and min over
the mean), errors; for the replicas, the sync traffic per decision: messages
the gateways published (`/admin/counters` → `nats.published`) and the
nats-server's own count of messages and payload bytes in and out (`/varz`).
Verdicts: cached fraction ≥ 0.95× one replica's, TTFT p50 and p99 ≤ 1.10× one
replica's, every engine within 1.3× of the mean.

To tell placement from overhead, the engines' request logs give each request's
own TTFT at the engine (queueing and prefill: what placement decides); the
rest of the client's TTFT is the gateways', the client's and the machine's.
The rest splits at the engine's submission
(its logged `unix_s` against the client's send time, one clock): the way in
(client, gateway, the engine's own tokenizing) and the way back. The
gateways' `kvroute_decision_latency_seconds` (request body read to endpoint chosen:
parsing, tokenizing, a burst turn's hold, the pick) gives its mean over the
arm (the way in's mean beside it). The gateways' CPU per request is
measured too, their threads' runs on a CPU per request (the scheduler's
count: wake-ups and returns from preemption; threads that end during the arm
are missing, a lower bound), and each gateway's CPU per
second without traffic (`IDLE_SECONDS` before the arm's requests start). The `apart` arm (`--arms`)
runs as many gateways as replicas without NATS, each on its own view: what
running that many gateway processes on this machine costs by itself, apart
from what the load sharing costs. Each measurement leaves
`trace-r<run>-<arm>.json` in the log directory: per request its burst,
conversation, turn, replica, the gateway's decision headers (endpoint, tier,
predicted cached tokens), the engine's cached tokens and TTFT; and every
gateway's `/admin/endpoints` before and after and `/admin/counters` after.

Run through scripts/bench_replicas.sh (venv, build, cleanup trap).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

# benchlib sits beside this file (put first on sys.path also under -P / PYTHONSAFEPATH).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    CLIENT, CLK_TCK, ENGINES, HOST, MODEL, Engine, SplitMix, Tally, add_engine_args, configure,
    engine_log_entries, engine_log_offsets, engine_requests, free_ports, get_json, http, install_uvloop,
    kvroute_toml, log, log_dir, median, pct, proxy_answers, reset_engines, spawn, sse_json, start_engines,
    stop, stop_all, stop_all_on_signals, subscribers_connected, wait_until,
)

configure("bench_replicas", "BENCH_REPLICAS_PIDFILE")

# Seconds each arm's gateways are measured without traffic before it starts.
IDLE_SECONDS = 3.0


# ---------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[-1].split()
        return (int(rest[11]) + int(rest[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_ns(pid: int) -> int:
    """Time on CPU of every thread of one process, in ns (the scheduler's
    own count: finer than utime + stime's clock ticks); 0 once it is gone."""
    total = 0
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return total


def run_slices(pid: int) -> dict[str, int]:
    """Per thread of one process, the times it was put on a CPU (the
    scheduler's count: every wake-up and every preemption's return); a
    thread that ends between the listing and the read is left out."""
    out: dict[str, int] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[t] = int(f.read().split()[2])
        except (OSError, IndexError, ValueError):
            pass
    return out


def slices_between(before: dict[str, int], after: dict[str, int]) -> int:
    """Runs between two `run_slices` readings: a thread's growth, counted
    from 0 for one started meanwhile. A thread that ended meanwhile (a
    blocking-pool thread idle for 10 s) is missing its runs: a lower bound."""
    return sum(max(0, n - before.get(t, 0)) for t, n in after.items())


def assistant_reply(engines: list[Engine], max_tokens: int) -> str:
    """The mock's reply text for `max_tokens` tokens (the same for every prompt)."""
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    ).encode()
    status, raw = http("POST", f"{engines[0].url}/v1/chat/completions", body, timeout=30)
    if status != 200:
        raise RuntimeError(f"engine reply probe answered {status}: {raw[:200]!r}")
    return json.loads(raw)["choices"][0]["message"]["content"]


class Nats:
    def __init__(self, args, tmp: Path, tag: str) -> None:
        self.port, self.monitor = free_ports(2)
        conf = tmp / f"nats-{tag}.conf"
        # Monitoring on loopback only (`-m` alone would listen on every interface).
        conf.write_text(f'host: "{HOST}"\nport: {self.port}\nhttp: "{HOST}:{self.monitor}"\n')
        self.logfile = tmp / f"nats-{tag}.log"
        self.proc = spawn([args.nats_server, "-c", str(conf)], self.logfile)
        wait_until("nats-server", lambda: self.varz() is not None, [self.proc], 20, self.logfile)

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    def varz(self) -> dict | None:
        return get_json(f"http://{HOST}:{self.monitor}/varz")


def decision_latency(admin: str) -> dict[float, float]:
    """The gateway's `kvroute_decision_latency_seconds` (request body read to
    endpoint chosen: parsing, tokenizing, its turn in a burst, the pick) as
    cumulative bucket counts by upper bound, plus `sum` under key -1."""
    status, raw = http("GET", f"{admin}/metrics")
    out: dict[float, float] = {}
    if status != 200:
        raise RuntimeError(f"{admin}/metrics answered {status}")
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("kvroute_decision_latency_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = out.get(float("inf") if le == "+Inf" else float(le), 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvroute_decision_latency_seconds_sum"):
            out[-1.0] = out.get(-1.0, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def latency_summary(before: list[dict], after: list[dict]) -> tuple[float, float]:
    """Mean and p50 (the bucket bound it falls under) of the decision latency
    over every gateway between `before` and `after`, in ms."""
    total: dict[float, float] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            total[k] = total.get(k, 0.0) + v - b.get(k, 0.0)
    count = total.get(float("inf"), 0.0)
    if not count:
        return 0.0, 0.0
    p50 = next((le for le in sorted(k for k in total if k >= 0) if total[le] >= count / 2), float("inf"))
    return round(total.get(-1.0, 0.0) / count * 1e3, 3), round(p50 * 1e3, 3)


@dataclass
class Gateway:
    url: str
    admin: str
    proc: subprocess.Popen
    logfile: Path

    def counters(self) -> dict | None:
        return get_json(f"{self.admin}/admin/counters")


def start_gateways(args, engines, tmp: Path, tag: str, n: int, nats: Nats | None) -> list[Gateway]:
    gws = []
    env = dict(os.environ)
    if args.gateway_log:
        env["RUST_LOG"] = args.gateway_log
    for i in range(n):
        listen, admin = free_ports(2)
        cfg = tmp / f"kvroute-{tag}-{i}.toml"
        cfg.write_text(kvroute_toml(engines, listen, admin, args.model_dir, nats_url=nats.url if nats else None,
                                    replicas_config=args.replicas_config, cost=args.cost))
        logfile = tmp / f"kvroute-{tag}-{i}.log"
        p = spawn([args.kvroute, "serve", "--config", str(cfg)], logfile, env)
        gws.append(Gateway(f"http://{HOST}:{listen}", f"http://{HOST}:{admin}", p, logfile))
    procs = [g.proc for g in gws]
    for g in gws:
        wait_until("kvroute subscribers", lambda g=g: subscribers_connected(g.admin), procs, 90, g.logfile)
        wait_until("kvroute proxy", lambda g=g: proxy_answers(g.url), procs, 60, g.logfile)
    if n > 1 and nats:
        # Every replica counts the n-1 others (they show up with their first
        # message, at the latest their first heartbeat).
        def all_seen() -> bool:
            for g in gws:
                c = g.counters() or {}
                rep = ((c.get("rules") or {}).get(MODEL) or {}).get("replicas") or {}
                if rep.get("replicas") != n - 1 or not (c.get("nats") or {}).get("connected"):
                    return False
            return True

        wait_until("replicas see each other", all_seen, procs, 30, gws[0].logfile)
    return gws


# ---------------------------------------------------------------- workload


@dataclass
class Turn:
    conv: int
    turn: int
    replica: int  # which of the replicas the front end hands it to


@dataclass
class Schedule:
    root: str
    docs: list[str]  # per conversation: its opening document
    users: list[list[str]]  # per conversation: its user turns
    bursts: list[list[Turn]]


def schedule(args) -> Schedule:
    """The seeded request schedule: bursts of turns, each turn with its replica."""
    rng = SplitMix(args.seed)
    front = SplitMix(args.seed ^ 0x5EED)
    root = "You are the support assistant of one company. Rules: " + rng.words(args.root_words)
    docs: list[str] = []
    users: list[list[str]] = []
    # (ready burst, conversation, next turn) of conversations with turns left
    pending: list[tuple[int, int, int]] = []
    bursts: list[list[Turn]] = []
    committed = 0
    b = 0
    while (committed < args.requests or pending) and b < 10 * args.requests + 100:
        size = rng.between(args.burst_min, args.burst_max)
        burst: list[Turn] = []
        pending.sort()
        while pending and len(burst) < size and pending[0][0] <= b:
            _, c, k = pending.pop(0)
            burst.append(Turn(c, k, front.below(args.replicas)))
            if k + 1 < len(users[c]):
                pending.append((b + rng.between(args.gap_min, args.gap_max), c, k + 1))
        while len(burst) < size and committed < args.requests:
            c = len(users)
            turns = min(rng.between(args.turns_min, args.turns_max), args.requests - committed)
            committed += turns
            docs.append(f"Case {c} file: " + rng.words(rng.between(args.doc_words // 2, args.doc_words * 3 // 2)))
            users.append([f"Case {c} question {k}: {rng.words(rng.between(20, 60))}?" for k in range(turns)])
            burst.append(Turn(c, 0, front.below(args.replicas)))
            if turns > 1:
                pending.append((b + rng.between(args.gap_min, args.gap_max), c, 1))
        bursts.append(burst)
        b += 1
    return Schedule(root, docs, users, bursts)


def messages_for(s: Schedule, conv: int, turn: int, reply: str) -> list[dict]:
    msgs = [{"role": "system", "content": s.root}]
    for k in range(turn + 1):
        user = s.users[conv][k]
        if k == 0:
            user = s.docs[conv] + "\n\n" + user
        msgs.append({"role": "user", "content": user})
        if k < turn:
            msgs.append({"role": "assistant", "content": reply})
    return msgs


@dataclass
class Sample:
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    late: float  # send time behind the schedule, s
    rid: str = ""  # the engine's response id
    who: tuple = ()  # (burst, conversation, turn, replica)
    decision: tuple = ()  # the gateway's x-kvroute-* headers: (endpoint, tier, predicted cached tokens)
    sent_unix: float = 0.0  # wall clock when sending began (the engines log theirs: `unix_s`)


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, due: float, tally: Tally,
                      who: tuple) -> None:
    t0, sent_unix = time.perf_counter(), time.time()
    late = t0 - due
    ttft = None
    usage: dict = {}
    rid = ""
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as resp:
            if resp.status != 200:
                tally.fail(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                return
            h = resp.headers
            decision = (
                h.get("x-kvroute-endpoint", ""), h.get("x-kvroute-tier", ""),
                int(h.get("x-kvroute-predicted-cached-tokens") or 0),
            )
            async for v in sse_json(resp):
                if not rid:
                    rid = str(v.get("id") or "")
                if v.get("usage"):
                    usage = v["usage"]
                if ttft is None:
                    for ch in v.get("choices") or ():
                        if (ch.get("delta") or {}).get("content"):
                            ttft = time.perf_counter() - t0
                            break
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        tally.fail(f"{type(e).__name__}: {e}")
        return
    latency = time.perf_counter() - t0
    prompt = int(usage.get("prompt_tokens") or 0)
    if prompt <= 0 or ttft is None:
        tally.fail("no usage.prompt_tokens or no content in the stream")
        return
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    tally.samples.append(Sample(ttft, latency, prompt, cached, late, rid, who, decision, sent_unix))


async def drive(urls: list[str], s: Schedule, reply: str, args) -> tuple[Tally, float, float]:
    """Sends the schedule's bursts open loop to `urls` (turn.replica mod len(urls))."""
    tally = Tally()
    bodies = [
        [
            json.dumps({
                "model": MODEL, "messages": messages_for(s, t.conv, t.turn, reply),
                "max_tokens": args.max_tokens, "stream": True,
                "stream_options": {"include_usage": True},
            }).encode()
            for t in burst
        ]
        for burst in s.bursts
    ]
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    to = aiohttp.ClientTimeout(total=args.request_timeout)
    tasks: list[asyncio.Task] = []
    async with aiohttp.ClientSession(connector=conn, timeout=to) as session:
        cpu0, t0 = time.process_time(), time.perf_counter()
        for b, burst in enumerate(s.bursts):
            due = t0 + b * args.burst_ms / 1e3
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for t, body in zip(burst, bodies[b]):
                url = f"{urls[t.replica % len(urls)]}/v1/chat/completions"
                who = (b, t.conv, t.turn, t.replica % len(urls))
                tasks.append(asyncio.create_task(one_request(session, url, body, due, tally, who)))
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), args.request_timeout + 10)
        except asyncio.TimeoutError:
            tally.fail("the last requests did not finish in time")
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    return tally, wall, cpu / wall if wall > 0 else 0.0


def summarize(tally: Tally, wall: float, client_cpu: float, engine_rows: dict[str, dict]) -> dict:
    ttft = [x.ttft * 1e3 for x in tally.samples]
    lat = [x.latency * 1e3 for x in tally.samples]
    late = [x.late * 1e3 for x in tally.samples]
    prompt = sum(x.prompt_tokens for x in tally.samples)
    cached = sum(x.cached_tokens for x in tally.samples)
    # The engine's own TTFT (submission to first token: queueing and prefill,
    # what placement decides) and the rest of the client's (gateway, client,
    # loopback, scheduling on a shared machine).
    # The rest splits at the engine's submission (`unix_s`, the same clock as
    # the client's `sent_unix`): the way in (client, gateway, the engine's own
    # tokenizing) and the way back (the first token through the gateway).
    eng, rest, way_in = [], [], []
    for x in tally.samples:
        row = engine_rows.get(x.rid)
        if row is not None and row.get("first_token_us") is not None:
            e_ms = row["first_token_us"] / 1e3
            eng.append(e_ms)
            rest.append(x.ttft * 1e3 - e_ms)
            if row.get("unix_s") is not None and x.sent_unix:
                way_in.append((row["unix_s"] - x.sent_unix) * 1e3)
    return {
        "engine_ttft_p50_ms": round(pct(eng, 50), 3),
        "engine_ttft_p99_ms": round(pct(eng, 99), 3),
        "engine_ttft_mean_ms": round(statistics.fmean(eng), 3) if eng else 0.0,
        "outside_engine_p50_ms": round(pct(rest, 50), 3),
        "outside_engine_p99_ms": round(pct(rest, 99), 3),
        "way_in_p50_ms": round(pct(way_in, 50), 3),
        "way_in_mean_ms": round(statistics.fmean(way_in), 3) if way_in else None,
        "way_in_p99_ms": round(pct(way_in, 99), 3),
        "engine_matched": len(eng),
        "requests": len(tally.samples),
        "errors": tally.errors,
        "first_error": tally.first_error,
        "seconds": round(wall, 3),
        "ttft_p50_ms": round(pct(ttft, 50), 3),
        "ttft_p99_ms": round(pct(ttft, 99), 3),
        "ttft_mean_ms": round(statistics.fmean(ttft), 3) if ttft else 0.0,
        "latency_p50_ms": round(pct(lat, 50), 3),
        "latency_p99_ms": round(pct(lat, 99), 3),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": round(cached / prompt, 4) if prompt else 0.0,
        "client_cpu": round(client_cpu, 3),
        "send_late_p99_ms": round(pct(late, 99), 3),
    }


# ---------------------------------------------------------------- counters


def rule_counters(c: dict | None) -> dict:
    return ((c or {}).get("rules") or {}).get(MODEL) or {}


def counter_delta(before: dict | None, after: dict | None) -> dict:
    """The numeric fields of one gateway's counters that matter here, after - before."""
    rb, ra = rule_counters(before), rule_counters(after)
    out = {
        "decisions": ra.get("decisions", 0) - rb.get("decisions", 0),
        "tiers": {k: v - (rb.get("tiers") or {}).get(k, 0) for k, v in (ra.get("tiers") or {}).items()},
        "misses": {
            k: v - (rb.get("misses") or {}).get(k, 0)
            for k, v in (ra.get("misses") or {}).items()
            if v - (rb.get("misses") or {}).get(k, 0)
        },
        "load_diversions": ra.get("load_diversions", 0) - rb.get("load_diversions", 0),
        "retries": ra.get("retries", 0) - rb.get("retries", 0),
        "hits": [a - b for a, b in zip(ra.get("hits") or [], rb.get("hits") or [0] * ENGINES)],
    }
    rep_a, rep_b = ra.get("replicas"), rb.get("replicas") or {}
    if rep_a:
        out["replicas"] = {
            k: (v - rep_b.get(k, 0) if k != "replicas" else v) for k, v in rep_a.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    na, nb = (after or {}).get("nats"), (before or {}).get("nats") or {}
    if na:
        out["nats"] = {
            k: (v - nb.get(k, 0) if not isinstance(v, bool) else v) for k, v in na.items()
            if isinstance(v, (int, float))
        }
    return out


VARZ_KEYS = ("in_msgs", "out_msgs", "in_bytes", "out_bytes")


# ---------------------------------------------------------------- main


def measure(args, engines, s: Schedule, reply: str, tmp: Path, arm: str, run: int) -> dict:
    n = 1 if arm == "one" else args.replicas
    tag = f"r{run}-{arm}"
    reset_engines(engines)
    # `apart`: as many gateways as `replicas`, sharing nothing (no NATS).
    nats = Nats(args, tmp, tag) if arm == "replicas" else None
    gws: list[Gateway] = []
    try:
        gws = start_gateways(args, engines, tmp, tag, n, nats)
        if args.cold_engine:
            # Every engine but the first holds the shared root prefix (sent to
            # them directly), as after engine 0 restarts.
            body = json.dumps({
                "model": MODEL, "max_tokens": 1,
                "messages": [{"role": "system", "content": s.root}, {"role": "user", "content": "warm"}],
            }).encode()
            for e in engines[1:]:
                status, raw = http("POST", f"{e.url}/v1/chat/completions", body, timeout=30)
                if status != 200:
                    raise RuntimeError(f"engine :{e.http} root warm-up answered {status}: {raw[:200]!r}")
        # Let the engines' load polls and the replicas' heartbeats settle,
        # then measure what the gateways cost without traffic.
        time.sleep(1.0)
        idle_before, idle_t0 = sum(cpu_ns(g.proc.pid) for g in gws), time.perf_counter()
        time.sleep(IDLE_SECONDS)
        idle_ns = sum(cpu_ns(g.proc.pid) for g in gws) - idle_before
        idle_ms_per_s = idle_ns / 1e6 / (time.perf_counter() - idle_t0) / len(gws)
        load_before = round(os.getloadavg()[0], 2)
        req_before = engine_requests(engines)
        offsets = engine_log_offsets(engines)
        cpu_before = sum(cpu_seconds(g.proc.pid) for g in gws)
        slices_before = [run_slices(g.proc.pid) for g in gws]
        c_before = [g.counters() for g in gws]
        lat_before = [decision_latency(g.admin) for g in gws]
        ep_before = [get_json(f"{g.admin}/admin/endpoints") for g in gws]
        v_before = nats.varz() if nats else None
        tally, wall, cpu = asyncio.run(drive([g.url for g in gws], s, reply, args))
        c_after = [g.counters() for g in gws]
        lat_after = [decision_latency(g.admin) for g in gws]
        ep_after = [get_json(f"{g.admin}/admin/endpoints") for g in gws]
        v_after = nats.varz() if nats else None
        req_after = engine_requests(engines)
        gateway_cpu = sum(cpu_seconds(g.proc.pid) for g in gws) - cpu_before
        gateway_slices = sum(slices_between(b, run_slices(g.proc.pid)) for g, b in zip(gws, slices_before))
        engine_rows = {str(r.get("id")): r for r in engine_log_entries(engines, offsets)}
    finally:
        for g in gws:
            stop(g.proc)
        if nats:
            stop(nats.proc)
    r = summarize(tally, wall, cpu, engine_rows)
    write_trace(tmp / f"trace-{tag}.json", engines, tally, engine_rows, ep_before, ep_after, c_after)
    r["gateway_cpu_ms_per_request"] = round(gateway_cpu * 1e3 / r["requests"], 3) if r["requests"] else 0.0
    r["idle_cpu_ms_per_s"] = round(idle_ms_per_s, 2)
    r["gateway_runs_per_request"] = round(gateway_slices / r["requests"], 1) if r["requests"] else 0.0
    r["decision_latency_mean_ms"], r["decision_latency_p50_bucket_ms"] = latency_summary(lat_before, lat_after)
    r["run"] = run
    r["arm"] = arm
    r["gateways"] = n
    per_engine = [a - b for a, b in zip(req_after, req_before)]
    r["per_engine"] = per_engine
    mean = statistics.fmean(per_engine) if per_engine else 0.0
    r["engine_max_over_mean"] = round(max(per_engine) / mean, 3) if mean else 0.0
    r["engine_min_over_mean"] = round(min(per_engine) / mean, 3) if mean else 0.0
    r["loadavg_1m_before"] = load_before
    r["loadavg_1m"] = round(os.getloadavg()[0], 2)
    r["counters"] = [counter_delta(b, a) for b, a in zip(c_before, c_after)]
    decisions = sum(c["decisions"] for c in r["counters"])
    r["decisions"] = decisions
    if nats and v_before and v_after:
        r["nats_varz"] = {k: v_after.get(k, 0) - v_before.get(k, 0) for k in VARZ_KEYS}
        published = sum((c.get("nats") or {}).get("published", 0) for c in r["counters"])
        deltas = sum((c.get("replicas") or {}).get("sent_deltas", 0) for c in r["counters"])
        r["traffic"] = {
            "published_msgs": published,
            "published_msgs_per_decision": round(published / decisions, 3) if decisions else 0.0,
            "endpoint_entries_per_decision": round(deltas / decisions, 3) if decisions else 0.0,
            "server_in_msgs_per_decision": round(r["nats_varz"]["in_msgs"] / decisions, 3) if decisions else 0.0,
            "server_in_bytes_per_decision": round(r["nats_varz"]["in_bytes"] / decisions, 1) if decisions else 0.0,
            "server_out_bytes_per_decision": round(r["nats_varz"]["out_bytes"] / decisions, 1) if decisions else 0.0,
            "server_in_bytes_per_msg": round(r["nats_varz"]["in_bytes"] / r["nats_varz"]["in_msgs"], 1)
            if r["nats_varz"]["in_msgs"] else 0.0,
            "server_in_bytes_per_second": round(r["nats_varz"]["in_bytes"] / wall, 1) if wall else 0.0,
        }
    return r


def write_trace(path: Path, engines: list[Engine], tally: Tally, engine_rows: dict[str, dict],
                ep_before: list, ep_after: list, counters: list) -> None:
    """Per request: who sent it where, what the gateway decided and expected,
    what the engine cached and how long it took there; plus each gateway's
    /admin/endpoints before and after and its /admin/counters after."""
    by_url = {e.url: i for i, e in enumerate(engines)}
    reqs = []
    for x in tally.samples:
        row = engine_rows.get(x.rid) or {}
        b, conv, turn, replica = x.who
        endpoint, tier, predicted = x.decision or ("", "", 0)
        reqs.append({
            "burst": b, "conv": conv, "turn": turn, "replica": replica,
            "engine": row.get("engine", by_url.get(endpoint, -1)), "tier": tier,
            "predicted_cached": predicted, "prompt_tokens": x.prompt_tokens, "cached_tokens": x.cached_tokens,
            "ttft_ms": round(x.ttft * 1e3, 3), "engine_ttft_ms": (row.get("first_token_us") or 0) / 1e3,
            "running_at_submit": row.get("running_at_submit"), "waiting_at_submit": row.get("waiting_at_submit"),
            "late_ms": round(x.late * 1e3, 3),
            "way_in_ms": round((row["unix_s"] - x.sent_unix) * 1e3, 3) if row.get("unix_s") and x.sent_unix else None,
        })
    reqs.sort(key=lambda q: (q["burst"], q["replica"]))
    doc = {"requests": reqs, "endpoints_before": ep_before, "endpoints_after": ep_after, "counters_after": counters}
    path.write_text(json.dumps(doc) + "\n")


def verdicts(one: list[dict], many: list[dict]) -> list[tuple[str, str, bool]]:
    c1, c4 = median(one, "cached_fraction"), median(many, "cached_fraction")
    p50_1, p50_4 = median(one, "ttft_p50_ms"), median(many, "ttft_p50_ms")
    p99_1, p99_4 = median(one, "ttft_p99_ms"), median(many, "ttft_p99_ms")
    spread = median(many, "engine_max_over_mean")
    low = median(many, "engine_min_over_mean")
    errors = sum(r["errors"] for r in one + many)
    return [
        ("cached fraction ≥ 0.95× one replica's",
         f"{c4:.4f} / {c1:.4f} = {c4 / c1 if c1 else 0:.3f}×", c1 > 0 and c4 >= 0.95 * c1),
        ("TTFT p50 ≤ 1.10× one replica's",
         f"{p50_4:.1f} / {p50_1:.1f} ms = {p50_4 / p50_1 if p50_1 else 0:.3f}×", p50_1 > 0 and p50_4 <= 1.10 * p50_1),
        ("TTFT p99 ≤ 1.10× one replica's",
         f"{p99_4:.1f} / {p99_1:.1f} ms = {p99_4 / p99_1 if p99_1 else 0:.3f}×", p99_1 > 0 and p99_4 <= 1.10 * p99_1),
        ("requests per engine within 1.3× of the mean",
         f"busiest {spread:.3f}×, least {low:.3f}× the mean", 0 < spread <= 1.3 and low >= 1 / 1.3),
        ("no errors", f"{errors}", errors == 0),
    ]


def report(args, rows: dict[str, list[dict]]) -> str:
    one, many = rows["one"], rows["replicas"]
    out = [f"\n### {args.replicas} replicas over NATS against 1 (median of {args.runs} runs)\n"]
    out.append("| arm | cached fraction | TTFT p50 ms | TTFT p99 ms | engine's TTFT p50 · p99 ms "
               "| rest of TTFT p50 ms | of it the way in, p50 · mean ms | decision mean ms "
               "| requests per engine (max/mean) | errors | gateway CPU ms/request | thread runs/request "
               "| idle CPU ms/s per gateway | load avg |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for name, arm in ((f"1 replica", one), (f"{args.replicas} replicas", many),
                      (f"{args.replicas} gateways apart", rows["apart"])):
        if not arm:
            continue
        # The per-engine counts of the run whose max/mean is the median one.
        mid = sorted(arm, key=lambda r: r["engine_max_over_mean"])[len(arm) // 2]
        loads = [r["loadavg_1m"] for r in arm]
        out.append(
            f"| {name} | {median(arm, 'cached_fraction'):.4f} | {median(arm, 'ttft_p50_ms'):.1f} "
            f"| {median(arm, 'ttft_p99_ms'):.1f} "
            f"| {median(arm, 'engine_ttft_p50_ms'):.1f} · {median(arm, 'engine_ttft_p99_ms'):.1f} "
            f"| {median(arm, 'outside_engine_p50_ms'):.1f} "
            f"| {median(arm, 'way_in_p50_ms'):.1f} · {median(arm, 'way_in_mean_ms'):.1f} "
            f"| {median(arm, 'decision_latency_mean_ms'):.2f} "
            f"| {'/'.join(map(str, mid['per_engine']))} ({median(arm, 'engine_max_over_mean'):.2f}) "
            f"| {sum(r['errors'] for r in arm)} | {median(arm, 'gateway_cpu_ms_per_request'):.2f} "
            f"| {median(arm, 'gateway_runs_per_request'):.0f} "
            f"| {median(arm, 'idle_cpu_ms_per_s'):.1f} "
            f"| {min(loads):.1f}–{max(loads):.1f} |"
        )
    if one and many:
        out.append(f"\n| target | {args.replicas} replicas / 1 | met |\n|---|---|---|")
        for what, figure, ok in verdicts(one, many):
            out.append(f"| {what} | {figure} | {'✓' if ok else '✗'} |")
        tr = [r["traffic"] for r in many if "traffic" in r]
        if tr:
            m = {k: statistics.median(t[k] for t in tr) for k in tr[0]}
            out.append(
                "\nSync traffic per decision (median): "
                f"{m['published_msgs_per_decision']:.2f} messages published by the gateways "
                f"({m['endpoint_entries_per_decision']:.2f} endpoint entries); nats-server: "
                f"{m['server_in_msgs_per_decision']:.2f} messages and {m['server_in_bytes_per_decision']:.0f} "
                f"payload bytes in, {m['server_out_bytes_per_decision']:.0f} out per decision "
                f"({m['server_in_bytes_per_msg']:.0f} B per message, {m['server_in_bytes_per_second'] / 1e3:.1f} kB/s in)."
            )
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvroute", required=True, help="path of the kvroute binary")
    ap.add_argument("--nats-server", required=True, help="path of the nats-server binary")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--replicas", type=int, default=4, help="gateways of the replicas arm")
    ap.add_argument("--arms", default="replicas,one",
                    help="comma list of replicas, one, apart (as many gateways as replicas, sharing nothing)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--burst-ms", type=float, default=200.0, help="one burst every this many ms")
    ap.add_argument("--burst-min", type=int, default=8)
    ap.add_argument("--burst-max", type=int, default=12)
    ap.add_argument("--gap-min", type=int, default=1, help="bursts between a conversation's turns, at least")
    ap.add_argument("--gap-max", type=int, default=4)
    ap.add_argument("--turns-min", type=int, default=2)
    ap.add_argument("--turns-max", type=int, default=8)
    ap.add_argument("--root-words", type=int, default=1500, help="the shared system prompt's words")
    ap.add_argument("--doc-words", type=int, default=400, help="a conversation's opening document, mean words")
    ap.add_argument("--max-tokens", type=int, default=16)
    add_engine_args(ap, prefill_us_per_token=50, prefill_step_us=1000)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--cold-engine", action="store_true",
                    help="before each measurement put the shared root prefix on every engine but the first "
                    "(engine 0 as just restarted)")
    ap.add_argument("--replicas-config", default="",
                    help="extra [replicas] keys for the replicas arm, e.g. sync_interval_ms=1")
    ap.add_argument("--cost", default="", help="[rules.cost] overrides for every gateway, e.g. affinity_tokens=256")
    ap.add_argument("--gateway-log", default="", help="RUST_LOG for the gateways")
    ap.add_argument("--json", help="write all figures here")
    ap.add_argument("--logs", help="directory for process logs (default: a temp dir)")
    args = ap.parse_args()
    if args.burst_min < 1 or args.burst_max < args.burst_min or args.gap_min < 1 or args.gap_max < args.gap_min:
        ap.error("need 1 ≤ burst-min ≤ burst-max and 1 ≤ gap-min ≤ gap-max")
    if args.turns_min < 1 or args.turns_max < args.turns_min or args.replicas < 2:
        ap.error("need 1 ≤ turns-min ≤ turns-max and --replicas ≥ 2")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ("replicas", "one", "apart") for a in arms):
        ap.error("--arms takes replicas, one and/or apart")
    install_uvloop()

    tmp = log_dir(args.logs)
    s = schedule(args)
    sizes = [len(b) for b in s.bursts]
    log(
        f"workload: {sum(sizes)} requests in {len(s.bursts)} bursts (sizes {min(x for x in sizes if x)}–{max(sizes)}, "
        f"every {args.burst_ms:.0f} ms, ≈{len(s.bursts) * args.burst_ms / 1e3:.0f} s), "
        f"{len(s.users)} conversations"
    )

    stop_all_on_signals()

    rows: dict[str, list[dict]] = {"replicas": [], "one": [], "apart": []}
    try:
        engines = start_engines(args, tmp, request_logs=True)
        log(f"engines on :{', :'.join(str(e.http) for e in engines)}")
        reply = assistant_reply(engines, args.max_tokens)
        for run in range(args.runs):
            # Alternate which arm goes first, so a drift in the machine's load
            # does not favour one arm.
            order = arms if run % 2 == 0 else arms[::-1]
            for arm in order:
                r = measure(args, engines, s, reply, tmp, arm, run)
                rows[arm].append(r)
                tiers = {}
                for c in r["counters"]:
                    for k, v in c["tiers"].items():
                        tiers[k] = tiers.get(k, 0) + v
                log(
                    f"run {run} {arm}: cached {r['cached_fraction']} ttft p50 {r['ttft_p50_ms']} "
                    f"p99 {r['ttft_p99_ms']} ms (engine's p50 {r['engine_ttft_p50_ms']} p99 {r['engine_ttft_p99_ms']}, "
                    f"rest p50 {r['outside_engine_p50_ms']} p99 {r['outside_engine_p99_ms']}, way in p50 {r['way_in_p50_ms']} p99 {r['way_in_p99_ms']} mean {r['way_in_mean_ms']}, decision mean {r['decision_latency_mean_ms']} p50 ≤{r['decision_latency_p50_bucket_ms']}), "
                    f"gateway cpu {r['gateway_cpu_ms_per_request']} ms/req, {r['gateway_runs_per_request']} thread runs/req (idle {r['idle_cpu_ms_per_s']} ms/s each), per engine {'/'.join(map(str, r['per_engine']))} "
                    f"(max/mean {r['engine_max_over_mean']}), errors {r['errors']}, "
                    f"send late p99 {r['send_late_p99_ms']} ms, client cpu {r['client_cpu']}, "
                    f"load {r['loadavg_1m_before']}→{r['loadavg_1m']}, tiers {tiers}"
                    + (f", traffic {r['traffic']}" if "traffic" in r else "")
                    + (f", first error {r['first_error']}" if r["first_error"] else "")
                )
    finally:
        stop_all()

    print(report(args, rows))
    if args.json:
        doc = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "logs")}
            | {"engines": ENGINES, "bursts": len(s.bursts), "conversations": len(s.users),
               "client": CLIENT},
            "arms": {
                arm: {
                    "median": {
                        k: median(rs, k)
                        for k in ("cached_fraction", "ttft_p50_ms", "ttft_p99_ms", "latency_p50_ms",
                                  "latency_p99_ms", "engine_ttft_p50_ms", "engine_ttft_p99_ms",
                                  "outside_engine_p50_ms", "outside_engine_p99_ms",
                                  "engine_max_over_mean", "engine_min_over_mean",
                                  "gateway_cpu_ms_per_request", "idle_cpu_ms_per_s")
                    },
                    "runs": rs,
                }
                for arm, rs in rows.items() if rs
            },
        }
        if rows["one"] and rows["replicas"]:
            doc["verdicts"] = [
                {"target": w, "figure": f, "met": ok} for w, f, ok in verdicts(rows["one"], rows["replicas"])
            ]
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        log(f"JSON written to {args.json}")
    bad = sum(r["errors"] for rs in rows.values() for r in rs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
