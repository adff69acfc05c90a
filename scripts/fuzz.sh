#!/usr/bin/env bash
# Run every cargo-fuzz target (or the ones named) for a fixed time each, on stable Rust.
#
#   bash scripts/fuzz.sh              # all targets, 600 s each
#   FUZZ_SECONDS=60 bash scripts/fuzz.sh vllm_events seq_window
#
# cargo-fuzz is installed into .tools/ at the repo root (git-ignored), never into
# ~/.cargo/bin, pinned to the version this script was last run with. It passes
# nightly-only flags (-Zsanitizer); RUSTC_BOOTSTRAP=1 lets the stable toolchain
# accept them. Only the targets asked for are built. The committed seeds in
# fuzz/corpus/<target>/ are read but not written: new inputs that raise coverage go
# to fuzz/artifacts/grown/<target>/ (git-ignored; copy the interesting ones into the
# seed corpus, which `cargo test` replays). Crashes land in fuzz/artifacts/<target>/
# and make this script exit non-zero.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cargo_fuzz_version=0.13.2
tools="$root/.tools"
if ! "$tools/bin/cargo-fuzz" --version 2>/dev/null | grep -qx "cargo-fuzz $cargo_fuzz_version"; then
  echo "==> installing cargo-fuzz $cargo_fuzz_version into $tools"
  cargo install cargo-fuzz --version "$cargo_fuzz_version" --locked --root "$tools"
fi
export PATH="$tools/bin:$PATH"
cd "$root/fuzz"
export RUSTC_BOOTSTRAP=1
seconds=${FUZZ_SECONDS:-600}
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)
known=" $(cargo fuzz list | tr '\n' ' ') "
for t in "${targets[@]}"; do
  if [[ "$known" != *" $t "* ]]; then
    echo "!! unknown fuzz target '$t'; the targets are:$known" >&2
    exit 2
  fi
done
failed=0
for t in "${targets[@]}"; do
  echo "== $t (${seconds}s)"
  cargo fuzz build -O "$t"
  # -max_len keeps inputs near real payload sizes; -rss_limit_mb bounds memory per input.
  mkdir -p "artifacts/grown/$t"
  if ! cargo fuzz run -O "$t" "artifacts/grown/$t" "corpus/$t" -- -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 \
       -print_final_stats=1 2>&1 | tail -n 25; then
    echo "!! $t found a failure: see fuzz/artifacts/$t/"
    failed=1
  fi
done
exit $failed
