#!/usr/bin/env python3
"""Burst ordering in the simulator: one gateway deciding each burst with the
requests that have a home first (the default, `--burst-order-ms` 1) against
deciding it in arrival order (`--burst-order-ms 0`), in one run.

For the bursty kinds (chat-bursts with the reference trace's 12 031 requests,
agent-bursts), every other `kvroute sim gen` kind and the Mooncake synthetic
trace (plus any trace named in TRACES), 8 workers, at 4 194 304 and 262 144
tokens of KV per worker, runs `kv-exact` both ways on the same arrivals and
prints per case, capacity and seed: hit %, TTFT mean / p50 / p99 (ms) in
arrival order, the same with the ordering, and the ordered figures as
multiples of the arrival-order ones. The last lines give, per kind, the
range of those multiples over the seeds.

    cargo build --release -p kvroute-gateway
    python3 scripts/sim_bursts.py [extra `kvroute sim run` flags]

KVROUTE names the binary, TRACE the Mooncake trace, TRACES more traces
(name=path,...), CASES (comma-separated names) restricts the cases, CAPS the
capacities, SEEDS the seeds (default 1,2,3), REPLICAS the replica count
(default 1), JOBS the simulations run at once (default 2; simulated time, so
the figures do not depend on it), OUT the JSON directory.
"""
import concurrent.futures, json, os, pathlib, subprocess, sys, tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
S = os.environ.get('KVROUTE', str(ROOT / 'target/release/kvroute'))
TRACE = os.environ.get('TRACE', str(ROOT.parent / 'shared/traces/mooncake_fast25_synthetic_trace.jsonl'))
OUT = os.environ.get('OUT') or tempfile.mkdtemp(prefix='kvroute-bursts-')
os.makedirs(OUT, exist_ok=True)
extra = sys.argv[1:]

cases = [
    ('chat-bursts', ['--kind', 'chat-bursts', '--requests', '12031'], True),
    ('agent-bursts', ['--kind', 'agent-bursts'], True),
]
for kind in ['tenants', 'multiturn', 'rag', 'nosharing']:
    cases.append((kind, ['--kind', kind], True))
# A trace is one workload: it does not vary with the seed.
cases.append(('mooncake', ['--trace', TRACE], False))
for item in filter(None, os.environ.get('TRACES', '').split(',')):
    name, path = item.split('=', 1)
    cases.append((name, ['--trace', path], False))
if os.environ.get('CASES'):
    keep = os.environ['CASES'].split(',')
    cases = [c for c in cases if c[0] in keep]
seeds = os.environ.get('SEEDS', '1,2,3').split(',')
caps = os.environ.get('CAPS', '4194304,262144').split(',')
replicas = os.environ.get('REPLICAS', '1')
pool = concurrent.futures.ThreadPoolExecutor(max_workers=int(os.environ.get('JOBS', '2')))


def run(args, cap, order, tag):
    out = os.path.join(OUT, f'{tag}_{cap}_o{order}.json')
    subprocess.run([S, 'sim', 'run', *args, '--workers', '8', '--capacity-tokens', cap,
                    '--replicas', replicas, '--policies', 'kv-exact',
                    '--burst-order-ms', order, '--json', out, *extra],
                   stdout=subprocess.DEVNULL, check=True)
    return json.load(open(out))['policies'][0]


jobs = []
for name, args, seeded in cases:
    for seed in (seeds if seeded else seeds[:1]):
        tag = f'{name}@{seed}' if seeded else name
        a = args + (['--seed', seed] if seeded else [])
        for cap in caps:
            jobs.append((name, tag, cap,
                         pool.submit(run, a, cap, '0', tag),
                         pool.submit(run, a, cap, '1', tag)))


def figs(p):
    t = p['ttft_ms']
    return 100 * p['prefix_hit_ratio'], t['mean'], t['p50'], t['p99']


print(f'{"case":16} {"cap":>8} | {"arrival order: hit% mean p50 p99":>34} | '
      f'{"homes first: hit% mean p50 p99":>34} | mean  p50  p99 (x arrival)')
ranges = {}
for name, tag, cap, off, on in jobs:
    a, b = figs(off.result()), figs(on.result())
    ratio = [b[i] / a[i] if a[i] else 1.0 for i in (1, 2, 3)]
    print(f'{tag:16} {cap:>8} | {a[0]:6.1f} {a[1]:7.0f} {a[2]:6.0f} {a[3]:7.0f}       | '
          f'{b[0]:6.1f} {b[1]:7.0f} {b[2]:6.0f} {b[3]:7.0f}       | '
          f'{ratio[0]:.2f} {ratio[1]:.2f} {ratio[2]:.2f}')
    r = ranges.setdefault((name, cap), [[9, 0], [9, 0], [9, 0]])
    for i, x in enumerate(ratio):
        r[i] = [min(r[i][0], x), max(r[i][1], x)]
print()
print('per kind and capacity, homes first x arrival order over the seeds: mean, p50, p99')
for (name, cap), r in ranges.items():
    print(f'{name:16} {cap:>8} | ' + '  '.join(f'{lo:.2f}-{hi:.2f}' for lo, hi in r))
