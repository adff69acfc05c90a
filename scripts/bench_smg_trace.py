#!/usr/bin/env python3
"""Reads the per-request traces `scripts/bench_smg.sh` writes with TRACE=1 and
explains a cell: where each gateway's cached tokens went, and what the slowest
requests waited for.

    scripts/bench_smg_trace.py LOGDIR [--cell r0-c32-n]

For every measurement pair (kvroute and smg of the same run and cell, same
workload) it prints:

* the per-engine split and the cached fraction;
* a decomposition of the prompt tokens that were *not* served from cache, per
  request class: a conversation's first turn (its tenant's system prompt: cold if
  that engine had not served the tenant before), a later turn on the engine of
  the previous turn (a shortfall there is the engine having evicted the
  conversation), a later turn moved to another engine (the conversation's
  history is recomputed there);
* kvroute's predicted vs delivered cached tokens (from its /admin/endpoints):
  prediction above delivery means routing on blocks the engine no longer held;
* for the slowest 1 %: the engine's own share of the latency (queue, prefill,
  decode from the mock's request log), the rest (gateway, client, scheduling),
  the machine's CPU busy fraction and runnable tasks while they ran, and how
  many requests each engine held when they were sent.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path

BLOCK = 16


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def classify(doc: dict) -> list[dict]:
    """Each request with its class and the cached tokens it could have had."""
    reqs = sorted(doc["requests"], key=lambda r: r["t"])
    by_conv: dict[int, dict[int, dict]] = defaultdict(dict)
    for r in reqs:
        by_conv[r["conv"]][r["turn"]] = r
    seen_tenant: set[tuple[int, int]] = set()
    out = []
    for r in reqs:
        prev = by_conv[r["conv"]].get(r["turn"] - 1)
        if r["turn"] == 0 or prev is None:
            cls = "first turn, tenant warm" if (r["tenant"], r["engine"]) in seen_tenant else "first turn, tenant cold"
            # The system prompt's share is not known here; compare with the other gateway.
            expect = None
        else:
            # The new prompt starts with the whole previous prompt (its generation
            # prompt included); the engine reuses its full blocks, minus the
            # last token vLLM always recomputes.
            expect = min(prev["prompt_tokens"] // BLOCK, (r["prompt_tokens"] - 1) // BLOCK) * BLOCK
            cls = "later turn, same engine" if prev["engine"] == r["engine"] else "later turn, moved"
        seen_tenant.add((r["tenant"], r["engine"]))
        out.append(r | {"class": cls, "expect": expect})
    return out


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[max(1, min(len(s), -(-int(p * len(s)) // 100))) - 1]


def cache_report(name: str, doc: dict, rows: list[dict]) -> None:
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    split = Counter(r["engine"] for r in rows)
    print(f"\n#### {name}: cached {cached}/{prompt} = {cached / prompt:.4f}; "
          f"per engine {'/'.join(str(split[i]) for i in sorted(split))}")
    print("| class | requests | prompt tokens | uncached tokens | shortfall vs previous prompt (requests, tokens) |")
    print("|---|---:|---:|---:|---:|")
    by = defaultdict(list)
    for r in rows:
        by[r["class"]].append(r)
    for cls in sorted(by):
        rs = by[cls]
        short = [(r["expect"] - r["cached_tokens"]) for r in rs if r["expect"] is not None and r["cached_tokens"] < r["expect"]]
        short_s = f"{len(short)}, {sum(short)}" if any(r["expect"] is not None for r in rs) else "–"
        print(f"| {cls} | {len(rs)} | {sum(r['prompt_tokens'] for r in rs)} "
              f"| {sum(r['prompt_tokens'] - r['cached_tokens'] for r in rs)} | {short_s} |")
    eps = doc.get("admin_endpoints")
    if isinstance(eps, dict):
        eps = eps.get("endpoints")
    if eps:
        pred = [e.get("predicted_cached_tokens", 0) for e in eps]
        dlv = [e.get("delivered_cached_tokens", 0) for e in eps]
        print(f"kvroute predicted / delivered cached tokens per endpoint: "
              f"{'/'.join(map(str, pred))} vs {'/'.join(map(str, dlv))}")
    cnt = doc.get("admin_counters", {}).get("rules")
    if cnt:
        for rule, c in cnt.items():
            print(f"kvroute counters {rule}: tiers {c.get('tiers')} load_diversions {c.get('load_diversions')} "
                  f"retries {c.get('retries')} misses {{{', '.join(f'{k}: {v}' for k, v in c.get('misses', {}).items() if v)}}}")


def pair_report(a: list[dict], b: list[dict], na: str, nb: str) -> None:
    """Per-(conversation, turn) difference in cached tokens, by a's class."""
    bk = {(r["conv"], r["turn"]): r for r in b}
    diff = defaultdict(lambda: [0, 0, 0])  # requests less, tokens less, tokens more
    for r in a:
        o = bk.get((r["conv"], r["turn"]))
        if o is None:
            continue
        d = o["cached_tokens"] - r["cached_tokens"]
        if d > 0:
            diff[r["class"]][0] += 1
            diff[r["class"]][1] += d
        elif d < 0:
            diff[r["class"]][2] += -d
    print(f"\n{na} vs {nb}, same (conversation, turn), by {na}'s class:")
    print(f"| {na} class | requests where {na} cached less | tokens {na} cached less | tokens {na} cached more | net |")
    print("|---|---:|---:|---:|---:|")
    for cls in sorted(diff):
        n, less, more = diff[cls]
        print(f"| {cls} | {n} | {less} | {more} | {more - less:+d} |")


def tail_report(name: str, doc: dict, rows: list[dict]) -> None:
    eng = {r["id"]: r for r in doc.get("engine_requests", [])}
    lat = [r["latency_ms"] for r in rows]
    p99 = pct(lat, 99)
    slow = [r for r in rows if r["latency_ms"] >= p99]
    samples = doc.get("cpu_samples", [])
    st = [s[0] for s in samples]

    def cpu_during(t0: float, t1: float) -> tuple[float, float]:
        i, j = bisect.bisect_left(st, t0), bisect.bisect_right(st, t1 + 0.05)
        w = samples[i:j]
        if not w:
            return float("nan"), float("nan")
        return statistics.mean(s[1] for s in w), statistics.mean(s[2] for s in w)

    # Requests in flight per engine at time t, from the client's view.
    spans = [(r["t"], r["t"] + r["latency_ms"] / 1e3, r["engine"]) for r in rows]

    def held(t: float) -> list[int]:
        n = [0] * 4
        for s0, s1, e in spans:
            if s0 < t < s1 and 0 <= e < 4:
                n[e] += 1
        return n

    def split(r: dict) -> tuple[float, float, float, float]:
        e = eng.get(r["id"])
        if not e:
            return (float("nan"),) * 4
        q = e["admitted_us"] / 1e3
        ft = e["first_token_us"] / 1e3
        fin = e["finish_us"] / 1e3
        return q, ft - q, fin - ft, r["latency_ms"] - fin

    allsplit = [split(r) for r in rows]
    cpu = doc.get("cpu_seconds", {})
    wall = doc.get("wall_s", 0) or 1
    if cpu:
        total = cpu.get("gateway", 0) + sum(cpu.get("engines", [])) + cpu.get("client", 0)
        print(f"CPU over the run ({wall:.1f} s): gateway {cpu.get('gateway', 0) / wall:.2f} cores, "
              f"engines {'/'.join(f'{c / wall:.2f}' for c in cpu.get('engines', []))}, "
              f"client {cpu.get('client', 0) / wall:.2f}; sum {total / wall:.2f} of 2 cores; "
              f"machine busy {statistics.mean(s[1] for s in samples) if samples else float('nan'):.2f}")
    med = [statistics.median(x[k] for x in allsplit if x[k] == x[k]) for k in range(4)] if eng else [0] * 4
    print(f"{name}: p99 {p99:.1f} ms; median split queue {med[0]:.1f} / prefill {med[1]:.1f} / decode {med[2]:.1f} "
          f"/ outside the engine {med[3]:.1f} ms")
    print("| t s | engine | latency ms | engine queue | prefill (incl. wait) | decode | outside engine | "
          "running at submit | cached/prompt | held per engine at send | CPU busy | runnable |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in sorted(slow, key=lambda r: -r["latency_ms"])[:25]:
        q, pf, dec, out = split(r)
        e = eng.get(r["id"], {})
        busy, runq = cpu_during(r["t"], r["t"] + r["latency_ms"] / 1e3)
        print(f"| {r['t']:.3f} | {r['engine']} | {r['latency_ms']:.1f} | {q:.1f} | {pf:.1f} | {dec:.1f} | {out:.1f} "
              f"| {e.get('running_at_submit', '?')} | {r['cached_tokens']}/{r['prompt_tokens']} "
              f"| {'/'.join(map(str, held(r['t'])))} | {busy:.2f} | {runq:.1f} |")
    outs = [x[3] for x in allsplit if x[3] == x[3]]
    if outs:
        print(f"outside-engine time: p50 {pct(outs, 50):.1f} p99 {pct(outs, 99):.1f} max {max(outs):.1f} ms; "
              f"engine time (finish): p50 {pct([x[0] + x[1] + x[2] for x in allsplit if x[0] == x[0]], 50):.1f} "
              f"p99 {pct([x[0] + x[1] + x[2] for x in allsplit if x[0] == x[0]], 99):.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdir", type=Path)
    ap.add_argument("--cell", help="only this tag, e.g. r0-c32-n")
    ap.add_argument("--no-tail", action="store_true", help="skip the slowest-1 %% tables")
    args = ap.parse_args()
    tags = sorted({p.name.split("-", 2)[2][:-5] for p in args.logdir.glob("trace-*-*.json")})
    if args.cell:
        tags = [t for t in tags if t == args.cell]
    if not tags:
        print(f"no trace-*.json in {args.logdir} (run bench_smg.sh with TRACE=1)", file=sys.stderr)
        return 1
    for tag in tags:
        print(f"\n### {tag}")
        docs = {}
        for gw in ("kvroute", "smg"):
            p = args.logdir / f"trace-{gw}-{tag}.json"
            if p.exists():
                docs[gw] = load(p)
        rows = {gw: classify(d) for gw, d in docs.items()}
        for gw, d in docs.items():
            cache_report(gw, d, rows[gw])
        if len(rows) == 2:
            pair_report(rows["kvroute"], rows["smg"], "kvroute", "smg")
        if not args.no_tail:
            for gw, d in docs.items():
                print()
                tail_report(gw, d, rows[gw])
    return 0


if __name__ == "__main__":
    sys.exit(main())
