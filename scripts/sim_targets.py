#!/usr/bin/env python3
"""The simulator targets for the default `kv-exact` policy, in one run.

For every `kvroute sim gen` kind and the Mooncake trace, 8 workers, at 262 144
and 4 194 304 tokens of KV capacity per worker, runs every policy and checks:
hit ratio >= 0.9 x the best policy's and >= 0.85 x the pooled bound; TTFT p50
and p99 <= rr, least-load and chwbl; time-averaged in-flight max/mean <= 1.3.
Prints one line per case and the peers' figures (hit% / p50 / p99 ms).

    cargo build --release -p kvroute-gateway
    python3 scripts/sim_targets.py [extra `kvroute sim run` flags]

KVROUTE names the binary, TRACE the Mooncake trace, OUT the JSON directory,
KINDS (comma-separated, e.g. rag,multiturn) restricts the cases, CAPS the
capacities.
Exits 0 whatever the verdict: it reports, the last line says ALL OK or not.
"""
import json,sys,subprocess,os,tempfile
import pathlib
ROOT=pathlib.Path(__file__).resolve().parent.parent
S=os.environ.get('KVROUTE', str(ROOT/'target/release/kvroute'))
TRACE=os.environ.get('TRACE', str(ROOT.parent/'shared/traces/mooncake_fast25_synthetic_trace.jsonl'))
extra=sys.argv[1:]
OUT=os.environ.get('OUT') or tempfile.mkdtemp(prefix='kvroute-sim-')
cases=[]
for kind in ['tenants','multiturn','rag','nosharing']:
    cases.append((kind,['--kind',kind]))
cases.append(('mooncake',['--trace',TRACE]))
if os.environ.get('KINDS'):
    keep=os.environ['KINDS'].split(',')
    cases=[c for c in cases if c[0] in keep]
allok=True
for cap in os.environ.get('CAPS','262144,4194304').split(','):
    for name,args in cases:
        out=os.path.join(OUT, f'{name}_{cap}.json')
        subprocess.run([S,'sim','run',*args,'--workers','8','--capacity-tokens',cap,'--policies','all','--json',out,*extra],stdout=subprocess.DEVNULL,check=True)
        r=json.load(open(out))
        P={p['policy']:p for p in r['policies']}
        k=P['kv-exact']
        best=max(p['prefix_hit_ratio'] for p in r['policies'])
        pooled=r['workload']['pooled_prefix_hit_ratio']
        fails=[]
        if k['prefix_hit_ratio']<0.9*best-1e-9: fails.append(f"hit {k['prefix_hit_ratio']:.3f}<0.9*best {best:.3f}")
        if k['prefix_hit_ratio']<0.85*pooled-1e-9: fails.append(f"hit<0.85*pooled {pooled:.3f}")
        for b in ['rr','least-load','chwbl']:
            for q in ['p50','p99']:
                if k['ttft_ms'][q]>P[b]['ttft_ms'][q]+1e-9: fails.append(f"{q} {k['ttft_ms'][q]:.0f}>{b} {P[b]['ttft_ms'][q]:.0f}")
        if k['load']['max_over_mean_in_flight']>1.3: fails.append(f"load {k['load']['max_over_mean_in_flight']:.2f}")
        allok &= not fails
        peers=' '.join(f"{n}:{P[n]['prefix_hit_ratio']*100:.1f}/{P[n]['ttft_ms']['p50']:.0f}/{P[n]['ttft_ms']['p99']:.0f}" for n in ['rr','least-load','chwbl','kv-overlap','dynamo-cost','smg-cache-aware','llmd-weighted'])
        print(f"{name:10} {cap:>8} kv-exact {k['prefix_hit_ratio']*100:.1f}% p50 {k['ttft_ms']['p50']:.0f} p99 {k['ttft_ms']['p99']:.0f} ld {k['load']['max_over_mean_in_flight']:.2f} pooled {pooled*100:.1f} | {'OK' if not fails else 'FAIL '+'; '.join(fails)}")
        print('     ', peers, flush=True)
print('ALL OK' if allok else 'SOME FAIL')
