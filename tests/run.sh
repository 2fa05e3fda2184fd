#!/usr/bin/env bash
# The test command: builds the binaries the black-box tests run (the lattice
# CLI and the example hooks), then runs every test, doc tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --bins --examples --locked
cargo test --doc --workspace --locked
cargo nextest run --workspace --locked --no-fail-fast
