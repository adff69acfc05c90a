#!/usr/bin/env bash
# The one command that runs every check: formatting, lints, all tests (unit, golden
# parity, property tests, fuzz-corpus replay, real-peer interop with pyzmq/msgspec,
# end-to-end over loopback). It prepares what it needs itself.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> python peers (venv with pyzmq + msgspec)"
bash scripts/python-env.sh

echo "==> cargo fmt --check"
cargo fmt --all -- --check

echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "==> cargo test"
cargo test --workspace --locked
