#!/usr/bin/env bash
# Run every cargo-fuzz target (or the ones named) for a fixed time each, on stable Rust.
#
#   bash scripts/fuzz.sh              # all targets, 600 s each
#   FUZZ_SECONDS=60 bash scripts/fuzz.sh vllm_events seq_window
#
# cargo-fuzz passes nightly-only flags (-Zsanitizer); RUSTC_BOOTSTRAP=1 lets the stable
# toolchain accept them. The committed seeds in fuzz/corpus/<target>/ are read but not written:
# new inputs that raise coverage go to fuzz/artifacts/grown/<target>/ (git-ignored; copy the
# interesting ones into the seed corpus, which `cargo test` replays). Crashes land in
# fuzz/artifacts/<target>/ and make this script exit non-zero.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
seconds=${FUZZ_SECONDS:-600}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
cargo fuzz build -O
failed=0
for t in "${targets[@]}"; do
  echo "== $t (${seconds}s)"
  # -max_len keeps inputs near real payload sizes; -rss_limit_mb bounds memory per input.
  mkdir -p "artifacts/grown/$t"
  if ! cargo fuzz run -O "$t" "artifacts/grown/$t" "corpus/$t" -- -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 \
       -print_final_stats=1 2>&1 | tail -n 25; then
    echo "!! $t found a failure: see fuzz/artifacts/$t/"
    failed=1
  fi
done
exit $failed
