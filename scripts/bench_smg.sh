#!/usr/bin/env bash
# kvroute (default KV-exact policy) vs SGLang Model Gateway `cache_aware`, both in
# front of the same 4 `kvroute mock-engine` processes on 127.0.0.1.
#
#   scripts/bench_smg.sh [--json FILE]
#
# Environment (defaults in brackets):
#   REQUESTS [2000]  chat requests per measurement (multi-turn conversations)
#   RUNS [3]         interleaved runs (kvroute, kvroute-embedded, smg, kvroute, ...); medians reported
#   ARMS [kvroute,kvroute-embedded,smg]  kvroute-embedded: the library alone (a KvRouter with
#                    the builder's defaults in the embedding example's axum proxy, embed_axum)
#   EMBED [next to KVROUTE]/embed_axum  its binary
#   CONCURRENCY [8,32]   MODES [nonstream,stream]
#   OUT              JSON output file (same as --json)
#   SMG_VERSION [1.13.0]  smg package installed into .venv-smg/
#   ENGINE flags: CAPACITY_BLOCKS [4096] MAX_RUNNING [64] PREFILL_US_PER_TOKEN [20]
#                 PREFILL_STEP_US [500] DECODE_US_PER_TOKEN [500] MAX_TOKENS [8]
#   BENCH_TIMEOUT [8100]  seconds the whole benchmark may take
#   SKIP_BUILD [0]   1: do not run cargo build, use target/release/kvroute as it is
#   KVROUTE [target/release/kvroute]  the binary to run (implies SKIP_BUILD=1 when set):
#                    a copy keeps one build for the whole run while others rebuild the tree
#   TRACE [0]        1: per-request traces (client, engines' request logs, CPU samples,
#                    kvroute's admin counters) in the log dir; scripts/bench_smg_trace.py reads them
#   LOGS             log directory (default: a new temp dir, printed at start)
#   KVROUTE_SCORER   a KV-exact scorer for kvroute's rule (default: none named = the default
#                    policy); e.g. longest_prefix to see what pure affinity does
#   KVROUTE_COST     [rules.cost] overrides for kvroute's rule, e.g. affinity_tokens=256
#
# Prints one markdown table per (concurrency, streaming). Exit 1 if any request failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source "$ROOT/scripts/bench_common.sh"

bench_parse_args 29 "$@"

VENV=$ROOT/.venv-smg
SMG_VERSION=${SMG_VERSION:-1.13.0}

# 1. venv with smg (ships its Rust gateway) and the load generator's client libs.
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('smg') != '$SMG_VERSION')" 2>/dev/null \
    || ! "$VENV/bin/python" -c "import aiohttp, uvloop" 2>/dev/null; then
    if ! timeout 900 "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "smg==$SMG_VERSION" "${BENCH_CLIENT_PACKAGES[@]}"; then
        echo "WARNING: smg==$SMG_VERSION is not installable here; using the newest smg that is" >&2
        timeout 900 "$VENV/bin/pip" install --quiet --disable-pip-version-check \
            smg "${BENCH_CLIENT_PACKAGES[@]}"
    fi
fi
echo "smg $("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('smg'))") in $VENV" >&2

# 2. the gateway binary (also the mock engine).
# SKIP_BUILD=1 uses the binary as it is (e.g. while the tree is mid-edit).
bench_kvroute "$ROOT/target/release/kvroute" kvroute-gateway kvroute-embed-axum
EMBED=${EMBED:-$(dirname "$KVROUTE")/embed_axum}
echo "kvroute binary: $KVROUTE ($(date -u -r "$KVROUTE" +%FT%TZ))" >&2

# 3. run; everything started below is killed on exit.
ARGS=(
    --kvroute "$KVROUTE" --smg "$VENV/bin/smg" --model-dir "$ROOT/golden/tokenizers/qwen3"
    --embed "$EMBED" --arms "${ARMS:-kvroute,kvroute-embedded,smg}"
    --requests "${REQUESTS:-2000}" --runs "${RUNS:-3}"
    --concurrency "${CONCURRENCY:-8,32}" --modes "${MODES:-nonstream,stream}"
    --capacity-blocks "${CAPACITY_BLOCKS:-4096}" --max-running "${MAX_RUNNING:-64}"
    --prefill-us-per-token "${PREFILL_US_PER_TOKEN:-20}" --prefill-step-us "${PREFILL_STEP_US:-500}"
    --decode-us-per-token "${DECODE_US_PER_TOKEN:-500}" --max-tokens "${MAX_TOKENS:-8}"
)
[ -n "$JSON_OUT" ] && ARGS+=(--json "$JSON_OUT")
[ "${TRACE:-0}" = 1 ] && ARGS+=(--trace)
[ -n "${LOGS:-}" ] && ARGS+=(--logs "$LOGS")
[ -n "${KVROUTE_SCORER:-}" ] && ARGS+=(--kvroute-scorer "$KVROUTE_SCORER")
[ -n "${KVROUTE_COST:-}" ] && ARGS+=(--kvroute-cost "$KVROUTE_COST")

bench_run bench_smg BENCH_SMG_PIDFILE "${BENCH_TIMEOUT:-8100}" \
    "$VENV/bin/python" "$ROOT/scripts/bench_smg.py" "${ARGS[@]}"
