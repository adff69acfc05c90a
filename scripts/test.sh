#!/usr/bin/env bash
# The one command that runs every check: toolchain version, formatting, lints, docs,
# all tests (unit, golden parity, property tests, fuzz-corpus replay, real-peer
# interop with pyzmq/msgspec, end-to-end over loopback). It prepares what it needs
# itself and ends with one `N passed, M failed` line over every test binary and
# doc-test.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> toolchain (rust-version from Cargo.toml)"
# The locked dependencies (kvroute-zeromq from zeromq 0.7, uuid 1.x) need this Rust; an older cargo
# fails deep in the build with a less helpful message. Clippy's incompatible_msrv
# lint (below) flags std APIs newer than it. KVROUTE_MSRV_CHECK=1 also compiles
# the workspace with exactly that toolchain (rustup; ~9 minutes on 2 cores, so not
# by default).
msrv=$(sed -n 's/^rust-version = "\([0-9.]*\)"/\1/p' Cargo.toml)
have=$(rustc --version | awk '{print $2}' | cut -d- -f1)
if [ -z "$msrv" ] || [ "$(printf '%s\n%s\n' "$msrv" "$have" | sort -V | head -n1)" != "$msrv" ]; then
  echo "!! rustc $have is older than the workspace's rust-version ${msrv:-?}: run \`rustup update stable\`" >&2
  exit 1
fi
echo "rustc $have >= rust-version $msrv"
if [ "${KVROUTE_MSRV_CHECK:-0}" = 1 ]; then
  rustup toolchain install "$msrv" --profile minimal
  CARGO_TARGET_DIR=target/msrv cargo "+$msrv" check --workspace --all-targets --locked
fi

echo "==> python peers (venv with pyzmq + msgspec)"
bash scripts/python-env.sh
# pingora-core (examples/embed_pingora) builds zlib-ng with cmake: use the venv's
# pinned one unless the caller chose another.
export CMAKE="${CMAKE:-$PWD/.venv/bin/cmake}"
"$CMAKE" --version | head -n1

echo "==> headless Chromium (Debian's chromium, for the HTML reports' render test)"
# examples/gateway/tests/html_reports.rs opens the demo's and the simulator's
# HTML reports in it and fails when it is missing; KVROUTE_CHROMIUM names
# another binary.
if [ -z "${KVROUTE_CHROMIUM:-}" ] && [ ! -x /usr/bin/chromium ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq chromium >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
  else
    echo "!! /usr/bin/chromium is missing: install Debian's chromium package (as root) or set KVROUTE_CHROMIUM" >&2
    exit 1
  fi
fi
"${KVROUTE_CHROMIUM:-/usr/bin/chromium}" --version

# A one-off full run gains nothing from incremental artifacts (several GB on disk);
# set CARGO_INCREMENTAL=1 to keep them for repeated local runs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# The full build (clippy, docs, ~150 test binaries, the outside crate) takes about
# 5 GB with incremental artifacts off. A fresh target directory must have
# KVROUTE_TEST_DISK_GB free: say so up front rather than fail deep inside a link
# with "No space left on device".
need_gb="${KVROUTE_TEST_DISK_GB:-8}"
target_dir="${CARGO_TARGET_DIR:-$PWD/target}"
mkdir -p "$target_dir"
free_gb=$(df -Pk "$target_dir" | awk 'NR == 2 { printf "%d", $4 / 1048576 }')
echo "==> disk: ${free_gb} GB free for $target_dir (a fresh build takes about 5 GB; at least ${need_gb} GB asked for)"
if [ "$free_gb" -lt "$need_gb" ] && [ ! -d "$target_dir/debug/deps" ]; then
  echo "!! only ${free_gb} GB free under $target_dir: free disk space (or set CARGO_TARGET_DIR elsewhere)" >&2
  exit 1
fi

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> cargo doc -D warnings"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

echo "==> cargo test"
log=$(mktemp "${TMPDIR:-/tmp}/kvroute-test.XXXXXX")
trap 'rm -f "$log"' EXIT
# --no-fail-fast: one failing binary must not hide the results of the others.
set +e
cargo test --workspace --locked --no-fail-fast 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
# kvroute as a dependency of a crate outside the workspace (no [patch]), against
# the `kvroute` binary the workspace run just built; the same target dir reuses
# the workspace's artifacts. Its results count in the summary below.
echo "==> cargo test --manifest-path tests/outside/Cargo.toml"
KVROUTE_BIN="$target_dir/debug/kvroute" CARGO_TARGET_DIR="$target_dir" \
  cargo test --locked --manifest-path tests/outside/Cargo.toml 2>&1 | tee -a "$log"
outside_status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ]; then status=$outside_status; fi
set -e
# One `test result:` line per test binary and per crate's doc-tests.
read -r binaries passed failed ignored < <(awk '
  /^test result:/ {
    n++
    for (i = 1; i <= NF; i++) {
      if ($(i+1) ~ /^passed;?$/) p += $i
      if ($(i+1) ~ /^failed;?$/) f += $i
      if ($(i+1) ~ /^ignored;?$/) g += $i
    }
  }
  END { printf "%d %d %d %d\n", n, p, f, g }' "$log")
echo
echo "==> $passed passed, $failed failed ($ignored ignored) over $binaries test binaries and doc-test runs"
if [ "$status" -ne 0 ] || [ "$failed" -ne 0 ]; then
  echo "!! cargo test failed (exit $status, $failed failed): see the output above" >&2
  exit 1
fi
if [ "$passed" -eq 0 ] || [ "$binaries" -eq 0 ]; then
  echo "!! no test ran: the summary above counted nothing" >&2
  exit 1
fi
