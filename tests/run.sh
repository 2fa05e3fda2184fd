#!/usr/bin/env bash
# The test command. Installs what the tests need and the machine lacks
# (tests/setup.sh: Debian packages, a Python virtual environment in .venv),
# builds what the black-box tests start — the lattice CLI and the example
# hooks, and static builds of lattice and the test peer for the container
# images (FROM scratch: no registry needed) — then runs every test, doc tests
# included. The container tests need a running Docker engine; the session
# tests start a throw-away PostgreSQL cluster in $TMPDIR/lattice-test-pg,
# which is stopped here at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tests/setup.sh
# grpcurl, the Python hook's packages: the virtual environment's, first.
PATH="$PWD/.venv/bin:$PATH"
export PATH
# A build from scratch gains nothing from incremental caches; they would only
# take disk (over a gigabyte for this workspace).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
target_dir="${CARGO_TARGET_DIR:-target}"
report_disk() {
  echo "disk: $(du -sh "$target_dir" 2>/dev/null | cut -f1) in $target_dir, $(df -h --output=avail . | tail -1 | tr -d ' ') free"
}
pg_cluster="${TMPDIR:-/tmp}/lattice-test-pg/cluster/data"
stop_postgres() {
  if [ -d "$pg_cluster" ]; then
    pg_ctl=$(ls -d /usr/lib/postgresql/*/bin/pg_ctl 2>/dev/null | sort | tail -1)
    [ -n "$pg_ctl" ] && runuser -u postgres -- "$pg_ctl" -D "$pg_cluster" -m fast stop >/dev/null 2>&1 || true
  fi
}
trap 'stop_postgres; report_disk' EXIT
# The tests' scratch directories (lattice_tests::temp_dir): removed when
# every test passed, kept after a failure.
scratch="${TMPDIR:-/tmp}/lattice-tests"
rm -rf "$scratch"
cargo build --workspace --bins --examples --locked
RUSTFLAGS='-C target-feature=+crt-static' cargo build --locked --target x86_64-unknown-linux-gnu \
  -p lattice-server --bin lattice -p lattice-tests --bin lattice-test-peer
cargo test --doc --workspace --locked
if cargo nextest run --workspace --locked --no-fail-fast; then
  rm -rf "$scratch"
else
  status=$?
  [ -d "$scratch" ] && echo "the tests' scratch files are kept in $scratch"
  exit "$status"
fi
