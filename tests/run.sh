#!/usr/bin/env bash
# The test command. Builds what the black-box tests start — the lattice CLI
# and the example hooks, and static builds of lattice and the test peer for
# the container images (FROM scratch: no registry needed) — then runs every
# test, doc tests included. The container tests need a running Docker engine.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins --examples --locked
RUSTFLAGS='-C target-feature=+crt-static' cargo build --locked --target x86_64-unknown-linux-gnu \
  -p lattice-server --bin lattice -p lattice-tests --bin lattice-test-peer
cargo test --doc --workspace --locked
cargo nextest run --workspace --locked --no-fail-fast
