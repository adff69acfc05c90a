#!/usr/bin/env python3
"""The default policy as the fleet grows: workers × gateway replicas, in one run.

For 8, 32, 128 and 256 workers and 1, 2, 4, 8 and 16 replicas (default 1 ms
replica sync, 100 ms engine polls), replays the bursty `chat-bursts` workload
with arrivals sped up in proportion to the workers (`--time-scale 8/W`, so
every fleet carries the same load per worker) under `kv-exact`, and prints
per cell: hit %, TTFT mean and p99 (ms), the mean as a multiple of one
replica's, the replicas' sync traffic per request (messages and bytes as the
NATS transport encodes them; each message reaches every other replica), and
the simulator's own wall time and peak memory.

    cargo build --release -p kvroute-gateway
    python3 scripts/sim_scale.py

KVROUTE names the binary, REQUESTS the workload size (default 4000), WORKERS
and REPLICAS the comma-separated sizes, OUT the JSON directory. With COMPARE
naming policies (e.g. `kv-exact,rr,least-load,chwbl,dynamo-cost`), it prints
instead one row per fleet with each policy's hit %, TTFT mean and p99, all
from one run of the same arrivals.
"""
import json, os, pathlib, resource, subprocess, sys, tempfile, time

ROOT = pathlib.Path(__file__).resolve().parent.parent
S = os.environ.get('KVROUTE', str(ROOT / 'target/release/kvroute'))
OUT = os.environ.get('OUT') or tempfile.mkdtemp(prefix='kvroute-scale-')
os.makedirs(OUT, exist_ok=True)
REQUESTS = os.environ.get('REQUESTS', '4000')
workers = [int(w) for w in os.environ.get('WORKERS', '8,32,128,256').split(',')]
replicas = [int(r) for r in os.environ.get('REPLICAS', '1,2,4,8,16').split(',')]

COMPARE = os.environ.get('COMPARE')
if COMPARE:
    names = COMPARE.split(',')
    print('| workers | replicas | ' + ' | '.join(f'{n}: hit % · mean · p99' for n in names) + ' |')
    print('|---|---|' + '---|' * len(names))
    for w in workers:
        for r in replicas:
            out = os.path.join(OUT, f'cmp_w{w}_r{r}.json')
            subprocess.run([S, 'sim', 'run', '--kind', 'chat-bursts', '--requests', REQUESTS,
                            '--workers', str(w), '--time-scale', repr(8 / w), '--replicas', str(r),
                            '--policies', COMPARE, '--json', out],
                           stdout=subprocess.DEVNULL, check=True)
            by = {p['policy']: p for p in json.load(open(out))['policies']}
            cells = [f"{100 * by[n]['prefix_hit_ratio']:.1f} · {by[n]['ttft_ms']['mean']:.0f} · {by[n]['ttft_ms']['p99']:.0f}"
                     for n in names]
            print(f"| {w} | {r} | " + ' | '.join(cells) + ' |', flush=True)
    sys.exit(0)

print('| workers | replicas | hit % | TTFT mean ms | TTFT p99 ms | mean ÷ 1 replica | sync msgs / request | sync bytes / request | sim wall s | sim peak MiB |')
print('|---|---|---|---|---|---|---|---|---|---|')
for w in workers:
    base = None
    for r in replicas:
        out = os.path.join(OUT, f'w{w}_r{r}.json')
        t0 = time.monotonic()
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        subprocess.run([S, 'sim', 'run', '--kind', 'chat-bursts', '--requests', REQUESTS,
                        '--workers', str(w), '--time-scale', repr(8 / w), '--replicas', str(r),
                        '--policies', 'kv-exact', '--json', out],
                       stdout=subprocess.DEVNULL, check=True)
        wall = time.monotonic() - t0
        # ru_maxrss of children is the largest child so far: report it only when it grew.
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        p = json.load(open(out))['policies'][0]
        mean, p99 = p['ttft_ms']['mean'], p['ttft_ms']['p99']
        if base is None:
            base = mean
        sync = p['replica_sync']
        served = max(p['served'], 1)
        print(f"| {w} | {r} | {100 * p['prefix_hit_ratio']:.1f} | {mean:.0f} | {p99:.0f} | {mean / base:.2f} "
              f"| {sync['messages'] / served:.2f} | {sync['per_decision_bytes']:.0f} | {wall:.1f} "
              f"| {peak // 1024 if peak > before else '≤ ' + str(peak // 1024)} |", flush=True)
