#!/usr/bin/env python3
"""The default policy with gateway replicas, in one run.

For the bursty kinds (chat-bursts with the reference trace's 12 031 requests,
agent-bursts), every other `kvroute sim gen` kind and the Mooncake synthetic
trace (plus any trace named in TRACES), 8 workers, at 4 194 304 and 262 144
tokens of KV per worker, runs `kv-exact` and the peers (`dynamo-cost`,
`smg-cache-aware`, `llmd-weighted`) with 1, 2, 4 and 8 replicas (default
1 ms replica sync) and checks, for 2, 4 and 8 replicas:

* kv-exact's TTFT mean and p99 <= 1.10 x its own single-replica figures;
* kv-exact's TTFT mean and p99 <= the best peer's at the same replica count
  (the peers reading the engines' gauges at their own scrape interval, the
  simulator's default `--peer-poll-ms`);
* kv-exact's hit ratio >= 0.95 x its single-replica hit ratio.

With BASE naming another `kvroute` binary, it also checks that kv-exact's
single-replica figures are within 2 % of that binary's.

    cargo build --release -p kvroute-gateway
    python3 scripts/sim_replicas.py [extra `kvroute sim run` flags]

KVROUTE names the binary, TRACE the Mooncake trace, TRACES more traces
(name=path,...), OUT the JSON directory, CASES (comma-separated names)
restricts the cases, CAPS the capacities, REPLICAS the replica counts, SEEDS
the seeds (comma-separated, default 1: the generators' workload and the
rule's random selectors; each other seed adds a case `name@seed`), JOBS
the simulations run at once (default 2; simulated time, so the figures do not
depend on it), EXACT_PEERS=0 skips the peers' runs with exact gauges.
Prints one table row per case, capacity and replica count: kv-exact's hit %,
TTFT mean / p99 (ms) and ratio to one replica, the best peer's mean / p99,
the best peer's mean / p99 when it reads every engine's gauges exactly at
each decision (`--peer-poll-ms 0`, which no scrape can do; not part of the
verdict), and the verdict. Exits 0 whatever the verdict; the last line says ALL OK or
how many cells missed.
"""
import concurrent.futures, json, os, pathlib, subprocess, sys, tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
S = os.environ.get('KVROUTE', str(ROOT / 'target/release/kvroute'))
BASE = os.environ.get('BASE')
TRACE = os.environ.get('TRACE', str(ROOT.parent / 'shared/traces/mooncake_fast25_synthetic_trace.jsonl'))
OUT = os.environ.get('OUT') or tempfile.mkdtemp(prefix='kvroute-replicas-')
os.makedirs(OUT, exist_ok=True)
PEERS = ['dynamo-cost', 'smg-cache-aware', 'llmd-weighted']
extra = sys.argv[1:]

cases = [
    ('chat-bursts', ['--kind', 'chat-bursts', '--requests', '12031']),
    ('agent-bursts', ['--kind', 'agent-bursts']),
]
for kind in ['tenants', 'multiturn', 'rag', 'nosharing']:
    cases.append((kind, ['--kind', kind]))
cases.append(('mooncake', ['--trace', TRACE]))
for item in filter(None, os.environ.get('TRACES', '').split(',')):
    name, path = item.split('=', 1)
    cases.append((name, ['--trace', path]))
if os.environ.get('CASES'):
    keep = os.environ['CASES'].split(',')
    cases = [c for c in cases if c[0] in keep]
seeds = os.environ.get('SEEDS', '1').split(',')
cases = [(name if seed == '1' else f'{name}@{seed}', args + ['--seed', seed])
         for name, args in cases for seed in seeds]
caps = os.environ.get('CAPS', '4194304,262144').split(',')
replicas = [int(r) for r in os.environ.get('REPLICAS', '1,2,4,8').split(',')]
exact_peers = os.environ.get('EXACT_PEERS', '1') != '0'
pool = concurrent.futures.ThreadPoolExecutor(max_workers=int(os.environ.get('JOBS', '2')))


def run(binary, args, cap, r, policies, tag, more=()):
    out = os.path.join(OUT, f'{tag}_{cap}_r{r}.json')
    subprocess.run([binary, 'sim', 'run', *args, '--workers', '8', '--capacity-tokens', cap,
                    '--replicas', str(r), '--policies', ','.join(policies), '--json', out,
                    *more, *extra],
                   stdout=subprocess.DEVNULL, check=True)
    return {p['policy']: p for p in json.load(open(out))['policies']}


def submit(*a, **k):
    return pool.submit(run, *a, **k)


def fig(p):
    return p['prefix_hit_ratio'], p['ttft_ms']['mean'], p['ttft_ms']['p99']


print(f"{'case':12} {'cap':>8} {'rep':>3} | {'hit%':>5} {'mean':>6} {'p99':>6} {'x1 mean':>7} {'x1 p99':>6} | "
      f"{'peer mean':>9} {'peer p99':>8} | {'exact mean':>10} {'exact p99':>9} | verdict", flush=True)
missed = 0
cells = 0
# Every simulation up front (they are independent), read in table order.
jobs = {}
for cap in caps:
    for name, args in cases:
        for r in replicas:
            jobs[cap, name, r] = submit(S, args, cap, r, ['kv-exact'] + PEERS, name)
            if exact_peers:
                jobs[cap, name, r, 'exact'] = submit(S, args, cap, r, PEERS, name + '_exact',
                                                     more=('--peer-poll-ms', '0'))
for cap in caps:
    for name, args in cases:
        single = None
        for r in replicas:
            P = jobs[cap, name, r].result()
            hit, mean, p99 = fig(P['kv-exact'])
            best_mean = min(P[p]['ttft_ms']['mean'] for p in PEERS)
            best_p99 = min(P[p]['ttft_ms']['p99'] for p in PEERS)
            exact = '%10s %9s' % ('-', '-')
            if exact_peers:
                E = jobs[cap, name, r, 'exact'].result()
                exact = '%10.0f %9.0f' % (min(E[p]['ttft_ms']['mean'] for p in PEERS),
                                          min(E[p]['ttft_ms']['p99'] for p in PEERS))
            fails = []
            if r == 1:
                single = (hit, mean, p99)
                if BASE:
                    b = fig(run(BASE, args, cap, 1, ['kv-exact'], name + '_base')['kv-exact'])
                    for label, new, old in zip(['hit', 'mean', 'p99'], single, b):
                        if abs(new - old) > 0.02 * old + 1e-9:
                            fails.append(f'{label} {new:.3f} vs base {old:.3f}')
                ratio = ''
            else:
                h1, m1, q1 = single
                if mean > 1.10 * m1 + 1e-9:
                    fails.append('mean>1.1x')
                if p99 > 1.10 * q1 + 1e-9:
                    fails.append('p99>1.1x')
                if mean > best_mean + 1e-9:
                    fails.append('mean>peer')
                if p99 > best_p99 + 1e-9:
                    fails.append('p99>peer')
                if hit < 0.95 * h1 - 1e-9:
                    fails.append('hit<0.95x')
                ratio = f'{mean / m1:7.2f} {p99 / q1:6.2f}'
            if r > 1 or BASE:
                cells += 1
                missed += bool(fails)
            verdict = ('OK' if not fails else 'MISS ' + ', '.join(fails)) if (r > 1 or BASE) else '(reference)'
            if not ratio:
                ratio = f"{'':7} {'':6}"
            print(f'{name:12} {cap:>8} {r:>3} | {hit * 100:5.1f} {mean:6.0f} {p99:6.0f} {ratio} | '
                  f'{best_mean:9.0f} {best_p99:8.0f} | {exact} | {verdict}', flush=True)
print('ALL OK' if not missed else f'{missed} of {cells} cells missed')
